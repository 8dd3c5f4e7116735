"""Reference attention and the tolerance rule, shared by the CPU and GPU tests.

Every function works on NumPy or CuPy arrays alike (``xp`` is taken from the inputs).

- ``attention_ref`` / ``attention_ref_backward``: plain full-matrix attention in float64, the
  "true" answer.
- ``attention_naive`` / ``attention_naive_backward``: what a naive implementation in a given
  dtype gives (each stage computed in float32 from operands rounded to that dtype, its result
  rounded to it), i.e. how far a same-dtype standard attention lands from the truth.
- ``assert_rule``: FlashAttention's rule, our error <= factor * the naive error + tiny slack.

Dropout enters each of them as ``dropout``: the multiplier ``keep / (1 - effective_p)``, (batch,
nheads, seqlen_q, seqlen_k), ``keep`` the public ``cupyflash.dropout_mask`` (``dropout_scale``
builds it); it multiplies P after the softmax (lse is that of the undropped softmax).

A user score_mod enters them as ``score_mod``, spelled out densely (see ``_scores``), a mask_mod
as the element ``mask`` it gives.
"""
import numpy as np

try:
    import cupy
except ImportError:             # CPU-only CI
    cupy = None

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def get_xp(*arrays):
    return cupy.get_array_module(*arrays) if cupy is not None else np


def rel_err(got, ref):
    """max |got - ref| / max(max |ref|, 1) over the finite entries of ref, in the arrays'
    module. The floor of 1 is the size of the standard-normal inputs: a result that is 0 in
    exact arithmetic (dq when each row sees one key: dS = P * (dP - D) = 0) comes out as
    rounding noise of that size."""
    xp = get_xp(got, ref)
    got, ref = xp.asarray(got).astype(xp.float64), xp.asarray(ref).astype(xp.float64)
    finite = xp.isfinite(ref)
    if not bool(finite.any()):
        return 0.0
    top = max(float(xp.abs(ref[finite]).max()), 1.0)
    return float(xp.abs(got[finite] - ref[finite]).max()) / top


def np_dtype(dtype):
    """A NumPy dtype from a name ("bfloat16" through ml_dtypes) or a dtype."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


# ---------------------------------------------------------------------------------------------
# Inputs

def random_array(xp, shape, dtype, seed):
    """Standard-normal data of ``shape`` in ``dtype`` (bfloat16 through ml_dtypes), drawn on the
    host and moved to the device for CuPy. Never zeros."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np_dtype(dtype))
    # CuPy 14 holds ml_dtypes.bfloat16 arrays as raw 16-bit data (the H100 runs use this path).
    return x if xp is np else xp.asarray(x)


def random_inputs(xp, shape_q, shape_kv, dtype, seed):
    """Fresh (q, k, v): q of ``shape_q``, k and v of ``shape_kv``."""
    return (random_array(xp, shape_q, dtype, seed),
            random_array(xp, shape_kv, dtype, seed + 1),
            random_array(xp, shape_kv, dtype, seed + 2))


# ---------------------------------------------------------------------------------------------
# Rounding to a dtype, kept in float32 (CuPy has no bfloat16 arithmetic)

