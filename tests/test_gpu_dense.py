"""Dense forward and backward on the GPU against a float64 reference computed on the GPU.

fp16/bf16 follow FlashAttention's rule (DESIGN.md): our error against the float64 reference is
at most 2x (out) or 3x (dq, dk, dv) the error of a naive same-dtype implementation. float32 and
float64 must match the reference to their own precision (float32 error rules out TF32).
lse is compared with the float64 lse of the same (dtype-rounded) inputs.
"""
import math
import zlib
from dataclasses import dataclass

import numpy as np
import pytest

import ml_dtypes

cp = pytest.importorskip("cupy")

import cupyflash as cf  # noqa: E402

try:
    from reference import (assert_rule, attention_naive, attention_naive_backward,  # noqa: E402
                           attention_ref, attention_ref_backward, random_inputs)
except ImportError:
    from tests.reference import (assert_rule, attention_naive,  # noqa: E402
                                 attention_naive_backward, attention_ref, attention_ref_backward,
                                 random_inputs)

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16),
          "fp32": np.dtype(np.float32), "fp64": np.dtype(np.float64)}
HALF = ("bf16", "fp16")

HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)

# (seqlen_q, seqlen_k): every length of the issue in both roles, seqlen_q != seqlen_k both ways.
SEQLEN_PAIRS = ((1, 17), (17, 1), (97, 255), (255, 97), (128, 128), (128, 1023), (1023, 128),
                (1023, 1025), (1025, 1023), (1, 2048), (2048, 17), (2048, 2048))

# Forward rule factor (out) and backward factor (dq, dk, dv), from DESIGN.md.
FWD_FACTOR, BWD_FACTOR = 2, 3
# lse: fp32 statistics, compared relative to max(|lse|, 1).
LSE_RTOL = {"bf16": 1e-4, "fp16": 1e-4, "fp32": 1e-5, "fp64": 1e-10}
FP64_RTOL = 1e-10


def _fp32_rtol(sq, sk):
    # Round-off of fp32 sums grows like the square root of the reduction length; 1e-5 of the
    # largest reference value at 1K keys is still ~100x below what TF32 (10-bit mantissa) gives.
    return 1e-5 * max(1.0, math.sqrt(max(sq, sk) / 1024))


@dataclass(frozen=True)
class Case:
    dtype: str
    sq: int
    sk: int
    d: int
    causal: bool
    batch: int = 1
    nheads: int = 2
    nheads_k: int = 2

    @property
    def id(self):
        heads = f"h{self.nheads}" if self.nheads == self.nheads_k else \
            f"h{self.nheads}k{self.nheads_k}"
        return (f"{self.dtype}-b{self.batch}-{heads}-q{self.sq}-k{self.sk}-d{self.d}-"
                f"{'causal' if self.causal else 'full'}")


def _params(cases):
    return [pytest.param(c, id=c.id) for c in cases]


def _main_cases():
    cases = []
    for j, dtype in enumerate(DTYPES):
        for i, (sq, sk) in enumerate(SEQLEN_PAIRS):
            # Each (pair, dtype) gets its own head dim, so every head dim meets 4 pairs.
            d = HEAD_DIMS[(i + 3 * j) % len(HEAD_DIMS)]
            small = sq * sk <= 255 * 255
            b, h = (2, 3) if small else (1, 2)
            for causal in (False, True):
                cases.append(Case(dtype, sq, sk, d, causal, b, h, h))
    return cases


def _seed(request):
    """A different, reproducible seed for every test case."""
    return zlib.crc32(request.node.nodeid.encode())


def _inputs(case, seed):
    dtype = DTYPES[case.dtype]
    shape_q = (case.batch, case.sq, case.nheads, case.d)
    shape_kv = (case.batch, case.sk, case.nheads_k, case.d)
    q, k, v = random_inputs(cp, shape_q, shape_kv, dtype, seed)
    # random_inputs draws q, k, v from seed, seed + 1, seed + 2: dout takes seed + 3.
    dout = random_inputs(cp, shape_q, shape_q, dtype, seed + 3)[0]
    return q, k, v, dout


def _wide(a):
    return a.astype(cp.float64)


def _has_nan(a):
    return bool(cp.isnan(_wide(a)).any())


def _first(result):
    # The naive forward may return (out, lse); only out is compared by the rule.
    return result[0] if isinstance(result, tuple) else result


def _assert_tight(name, got, ref, rtol, magnitude=None):
    got, ref = _wide(got), _wide(cp.asarray(ref))
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    assert not bool(cp.isnan(got).any()), f"{name} has NaN"
    err = float(cp.abs(got - ref).max())
    top = max(float(cp.abs(ref).max()) if magnitude is None else magnitude, 1e-30)
    assert err <= rtol * top, \
        f"{name}: max error {err:.3e} > {rtol:.1e} * max|ref| ({top:.3e}), ratio {err / top:.2e}"


