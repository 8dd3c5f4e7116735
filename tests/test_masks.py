"""Block-sparse masks (cupyflash.masks) and the NumPy path with block_mask, without a GPU."""
import inspect

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _numpy_backend, _spec, _validate, masks
from reference import (attention_naive, attention_naive_backward, attention_ref,
                       attention_ref_backward, assert_rule, random_array, random_inputs,
                       rel_err)

F64_REL = 1e-12


def causal_dense(sq, sk):
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)


def block_any(dense, bq, bk):
    """(h, sq, sk) element mask -> (h, nbq, nbk): blocks holding any True element."""
    h, sq, sk = dense.shape
    nbq, nbk = -(-sq // bq), -(-sk // bk)
    padded = np.zeros((h, nbq * bq, nbk * bk), bool)
    padded[:, :sq, :sk] = dense
    return padded.reshape(h, nbq, bq, nbk, bk).any(axis=(2, 4))


def expand(blocks, bq, bk, sq, sk):
    return blocks.repeat(bq, axis=1).repeat(bk, axis=2)[:, :sq, :sk]


def rand_blocks(shape, seed, density=0.5):
    return np.random.default_rng(seed).random(shape) < density


# --- builders against hand-computed layouts -------------------------------------------------

def test_causal_square_4x4_blocks():
    m = masks.causal(512, 512)
    np.testing.assert_array_equal(m.blocks[0], np.tril(np.ones((4, 4), bool)))
    assert m.causal and m.heads == 1
    # Query block i: the diagonal block (partial) first, then 0 .. i-1 (full).
    for i in range(4):
        assert m.kv_counts[0, i] == i + 1 and m.kv_partial[0, i] == 1
        assert list(m.kv_indices[0, i, :i + 1]) == [i] + list(range(i))
        assert (m.kv_indices[0, i, i + 1:] == 0).all()
    # Key block j is visited by query blocks j (partial), then j+1 .. 3 (full).
    for j in range(4):
        assert list(m.q_indices[0, j, :m.q_counts[0, j]]) == list(range(j, 4))
        assert m.q_partial[0, j] == 1


def test_causal_seqlen_q_shorter_than_seqlen_k():
    # shift = 256: query block 0 (rows 0..127) sees keys <= 383, block 1 sees all 512.
    m = masks.causal(256, 512, block_size=128)
    np.testing.assert_array_equal(m.blocks[0], [[1, 1, 1, 0], [1, 1, 1, 1]])
    # key_end(0) = 257: key block 2 (ends at 384) is partial; key_end(128) = 385: block 3.
    assert list(m.kv_indices[0, 0, :3]) == [2, 0, 1] and m.kv_partial[0, 0] == 1
    assert list(m.kv_indices[0, 1, :4]) == [3, 0, 1, 2] and m.kv_partial[0, 1] == 1


def test_causal_seqlen_q_longer_than_seqlen_k():
    # shift = -256: rows 0..255 see nothing, row 256 sees key 0, row 511 sees keys 0..255.
    m = masks.causal(512, 256, block_size=128)
    np.testing.assert_array_equal(m.blocks[0], [[0, 0], [0, 0], [1, 0], [1, 1]])
    np.testing.assert_array_equal(m.kv_counts[0], [0, 0, 1, 2])
    np.testing.assert_array_equal(m.q_counts[0], [2, 1])


@pytest.mark.parametrize("block_size", [64, 128, (64, 128), (128, 64)])
@pytest.mark.parametrize("sq,sk", [(1, 1), (200, 200), (97, 300), (300, 97), (129, 1)])
def test_causal_equals_causal_attention_elementwise(sq, sk, block_size):
    m = masks.causal(sq, sk, block_size)
    np.testing.assert_array_equal(m.to_dense()[0], causal_dense(sq, sk))
    np.testing.assert_array_equal(m.blocks, block_any(causal_dense(sq, sk)[None], *m.block_size))


def test_sliding_window_hand_layouts():
    eye = np.eye(4, dtype=bool)
    band1 = eye | np.eye(4, k=1, dtype=bool) | np.eye(4, k=-1, dtype=bool)
    band2 = band1 | np.eye(4, k=2, dtype=bool) | np.eye(4, k=-2, dtype=bool)
    np.testing.assert_array_equal(masks.sliding_window(512, 512, 1).blocks[0], eye)
    # |i - j| < 128 reaches the neighbour blocks (row 127, key 128) but not two away.
    np.testing.assert_array_equal(masks.sliding_window(512, 512, 128).blocks[0], band1)
    np.testing.assert_array_equal(masks.sliding_window(512, 512, 129).blocks[0], band1)
    np.testing.assert_array_equal(masks.sliding_window(512, 512, 130).blocks[0], band2)
    # seqlen_q = 128, seqlen_k = 512: the query rows align to keys 384..511.
    np.testing.assert_array_equal(masks.sliding_window(128, 512, 1).blocks[0], [[0, 0, 0, 1]])


@pytest.mark.parametrize("window", [1, 50, 64, 65, 200])
@pytest.mark.parametrize("sq,sk", [(300, 300), (100, 390), (390, 100), (1, 77)])
def test_sliding_window_blocks_are_those_meeting_the_band(sq, sk, window):
    i = np.arange(sq)[:, None] + (sk - sq)
    band = np.abs(i - np.arange(sk)[None, :]) < window
    m = masks.sliding_window(sq, sk, window, block_size=64)
    np.testing.assert_array_equal(m.blocks, block_any(band[None], 64, 64))


def test_strided_hand_layout():
    # |qb - kb| < 2, or kb % 2 == 1 (summary columns 1 and 3).
    expected = [[1, 1, 0, 1],
                [1, 1, 1, 1],
                [0, 1, 1, 1],
                [0, 1, 1, 1]]
    np.testing.assert_array_equal(masks.strided(512, 512, 2).blocks[0], expected)
    np.testing.assert_array_equal(masks.strided(512, 512, 1).blocks[0], np.ones((4, 4)))


def test_longformer_hand_layout():
    expected = [[1, 1, 1, 1],
                [1, 1, 0, 0],
                [1, 0, 1, 0],
                [1, 0, 0, 1]]
    np.testing.assert_array_equal(masks.longformer(512, 512, 1, 1).blocks[0], expected)
    np.testing.assert_array_equal(masks.longformer(512, 512, 1, 0).blocks[0], np.eye(4))


def test_bigbird_reproducible_by_seed_and_different_across_seeds():
    kw = dict(window=64, global_blocks=1, random_blocks=3, block_size=64)
    a = masks.bigbird(2048, 2048, seed=7, **kw)
    np.testing.assert_array_equal(a.blocks, masks.bigbird(2048, 2048, seed=7, **kw).blocks)
    assert (a.blocks != masks.bigbird(2048, 2048, seed=8, **kw).blocks).any()
    base = masks.longformer(2048, 2048, 64, 1, block_size=64).blocks
    assert (a.blocks >= base).all()
    # Exactly random_blocks extra blocks per row, where that many are left.
    extra = (a.blocks & ~base).sum(axis=-1)
    np.testing.assert_array_equal(extra, np.minimum(3, (~base).sum(axis=-1)))


def test_bigbird_per_head_random_blocks_differ():
    m = masks.bigbird(1024, 1024, 64, 1, 2, seed=0, block_size=64, nheads=4)
    assert m.heads == 4 and m.blocks.shape == (4, 16, 16)
    assert len({m.blocks[h].tobytes() for h in range(4)}) > 1


def test_random_density_near_target():
    m = masks.random(64 * 128, 64 * 128, 0.3, seed=0)
    assert m.blocks.shape == (1, 64, 64)
    assert abs(m.density - 0.3) < 0.03
    np.testing.assert_array_equal(m.blocks, masks.random(64 * 128, 64 * 128, 0.3, 0).blocks)
    assert not masks.random(300, 300, 0.0, seed=1).blocks.any()
    assert masks.random(300, 300, 1.0, seed=1).blocks.all()
    assert masks.random(300, 300, 0.5, seed=1, nheads=3).heads == 3


# --- BlockMask: from_dense, to_dense, density, combinations ---------------------------------

@pytest.mark.parametrize("heads", [None, 1, 3])
def test_from_dense_round_trip(heads):
    shape = (3, 4) if heads is None else (heads, 3, 4)
    grid = rand_blocks(shape, seed=1)
    m = cf.BlockMask.from_dense(grid, (64, 128), seqlen_q=150, seqlen_k=400)
    np.testing.assert_array_equal(m.blocks, grid.reshape((-1, 3, 4)))
    assert m.heads == (heads or 1) and m.block_size == (64, 128)
    assert not m.blocks.flags.writeable
    grid[...] = ~grid                       # the mask holds its own copy
    assert (m.blocks != grid.reshape((-1, 3, 4))).all()


def test_from_dense_accepts_lists_and_dlpack_objects():
    grid = rand_blocks((2, 3), seed=2)

    class Foreign:                          # a framework array seen only through DLPack
        def __dlpack__(self, **kw):
            return grid.__dlpack__(**kw)

        def __dlpack_device__(self):
            return grid.__dlpack_device__()

    for obj in (grid.tolist(), Foreign()):
        m = cf.BlockMask.from_dense(obj, 64, seqlen_q=128, seqlen_k=150)
        np.testing.assert_array_equal(m.blocks[0], grid)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,bs", [(150, 400, (64, 128)), (400, 150, (128, 64)),
                                      (1, 1, 64), (257, 257, 128)])