def round_to(x, dtype):
    """``x`` rounded to ``dtype`` ("float16", "bfloat16", "float32", "float64"), returned as
    float32 (float64 for "float64") holding values representable in ``dtype``."""
    xp = get_xp(x)
    dtype = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if dtype == "float64":
        return x.astype(xp.float64)
    x = x.astype(xp.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(xp.float16).astype(xp.float32)
    if dtype == "bfloat16":
        return _round_bf16(x)
    raise ValueError(f"dtype must be float16, bfloat16, float32 or float64, got {dtype!r}")


def _round_bf16(x):
    """Round-to-nearest-even of float32 to bfloat16 on the bits: add 0x7FFF plus the lowest
    kept bit, then clear the 16 dropped bits. NaN is kept as is (the add could carry it)."""
    xp = get_xp(x)
    bits = xp.ascontiguousarray(x).view(xp.uint32)
    lsb = (bits >> xp.uint32(16)) & xp.uint32(1)
    rounded = ((bits + xp.uint32(0x7FFF) + lsb) & xp.uint32(0xFFFF0000)).view(xp.float32)
    return xp.where(xp.isnan(x), x, rounded)


def _einsum(spec, a, b):
    """Two-operand einsum through BLAS (NumPy's default is a plain loop, slow at large sizes)."""
    return get_xp(a, b).einsum(spec, a, b, optimize=True)


# ---------------------------------------------------------------------------------------------
# The float64 reference

def visible(xp, seqlen_q, seqlen_k, causal, window_size=(-1, -1)):
    """(seqlen_q, seqlen_k) bool, True where query i sees key j, from the documented rule
    (written here apart from cupyflash._spec on purpose): with the offset ``o = j - (i +
    seqlen_k - seqlen_q)`` of key j from query i's bottom-right-aligned diagonal, j is seen iff
    ``o >= -left`` (unless left < 0), ``o <= right`` (unless right < 0) and, if causal,
    ``o <= 0``."""
    left, right = window_size
    offset = xp.arange(seqlen_k)[None, :] - (xp.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q)
    seen = xp.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        seen &= offset >= -left
    if right >= 0:
        seen &= offset <= right
    if causal:
        seen &= offset <= 0
    return seen


def _repeat_kv(x, nheads):
    """(b, sk, hk, d) -> (b, sk, nheads, d): query head h uses kv head h // (nheads // hk)."""
    xp = get_xp(x)
    return xp.repeat(x, nheads // x.shape[2], axis=2)


def _sum_groups(dx, nheads_k):
    """(b, sk, nheads, d) -> (b, sk, nheads_k, d), summed over the query heads of each group."""
    b, s, h, d = dx.shape
    return dx.reshape(b, s, nheads_k, h // nheads_k, d).sum(axis=3)


def _softmax(s, xp):
    """Row softmax of (..., sq, sk) with -inf for masked entries; all-masked rows give P = 0.
    Returns (P, lse) with lse -inf for those rows; no NaN and no warning."""
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))
    e = xp.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    seen = l > 0
    l_safe = xp.where(seen, l, xp.ones_like(l))
    p = e / l_safe
    lse = xp.where(seen, m + xp.log(l_safe), xp.full_like(l, -xp.inf))
    return p, lse[..., 0]


def _unrounded(x):
    return x


def _scores(q, k, scale, causal, mask=None, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, bias=None, score_mod=None, rounded=_unrounded):
    """(b, h, sq, sk) scores, k already repeated to h heads, in FlashAttention 2's order:
    ``s = q k^T * scale``; with ``score_mod``, ``score_mod(s)``; with ``softcap``, ``softcap *
    tanh(s / softcap)``; with ``alibi_slopes`` ((h,) or (b, h)), plus ``-slope * |i + sk - sq -
    j|``; with ``bias`` (an additive score_mod spelled out densely, broadcasting to (b, h, sq,
    sk)), plus ``bias``; then -inf where masked: the band of ``causal`` and ``window_size``
    (``visible``) and ``mask`` (bool (h or 1, sq, sk), or (b or 1, h or 1, sq, sk) for a mask
    that varies over the batch; True where visible). Each stage's result goes through
    ``rounded``.

    ``score_mod``: a user score_mod spelled out densely, a callable taking the scores ``s``
    and returning the modified scores, their derivative d new / d s (None where it is 1) and
    ``tables(ds, sizes=False)``: the gradients of the mod's arrays (a dict of host NumPy
    arrays) from ``ds`` = d loss / d the modified scores, added up one term at a time in
    float64 for float64 ``ds``, else in float32 (as a naive implementation would); with
    ``sizes``, the sums of the terms' absolute values. Never with softcap or ALiBi (the call
    refuses them together).

    Returns ``(s, dmod, tables)``: ``dmod`` = d s / d (q k^T * scale) through the softcap or
    the score_mod (None where it is 1), ``tables`` the score_mod's (None without one)."""
    xp = get_xp(q)
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    s = rounded(_einsum("bihd,bjhd->bhij", q, k) * scale)
    dmod = tables = None
    if score_mod is not None:
        assert not softcap and alibi_slopes is None, "score_mod with softcap or ALiBi"
        s, dmod, tables = score_mod(s)
        s = rounded(s)
        dmod = None if dmod is None else rounded(dmod)
    if softcap:
        capped = xp.tanh(s / softcap)
        dmod = rounded(1 - capped * capped)
        s = rounded(softcap * capped)
    if alibi_slopes is not None:
        slopes = xp.asarray(alibi_slopes).reshape(-1, h)[:, :, None, None]     # (b or 1, h)
        distance = xp.abs(xp.arange(sq)[:, None] + (sk - sq) - xp.arange(sk)[None, :])
        s = rounded(s - slopes * distance)
    if bias is not None:
        s = rounded(s + xp.asarray(bias).astype(s.dtype))
    if causal or tuple(window_size) != (-1, -1):
        s = xp.where(visible(xp, sq, sk, causal, window_size), s, -xp.inf)
    if mask is not None:
        mask = xp.asarray(mask, dtype=bool)
        s = xp.where(mask if mask.ndim == 4 else mask[None], s, -xp.inf)
    return s, dmod, tables


def attention_ref(q, k, v, scale, causal, mask=None, dropout=None, term_sizes=False,
                  **variant):
    """Full-matrix attention in float64. Returns out (b, sq, h, d) and lse (b, h, sq).
    ``mask``: optional element mask, bool (h or 1, sq, sk) or (b or 1, h or 1, sq, sk), True
    where visible (e.g. ``BlockMask.to_dense()``), ANDed with causal. ``dropout``: the
    multiplier of P (``dropout_scale``) or None. ``variant``: ``window_size``, ``softcap``,
    ``alibi_slopes`` with ``flash_attention``'s meaning, ``bias`` and a dense ``score_mod``
    (see ``_scores``). ``term_sizes``: a third result, P |V|, the sums of the absolute values
    of out's terms: the scale of a computed out's rounding where the terms cancel."""
    xp = get_xp(q, k, v)
    q, k, v = (x.astype(xp.float64) for x in (q, k, v))
    h = q.shape[2]
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    s, _, _ = _scores(q, k, scale, causal, mask, **_float64(variant, xp))
    p, lse = _softmax(s, xp)
    if dropout is not None:
        p = p * dropout
    out = _einsum("bhij,bjhd->bihd", p, v)
    if term_sizes:
        return out, lse, _einsum("bhij,bjhd->bihd", p, xp.abs(v))
    return out, lse


def attention_ref_backward(dout, q, k, v, scale, causal, mask=None, dropout=None,
                           return_ds=False, out=None, term_sizes=False, **variant):
    """Gradients of ``attention_ref`` in float64, by the explicit formulas on the full matrix:
    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(P * dP)), times the derivative of the
    softcap or the ``score_mod`` (the ALiBi bias and an additive ``bias`` are constants),
    dQ = dS K * scale, dK = dS^T Q * scale; dk and dv summed over the query heads of each
    group. With ``dropout`` (the multiplier Z): dV = (P Z)^T dO, and dP = (dO V^T) Z in dS
    (whose rowsum(P dP) is then rowsum(dO * O)). ``out``: that row sum taken as rowsum(dO *
    out) from this out instead, as ``flash_attention_backward`` takes it from the out it is
    handed (rounded to the input dtype by the forward).

    Returns (dq, dk, dv); with a ``score_mod`` then two dicts by array name: the gradients
    of its arrays, and the sizes of their terms with dS replaced by P * (|dP| +
    |rowsum(P * dP)|), the scale of the rounding a computed dS carries (a check's magnitude
    where the terms cancel: to exactly 0 where each row sees one key, dS = 0); with
    ``return_ds`` last dS, (b, h, sq, sk), d loss / d the final scores, of which the gradient
    of an additive bias is a sum. With ``term_sizes``, before dS, the sums of the absolute
    values of dq's, dk's and dv's terms, dS again replaced by P * (|dP| + |rowsum(P * dP)|):
    the scale of the rounding of gradients whose terms cancel (dv of a single key is a plain
    sum of dO over the queries)."""
    xp = get_xp(dout, q, k, v)
    dout, q, k, v = (x.astype(xp.float64) for x in (dout, q, k, v))
    h, hk = q.shape[2], k.shape[2]
    k_h, v_h = _repeat_kv(k, h), _repeat_kv(v, h)
    s, dmod, tables = _scores(q, k_h, scale, causal, mask, **_float64(variant, xp))
    p, _ = _softmax(s, xp)
    dp = _einsum("bihd,bjhd->bhij", dout, v_h)
    if dropout is None:
        dv = _einsum("bhij,bihd->bjhd", p, dout)
    else:
        dv = _einsum("bhij,bihd->bjhd", p * dropout, dout)
        dp = dp * dropout
    if out is None:
        rows = (p * dp).sum(axis=-1, keepdims=True)
    else:
        rows = (dout * out.astype(xp.float64)).sum(axis=-1).transpose(0, 2, 1)[..., None]
    ds = p * (dp - rows)
    ds_in = ds if dmod is None else ds * dmod
    dq = _einsum("bhij,bjhd->bihd", ds_in, k_h) * scale
    dk = _einsum("bhij,bihd->bjhd", ds_in, q) * scale
    result = (dq, _sum_groups(dk, hk), _sum_groups(dv, hk))
    ds_size = p * (xp.abs(dp) + xp.abs(rows)) if tables is not None or term_sizes else None
    if tables is not None:
        result += (tables(ds), tables(ds_size, sizes=True))
    if term_sizes:
        ds_size = ds_size if dmod is None else ds_size * xp.abs(dmod)
        p_size = p if dropout is None else p * dropout
        result += ((_einsum("bhij,bjhd->bihd", ds_size, xp.abs(k_h)) * abs(scale),
                    _sum_groups(_einsum("bhij,bihd->bjhd", ds_size, xp.abs(q)) * abs(scale), hk),
                    _sum_groups(_einsum("bhij,bihd->bjhd", p_size, xp.abs(dout)), hk)),)
    return result + (ds,) if return_ds else result


def dropout_scale(xp, batch, nheads, seqlen_q, seqlen_k, dropout_p, seed, offset=0):
    """The ``dropout`` multiplier of a call, ``keep / (1 - effective_p(dropout_p))`` in
    float64, from the public keep-mask; None for ``dropout_p == 0``."""
    if not dropout_p:
        return None
    import cupyflash as cf
    keep = cf.dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed, offset, xp=xp)
    return keep / (1.0 - cf.dropout.effective_p(dropout_p))


