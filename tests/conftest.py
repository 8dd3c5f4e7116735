"""Shared test setup: the ``gpu`` marker skips cleanly where no CUDA GPU is present."""
import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """None when a CUDA GPU is usable through CuPy, else why not."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CuPy install
        return f"needs a CUDA GPU: CuPy is not importable ({type(e).__name__}: {e})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device, CUDA runtime missing, ...
        return f"needs a CUDA GPU: CUDA is not usable ({type(e).__name__}: {e})"
    if count == 0:
        return "needs a CUDA GPU: CUDA reports 0 devices"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where there is none)")


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        reason = reason or gpu_skip_reason()
        if reason is None:
            return
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def has_gpu():
    """True when CuPy sees at least one CUDA GPU."""
    return gpu_skip_reason() is None
