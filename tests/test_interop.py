"""Interop: NumPy, CuPy, PyTorch and JAX arrays in and out of cupyflash.

Checked: inputs are read in place and results handed back without a copy (data pointers),
dtypes, devices, the caller's stream (inputs produced on a side stream right before the call),
the mixed-kind rules, autograd through ``cupyflash.torch`` (against PyTorch's SDPA math
backend) and ``cupyflash.jax`` (against a jnp reference), and the README's examples.

Tolerances: fp16/bf16 follow FlashAttention's rule (DESIGN.md): our error against a float64
reference is at most 2x (out) or 3x (gradients) that of a naive same-dtype implementation.
The naive one is ``reference.attention_naive`` (each stage rounded to the dtype), as in the
other GPU tests; SDPA's math backend in the same dtype is not used as the baseline because it
may compute half inputs in float32 internally, which is not a naive same-dtype result.
float32 and float64 are compared tightly, as in test_gpu_dense.py.

Framework tests skip where the framework is not importable; GPU tests (marker ``gpu``) skip
where CuPy sees no GPU.
"""
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import cupyflash as cf  # noqa: E402
from cupyflash import _arrays  # noqa: E402

try:
    from gpu_checks import BWD_FACTOR, FP64_RTOL, FWD_FACTOR, fp32_rtol, seed_of  # noqa: E402
    from reference import (assert_rule, attention_naive, attention_naive_backward,  # noqa: E402
                           attention_ref, get_xp)
except ImportError:
    from tests.gpu_checks import (BWD_FACTOR, FP64_RTOL, FWD_FACTOR,  # noqa: E402
                                  fp32_rtol, seed_of)
    from tests.reference import (assert_rule, attention_naive,  # noqa: E402
                                 attention_naive_backward, attention_ref, get_xp)

README = Path(__file__).resolve().parent.parent / "README.md"
HALF = ("float16", "bfloat16")
# A long GPU job (~0.1 s) queued right before the inputs are written: if our kernels ran on
# another stream, they would read the inputs before they exist.
LONG_MATMUL_N, LONG_MATMUL_REPEATS = 8192, 6


def _cupy():
    return pytest.importorskip("cupy")


def _torch():
    torch = pytest.importorskip("torch")
    return torch


def _torch_cuda():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device (CPU-only build?)")
    return torch


def _jax():
    return pytest.importorskip("jax")


def _jax_gpu():
    jax = _jax()
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    if not devices:
        pytest.skip("JAX has no GPU backend here")
    return jax, devices[0]


def _record_results(monkeypatch):
    """Record the data pointer of every CuPy result handed to ``to_caller``."""
    ptrs = []
    real = _arrays.to_caller

    def spy(result, caller):
        ptrs.append(getattr(getattr(result, "data", None), "ptr", None))
        return real(result, caller)

    monkeypatch.setattr(_arrays, "to_caller", spy)
    return ptrs


def _assert_close(name, got, ref, naive, dtype, sq, sk, factor, magnitude=None):
    """fp16/bf16: the rule against ``naive``; fp32/fp64: tight, relative to ``magnitude``.
    All arguments are CuPy or NumPy arrays."""
    xp = get_xp(got, ref)
    if dtype in HALF:
        assert_rule(name, got, ref, naive, factor, magnitude)
        return
    got, ref = xp.asarray(got, dtype=xp.float64), xp.asarray(ref, dtype=xp.float64)
    assert not bool(xp.isnan(got).any()), f"{name} has NaN"
    top = max(float(xp.abs(ref).max()) if magnitude is None else magnitude, 1e-30)
    rtol = fp32_rtol(sq, sk) if dtype == "float32" else FP64_RTOL
    err = float(xp.abs(got - ref).max())
    assert err <= rtol * top, f"{name}: max error {err:.3e} > {rtol:.1e} * {top:.3e}"


# =============================================================================================
# Mixed kinds and other boundary rules (run anywhere)

class _FakeDeviceArray:
    """Claims to live on CUDA device 0; never converted (the host/device check comes first)."""

    def __dlpack__(self, **kwargs):
        raise AssertionError("must not be converted")

    def __dlpack_device__(self):
        return (2, 0)


class _HostWrapper:
    """A host array of some other DLPack framework (wraps a NumPy array)."""

    def __init__(self, a, namespace=None):
        self.a, self.namespace = a, namespace

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


class _Namespace:
    """A minimal array-API namespace whose from_dlpack wraps the result again."""

    @staticmethod
    def from_dlpack(x):
        return _WrappedWithNamespace(np.from_dlpack(x))


