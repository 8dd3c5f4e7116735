"""Checks shared by the GPU tests (test_gpu_dense.py, test_gpu_sparse.py, test_interop.py).

Tolerances follow FlashAttention's rule (DESIGN.md): fp16/bf16 within 2x (out) or 3x (dq, dk, dv)
the error of a naive same-dtype implementation against the float64 reference; float32 and float64
to their own precision (float32 error rules out TF32). lse is compared with the float64 lse of the
same (dtype-rounded) inputs.

The checks take a test case (``Case``, or any object with its fields: ``dtype``, a key of
``DTYPES``, ``batch``, ``sq``, ``sk``, ``nheads``, ``nheads_k``, ``d`` and ``causal``), an
optional element ``mask`` (bool, (heads or 1, sq, sk) or (batch or 1, heads or 1, sq, sk), True
where visible) that the reference applies on top of ``causal``, and the call's variant as
tests/reference.py's keywords (``window_size``, ``softcap``, ``alibi_slopes``, ``dropout``: the
multiplier of P, ``score_mod``: a dense spelling of the user's), passed through to the reference
and the naive implementation. Where ALiBi or a score_mod moves the scores far from 0, the fp32
and fp64 bounds widen with the largest |lse| (``tight_rtol``); where a result's terms cancel
(dv of a single key is a plain sum of dout), they add 4 roundings of the sums of the terms'
absolute values (``assert_tight``); the gradients of a score_mod's arrays are held to
``assert_table_rule``.

Importable without CuPy (``cp`` is then None): test_interop.py's host-only tests use the
tolerances and seeds from here.
"""
import math
import zlib
from dataclasses import dataclass

import numpy as np
import pytest

import ml_dtypes

try:
    import cupy as cp
except ImportError:             # CPU-only: only the constants and host helpers are usable
    cp = None

import cupyflash as cf

try:
    from reference import (assert_rule, attention_naive, attention_naive_backward,
                           attention_ref, attention_ref_backward, max_abs_err, random_inputs)
except ImportError:
    from tests.reference import (assert_rule, attention_naive, attention_naive_backward,
                                 attention_ref, attention_ref_backward, max_abs_err,
                                 random_inputs)

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16),
          "fp32": np.dtype(np.float32), "fp64": np.dtype(np.float64)}
HALF = ("bf16", "fp16")

# Forward rule factor (out) and backward factor (dq, dk, dv), from DESIGN.md.
FWD_FACTOR, BWD_FACTOR = 2, 3
# lse: fp32 statistics, compared relative to max(|lse|, 1).
LSE_RTOL = {"bf16": 1e-4, "fp16": 1e-4, "fp32": 1e-5, "fp64": 1e-10}
FP64_RTOL = 1e-10
# One rounding of fp32 and of fp64 (unit roundoff), indexed by "is fp64".
ROUNDING = (2.0 ** -24, 2.0 ** -53)


def fp32_rtol(sq, sk):
    # Round-off of fp32 sums grows like the square root of the reduction length; 1e-5 of the
    # largest reference value at 1K keys is still ~100x below what TF32 (10-bit mantissa) gives.
    return 1e-5 * max(1.0, math.sqrt(max(sq, sk) / 1024))


@dataclass(frozen=True)
class Case:
    """A GPU test case: the fields the checks here read, and ``id`` for test ids."""
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


def seed_of(request):
    """A different, reproducible seed for every test case."""
    return zlib.crc32(request.node.nodeid.encode())


def params(cases):
    return [pytest.param(c, id=c.id) for c in cases]


def make_inputs(case, seed):
    """q, k, v, dout of the case's shapes and dtype, on the GPU."""
    dtype = DTYPES[case.dtype]
    shape_q = (case.batch, case.sq, case.nheads, case.d)
    shape_kv = (case.batch, case.sk, case.nheads_k, case.d)
    q, k, v = random_inputs(cp, shape_q, shape_kv, dtype, seed)
    # random_inputs draws q, k, v from seed, seed + 1, seed + 2: dout takes seed + 3.
    dout = random_inputs(cp, shape_q, shape_q, dtype, seed + 3)[0]
    return q, k, v, dout


def wide(a):
    return a.astype(cp.float64)


def has_nan(a):
    return bool(cp.isnan(wide(a)).any())


def first(result):
    # The naive forward may return (out, lse); only out is compared by the rule.
    return result[0] if isinstance(result, tuple) else result


