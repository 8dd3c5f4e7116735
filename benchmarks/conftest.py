"""Options and setup of the pytest-benchmark suite (``pytest benchmarks/``).

``--bench-full`` runs the whole grid (otherwise the cases marked ``bench_full`` are
deselected); without a CUDA GPU every case is skipped with the reason. After the run, the
comparison tables of ``python -m cupyflash bench`` are printed for the rows measured.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's cupyflash
from cupyflash import bench  # noqa: E402
from cupyflash._gpu import gpu_or_reason  # noqa: E402

_ROWS = []


def pytest_addoption(parser):
    group = parser.getgroup("cupyflash benchmarks")
    group.addoption("--bench-full", action="store_true",
                    help="the whole grid: every implementation, pass, dtype, head dim, causal "
                         "and seqlen, and every block-sparse pattern (default: a small subset)")
    group.addoption("--bench-reps", type=int, default=20,
                    help="timed calls per case (pytest-benchmark rounds; default 20)")
    group.addoption("--bench-warmup", type=int, default=3,
                    help="untimed calls before timing (default 3)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where there is none)")
    config.addinivalue_line("markers", "bench_full: runs only with --bench-full")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--bench-full"):
        deselected = [i for i in items if i.get_closest_marker("bench_full")]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [i for i in items if not i.get_closest_marker("bench_full")]
    _, why = gpu_or_reason()
    if why is not None:
        skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {why}")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture
def bench_settings(request):
    """(timed rounds, warm-up calls) from the command line."""
    return request.config.getoption("--bench-reps"), request.config.getoption("--bench-warmup")


@pytest.fixture
def bench_rows():
    """The session's result rows, printed as tables at the end."""
    yield _ROWS
    bench.release_memory()


def pytest_terminal_summary(terminalreporter):
    if _ROWS:
        terminalreporter.section("cupyflash: TFLOP/s against the peers")
        terminalreporter.write_line(bench.format_report(_ROWS))
