"""The bench's peers where they cannot run: each says why (``Unavailable``), before touching
the inputs, so that ``compare`` turns it into a skipped row."""
import sys

import pytest

from cupyflash.bench import Case, Unavailable
from cupyflash.bench import peers


def test_fa4_runs_dense_cases_only():
    with pytest.raises(Unavailable, match="dense cases only"):
        peers.make_runner("fa4", Case.sparse("random", 1024), None)


def test_fa4_without_its_package_says_which_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)   # import raises ImportError
    with pytest.raises(Unavailable) as info:
        peers.make_runner("fa4", Case.dense(1024, 128), None)
    try:
        peers._torch()
    except Unavailable:
        assert "torch" in str(info.value)              # no torch here: that comes first
    else:
        assert "flash-attn-4" in str(info.value)


def test_fa4_takes_our_layout_and_sdpa_swaps_heads_and_rows():
    class Array:
        def transpose(self, a, b):
            return ("swapped", a, b)
    x = Array()
    assert peers.Fa4._layout(peers.Fa4.__new__(peers.Fa4), x) is x
    assert peers.Sdpa._layout(peers.Sdpa.__new__(peers.Sdpa), x) == ("swapped", 1, 2)
