#!/usr/bin/env bash
# Run pdkv's GPU tier on an offline GPU host from the bundle scripts/gpu/pack.sh made, and write a summary.
#
# Usage (from the repository root): bash scripts/gpu/run.sh BUNDLE_DIR [WORK]
#   BUNDLE_DIR  the folder holding bundle.tgz.* and bundle.sha256
#   WORK        where the bundle unpacks and the model's weights are written (default /tmp/pdkv-gpu); kept, so
#               a second run on the same host skips both
# Environment:
#   OUT     the few result files (summary.txt, the test logs, gpu_pd.json, digest.txt); default WORK/out. The
#           engines' logs, `pdkv up`'s events and the rest go to WORK/aux; digest.txt quotes what matters of them.
#   STEPS   any of "bench tests transport writes forward profile check kill", run in the order named (default "bench tests
#           transport kill"); kill last: the deployments' P restart after it. transport: tests/gpu but the
#           deployment tests, which allocate GPU memory of their own (two D processes of 4.75 GB of KV each in
#           test_ipc_concurrency): on an 80 GB H100 with two deployments up (71.7 GB) run them with no engine up,
#           PREPARE_ONLY=1 STEPS=transport. writes: `pdkv bench` of the ipc and socket writes alone (part of bench
#           too; no engine needed: PREPARE_ONLY=1 WEIGHTS=0 STEPS=writes sweeps the socket settings on a bare host,
#           SOCKET_LAYOUT=scattered for the layout the deployments' blocks take). forward (no engine either):
#           benchmarks/socket_forward_gpu.py, what a socket write beside P's forward costs that forward, once per
#           FORWARD_CONNECTIONS (default "0 1": the transport's default, then one connection), into
#           OUT/forward-N.json. profile: `pdkv profile` of the ipc
#           deployment's P and D into OUT/qwen3-8b.profile.json, then `pdkv plan --slo` of the seed's
#           workload on it; check (after profile): benchmarks/planner_check.py, the planner's predicted TTFT
#           of that P against the measured one at 30% and 70% load; wake: benchmarks/engine_wake.py, that P's time
#           for a prompt against how long it was idle before it.
#   ROUNDS  the benchmark's timed rounds (default 10).
#   BASELINE  the deployment gpu_pd.py's ratios are to (default mooncake-tcp), e.g. BASELINE=pdkv-socket with
#           DEPLOYMENTS="pdkv-socket pdkv-socket-layers" on an 80 GB H100, where a third deployment does not fit.
#   BENCH_WRITES=0  the bench step runs gpu_pd.py alone, not `pdkv bench` of the ipc and socket writes (a second
#           bench step on the same host, another pair of deployments).
#   SOCKET_CONNECTIONS, SOCKET_BUFFERS  the bench step's socket write once per pair of values: P's connections to D
#           (default "0": the transport's default, the worker's cores at most 4) and each connection's socket buffers
#           in bytes ("default": the transport's 96 KiB; 0: the kernel's autotuning), e.g. SOCKET_CONNECTIONS="4 8"
#           SOCKET_BUFFERS="default 0 1048576" to see what a many-core host wants (pdkv bench --connections,
#           --socket-buffer). PDKV_GPU_SOCKET_CONNECTIONS / PDKV_GPU_SOCKET_BUFFER give the socket deployments the
#           setting that measurement chose (tests/gpu/deployments.py); PDKV_GPU_SOCKET_LAYER_GROUPS the writes
#           pdkv-socket-layers' P cuts a forward's layers into (socket_layer_groups; 36: one a layer of Qwen3-8B);
#           PDKV_GPU_SOCKET_SEND_PROCESS=false their P's writes from its own threads (socket_send_process).
#   DEPLOYMENTS  which of tests/gpu/deployments.py to start and test (default pdkv-ipc pdkv-tcp mooncake-tcp:
#           three fit one H200; pdkv-socket is the fourth, e.g. DEPLOYMENTS="pdkv-ipc pdkv-socket mooncake-tcp");
#           profile and check need pdkv-ipc alone, bench mooncake-tcp. pdkv-socket-layers is pdkv-socket with P
#           writing a group of layers at a time as its forward computes them (socket_write_layers, the connector's
#           default on a GPU; pdkv-socket sets it false): DEPLOYMENTS="mooncake-tcp pdkv-socket pdkv-socket-layers"
#           measures it beside the one write after P's forward (gpu_pd.py's table).
#   PDKV_GPU_GRAPHS  "full-decode" (the default) or "eager": tests/gpu/deployments.py.
#   PDKV_GPU_DECODE_SCHEDULING  "async" (the default) or "sync" (D without vLLM's async scheduling): the same.
#   START   "together" (0.26's default: every deployment at once) or "serial" (0.34's default: each once the one
#           before is ready, as vLLM 0.34 measures each engine's KV cache from the memory free after its warm-up).
#   PREPARE_ONLY=1  unpack and write the weights (WEIGHTS=0: not), run the transport, writes and forward steps STEPS names,
#           then stop.
#   KEEP=1 / ATTACH=1  the first leaves the deployments running when the run ends, the second (a later run on the
#           same host, same WORK) uses them instead of starting its own: start and tests in two shorter commands.
#           With ATTACH=1, a running deployment DEPLOYMENTS does not name is stopped first and one it names that is not
#           running is started: e.g. on an 80 GB H100 (two deployments fit) "pdkv-ipc mooncake-tcp", then
#           "pdkv-socket mooncake-tcp" keeps vLLM's MooncakeConnector up and swaps pdkv's.
#           A run without ATTACH=1, or with another VLLM than the deployments left running, stops them first (and
#           then starts its own).
#   VLLM    0.26 (the default) or 0.34: which vLLM runs (0.34: BUNDLE_DIR/vllm-0.34 from `VLLM=0.34 pack.sh`,
#           unpacked before the 0.26 site; each engine's extensible KV cache sized from its share of the GPU,
#           PDKV_GPU_KV=extensible in tests/gpu/deployments.py).
#
# Steps: unpack; write Qwen3-8B-sized seeded random weights (`pdkv model random`, on the GPU); start the three
# deployments of tests/gpu/deployments.py at once with `pdkv up -f` (P and D of each on GPU 0); run the GPU
# tests against them (`pytest -m gpu tests/gpu`); the side-by-side benchmark (benchmarks/gpu_pd.py) and
# `pdkv bench` of the ipc write against a same-GPU copy_; then the tests that kill P under load; stop all.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
BUNDLE="$(realpath "${1:?usage: run.sh BUNDLE_DIR [WORK]}")"
WORK="${2:-/tmp/pdkv-gpu}"
OUT="${OUT:-$WORK/out}"
STEPS="${STEPS-bench tests transport kill}"  # set but empty: no step (PREPARE_ONLY=1 STEPS="": unpack and weights)
AUX="$WORK/aux"
[ "${ATTACH:-0}" = 1 ] || rm -rf "$AUX"
mkdir -p "$WORK" "$OUT" "$AUX"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
say() { printf '%s\n' "$*" | tee -a "$SUMMARY"; }
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
T0=$(date +%s)

