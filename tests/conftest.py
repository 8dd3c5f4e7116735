"""Shared test setup: the ``gpu`` marker skips cleanly where no CUDA GPU is present."""
import functools
import os
import random
import sys

import pytest

from cupyflash._gpu import gpu_or_reason

# Every launch plan replayed in the GPU tests is checked against a fresh preparation of its call
# (cupyflash/_launch.py, _planned).
os.environ.setdefault("CUPYFLASH_CHECK_PLANS", "1")
# Before any test module imports JAX: by default its first use (even of its CPU devices, which
# starts every backend) takes 75% of GPU memory, ~105 GB of an H200 per pytest worker, and the
# other workers' CuPy and PyTorch pools then run out.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """None when a CUDA GPU is usable through CuPy, else why not (the CLI's wording)."""
    _, why = gpu_or_reason()
    return None if why is None else f"needs a CUDA GPU: {why}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where there is none)")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # The controller of a pytest-xdist run, before its workers start: they share one
        # GPU fuzz seed (each would draw its own, and the summary names one), and their
        # fuzz example counts come back here to be printed.
        if not os.environ.get("CUPYFLASH_FUZZ_SEED", "").strip():
            os.environ["CUPYFLASH_FUZZ_SEED"] = str(random.SystemRandom().randrange(2**32))
        from strategies import WorkerExampleCounts
        config.pluginmanager.register(WorkerExampleCounts(), "fuzz-example-counts")


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        reason = reason or gpu_skip_reason()
        if reason is None:
            return
        item.add_marker(pytest.mark.skip(reason=reason))


def pytest_runtest_logreport(report):
    """A failure named on stderr as soon as it is known: a GPU run that its time limit stops
    before pytest's summary (benchmarks/gpu_suite.sh) still says which test failed, and under
    which GPU fuzz seed."""
    if report.failed:
        seed = os.environ.get("CUPYFLASH_FUZZ_SEED", "").strip()
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when}{', fuzz seed ' + seed if seed else ''})\n")


@pytest.fixture(scope="session")
def has_gpu():
    """True when CuPy sees at least one CUDA GPU."""
    return gpu_skip_reason() is None
