#!/usr/bin/env bash
# Run a command with our kernels compiled by the NVRTC in DIR (libnvrtc.so.13 and its
# libnvrtc-builtins, as the nvidia-cuda-nvrtc wheel ships them) instead of the one CuPy finds:
#
#   bash benchmarks/with_nvrtc.sh DIR command [args...]
#
# The library is preloaded, so CuPy's lookup gets it; CuPy's cache keys include the NVRTC
# version, so one cache directory serves both compilers. Why: the lent H100's image has NVRTC
# 13.0 (its PyTorch environment's), while `pip install cupy-cuda13x[ctk]` installs the newest
# 13.x, and the register allocation of our 255-register kernels differs between them by a few
# percent of speed. The bench JSON records the version a run compiled with (versions.nvrtc).
set -euo pipefail
DIR=$(cd "$1" && pwd)
shift
[ -f "$DIR/libnvrtc.so.13" ] || { echo "no libnvrtc.so.13 in $DIR" >&2; exit 2; }
export LD_PRELOAD="$DIR/libnvrtc.so.13${LD_PRELOAD:+:$LD_PRELOAD}"
export LD_LIBRARY_PATH="$DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"
