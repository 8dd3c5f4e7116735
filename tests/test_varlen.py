"""Packed variable-length batches (``cupyflash.flash_attention_varlen`` and its backward).

Every sequence of a packed call must give what a dense call on that sequence alone gives: on
the NumPy path exactly (the same float64 tiles), on the GPU by FlashAttention's rule against
the float64 reference of the sequence (tests/gpu_checks.py), and bit for bit against dense
calls of the same generic kernels (forward, and dk/dv, which no atomics add). The lengths
include 1, odd tails, a sequence without queries, one without keys, and one long sequence among
many short ones; the variants (window, softcap, per-sequence ALiBi slopes, dropout, a score_mod
reading the sequence index) are checked with the sequence's index where the dense call has its
batch entry. Bad offsets and lengths raise before anything runs.
"""
import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _launch
from reference import attention_ref, attention_ref_backward, dropout_scale, random_array, rel_err

F64_REL = 1e-12


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_inputs(xp, lens_q, lens_k, h, hk, d, dtype, seed):
    """q, k, v, dout of a packed batch with these sequence lengths, and the offsets."""
    tq, tk = int(sum(lens_q)), int(sum(lens_k))
    q = random_array(xp, (tq, h, d), dtype, seed)
    k = random_array(xp, (tk, hk, d), dtype, seed + 1)
    v = random_array(xp, (tk, hk, d), dtype, seed + 2)
    dout = random_array(xp, (tq, h, d), dtype, seed + 3)
    return q, k, v, dout, xp.asarray(offsets(lens_q)), xp.asarray(offsets(lens_k))


def sequences(lens_q, lens_k):
    """(b, rows of q, rows of k) of each sequence."""
    cq, ck = offsets(lens_q), offsets(lens_k)
    return [(b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])) for b in range(len(lens_q))]


# Lengths: 1, odd tails, no queries (b=3), no keys (b=4), more queries than keys under causal.
LENS_Q = [1, 17, 70, 0, 33, 129, 5]
LENS_K = [1, 3, 70, 4, 0, 200, 64]


# --- NumPy path (runs everywhere) -----------------------------------------------------------

@pytest.mark.parametrize("variant", [
    {}, {"causal": True}, {"window_size": (9, 4)}, {"softcap": 3.0}, {"causal": True, "softcap": 2.0},
], ids=["full", "causal", "window", "softcap", "causal-softcap"])
def test_numpy_packed_equals_dense_per_sequence(variant):
    q, k, v, dout, cq, ck = packed_inputs(np, LENS_Q, LENS_K, 4, 2, 16, np.float64, 1)
    out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, return_lse=True, **variant)
    grads = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, **variant)
    assert lse.shape == (4, q.shape[0])
    for b, rq, rk in sequences(LENS_Q, LENS_K):
        if rq.stop == rq.start:
            continue
        if rk.stop == rk.start:
            assert (out[rq] == 0).all() and np.isneginf(lse[:, rq]).all() and (grads[0][rq] == 0).all()
            continue
        o, l = cf.flash_attention(q[None, rq], k[None, rk], v[None, rk], return_lse=True, **variant)
        assert np.array_equal(out[rq], o[0]) and np.array_equal(lse[:, rq], l[0]), b
        g = cf.flash_attention_backward(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], o, l,
                                        **variant)
        assert np.array_equal(grads[0][rq], g[0][0]), b
        for got, ref in zip(grads[1:], g[1:]):
            assert np.array_equal(got[rk], ref[0]), b
    # Keys of a sequence without queries get no gradient.
    _, _, rk = sequences(LENS_Q, LENS_K)[3]
    assert (grads[1][rk] == 0).all() and (grads[2][rk] == 0).all()


def per_sequence_reference(q, k, v, dout, lens_q, lens_k, scale, causal, variant_of):
    """{b: (out, lse, dq, dk, dv)} of the float64 reference on each sequence alone;
    ``variant_of(b, sq, sk)``: the reference keywords of sequence b."""
    refs = {}
    for b, rq, rk in sequences(lens_q, lens_k):
        if rq.stop > rq.start and rk.stop > rk.start:
            args = (q[None, rq], k[None, rk], v[None, rk])
            var = variant_of(b, rq.stop - rq.start, rk.stop - rk.start)
            o, l = attention_ref(*args, scale, causal, **var)
            refs[b] = (o, l) + attention_ref_backward(dout[None, rq], *args, scale, causal, **var)
    return refs