VLLM="${VLLM:-0.26}"
unpack() {  # unpack BUNDLE_DIR FOLDER: the pieces in BUNDLE_DIR hold WORK/FOLDER
    if [ ! -f "$WORK/$2/.unpacked" ]; then
        (cd "$1" && sha256sum -c --quiet bundle.sha256) || { say "bundle: checksum mismatch in $1"; exit 3; }
        cat "$1"/bundle.tgz.* | tar -xzf - -C "$WORK" || { say "bundle: unpack of $1 failed"; exit 3; }
        touch "$WORK/$2/.unpacked"
    fi
}
unpack "$BUNDLE" site
SITE="$WORK/site"
case "$VLLM" in
    0.26) ;;
    0.34)
        unpack "$BUNDLE/vllm-0.34" site-0.34
        # vLLM 0.34's kernel warm-up imports MiniMax-M3's CuTe DSL kernels on every CUDA host, a package this bundle
        # leaves out (no model here uses it): scripts/gpu/vllm034 stands a no-op in for that one warm-up.
        SITE="$ROOT/scripts/gpu/vllm034:$WORK/site-0.34:$SITE"
        export PDKV_GPU_KV="${PDKV_GPU_KV:-extensible}" ;;
    *) say "VLLM must be 0.26 or 0.34, got $VLLM"; exit 2 ;;
