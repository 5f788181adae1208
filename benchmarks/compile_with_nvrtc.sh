#!/usr/bin/env bash
# Compiles instances with another NVRTC than the installed one, e.g. the GPU machine's, so that what
# only that version rejects shows before device time is spent (NVRTC 13.0 compiles a generic lambda
# as a host function, 13.5 does not: benchmarks/results/20261207-nvidia-h100-sm90-bwd-pipelined-step).
# The wheel's libnvrtc is preloaded, so cuda-bindings uses it; its cubins go to a cache of their own.
#
#     benchmarks/compile_with_nvrtc.sh 13.0.88 flash_bwd_sm90 [sm_90a]
#
# ptxas's register and spill lines: FLASHGEN_NVRTC_EXTRA_OPTIONS=-Xptxas=-v FLASHGEN_CLI_FLAGS=-v
# (flashgen's info log prints each compile's NVRTC log).
set -euo pipefail
version=${1:?usage: compile_with_nvrtc.sh VERSION [FILTER] [ARCH]}
filter=${2:-}
arch=${3:-sm_90a}
dir=${TMPDIR:-/tmp}/flashgen-nvrtc-$version
if [ ! -d "$dir/nvidia" ]; then
  python -m pip download --no-deps -q -d "$dir" "nvidia-cuda-nvrtc==$version"
  python -m zipfile -e "$dir"/nvidia_cuda_nvrtc-*.whl "$dir"
fi
libnvrtc=$(find "$dir/nvidia" -name 'libnvrtc.so.*' ! -name '*alt*' | head -1)
lib=$(dirname "$libnvrtc")
export LD_PRELOAD="$libnvrtc $(find "$lib" -name 'libnvrtc-builtins.so.*' ! -name '*alt*' | head -1)"
export LD_LIBRARY_PATH="$lib" FLASHGEN_CACHE_DIR="$dir/cache"
python -c "from flashgen.generator import nvrtc; print('NVRTC', '.'.join(map(str, nvrtc.nvrtc_version())))"
python -m flashgen ${FLASHGEN_CLI_FLAGS:-} build --arch "$arch" ${filter:+--filter "$filter"} -j "$(nproc)"