def test_numpy_packed_variants_see_the_sequence_index():
    """ALiBi slopes (batch, nheads) per sequence, dropout keyed by the sequence index, a
    score_mod reading ``b``: all against the float64 reference of each sequence alone."""
    lens_q, lens_k = [3, 40, 1, 25], [7, 33, 5, 25]
    h, hk, d, scale = 4, 2, 8, 0.3
    q, k, v, dout, cq, ck = packed_inputs(np, lens_q, lens_k, h, hk, d, np.float64, 7)
    slopes = np.random.default_rng(3).uniform(0.1, 0.9, (4, h)).astype(np.float32)
    tab = np.array([0.5, 1.5, 1.0, 0.75], np.float64)
    score_mod = cf.ScoreMod(python=lambda s, b, h, i, j, tab: s * tab[b],
                            python_grad=lambda s, ds, b, h, i, j, tab: ds * tab[b],
                            arrays={"tab": tab})
    mask_p, seed = 0.25, 11
    drop = dropout_scale(np, 4, h, max(lens_q), max(lens_k), mask_p, seed)
    cases = [
        ({"alibi_slopes": slopes}, lambda b, sq, sk: {"alibi_slopes": slopes[b]}, scale),
        ({"dropout_p": mask_p, "seed": seed}, lambda b, sq, sk: {"dropout": drop[b:b + 1, :, :sq, :sk]}, scale),
        ({"score_mod": score_mod}, None, None),
    ]
    for kw, variant_of, sc in cases:
        for causal in (False, True):
            out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, causal=causal, softmax_scale=scale,
                                                 return_lse=True, **kw)
            grads = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=causal,
                                                       softmax_scale=scale, **kw)
            for b, rq, rk in sequences(lens_q, lens_k):
                # The score_mod multiplies the scores by tab[b]: the reference's scale.
                var = variant_of(b, rq.stop - rq.start, rk.stop - rk.start) if variant_of else {}
                s = sc if sc is not None else scale * tab[b]
                args = (q[None, rq], k[None, rk], v[None, rk])
                o, l = attention_ref(*args, s, causal, **var)
                g = attention_ref_backward(dout[None, rq], *args, s, causal, **var)
                name = f"{sorted(kw)} causal={causal} b={b}"
                assert rel_err(out[None, rq], o) < F64_REL, name
                assert rel_err(lse[None, :, rq], l) < F64_REL, name
                assert rel_err(grads[0][None, rq], g[0]) < F64_REL, name
                assert rel_err(grads[1][None, rk], g[1]) < F64_REL, name
                assert rel_err(grads[2][None, rk], g[2]) < F64_REL, name


# --- bad input --------------------------------------------------------------------------------

def _args(lens_q=(3, 4), lens_k=(2, 5)):
    q, k, v, dout, cq, ck = packed_inputs(np, list(lens_q), list(lens_k), 2, 2, 8, np.float32, 0)
    return q, k, v, cq, ck


@pytest.mark.parametrize("bad,match", [
    (lambda a: a.update(cu_seqlens_q=np.array([0, 3, 6], np.int32)),
     r"cu_seqlens_q\[-1\] = 6 must equal the packed array's rows \(7\)"),
    (lambda a: a.update(cu_seqlens_q=np.array([0, 5, 3], np.int32)),
     r"cu_seqlens_q must not decrease: cu_seqlens_q\[2\] = 3 < cu_seqlens_q\[1\] = 5"),
    (lambda a: a.update(cu_seqlens_k=np.array([1, 2, 7], np.int32)), r"cu_seqlens_k\[0\] must be 0, got 1"),
    (lambda a: a.update(cu_seqlens_k=np.array([0, 7], np.int32)),
     r"cu_seqlens_k has 2 entries but cu_seqlens_q has 3"),
    (lambda a: a.update(cu_seqlens_q=np.array([[0, 3, 7]], np.int32)), r"cu_seqlens_q must be 1-D"),
    (lambda a: a.update(max_seqlen_k=4), r"max_seqlen_k = 4 is below the longest sequence of cu_seqlens_k \(5\)"),
    (lambda a: a.update(q=a["q"][None]), r"q must be 3-D \(total_q, nheads, headdim\)"),
    (lambda a: a.update(v=a["v"][:6]), r"v shape \(6, 2, 8\) must equal k's shape \(7, 2, 8\)"),
], ids=["last-offset", "decreasing", "first-offset", "batch-mismatch", "2d-offsets", "max-too-small",
        "4d-q", "v-shape"])
