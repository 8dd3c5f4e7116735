"""``cupyflash.flash_attention_with_kvcache``: appends into contiguous and paged caches, then
attention over each entry's valid prefix, against a dense call (NumPy, exact: the cache path
gathers and runs the same tiles) and the float64 reference (GPU, FlashAttention's rule); page
sizes 16 and 256 with shuffled page tables, lengths 0 and at capacity, one query (decoding) and
several (chunked prefill, causal), GQA, every split count from 1 to many and the automatic one,
the score variants. Bad lengths, pages and index dtypes raise before anything is written: the
caches are compared with their copies."""
import numpy as np
import pytest

import cupyflash as cf
from reference import attention_ref, random_array, rel_err


def make_cache(xp, dtype, batch, hk, d, paged, page_size, capacity, seed):
    """k_cache, v_cache (random: unused rows hold garbage, never zeros) and the block table
    (None for a contiguous cache; else a shuffled table over more pages than are used)."""
    if not paged:
        shape = (batch, capacity, hk, d)
        return random_array(xp, shape, dtype, seed), random_array(xp, shape, dtype, seed + 1), None
    per_seq = -(-capacity // page_size)
    pages = batch * per_seq + 3
    shape = (pages, page_size, hk, d)
    order = np.random.default_rng(seed).permutation(pages)[:batch * per_seq].reshape(batch, per_seq)
    return (random_array(xp, shape, dtype, seed), random_array(xp, shape, dtype, seed + 1),
            xp.asarray(order.astype(np.int32)))


def entry_keys(xp, k_cache, v_cache, table, b, n):
    """Entry b's first n keys and values, (1, n, hk, d)."""
    rows = np.arange(n)
    if table is None:
        return k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
    t = np.asarray(table if isinstance(table, np.ndarray) else table.get())
    page, off = xp.asarray(t[b, rows // k_cache.shape[1]]), xp.asarray(rows % k_cache.shape[1])
    return k_cache[page, off][None], v_cache[page, off][None]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_equals_dense_over_the_prefix(paged, causal):
    batch, sq, h, hk, d, new = 3, 3, 4, 2, 16, 2
    k_cache, v_cache, table = make_cache(np, np.float64, batch, hk, d, paged, 16, 48, 1)
    q = random_array(np, (batch, sq, h, d), np.float64, 5)
    k, v = (random_array(np, (batch, new, hk, d), np.float64, s) for s in (6, 7))
    seqlens = np.array([0, 17, 46], np.int32)      # the last ends at the capacity
    out, lse = cf.flash_attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                               block_table=table, causal=causal, return_lse=True)
    for b in range(batch):
        n = seqlens[b] + new
        kb, vb = entry_keys(np, k_cache, v_cache, table, b, n)
        assert np.array_equal(kb[0, seqlens[b]:], k[b]) and np.array_equal(vb[0, seqlens[b]:], v[b])
        o, l = cf.flash_attention(q[b:b + 1], kb, vb, causal=causal, return_lse=True)
        assert np.array_equal(out[b], o[0]) and np.array_equal(lse[b], l[0]), b


def test_numpy_int_lengths_and_no_keys():
    """cache_seqlens as an int; an empty cache without an append: out 0, lse -inf."""
    k_cache, v_cache, _ = make_cache(np, np.float64, 2, 1, 8, False, 16, 8, 0)
    q = random_array(np, (2, 1, 2, 8), np.float64, 3)
    out, lse = cf.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=0, return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()
    out, lse = cf.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=8, return_lse=True)
    ref, ref_lse = attention_ref(q, k_cache, v_cache, 8 ** -0.5, False)
    assert rel_err(out, ref) < 1e-12 and rel_err(lse, ref_lse) < 1e-12


def _bad_call(**change):
    k_cache, v_cache, table = make_cache(np, np.float32, 2, 2, 16, True, 16, 32, 0)
    args = dict(q=random_array(np, (2, 1, 4, 16), np.float32, 1), k_cache=k_cache, v_cache=v_cache,
                k=random_array(np, (2, 2, 2, 16), np.float32, 2), v=random_array(np, (2, 2, 2, 16), np.float32, 3),
                cache_seqlens=np.array([3, 5], np.int32), block_table=table)
    args.update(change)
    return args


@pytest.mark.parametrize("change,err,match", [
    (dict(cache_seqlens=np.array([3, 31], np.int32)), ValueError,
     r"the cache is too small for the append: entry 1 would hold 33 keys .* its capacity is 32"),
    (dict(cache_seqlens=np.array([3, -1], np.int32)), ValueError, r"cache_seqlens\[1\] = -1 must be >= 0"),
    (dict(block_table=np.array([[0, 99], [1, 2]], np.int32), cache_seqlens=np.array([20, 5], np.int32)),
     ValueError, r"block_table\[0, 1\] = 99 is out of range for 7 pages"),
    (dict(block_table=np.array([[0, 1], [2, 3]], np.int64)), TypeError, "block_table: dtype must be int32"),
    (dict(cache_seqlens=np.array([3, 5], np.int64)), TypeError, "cache_seqlens: dtype must be int32"),
    (dict(cache_seqlens=np.array([3], np.int32)), ValueError, r"cache_seqlens shape \(1,\) must be \(batch,\)"),
    (dict(block_table=np.zeros((3, 2), np.int32)), ValueError, r"block_table shape \(3, 2\) must be \(batch"),
    (dict(v=None), ValueError, "k and v must be given together"),
    (dict(k=np.zeros((2, 2, 2, 8), np.float32)), ValueError, r"k shape \(2, 2, 2, 8\) must be"),
], ids=["too-small", "negative", "page-out-of-range", "table-dtype", "lengths-dtype", "lengths-shape",
        "table-shape", "k-without-v", "k-shape"])
def test_bad_input_raises_and_leaves_the_cache(change, err, match):
    args = _bad_call(**change)
    before = args["k_cache"].copy(), args["v_cache"].copy()
    with pytest.raises(err, match=match):
        cf.flash_attention_with_kvcache(**args)
    assert np.array_equal(args["k_cache"], before[0]) and np.array_equal(args["v_cache"], before[1])


def test_numpy_lengths_are_checked_even_unchecked():
    """NumPy inputs read their lengths for free: check_lengths=False still checks them."""
    args = _bad_call(cache_seqlens=np.array([3, 31], np.int32))
    with pytest.raises(ValueError, match="the cache is too small for the append"):
        cf.flash_attention_with_kvcache(**args, check_lengths=False)
    with pytest.raises(TypeError, match="check_lengths must be a bool"):
        cf.flash_attention_with_kvcache(**_bad_call(), check_lengths=None)


def test_page_size_must_be_a_multiple_of_16():
    k_cache = np.zeros((4, 24, 1, 8), np.float32)
    with pytest.raises(ValueError, match=r"page_size 24 \(axis 1\) must be a multiple of 16"):
        cf.flash_attention_with_kvcache(np.zeros((1, 1, 1, 8), np.float32), k_cache, k_cache, cache_seqlens=1,
                                        block_table=np.zeros((1, 2), np.int32))


def test_decode_splits_requested_capped_and_chosen():
    from cupyflash import _launch
    assert _launch.decode_splits(8, 10 ** 6, 264, requested=1000) == _launch.DECODE_MAX_SPLITS
    assert _launch.decode_splits(8, 100, 264, requested=5) == 2     # two 64-key steps
    assert _launch.decode_splits(512, 8192, 264) == 1               # the batch fills the GPU
    for keys in (1024, 8192, 32768, 131072, 10 ** 6):
        n = _launch.decode_splits(8, keys, 264)
        assert 1 <= n <= _launch.DECODE_MAX_SPLITS and 8 * n <= 264, (keys, n)


# --- GPU ------------------------------------------------------------------------------------

cp = None
try:
    import cupy as cp  # noqa: F811
    from gpu_checks import DTYPES, Case, check_forward, seed_of
except ImportError:
    pass


def run_gpu(dtype, batch, sq, h, hk, d, paged, page_size, capacity, seqlens, new, request, causal=False,
            num_splits=0, **variant):
    k_cache, v_cache, table = make_cache(cp, DTYPES[dtype], batch, hk, d, paged, page_size, capacity,
                                         seed_of(request))
    q = random_array(cp, (batch, sq, h, d), DTYPES[dtype], seed_of(request) + 7)
    k = v = None
    if new:
        k, v = (random_array(cp, (batch, new, hk, d), DTYPES[dtype], seed_of(request) + s) for s in (8, 9))
    lens = cp.asarray(np.asarray(seqlens, np.int32))
    scale = d ** -0.5
    out, lse = cf.flash_attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, block_table=table,
                                               causal=causal, num_splits=num_splits, return_lse=True, **variant)
    for b in range(batch):
        n = int(seqlens[b]) + new
        kb, vb = entry_keys(cp, k_cache, v_cache, table, b, n)
        if new:
            assert bool((kb[0, seqlens[b]:].view(cp.uint8) == k[b].view(cp.uint8)).all()), f"k not appended, entry {b}"
            assert bool((vb[0, seqlens[b]:].view(cp.uint8) == v[b].view(cp.uint8)).all()), f"v not appended, entry {b}"
        if n == 0:
            assert not bool(out[b].astype(cp.float32).any()) and bool(cp.isneginf(lse[b]).all())
            continue
        ref_variant = dict(variant)
        if variant.get("alibi_slopes") is not None:
            ref_variant["alibi_slopes"] = variant["alibi_slopes"][b] if variant["alibi_slopes"].ndim == 2 \
                else variant["alibi_slopes"]
        check_forward(Case(dtype, sq, n, d, causal, 1, h, hk), q[b:b + 1], kb, vb, out[b:b + 1], lse[b:b + 1],
                      scale, **ref_variant)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("paged,page_size", [(False, 0), (True, 16), (True, 256)],
                         ids=["contiguous", "page16", "page256"])