def _assert_lse(lse, ref_lse, dtype_name):
    expected = np.float64 if dtype_name == "fp64" else np.float32
    assert lse.dtype == expected, f"lse dtype {lse.dtype}, expected {np.dtype(expected)}"
    lse, ref = _wide(lse), _wide(cp.asarray(ref_lse))
    assert lse.shape == ref.shape, f"lse shape {lse.shape}, expected {ref.shape}"
    assert not bool(cp.isnan(lse).any()), "lse has NaN"
    empty = cp.isneginf(ref)
    assert bool((cp.isneginf(lse) == empty).all()), "lse is -inf exactly on the rows without keys"
    seen = ~empty
    if not bool(seen.any()):
        return
    lse, ref = lse[seen], ref[seen]        # boolean indexing: -inf rows never subtract
    err = cp.abs(lse - ref)
    bound = LSE_RTOL[dtype_name] * cp.maximum(cp.abs(ref), 1.0)
    worst = float((err / bound).max())
    assert worst <= 1.0, (f"lse: error up to {worst:.2f}x the bound "
                          f"{LSE_RTOL[dtype_name]:.0e} * max(|lse|, 1); "
                          f"max abs error {float(err.max()):.3e}")


def _check_forward(case, q, k, v, out, lse, scale):
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (case.batch, case.nheads, case.sq)
    ref_out, ref_lse = attention_ref(q, k, v, scale, case.causal)
    if case.dtype in HALF:
        naive = _first(attention_naive(q, k, v, scale, case.causal, q.dtype))
        assert not _has_nan(out), "out has NaN"
        assert_rule("out", out, ref_out, naive, FWD_FACTOR)
    else:
        rtol = _fp32_rtol(case.sq, case.sk) if case.dtype == "fp32" else FP64_RTOL
        _assert_tight("out", out, ref_out, rtol)
    _assert_lse(lse, ref_lse, case.dtype)


def _check_backward(case, dout, q, k, v, grads, scale):
    refs = attention_ref_backward(dout, q, k, v, scale, case.causal)
    # One scale for the three gradients: dq cancels to exactly 0 when seqlen_k = 1
    # (dS = dP - D = 0), so its own max would make rounding noise look infinite.
    magnitude = max(float(cp.abs(_wide(cp.asarray(r))).max()) for r in refs)
    for name, g, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype, \
            f"{name}: {g.shape} {g.dtype}, expected {like.shape} {like.dtype}"
    if case.dtype in HALF:
        naives = attention_naive_backward(dout, q, k, v, scale, case.causal, q.dtype)
        for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
            assert not _has_nan(g), f"{name} has NaN"
            assert_rule(name, g, r, n, BWD_FACTOR, magnitude)
    else:
        rtol = _fp32_rtol(case.sq, case.sk) if case.dtype == "fp32" else FP64_RTOL
        for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
            _assert_tight(name, g, r, rtol, magnitude)


def _run_and_check(case, q, k, v, dout, deterministic=False):
    scale = case.d ** -0.5
    out, lse = cf.flash_attention(q, k, v, causal=case.causal, softmax_scale=scale,
                                  return_lse=True)
    _check_forward(case, q, k, v, out, lse, scale)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                        softmax_scale=scale, deterministic=deterministic)
    _check_backward(case, dout, q, k, v, grads, scale)
    return out, lse, grads


@pytest.mark.parametrize("case", _params(_main_cases()))
def test_forward_backward_match_reference(case, request):
    q, k, v, dout = _inputs(case, _seed(request))
    _run_and_check(case, q, k, v, dout)


def _head_layout_cases():
    cases = []
    for dtype in DTYPES:
        for causal in (False, True):
            cases.append(Case(dtype, 255, 1023, 64, causal, 2, 16, 2))    # GQA, 8 query heads per kv head
            cases.append(Case(dtype, 1023, 255, 128, causal, 2, 8, 1))    # MQA
    return cases


@pytest.mark.parametrize("case", _params(_head_layout_cases()))
def test_grouped_heads_gqa_mqa(case, request):
    q, k, v, dout = _inputs(case, _seed(request))
    _run_and_check(case, q, k, v, dout)


def _strided_cases(packing):
    cases = []
    for dtype in ("bf16", "fp16", "fp32"):
        for causal in (False, True):
            if packing == "qkv":
                cases.append(Case(dtype, 255, 255, 80, causal, 2, 4, 4))
            else:
                cases.append(Case(dtype, 97, 1025, 59, causal, 2, 4, 2))
    return cases


@pytest.mark.parametrize("case", _params(_strided_cases("qkv")))
def test_strided_packed_qkv(case, request):
    """q, k, v are slices of one (batch, seqlen, 3, nheads, headdim) tensor, read in place."""
    q, k, v, dout = _inputs(case, _seed(request))
    qkv = cp.stack([q, k, v], axis=2)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    _run_and_check(case, q, k, v, dout)


