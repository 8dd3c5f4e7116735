#!/usr/bin/env bash
# The multi-GPU job (ring attention over NCCL), in steps, each writing under $OUT:
#
#   bash benchmarks/ring_suite.sh tests scaling memory
#
#   tests    tests/test_distributed_nccl.py (two processes over CuPy's NCCL and torch.distributed,
#            the README's launch examples) and tests/test_distributed.py (threads on one GPU)
#            -> ring_tests.log
#   scaling  benchmarks/bench_ring.py at $SEQLENS (default 1M tokens) over $WORLDS (default 2 up
#            to every GPU) -> bench_ring.json
#   memory   benchmarks/bench_ring.py --memory-gib $MEMORY_GIB (default 12) over $MEMORY_WORLDS
#            (default "1 2") -> bench_ring_memory.json
#
# First a warm-up compiles the d=128 bf16 kernels the ring runs into ./.cupy_cache (shared by the
# ranks' processes). Env: PYTHON, SEQLENS, WORLDS, MEMORY_GIB, MEMORY_WORLDS, RING_ARGS (more
# bench_ring.py arguments for scaling), STEP_TIMEOUT (seconds per step, default 540).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUPY_CACHE_DIR="$PWD/.cupy_cache"
nvidia-smi -L
nvidia-smi topo -m
SECONDS=0
"$PY" - <<'EOF'
import cupy as cp
import ml_dtypes
import cupyflash as cf
from cupy.cuda import nccl
from cupyflash.bench import reports
print(reports.versions(), "nccl", nccl.get_version())
# Causal and plain calls of 8K+ rows pick the same kernels as the ring's shards.
for n, causal in ((8192, True), (8192, False), (4096, True)):
    q, k, v = (cp.random.standard_normal((1, n, 2, 128), dtype=cp.float32).astype(ml_dtypes.bfloat16)
               for _ in range(3))
    out, lse = cf.flash_attention(q, k, v, causal=causal, return_lse=True)
    cf.flash_attention_backward(q, q, k, v, out, lse, causal=causal)
cp.cuda.Device().synchronize()
EOF
echo "warm-up took ${SECONDS} s"
RC=0
for STEP in "$@"; do
    SECONDS=0
    case $STEP in
        tests)
            timeout "${STEP_TIMEOUT:-540}" "$PY" -m pytest -q -rs -p no:cacheprovider \
                tests/test_distributed_nccl.py tests/test_distributed.py 2>&1 | tee "$OUT/ring_tests.log"
            ;;
        scaling)
            # shellcheck disable=SC2086
            timeout "${STEP_TIMEOUT:-540}" "$PY" benchmarks/bench_ring.py --out "$OUT" \
                --seqlens ${SEQLENS:-1048576} ${WORLDS:+--worlds $WORLDS} ${RING_ARGS:-}
            ;;
        memory)
            # shellcheck disable=SC2086
            timeout "${STEP_TIMEOUT:-540}" "$PY" benchmarks/bench_ring.py --out "$OUT" \
                --memory-gib "${MEMORY_GIB:-12}" --worlds ${MEMORY_WORLDS:-1 2}
            ;;
        *)
            echo "unknown step $STEP"; false ;;
    esac
    STEP_RC=${PIPESTATUS[0]}
    echo "=== $STEP: exit $STEP_RC after ${SECONDS} s"
    [ "$STEP_RC" = 0 ] || RC=$STEP_RC
done
exit "$RC"