def _float64(variant, xp):
    """The variant keywords with the ALiBi slopes in float64."""
    slopes = variant.get("alibi_slopes")
    if slopes is None:
        return variant
    return {**variant, "alibi_slopes": xp.asarray(slopes).astype(xp.float64)}


# ---------------------------------------------------------------------------------------------
# A naive implementation in a given dtype

def _naive_probs(q, k, scale, causal, dtype, mask=None, **variant):
    """Rounded operands and P = round(softmax(S)), S the scores with each stage (q k^T *
    scale, score_mod, softcap, ALiBi bias, ``bias``) computed in float32 and rounded to
    ``dtype``; also the rounded derivative of the softcap or score_mod (None where it is 1) and
    the score_mod's table gradients (``_scores``)."""
    xp = get_xp(q, k)
    q, k = round_to(q, dtype), round_to(k, dtype)
    k_h = _repeat_kv(k, q.shape[2])
    s, dmod, tables = _scores(q, k_h, scale, causal, mask, **variant,
                              rounded=lambda x: round_to(x, dtype))
    p, lse = _softmax(s, xp)
    return q, k_h, round_to(p, dtype), round_to(lse, dtype), dmod, tables


def attention_naive(q, k, v, scale, causal, dtype, mask=None, dropout=None, **variant):
    """Standard attention as a naive ``dtype`` implementation computes it (S, P, the dropped
    P and O each rounded to ``dtype``). Returns (out, lse) as float32 (float64 for
    "float64")."""
    _, _, p, lse, _, _ = _naive_probs(q, k, scale, causal, dtype, mask, **variant)
    if dropout is not None:
        p = round_to(p * dropout, dtype)
    v_h = _repeat_kv(round_to(v, dtype), q.shape[2])
    out = round_to(_einsum("bhij,bjhd->bihd", p, v_h), dtype)
    return out, lse


