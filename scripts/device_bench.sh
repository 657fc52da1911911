#!/usr/bin/env bash
# pdkv bench on a GPU host: Qwen3-8B geometry, 63 blocks, GPU0 -> GPU1 over Mooncake tcp and
# through CUDA IPC, the three layouts with --baseline, then a blocks sweep; JSON, logs and a summary under $OUT.
#
# Run from the repository root, offline. Expects next to it:
#   .whl/  mooncake-transfer-engine-cuda13 (and any of pdkv's Python deps the host lacks:
#          msgspec, pyzmq, typer, rich, ...); installed with pip --no-index --no-deps
#   .deb/  Debian's libibverbs1, librdmacm1 (and their lib deps, e.g. libnl-3-200,
#          libnl-route-3-200); unpacked with dpkg -x, found through LD_LIBRARY_PATH
#
# Environment: OUT (default /tmp/pdkv-device-bench), PYTHON (default python3),
# ITERS (30), WARMUP (3), SRC (cuda:0), DST (cuda:1), SWEEP (1: also sweep blocks=1,16,63,256),
# IPC (1: also the three layouts through CUDA IPC, ITERS x 3 writes each),
# USE_CLI (0: call the library instead of the typer CLI), WHL_DIR (.whl), DEB_DIR (.deb),
# RUN_TIMEOUT (120 s per benchmark run).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/pdkv-device-bench}"
PY="${PYTHON:-python3}"
ITERS="${ITERS:-30}"
WARMUP="${WARMUP:-3}"
SRC="${SRC:-cuda:0}"
DST="${DST:-cuda:1}"
SWEEP="${SWEEP:-1}"
# The device tool allows 10 minutes per command: every run is bounded so that the summary is always written.
RUN_TIMEOUT="${RUN_TIMEOUT:-120}"
WHL_DIR="${WHL_DIR:-.whl}"
DEB_DIR="${DEB_DIR:-.deb}"
SITE=/tmp/pdkv-site
DEBROOT=/tmp/pdkv-debroot
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_bench.log") 2>&1

say() { printf '\n== %s\n' "$*"; }

say "host"
"$PY" --version
nvidia-smi -L > "$OUT/gpus.txt" 2>&1 || echo "nvidia-smi failed" >> "$OUT/gpus.txt"
cat "$OUT/gpus.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true

