"""pytest-benchmark suite: cupyflash and its peers, forward, backward and forward+backward.

    pytest benchmarks/ --benchmark-json=bench.json             # default subset, ~2 minutes
    pytest benchmarks/ --bench-full --benchmark-json=bench.json  # the whole grid

Each test times one implementation at one case and pass (cupyflash/bench.py: CUDA events
around each call after warm-up, calls rotating among 3 input sets, each queued behind a short
spin kernel). pytest-benchmark's own statistics are host times of one call plus its
synchronization; the numbers to read are in ``extra_info``: ``ms`` (median of the CUDA-event
times), ``tflops`` (DESIGN.md's FLOPs), ``peak_bytes`` (device memory one call takes above its
inputs) and the case. Tests of one case and pass share a group, so pytest-benchmark's table
puts the implementations side by side; the tables printed at the end add the ratios to SDPA
flash and naive attention.

A peer that is not importable or cannot run a case (e.g. a backend without head dim 256) is
skipped with the reason; a failure of cupyflash fails its test.

Grid (``--bench-full``): dense cases for every implementation of ``bench.DENSE_IMPLS``, pass,
dtype (bf16, fp16), head dim (64, 128, 256), causal or not, seqlen 512 to 16K (batch x seqlen =
16K tokens, 2048 / head dim heads); block-sparse patterns (random 10%, sliding window 1024,
causal as a block mask) at seqlen 8K and 32K for cupyflash and FlexAttention. Default: bf16,
d=128, seqlen 1K, 4K and 16K, causal and not, cupyflash and SDPA flash, every pass; and the
sliding window at 8K for cupyflash and FlexAttention.
"""
import contextlib
import itertools

import pytest

from cupyflash import bench

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (the [bench] extra)")

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
HEADDIMS = (64, 128, 256)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
SPARSE_SEQLENS = (8192, 32768)

DEFAULT_IMPLS = ("cupyflash", "sdpa_flash")
DEFAULT_SEQLENS = (1024, 4096, 16384)
DEFAULT_SPARSE = ("sliding_window", 8192)


def _dense_params():
    for impl, pass_, dtype, d, causal, s in itertools.product(
            bench.DENSE_IMPLS, bench.PASSES, DTYPES, HEADDIMS, (False, True), SEQLENS):
        default = (impl in DEFAULT_IMPLS and dtype == "bf16" and d == 128
                   and s in DEFAULT_SEQLENS)
        yield pytest.param(impl, pass_, DTYPES[dtype], d, causal, s,
                           id=f"{impl}-{pass_}-{dtype}-d{d}-{'causal' if causal else 'full'}-{s}",
                           marks=() if default else pytest.mark.bench_full)


def _sparse_params():
    for impl, pass_, pattern, s in itertools.product(
            bench.SPARSE_IMPLS, bench.PASSES, bench.SPARSE_PATTERNS, SPARSE_SEQLENS):
        default = (pattern, s) == DEFAULT_SPARSE
        yield pytest.param(impl, pass_, pattern, s, id=f"{impl}-{pass_}-{pattern}-{s}",
                           marks=() if default else pytest.mark.bench_full)


@contextlib.contextmanager
def _peers_skip(impl):
    """A peer that cannot run skips its test, with the reason; cupyflash's failures fail."""
    try:
        yield
    except bench.Unavailable as e:
        pytest.skip(str(e))
    except Exception as e:
        if impl == "cupyflash":
            raise
        pytest.skip(f"{impl} failed: {bench.error_text(e)}")


def _run(benchmark, settings, rows, impl, pass_, case):
    reps, warmup = settings
    with _peers_skip(impl):
        runner = bench.make_runner(impl, case, bench.input_sets(case))
        timing = bench.Timing(runner.clock, runner.calls(pass_))
        timing.warm_up(warmup)
        benchmark.group = f"{case.label()} {pass_}"
        benchmark.pedantic(timing, setup=timing.before, rounds=reps, iterations=1)
        row = bench.result_row(runner, pass_, timing)
    benchmark.extra_info.update(row)
    rows.append(row)


@pytest.mark.gpu
@pytest.mark.parametrize("impl, pass_, dtype, headdim, causal, seqlen", list(_dense_params()))
def test_dense(benchmark, bench_settings, bench_rows, impl, pass_, dtype, headdim, causal,
               seqlen):
    _run(benchmark, bench_settings, bench_rows, impl, pass_,
         bench.Case.dense(seqlen, headdim, causal, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("impl, pass_, pattern, seqlen", list(_sparse_params()))
def test_sparse(benchmark, bench_settings, bench_rows, impl, pass_, pattern, seqlen):
    _run(benchmark, bench_settings, bench_rows, impl, pass_, bench.Case.sparse(pattern, seqlen))
