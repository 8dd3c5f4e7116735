"""benchmarks/bench_ring.py's host-side pieces, no GPU: the input blocks each rank makes and
the bisection that finds the longest sequence."""
import sys
from pathlib import Path

import numpy as np
import pytest

from cupyflash import distributed as cfd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_ring  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_blocks_are_the_shard_of_the_sequence(world):
    """A rank's blocks, in its order, are ``shard`` of the sequence's blocks: every world cuts
    the same sequence, and world 0 (one GPU) holds it all in order."""
    blocks = np.arange(bench_ring.BLOCKS)[None]
    for rank in range(world):
        assert bench_ring._blocks_of(world, rank) == list(cfd.shard(blocks, rank, world)[0])
    assert bench_ring._blocks_of(0, 0) == list(range(bench_ring.BLOCKS))


@pytest.mark.parametrize("longest", [4096, 300000, 311296, 1 << 20, 5_000_000])
@pytest.mark.parametrize("guess", [4096, 250000, 2_000_000])
def test_longest_brackets_the_threshold(longest, guess):
    """The longest multiple of GRANULE that runs and the next one, which does not, from any
    first guess, each probed at most once."""
    probed = []

    def probe(s):
        probed.append(s)
        return s <= longest, {}
    lo, hi, probes = bench_ring._longest(probe, guess)
    g = bench_ring.GRANULE
    assert lo == longest // g * g and hi == lo + g
    assert len(probed) == len(set(probed)) == len(probes)
