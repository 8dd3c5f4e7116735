"""Benchmark machinery, shared by ``python -m cupyflash bench``, the pytest-benchmark suite
(``benchmarks/test_bench.py``) and the scripts in ``benchmarks/``; ``import cupyflash`` never
imports it.

- ``cases``: what is measured (shapes, dtypes, mask patterns), FLOPs, inputs;
- ``timing``: CUDA-event clocks behind a spin kernel, peak memory, the timed loop;
- ``peers``: the implementations compared (runners) and the measuring of one case;
- ``reports``: JSON of a run, the tables, the figure, the targets they are checked against.

The names below are the ones the command line and the scripts use.
"""
from .cases import (DEFAULT_DENSE_IMPLS, DENSE_IMPLS, HEAD_WIDTH, PASSES, RANDOM_DENSITY,
                    SPARSE_BATCH, SPARSE_BLOCK, SPARSE_HEADDIM, SPARSE_IMPLS, SPARSE_NHEADS,
                    SPARSE_PATTERNS, TOKENS, WINDOW, Case, attention_flops, error_text,
                    input_sets, np_dtype, tflops)
from .peers import (Ours, Unavailable, compare, failed_row, make_runner, measure,
                    result_row)
from .reports import (add_ratios, fmt, format_report, gpu_name, pivot, plot, progress_line,
                     pyplot, report, row_status, table_text, write_json)
from .timing import CupyClock, Timing, release_memory, time_calls

__all__ = [
    "DEFAULT_DENSE_IMPLS", "DENSE_IMPLS", "HEAD_WIDTH", "PASSES", "RANDOM_DENSITY",
    "SPARSE_BATCH", "SPARSE_BLOCK", "SPARSE_HEADDIM", "SPARSE_IMPLS", "SPARSE_NHEADS",
    "SPARSE_PATTERNS", "TOKENS", "WINDOW",
    "Case", "attention_flops", "error_text", "input_sets", "np_dtype", "tflops",
    "Ours", "Unavailable", "compare", "failed_row", "make_runner", "measure", "result_row",
    "add_ratios", "fmt", "format_report", "gpu_name", "pivot", "plot", "progress_line",
    "pyplot", "report", "row_status", "table_text", "write_json",
    "CupyClock", "Timing", "release_memory", "time_calls",
]
