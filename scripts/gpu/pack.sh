#!/usr/bin/env bash
# Pack everything an offline GPU host needs to run pdkv's GPU tier (tests/gpu) and the GPU P/D benchmark
# (benchmarks/gpu_pd.py): vLLM 0.26.0 and the wheels in scripts/gpu/wheels.txt unpacked for Python 3.12 and
# slimmed to what a dense bf16 model on Hopper loads; Debian's RDMA user-space libraries for Mooncake (and
# libcurl's, used only where the host has none); the model folder without weights (Qwen3-8B's config and a
# tokenizer that names every id; scripts/gpu/run.sh writes seeded random weights on the host).
#
# Usage: bash scripts/gpu/pack.sh [OUT]      (default OUT=.gpu; run as root on a Debian host with PyPI access)
# Writes OUT/bundle.tgz.aa, .ab, ... (PIECE_MB each, default 50: a piece and the checkout fit one 64 MiB device call) and OUT/bundle.sha256.
# With VLLM=0.34 it also writes OUT/vllm-0.34/bundle.tgz.* and its bundle.sha256: vLLM 0.34.0 with torch 2.14 and
# what else scripts/gpu/wheels-0.34.txt names, an overlay run.sh puts before the 0.26 site (about 800 MB).
# Copy OUT/ and this checkout to the GPU host, then: bash scripts/gpu/run.sh OUT   (VLLM=0.34 for 0.34)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="$(realpath -m "${1:-.gpu}")"
PIECE_MB="${PIECE_MB:-50}"
CACHE="${PDKV_GPU_WHEELS:-$HOME/.cache/pdkv/gpu-wheels}"
VLLM="${VLLM:-0.26}"
case "$VLLM" in 0.26|0.34) ;; *) echo "VLLM must be 0.26 or 0.34, got $VLLM" >&2; exit 2 ;; esac
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$OUT" "$CACHE" "$STAGE/site" "$STAGE/deb" "$STAGE/debs/rdma" "$STAGE/debs/curl"

# The model folder is written by pdkv itself (`pdkv model random`, below): its CLI needs typer, rich and msgspec,
# the tokenizer tokenizers. Where this host's python3 lacks them they go to a folder of this run, not its site-packages.
TOOLS="$STAGE/tools"
if ! python3 -c "import typer, rich, msgspec, tokenizers" 2>/dev/null; then
    echo "== pdkv's own dependencies for 'pdkv model random' (typer, rich, msgspec, tokenizers) -> $TOOLS"
    python3 -m pip install -q --disable-pip-version-check --target "$TOOLS" "typer>=0.12" "rich>=13" "msgspec>=0.18" "tokenizers>=0.19" || {
        echo "pack.sh: 'pdkv model random' needs typer, rich, msgspec and tokenizers, and pip could not install them: pip install" \
             "-e '.[test]' here first" >&2
        exit 1
    }
fi

PLATFORMS=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")

echo "== wheels -> $CACHE"
mapfile -t WANTED < <(grep -v '^\s*#' scripts/gpu/wheels.txt | sed '/^\s*$/d')
python3 -m pip download -q --disable-pip-version-check --no-deps "${TARGET[@]}" -d "$CACHE" "${WANTED[@]}"

echo "== unpack for Python 3.12"
python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile "${TARGET[@]}" --no-index --find-links "$CACHE" \
    --target "$STAGE/site" "${WANTED[@]}"

echo "== slim"
# What a dense bf16 model on Hopper (FlashAttention 3) never loads, and Mooncake beyond its transfer engine.
rm -rf "$STAGE/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$STAGE/site/vllm/_moe_C_stable_libtorch.abi3.so" \
       "$STAGE/site/vllm/third_party/deep_gemm" "$STAGE/site/vllm/third_party/fmha_sm100" "$STAGE/site/vllm_rs"* \
       "$STAGE/site/mooncake/_store"*.so "$STAGE/site/mooncake/_ep"*.so "$STAGE/site/mooncake/libmooncake_pg"*.so \
       "$STAGE/site/mooncake/libmooncake_ep"*.so "$STAGE/site/mooncake/mooncake_client" "$STAGE/site/mooncake/mooncake_master" \
       "$STAGE/site/mooncake/transfer_engine_bench" "$STAGE/site/bin"
find "$STAGE/site" -name __pycache__ -prune -exec rm -rf {} +

echo "== Debian libraries"
(cd "$STAGE/debs/rdma" && apt-get download -q libibverbs1 ibverbs-providers librdmacm1 libnl-3-200 libnl-route-3-200 libnuma1 >/dev/null)
(cd "$STAGE/debs/curl" && apt-get download -q libcurl4 libbrotli1 libnghttp2-14 libpsl5 librtmp1 libssh2-1 libldap-2.5-0 \
    libsasl2-2 libsasl2-modules-db libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 \
    libidn2-0 libunistring2 libgnutls30 libhogweed6 libnettle8 libtasn1-6 libp11-kit0 libgmp10 libdb5.3 >/dev/null)
for set in rdma curl; do
    for deb in "$STAGE/debs/$set"/*.deb; do dpkg -x "$deb" "$STAGE/deb/$set"; done
done
rm -rf "$STAGE/debs"

echo "== model folder (no weights)"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}:$TOOLS" python3 -m pdkv model random "$STAGE/model" --config tests/fixtures/configs/qwen3-8b/config.json --no-weights --json >/dev/null

pieces() {  # pieces DIR NAMES...: tar the named folders of $STAGE into DIR/bundle.tgz.* and their checksums
    local dir="$1"; shift
    mkdir -p "$dir"
    rm -f "$dir"/bundle.tgz.* "$dir"/bundle.sha256
    tar -C "$STAGE" -czf - "$@" | split -b "${PIECE_MB}M" - "$dir/bundle.tgz."
    (cd "$dir" && sha256sum bundle.tgz.* > bundle.sha256)
    du -ch "$dir"/bundle.tgz.* | tail -n 1
}
echo "== pieces"
pieces "$OUT" site deb model

if [ "$VLLM" = "0.34" ]; then
    echo "== vLLM 0.34 overlay"
    mapfile -t OVERLAY < <(grep -v '^\s*#' scripts/gpu/wheels-0.34.txt | sed '/^\s*$/d')
    python3 -m pip download -q --disable-pip-version-check --no-deps "${TARGET[@]}" -d "$CACHE" "${OVERLAY[@]}"
    python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile "${TARGET[@]}" --no-index --find-links "$CACHE" \
        --target "$STAGE/site-0.34" "${OVERLAY[@]}"
    # As for 0.26, plus Triton's Blackwell tools and static libraries, NCCL's headers and static library.
    rm -rf "$STAGE/site-0.34/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$STAGE/site-0.34/vllm/_moe_C_stable_libtorch.abi3.so" \
           "$STAGE/site-0.34/vllm/third_party/deep_gemm" "$STAGE/site-0.34/vllm/third_party/fmha_sm100" "$STAGE/site-0.34/vllm_rs"* \
           "$STAGE/site-0.34/bin" "$STAGE/site-0.34/nvidia/nccl/include" "$STAGE/site-0.34"/nvidia/nccl/lib/*.a \
           "$STAGE/site-0.34/triton/backends/nvidia/bin/ptxas-blackwell" "$STAGE/site-0.34/triton/backends/nvidia/lib/cupti"
    find "$STAGE/site-0.34" \( -name __pycache__ -prune -o -name '*.a' \) -exec rm -rf {} +
    du -sh "$STAGE/site-0.34"
    pieces "$OUT/vllm-0.34" site-0.34
fi
ls -l "$OUT"
