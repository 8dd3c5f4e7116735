"""Ring attention (cupyflash.distributed): the ranks as threads of one process (LocalRing), on
NumPy arrays (CI) and on one GPU, against one call over the full sequence and the float64
reference. The NCCL adapters need two GPUs: tests/test_distributed_nccl.py."""
import threading

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import distributed as cfd
from gpu_checks import BWD_FACTOR, DTYPES, FWD_FACTOR, Case, check_backward, check_forward, seed_of
from reference import (assert_rule, attention_naive, attention_naive_backward, attention_ref,
                       attention_ref_backward, random_array)


def run_ranks(world, fn):
    """``fn(rank, group)`` in one thread per rank of a LocalRing; the results by rank. A rank's
    error is raised here (the others then stop at their next exchange)."""
    ring = cfd.LocalRing(world)
    results, errors = [None] * world, []

    def body(rank):
        try:
            results[rank] = fn(rank, ring.member(rank))
        except BaseException as e:  # noqa: B902 (handed to the main thread)
            errors.append(e)
            ring._barrier.abort()
    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def ring_call(world, layout, q, k, v, dout, **kw):
    """Forward and backward over ``world`` ranks: the full out, lse, dq, dk, dv, unsharded."""
    def rank(r, group):
        def sh(x):
            return cfd.shard(x, r, world, layout=layout)
        out, lse = cfd.ring_attention(sh(q), sh(k), sh(v), group, layout=layout, return_lse=True, **kw)
        grads = cfd.ring_attention_backward(sh(dout), sh(q), sh(k), sh(v), out, lse, group, layout=layout, **kw)
        return (out, lse) + tuple(grads)
    results = run_ranks(world, rank)
    return [cfd.unshard([r[i] for r in results], axis=2 if i == 1 else 1, layout=layout) for i in range(5)]


def inputs(xp, dtype, batch, seqlen, h, hk, d, seed):
    shapes = [(batch, seqlen, h, d), (batch, seqlen, hk, d), (batch, seqlen, hk, d), (batch, seqlen, h, d)]
    return [random_array(xp, s, dtype, seed + i) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_ring_equals_one_call(world, layout, causal):
    """float64: the ring's out, lse and gradients are those of one call over the whole sequence
    to rounding (chunks of 5 rows, GQA 4 / 2)."""
    per = 2 if layout == "zigzag" else 1
    q, k, v, dout = inputs(np, np.float64, 2, world * per * 5, 4, 2, 16, 10 * world + causal)
    out, lse = cf.flash_attention(q, k, v, causal=causal, return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=causal)
    got = ring_call(world, layout, q, k, v, dout, causal=causal)
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, (out, lse) + tuple(grads)):
        assert g.dtype == ref.dtype and g.shape == ref.shape, name
        np.testing.assert_allclose(g, ref, rtol=1e-11, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("world,layout", [(1, "zigzag"), (2, "zigzag"), (3, "zigzag"), (4, "zigzag"),
                                          (3, "contiguous")])
@pytest.mark.parametrize("window_size,causal", [
    ((3, 0), False), ((3, 2), False), ((0, 0), False), ((12, -1), False), ((-1, 7), False),
    ((6, 9), True), ((11, 4), False), ((17, 31), False), ((40, 40), False)])
def test_numpy_ring_window_equals_one_call(world, layout, window_size, causal):
    """float64, windows narrower than a chunk (5 rows), across several chunks, one-sided and
    wider than the sequence: out, lse and gradients are one call's over the whole sequence."""
    per = 2 if layout == "zigzag" else 1
    q, k, v, dout = inputs(np, np.float64, 1, world * per * 5, 2, 1, 8, 7 * world + window_size[0])
    kw = dict(causal=causal, window_size=window_size)
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, **kw)
    got = ring_call(world, layout, q, k, v, dout, **kw)
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, (out, lse) + tuple(grads)):
        np.testing.assert_allclose(g, ref, rtol=1e-11, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("head_groups,world,causal,window_size", [
    (2, 2, True, (-1, -1)), (4, 3, False, (-1, -1)), (2, 3, False, (6, 9)), (4, 1, True, (-1, -1))])
def test_numpy_ring_head_groups_equal_one_call(head_groups, world, causal, window_size):
    """float64, GQA 8 / 4: heads in groups, one ring each (every group's query heads those of
    its KV heads), give one call's out, lse and gradients over the whole sequence."""
    q, k, v, dout = inputs(np, np.float64, 2, world * 2 * 5, 8, 4, 16, 3 * world + head_groups)
    kw = dict(causal=causal, window_size=window_size)
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, **kw)
    got = ring_call(world, "zigzag", q, k, v, dout, head_groups=head_groups, **kw)
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, (out, lse) + tuple(grads)):
        assert g.dtype == ref.dtype and g.shape == ref.shape, name
        np.testing.assert_allclose(g, ref, rtol=1e-11, atol=1e-12, err_msg=name)


