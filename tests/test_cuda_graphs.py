"""Calls captured into CUDA graphs and replayed: under CuPy's stream capture and under
``torch.cuda.graph``.

A capture records the kernels with the addresses of their buffers; a replay must find every
buffer where the capture left it. So, checked on the GPU:

- CuPy: forward and backward (dense, causal GQA with tails; a block mask whose lists an
  earlier call made on another stream) captured after one eager call, then replayed on new
  inputs written into the captured arrays, over outputs poisoned with NaN: the replayed
  results pass the float64 reference's rule for the new inputs, and buffers allocated after
  the capture (in memory the call's scratch had during it) are not written by the replay;
- PyTorch: a training step of a small model (projections, our causal attention, backward
  through autograd) captured whole and replayed on a new input gives the eager step's loss
  and gradients;
- a packed batch (flash_attention_varlen, maximums given) captured and replayed on new values
  gives the bits of eager calls on them, and so does a split-KV decode;
- host work a capture cannot hold is refused with a RuntimeError that says what to do, and
  the capture is still usable after it: a kernel's first use (compile and load), a block
  mask's lists never copied to the device, a mask_mod without a block mask.

Skipped where there is no GPU (CI), the PyTorch test also where PyTorch is absent.
"""
import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _launch, masks

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

from tests import gpu_checks  # noqa: E402

CASE = gpu_checks.Case("bf16", 200, 130, 64, True, batch=2, nheads=4, nheads_k=2)


def _fill(arrays, seed):
    """New random values into the captured inputs, in place."""
    fresh = gpu_checks.make_inputs(CASE, seed)
    for a, f in zip(arrays, fresh):
        a[...] = f


def _capture(stream, fn):
    """fn() captured on ``stream``: (its results, the graph)."""
    stream.begin_capture()
    try:
        results = fn()
    finally:
        graph = stream.end_capture()
    return results, graph


def _captured_poisoned(step):
    """step() once eagerly (it compiles, and copies a mask's lists, on the null stream), then
    captured on a stream of its own, its results filled with NaN: (stream, results, graph)."""
    step()
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        results, graph = _capture(stream, step)
        for r in results:
            r.fill(np.nan)
    return stream, results, graph


@pytest.mark.parametrize("with_mask", [False, True], ids=["dense", "block_mask"])
def test_cupy_capture_replays_forward_and_backward_on_new_inputs(with_mask):
    q, k, v, dout = gpu_checks.make_inputs(CASE, 11)
    scale = CASE.d ** -0.5
    mask = masks.causal(CASE.sq, CASE.sk, 64) if with_mask else None
    kw = dict(causal=CASE.causal, softmax_scale=scale, block_mask=mask)

    def step():
        out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
        return (out, lse) + cf.flash_attention_backward(dout, q, k, v, out, lse, **kw)

    stream, results, graph = _captured_poisoned(step)
    with stream:
        _fill((q, k, v, dout), 12)
        stream.synchronize()
        # Arrays of the sizes of the call's scratch (dq's fp32 buffer, the row statistics),
        # which CuPy's pool would give the memory the scratch had during the capture: a
        # replay must not write them.
        bystanders = [cp.full(_launch.dq_accum_shape(q.shape), 7, cp.float32),
                      cp.full((2, CASE.batch, CASE.nheads, CASE.sq), 7, cp.float32)]
        graph.launch()
        stream.synchronize()
    out, lse, dq, dk, dv = results
    elem_mask = None if mask is None else cp.asarray(mask.to_dense())
    gpu_checks.check_forward(CASE, q, k, v, out, lse, scale, elem_mask)
    gpu_checks.check_backward(CASE, dout, q, k, v, (dq, dk, dv), scale, elem_mask)
    assert all(bool((a == 7).all()) for a in bystanders), "the replay wrote memory it does not own"


def test_cupy_capture_replays_a_packed_batch_on_new_inputs():
    """flash_attention_varlen and its backward captured with the maximums given (the offsets
    are trusted there, not read to the host), replayed on new values: the bits of eager calls
    on those values (forward, dk, dv; dq adds up by atomics in any order: the rule)."""
    lens = [130, 1, 77, 0, 200]
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    total, h, hk, d = sum(lens), 4, 2, 64
    rng = np.random.default_rng(41)

    def draw():
        return [cp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(gpu_checks.DTYPES["bf16"])
                for s in ((total, h, d), (total, hk, d), (total, hk, d), (total, h, d))]
    q, k, v, dout = draw()
    kw = dict(causal=True)

    def step():
        out, lse = cf.flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), return_lse=True, **kw)
        return (out, lse) + cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, max(lens),
                                                               max(lens), **kw)

    stream, results, graph = _captured_poisoned(step)
    with stream:
        for a, f in zip((q, k, v, dout), draw()):
            a[...] = f
        stream.synchronize()
        graph.launch()
        stream.synchronize()
    out, lse, dq, dk, dv = results
    ref = step()
    for name, got, want in zip(("out", "lse", "dk", "dv"), (out, lse, dk, dv), (ref[0], ref[1], ref[3], ref[4])):
        assert bool((got.view(cp.uint8) == want.view(cp.uint8)).all()), name
    err = float(cp.abs(dq.astype(cp.float32) - ref[2].astype(cp.float32)).max())
    assert err <= 1e-2 * float(cp.abs(ref[2].astype(cp.float32)).max()), err

    def without_maximums():
        with pytest.raises(RuntimeError, match="max_seqlen_q and max_seqlen_k"):
            cf.flash_attention_varlen(q, k, v, cu, cu)
    with stream:
        _capture(stream, without_maximums)