def test_to_dense_is_block_expansion_and_causal(sq, sk, bs, causal):
    bq, bk = (bs, bs) if isinstance(bs, int) else bs
    grid = rand_blocks((2, -(-sq // bq), -(-sk // bk)), seed=sq + sk)
    m = cf.BlockMask.from_dense(grid, bs, seqlen_q=sq, seqlen_k=sk, causal=causal)
    dense = m.to_dense()
    assert dense.shape == (2, sq, sk) and dense.dtype == bool
    expected = np.zeros((2, sq, sk), bool)
    for h, i, j in np.ndindex(expected.shape):
        expected[h, i, j] = grid[h, i // bq, j // bk] and (not causal or j <= i + sk - sq)
    np.testing.assert_array_equal(dense, expected)
    assert m.density == pytest.approx(expected.mean(), abs=1e-15)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (3, 0), (0, 17), (40, 40),
                                    (100, -1), (-1, 5)])
@pytest.mark.parametrize("sq,sk,tile", [(150, 400, (64, 16)), (400, 150, (16, 64)),
                                        (1, 1, (16, 16)), (97, 97, (32, 32)), (5, 300, (16, 32))])
def test_visible_counts_are_the_band_counted_element_by_element(sq, sk, tile, window):
    """The closed form of masks._visible_counts against _spec.visible summed per tile."""
    tq, tk = tile
    seen = _spec.visible(np.arange(sq), np.arange(sk), sq, sk, window)
    expected = np.array([[seen[i:i + tq, j:j + tk].sum() for j in range(0, sk, tk)]
                         for i in range(0, sq, tq)])
    np.testing.assert_array_equal(masks._visible_counts(tq, tk, sq, sk, window), expected)


def test_density_of_builders_matches_dense_mean():
    for m in (masks.causal(300, 500, 64), masks.causal(500, 300, (128, 64)),
              masks.sliding_window(333, 333, 70, 64), masks.strided(700, 600, 3, 64),
              masks.bigbird(700, 900, 100, 1, 2, seed=3, block_size=64, nheads=2)):
        assert m.density == pytest.approx(m.to_dense().mean(), abs=1e-15)
    assert masks.causal(1024, 1024).density == pytest.approx((1024 * 1025 / 2) / 1024 ** 2)


def test_and_or_are_elementwise():
    a = masks.sliding_window(400, 300, 64, 64)
    b = masks.random(400, 300, 0.5, seed=4, block_size=64, nheads=3)
    c = masks.causal(400, 300, 64)
    for x, y in ((a, b), (b, a), (a, c), (c, b)):
        both = x & y
        np.testing.assert_array_equal(both.to_dense(), x.to_dense() & y.to_dense())
        assert both.causal == (x.causal or y.causal)
        assert both.heads == max(x.heads, y.heads)
    either = a | b
    assert either.heads == 3 and not either.causal
    np.testing.assert_array_equal(either.to_dense(), a.to_dense() | b.to_dense())
    cc = c | (c & b)
    assert cc.causal
    np.testing.assert_array_equal(cc.to_dense(), c.to_dense() | (c & b).to_dense())


def test_or_of_causal_with_non_causal_is_value_error():
    with pytest.raises(ValueError, match="causal mask with a non-causal"):
        masks.causal(256, 256) | masks.sliding_window(256, 256, 10)


@pytest.mark.parametrize("other", [
    lambda: masks.causal(256, 255),
    lambda: masks.causal(256, 256, 64),
    lambda: masks.random(256, 256, 0.5, 0, nheads=3),
])
def test_combining_masks_of_other_geometry_is_value_error(other):
    a = masks.random(256, 256, 0.5, 0, nheads=2)
    for op in (lambda x, y: x & y, lambda x, y: x | y):
        with pytest.raises(ValueError, match="BlockMask"):
            op(a, other())


def test_repr_names_the_geometry():
    r = repr(masks.causal(300, 200, (64, 128)))
    assert r.startswith("BlockMask(") and "seqlen_q=300" in r and "causal=True" in r
    assert "(64, 128)" in r


# --- visiting lists -------------------------------------------------------------------------

def brute_tiles(m, tq, tk, causal):
    """(kept, partial), (heads, nqt, nkt), from the element mask: kept iff the tile holds a
    visible element; partial iff some element of the tile rectangle (rows within seqlen_q,
    all tile_k columns, those past seqlen_k counted as masked) is not visible."""
    eff = cf.BlockMask.from_dense(m.blocks, m.block_size, seqlen_q=m.seqlen_q,
                                  seqlen_k=m.seqlen_k, causal=m.causal or causal)
    dense = eff.to_dense()
    h, sq, sk = dense.shape
    nqt, nkt = -(-sq // tq), -(-sk // tk)
    kept = np.zeros((h, nqt, nkt), bool)
    partial = np.zeros((h, nqt, nkt), bool)
    rows = np.arange(sq)[:, None]
    cols = np.arange(nkt * tk)[None, :]
    causal_eff = m.causal or causal
    # Without the block grid: is every element of the tile visible by bounds and causal?
    visible_no_blocks = (cols < sk) & ((not causal_eff) | (cols <= rows + sk - sq))
    for hh, mt, nt in np.ndindex(kept.shape):
        rs, cs = slice(mt * tq, (mt + 1) * tq), slice(nt * tk, (nt + 1) * tk)
        kept[hh, mt, nt] = dense[hh, rs, cs].any()
        partial[hh, mt, nt] = not visible_no_blocks[rs, cs].all()
    return kept, partial


def lists_to_pairs(idx, count, n_partial, transpose=False):
    """{(h, row, col): partial} from padded lists, checking their order and padding."""
    pairs = {}
    for h, r in np.ndindex(count.shape):
        n, p = int(count[h, r]), int(n_partial[h, r])
        entries = list(idx[h, r, :n])
        assert 0 <= p <= n
        assert entries[:p] == sorted(entries[:p]) and entries[p:] == sorted(entries[p:])
        assert len(set(entries)) == n
        assert (idx[h, r, n:] == 0).all()
        for pos, c in enumerate(entries):
            key = (h, int(c), r) if transpose else (h, r, int(c))
            pairs[key] = pos < p
    return pairs


def check_tile_lists(m, tq, tk, causal):
    t = m.tile_lists(tq, tk, causal, np)
    h = m.heads
    nqt, nkt = -(-m.seqlen_q // tq), -(-m.seqlen_k // tk)
    shapes = [(h, nqt, nkt), (h, nqt), (h, nqt), (h, nkt, nqt), (h, nkt), (h, nkt)]
    for a, shape in zip(t, shapes):
        assert a.shape == shape and a.dtype == np.int32 and a.flags.c_contiguous
    fwd = lists_to_pairs(t.kv_idx, t.kv_count, t.kv_partial)
    bwd = lists_to_pairs(t.q_idx, t.q_count, t.q_partial, transpose=True)
    assert fwd == bwd
    kept, partial = brute_tiles(m, tq, tk, causal)
    assert set(fwd) == set(zip(*map(tuple, np.nonzero(kept))))
    for key, is_partial in fwd.items():
        assert is_partial == partial[key], key
    return t


@pytest.mark.parametrize("call_causal", [False, True])
@pytest.mark.parametrize("mask_causal", [False, True])
@pytest.mark.parametrize("sq,sk,bs", [(1, 1, 64), (128, 128, 128), (100, 300, (64, 128)),
                                      (300, 100, (128, 64)), (257, 129, 64), (70, 600, 128)])
def test_tile_lists_match_brute_force(sq, sk, bs, mask_causal, call_causal):
    bq, bk = (bs, bs) if isinstance(bs, int) else bs
    grid = rand_blocks((2, -(-sq // bq), -(-sk // bk)), seed=sq * sk, density=0.7)
    m = cf.BlockMask.from_dense(grid, bs, seqlen_q=sq, seqlen_k=sk, causal=mask_causal)
    for tq, tk in ((bq, bk), (16, 32), (bq // 2, bk), (32, 16)):
        check_tile_lists(m, tq, tk, call_causal)


def test_block_lists_are_the_tile_lists_at_block_size():
    m = masks.bigbird(500, 700, 100, 1, 2, seed=5, block_size=(64, 128), nheads=2)
    t = check_tile_lists(m, 64, 128, False)
    for name, a in zip(("kv_indices", "kv_counts", "kv_partial", "q_indices", "q_counts",
                        "q_partial"), t):
        np.testing.assert_array_equal(getattr(m, name), a, err_msg=name)


def test_tile_lists_at_64_of_a_128_mask_are_its_expansion():
    m = masks.random(500, 700, 0.5, seed=6, nheads=2)
    t = m.tile_lists(64, 64, False, np)
    kept = np.zeros((2, 8, 11), bool)
    for h, mt in np.ndindex(2, 8):
        kept[h, mt, t.kv_idx[h, mt, :t.kv_count[h, mt]]] = True
    np.testing.assert_array_equal(kept, m.blocks.repeat(2, axis=1).repeat(2, axis=2)[:, :8, :11])
    # Non-causal: only the last key tile (keys 640..699 of 704) needs masking.
    for h, mt in np.ndindex(2, 8):
        visited = t.kv_idx[h, mt, :t.kv_count[h, mt]]
        assert list(visited[:t.kv_partial[h, mt]]) == ([10] if 10 in visited else [])


def test_fully_invisible_blocks_are_dropped():
    # Every block kept, causal, seqlen_q = 512 > seqlen_k = 128: rows 0..383 see no key, so
    # query blocks 0..2 visit nothing; block (3, 0) is the only one left.
    m = cf.BlockMask.from_dense(np.ones((4, 1), bool), seqlen_q=512, seqlen_k=128, causal=True)
    np.testing.assert_array_equal(m.kv_counts[0], [0, 0, 0, 1])
    np.testing.assert_array_equal(m.q_counts[0], [1])
    assert m.q_indices[0, 0, 0] == 3 and m.q_partial[0, 0] == 1
    # A non-causal mask gets the same drop when the call is causal.
    t = cf.BlockMask.from_dense(np.ones((4, 1), bool), seqlen_q=512, seqlen_k=128) \
        .tile_lists(128, 128, True, np)
    np.testing.assert_array_equal(t.kv_count[0], [0, 0, 0, 1])


def test_tile_lists_are_cached():
    m = masks.causal(300, 300, 128)
    assert m.tile_lists(64, 32, False, np) is m.tile_lists(64, 32, False, np)
    # The call's causal is ORed with the mask's.
    assert m.tile_lists(64, 32, False, np) is m.tile_lists(64, 32, True, np)


def _fake_cupy(stream, captured=()):
    """Just what tile_lists uses of CuPy, on NumPy arrays; ``stream[0]`` is the current
    stream's pointer, and the streams in ``captured`` are being captured into a CUDA graph."""
    from types import SimpleNamespace
    runtime = SimpleNamespace(streamIsCapturing=lambda ptr: int(ptr in captured))
    cuda = SimpleNamespace(Device=lambda: SimpleNamespace(id=0), runtime=runtime,
                           get_current_stream=lambda: SimpleNamespace(ptr=stream[0]))
    return SimpleNamespace(__name__="cupy", cuda=cuda, asarray=np.array,
                           ascontiguousarray=np.ascontiguousarray)


def test_device_lists_keep_only_the_most_recently_used_streams():
    """One device copy per stream, reused on that stream; a caller that moves through ever new
    streams must not grow the cache without end, and the stream it keeps using stays cached."""
    m = masks.causal(300, 300, 128)
    stream = [1]
    xp = _fake_cupy(stream)
    kept = m.tile_lists(64, 64, False, xp)
    assert m.tile_lists(64, 64, False, xp) is kept
    first_other = None
    for ptr in range(2, 2 + 3 * masks.DEVICE_LISTS_KEPT):
        stream[0] = ptr
        other = m.tile_lists(64, 64, False, xp)
        first_other = first_other or other
        assert other is not kept
        stream[0] = 1
        assert m.tile_lists(64, 64, False, xp) is kept
        assert len(m._device_lists) <= masks.DEVICE_LISTS_KEPT
    stream[0] = 2
    assert m.tile_lists(64, 64, False, xp) is not first_other, "the oldest copy was kept"
    np.testing.assert_array_equal(m.tile_lists(64, 64, False, xp).kv_idx,
                                  m.tile_lists(64, 64, False, np).kv_idx)


def test_capture_reuses_lists_of_another_stream_and_keeps_them():
    """Inside a CUDA graph capture (its own stream) nothing is copied: the lists an earlier
    call made on another stream serve, and stay with the mask after the recently-used
    eviction has dropped them; with none made yet, a clear error instead of a copy."""
    m = masks.causal(300, 300, 128)
    stream = [1]
    xp = _fake_cupy(stream, captured={99})
    eager = m.tile_lists(64, 64, False, xp)
    stream[0] = 99
    assert m.tile_lists(64, 64, False, xp) is eager
    with pytest.raises(RuntimeError, match="64 x 128 tiles .* before capturing"):
        m.tile_lists(64, 128, False, xp)
    for ptr in range(2, 2 + 2 * masks.DEVICE_LISTS_KEPT):    # evicts stream 1's copy
        stream[0] = ptr
        m.tile_lists(64, 64, False, xp)
    assert all(lst is not eager for lst in m._device_lists.values())
    stream[0] = 99
    assert m.tile_lists(64, 64, False, xp) is eager


@pytest.mark.parametrize("tq,tk,match", [(8, 64, "tile_q"), (96, 64, "tile_q"),
                                         (64, 256, "tile_k"), (64, 48, "tile_k")])
def test_tile_lists_bad_tile_is_value_error(tq, tk, match):
    with pytest.raises(ValueError, match=match):
        masks.causal(300, 300, 128).tile_lists(tq, tk, False, np)


# --- invalid masks --------------------------------------------------------------------------

@pytest.mark.parametrize("bs", [32, 256, 96, (64, 32), (128, 256)])
def test_unsupported_block_size_is_value_error(bs):
    with pytest.raises(ValueError, match="block_size: block_[qk] must be 64 or 128"):
        cf.BlockMask.from_dense(np.ones((1, 1), bool), bs, seqlen_q=10, seqlen_k=10)
    with pytest.raises(ValueError, match="block_size"):
        masks.causal(10, 10, block_size=bs)


@pytest.mark.parametrize("bs", ["128", 128.0, (64, None), True])
def test_non_integer_block_size_is_type_error(bs):
    with pytest.raises(TypeError, match="block_size"):
        masks.causal(10, 10, block_size=bs)


def test_block_size_of_three_is_value_error():
    with pytest.raises(ValueError, match="pair"):
        masks.causal(10, 10, block_size=(64, 64, 64))


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float32])
def test_non_bool_array_is_type_error(dtype):
    with pytest.raises(TypeError, match="^block_mask_bool: dtype must be bool, got"):
        cf.BlockMask.from_dense(np.ones((2, 2), dtype), seqlen_q=256, seqlen_k=256)


@pytest.mark.parametrize("shape", [(2,), (1, 1, 2, 2)])
def test_wrong_ndim_is_value_error(shape):
    with pytest.raises(ValueError, match="^block_mask_bool must be 2-D .* or 3-D"):
        cf.BlockMask.from_dense(np.ones(shape, bool), seqlen_q=256, seqlen_k=256)


@pytest.mark.parametrize("shape", [(2, 3), (3, 2), (1, 2), (4, 2, 3)])
def test_shape_not_matching_seqlens_is_value_error(shape):
    with pytest.raises(ValueError, match=r"must be .* = \(2, 2\)"):
        cf.BlockMask.from_dense(np.ones(shape, bool), seqlen_q=256, seqlen_k=129)


def test_zero_heads_is_value_error():
    with pytest.raises(ValueError, match="heads >= 1"):
        cf.BlockMask.from_dense(np.ones((0, 2, 2), bool), seqlen_q=256, seqlen_k=256)


@pytest.mark.parametrize("sq,sk,name", [(0, 10, "seqlen_q"), (10, -1, "seqlen_k")])
def test_bad_seqlen_is_value_error(sq, sk, name):
    with pytest.raises(ValueError, match=f"{name} must be >= 1"):
        masks.causal(sq, sk)


@pytest.mark.parametrize("build,match", [
    (lambda: masks.random(256, 256, -0.1, 0), "density must be in"),
    (lambda: masks.random(256, 256, 1.5, 0), "density must be in"),
    (lambda: masks.sliding_window(256, 256, 0), "window must be >= 1"),
    (lambda: masks.longformer(256, 256, 0, 1), "window must be >= 1"),
    (lambda: masks.longformer(256, 256, 4, -1), "global_blocks must be >= 0"),
    (lambda: masks.strided(256, 256, 0), "stride must be >= 1"),
    (lambda: masks.bigbird(256, 256, 4, 1, -2, seed=0), "random_blocks must be >= 0"),
    (lambda: masks.random(256, 256, 0.5, 0, nheads=0), "nheads must be >= 1"),
])
def test_bad_builder_argument_is_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_non_number_density_is_type_error():
    with pytest.raises(TypeError, match="density"):
        masks.random(256, 256, "0.5", 0)


def test_check_block_mask_errors():
    q = np.zeros((1, 200, 4, 8))
    k = np.zeros((1, 300, 2, 8))
    _validate.check_block_mask(masks.causal(200, 300), q, k)
    _validate.check_block_mask(masks.random(200, 300, 0.5, 0, nheads=4), q, k)
    with pytest.raises(TypeError, match="block_mask must be a cupyflash.BlockMask"):
        _validate.check_block_mask(np.ones((2, 3), bool), q, k)
    with pytest.raises(ValueError, match="seqlen_q 201 does not match q's seqlen_q 200"):
        _validate.check_block_mask(masks.causal(201, 300), q, k)
    with pytest.raises(ValueError, match="seqlen_k 299 does not match k's seqlen_k 300"):
        _validate.check_block_mask(masks.causal(200, 299), q, k)
    with pytest.raises(ValueError, match=r"heads must be 1 or q's nheads \(4\), got 2"):
        _validate.check_block_mask(masks.random(200, 300, 0.5, 0, nheads=2), q, k)


# --- the NumPy path with a block mask -------------------------------------------------------

def api_takes_block_mask():
    params = inspect.signature(cf.flash_attention).parameters
    params_bwd = inspect.signature(cf.flash_attention_backward).parameters
    return "block_mask" in params and "block_mask" in params_bwd


def run_backend(q, k, v, dout, scale, causal, mask):
    spec = _spec.CallSpec.of(q, causal=causal or mask.causal, block_mask=mask)
    out, lse = _numpy_backend.forward(q, k, v, scale, spec, block_mask=mask)
    grads = _numpy_backend.backward(dout, q, k, v, out, lse, scale, spec, block_mask=mask)
    return out, lse, grads


def run_api(q, k, v, dout, scale, causal, mask):
    if not api_takes_block_mask():
        pytest.skip("flash_attention does not take block_mask yet")
    out, lse = cf.flash_attention(q, k, v, causal=causal, softmax_scale=scale,
                                  block_mask=mask, return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                        softmax_scale=scale, block_mask=mask)
    return out, lse, grads


RUNNERS = {"backend": run_backend, "api": run_api}


def check_masked(runner, mask, b, h, hk, d, causal, seed, dtype=np.float64):
    sq, sk = mask.seqlen_q, mask.seqlen_k
    q, k, v = random_inputs(np, (b, sq, h, d), (b, sk, hk, d), dtype, seed)
    dout = random_array(np, q.shape, dtype, seed + 5)
    scale = d ** -0.5
    # No NaN-making operation or division by zero (fp16 casts may underflow, harmlessly).
    with np.errstate(invalid="raise", divide="raise"):
        out, lse, grads = RUNNERS[runner](q, k, v, dout, scale, causal, mask)
    dense = mask.to_dense()
    out_ref, lse_ref = attention_ref(q, k, v, scale, causal, mask=dense)
    grads_ref = attention_ref_backward(dout, q, k, v, scale, causal, mask=dense)
    for a in (out, lse) + tuple(grads):
        assert not np.isnan(a).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    if dtype == np.float64:
        assert rel_err(out, out_ref) < F64_REL
        assert rel_err(lse, lse_ref) < F64_REL
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            assert g.shape == g_ref.shape
            assert rel_err(g, g_ref) < F64_REL, name
    else:
        out_naive, lse_naive = attention_naive(q, k, v, scale, causal, dtype, mask=dense)
        assert_rule("out", out, out_ref, out_naive, 2)
        assert_rule("lse", lse, lse_ref, lse_naive, 2)
        grads_naive = attention_naive_backward(dout, q, k, v, scale, causal, dtype, mask=dense)
        magnitude = max(float(np.abs(g).max()) for g in grads_ref)
        for name, g, g_ref, g_naive in zip(("dq", "dk", "dv"), grads, grads_ref, grads_naive):
            assert_rule(name, g, g_ref, g_naive, 3, magnitude)
    return out, lse, grads


@pytest.mark.parametrize("runner", ["backend", "api"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,bs", [(300, 300, 64), (97, 261, (64, 128)),
                                      (261, 97, (128, 64)), (1, 130, 64), (130, 1, 64)])
def test_shared_random_mask_matches_masked_reference(runner, sq, sk, bs, causal):
    mask = masks.random(sq, sk, 0.6, seed=sq + sk, block_size=bs)
    check_masked(runner, mask, 2, 2, 2, 16, causal, seed=sq)


@pytest.mark.parametrize("runner", ["backend", "api"])
@pytest.mark.parametrize("causal", [False, True])
def test_per_head_mask_with_gqa(runner, causal):
    mask = masks.bigbird(300, 400, 70, 1, 1, seed=9, block_size=64, nheads=4)
    check_masked(runner, mask, 2, 4, 2, 8, causal, seed=30)


@pytest.mark.parametrize("runner", ["backend", "api"])
def test_per_head_mask_with_mqa(runner):
    mask = masks.random(200, 150, 0.5, seed=10, block_size=64, nheads=3)
    check_masked(runner, mask, 1, 3, 1, 8, True, seed=31)


@pytest.mark.parametrize("runner", ["backend", "api"])
@pytest.mark.parametrize("sq,sk", [(200, 330), (330, 200), (129, 129)])
def test_sliding_window_with_causal_call(runner, sq, sk):
    check_masked(runner, masks.sliding_window(sq, sk, 50, 64), 1, 2, 1, 8, True, seed=sq)


@pytest.mark.parametrize("runner", ["backend", "api"])
@pytest.mark.parametrize("sq,sk", [(200, 330), (330, 200), (17, 17)])
def test_causal_mask_equals_dense_causal(runner, sq, sk):
    q, k, v = random_inputs(np, (1, sq, 2, 8), (1, sk, 2, 8), np.float64, seed=40)
    dout = random_array(np, q.shape, np.float64, seed=41)
    out, lse, grads = RUNNERS[runner](q, k, v, dout, 8 ** -0.5, False, masks.causal(sq, sk, 64))
    spec = _spec.CallSpec.of(q, causal=True)
    out_d, lse_d = _numpy_backend.forward(q, k, v, 8 ** -0.5, spec)
    grads_d = _numpy_backend.backward(dout, q, k, v, out_d, lse_d, 8 ** -0.5, spec)
    assert rel_err(out, out_d) < F64_REL and rel_err(lse, lse_d) < F64_REL
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_d))
    for g, g_d in zip(grads, grads_d):
        assert rel_err(g, g_d) < F64_REL


@pytest.mark.parametrize("runner", ["backend", "api"])
def test_rows_without_keys_are_zero_and_lse_neg_inf(runner):
    grid = np.ones((2, 3, 2), bool)
    grid[0, 1] = False                      # head 0: query block 1 sees nothing
    grid[1, :, 1] = False                   # head 1: key block 1 is seen by no query
    grid[1, 2] = False
    mask = cf.BlockMask.from_dense(grid, 64, seqlen_q=150, seqlen_k=100)
    out, lse, (dq, dk, dv) = check_masked(runner, mask, 2, 2, 2, 8, False, seed=50)
    assert (out[:, 64:128, 0] == 0).all() and np.isneginf(lse[:, 0, 64:128]).all()
    assert (dq[:, 64:128, 0] == 0).all()
    assert (out[:, 128:, 1] == 0).all() and np.isneginf(lse[:, 1, 128:]).all()
    assert np.isfinite(lse[:, 0, :64]).all() and np.isfinite(lse[:, 1, :128]).all()


@pytest.mark.parametrize("runner", ["backend", "api"])
def test_empty_mask_gives_zeros(runner):
    mask = masks.random(100, 100, 0.0, seed=0, block_size=64)
    out, lse, grads = check_masked(runner, mask, 1, 2, 2, 8, True, seed=51)
    assert (out == 0).all() and np.isneginf(lse).all()
    for g in grads:
        assert (g == 0).all()


@pytest.mark.parametrize("runner", ["backend", "api"])
def test_causal_mask_rows_without_keys(runner):
    # seqlen_q > seqlen_k under a causal mask: the first 100 rows see no key.
    mask = masks.longformer(230, 130, 40, 1, block_size=64) & masks.causal(230, 130, 64)
    out, lse, _ = check_masked(runner, mask, 1, 2, 2, 8, False, seed=52)
    assert (out[:, :100] == 0).all() and np.isneginf(lse[:, :, :100]).all()


@pytest.mark.parametrize("runner", ["backend", "api"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_low_precision_masked_follows_the_rule(runner, dtype):
    mask = masks.strided(200, 260, 2, 64) & masks.random(200, 260, 0.8, seed=3, block_size=64)
    check_masked(runner, mask, 1, 4, 2, 16, True, seed=60, dtype=np.dtype(dtype))


def test_api_rejects_mismatched_mask():
    if not api_takes_block_mask():
        pytest.skip("flash_attention does not take block_mask yet")
    q, k, v = random_inputs(np, (1, 100, 2, 8), (1, 120, 2, 8), np.float32, seed=70)
    with pytest.raises(ValueError, match="seqlen_k"):
        cf.flash_attention(q, k, v, block_mask=masks.causal(100, 121))
    with pytest.raises(TypeError, match="BlockMask"):
        cf.flash_attention(q, k, v, block_mask=np.ones((2, 2), bool))
    with pytest.raises(ValueError, match="heads"):
        cf.flash_attention(q, k, v, block_mask=masks.random(100, 120, 0.5, 0, nheads=3))


def test_hopper_passes_group_mask_mods_whose_tiles_are_causal_like():
    """``_launch.sm90_grouped``: a mask_mod's forward tiles are drawn longest first in launch
    groups where no later query block of its block mask sees fewer key blocks than an earlier
    one and some see more, its dK/dV pass's where no later key block is seen by more query
    blocks and some by fewer (causal-like), else in order; without a mask_mod, in order."""
    from cupyflash import _launch
    s = 1024
    spec = _spec.CallSpec(dtype="bfloat16", headdim=128, mask_mod=True)
    assert _launch.sm90_grouped(spec, masks.causal(s, s))
    assert not _launch.sm90_grouped(_spec.CallSpec(dtype="bfloat16", headdim=128), masks.causal(s, s))
    prefix = np.tri(8, dtype=bool)
    prefix[:, :2] = True   # every row sees the first two blocks
    assert _launch.sm90_grouped(spec, masks.BlockMask(prefix, seqlen_q=s, seqlen_k=s))
    assert not _launch.sm90_grouped(spec, masks.BlockMask(np.ones((8, 8), bool), seqlen_q=s, seqlen_k=s))
    shrinking = np.tri(8, dtype=bool)[::-1]
    assert not _launch.sm90_grouped(spec, masks.BlockMask(shrinking, seqlen_q=s, seqlen_k=s))
    per_head = np.stack([np.tri(8, dtype=bool), np.tri(8, dtype=bool)[::-1]])
    assert not _launch.sm90_grouped(spec, masks.BlockMask(per_head, seqlen_q=s, seqlen_k=s))
    assert not _launch.sm90_grouped(spec, None)
    # The dK/dV pass: the key blocks' counts of query blocks.
    for mask in (masks.causal(s, s), masks.BlockMask(prefix, seqlen_q=s, seqlen_k=s)):
        assert _launch.sm90_grouped(spec, mask, backward=True)
    upper = np.tri(8, dtype=bool).T   # later key blocks seen by more rows: rows shrink too
    for mask in (masks.BlockMask(upper, seqlen_q=s, seqlen_k=s), masks.BlockMask(np.ones((8, 8), bool), seqlen_q=s, seqlen_k=s)):
        assert not _launch.sm90_grouped(spec, mask, backward=True)
    per_head = np.stack([np.tri(8, dtype=bool), upper])
    assert not _launch.sm90_grouped(spec, masks.BlockMask(per_head, seqlen_q=s, seqlen_k=s), backward=True)
    # Rows that grow by keys on the left: the last key blocks are seen by the most rows.
    left = np.tri(8, dtype=bool)[:, ::-1]
    assert _launch.sm90_grouped(spec, masks.BlockMask(left, seqlen_q=s, seqlen_k=s))
    assert not _launch.sm90_grouped(spec, masks.BlockMask(left, seqlen_q=s, seqlen_k=s), backward=True)