def test_bad_packed_input_is_value_error(bad, match):
    q, k, v, cq, ck = _args()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    bad(args)
    with pytest.raises(ValueError, match=match):
        cf.flash_attention_varlen(**args)


def test_offsets_must_be_int32():
    q, k, v, cq, ck = _args()
    with pytest.raises(TypeError, match="cu_seqlens_k: dtype must be int32, got int64"):
        cf.flash_attention_varlen(q, k, v, cq, ck.astype(np.int64))


def test_traced_packed_calls_are_refused(monkeypatch):
    """README (Status): under torch.compile tracing flash_attention_varlen and its backward
    raise (cupyflash.torch.flash_attention_varlen runs them outside the graph instead)."""
    from cupyflash import api
    q, k, v, cq, ck = _args()
    out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, return_lse=True)
    monkeypatch.setattr(api, "_traced_by_torch", lambda a: True)
    with pytest.raises(NotImplementedError, match="flash_attention_varlen has no torch.compile operator"):
        cf.flash_attention_varlen(q, k, v, cq, ck)
    with pytest.raises(NotImplementedError, match="flash_attention_varlen has no torch.compile operator"):
        cf.flash_attention_varlen_backward(q, q, k, v, out, lse, cq, ck)


def test_backward_checks_the_packed_lse():
    q, k, v, cq, ck = _args()
    out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, return_lse=True)
    with pytest.raises(ValueError, match=r"lse shape \(1, 2, 7\) must be \(nheads, total_q\) = \(2, 7\)"):
        cf.flash_attention_varlen_backward(q, q, k, v, out, lse[None], cq, ck)
    with pytest.raises(ValueError, match=r"dout shape \(6, 2, 8\) must equal q's shape"):
        cf.flash_attention_varlen_backward(q[:6], q, k, v, out, lse, cq, ck)


def test_unchecked_offsets_need_both_maximums():
    q, k, v, cq, ck = _args()
    for maxima in ((), (4,), (None, 5)):
        with pytest.raises(ValueError, match="check_offsets=False needs max_seqlen_q and max_seqlen_k"):
            cf.flash_attention_varlen(q, k, v, cq, ck, *maxima, check_offsets=False)
    with pytest.raises(TypeError, match="check_offsets must be a bool"):
        cf.flash_attention_varlen(q, k, v, cq, ck, 4, 5, check_offsets=0)


def test_numpy_offsets_are_checked_even_unchecked():
    """NumPy inputs read their offsets for free: check_offsets=False still checks them, and
    gives the bits of a checked call."""
    q, k, v, cq, ck = _args()
    out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, return_lse=True)
    got, got_lse = cf.flash_attention_varlen(q, k, v, cq, ck, 4, 5, check_offsets=False, return_lse=True)
    assert np.array_equal(got, out) and np.array_equal(got_lse, lse)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must not decrease"):
        cf.flash_attention_varlen(q, k, v, np.array([0, 5, 3], np.int32), ck, 5, 5, check_offsets=False)
    with pytest.raises(ValueError, match=r"cu_seqlens_k has 2 entries"):
        cf.flash_attention_varlen_backward(q, q, k, v, out, lse, cq, np.array([0, 7], np.int32), 4, 7,
                                           check_offsets=False)


def test_a_deferred_check_runs_once_before_the_first_launch():
    """_launch.checked_before_launch: the check runs at the first launch or fill (``settle``),
    once, or at the block's end where nothing launched; its error leaves nothing pending."""
    seen = []
    with _launch.checked_before_launch(lambda: seen.append("check")):
        seen.append("prepare")
        _launch.settle()
        seen.append("launch")
        _launch.settle()
    assert seen == ["prepare", "check", "launch"]
    with _launch.checked_before_launch(lambda: seen.append("at the end")):
        pass
    assert seen[-1] == "at the end"

    def bad():
        raise ValueError("bad offsets")
    with pytest.raises(ValueError, match="bad offsets"):
        with _launch.checked_before_launch(bad):
            _launch.settle()
            seen.append("launched after a failed check")
    with pytest.raises(KeyError):   # an error before the launch: the check is dropped with it
        with _launch.checked_before_launch(bad):
            raise KeyError("prepare")
    _launch.settle()
    assert seen[-1] == "at the end"


def test_per_sequence_slopes_need_one_row_per_sequence():
    q, k, v, cq, ck = _args()
    with pytest.raises(ValueError, match=r"alibi_slopes shape \(3, 2\) must be \(nheads,\) = \(2,\) "
                                         r"or \(batch, nheads\) = \(2, 2\)"):
        cf.flash_attention_varlen(q, k, v, cq, ck, alibi_slopes=np.ones((3, 2), np.float32))