def test_cupy_capture_replays_a_split_decode():
    """flash_attention_with_kvcache over 8 splits (the parts in a workspace of the call, then
    merged) captured and replayed twice on new queries over poisoned outputs: the bits of
    eager calls made between the replays."""
    rng = np.random.default_rng(5)
    b, h, hk, d, capacity = 2, 8, 2, 128, 2048

    def draw(shape):
        return cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(gpu_checks.DTYPES["bf16"])
    k_cache, v_cache, q = draw((b, capacity, hk, d)), draw((b, capacity, hk, d)), draw((b, 1, h, d))
    lens = cp.asarray(np.array([2000, 1500], np.int32))

    def step():
        return cf.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=8,
                                               return_lse=True)
    stream, results, graph = _captured_poisoned(step)
    with stream:
        for _ in range(2):
            q[...] = draw(q.shape)
            graph.launch()
            want = step()
            stream.synchronize()
            for name, got, ref in zip(("out", "lse"), results, want):
                assert bool((got.view(cp.uint8) == ref.view(cp.uint8)).all()), name


def test_first_use_of_a_kernel_in_a_capture_is_refused_and_the_capture_survives():
    q, k, v, _ = gpu_checks.make_inputs(CASE, 21)
    cf.flash_attention(q, k, v, causal=True)
    _launch._kernel.cache_clear()          # as in a fresh process: nothing loaded yet
    def first_use():
        with pytest.raises(RuntimeError, match="compiles and loads it.*before capturing"):
            cf.flash_attention(q, k, v, causal=True)

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _, graph = _capture(stream, first_use)
        graph.launch()                      # the capture was not invalidated
        stream.synchronize()
    cf.flash_attention(q, k, v, causal=True)   # loads it again outside the capture


def test_host_work_in_a_capture_is_refused_with_what_to_do():
    q, k, v, _ = gpu_checks.make_inputs(CASE, 31)
    fresh = masks.causal(CASE.sq, CASE.sk, 64)
    cf.flash_attention(q, k, v, block_mask=masks.causal(CASE.sq, CASE.sk, 64))  # kernels loaded
    def host_work():
        with pytest.raises(RuntimeError, match="lists .* copied to the device"):
            cf.flash_attention(q, k, v, block_mask=fresh)
        with pytest.raises(RuntimeError, match="BlockMask.from_mask_mod"):
            cf.flash_attention(q, k, v, mask_mod=cf.MaskMod("q_idx >= kv_idx"))

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _capture(stream, host_work)


def test_torch_cuda_graph_replays_a_training_step():
    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft
    torch.manual_seed(0)
    dev = torch.device("cuda")
    b, s, h, hk, d = 2, 200, 4, 2, 64
    proj = torch.nn.Linear(256, (h + 2 * hk) * d, device=dev, dtype=torch.bfloat16)
    back = torch.nn.Linear(h * d, 256, device=dev, dtype=torch.bfloat16)
    params = list(proj.parameters()) + list(back.parameters())

    def step(x):
        qkv = proj(x).view(b, s, h + 2 * hk, d)
        q, k, v = qkv.split([h, hk, hk], dim=2)
        out = cft.flash_attention(q, k, v, causal=True)
        loss = back(out.reshape(b, s, h * d)).float().square().mean()
        loss.backward()
        return loss

    static_x = torch.randn(b, s, 256, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # warm-up off the default stream, as PyTorch asks
        for _ in range(2):
            for p in params:
                p.grad = None
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(static_x)
    static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_loss.clone()] + [p.grad.clone() for p in params]
    del static_loss         # and the captured autograd graph it holds

    for p in params:
        p.grad = None
    eager = [step(static_x).detach()] + [p.grad for p in params]
    for name, got, want in zip(["loss", "proj.weight", "proj.bias", "back.weight", "back.bias"],
                               replayed, eager):
        # Same kernels on the same inputs; dq's additions may come in another order.
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")