class _WrappedWithNamespace(_HostWrapper):
    def __array_namespace__(self, api_version=None):
        return _Namespace


def _host_qkv(seed=0, shape_q=(2, 17, 4, 16), shape_kv=(2, 23, 2, 16)):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape_q), rng.standard_normal(shape_kv),
            rng.standard_normal(shape_kv))


def test_host_array_mixed_with_device_arrays_is_type_error_naming_the_host_argument():
    q, _, _ = _host_qkv()
    with pytest.raises(TypeError, match=r"^q \(numpy\) is on the host but k \(dlpack\), "
                                        r"v \(dlpack\) are on a GPU.*one kind"):
        cf.flash_attention(q, _FakeDeviceArray(), _FakeDeviceArray())


def test_backward_names_every_host_argument():
    q, k, v = _host_qkv()
    out, lse = cf.flash_attention(q, k, v, return_lse=True)
    dev = _FakeDeviceArray()
    with pytest.raises(TypeError, match=r"^dout \(numpy\), q \(numpy\) are on the host but "
                                        r"k \(dlpack\), v \(dlpack\), out \(dlpack\), "
                                        r"lse \(dlpack\) are on a GPU"):
        cf.flash_attention_backward(np.ones_like(out), q, dev, dev, dev, dev)


def test_object_without_dlpack_is_type_error():
    q, k, v = _host_qkv()
    with pytest.raises(TypeError, match="^v must be a NumPy array, a CuPy array or an object "
                                        "with __dlpack__, got list"):
        cf.flash_attention(q, k, v.tolist())


def test_unsupported_dlpack_device_is_type_error():
    class Vulkan(_FakeDeviceArray):
        def __dlpack_device__(self):
            return (7, 0)
    q, k, v = _host_qkv()
    with pytest.raises(TypeError, match="^k: unsupported DLPack device type 7"):
        cf.flash_attention(q, Vulkan(), v)


def test_host_dlpack_arrays_run_the_numpy_path_and_come_back_as_their_kind():
    q, k, v = _host_qkv(1)
    expected = cf.flash_attention(q, k, v, causal=True)
    # Without __array_namespace__ the NumPy result is returned as is.
    out = cf.flash_attention(_HostWrapper(q), _HostWrapper(k), _HostWrapper(v), causal=True)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, expected)
    # With one, the result is made of q's kind through its from_dlpack; k, v may be NumPy.
    out = cf.flash_attention(_WrappedWithNamespace(q), k, v, causal=True)
    assert isinstance(out, _WrappedWithNamespace)
    np.testing.assert_array_equal(out.a, expected)


# =============================================================================================
# CuPy

def _cupy_qkv(cp, shape_q, shape_kv, dtype, seed):
    rng = np.random.default_rng(seed)
    return tuple(cp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype)
                 for s in (shape_q, shape_kv, shape_kv))


def _check_cupy_forward(cp, q, k, v, out, causal):
    scale = q.shape[-1] ** -0.5
    q64, k64, v64 = (x.astype(cp.float64) for x in (q, k, v))
    ref, _ = attention_ref(q64, k64, v64, scale, causal)
    naive, _ = attention_naive(q64, k64, v64, scale, causal, q.dtype.name)
    _assert_close("out", out, ref, naive, q.dtype.name, q.shape[1], k.shape[1], FWD_FACTOR)


def _long_job(tanh, m):
    """Queue ~0.1 s of matmuls of the LONG_MATMUL_N-square matrix ``m`` on the current stream of
    its framework (bounded values: ``tanh`` of that framework). Returns the chain's last element."""
    big = m
    for _ in range(LONG_MATMUL_REPEATS):
        big = tanh(big @ m)
    return big


def _cupy_long_job(cp):
    """Queue ~0.1 s of matmuls on CuPy's current stream."""
    n = LONG_MATMUL_N
    return _long_job(cp.tanh, cp.random.standard_normal((n, n), dtype=cp.float32)
                     / np.float32(n ** 0.5))