def test_default_head_groups():
    """None: the most groups (a divisor of nheads_k) whose k shards keep GROUP_BYTES; GQA's
    query heads go with their KV head."""
    g = cfd.GROUP_BYTES
    assert len(cfd._head_groups(16, 16, g - 1, None)) == 1
    assert len(cfd._head_groups(16, 16, 16 * g, None)) == 16
    assert len(cfd._head_groups(16, 16, 5 * g, None)) == 4
    assert len(cfd._head_groups(16, 16, 1000 * g, None)) == 16
    assert cfd._head_groups(8, 2, 2 * g, None) == [(slice(0, 4), slice(0, 1)), (slice(4, 8), slice(1, 2))]
    assert cfd._head_groups(6, 3, 0, 3)[2] == (slice(4, 6), slice(2, 3))


def test_window_calls_reach_only_the_band():
    """Each windowed call's rows and keys are exactly the pairs the band reaches: over all
    ranks and steps, the visible pairs (window inside each call, bottom-right aligned) are the
    band of the whole sequence, each once."""
    from cupyflash import _spec
    world, c = 3, 7
    n = 2 * world * c
    for band in [(4, 0), (9, 3), (0, 12), (-1, 5), (15, -1)]:
        seen = np.zeros((n, n), int)
        for rank in range(world):
            mine = cfd.chunks_of(rank, world)
            for step in range(world):
                theirs = cfd.chunks_of((rank - step) % world, world)
                for q0, q1, k0, k1, window in cfd._plan(mine, theirs, c, band):
                    rows = [mine[i // c] * c + i % c for i in range(q0, q1)]
                    keys = [theirs[j // c] * c + j % c for j in range(k0, k1)]
                    hit = _spec.visible(range(q1 - q0), range(k1 - k0), q1 - q0, k1 - k0, window)
                    assert hit.any(axis=1).all(), f"{band}: rows that see nothing in a call"
                    seen[np.ix_(rows, keys)] += hit
        want = _spec.visible(range(n), range(n), n, n, band)
        np.testing.assert_array_equal(seen, want.astype(int), err_msg=str(band))


def test_numpy_ring_softcap_and_scale():
    q, k, v, dout = inputs(np, np.float64, 1, 3 * 2 * 7, 2, 1, 8, 5)
    kw = dict(causal=True, softcap=2.0, softmax_scale=0.3)
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, **kw)
    got = ring_call(3, "zigzag", q, k, v, dout, **kw)
    for g, ref in zip(got, (out, lse) + tuple(grads)):
        np.testing.assert_allclose(g, ref, rtol=1e-11, atol=1e-12)


def assert_ring_under_the_rule(got, q, k, v, dout, causal, **variant):
    """The ring's out, lse, dq, dk, dv (bf16 inputs) against the float64 reference by the
    tolerance rule."""
    scale = q.shape[-1] ** -0.5
    out_ref, lse_ref = attention_ref(q, k, v, scale, causal, **variant)
    out_naive, lse_naive = attention_naive(q, k, v, scale, causal, "bfloat16", **variant)
    assert_rule("out", got[0], out_ref, out_naive, FWD_FACTOR)
    assert_rule("lse", got[1], lse_ref, lse_naive, FWD_FACTOR)
    refs = attention_ref_backward(dout, q, k, v, scale, causal, **variant)
    naives = attention_naive_backward(dout, q, k, v, scale, causal, "bfloat16", **variant)
    magnitude = max(float(abs(r).max()) for r in refs)
    for name, g, ref, naive in zip(("dq", "dk", "dv"), got[2:], refs, naives):
        assert_rule(name, g, ref, naive, BWD_FACTOR, magnitude)


@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (20, 9))])
def test_numpy_ring_bf16_under_the_rule(causal, window_size):
    """bf16 through the NumPy path: out, lse and gradients against the float64 reference by the
    tolerance rule (the parts are rounded to bf16 and added up in float32)."""
    q, k, v, dout = inputs(np, DTYPES["bf16"], 1, 4 * 2 * 9, 4, 2, 32, 21 + causal)
    got = ring_call(4, "zigzag", q, k, v, dout, causal=causal, window_size=window_size)
    assert_ring_under_the_rule(got, q, k, v, dout, causal, window_size=window_size)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_steps_are_balanced(world):
    """Causal zigzag: at every step every rank's calls cover the same number of visible
    (query, key) pairs (2c^2 + c at the first step, its own shard's causal triangle; 2c^2
    after), and over all steps the pairs are exactly the causal triangle of the sequence."""
    c = 6
    total = 0
    for step in range(world):
        work = set()
        for rank in range(world):
            src = (rank - step) % world
            pairs = 0
            for q0, q1, k0, k1, window in cfd._plan(cfd.chunks_of(rank, world), cfd.chunks_of(src, world), c,
                                                    cfd.CAUSAL):
                rows = q1 - q0
                pairs += rows * (k1 - k0) - (rows * (rows - 1) // 2 if window == cfd.CAUSAL else 0)
            work.add(pairs)
            total += pairs
        assert work == {2 * c * c + (c if step == 0 else 0)}, f"step {step}: work per rank {sorted(work)}"
    n = 2 * world * c
    assert total == n * (n + 1) // 2


def test_readme_launch_examples_are_the_two_engines():
    from test_distributed_nccl import launch_blocks
    assert sorted(launch_blocks()) == ["ring_cupy", "ring_torch"]


def test_shard_unshard_round_trip():
    x = np.arange(2 * 24 * 3).reshape(2, 24, 3)
    for layout, world in (("zigzag", 3), ("contiguous", 4), ("zigzag", 1)):
        shards = [cfd.shard(x, r, world, layout=layout) for r in range(world)]
        assert all(s.flags.c_contiguous for s in shards)
        np.testing.assert_array_equal(cfd.unshard(shards, layout=layout), x)
    # zigzag over 3 ranks: 6 chunks of 4 rows; rank 0 holds chunks 0 and 5.
    np.testing.assert_array_equal(cfd.shard(x, 0, 3)[0, :, 0], x[0, list(range(4)) + list(range(20, 24)), 0])


def test_bad_inputs():
    q = np.zeros((1, 6, 2, 8), np.float32)
    with pytest.raises(ValueError, match="x: sequence length 6 .* multiple of 4"):
        cfd.shard(q, 0, 2)
    with pytest.raises(ValueError, match="layout must be one of"):
        cfd.shard(q, 0, 2, layout="striped")
    member = cfd.LocalRing(1).member(0)
    odd = np.zeros((1, 5, 2, 8), np.float32)
    with pytest.raises(ValueError, match="q: the zigzag layout .* seqlen must be even, got 5"):
        cfd.ring_attention(odd, odd, odd, member)
    with pytest.raises(ValueError, match="q and k must be shards of the same sequence"):
        cfd.ring_attention(q, q[:, :4], q[:, :4], member)
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        cfd.ring_attention(q, q, q, object())
    with pytest.raises(ValueError, match="rank must be in"):
        cfd.LocalRing(2).member(2)
    four = np.zeros((1, 6, 4, 8), np.float32)
    with pytest.raises(ValueError, match=r"head_groups must divide nheads_k \(4\), got 3"):
        cfd.ring_attention(four, four, four, member, head_groups=3)
    with pytest.raises(ValueError, match=r"head_groups must be <= 2, got 4"):
        cfd.ring_attention(q, q, q, member, head_groups=4)
    with pytest.raises(ValueError, match=r"head_groups must be >= 1, got 0"):
        cfd.ring_attention(q, q, q, member, head_groups=0)
    with pytest.raises(TypeError, match="head_groups must be an integer, got float 1.0"):
        cfd.ring_attention_backward(q, q, q, q, q, np.zeros((1, 2, 6), np.float32), member, head_groups=1.0)
    gqa = np.zeros((1, 6, 4, 8), np.float32)
    with pytest.raises(ValueError, match="k and v must have the same number of heads, dividing q's: q has 2, k 4"):
        cfd.ring_attention(q, gqa, gqa, member)


# --- GPU: the ranks as threads on one device --------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("world,layout,causal,dtype,head_groups", [
    (2, "zigzag", True, "bf16", None), (4, "zigzag", True, "fp16", None), (3, "zigzag", False, "bf16", None),
    (2, "contiguous", True, "bf16", None), (3, "zigzag", True, "bf16", 2)])
