#!/usr/bin/env bash
# The GPU job: kernel warm-up, tests, compute-sanitizer, the comparison benchmark (python -m
# cupyflash bench) and the block-sparse benchmark. Run from the repo root on a GPU machine:
#
#   bash benchmarks/gpu_suite.sh            # everything
#   bash benchmarks/gpu_suite.sh quick      # tests without the seqlen-2048 cases and the
#                                           # scale tests, bench --quick
#   SUITE_TESTS="tests/test_gpu_dense.py -k fwd" bash benchmarks/gpu_suite.sh
#
# Results go to $OUT (default ./gpu_out), five files (a lent GPU machine returns at most
# eight): logs.tar.gz (prewarm.log, gpu_tests.log, gpu_tests.xml, sanitize.log with one log
# per run under sanitize/, bench.log; packed on exit, also when a step fails), bench.json,
# bench.png, bench_sparse.json, cupy_cache.tar.gz. Each log is also printed as it is written,
# and a summary comes last. The NVRTC cache lives in ./.cupy_cache (git-ignored); carry it to
# the next machine to skip compiling. The pytest-benchmark suite (pytest benchmarks/) is not
# run here: it measures the same things, case by case, for pytest-benchmark's JSON.
# Env: PYTHON (default python3), SUITE_TESTS (pytest arguments, shell-quoted), GIT_COMMIT
# (recorded in the JSON; on a lent device machine the copied .git may name an older commit),
# PREWARM=0 to skip the parallel compile, PREWARM_JOBS (default: CPU count),
# SKIP_SANITIZE=1 / SKIP_DENSE_BENCH=1 / SKIP_SPARSE_BENCH=1 to skip compute-sanitizer / the
# comparison / the block-sparse benchmark, SUITE_JOBS=N to run the tests in N processes
# (pytest-xdist; the GPU fuzz's seven families then run side by side: tests/test_fuzz_gpu.py).
# A failing test is named in the tests' log when it fails (tests/conftest.py), so a run stopped
# by a time limit before pytest's summary still says which one.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-full}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOGS=$(mktemp -d)/logs
mkdir -p "$LOGS"
pack_logs() { tar -czf "$OUT/logs.tar.gz" -C "$(dirname "$LOGS")" logs; }
trap pack_logs EXIT
trap 'exit 143' TERM INT    # so that the EXIT trap runs when the job is stopped
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR="$PWD/.cupy_cache"
mkdir -p "$CUPY_CACHE_DIR"
echo "cupy cache: $CUPY_CACHE_DIR ($(find "$CUPY_CACHE_DIR" -type f | wc -l) files at start)"

nvidia-smi -L
"$PY" -c "import cupy, numpy; rt = cupy.cuda.runtime.runtimeGetVersion(); \
print('python', __import__('sys').version.split()[0], '| cupy', cupy.__version__, \
'| numpy', numpy.__version__, '| CUDA runtime', rt)"

# 1. Compile every kernel instantiation the config table can pick on this GPU, in parallel
#    processes, into CuPy's on-disk cache: one NVRTC compile per instantiation would otherwise
#    run one after another inside the tests. Failures are only reported here; the tests show them.
if [ "${PREWARM:-1}" != 0 ]; then
    SECONDS=0
    PREWARM_PY=$(mktemp -d)/prewarm.py    # a real file: spawned workers re-import it
    cat > "$PREWARM_PY" <<'EOF'
import multiprocessing as mp
import os
import re
import time


def compile_one(item):
    filename, name = item
    t0 = time.perf_counter()
    try:
        import cupy
        from cupyflash import _compile
        with cupy.cuda.Device(0):
            arch = _compile.ARCH_SPECIFIC.get(filename)   # the Hopper kernels: sm_90a cubins
            if arch:
                _compile.get_arch_kernel(0, _compile.source(filename), name, arch)
            else:
                _compile._module(0, _compile.source(filename), (name,)).get_function(name)
        return filename, name, time.perf_counter() - t0, None
    except Exception as e:
        return filename, name, time.perf_counter() - t0, f"{type(e).__name__}: {e}"


def main():
    import cupy
    from cupyflash import _launch
    limit = cupy.cuda.Device(0).attributes["MaxSharedMemoryPerBlockOptin"]
    names = _launch.kernel_names(limit, cupy.cuda.Device(0).compute_capability == "90")
    def longest_first(item):
        # Backward and big head dims first: the longest compiles start early.
        filename, name = item
        m = re.search(r"<\w+, (\d+)", name)
        return (filename == "generic.cu", -(int(m.group(1)) if m else 0), filename != "bwd.cu")

    items = sorted(((f, n) for f, ns in names.items() for n in dict.fromkeys(ns)),
                   key=longest_first)
    jobs = int(os.environ.get("PREWARM_JOBS") or os.cpu_count() or 4)
    print(f"prewarm: {len(items)} kernels, {jobs} processes, smem limit {limit}", flush=True)
    t0 = time.perf_counter()
    done, failed = [], []
    with mp.get_context("spawn").Pool(jobs) as pool:
        for filename, name, sec, err in pool.imap_unordered(compile_one, items):
            done.append((sec, filename, name))
            if err:
                failed.append((filename, name, err))
                print(f"FAILED {filename} {name}: {err.splitlines()[0][:300]}", flush=True)
    wall = time.perf_counter() - t0
    done.sort(reverse=True)
    print(f"prewarm: {len(done) - len(failed)} ok, {len(failed)} failed, {wall:.0f} s wall, "
          f"{sum(d[0] for d in done):.0f} s of compiling")
    for sec, filename, name in done[:8]:
        print(f"  slowest: {sec:6.1f} s  {filename} {name}")
    for filename, name, err in failed[:3]:
        print(f"--- {filename} {name}\n{err[:3000]}")