esac
say "bundle unpacked, vLLM $VLLM ($(elapsed))"

export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
LIBS="$WORK/deb/rdma/usr/lib/x86_64-linux-gnu:$WORK/deb/rdma/lib/x86_64-linux-gnu"
# Debian's libcurl (and what it links) only where the host has none: it must not shadow the host's own TLS.
if ! ldconfig -p | grep -q 'libcurl.so.4 '; then LIBS="$LIBS:$WORK/deb/curl/usr/lib/x86_64-linux-gnu"; fi
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export IBV_CONFIG_DIR="$WORK/deb/rdma/etc/libibverbs.d"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_HOST_IP=127.0.0.1 MC_LOG_LEVEL=ERROR PYTHONUNBUFFERED=1
export PDKV_GPU_MODEL="$WORK/model" PDKV_GPU_OUT="$AUX"
PY=python3

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$SUMMARY"
say "engines: ${PDKV_GPU_GRAPHS:-full-decode}; D's scheduling: ${PDKV_GPU_DECODE_SCHEDULING:-async}; steps: $STEPS"
$PY - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib
for name in ("torch", "vllm", "mooncake.engine", "pdkv.connector.vllm_connector"):
    try:
        mod = importlib.import_module(name)
        print(f"ok {name} {getattr(mod, '__version__', '')}")
    except Exception as e:  # every missing piece at once
        print(f"MISSING {name}: {type(e).__name__}: {e}")
EOF

# The weights (a minute on the GPU) only for the engines: the transport tests and `pdkv bench` read the config alone.
if [ "${PREPARE_ONLY:-0}" != 1 ] || [ "${WEIGHTS:-1}" = 1 ]; then
    if ! $PY -c "import sys; from pdkv.randmodel import has_weights; sys.exit(0 if has_weights('$WORK/model') else 1)"; then
        $PY -m pdkv model random "$WORK/model" --config "$WORK/model/config.json" --json > "$AUX/model.json" \
            || { say "model: writing the weights failed"; exit 3; }
    fi
    say "model ready ($(elapsed))"
fi
step_transport() {
    $PY -m pytest -m gpu -q -p no:cacheprovider tests/gpu --ignore tests/gpu/test_vllm_pd.py > "$OUT/tests-transport.log" 2>&1 || rc=1
    say "transport tests: $(tail -n 1 "$OUT/tests-transport.log") ($(elapsed))"
}
step_writes() {
    # `pdkv bench` of the writes alone, no engine needed: ipc against a same-GPU copy_, then the socket transport
    # (staged through pinned buffers) against Mooncake tcp, same bytes, once per SOCKET_CONNECTIONS x SOCKET_BUFFERS.
    $PY -m pdkv bench --model "$WORK/model" --blocks 63 --transport ipc --src cuda:0 --dst cuda:0 --layout contiguous \
        --baseline --iters 30 --json > "$AUX/bench-ipc.json" 2> "$AUX/bench-ipc.stderr" || rc=1
    $PY - "$AUX/bench-ipc.json" <<'PYEOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
for c in r["cases"]:
    b = c["baseline"]["bare"]
    print(f"ipc write {c['bytes']:,} B: p50 {c['timing']['p50_ms']:.3f} ms; same-GPU copy_ p50 {b['p50_ms']:.3f} ms; "
          f"ipc/copy_ bandwidth {b['p50_ms'] / c['timing']['p50_ms']:.2f}; verified {c['verified']}")
PYEOF
    for conns in ${SOCKET_CONNECTIONS:-0}; do for buf in ${SOCKET_BUFFERS:-default}; do
        local sized=() name="bench-socket-$conns-$buf"
        [ "$buf" = default ] || sized=(--socket-buffer "$buf")
        $PY -m pdkv bench --model "$WORK/model" --blocks 63 --transport socket --src cuda:0 --dst cuda:0 --layout "${SOCKET_LAYOUT:-all}" \
            --connections "$conns" "${sized[@]}" --baseline --iters 30 --json > "$AUX/$name.json" 2> "$AUX/$name.stderr" || rc=1
        cp "$AUX/$name.json" "$OUT/" 2>/dev/null
        $PY - "$AUX/$name.json" <<'PYEOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
used = r["mc_settings"]  # the socket transport's settings as opened
for c in r["cases"]:
    b = c["baseline"]["bare"]
    print(f"socket write {c['bytes']:,} B GPU->GPU, {c['layout']}, {used['connections']} connections, "
          f"{int(used['socket_buffer_bytes']):,} B socket buffers: p50 "
          f"{c['timing']['p50_ms']:.2f} ms; Mooncake tcp p50 {b['p50_ms']:.2f} ms; socket/Mooncake throughput "
          f"{b['p50_ms'] / c['timing']['p50_ms']:.2f}x; verified {c['verified']}")
PYEOF
    done; done
    say "writes done ($(elapsed))"
}
step_forward() {
    for conns in ${FORWARD_CONNECTIONS:-0 1}; do
        $PY benchmarks/socket_forward_gpu.py --connections "$conns" --json "$OUT/forward-$conns.json" \
            > "$AUX/forward-$conns.log" 2>&1 || rc=1
        say "socket write beside P's forward, connections $conns (0: the default):"
        grep -A8 '^mode ' "$AUX/forward-$conns.log" | tee -a "$SUMMARY" || tail -n 5 "$AUX/forward-$conns.log" | tee -a "$SUMMARY"
    done
    say "forward done ($(elapsed))"
}
rc=0
if [ "${PREPARE_ONLY:-0}" = 1 ]; then  # unpack and weights only (a command of its own where each is bounded),
    for step in $STEPS; do  # and the steps that need no engine, while none holds the GPU
        case "$step" in
            transport|writes|forward) "step_$step" ;;
            *) say "PREPARE_ONLY=1 runs transport, writes and forward, not $step" ;;
        esac
    done
    exit $rc