def test_gpu_ring_under_the_rule(world, layout, causal, dtype, head_groups, request):
    """The GPU kernels (whatever family the device runs) over a ring of threads: out, lse and
    gradients against the float64 reference, chunks of 97 rows (odd tails in every tile); with
    head groups, the kernels read strided head slices of the shards."""
    import cupy as cp
    per = 2 if layout == "zigzag" else 1
    seqlen = world * per * 97
    case = Case(dtype, seqlen, seqlen, 128, causal, batch=2, nheads=4, nheads_k=2)
    q, k, v, dout = inputs(cp, DTYPES[dtype], 2, seqlen, 4, 2, 128, seed_of(request))
    out, lse, dq, dk, dv = ring_call(world, layout, q, k, v, dout, causal=causal, head_groups=head_groups)
    check_forward(case, q, k, v, out, lse, 128 ** -0.5)
    check_backward(case, dout, q, k, v, (dq, dk, dv), 128 ** -0.5, out=out, lse=lse)


@pytest.mark.gpu
@pytest.mark.parametrize("world,window_size,causal", [(2, (100, 0), False), (3, (150, 60), False),
                                                      (4, (300, -1), True)])
def test_gpu_ring_window_under_the_rule(world, window_size, causal, request):
    """Windows narrower than a chunk (97 rows) and across chunks, on the GPU kernels over a ring
    of threads, against the float64 reference."""
    import cupy as cp
    q, k, v, dout = inputs(cp, DTYPES["bf16"], 2, world * 2 * 97, 4, 2, 128, seed_of(request))
    got = ring_call(world, "zigzag", q, k, v, dout, causal=causal, window_size=window_size)
    assert_ring_under_the_rule(got, q, k, v, dout, causal, window_size=window_size)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_gpu_torch_ring_autograd(world, request):
    """cupyflash.torch.ring_attention over a ring of threads: out, lse and (one rank) the
    autograd gradients, unsharded, against the float64 reference. Two ranks as threads of one
    process check the forward only: PyTorch runs every backward pass of a device on one
    engine thread, so the second rank's backward would wait behind the first rank's, which
    waits for it at the exchange (two processes, as in the README's torchrun example, do not
    share that thread: tests/test_distributed_nccl.py)."""
    torch = pytest.importorskip("torch")
    import cupy as cp
    import cupyflash.torch as cft
    seqlen = world * 2 * 97
    case = Case("fp16", seqlen, seqlen, 64, True, batch=1, nheads=4, nheads_k=1)
    q, k, v, dout = inputs(cp, DTYPES["fp16"], 1, seqlen, 4, 1, 64, seed_of(request))
    tq, tk, tv, tdout = (torch.from_dlpack(x) for x in (q, k, v, dout))

    def rank(r, group):
        qs, ks, vs = (cfd.shard(x, r, world).requires_grad_() for x in (tq, tk, tv))
        out, lse = cft.ring_attention(qs, ks, vs, group, causal=True, return_lse=True)
        if world == 1:
            out.backward(cfd.shard(tdout, r, world))
            return out.detach(), lse, qs.grad, ks.grad, vs.grad
        return out.detach(), lse
    results = run_ranks(world, rank)
    got = [cp.from_dlpack(cfd.unshard([x[i] for x in results], axis=2 if i == 1 else 1))
           for i in range(len(results[0]))]
    check_forward(case, q, k, v, got[0], got[1], 64 ** -0.5)
    if world == 1:
        check_backward(case, dout, q, k, v, got[2:], 64 ** -0.5, out=got[0], lse=got[1])