@pytest.mark.parametrize("case", _params(_strided_cases("kv")))
def test_strided_packed_kv_and_head_major_q(case, request):
    """k, v are slices of one (batch, seqlen_k, nheads_k, 2, headdim) tensor; q is stored
    head-major (batch, nheads, seqlen_q, headdim) and seen through a transposed view."""
    q, k, v, dout = _inputs(case, _seed(request))
    kv = cp.stack([k, v], axis=3)
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    q = cp.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    dout = cp.ascontiguousarray(dout.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not (k.flags.c_contiguous or q.flags.c_contiguous)
    _run_and_check(case, q, k, v, dout)


def _empty_row_cases():
    cases = []
    for dtype in DTYPES:
        cases.append(Case(dtype, 97, 17, 64, True, 2, 2, 2))
        cases.append(Case(dtype, 1025, 128, 40, True, 1, 2, 1))
    return cases


@pytest.mark.parametrize("case", _params(_empty_row_cases()))
def test_causal_rows_without_keys_are_zero(case, request):
    """Causal with seqlen_q > seqlen_k, bottom-right aligned: the first seqlen_q - seqlen_k
    queries see no key. Their output and dq are 0, lse is -inf, and no NaN appears."""
    q, k, v, dout = _inputs(case, _seed(request))
    out, lse, (dq, dk, dv) = _run_and_check(case, q, k, v, dout)
    empty = case.sq - case.sk
    for name, a in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not _has_nan(a), f"{name} has NaN"
    assert bool((_wide(out[:, :empty]) == 0).all()), "out is not 0 on rows without keys"
    assert bool((_wide(dq[:, :empty]) == 0).all()), "dq is not 0 on rows without keys"
    assert bool(cp.isneginf(lse[:, :, :empty]).all()), "lse is not -inf on rows without keys"
    assert bool(cp.isfinite(lse[:, :, empty:]).all()), "lse is not finite on rows with keys"


def _poison_pool(nbytes_list, copies=4):
    """Leave free blocks of exactly these sizes, filled with 0xFF bytes (NaN in every float
    format), in CuPy's memory pool, so that the library's cp.empty outputs land on them."""
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    blocks = []
    for n in nbytes_list:
        for _ in range(copies):
            a = cp.empty(n, cp.uint8)
            a.fill(255)
            blocks.append(a)
    del a
    blocks.clear()


def _poison_cases():
    cases = []
    for dtype in DTYPES:
        cases.append(Case(dtype, 97, 255, 40, False, 2, 3, 3))
        cases.append(Case(dtype, 255, 97, 111, True, 2, 4, 2))
    return cases


@pytest.mark.parametrize("case", _params(_poison_cases()))
def test_every_output_element_is_written(case, request):
    """Outputs are allocated on NaN-filled memory; any element the kernels skip shows as NaN."""
    q, k, v, dout = _inputs(case, _seed(request))
    acc = 8 if case.dtype == "fp64" else 4
    lse_bytes = case.batch * case.nheads * case.sq * acc
    _poison_pool(sorted({q.nbytes, k.nbytes, v.nbytes, lse_bytes, q.size * 4}))
    probe = cp.empty(q.shape, q.dtype)
    assert bool((probe.view(cp.uint8) == 255).all()), "test setup: the pool was not poisoned"
    del probe
    scale = case.d ** -0.5
    out, lse = cf.flash_attention(q, k, v, causal=case.causal, softmax_scale=scale,
                                  return_lse=True)
    dq, dk, dv = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                             softmax_scale=scale)
    for name, a in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not _has_nan(a), f"{name} has NaN: an element was never written"
    _check_forward(case, q, k, v, out, lse, scale)
    _check_backward(case, dout, q, k, v, (dq, dk, dv), scale)


def _deterministic_cases():
    return [Case(dtype, 1023, 1025, 128, causal, 2, 4, 2)
            for dtype in HALF for causal in (False, True)]


@pytest.mark.parametrize("case", _params(_deterministic_cases()))
def test_deterministic_backward_is_bit_identical(case, request):
    q, k, v, dout = _inputs(case, _seed(request))
    out, lse, first = _run_and_check(case, q, k, v, dout, deterministic=True)
    scale = case.d ** -0.5
    second = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                         softmax_scale=scale, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        same = bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
        assert same, f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float32_does_not_use_tf32(causal, request):
    """TF32 keeps 10 mantissa bits (relative error ~1e-3); true fp32 stays near 1e-6."""
    case = Case("fp32", 255, 1023, 128, causal, 2, 2, 2)
    q, k, v, dout = _inputs(case, _seed(request))
    scale = case.d ** -0.5
    out, lse = cf.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    dq, dk, dv = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                             softmax_scale=scale)
    ref_out, _ = attention_ref(q, k, v, scale, causal)
    refs = attention_ref_backward(dout, q, k, v, scale, causal)
    _assert_tight("out", out, ref_out, 1e-5)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        _assert_tight(name, g, r, 1e-5)
