"""NaN and infinity follow the arithmetic, the same on the NumPy path and every kernel family.

The contract (``flash_attention``'s docstring): a NaN in query row i makes row i of out and lse
NaN and changes no other row; a NaN, or a +inf score, from key j makes NaN exactly the rows
that see key j (bounds, causal and block masks decide which); a key whose score is -inf
weighs 0; a row without a key of nonzero weight gives 0 and lse -inf. "Changes no other row"
is checked bit for bit against the same call on clean inputs.
"""
import numpy as np
import pytest

import cupyflash as cf
from reference import np_dtype, random_array

# (array module, dtype): the NumPy path in both of its input precisions, then the tensor-core
# (bf16, fp16) and plain (fp32, fp64) kernels.
BACKENDS = [pytest.param("numpy", d, id=f"numpy-{d}") for d in ("float64", "float32")] + [
    pytest.param("cupy", d, id=f"cupy-{d}", marks=pytest.mark.gpu)
    for d in ("bfloat16", "float16", "float32", "float64")]

B, SQ, SK, H, HK, D = 2, 150, 130, 4, 2, 40       # odd sizes; causal rows 0..19 see no key


def _xp(name):
    if name == "numpy":
        return np
    import cupy
    return cupy


def _host(x):
    """float64 NumPy copy of a result."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return x.astype("float64").get()


def _inputs(dtype, seed):
    shapes = ((B, SQ, H, D), (B, SK, HK, D), (B, SK, HK, D))
    return [random_array(np, s, dtype, seed + i) for i, s in enumerate(shapes)]


def _run(xp, host_inputs, **kw):
    q, k, v = (xp.asarray(a) for a in host_inputs)
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    return _host(out), _host(lse)


def _sees(causal, mask, key):
    """(B, SQ, H) bool: which (batch, row, head) sees key ``key`` of kv head 1 in batch 0."""
    rows = np.arange(SQ)
    seen = np.ones(SQ, bool) if not causal else key <= rows + (SK - SQ)
    out = np.zeros((B, SQ, H), bool)
    for h in range(H):
        if h // (H // HK) != 1:
            continue
        visible = seen.copy()
        if mask is not None:
            visible &= mask.to_dense()[h % mask.heads, :, key]
        out[0, :, h] = visible
    return out


def _assert_nan_exactly(got, clean, poisoned):
    """out (B, SQ, H, D) / lse (B, H, SQ): NaN on the ``poisoned`` rows (B, SQ, H), bitwise
    equal to the clean call's result elsewhere."""
    out, lse = got
    out0, lse0 = clean
    lse, lse0 = lse.transpose(0, 2, 1), lse0.transpose(0, 2, 1)    # rows as (B, SQ, H)
    assert np.isnan(out[poisoned]).all(), "out: a row that sees the NaN is not NaN"
    assert np.isnan(lse[poisoned]).all(), "lse: a row that sees the NaN is not NaN"
    assert not np.isnan(out[~poisoned]).any(), \
        f"out: NaN in {int(np.isnan(out[~poisoned]).any(-1).sum())} rows that do not see it"
    np.testing.assert_array_equal(out[~poisoned], out0[~poisoned])
    np.testing.assert_array_equal(lse[~poisoned], lse0[~poisoned])


