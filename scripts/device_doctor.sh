#!/usr/bin/env bash
# Run `pdkv doctor --protocol rdma` on a GPU host and keep its JSON and table under $OUT.
# Run from the repository root. pdkv need not be installed: it runs from the tree.
# Its light dependencies come from the wheel folder .whl when they are missing.
set -u
OUT="${OUT:-./doctor-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import typer, rich, msgspec, psutil, pynvml" 2>/dev/null && [ -d .whl ]; then
    DEPS="$(mktemp -d)"
    # --target keeps the system Python untouched (and works where PEP 668 forbids plain installs).
    "$PY" -m pip install --quiet --no-index --find-links .whl --target "$DEPS" \
        typer rich msgspec psutil nvidia-ml-py > "$OUT/pip.log" 2>&1 || echo "pip install failed, see $OUT/pip.log"
    export PYTHONPATH="$PYTHONPATH:$DEPS"
fi

{
    echo "host: $(hostname)  kernel: $(uname -r)  python: $("$PY" --version 2>&1)"
    nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id,driver_version --format=csv,noheader 2>&1 || true
    ls /sys/class/infiniband 2>&1 || true
    lsmod 2>/dev/null | grep -E '^nvidia' || true
} > "$OUT/host.txt"

# The JSON first, then the table; 4 is the exit code for "some check failed".
"$PY" -m pdkv doctor --protocol rdma --json > "$OUT/doctor.json" 2> "$OUT/doctor.json.stderr"
echo "json exit code: $?" | tee "$OUT/exit_codes.txt"
COLUMNS=200 "$PY" -m pdkv doctor --protocol rdma > "$OUT/doctor.txt" 2>&1
echo "table exit code: $?" | tee -a "$OUT/exit_codes.txt"
cat "$OUT/doctor.txt"