@pytest.mark.gpu
def test_cupy_inputs_written_on_a_side_stream_right_before_the_call():
    cp = _cupy()
    q0, k0, v0 = _cupy_qkv(cp, (2, 1025, 4, 64), (2, 1025, 4, 64), cp.float16, 11)
    dout0 = _cupy_qkv(cp, q0.shape, k0.shape, cp.float16, 12)[0]
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _cupy_long_job(cp)
        q, k, v, dout = (cp.empty_like(x) for x in (q0, k0, v0, dout0))
        for dst, src in ((q, q0), (k, k0), (v, v0), (dout, dout0)):
            dst[...] = src
        out, lse = cf.flash_attention(q, k, v, causal=True, return_lse=True)
        grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=True,
                                            deterministic=True)
    stream.synchronize()
    # The same calls with every input ready, on the default stream: bit-identical.
    out0, lse0 = cf.flash_attention(q0, k0, v0, causal=True, return_lse=True)
    expected = cf.flash_attention_backward(dout0, q0, k0, v0, out0, lse0, causal=True,
                                           deterministic=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + grads,
                          (out0, lse0) + expected):
        assert bool((a.view(cp.uint8) == b.view(cp.uint8)).all()), f"{name} differs"
    _check_cupy_forward(cp, q0, k0, v0, out, True)


@pytest.mark.gpu
def test_cupy_results_stay_cupy_on_the_inputs_device():
    cp = _cupy()
    q, k, v = _cupy_qkv(cp, (1, 97, 4, 64), (1, 128, 2, 64), cp.float32, 3)
    out, lse = cf.flash_attention(q, k, v, return_lse=True)
    assert isinstance(out, cp.ndarray) and isinstance(lse, cp.ndarray)
    assert out.device == q.device and out.dtype == q.dtype
    _check_cupy_forward(cp, q, k, v, out, False)


@pytest.mark.gpu
def test_cupy_arrays_on_gpu1_run_on_gpu1():
    cp = _cupy()
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(1):
        q, k, v = _cupy_qkv(cp, (1, 255, 4, 64), (1, 300, 4, 64), cp.float16, 5)
    with cp.cuda.Device(0):
        out, lse = cf.flash_attention(q, k, v, causal=True, return_lse=True)
        dq, dk, dv = cf.flash_attention_backward(q, q, k, v, out, lse, causal=True)
        assert cp.cuda.Device().id == 0
    assert {a.device.id for a in (out, lse, dq, dk, dv)} == {1}
    with cp.cuda.Device(1):
        _check_cupy_forward(cp, q, k, v, out, True)


@pytest.mark.gpu
def test_numpy_mixed_with_cupy_is_type_error():
    cp = _cupy()
    q, k, v = _host_qkv()
    with pytest.raises(TypeError, match=r"^k \(numpy\), v \(numpy\) are on the host but "
                                        r"q \(cupy\) is on a GPU"):
        cf.flash_attention(cp.asarray(q), k, v)


# =============================================================================================
# PyTorch

TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _torch_rand(torch, shape, dtype, device, rng):
    x = torch.from_numpy(rng.standard_normal(shape))
    return x.to(device=device, dtype=getattr(torch, dtype))


def _cp64(t):
    """A float64 CuPy copy of a CUDA tensor (for the reference functions)."""
    cp = _cupy()
    return cp.from_dlpack(t.detach().double().contiguous())