def assert_tight(name, got, ref, rtol, magnitude=None, sizes=None):
    """``got`` within ``rtol`` of the largest reference value (or ``magnitude``), plus, where
    ``sizes`` (the sums of the absolute values of the reference's terms) is given, 4 roundings
    of the input dtype's precision (fp32 or fp64, from ``got``) of the largest size: a sum whose
    terms cancel keeps the rounding of its partial sums, which its result does not scale."""
    rounding = ROUNDING[got.dtype == cp.float64]
    got, ref = wide(got), wide(cp.asarray(ref))
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    assert not bool(cp.isnan(got).any()), f"{name} has NaN"
    err = float(cp.abs(got - ref).max())
    top = max(float(cp.abs(ref).max()) if magnitude is None else magnitude, 1e-30)
    slack = 0.0 if sizes is None else 4 * rounding * float(cp.asarray(sizes).max())
    assert err <= rtol * top + slack, \
        (f"{name}: max error {err:.3e} > {rtol:.1e} * max|ref| ({top:.3e}) + {slack:.3e} "
         f"(the rounding of the terms' sizes), ratio {err / top:.2e}")


def assert_lse(lse, ref_lse, dtype_name):
    expected = np.float64 if dtype_name == "fp64" else np.float32
    assert lse.dtype == expected, f"lse dtype {lse.dtype}, expected {np.dtype(expected)}"
    lse, ref = wide(lse), wide(cp.asarray(ref_lse))
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


def tight_rtol(case, lse=None, variant=None):
    """The bound of fp32 (``fp32_rtol``) and fp64 (``FP64_RTOL``), relative to the largest
    reference value. Where the ``variant`` (reference keywords) has ALiBi or a score_mod,
    which can move the scores far from 0 (a linear bias at long distances), 4 roundings of
    the largest finite |lse| where that is more: the kernels' scores and the lse the backward
    is handed are in the input dtype, and their rounding turns into a relative error of that
    size in P = exp(s - lse). ``lse``: the reference's (forward) or the one the backward was
    handed; needed only there."""
    base = fp32_rtol(case.sq, case.sk) if case.dtype == "fp32" else FP64_RTOL
    variant = variant or {}
    if variant.get("alibi_slopes") is None and variant.get("score_mod") is None:
        return base
    if lse is None:
        raise ValueError("tight_rtol: ALiBi and a score_mod widen the bound by the lse: pass it")
    finite = cp.isfinite(lse)
    top = float(cp.abs(lse[finite]).max()) if bool(finite.any()) else 0.0
    return max(base, 4 * ROUNDING[case.dtype == "fp64"] * top)


def check_forward(case, q, k, v, out, lse, scale, mask=None, **variant):
    """out and lse against the float64 reference (under the element ``mask`` if given, with
    the reference keywords ``variant``)."""
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (case.batch, case.nheads, case.sq)
    tight = case.dtype not in HALF
    ref_out, ref_lse, *sizes = attention_ref(q, k, v, scale, case.causal, mask=mask,
                                             term_sizes=tight, **variant)
    if not tight:
        naive = first(attention_naive(q, k, v, scale, case.causal, q.dtype, mask=mask,
                                      **variant))
        assert not has_nan(out), "out has NaN"
        assert_rule("out", out, ref_out, naive, FWD_FACTOR)
    else:
        assert_tight("out", out, ref_out, tight_rtol(case, ref_lse, variant), sizes=sizes[0])
    assert_lse(lse, ref_lse, case.dtype)


def assert_table_rule(name, got, ref, ref_given_out, naive, size):
    """FlashAttention's rule for the gradient of a score_mod's array (host arrays), with the
    kernels' error taken against the reference given the out they were handed: the backward
    takes D = rowsum(dout * out) from out as the forward rounded it, and a table entry adds
    that rounding up over whole rows and heads, which a naive implementation (D from P dP)
    does not. ``size``: the largest sum of the terms' sizes (tests/reference.py), the
    slack's scale: an entry may cancel to 0 (exactly, where each row sees one key, while the
    kernels add rounding noise)."""
    assert not np.isnan(got).any(), f"{name} has NaN"
    err, naive_err = max_abs_err(got, ref_given_out), max_abs_err(naive, ref)
    bound = BWD_FACTOR * naive_err + 1e-6 * size + 1e-7
    assert err <= bound, (f"{name}: max error {err:.3e} vs the reference given out exceeds "
                          f"{BWD_FACTOR} x naive error {naive_err:.3e} + slack (= {bound:.3e})")