say "install wheels from $WHL_DIR/ into $SITE"
mkdir -p "$SITE"
shopt -s nullglob
wheels=("$WHL_DIR"/*.whl)
if ((${#wheels[@]})); then
    "$PY" -m pip install --no-index --no-deps --quiet --target "$SITE" "${wheels[@]}" \
        || { echo "pip install from .whl/ failed"; exit 3; }
else
    echo "no wheels in $WHL_DIR/: relying on what $PY already has"
fi

say "unpack $DEB_DIR/ into $DEBROOT"
mkdir -p "$DEBROOT"
debs=("$DEB_DIR"/*.deb)
for deb in "${debs[@]}"; do
    dpkg -x "$deb" "$DEBROOT" || echo "dpkg -x $deb failed"
done
LIBS=""
for d in "$DEBROOT"/usr/lib/x86_64-linux-gnu "$DEBROOT"/lib/x86_64-linux-gnu "$DEBROOT"/usr/lib "$DEBROOT"/usr/lib/x86_64-linux-gnu/libibverbs; do
    [[ -d "$d" ]] && LIBS="$LIBS:$d"
done
export LD_LIBRARY_PATH="${LIBS#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[[ -d "$DEBROOT/etc/libibverbs.d" ]] && export IBV_CONFIG_DIR="$DEBROOT/etc/libibverbs.d"
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MC_LOG_LEVEL="${MC_LOG_LEVEL:-ERROR}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

say "check imports"
"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import importlib, sys
missing = []
for name in ("msgspec", "zmq", "numpy", "torch", "mooncake.engine", "pdkv.bench.runner", "typer", "rich"):
    try:
        mod = importlib.import_module(name)
        print(f"ok       {name} {getattr(mod, '__version__', '')}")
    except Exception as exc:  # report every missing piece at once
        print(f"MISSING  {name}: {exc}")
        missing.append(name)
try:
    import torch
    print("cuda devices:", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
except Exception:
    pass
hard = [m for m in missing if m not in ("typer", "rich", "numpy")]  # numpy only for cpu memory
sys.exit(1 if hard else 0)
EOF
if [[ ${PIPESTATUS[0]} -ne 0 ]]; then
    echo "required modules missing (see $OUT/env.txt): put their wheels in .whl/"
    exit 3
fi
if [[ "${USE_CLI:-}" != 0 ]] && "$PY" -c "from pdkv.cli.app import build_app; build_app()" 2>/dev/null; then
    USE_CLI=1
else
    USE_CLI=0
    echo "the pdkv CLI does not load here (or USE_CLI=0): using the library entry point"
fi

# One benchmark invocation: JSON on stdout to $1, the rest to $1.log; never aborts the script.
bench() {
    local out="$1"; shift
    if [[ $USE_CLI == 1 ]]; then
        timeout "$RUN_TIMEOUT" "$PY" -m pdkv bench "$@" --json > "$out" 2> "${out%.json}.log"
    else
        timeout "$RUN_TIMEOUT" "$PY" -m pdkv.bench "$@" --json > "$out" 2> "${out%.json}.log"
    fi
    local rc=$?
    echo "exit $rc: pdkv bench $*"
    [[ $rc -ne 0 ]] && tail -5 "${out%.json}.log"
    return 0
}

QWEN3_8B=(--layers 36 --kv-heads 8 --head-dim 128 --block-size 16)
for layout in contiguous per-block scattered; do
    say "$layout: 63 blocks $SRC -> $DST over tcp, with baseline"
    bench "$OUT/bench-$layout.json" "${QWEN3_8B[@]}" --blocks 63 --src "$SRC" --dst "$DST" --transport tcp \
        --layout "$layout" --baseline --iters "$ITERS" --warmup "$WARMUP"
done

if [[ "${IPC:-1}" == 1 ]]; then
    say "ipc: 63 blocks $SRC -> $DST through CUDA IPC, all layouts, with the copy_ baseline"
    bench "$OUT/bench-ipc.json" "${QWEN3_8B[@]}" --blocks 63 --src "$SRC" --dst "$DST" --transport ipc \
        --layout all --baseline --iters "$((ITERS * 3))" --warmup "$WARMUP"
fi

if [[ $SWEEP == 1 ]]; then
    say "sweep blocks=1,16,63,256 x all layouts (no baseline)"
    bench "$OUT/sweep.json" "${QWEN3_8B[@]}" --src "$SRC" --dst "$DST" --transport tcp \
        --sweep blocks=1,16,63,256 --sweep layout=all --iters 10 --warmup 2
fi

say "summary"
"$PY" - "$OUT" <<'EOF' | tee "$OUT/summary.md"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
for name in ("bench-contiguous.json", "bench-per-block.json", "bench-scattered.json", "bench-ipc.json", "sweep.json"):
    p = out / name
    try:
        rep = json.loads(p.read_text())
    except Exception as exc:
        rows.append(f"| {name} | failed: {exc} |")
        continue
    for c in rep["cases"]:
        t, b = c["timing"], c.get("baseline") or {}
        bare = b.get("bare") or {}
        rows.append(
            f"| {name.removesuffix('.json')} | {c['layout']} | {c['blocks']} | {c['bytes']} | {c['descriptors']} | "
            f"{c['plan_ms']:.2f} | {c['cold_ms']:.1f} | {t['min_ms']:.2f} | {t['p50_ms']:.2f} | {t['p90_ms']:.2f} | "
            f"{t['p99_ms']:.2f} | {t['max_ms']:.2f} | {t['gbps_p50']:.2f} | {t['gbps_run']:.2f} | {t['link_pct_p50']:.2f} | "
            f"{bare.get('p50_ms', float('nan')):.2f} | {b.get('p50_ratio', float('nan')):.3f} | {b.get('teb_gbps') or '-'} | "
            f"{c['verified']} | {rep['src']}->{rep['dst']} |"
        )
print("| run | layout | blocks | bytes | descr | plan ms | cold ms | min | p50 | p90 | p99 | max | GB/s p50 | GB/s run | % link | bare p50 | pdkv/bare | teb GB/s | verified | memory |")
print("|" + "---|" * 20)
print("\n".join(rows))
EOF
echo "results in $OUT"