def attention_naive_backward(dout, q, k, v, scale, causal, dtype, mask=None, dropout=None,
                             return_ds=False, **variant):
    """Gradients as a naive ``dtype`` implementation computes them: P recomputed as in
    ``attention_naive``, then dV, dP (dropped), dS (then through the softcap or score_mod),
    dQ and dK each computed in float32 from rounded operands and rounded to ``dtype``.
    Returns (dq, dk, dv); with a ``score_mod`` then the gradients of its arrays from the
    rounded dS (a dict, added up in float32, float64 for "float64"); with ``return_ds`` last
    the rounded dS."""
    hk = k.shape[2]
    q, k_h, p, _, dmod, tables = _naive_probs(q, k, scale, causal, dtype, mask, **variant)
    v_h = _repeat_kv(round_to(v, dtype), q.shape[2])
    dout = round_to(dout, dtype)
    p_out = p if dropout is None else round_to(p * dropout, dtype)
    dv = round_to(_sum_groups(_einsum("bhij,bihd->bjhd", p_out, dout), hk), dtype)
    dp = round_to(_einsum("bihd,bjhd->bhij", dout, v_h), dtype)
    if dropout is not None:
        dp = round_to(dp * dropout, dtype)
    ds = round_to(p * (dp - (p * dp).sum(axis=-1, keepdims=True)), dtype)
    ds_in = ds if dmod is None else round_to(ds * dmod, dtype)
    dq = round_to(_einsum("bhij,bjhd->bihd", ds_in, k_h) * scale, dtype)
    dk = round_to(_sum_groups(_einsum("bhij,bihd->bjhd", ds_in, q) * scale, hk), dtype)
    result = (dq, dk, dv)
    if tables is not None:
        result += (tables(ds),)
    return result + (ds,) if return_ds else result