def _sdpa_math(torch, q, k, v, scale, causal, dense_mask=None):
    """PyTorch SDPA (math backend) on (batch, seqlen, heads, d) tensors; GQA by repeating kv
    heads; causal aligned bottom-right through an explicit mask; ``dense_mask`` (heads or 1,
    sq, sk) bool ANDed in."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)[None]
    if dense_mask is not None:
        dense = torch.from_numpy(dense_mask).to(q.device)
        mask = dense if mask is None else mask & dense
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=None if mask is None else mask[None], scale=scale)
    return out.transpose(1, 2)


def _check_torch_autograd(torch, q, k, v, dout, causal, block_mask=None, scale=None):
    """Run cupyflash.torch forward + backward on leaves q, k, v and compare (below)."""
    import cupyflash.torch as cft
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = cft.flash_attention(q, k, v, causal=causal, softmax_scale=scale,
                              block_mask=block_mask)
    out.backward(dout)
    _compare_torch_autograd(torch, q, k, v, dout, causal, block_mask, scale, out,
                            (q.grad, k.grad, v.grad))
    return out


def _compare_torch_autograd(torch, q, k, v, dout, causal, block_mask, scale, out, grads):
    """out and (dq, dk, dv) against SDPA math in float64 (the reference) under the rule,
    with reference.attention_naive as the naive same-dtype implementation."""
    cp = _cupy()
    dtype = str(q.dtype).replace("torch.", "")
    assert out.dtype == q.dtype and out.device == q.device and out.shape == q.shape
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g is not None, f"{name} is None"
        assert g.shape == x.shape and g.dtype == x.dtype and g.device == x.device, name

    dense = None if block_mask is None else block_mask.to_dense()
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = _sdpa_math(torch, *leaves, scale, causal, dense)
    ref.backward(dout.double())
    sq, sk = q.shape[1], k.shape[1]
    with cp.cuda.Device(q.device.index):
        refs = [_cp64(x.grad) for x in leaves]
        q64, k64, v64, dout64 = (_cp64(x) for x in (q, k, v, dout))
        mask = None if dense is None else cp.asarray(dense)
        naive_out, naive_grads = None, (None, None, None)
        if dtype in HALF:
            naive_out, _ = attention_naive(q64, k64, v64, scale, causal, dtype, mask)
            naive_grads = attention_naive_backward(dout64, q64, k64, v64, scale, causal, dtype,
                                                   mask)
        _assert_close("out", _cp64(out), _cp64(ref), naive_out, dtype, sq, sk, FWD_FACTOR)
        magnitude = max(float(cp.abs(r).max()) for r in refs)
        for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naive_grads):
            _assert_close(name, _cp64(g), r, n, dtype, sq, sk, BWD_FACTOR, magnitude)


def _torch_leaves(torch, shape_q, shape_kv, dtype, seed, device="cuda"):
    rng = np.random.default_rng(seed)
    q, k, v = (_torch_rand(torch, s, dtype, device, rng).requires_grad_()
               for s in (shape_q, shape_kv, shape_kv))
    dout = _torch_rand(torch, shape_q, dtype, device, rng)
    return q, k, v, dout


# (name, batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, causal)
TORCH_CASES = (
    ("full", 2, 255, 255, 4, 4, 64, False),
    ("causal", 2, 255, 255, 4, 4, 64, True),
    ("causal-q<k", 1, 97, 300, 4, 4, 80, True),       # bottom-right: every query sees keys
    ("full-q>k", 1, 300, 97, 4, 4, 128, False),
    ("gqa-causal", 2, 200, 200, 8, 2, 64, True),
    ("mqa", 1, 129, 257, 6, 1, 32, False),
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("case", TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
def test_torch_autograd_matches_sdpa_math(case, dtype, request):
    torch = _torch_cuda()
    _, b, sq, sk, h, hk, d, causal = case
    q, k, v, dout = _torch_leaves(torch, (b, sq, h, d), (b, sk, hk, d), dtype, seed_of(request))
    _check_torch_autograd(torch, q, k, v, dout, causal)


# (name, seqlen_q, seqlen_k, causal, builder); the masks leave no query row without keys.
MASK_CASES = (
    ("sliding-window", 300, 300, False,
     lambda sq, sk: cf.masks.sliding_window(sq, sk, 100, block_size=64)),
    ("sliding-window-causal", 300, 300, True,
     lambda sq, sk: cf.masks.sliding_window(sq, sk, 100, block_size=64)),
    ("causal-mask-q<k", 200, 333, False,
     lambda sq, sk: cf.masks.causal(sq, sk, block_size=(64, 128))),
    ("grid", 256, 320, False,
     lambda sq, sk: cf.BlockMask.from_dense(
         np.eye(4, 5, dtype=bool) | np.eye(4, 5, 1, dtype=bool), 64, seqlen_q=sq, seqlen_k=sk)),
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_torch_autograd_with_block_mask_and_gqa(case, dtype, request):
    torch = _torch_cuda()
    _, sq, sk, causal, build = case
    mask = build(sq, sk)
    q, k, v, dout = _torch_leaves(torch, (2, sq, 4, 64), (2, sk, 2, 64), dtype, seed_of(request))
    _check_torch_autograd(torch, q, k, v, dout, causal, block_mask=mask)


@pytest.mark.gpu
def test_torch_broadcast_grad_of_sum_is_accepted():
    """``out.sum().backward()`` hands a gradient with all strides 0."""
    torch = _torch_cuda()
    import cupyflash.torch as cft
    q, k, v, _ = _torch_leaves(torch, (1, 128, 2, 64), (1, 128, 2, 64), "float32", 7)
    cft.flash_attention(q, k, v, causal=True).sum().backward()
    got = [x.grad for x in (q, k, v)]
    again = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    cft.flash_attention(*again, causal=True).backward(torch.ones_like(q))
    for name, g, x in zip(("dq", "dk", "dv"), got, again):
        torch.testing.assert_close(g, x.grad, msg=name)


@pytest.mark.gpu
def test_torch_packed_qkv_slices_are_read_in_place_and_results_are_not_copied(monkeypatch):
    torch = _torch_cuda()
    cp = _cupy()
    import cupyflash.torch as cft
    rng = np.random.default_rng(13)
    qkv = _torch_rand(torch, (2, 255, 3, 4, 80), "bfloat16", "cuda", rng).requires_grad_()
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    for x in (q, k, v):
        view = cp.from_dlpack(x.detach())
        assert view.data.ptr == x.data_ptr() and view.strides == tuple(
            s * x.element_size() for s in x.stride())
    ptrs = _record_results(monkeypatch)
    out, lse = cf.flash_attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert [out.data_ptr(), lse.data_ptr()] == ptrs
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 255)
    # Autograd through the slices: the gradient lands in qkv.grad.
    monkeypatch.undo()
    dout = _torch_rand(torch, q.shape, "bfloat16", "cuda", rng)
    cft.flash_attention(q, k, v, causal=True).backward(dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    _sdpa_math(torch, *leaves, 80 ** -0.5, True).backward(dout.double())
    q64, k64, v64, dout64 = (_cp64(x) for x in (q, k, v, dout))
    naives = attention_naive_backward(dout64, q64, k64, v64, 80 ** -0.5, True, "bfloat16")
    refs = [_cp64(x.grad) for x in leaves]
    magnitude = max(float(cp.abs(r).max()) for r in refs)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_rule(name, _cp64(qkv.grad[:, :, i]), refs[i], naives[i], BWD_FACTOR, magnitude)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_dtypes_round_trip(dtype, request, monkeypatch):
    torch = _torch_cuda()
    q, k, v, dout = _torch_leaves(torch, (1, 97, 4, 64), (1, 130, 2, 64), dtype, seed_of(request))
    q, k, v = (x.detach() for x in (q, k, v))
    ptrs = _record_results(monkeypatch)
    out, lse = cf.flash_attention(q, k, v, return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse)
    results = (out, lse) + tuple(grads)
    assert [r.data_ptr() for r in results] == ptrs
    assert all(isinstance(r, torch.Tensor) and r.device == q.device for r in results)
    assert out.dtype == q.dtype and all(g.dtype == q.dtype for g in grads)
    assert lse.dtype == (torch.float64 if dtype == "float64" else torch.float32)


@pytest.mark.gpu
def test_torch_tensors_on_gpu0_and_gpu1_stay_there():
    torch = _torch_cuda()
    cp = _cupy()
    for index in range(min(torch.cuda.device_count(), 2)):
        device = torch.device("cuda", index)
        q, k, v, dout = _torch_leaves(torch, (1, 200, 4, 64), (1, 200, 4, 64), "float16",
                                      100 + index, device=device)
        before = (torch.cuda.current_device(), cp.cuda.Device().id)
        out = _check_torch_autograd(torch, q, k, v, dout, True)
        assert (torch.cuda.current_device(), cp.cuda.Device().id) == before
        assert out.device == device and q.grad.device == device
    if torch.cuda.device_count() < 2:
        pytest.skip("checked cuda:0 only: needs a second GPU for cuda:1")


def _torch_long_job(torch, device):
    """Queue ~0.1 s of matmuls on PyTorch's current stream."""
    n = LONG_MATMUL_N
    return _long_job(torch.tanh, torch.randn(n, n, device=device) / n ** 0.5)