@pytest.mark.parametrize("num_splits", [0, 1, 3, 64])
def test_gpu_decode(dtype, paged, page_size, num_splits, request):
    """One new token per entry (decoding), GQA 8 / 2, lengths from 0 (the append alone) to
    the capacity, the splits' counts from one to more than the keys' steps."""
    run_gpu(dtype, 4, 1, 8, 2, 128, paged, page_size or 16, 1024, [0, 1, 700, 1023], 1, request,
            num_splits=num_splits)


@pytest.mark.gpu
def test_gpu_decode_merge_is_the_split_pass_dependent(monkeypatch, request):
    """From sm_90 on the merge kernel is launched as the split pass's programmatic dependent
    (it may start beside the pass's blocks and waits for their parts itself); before, the
    ordinary way. Its results are checked as every split decode's."""
    from cupyflash import _driver
    grids, launch = [], _driver.launch_dependent

    def spy(function, grid, *rest):
        grids.append(tuple(grid))
        return launch(function, grid, *rest)
    monkeypatch.setattr(_driver, "launch_dependent", spy)
    run_gpu("bf16", 2, 1, 8, 2, 128, False, 0, 4096, [4000, 4096], 0, request, num_splits=16)
    assert grids == ([(1, 8, 2)] if int(cp.cuda.Device().compute_capability) >= 90 else [])


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_unchecked_lengths_are_not_read(paged, request, monkeypatch):
    """check_lengths=False: the lengths and the table are never read to the host (the check
    is never reached); the appended caches, out and lse are the bits of a checked call's (the
    grids then cover the capacity, which the longest entry fills here, so that both calls
    split the keys alike). Inputs only the host gather takes refuse it before anything is
    written."""
    from gpu_checks import seed_of
    from cupyflash import _validate
    made = [make_cache(cp, DTYPES["bf16"], 3, 2, 128, paged, 16, 1000, seed_of(request)) for _ in range(2)]
    q = random_array(cp, (3, 1, 8, 128), DTYPES["bf16"], 5)
    k, v = (random_array(cp, (3, 1, 2, 128), DTYPES["bf16"], s) for s in (6, 7))
    lens = cp.asarray(np.array([0, 517, 999], np.int32))
    results = []
    for check, (k_cache, v_cache, table) in zip((True, False), made):
        if not check:
            monkeypatch.setattr(_validate, "check_cache_lengths", lambda *a: pytest.fail("lengths were read"))
        results.append(cf.flash_attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens,
                                                       block_table=table, return_lse=True, check_lengths=check)
                       + (k_cache, v_cache))
    for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), *results):
        assert bool((a.view(cp.uint8) == b.view(cp.uint8)).all()), name
    k_cache, v_cache, table = made[0]
    q32, k32 = q.astype(cp.float32), k_cache.astype(cp.float32)
    before = k32.copy()
    with pytest.raises(ValueError, match="check_lengths=False cannot skip the read"):
        cf.flash_attention_with_kvcache(q32, k32, k32, k=k.astype(cp.float32), v=v.astype(cp.float32),
                                        cache_seqlens=lens, block_table=table, check_lengths=False)
    assert bool((k32 == before).all())