def _mask(kind):
    if kind is None:
        return None
    grid = np.random.default_rng(3).random((H, -(-SQ // 64), -(-SK // 64))) < 0.6
    return cf.BlockMask.from_dense(grid, 64, seqlen_q=SQ, seqlen_k=SK)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("xp_name,dtype", BACKENDS)
def test_nan_in_a_query_row_changes_only_that_row(xp_name, dtype, causal):
    xp = _xp(xp_name)
    host = _inputs(dtype, seed=11)
    clean = _run(xp, host, causal=causal)
    poisoned = np.zeros((B, SQ, H), bool)
    for b, row, h in ((1, 77, 3), (0, SQ - 1, 0)):
        host[0][b, row, h, 5] = np.nan
        poisoned[b, row, h] = True
    got = _run(xp, host, causal=causal)
    _assert_nan_exactly(got, clean, poisoned)


@pytest.mark.parametrize("xp_name,dtype", BACKENDS)
def test_nan_in_a_query_row_without_keys_leaves_it_empty(xp_name, dtype):
    xp = _xp(xp_name)
    host = _inputs(dtype, seed=12)
    host[0][0, 3, 1, :] = np.nan            # causal, seqlen_q > seqlen_k: row 3 sees no key
    out, lse = _run(xp, host, causal=True)
    assert (out[0, 3, 1] == 0).all() and lse[0, 1, 3] == -np.inf


@pytest.mark.parametrize("mask_kind", [None, "random"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("xp_name,dtype", BACKENDS)
def test_nan_in_a_key_poisons_exactly_the_rows_that_see_it(xp_name, dtype, causal, mask_kind):
    xp = _xp(xp_name)
    mask = _mask(mask_kind)
    host = _inputs(dtype, seed=13)
    clean = _run(xp, host, causal=causal, block_mask=mask)
    key = 70
    host[1][0, key, 1, 9] = np.nan
    got = _run(xp, host, causal=causal, block_mask=mask)
    poisoned = _sees(causal, mask, key)
    assert poisoned.any() and not poisoned.all()
    _assert_nan_exactly(got, clean, poisoned)


@pytest.mark.parametrize("xp_name,dtype", BACKENDS)
def test_plus_inf_score_poisons_exactly_the_rows_that_see_it(xp_name, dtype):
    xp = _xp(xp_name)
    host = _inputs(dtype, seed=14)
    host[0] = np.abs(host[0]) + np.asarray(0.25, host[0].dtype)    # every score of the key +inf
    clean = _run(xp, host, causal=True)
    key = 100
    host[1][0, key, 1, :] = np.inf
    got = _run(xp, host, causal=True)
    _assert_nan_exactly(got, clean, _sees(True, None, key))


@pytest.mark.parametrize("xp_name,dtype", BACKENDS)
def test_minus_inf_score_weighs_zero(xp_name, dtype):
    """Two keys, the first with score -inf for every query: out is the second key's v exactly,
    lse its score; with that key alone every row is empty (0 and lse -inf), without NaN."""
    xp = _xp(xp_name)
    rng = np.random.default_rng(15)
    dt = np_dtype(dtype)
    q = (np.abs(rng.standard_normal((1, 9, 2, 16))) + 0.25).astype(dt)
    k = rng.standard_normal((1, 2, 1, 16)).astype(dt)
    v = rng.standard_normal((1, 2, 1, 16)).astype(dt)
    k[0, 0] = -np.inf
    out, lse = _run(xp, (q, k, v))
    np.testing.assert_array_equal(out, np.broadcast_to(v[0, 1, 0].astype(np.float64), out.shape))
    assert np.isfinite(lse).all()
    out, lse = _run(xp, (q, k[:, :1], v[:, :1]))
    assert (out == 0).all() and (lse == -np.inf).all()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("xp_name,dtype", BACKENDS)
def test_backward_nan_query_row_stays_in_its_dq_row(xp_name, dtype, deterministic):
    xp = _xp(xp_name)
    host = _inputs(dtype, seed=16)
    host[0][1, 77, 3, 5] = np.nan
    q, k, v = (xp.asarray(a) for a in host)
    out, lse = cf.flash_attention(q, k, v, causal=True, return_lse=True)
    dout = xp.asarray(random_array(np, q.shape, dtype, 17))
    dq, dk, dv = (_host(g) for g in cf.flash_attention_backward(
        dout, q, k, v, out, lse, causal=True, deterministic=deterministic))
    assert np.isnan(dq[1, 77, 3]).all()
    others = np.ones(dq.shape[:3], bool)
    others[1, 77, 3] = False
    assert np.isfinite(dq[others]).all(), "dq: NaN outside the poisoned query row"
    assert np.isfinite(dk[0]).all() and np.isfinite(dv[0]).all(), \
        "dk/dv: NaN in a batch without NaN"