# --- GPU ----------------------------------------------------------------------------------------

cp = None
try:
    import cupy as cp  # noqa: F811
    from gpu_checks import DTYPES, Case, check_backward, check_forward, has_nan
except ImportError:
    pass


def gpu_inputs(dtype, lens_q, lens_k, h, hk, d, seed):
    return packed_inputs(cp, lens_q, lens_k, h, hk, d, DTYPES[dtype], seed)


def check_each_sequence(dtype, lens_q, lens_k, h, hk, d, causal, q, k, v, dout, out, lse, grads,
                        scale_of, variant_of=lambda b, sq, sk: {}):
    """Each sequence's rows of out, lse and the gradients by the rule against the float64
    reference of that sequence alone (softmax scale ``scale_of(b)``, keywords
    ``variant_of(b, sq, sk)``); rows of sequences without keys 0 (lse -inf), keys of sequences
    without queries 0."""
    dq, dk, dv = grads[:3]
    for b, rq, rk in sequences(lens_q, lens_k):
        sq, sk = rq.stop - rq.start, rk.stop - rk.start
        if sq == 0:
            assert not bool(dk[rk].astype(cp.float32).any()) and not bool(dv[rk].astype(cp.float32).any())
            continue
        if sk == 0:
            assert not bool(out[rq].astype(cp.float32).any()) and bool(cp.isneginf(lse[:, rq]).all())
            assert not bool(dq[rq].astype(cp.float32).any())
            continue
        case = Case(dtype, sq, sk, d, causal, 1, h, hk)
        one = (q[None, rq], k[None, rk], v[None, rk])
        variant, scale = variant_of(b, sq, sk), scale_of(b)
        check_forward(case, *one, out[None, rq], lse[None, :, rq], scale, **variant)
        check_backward(case, dout[None, rq], *one, (dq[None, rq], dk[None, rk], dv[None, rk]), scale,
                       lse=lse[None, :, rq], **variant)


# One long sequence among many short ones; and the general mix.
LONG = ([1500] + [1, 2, 3, 31, 64, 65] * 3, [1500] + [2, 1, 3, 31, 64, 65] * 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,hk", [("bf16", 64, 2), ("fp16", 128, 4), ("fp32", 40, 2), ("fp64", 96, 1),
                                        ("bf16", 256, 1), ("fp16", 32, 4)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gpu_packed_matches_reference(dtype, d, hk, causal, deterministic, request):
    from gpu_checks import seed_of
    lens_q, lens_k = LONG if d == 64 else (LENS_Q, LENS_K)
    h, scale = 4, d ** -0.5
    q, k, v, dout, cq, ck = gpu_inputs(dtype, lens_q, lens_k, h, hk, d, seed_of(request))
    out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True)
    grads = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=causal,
                                               deterministic=deterministic)
    for name, a in (("out", out), ("lse", lse), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        assert not has_nan(a), f"{name} has NaN"
    check_each_sequence(dtype, lens_q, lens_k, h, hk, d, causal, q, k, v, dout, out, lse, grads,
                        lambda b: scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", ["window", "softcap", "softcap_d256", "alibi", "alibi_d128", "dropout",
                                  "score_mod"])