@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 256])
def test_gpu_decode_most_splits(d, request):
    """num_splits past the cap runs DECODE_MAX_SPLITS splits: the merge's lse pass then takes
    more than one split per thread at head dim 32 (64 threads)."""
    run_gpu("bf16", 1, 1, 4, 1, d, False, 0, 8300, [8199], 1, request, num_splits=1000)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 64, 96, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_chunked_prefill(d, causal, request):
    """Five queries and five new keys per entry, one kv head for 6 query heads (30 packed rows:
    two row chunks), without new keys in the second call."""
    run_gpu("bf16", 2, 5, 6, 1, d, True, 16, 300, [17, 290], 5, request, causal=causal)
    run_gpu("fp16", 2, 5, 6, 1, d, False, 0, 300, [0, 131], 0, request, causal=causal, num_splits=2)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [40, 120])
def test_gpu_decode_head_dim_below_bucket(d, request):
    """Head dims between the buckets (64 and 128 hold them): the kernels' columns past the
    head dim, in Q, K and V alike, are zeros, with partial row tiles and splits."""
    run_gpu("bf16", 3, 1, 8, 2, d, True, 16, 600, [5, 300, 598], 1, request, num_splits=2)
    run_gpu("fp16", 2, 2, 4, 2, d, False, 0, 300, [0, 299], 1, request, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["window", "softcap", "alibi"])
def test_gpu_decode_variants(name, request):
    variant = {"window": {"window_size": (100, 0)}, "softcap": {"softcap": 5.0},
               "alibi": {"alibi_slopes": cp.asarray(np.random.default_rng(0).uniform(0.01, 0.2, (3, 8))
                                                    .astype(np.float32))}}[name]
    run_gpu("bf16", 3, 2, 8, 4, 64, True, 16, 600, [5, 300, 598], 2, request, causal=True, **variant)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_gpu_other_dtypes_gather(dtype, request):
    """float32/float64 caches: gathered into a packed batch (flash_attention_varlen)."""
    run_gpu(dtype, 2, 3, 4, 2, 64, True, 16, 100, [10, 90], 3, request, causal=True)