# ---------------------------------------------------------------------------------------------
# The tolerance rule

def max_abs_err(got, ref):
    """max |got - ref| over the entries where ref is finite (0 when there are none)."""
    xp = get_xp(got, ref)
    got, ref = got.astype(xp.float64), ref.astype(xp.float64)
    finite = xp.isfinite(ref)
    if not bool(finite.any()):
        return 0.0
    # Infinite entries compare as 0 - 0, so that -inf - -inf makes no NaN or warning.
    diff = xp.where(finite, got, 0.0) - xp.where(finite, ref, 0.0)
    return float(xp.abs(diff).max())


def assert_rule(name, got, ref, naive, factor, magnitude=None):
    """FlashAttention's rule: max|got - ref| <= factor * max|naive - ref| + slack, with a tiny
    slack (1e-6 * magnitude + 1e-7) for the case where the naive error is ~0. ``magnitude``
    defaults to max|ref|; gradients pass the largest of all three gradients, because a gradient
    that cancels to exactly 0 (dq with seqlen_k = 1) has no scale of its own. Also: got has no
    NaN where ref has none, and got equals ref where ref is infinite (lse of empty rows)."""
    xp = get_xp(got, ref)
    got, ref, naive = (xp.asarray(x).astype(xp.float64) for x in (got, ref, naive))
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    bad_nan = xp.isnan(got) & ~xp.isnan(ref)
    assert not bool(bad_nan.any()), f"{name}: {int(bad_nan.sum())} NaN where the reference has none"
    inf = xp.isinf(ref)
    if bool(inf.any()):
        assert bool((got[inf] == ref[inf]).all()), f"{name}: differs where the reference is infinite"
    err = max_abs_err(got, ref)
    naive_err = max_abs_err(naive, ref)
    finite_ref = xp.where(xp.isfinite(ref), ref, 0.0)
    if magnitude is None:
        magnitude = float(xp.abs(finite_ref).max()) if ref.size else 0.0
    slack = 1e-6 * magnitude + 1e-7
    bound = factor * naive_err + slack
    assert err <= bound, (f"{name}: max error {err:.3e} vs reference exceeds {factor} x naive "
                          f"error {naive_err:.3e} + slack {slack:.1e} (= {bound:.3e})")


def assert_gradients_match_finite_differences(q, k, v, dout, eps=1e-6, **kw):
    """flash_attention_backward's float64 gradients (NumPy path) against central differences of
    the loss sum(flash_attention(q, k, v, **kw) * dout), element by element: small shapes."""
    import cupyflash as cf
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, **kw)

    def loss(*inputs):
        return float((cf.flash_attention(*inputs, **kw) * dout).sum())

    for idx, (name, g) in enumerate(zip(("dq", "dk", "dv"), grads)):
        fd = np.zeros_like(g)
        for pos in np.ndindex(g.shape):
            plus, minus = [q, k, v], [q, k, v]
            plus[idx], minus[idx] = plus[idx].copy(), minus[idx].copy()
            plus[idx][pos] += eps
            minus[idx][pos] -= eps
            fd[pos] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg=name)