if __name__ == "__main__":
    main()
EOF
    "$PY" "$PREWARM_PY" 2>&1 | tee "$LOGS/prewarm.log"
    echo "prewarm took ${SECONDS} s"
fi

# 2. Tests (the suite goes on to the benchmark even if they fail).
if [ -n "${SUITE_TESTS:-}" ]; then
    eval "TESTS=($SUITE_TESTS)"
elif [ "$MODE" = quick ]; then
    TESTS=(tests --ignore=tests/test_compile.py --ignore=tests/test_gpu_scale.py -k "not 2048")
else
    # The NVRTC compile checks are CI's (the prewarm above already compiled for this GPU).
    TESTS=(tests --ignore=tests/test_compile.py)
fi
TIMEOUT=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    TIMEOUT=(--timeout=600)
fi
JOBS=()
if [ "${SUITE_JOBS:-1}" -gt 1 ]; then
    JOBS=(-n "$SUITE_JOBS")
fi
SECONDS=0
# junit_family=legacy: the junit XML of pytest's default family drops record_property's
# values, which the summary below reads.
"$PY" -m pytest "${TESTS[@]}" -q -rs ${TIMEOUT[@]+"${TIMEOUT[@]}"} ${JOBS[@]+"${JOBS[@]}"} -p no:cacheprovider \
    -o junit_family=legacy --junitxml="$LOGS/gpu_tests.xml" 2>&1 | tee "$LOGS/gpu_tests.log"
TEST_RC=${PIPESTATUS[0]}
echo "tests took ${SECONDS} s (exit $TEST_RC)"

# 3. compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over every kernel family.
SANITIZE_RC=0
: > "$LOGS/sanitize.log"
if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
    SECONDS=0
    "$PY" benchmarks/sanitize.py --log-dir "$LOGS/sanitize" 2>&1 | tee "$LOGS/sanitize.log"
    SANITIZE_RC=${PIPESTATUS[0]}
    echo "sanitizer took ${SECONDS} s (exit $SANITIZE_RC)"
fi

# 4. Benchmarks: the comparison table and figure, then block-sparse; one log for both.
QUICK=()
[ "$MODE" = quick ] && QUICK=(--quick)
: > "$LOGS/bench.log"
BENCH_RC=0
if [ "${SKIP_DENSE_BENCH:-0}" != 1 ]; then
    SECONDS=0
    "$PY" -m cupyflash bench ${QUICK[@]+"${QUICK[@]}"} --json "$OUT/bench.json" \
        --plot "$OUT/bench.png" 2>&1 | tee -a "$LOGS/bench.log"
    BENCH_RC=${PIPESTATUS[0]}
    echo "comparison benchmark took ${SECONDS} s (exit $BENCH_RC)"
fi
SPARSE_RC=0
if [ "${SKIP_SPARSE_BENCH:-0}" != 1 ]; then
    SECONDS=0
    echo "=== bench_sparse run ===" >> "$LOGS/bench.log"
    "$PY" benchmarks/bench_sparse.py --out "$OUT" ${QUICK[@]+"${QUICK[@]}"} 2>&1 \
        | tee -a "$LOGS/bench.log"
    SPARSE_RC=${PIPESTATUS[0]}
    echo "sparse benchmark took ${SECONDS} s (exit $SPARSE_RC)"
fi

# 5. The compile cache, so the next machine need not compile again.
tar -czf "$OUT/cupy_cache.tar.gz" -C "$PWD" .cupy_cache
SIZE=$(stat -c %s "$OUT/cupy_cache.tar.gz")
echo "cupy cache: $(find "$CUPY_CACHE_DIR" -type f | wc -l) files, tarball $((SIZE / 1024)) KiB"
if [ "$SIZE" -gt $((15 * 1024 * 1024)) ]; then
    echo "WARNING: cupy_cache.tar.gz is over 15 MiB and may not come back from the device"
fi

# 6. Summary, last.
echo
echo "=== summary ==="
grep -E "(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s" \
    "$LOGS/gpu_tests.log" | tail -n 1 || echo "no pytest summary line (exit $TEST_RC)"
# The 1M-token figures: junit properties of tests/test_gpu_scale.py.
"$PY" - "$LOGS/gpu_tests.xml" <<'EOF' || true
import sys
import xml.etree.ElementTree as ET
props = {p.get("name"): p.get("value") for p in ET.parse(sys.argv[1]).iter("property")
         if p.get("name", "").startswith("million_")}
if props:
    g = lambda n: props.get("million_" + n, "?")
    print(f"1M tokens causal bf16: fwd {g('fwd_seconds')} s ({g('fwd_tflops')} TFLOP/s), "
          f"bwd {g('bwd_seconds')} s ({g('bwd_tflops')} TFLOP/s); peak in use fwd "
          f"{g('fwd_peak_gib')} GiB ({g('fwd_unavoidable_gib')} unavoidable), bwd "
          f"{g('bwd_peak_gib')} GiB ({g('bwd_unavoidable_gib')} unavoidable)")
EOF
grep "^sanitize:" "$LOGS/sanitize.log" | tail -n 1 || echo "sanitize: not run"
# Each table runs from its "=== ... table ===" line to the next "=== " line.
for TABLE in bench bench_sparse; do
    echo
    awk -v want="=== $TABLE table ===" '/^=== /{p = ($0 == want); next} p' "$LOGS/bench.log"
done
echo "exit: tests $TEST_RC, sanitizer $SANITIZE_RC, comparison benchmark $BENCH_RC, sparse" \
    "benchmark $SPARSE_RC"
[ "$TEST_RC" = 0 ] && [ "$SANITIZE_RC" = 0 ] && [ "$BENCH_RC" = 0 ] && [ "$SPARSE_RC" = 0 ]