def test_gpu_packed_variants(dtype, name, request):
    """softcap_d256: the Hopper forward's fixed softmax base in bf16 (above head dim 128);
    alibi_d128: the Hopper backward in 80-query steps (no band)."""
    from gpu_checks import seed_of
    lens_q, lens_k = [3, 40, 1, 130, 0], [7, 33, 5, 129, 6]
    h, hk, scale, causal = 4, 2, 0.125, name in ("alibi", "softcap", "softcap_d256")
    name, _, d = name.partition("_d")   # a head dim in the name, else 64
    d = int(d or 64)
    q, k, v, dout, cq, ck = gpu_inputs(dtype, lens_q, lens_k, h, hk, d, seed_of(request))
    slopes = cp.asarray(np.random.default_rng(3).uniform(0.1, 0.9, (5, h)).astype(np.float32))
    tab = np.array([0.5, 1.5, 1.0, 0.75, 2.0], np.float32)
    drop = dropout_scale(cp, 5, h, max(lens_q), max(lens_k), 0.2, 5)
    kw, variant_of = {
        "window": ({"window_size": (20, 3)}, lambda b, sq, sk: {"window_size": (20, 3)}),
        "softcap": ({"softcap": 2.0}, lambda b, sq, sk: {"softcap": 2.0}),
        "alibi": ({"alibi_slopes": slopes}, lambda b, sq, sk: {"alibi_slopes": slopes[b]}),
        "dropout": ({"dropout_p": 0.2, "seed": 5},
                    lambda b, sq, sk: {"dropout": drop[b:b + 1, :, :sq, :sk]}),
        # score * tab[b]: the reference with softmax_scale * tab[b], sequence by sequence.
        "score_mod": ({"score_mod": cf.ScoreMod("score * tab(b)", grad="return dscore * tab(b);",
                                                arrays={"tab": cp.asarray(tab)})},
                      lambda b, sq, sk: {}),
    }[name]
    out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, causal=causal, softmax_scale=scale,
                                         return_lse=True, **kw)
    grads = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=causal,
                                               softmax_scale=scale, **kw)
    scale_of = (lambda b: scale * float(tab[b])) if name == "score_mod" else (lambda b: scale)
    check_each_sequence(dtype, lens_q, lens_k, h, hk, d, causal, q, k, v, dout, out, lse, grads, scale_of,
                        variant_of)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_packed_is_bit_identical_to_dense_calls(causal, request, monkeypatch):
    """With the generic kernels forced, each sequence's out, lse, dk and dv are the bits of a
    dense call on it alone (same kernels, same tiles; dq adds up with atomics in any order)."""
    from gpu_checks import seed_of
    monkeypatch.setenv("CUPYFLASH_KERNELS", "generic")
    h, hk, d = 4, 2, 128
    q, k, v, dout, cq, ck = gpu_inputs("bf16", LENS_Q, LENS_K, h, hk, d, seed_of(request))
    out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, causal=causal, return_lse=True)
    _, dk, dv = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=causal)
    for b, rq, rk in sequences(LENS_Q, LENS_K):
        if rq.stop == rq.start or rk.stop == rk.start:
            continue
        o, l = cf.flash_attention(q[None, rq], k[None, rk], v[None, rk], causal=causal, return_lse=True)
        _, gk, gv = cf.flash_attention_backward(dout[None, rq], q[None, rq], k[None, rk], v[None, rk],
                                                o, l, causal=causal)
        for what, got, ref in (("out", out[rq], o[0]), ("lse", lse[:, rq], l[0]), ("dk", dk[rk], gk[0]),
                               ("dv", dv[rk], gv[0])):
            assert bool((got.view(cp.uint8) == cp.ascontiguousarray(ref).view(cp.uint8)).all()), f"{what} b={b}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_packed_writes_every_output_element(dtype, request):
    """Outputs on NaN-filled memory (test_gpu_dense's poisoned pool): every row of out, lse,
    dq, dk and dv is written, those of empty sequences included; the fp32 dQ buffer lands on
    NaN too (each sequence's slice of it zeroed by the preprocess kernel)."""
    from gpu_checks import seed_of
    from test_gpu_dense import _poisoned_pool
    h, hk, d = 4, 2, 64
    q, k, v, dout, cq, ck = gpu_inputs(dtype, LENS_Q, LENS_K, h, hk, d, seed_of(request))
    acc = 4
    accum = _launch.dq_accum_shape((1,) + q.shape, _launch.Packed(cq, ck, max(LENS_Q), max(LENS_K)))
    pool = _poisoned_pool(sorted({q.nbytes, k.nbytes, v.nbytes, q.shape[0] * h * acc,
                                  int(np.prod(accum)) * 4}))
    with cp.cuda.using_allocator(pool.malloc):
        out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
        grads = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=True)
    for name, a in (("out", out), ("lse", lse), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        assert not has_nan(a), f"{name} has NaN: an element was never written"
    check_each_sequence(dtype, LENS_Q, LENS_K, h, hk, d, True, q, k, v, dout, out, lse, grads,
                        lambda b: d ** -0.5)


@pytest.mark.gpu
def test_gpu_bad_offsets_raise_before_launch():
    q, k, v, dout, cq, ck = gpu_inputs("bf16", [3, 4], [2, 5], 2, 2, 64, 0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must not decrease"):
        cf.flash_attention_varlen(q, k, v, cp.asarray([0, 5, 3], cp.int32), ck)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\] = 6 must equal the packed array's rows \(7\)"):
        cf.flash_attention_varlen(q, k, v, cq, cp.asarray([0, 2, 6], cp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_gpu_bad_offsets_with_maximums_raise_before_launch(pass_, monkeypatch):
    """With both maximums given the check of the offsets waits until just before the first
    launch: bad offsets still raise before any kernel or fill is queued."""
    q, k, v, dout, cq, ck = gpu_inputs("bf16", [3, 4], [2, 5], 2, 2, 64, 0)
    out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, 4, 5, return_lse=True)
    queued = []
    monkeypatch.setattr(_launch, "_kernel", lambda *args: queued.append(args))
    monkeypatch.setattr(cp, "zeros", lambda *args, **kw: queued.append(args))

    def call(cu_q, cu_k, *maxima):
        if pass_ == "fwd":
            return cf.flash_attention_varlen(q, k, v, cu_q, cu_k, *maxima)
        return cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, *maxima)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must not decrease"):
        call(cp.asarray([0, 5, 3], cp.int32), ck, 5, 5)
    with pytest.raises(ValueError, match=r"max_seqlen_k = 4 is below the longest sequence of cu_seqlens_k \(5\)"):
        call(cq, ck, 4, 4)
    assert queued == []


@pytest.mark.gpu
def test_gpu_checked_call_with_maximums_prepares_before_it_waits(monkeypatch):
    """README: given both maximums, a checked call fills its launch parameters before it waits
    for the offsets' read; without them it waits first (the grids need the longest)."""
    from cupyflash import _arrays
    q, k, v, _, cq, ck = gpu_inputs("bf16", LENS_Q, LENS_K, 4, 2, 128, 0)
    order = []
    fill, wait = _launch._fill_dims, _arrays.HostCopy.wait

    def filled(*args):
        order.append("prepare")
        return fill(*args)

    def waited(self):
        order.append("wait")
        return wait(self)
    monkeypatch.setattr(_launch, "_fill_dims", filled)
    monkeypatch.setattr(_arrays.HostCopy, "wait", waited)
    cf.flash_attention_varlen(q, k, v, cq, ck, max(LENS_Q), max(LENS_K))
    cf.flash_attention_varlen(q, k, v, cq, ck)
    assert order == ["prepare", "wait", "wait", "prepare"]


@pytest.mark.gpu
def test_gpu_host_copy_reads_each_array_once_in_order():
    from cupyflash import _arrays
    a = cp.arange(5, dtype=cp.int32)
    b = cp.arange(6, dtype=cp.int64)[::-2]   # strided: copied contiguous first
    got = _arrays.HostCopy([a, b, a]).wait()
    assert [g.tolist() for g in got] == [[0, 1, 2, 3, 4], [5, 3, 1], [0, 1, 2, 3, 4]]
    assert got[0] is not got[2] and got[1].dtype == np.int64


@pytest.mark.gpu
def test_gpu_unchecked_offsets_are_not_read(request, monkeypatch):
    """check_offsets=False: the offsets are never read to the host (the check is never
    reached), and out, lse and the gradients are the bits of the checked calls."""
    from gpu_checks import seed_of
    from cupyflash import _validate
    q, k, v, dout, cq, ck = gpu_inputs("bf16", LENS_Q, LENS_K, 4, 2, 128, seed_of(request))
    out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
    grads = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, causal=True, deterministic=True)
    maxima = (max(LENS_Q), max(LENS_K))
    # Checked with the maximums given (the check deferred to the launch): the same bits.
    got, got_lse = cf.flash_attention_varlen(q, k, v, cq, ck, *maxima, causal=True, return_lse=True)
    got_grads = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, *maxima, causal=True,
                                                   deterministic=True)
    for name, a, b in (("out", got, out), ("lse", got_lse, lse), *zip(("dq", "dk", "dv"), got_grads, grads)):
        assert bool((a.view(cp.uint8) == b.view(cp.uint8)).all()), name

    def refuse(*args):
        raise AssertionError("the offsets were read and checked")
    monkeypatch.setattr(_validate, "check_cu_seqlens", refuse)
    got, got_lse = cf.flash_attention_varlen(q, k, v, cq, ck, *maxima, causal=True, return_lse=True,
                                             check_offsets=False)
    got_grads = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, *maxima, causal=True,
                                                   deterministic=True, check_offsets=False)
    for name, a, b in (("out", got, out), ("lse", got_lse, lse), *zip(("dq", "dk", "dv"), got_grads, grads)):
        assert bool((a.view(cp.uint8) == b.view(cp.uint8)).all()), name
