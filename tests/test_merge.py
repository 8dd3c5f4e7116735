"""``cupyflash.merge_attention``: attention over disjoint key sets merged by their lse equals the
attention over all the keys (float64 within 1e-12 on the NumPy path; float32 and float64 on the
GPU to their own precision; a bf16 merge is the float32 merge of the same parts rounded once).
Rows that see no key in some part, or in every part, and packed (varlen) layouts included."""
import numpy as np
import pytest

import cupyflash as cf
from reference import random_array, rel_err


def split_attention(q, k, v, cuts, causal):
    """The parts' (out, lse) over the key ranges between ``cuts``. A causal whole is, for keys
    lo..hi-1, the window (-1, seqlen_k - hi) aligned to the part's own bottom-right corner:
    query i sees key j <= i + seqlen_k - seqlen_q. Early rows see no key of late parts."""
    sk = k.shape[1]
    return [cf.flash_attention(q, k[:, lo:hi], v[:, lo:hi], window_size=(-1, sk - hi) if causal else (-1, -1),
                               return_lse=True) for lo, hi in zip(cuts[:-1], cuts[1:])]


@pytest.mark.parametrize("causal", [False, True])
def test_numpy_merge_equals_the_whole(causal):
    q = random_array(np, (2, 37, 4, 16), np.float64, 1)
    k = random_array(np, (2, 100, 2, 16), np.float64, 2)
    v = random_array(np, (2, 100, 2, 16), np.float64, 3)
    whole, whole_lse = cf.flash_attention(q, k, v, causal=causal, return_lse=True)
    parts = split_attention(q, k, v, [0, 1, 40, 70, 100], causal)
    out, lse = cf.merge_attention([o for o, _ in parts], [l for _, l in parts])
    assert rel_err(out, whole) < 1e-12 and rel_err(lse, whole_lse) < 1e-12
    # Stacked parts give the same.
    out2, _ = cf.merge_attention(np.stack([o for o, _ in parts]), np.stack([l for _, l in parts]))
    assert np.array_equal(out, out2)


def test_rows_without_keys_and_nan():
    o = random_array(np, (1, 3, 2, 8), np.float64, 0)
    l = np.array([[[0.5, -np.inf, np.nan], [1.0, -np.inf, 2.0]]])
    out, lse = cf.merge_attention([o, o], [l, l])
    assert (out[0, 1] == 0).all() and np.isneginf(lse[0, :, 1]).all()
    assert np.isnan(out[0, 2, 0]).all() and np.isnan(lse[0, 0, 2]) and np.isfinite(lse[0, 1, 2])
    assert rel_err(out[0, 0], o[0, 0]) < 1e-15 and abs(lse[0, 0, 0] - (0.5 + np.log(2))) < 1e-15


def test_packed_layout():
    cu = np.array([0, 5, 5, 35], np.int32)
    cuk = np.array([0, 7, 19, 40], np.int32)
    q = random_array(np, (35, 2, 8), np.float64, 4)
    k = random_array(np, (40, 2, 8), np.float64, 5)
    v = random_array(np, (40, 2, 8), np.float64, 6)
    whole = cf.flash_attention_varlen(q, k, v, cu, cuk, return_lse=True)
    # Keys split per sequence into their first 3 and the rest.
    a = cf.flash_attention_varlen(q, k[np.r_[0:3, 7:10, 19:22]], v[np.r_[0:3, 7:10, 19:22]], cu,
                                  np.array([0, 3, 6, 9], np.int32), return_lse=True)
    rest = np.r_[3:7, 10:19, 22:40]
    b = cf.flash_attention_varlen(q, k[rest], v[rest], cu, np.array([0, 4, 13, 31], np.int32),
                                  return_lse=True)
    out, lse = cf.merge_attention([a[0], b[0]], [a[1], b[1]])
    assert rel_err(out, whole[0]) < 1e-12 and rel_err(lse, whole[1]) < 1e-12


@pytest.mark.parametrize("bad,err,match", [
    (lambda o, l: ([], []), ValueError, "outs must hold at least one part"),
    (lambda o, l: ([o, o], [l]), ValueError, "outs has 2 parts but lses has 1"),
    (lambda o, l: ([o, o[:, :2]], [l, l]), ValueError, r"outs\[1\] is \(1, 2, 2, 8\) float64"),
    (lambda o, l: ([o], [l[:, :, :2]]), ValueError, r"lses\[0\] shape \(1, 2, 2\) must be \(batch, nheads, seqlen_q\)"),
    (lambda o, l: ([o], [l.astype(np.float16)]), TypeError, r"lses\[0\]: dtype must be float32 or float64"),
    (lambda o, l: ("x", "y"), TypeError, "outs must be a sequence of arrays"),
])
def test_bad_parts(bad, err, match):
    o = random_array(np, (1, 3, 2, 8), np.float64, 0)
    l = np.zeros((1, 2, 3))
    with pytest.raises(err, match=match):
        cf.merge_attention(*bad(o, l))


cp = None
try:
    import cupy as cp  # noqa: F811
except ImportError:
    pass


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-6), (np.float64, 1e-12)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_merge_equals_the_whole(dtype, tol, causal):
    q = random_array(cp, (2, 130, 4, 64), dtype, 1)
    k = random_array(cp, (2, 300, 2, 64), dtype, 2)
    v = random_array(cp, (2, 300, 2, 64), dtype, 3)
    whole, whole_lse = cf.flash_attention(q, k, v, causal=causal, return_lse=True)
    parts = split_attention(q, k, v, [0, 100, 170, 171, 300], causal)
    out, lse = cf.merge_attention([o for o, _ in parts], [l for _, l in parts])
    assert isinstance(out, cp.ndarray) and out.dtype == dtype
    assert rel_err(out, whole) < tol and rel_err(lse, whole_lse) < tol


@pytest.mark.gpu
def test_gpu_bf16_merge_is_the_float32_merge_rounded_once():
    import ml_dtypes
    bf16 = np.dtype(ml_dtypes.bfloat16)
    outs = [random_array(cp, (2, 33, 4, 64), bf16, s) for s in range(3)]
    lses = [cp.asarray(np.random.default_rng(s).normal(size=(2, 4, 33)).astype(np.float32)) for s in range(3)]
    out, lse = cf.merge_attention(outs, lses)
    ref, ref_lse = cf.merge_attention([o.astype(cp.float32) for o in outs], lses)
    assert out.dtype == bf16 and lse.dtype == np.float32
    assert bool((out.view(cp.uint16) == ref.astype(bf16).view(cp.uint16)).all())
    assert bool((lse == ref_lse).all())
