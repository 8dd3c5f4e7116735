"""What the kernels and the launch code assume of the tile table (cupyflash._config), checked
for every device size, head-dim bucket and mask block size the table can be asked for. No
kernel run shows these: a violation reads or writes out of bounds only at some shapes, or
quietly runs a smaller tile than fits."""
import itertools

import numpy as np
import pytest

from cupyflash import _config, _launch

MASK_LIMITS = list(itertools.product(_config.MASK_BLOCK_SIZES, repeat=2))
PICKS = [(limit, hd, bq, bk, deterministic)
         for limit in sorted(set(_config.SMEM_LIMIT.values()))
         for hd in _config.HEAD_DIM_BUCKETS
         for bq, bk in MASK_LIMITS
         for deterministic in (False, True)]
# Every shared-memory size a device could report, in steps of 1 KB: the table's order must
# give the right tile at sizes between those of the devices listed today too.
ANY_LIMIT = range(16 * 1024, 256 * 1024 + 1, 1024)
PASSES = ("fwd", "bwd", "dq")


def table_tiles():
    return [(pass_, hd, t) for pass_ in PASSES for hd in _config.HEAD_DIM_BUCKETS
            for t in _config._TABLES[pass_][hd]]


def allowed(t, hd, limit, bq, bk, deterministic):
    """What ``_config.tile`` may pick: fits the device, lies inside one mask block, and has
    no dQ atomics in a deterministic backward."""
    return (t.fits(hd, limit) and t.br <= bq and t.bc <= bk
            and not (deterministic and getattr(t, "atomic_only", False)))


def size(t):
    """Bigger is better: more of the score matrix per thread block, then more buffers in
    flight, then wider warp slices."""
    return (t.br * t.bc, getattr(t, "stages", 1), getattr(t, "km", 1))


@pytest.mark.parametrize("pass_", PASSES)
def test_every_tile_fits_and_lies_inside_one_mask_block(pass_):
    for limit, hd, bq, bk, deterministic in PICKS:
        t = _config.tile(pass_, hd, limit, bq, bk, deterministic=deterministic)
        where = (pass_, limit, hd, bq, bk, deterministic, t)
        assert t.smem_bytes(hd) <= limit, where
        # tile_lists needs tiles that divide the mask's blocks (each tile in one block).
        assert bq % t.br == 0 and bk % t.bc == 0, where


@pytest.mark.parametrize("pass_", PASSES)
def test_the_pick_is_the_biggest_tile_allowed(pass_):
    """The table lists tiles biggest first, so the first one allowed is the biggest allowed."""
    for limit, hd, (bq, bk), deterministic in itertools.product(
            ANY_LIMIT, _config.HEAD_DIM_BUCKETS, MASK_LIMITS, (False, True)):
        options = [t for t in _config._TABLES[pass_][hd]
                   if allowed(t, hd, limit, bq, bk, deterministic)]
        if not options:
            with pytest.raises(RuntimeError, match="no .* tile"):
                _config.tile(pass_, hd, limit, bq, bk, deterministic=deterministic)
            continue
        t = _config.tile(pass_, hd, limit, bq, bk, deterministic=deterministic)
        assert size(t) == max(map(size, options)), (pass_, limit, hd, bq, bk, deterministic)


def test_every_tile_of_the_table_can_be_picked():
    """A tile that an earlier one beats at every shared-memory size, mask and determinism is
    dead weight (and never compile-checked: kernel_names lists only picks)."""
    picked = {(pass_, hd, _config.tile(pass_, hd, limit, bq, bk, deterministic=deterministic))
              for pass_ in PASSES
              for limit, hd, (bq, bk), deterministic in itertools.product(
                  ANY_LIMIT, _config.HEAD_DIM_BUCKETS, MASK_LIMITS, (False, True))
              if any(allowed(t, hd, limit, bq, bk, deterministic)
                     for t in _config._TABLES[pass_][hd])}
    assert not set(table_tiles()) - picked


def test_warp_grids_divide_every_tile():
    """The static_asserts of fwd.cu and bwd.cu, for every tile of the table (the compile check
    instantiates only the tiles that today's devices pick)."""
    for pass_, hd, t in table_tiles():
        where = (pass_, hd, t)
        assert t.bc % 16 == 0 and hd % 16 == 0, where       # 16x16 mma operands
        if pass_ == "fwd":
            # Warps own whole 16-row slices of the query block.
            assert t.br % (16 * t.warps) == 0, where
        elif pass_ == "dq":
            assert t.br == 16 * t.warps, where
        else:
            # Keys in slices of 16 * km rows across the warps, queries (and the head dim of
            # dK, dV) split over the warps left; dQ rows in slices of 16 * km, columns split.
            assert t.bc % (16 * t.km) == 0 and t.warps % (t.bc // (16 * t.km)) == 0, where
            along_q = t.warps // (t.bc // (16 * t.km))
            assert t.br % (16 * along_q) == 0 and hd % (16 * along_q) == 0, where
            assert t.br % (16 * t.km) == 0 and t.warps % (t.br // (16 * t.km)) == 0, where
            assert hd % (16 * (t.warps // (t.br // (16 * t.km)))) == 0, where


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


@pytest.mark.parametrize("field", ["kv_blocks", "q_blocks"])
def test_block_lists_for_other_tiles_are_refused(field):
    """The tensor-core kernels know their tiles only as template constants: a list made for
    other tiles must be refused before the launch, not read with the wrong geometry."""
    p = np.zeros((), _launch.BWD_PARAMS)
    _launch._check_lists(p, field, 64, 64)             # no list: a dense call
    rec = p[field]
    rec["idx"], rec["row_tile"], rec["list_tile"] = 1, 128, 64
    _launch._check_lists(p, field, 128, 64)
    for row_tile, list_tile in ((64, 64), (64, 128), (128, 128)):
        with pytest.raises(AssertionError, match=f"{field} lists are for 128 x 64 tiles"):
            _launch._check_lists(p, field, row_tile, list_tile)


def test_backward_kernels_read_bands_at_run_time_only_in_the_deterministic_mode():
    """cuda/bwd.cu's names: the atomic dK/dV kernels keep their band compiled (no band, causal
    and a window apart: reading causal at run time measured 1-2% slower), the deterministic
    mode's dK/dV and dQ kernels take one name for all three; kernel_names lists each once."""
    from cupyflash import _spec
    t = _config.tile("bwd", 128, _config.SMEM_LIMIT[80])
    dq = _config.tile("dq", 128, _config.SMEM_LIMIT[80])
    specs = [_spec.CallSpec("float16", 128, window=w) for w in (_spec.NO_WINDOW, _spec.CAUSAL, (64, 0))]
    assert len({_launch.bwd_dkdv_name(s, "fp16", 128, t, True) for s in specs}) == 3
    assert len({_launch.bwd_dkdv_name(s, "fp16", 128, t, False) for s in specs}) == 1
    assert len({_launch.bwd_dq_name(s, "fp16", 128, dq) for s in specs}) == 1
    for limit in (_config.SMEM_LIMIT[80], _config.SMEM_LIMIT[86]):
        for names in _launch.kernel_names(limit).values():
            assert len(names) == len(set(names))
