#!/usr/bin/env bash
# Run `pdkv doctor --transport rdma` on a GPU host and keep its JSON and table under $OUT.
# Run from the repository root. pdkv need not be installed: it runs from the tree.
# Missing light dependencies (typer, rich, msgspec, psutil, nvidia-ml-py) come from
# the wheel folder .whl; so does Mooncake when its wheel is there, with libibverbs
# extracted from the .deb folder (no root needed, nothing installed system-wide).
set -u
OUT="${OUT:-./doctor-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
DEPS="$(mktemp -d)"
export PYTHONPATH="$PWD:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
# --target keeps the system Python untouched (and works where PEP 668 forbids plain installs).
pip_from_whl() { "$PY" -m pip install --quiet --no-index --find-links .whl --target "$DEPS" "$@" >> "$OUT/pip.log" 2>&1 || echo "pip install $* failed: see $OUT/pip.log"; }

need=""
"$PY" -c "import typer, rich, msgspec, psutil" 2>/dev/null || need="typer rich msgspec psutil"
"$PY" -c "import pynvml" 2>/dev/null || need="$need nvidia-ml-py"
if [ -n "$need" ] && [ -d .whl ]; then
    pip_from_whl $need
fi

moon_whl=$(ls .whl/mooncake_transfer_engine*.whl 2>/dev/null | head -n 1)
if ! "$PY" -c "import mooncake.engine" 2>/dev/null && [ -n "$moon_whl" ]; then
    pip_from_whl --no-deps "$moon_whl"
    for deb in .deb/*.deb; do
        [ -e "$deb" ] || continue
        if command -v dpkg-deb > /dev/null; then
            dpkg-deb -x "$deb" "$DEPS/sysroot"
        else
            (mkdir -p "$DEPS/x" && cd "$DEPS/x" && ar x "$OLDPWD/$deb" && mkdir -p ../sysroot && tar -xf data.tar.* -C ../sysroot && rm -f ./*)
        fi
    done
    export LD_LIBRARY_PATH="$DEPS/sysroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

{
    echo "host: $(hostname)  kernel: $(uname -r)  python: $("$PY" --version 2>&1)"
    nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id,driver_version --format=csv,noheader 2>&1 || true
    head -n 1 /proc/driver/nvidia/version 2>&1 || true
    ls /sys/class/infiniband /dev/infiniband 2>&1 || true
    lsmod 2>/dev/null | grep -E '^nvidia' || true
    grep 'Max locked memory' /proc/self/limits
} > "$OUT/host.txt"

# The JSON first, then the table; 4 is the exit code for "some check failed".
"$PY" -m pdkv doctor --transport rdma --json > "$OUT/doctor.json" 2> "$OUT/doctor.json.stderr"
echo "json exit code: $?" | tee "$OUT/exit_codes.txt"
COLUMNS=200 "$PY" -m pdkv doctor --transport rdma > "$OUT/doctor.txt" 2>&1
echo "table exit code: $?" | tee -a "$OUT/exit_codes.txt"
cat "$OUT/doctor.txt"
