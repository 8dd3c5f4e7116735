#!/usr/bin/env bash
# Nsight Compute on our forward and dK/dV kernels and, side by side, on PyTorch SDPA's flash
# kernels (FlashAttention 2) for the same problem (bf16, 16K tokens, 2048 = heads x d):
#
#   bash benchmarks/profile_ncu.sh [ours|sdpa|both] [extra profile_once.py args, e.g. --causal]
#
# Writes to $OUT: ncu_<impl>.log, details_<impl>.csv (every section's metrics) and
# sass_<impl>.csv (per-SASS-instruction executions, stall samples, shared-memory wavefronts).
# Read them with benchmarks/ncu_summary.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" CUPY_CACHE_DIR="$PWD/.cupy_cache"
WHICH=${1:-both}
shift || true
# Launches to skip: the warm-up iteration's (ours: fwd, dK/dV; SDPA: fwd, dot_do_o, dq_dk_dv, convert).
for spec in "ours 2 2" "sdpa 4 4"; do
    set -- $spec "$@"
    impl=$1 skip=$2 count=$3
    shift 3
    [ "$WHICH" = both ] || [ "$WHICH" = "$impl" ] || continue
    ncu -k regex:flash_ --launch-skip "$skip" -c "$count" --set full --import-source no -f \
        -o "/tmp/ncu_$impl" python3 benchmarks/profile_once.py --impl "$impl" "$@" \
        > "$OUT/ncu_$impl.log" 2>&1
    ncu -i "/tmp/ncu_$impl.ncu-rep" --page details --csv > "$OUT/details_$impl.csv" 2>&1
    ncu -i "/tmp/ncu_$impl.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$impl.csv" 2>&1
done
ls -la "$OUT"