fi

FILES="$WORK/deployments"
$PY -m tests.gpu.deployments "$WORK/model" "$FILES" > /dev/null
PIDS=()
DEPLOYMENTS="${DEPLOYMENTS:-pdkv-ipc pdkv-tcp mooncake-tcp}"
export PDKV_GPU_DEPLOYMENTS="$DEPLOYMENTS"
N=$(echo $DEPLOYMENTS | wc -w)
stop_pids() {  # stop_pids PID...: each pdkv up's process group, INT first (it stops its engines), KILL after 60 s
    for pid in "$@"; do kill -INT -- "-$pid" 2>/dev/null; done
    for _ in $(seq 60); do
        alive=0; for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break; sleep 1
    done
    for pid in "$@"; do kill -KILL -- "-$pid" 2>/dev/null; done
}
stop_all() { [ ${#PIDS[@]} = 0 ] || stop_pids "${PIDS[@]}"; rm -f "$WORK/running"; }
digest() {
    # What a reader needs of WORK/aux, in one file: every event of `pdkv up` but the long ready line, each log's
    # errors and its last lines, the near-ties the tests saw.
    {
        for f in "$AUX"/up-*.jsonl "$AUX"/up-*.stderr; do
            echo "=== $f"; grep -v '"event": "ready"' "$f" | tail -n 20 | cut -c1-400
        done
        for f in "$AUX"/logs-*/*.log; do
            echo "=== $f"
            grep -n -E "Traceback|Error|error:|CUDA|out of memory|Killed|died|exited|signal" "$f" | head -n 25 | cut -c1-400
            echo "--- last lines"; tail -n 25 "$f" | cut -c1-400
        done
        echo "=== ties (P/D left P alone's answer at a bf16 tie): $(cat "$AUX"/ties.jsonl 2>/dev/null | wc -l)"
        cat "$AUX"/ties.jsonl 2>/dev/null
    } > "$OUT/digest.txt" 2>&1
}
# KEEP=1 leaves the deployments running when this run ends ("NAME PID VLLM" lines in WORK/running), for a later run on the
# same host with ATTACH=1, which uses them instead of starting its own: start and tests then fit two commands of a
# bounded length. Without KEEP they stop at the end.
NAMES=()
finish() {
    if [ "${KEEP:-0}" = 1 ]; then
        : > "$WORK/running"
        for i in "${!PIDS[@]}"; do echo "${NAMES[$i]} ${PIDS[$i]} $VLLM" >> "$WORK/running"; done
    else
        stop_all
    fi
    digest
}
trap finish EXIT
ready_count() {  # the deployments of DEPLOYMENTS whose pdkv up said ready
    local n=0 name
    for name in $DEPLOYMENTS; do grep -q '"event": "ready"' "$AUX/up-$name.jsonl" 2>/dev/null && n=$((n + 1)); done
    echo $n
}
wait_ready() {  # wait_ready COUNT: until COUNT deployments are ready, one ends, or 540 s pass
    for _ in $(seq 540); do
        [ "$(ready_count)" -ge "$1" ] && return 0
        for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || { say "a pdkv up ended early"; return 1; }; done
        sleep 1
    done
    return 1
}
# Deployments a KEEP=1 run left: stopped unless this run attaches to them (same vLLM), each by its own process group.
if [ -f "$WORK/running" ] && { [ "${ATTACH:-0}" != 1 ] || grep -qv " $VLLM\$" "$WORK/running"; }; then
    while read -r name pid version; do
        say "stopping $name (vLLM $version), left running by an earlier run"; stop_pids "$pid"
    done < "$WORK/running"
    rm -f "$WORK/running"
fi
if [ "${ATTACH:-0}" = 1 ]; then
    [ -f "$WORK/running" ] || say "ATTACH=1: no deployments of vLLM $VLLM left running in $WORK: starting them"
    [ -f "$WORK/running" ] && while read -r name pid _; do
        if [[ " $DEPLOYMENTS " == *" $name "* ]]; then
            kill -0 "$pid" 2>/dev/null || { say "ATTACH=1: $name (pdkv up $pid) is gone"; exit 1; }
            NAMES+=("$name"); PIDS+=("$pid")
        else
            say "ATTACH=1: stopping $name, which DEPLOYMENTS does not name"; stop_pids "$pid"
        fi
    done < "$WORK/running"
    say "attached to ${NAMES[*]:-none}"
fi
# vLLM 0.34 sizes each engine's KV cache from the memory it measures after warm-up, and counts what another
# process allocates meanwhile as its own: with START=serial (0.34's default) each deployment starts once the
# one before is ready, and pdkv up starts a deployment's engines on the shared GPU one after another itself.
START="${START:-$([ "$VLLM" = 0.34 ] && echo serial || echo together)}"
for name in $DEPLOYMENTS; do
    [[ " ${NAMES[*]} " == *" $name "* ]] && continue
    say "starting $name ($START)"
    setsid $PY -m pdkv up -f "$FILES/$name.toml" --json --log-dir "$AUX/logs-$name" > "$AUX/up-$name.jsonl" 2> "$AUX/up-$name.stderr" &
    PIDS+=($!); NAMES+=("$name")
    if [ "$START" = serial ]; then wait_ready "${#PIDS[@]}" || break; say "$name ready ($(elapsed))"; fi
done
wait_ready "$N"
ready=$(ready_count)
say "deployments ready: $ready of $N ($(elapsed))"
gpu_memory() { say "GPU memory in use: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader) ($1)"; }
gpu_memory "all engines up"
for name in $DEPLOYMENTS; do grep -h '"event": "ready"' "$AUX/up-$name.jsonl" | cut -c1-300 >> "$SUMMARY"; done
# Each engine's KV capacity as its log states it (same settings for every deployment: pdkv's against vLLM's connector).
for f in "$AUX"/logs-*/*.log; do
    grep -h -E "GPU KV cache size|Extended KV cache to|Memory after warmup|Available KV cache memory|KV cache layout|extensible" "$f" 2>/dev/null \
        | sed "s#^#$(basename "$(dirname "$f")")/$(basename "$f"): #" | cut -c1-260 | tail -n 4 >> "$SUMMARY"
done
if [ "$ready" != "$N" ]; then
    for f in "$AUX"/up-*.stderr; do echo "--- $f" >> "$SUMMARY"; tail -n 15 "$f" >> "$SUMMARY"; done
    exit 1
fi
export PDKV_GPU_UP=1

rc=0
step_tests() {
    # The deployments' tests, in a process of their own: a crash in another GPU test cannot take them down.
    $PY -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_vllm_pd.py -k "not killed" --junitxml "$AUX/tests.xml" \
        > "$OUT/tests.log" 2>&1 || rc=1
    say "deployment tests: $(tail -n 1 "$OUT/tests.log") ($(elapsed))"
    gpu_memory "after the tests"
}
step_bench() {
    $PY benchmarks/gpu_pd.py --rounds "${ROUNDS:-10}" --baseline "${BASELINE:-mooncake-tcp}" --json "$OUT/gpu_pd.json" \
        >> "$SUMMARY" 2> "$AUX/gpu_pd.stderr" || { rc=1; tail -n 20 "$AUX/gpu_pd.stderr" >> "$SUMMARY"; }
    [ "${BENCH_WRITES:-1}" = 0 ] || step_writes
    # vLLM's MooncakeConnector times its own writes (P's stats log, every 10 s): beside pdkv's traced write.
    grep -h "KV Transfer metrics" "$AUX"/logs-mooncake-tcp/* 2>/dev/null | tail -n 3 | cut -c1-400 >> "$SUMMARY"
    say "bench done ($(elapsed))"
}
step_kill() {
    $PY -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_vllm_pd.py -k "killed" > "$OUT/tests-kill.log" 2>&1 || rc=1
    say "kill tests: $(tail -n 1 "$OUT/tests-kill.log") ($(elapsed))"
}
step_profile() {
    local p d kv gpu profile="$OUT/qwen3-8b.profile.json"
    read -r p d kv < <($PY -c "from tests.gpu.deployments import KV_CACHE_BYTES, urls; u = urls('pdkv-ipc'); print(u.prefill, u.decode, KV_CACHE_BYTES >> 30)")
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
    # The GPUs and vLLM's version the profile detects itself; the description says how the engines share the GPU.
    $PY -m pdkv profile --prefill "$p" --decode "$d" --model "$WORK/model" -o "$profile" \
        --hardware "1 x $gpu shared by $((2 * N)) engines ($N deployments' P and D, $kv GiB of KV each), ${PDKV_GPU_GRAPHS:-full-decode} engines, batch-invariant kernels" \
        > "$AUX/profile.txt" 2>&1 || { rc=1; tail -n 20 "$AUX/profile.txt" >> "$SUMMARY"; }
    grep -E "fit:|warning" "$AUX/profile.txt" | cut -c1-300 | tee -a "$SUMMARY"
    # The seed's workload (1,000-token prompts, 128 output tokens) on that profile.
    for rate in 5 20; do
        $PY -m pdkv plan --profile "$profile" --slo ttft=500,itl=50 --rate "$rate" --prompt-tokens 1000 --output-tokens 128 \
            2>&1 | tee -a "$SUMMARY" || rc=1
    done
    say "profile done ($(elapsed))"
}
step_check() {
    local p budget profile="$OUT/qwen3-8b.profile.json"
    [ -f "$profile" ] || { say "check: no profile (name the profile step before it)"; rc=1; return; }
    read -r p budget < <($PY -c "from tests.gpu.deployments import MAX_BATCH_TOKENS, urls; print(urls('pdkv-ipc').prefill, MAX_BATCH_TOKENS)")
    $PY benchmarks/planner_check.py --url "$p" --profile "$profile" --prompt-tokens 1000 --utilization 0.3,0.7 \
        --max-batch-tokens "$budget" --seconds "${CHECK_SECONDS:-40}" > "$AUX/check.txt" 2>&1 || rc=1
    tail -n 12 "$AUX/check.txt" | cut -c1-300 | tee -a "$SUMMARY"
    say "check done ($(elapsed))"
}
step_wake() {
    local p
    p=$($PY -c "from tests.gpu.deployments import urls; print(urls('pdkv-ipc').prefill)")
    $PY benchmarks/engine_wake.py --url "$p" --prompt-tokens 1000 > "$AUX/wake.txt" 2>&1 || rc=1
    cut -c1-200 "$AUX/wake.txt" | tee -a "$SUMMARY"
    say "wake done ($(elapsed))"
}
# The steps run in the order STEPS names them.
for step in $STEPS; do
    case "$step" in
        tests|bench|kill|transport|writes|forward|profile|check|wake) "step_$step" ;;
        *) say "unknown step: $step (tests, bench, kill, transport, writes, forward, profile, check, wake)"; rc=2 ;;
    esac
done
exit $rc
