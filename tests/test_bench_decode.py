"""benchmarks/bench_decode.py's cache rotation, no GPU: a cell whose cache L2 could hold is
timed over enough copies that none is still there when its turn comes again."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_decode  # noqa: E402

L2 = 60 << 20   # the H200's


@pytest.mark.parametrize("kv_mib", [1, 4, 16, 32, 33.5, 59, 64, 119])
def test_the_other_copies_fill_l2_twice(kv_mib):
    kv = int(kv_mib * 2**20)
    n = bench_decode.cache_copies(kv, L2)
    assert 2 <= n <= bench_decode.MAX_COPIES
    assert (n - 1) * kv >= 2 * L2 or n == bench_decode.MAX_COPIES
    assert (n - 2) * kv < 2 * L2      # no more than that


@pytest.mark.parametrize("kv_mib", [120, 128, 4096])
def test_a_cache_twice_the_l2_is_timed_alone(kv_mib):
    assert bench_decode.cache_copies(kv_mib << 20, L2) == 1