def check_backward(case, dout, q, k, v, grads, scale, mask=None, *, out=None, lse=None,
                   **variant):
    """(dq, dk, dv) against the float64 reference (under the element ``mask`` if given, with
    the reference keywords ``variant``); ``lse``, the one the backward was handed, where
    ``tight_rtol`` needs it. With a score_mod that names arrays whose gradient the backward
    returns (a fourth result, float32, float64 for fp64), those by ``assert_table_rule``
    against a naive implementation's (its rounded dS added up in float32, float64 for fp64)
    and the reference given ``out``, the forward's out the backward was handed."""
    tight = case.dtype not in HALF
    refs = attention_ref_backward(dout, q, k, v, scale, case.causal, mask=mask,
                                  term_sizes=tight, **variant)
    if tight:   # last, the sizes of the gradients' terms
        *refs, grad_sizes = refs
    # With a score_mod the reference adds its arrays' gradients and the sizes of their terms.
    ref_tables, sizes = refs[3:] if len(refs) == 5 else ({}, {})
    refs = refs[:3]
    tables = grads[3] if len(grads) == 4 else {}
    assert set(tables) == set(ref_tables), \
        f"table gradients {sorted(tables)}, expected {sorted(ref_tables)}"
    # One scale for the three gradients: a gradient that cancels to exactly 0 has none of its
    # own, and its own max would make rounding noise look infinite. Dense: dq when seqlen_k = 1
    # (dS = dP - D = 0); with a mask also dq of a row that sees one key and dk/dv of keys no
    # query sees.
    magnitude = max(float(cp.abs(wide(cp.asarray(r))).max()) for r in refs)
    for name, g, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype, \
            f"{name}: {g.shape} {g.dtype}, expected {like.shape} {like.dtype}"
    naives = None
    if not tight or tables:
        naives = attention_naive_backward(dout, q, k, v, scale, case.causal, q.dtype,
                                          mask=mask, **variant)
    if not tight:
        for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naives):
            assert not has_nan(g), f"{name} has NaN"
            assert_rule(name, g, r, n, BWD_FACTOR, magnitude)
    else:
        rtol = tight_rtol(case, lse, variant)
        for name, g, r, size in zip(("dq", "dk", "dv"), grads, refs, grad_sizes):
            assert_tight(name, g, r, rtol, magnitude, size)
    if not tables:
        return
    if out is None:
        raise ValueError("check_backward: the gradients of a score_mod's arrays are checked "
                         "against the reference given the forward's out: pass out=")
    given = attention_ref_backward(dout, q, k, v, scale, case.causal, mask=mask, out=out,
                                   **variant)[3]
    table_dtype = cp.float64 if case.dtype == "fp64" else cp.float32
    for name, t in tables.items():
        assert isinstance(t, cp.ndarray) and t.dtype == table_dtype, \
            f"d {name}: {type(t)} {t.dtype}"
        assert t.shape == ref_tables[name].shape, f"d {name}: shape {t.shape}"
        assert_table_rule(f"d {name}", cp.asnumpy(t), ref_tables[name], given[name],
                          naives[3][name], float(sizes[name].max()))


def run_and_check(case, q, k, v, dout, deterministic=False, block_mask=None):
    """Forward and backward (with ``block_mask`` if given), each checked against the reference
    (under the element mask ``block_mask.to_dense()`` if given). Returns out, lse, (dq, dk, dv)."""
    scale = case.d ** -0.5
    mask = None if block_mask is None else cp.asarray(block_mask.to_dense())
    out, lse = cf.flash_attention(q, k, v, causal=case.causal, softmax_scale=scale,
                                  block_mask=block_mask, return_lse=True)
    check_forward(case, q, k, v, out, lse, scale, mask)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                        softmax_scale=scale, block_mask=block_mask,
                                        deterministic=deterministic)
    check_backward(case, dout, q, k, v, grads, scale, mask)
    return out, lse, grads


def assert_rows_without_keys(out, lse, dq, empty, seen):
    """Query rows ``empty`` (an index along seqlen_q) see no key: out and dq are 0 there and lse
    is -inf; rows ``seen`` have a finite lse."""
    assert bool((wide(out[:, empty]) == 0).all()), "out is not 0 on rows without keys"
    assert bool((wide(dq[:, empty]) == 0).all()), "dq is not 0 on rows without keys"
    assert bool(cp.isneginf(lse[:, :, empty]).all()), "lse is not -inf on rows without keys"
    assert bool(cp.isfinite(lse[:, :, seen]).all()), "lse is not finite on rows with keys"


def assert_bit_identical_grads(first_grads, second_grads):
    """Two deterministic backward runs (fp16/bf16) gave the same bits."""
    for name, a, b in zip(("dq", "dk", "dv"), first_grads, second_grads):
        same = bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
        assert same, f"{name} differs between two deterministic runs"