@pytest.mark.gpu
def test_torch_inputs_written_on_a_side_stream_right_before_the_call():
    """Inputs are written on a side stream behind a long job and the call is made under
    ``torch.cuda.stream(side)``; forward and backward must run after them on that stream."""
    torch = _torch_cuda()
    import cupyflash.torch as cft
    q0, k0, v0, dout0 = _torch_leaves(torch, (2, 1025, 8, 64), (2, 1025, 2, 64), "bfloat16", 21)
    q0, k0, v0 = (x.detach() for x in (q0, k0, v0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _torch_long_job(torch, "cuda")
        q, k, v, dout = (torch.empty_like(x) for x in (q0, k0, v0, dout0))
        for dst, src in ((q, q0), (k, k0), (v, v0), (dout, dout0)):
            dst.copy_(src)
        for x in (q, k, v):
            x.requires_grad_()
        out = cft.flash_attention(q, k, v, causal=True)
        out.backward(dout)
        # The plain API on the same stream: no autograd, same ordering.
        out_plain = cf.flash_attention(q.detach(), k.detach(), v.detach(), causal=True)
    torch.cuda.synchronize()
    _compare_torch_autograd(torch, q0, k0, v0, dout0, True, None, 64 ** -0.5, out,
                            (q.grad, k.grad, v.grad))
    expected = cf.flash_attention(q0, k0, v0, causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out_plain, expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_torch_and_cupy_arrays_mix_on_one_gpu_in_stream_order():
    """q, v are PyTorch tensors (launch on PyTorch's current stream); k is a CuPy array made
    on a busy non-blocking CuPy stream: the launch waits for it without a host sync."""
    torch = _torch_cuda()
    cp = _cupy()
    rng = np.random.default_rng(31)
    q = _torch_rand(torch, (1, 512, 4, 64), "float16", "cuda", rng)
    v = _torch_rand(torch, (1, 512, 4, 64), "float16", "cuda", rng)
    k_host = rng.standard_normal((1, 512, 4, 64)).astype(np.float16)
    torch.cuda.synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _cupy_long_job(cp)
        k = cp.empty(k_host.shape, cp.float16)
        k.set(k_host, stream=stream)
        out = cf.flash_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.device == q.device
    torch.cuda.synchronize()
    stream.synchronize()
    k_t = torch.from_numpy(k_host).cuda()
    expected = cf.flash_attention(q, k_t, v)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_torch_cpu_tensor_mixed_with_cuda_tensor_is_type_error():
    torch = _torch_cuda()
    q = torch.randn(1, 16, 2, 32, device="cuda")
    with pytest.raises(TypeError, match=r"^k \(torch\) is on the host but q \(torch\), "
                                        r"v \(torch\) are on a GPU"):
        cf.flash_attention(q, q.cpu(), q)


def test_torch_cpu_tensors_run_the_numpy_path_with_autograd():
    """Runs wherever PyTorch is importable (CPU tensors go through NumPy, zero-copy)."""
    torch = _torch()
    import cupyflash.torch as cft
    q, k, v, dout = _torch_leaves(torch, (2, 33, 4, 16), (2, 47, 2, 16), "float64", 41,
                                  device="cpu")
    out = cft.flash_attention(q, k, v, causal=True)
    out.backward(dout)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = _sdpa_math(torch, *leaves, 16 ** -0.5, True)
    ref.backward(dout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, x, leaf in zip(("dq", "dk", "dv"), (q, k, v), leaves):
        torch.testing.assert_close(x.grad, leaf.grad, rtol=1e-10, atol=1e-12, msg=name)


def _packed_leaves(torch, lengths, h, hk, d, dtype, seed, device):
    """Packed q, k, v (leaves), dout and the int32 offsets of a batch of sequences."""
    total = int(sum(lengths))
    q, k, v, dout = _torch_leaves(torch, (total, h, d), (total, hk, d), dtype, seed, device=device)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    return q, k, v, dout, cu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF)
def test_torch_varlen_autograd_is_the_packed_calls(dtype, request):
    """cupyflash.torch.flash_attention_varlen's out, lse and gradients are those of
    cupyflash.flash_attention_varlen and its backward on the same tensors (the same kernels:
    equal bits), with GQA, causal, a window and a sequence of one token; lse is not
    differentiable; torch.compile runs it outside its graph, with the same result."""
    torch = _torch_cuda()
    import cupyflash.torch as cft
    q, k, v, dout, cu = _packed_leaves(torch, (37, 130, 1, 64), 4, 2, 64, dtype, seed_of(request), "cuda")
    options = dict(causal=True, window_size=(50, 0), softmax_scale=0.3)
    out, lse = cft.flash_attention_varlen(q, k, v, cu, cu, return_lse=True, **options)
    assert not lse.requires_grad
    out.backward(dout)
    leaves = [x.detach() for x in (q, k, v)]
    ref_out, ref_lse = cf.flash_attention_varlen(*leaves, cu, cu, return_lse=True, **options)
    ref_grads = cf.flash_attention_varlen_backward(dout, *leaves, ref_out, ref_lse, cu, cu, **options)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for name, x, ref in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
        assert torch.equal(x.grad, ref), name
    compiled = torch.compile(lambda q, k, v: cft.flash_attention_varlen(q, k, v, cu, cu, **options))
    assert torch.equal(compiled(*leaves), ref_out)


def test_torch_varlen_cpu_tensors_match_per_sequence_calls():
    """Runs wherever PyTorch is importable: the NumPy path with autograd, each sequence's
    out and gradients those of a dense call on it (GQA, causal, ALiBi, lengths 1 to 40)."""
    torch = _torch()
    import cupyflash.torch as cft
    lengths = (1, 40, 17)
    q, k, v, dout, cu = _packed_leaves(torch, lengths, 4, 2, 16, "float64", 43, "cpu")
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32)
    out = cft.flash_attention_varlen(q, k, v, cu, cu, causal=True, alibi_slopes=slopes)
    out.backward(dout)
    for b, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = [x.detach()[start:end][None].clone().requires_grad_() for x in (q, k, v)]
        ref = cft.flash_attention(*part, causal=True, alibi_slopes=slopes)
        ref.backward(dout[start:end][None])
        torch.testing.assert_close(out[start:end], ref[0], rtol=1e-10, atol=1e-12)
        for name, x, leaf in zip(("dq", "dk", "dv"), (q, k, v), part):
            torch.testing.assert_close(x.grad[start:end], leaf.grad[0], rtol=1e-10, atol=1e-12,
                                       msg=f"{name} of sequence {b}")


def test_torch_varlen_refuses_bad_flags_before_any_work():
    torch = _torch()
    import cupyflash.torch as cft
    q, k, v, _, cu = _packed_leaves(torch, (3, 5), 2, 2, 8, "float64", 44, "cpu")
    for flag in ("deterministic", "return_lse"):
        with pytest.raises(TypeError, match=f"^{flag} must be"):
            cft.flash_attention_varlen(q, k, v, cu, cu, **{flag: 1})


# =============================================================================================
# JAX

def _jnp_attention(jnp, q, k, v, scale, causal):
    """Plain attention in jnp on (batch, seqlen, heads, d); GQA by repeating kv heads, causal
    aligned bottom-right. Every row sees a key in the cases used here."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        visible = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + (sk - sq)
        s = jnp.where(visible, s, -jnp.inf)
    p = jnp.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return jnp.einsum("bhij,bjhd->bihd", p, v)


class _x64:
    """jax_enable_x64 on inside the block, restored after."""

    def __init__(self, jax):
        self.jax = jax

    def __enter__(self):
        self.before = bool(self.jax.config.read("jax_enable_x64")) \
            if hasattr(self.jax.config, "read") else bool(self.jax.config.jax_enable_x64)
        self.jax.config.update("jax_enable_x64", True)

    def __exit__(self, *exc):
        self.jax.config.update("jax_enable_x64", self.before)


def _np64(x):
    return np.asarray(x).astype(np.float64)


def _check_jax_grad(jax, device, dtype, shape_q, shape_kv, causal, seed):
    import jax.numpy as jnp
    import cupyflash.jax as cfj
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s) for s in (shape_q, shape_kv, shape_kv, shape_q)]
    q, k, v, w = (jax.device_put(jnp.asarray(x, dtype=dtype), device) for x in host)
    scale = shape_q[-1] ** -0.5

    def loss(q, k, v):
        out = cfj.flash_attention(q, k, v, causal=causal)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))

    out = cfj.flash_attention(q, k, v, causal=causal)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert out.dtype == q.dtype and out.devices() == {device}
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape and g.devices() == {device}

    q64, k64, v64, w64 = (_np64(x) for x in (q, k, v, w))
    with _x64(jax):
        args = [jnp.asarray(x, dtype=jnp.float64) for x in (q64, k64, v64)]

        def ref_loss(q, k, v):
            return jnp.sum(_jnp_attention(jnp, q, k, v, scale, causal) * jnp.asarray(w64))

        ref_out = np.asarray(_jnp_attention(jnp, *args, scale, causal))
        refs = [np.asarray(g) for g in jax.grad(ref_loss, argnums=(0, 1, 2))(*args)]
    name = jnp.dtype(dtype).name
    naive_out, naive_grads = None, (None, None, None)
    dout64 = _np64(w.astype(jnp.float32))
    if name in HALF:
        naive_out, _ = attention_naive(q64, k64, v64, scale, causal, name)
        naive_grads = attention_naive_backward(dout64, q64, k64, v64, scale, causal, name)
    sq, sk = shape_q[1], shape_kv[1]
    _assert_close("out", _np64(out), ref_out, naive_out, name, sq, sk, FWD_FACTOR)
    magnitude = max(float(np.abs(r).max()) for r in refs)
    for label, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naive_grads):
        _assert_close(label, _np64(g), r, n, name, sq, sk, BWD_FACTOR, magnitude)
    # The jnp reference agrees with the project's float64 reference.
    ref_np, _ = attention_ref(q64, k64, v64, scale, causal)
    np.testing.assert_allclose(ref_out, ref_np, rtol=0, atol=1e-10 * max(1, np.abs(ref_np).max()))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_jax_grad_matches_jnp_reference(dtype, causal, request):
    jax, device = _jax_gpu()
    _check_jax_grad(jax, device, dtype, (2, 200, 8, 64), (2, 257, 2, 64), causal,
                    seed_of(request))


def test_jax_grad_on_cpu_arrays_runs_the_numpy_path():
    jax = _jax()
    _check_jax_grad(jax, jax.devices("cpu")[0], "float32", (1, 33, 4, 16), (1, 47, 2, 16),
                    True, 5)


@pytest.mark.gpu
def test_jax_arrays_are_read_in_place_and_results_are_not_copied(monkeypatch):
    jax, device = _jax_gpu()
    cp = _cupy()
    import jax.numpy as jnp
    rng = np.random.default_rng(51)
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal((1, 300, 4, 64)), jnp.bfloat16),
                              device) for _ in range(3))
    view = cp.from_dlpack(q)
    assert view.data.ptr == q.unsafe_buffer_pointer()
    assert view.dtype.name == "bfloat16"
    ptrs = _record_results(monkeypatch)
    out, lse = cf.flash_attention(q, k, v, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert [out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()] == ptrs
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32


@pytest.mark.gpu
def test_jax_inputs_still_being_computed_are_waited_for():
    """JAX dispatches asynchronously: q is the tail of a long matmul chain when we get it."""
    jax, device = _jax_gpu()
    import jax.numpy as jnp
    rng = np.random.default_rng(61)
    host = [rng.standard_normal((1, 1024, 4, 64)).astype(np.float32) for _ in range(3)]
    k, v = (jax.device_put(jnp.asarray(x, jnp.float16), device) for x in host[1:])
    n = LONG_MATMUL_N
    m = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / n ** 0.5,
                       device)
    m.block_until_ready()
    big = _long_job(jnp.tanh, m)
    # q depends on the chain's last element: it is not computed yet when we receive it.
    q = (jax.device_put(jnp.asarray(host[0]), device) + 0 * big[0, 0]).astype(jnp.float16)
    out = cf.flash_attention(q, k, v, causal=True)
    expected = cf.flash_attention(jax.device_put(jnp.asarray(host[0], jnp.float16), device),
                                  k, v, causal=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


# =============================================================================================
# The README's examples

def _readme_blocks():
    text = README.read_text()
    pattern = re.compile(r"<!-- test: (\w+) -->\s*```python\n(.*?)```", re.S)
    return {name: code for name, code in pattern.findall(text)}


# The README's examples of the variant keywords and of the user mods run on NumPy arrays, like
# its NumPy example; the user mods' CuPy example on the GPU.
HOST_EXAMPLES = ("numpy", "window_size", "softcap", "alibi_slopes", "dropout", "user_mods",
                 "varlen", "kvcache", "ring_local")
GPU_EXAMPLES = ("cupy", "jax", "torch", "cuda_graphs", "user_mods_cupy", "hf_transformers")


def _needs(framework):
    if framework in HOST_EXAMPLES:
        return
    _cupy()
    if framework in ("torch", "cuda_graphs", "hf_transformers"):
        _torch_cuda()
    elif framework == "jax":
        _jax_gpu()
    if framework == "hf_transformers":
        pytest.importorskip("transformers.masking_utils")


def test_readme_has_one_tested_example_per_framework_and_variant():
    assert sorted(_readme_blocks()) == sorted(GPU_EXAMPLES + HOST_EXAMPLES)


@pytest.mark.parametrize("framework", [
    *HOST_EXAMPLES,
    pytest.param("cupy", marks=pytest.mark.gpu),
    pytest.param("torch", marks=pytest.mark.gpu),
    pytest.param("cuda_graphs", marks=pytest.mark.gpu),
    pytest.param("jax", marks=pytest.mark.gpu),
    pytest.param("user_mods_cupy", marks=pytest.mark.gpu),
    pytest.param("hf_transformers", marks=pytest.mark.gpu),
])
def test_readme_example_runs(framework, monkeypatch):
    _needs(framework)
    code = _readme_blocks()[framework]
    # A module found under its name, as a real one is: torch.compile imports the module of
    # the functions it traces.
    readme = types.ModuleType("readme")
    monkeypatch.setitem(sys.modules, "readme", readme)
    exec(compile(code, f"README.md ({framework} example)", "exec"), readme.__dict__)
