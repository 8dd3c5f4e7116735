"""Shared test setup: the ``gpu`` marker skips cleanly where no CUDA GPU is present."""
import functools

import pytest

from cupyflash._gpu import gpu_or_reason


@functools.lru_cache(maxsize=None)
def gpu_skip_reason():
    """None when a CUDA GPU is usable through CuPy, else why not (the CLI's wording)."""
    _, why = gpu_or_reason()
    return None if why is None else f"needs a CUDA GPU: {why}"


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
