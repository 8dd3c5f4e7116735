"""What the kernels and the launch code assume of the tile table (cupyflash._config), checked
for every device size, head-dim bucket and mask block size the table can be asked for. No
kernel run shows these: a violation reads or writes out of bounds only at some shapes."""
import itertools

import pytest

from cupyflash import _config, _launch

MASK_LIMITS = list(itertools.product(_config.MASK_BLOCK_SIZES, repeat=2))
PICKS = [(limit, hd, bq, bk, deterministic)
         for limit in sorted(set(_config.SMEM_LIMIT.values()))
         for hd in _config.HEAD_DIM_BUCKETS
         for bq, bk in MASK_LIMITS
         for deterministic in (False, True)]


@pytest.mark.parametrize("pass_", ["fwd", "bwd", "dq"])
def test_every_tile_fits_and_lies_inside_one_mask_block(pass_):
    for limit, hd, bq, bk, deterministic in PICKS:
        t = _config.tile(pass_, hd, limit, bq, bk, deterministic=deterministic)
        where = (pass_, limit, hd, bq, bk, deterministic, t)
        assert t.smem_bytes(hd) <= limit, where
        # tile_lists needs tiles that divide the mask's blocks (each tile in one block).
        assert bq % t.br == 0 and bk % t.bc == 0, where


def test_double_buffered_forward_tile_only_where_two_blocks_fit():
    for limit, hd, bq, bk, _ in PICKS:
        t = _config.tile("fwd", hd, limit, bq, bk)
        assert t.smem_bytes(hd) * t.stages <= limit, (limit, hd, t)
        assert t.stages_for(causal=True) == 1
        assert t.smem_bytes(hd, causal=True) <= t.smem_bytes(hd)


def test_deterministic_backward_never_takes_an_atomic_only_tile():
    for limit, hd, bq, bk, _ in PICKS:
        assert not _config.tile("bwd", hd, limit, bq, bk, deterministic=True).atomic_only


def test_dq_accumulator_holds_whole_tiles_of_every_backward():
    """The dK/dV kernels add dQ tiles of ``br`` rows x the head-dim bucket without bounds
    checks: the accumulator's rows must be whole tiles past seqlen_q, its columns the bucket."""
    for limit, hd, bq, bk, _ in PICKS:
        t = _config.tile("bwd", hd, limit, bq, bk)
        assert _config.MAX_BLOCK % t.br == 0, (limit, hd, t)
    for d in range(1, _config.MAX_HEADDIM + 1):
        for sq in (1, 127, 128, 129, 1000):
            b, h, rows, cols = _launch.dq_accum_shape((2, sq, 3, d))
            assert (b, h) == (2, 3)
            assert rows >= sq and rows % _config.MAX_BLOCK == 0
            assert cols == _config.head_dim_bucket(d)
