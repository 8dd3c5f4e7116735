"""User mods (``cupyflash.ScoreMod``, ``cupyflash.MaskMod``): a T5-style relative-position
bias with its gradient, a document mask, both together, a nonlinear score_mod, and plain
callables.

On the NumPy path each mod is checked against tests/reference.py's float64 attention with the
mod spelled out densely (the bias as a (heads, seqlen_q, seqlen_k) array added to the scores,
the mask as an element mask), within 1e-12 of max(max|ref|, 1) as tests/test_variants.py; the
gradients, the tables' among them, also against central finite differences of the NumPy
forward. Then the blocks of ``masks.from_mask_mod`` against a brute-force classification, and
the refused calls (NVRTC rejects a snippet: ``SnippetError`` with the snippet's own line
numbers; NVRTC runs without a GPU).

On the GPU (``gpu`` marker, skipped where CuPy sees none): every dtype, causal or not, atomic
and deterministic backward, head dims 64, 128 and 96, GQA, against the NumPy path's float64
results on the same (upcast) inputs; float64 within ``FP64_RTOL``, the other dtypes by
FlashAttention's rule against a naive same-dtype implementation with the same dense bias and
mask (2x forward, 3x gradients, DESIGN.md). The bias gradient is float32 on the GPU: it is held
to the same rule against a naive implementation's sum of its rounded dS (in the input dtype,
float32 for float32 and float64 inputs).
"""
from dataclasses import dataclass

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import masks, mods
from reference import (assert_gradients_match_finite_differences, assert_rule, attention_naive,
                       attention_naive_backward, attention_ref, attention_ref_backward,
                       np_dtype, random_array, rel_err)

F64_REL = 1e-12
FWD_FACTOR, BWD_FACTOR = 2, 3


def assert_close64(name, got, ref, tol=F64_REL):
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    assert not np.isnan(np.asarray(got, np.float64)).any(), f"{name} has NaN"
    err = rel_err(got, ref)
    assert err < tol, f"{name}: relative error {err:.2e}"


def inputs(shape, dtype=np.float64, seed=0):
    """q, k, v, dout for (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim), host."""
    b, sq, sk, h, hk, d = shape
    return (random_array(np, (b, sq, h, d), dtype, seed),
            random_array(np, (b, sk, hk, d), dtype, seed + 1),
            random_array(np, (b, sk, hk, d), dtype, seed + 2),
            random_array(np, (b, sq, h, d), dtype, seed + 3))


# ---------------------------------------------------------------------------------------------
# The mods

def t5_mod(bias, W, clamp=False):
    """T5-style relative-position bias: ``score + bias[h, kv_idx - q_idx + W]``, bias
    (nheads, 2 W), W >= max(seqlen_q, seqlen_k) so that every offset has its entry; or with
    ``clamp``, offsets clamped to [-W, W] as T5's far buckets (bias (nheads, 2 W + 1)): most
    elements of a long sequence then add to two entries. With its gradient (d bias[h, r] = the
    sum of dS over the elements at offset r - W) as CUDA and Python rules."""
    def rule(score, b, h, q_idx, kv_idx, bias):
        return score + bias[h, t5_offsets(kv_idx - q_idx, W, clamp)]

    def grad(score, dscore, b, h, q_idx, kv_idx, bias, d_bias):
        hh, rel, ds = np.broadcast_arrays(h, t5_offsets(kv_idx - q_idx, W, clamp), dscore)
        np.add.at(d_bias, (hh, rel), ds)
        return dscore

    at = f"min(max(kv_idx - q_idx, -{W}), {W}) + {W}" if clamp else f"kv_idx - q_idx + {W}"
    return cf.ScoreMod(f"score + bias(h, {at})",
                       grad=f"d_bias.add(bias.offset(h, {at}), dscore); return dscore;",
                       python=rule, python_grad=grad, arrays={"bias": bias},
                       grad_arrays=("bias",))


def t5_offsets(rel, W, clamp=False):
    """The table column of offset kv_idx - q_idx = rel."""
    return (np.clip(rel, -W, W) if clamp else rel) + W


def t5_dense(bias, sq, sk, W, clamp=False):
    """The bias as the reference adds it: (nheads, sq, sk), bias[h, j - i + W]."""
    rel = t5_offsets(np.arange(sk)[None, :] - np.arange(sq)[:, None], W, clamp)
    return np.asarray(bias)[:, rel]


def t5_bias_grad(ds, W, dtype=np.float64, clamp=False):
    """d bias from dS (b, h, sq, sk): the sum of dS over batch and each diagonal, summed in
    ``dtype``."""
    ds = np.asarray(ds).astype(dtype)
    _, h, sq, sk = ds.shape
    out = np.zeros((h, 2 * W + clamp), dtype)
    rel = t5_offsets(np.arange(sk)[None, :] - np.arange(sq)[:, None], W, clamp)
    np.add.at(out, (np.arange(h)[:, None, None], rel[None]), ds.sum(axis=0, dtype=dtype))
    return out


def doc_mod(doc):
    """Document mask: a query sees the keys of its own document. ``doc`` int32 ids, (L,) shared
    by the batch or (batch, L) per batch entry, L >= max(seqlen_q, seqlen_k)."""
    if doc.ndim == 1:
        return cf.MaskMod("doc[q_idx] == doc[kv_idx]", arrays={"doc": doc},
                          python=lambda b, h, q_idx, kv_idx, doc: doc[q_idx] == doc[kv_idx])
    return cf.MaskMod("doc(b, q_idx) == doc(b, kv_idx)", arrays={"doc": doc},
                      python=lambda b, h, q_idx, kv_idx, doc: doc[b, q_idx] == doc[b, kv_idx])


def doc_dense(doc, sq, sk):
    """The element mask of ``doc_mod``: (1, sq, sk), or (batch, 1, sq, sk) per batch entry."""
    doc = np.asarray(doc)
    return doc[..., :sq, None] == doc[..., None, :sk] if doc.ndim == 1 else \
        (doc[:, :sq, None] == doc[:, None, :sk])[:, None]


def doc_ids(lengths, batch=None, seed=0):
    """int32 ids of consecutive documents of the given lengths; per batch entry (shuffled
    lengths) with ``batch``."""
    if batch is None:
        return np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    rng = np.random.default_rng(seed)
    return np.stack([np.repeat(np.arange(len(lengths)), rng.permutation(lengths))
                     for _ in range(batch)]).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# NumPy path: T5 bias against the reference with the dense bias

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): odd seqlens both ways with GQA and
# batch 2, tile multiples, one key block.
T5_SHAPES = [(2, 77, 130, 4, 2, 32), (1, 130, 77, 6, 2, 16), (2, 128, 128, 2, 2, 64),
             (1, 40, 50, 3, 1, 8)]


def _check_t5(shape, causal, seed):
    b, sq, sk, h, hk, d = shape
    q, k, v, dout = inputs(shape, seed=seed)
    W = max(sq, sk)
    bias = (0.5 * np.random.default_rng(seed + 9).standard_normal((h, 2 * W))).astype(np.float32)
    mod = t5_mod(bias, W)
    out, lse = cf.flash_attention(q, k, v, causal=causal, score_mod=mod, return_lse=True)
    dq, dk, dv, grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                    score_mod=mod)
    scale = d ** -0.5
    dense = t5_dense(bias, sq, sk, W)
    ref_out, ref_lse = attention_ref(q, k, v, scale, causal, bias=dense)
    *ref_grads, ds = attention_ref_backward(dout, q, k, v, scale, causal, bias=dense,
                                            return_ds=True)
    assert list(grads) == ["bias"] and grads["bias"].shape == bias.shape
    assert grads["bias"].dtype == np.float64
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv", "d bias"),
                              (out, lse, dq, dk, dv, grads["bias"]),
                              (ref_out, ref_lse, *ref_grads, t5_bias_grad(ds, W))):
        assert_close64(name, got, ref)
    # The bias really moved the result (the reference without it is far away).
    plain, _ = attention_ref(q, k, v, scale, causal)
    assert rel_err(out, plain) > 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", T5_SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}k{}-d{}".format(*s))
def test_t5_bias_matches_reference_with_dense_bias(shape, causal):
    _check_t5(shape, causal, seed=sum(shape) + causal)


def test_t5_bias_gradient_is_zero_at_offsets_no_element_has():
    """With W = 100 > seqlens, offsets below -(seqlen_q - 1) or above seqlen_k - 1 (and above
    seqlen_k - seqlen_q under causal) belong to no element: their gradient is exactly 0, the
    others' not."""
    q, k, v, dout = inputs((1, 30, 40, 2, 2, 16), seed=5)
    W = 100
    bias = np.random.default_rng(6).standard_normal((2, 2 * W)).astype(np.float32)
    mod = t5_mod(bias, W)
    out, lse = cf.flash_attention(q, k, v, causal=True, score_mod=mod, return_lse=True)
    d_bias = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=True, score_mod=mod)[3]
    d_bias = d_bias["bias"]
    reached = np.zeros(2 * W, bool)
    reached[W - 29:W + 40 - 30 + 1] = True
    assert (d_bias[:, ~reached] == 0).all()
    assert (d_bias[:, reached] != 0).all()


@pytest.mark.parametrize("kw,shape", [
    (dict(), (1, 5, 6, 2, 2, 3)),
    (dict(causal=True), (1, 6, 5, 2, 2, 3)),
    (dict(causal=True), (2, 5, 6, 4, 2, 3)),
    (dict(), (2, 6, 4, 2, 1, 3)),
], ids=["plain", "causal", "gqa-causal-batch2", "mqa-batch2"])
def test_t5_gradients_match_finite_differences(kw, shape):
    """dq, dk, dv and d bias against central differences of the NumPy forward (float64
    table, so that its entries can be nudged by 1e-6)."""
    b, sq, sk, h, hk, d = shape
    q, k, v, dout = (x * 2 for x in inputs(shape, seed=sum(shape)))
    W = max(sq, sk)
    bias = np.random.default_rng(7).standard_normal((h, 2 * W))
    assert_gradients_match_finite_differences(q, k, v, dout, score_mod=t5_mod(bias, W), **kw)
    _assert_table_grad_matches_fd(q, k, v, dout, lambda t: t5_mod(t, W), bias, "bias", **kw)


def test_clamped_t5_gradient_matches_finite_differences():
    """The clamped table (t5_mod(clamp=True)): its two far entries gather most elements."""
    shape = (1, 9, 11, 2, 1, 4)
    q, k, v, dout = (x * 2 for x in inputs(shape, seed=12))
    bias = np.random.default_rng(8).standard_normal((2, 2 * 3 + 1))
    _assert_table_grad_matches_fd(q, k, v, dout, lambda t: t5_mod(t, 3, clamp=True), bias, "bias",
                                  causal=True)


def _assert_table_grad_matches_fd(q, k, v, dout, make_mod, table, name, eps=1e-6, **kw):
    """The backward's gradient of the score_mod's array ``name`` against central differences
    of sum(flash_attention(..., score_mod=make_mod(table)) * dout)."""
    mod = make_mod(table)
    out, lse = cf.flash_attention(q, k, v, score_mod=mod, return_lse=True, **kw)
    got = cf.flash_attention_backward(dout, q, k, v, out, lse, score_mod=mod, **kw)[3][name]

    def loss(t):
        return float((cf.flash_attention(q, k, v, score_mod=make_mod(t), **kw) * dout).sum())

    fd = np.zeros_like(table)
    for pos in np.ndindex(table.shape):
        plus, minus = table.copy(), table.copy()
        plus[pos] += eps
        minus[pos] -= eps
        fd[pos] = (loss(plus) - loss(minus)) / (2 * eps)
    assert np.abs(fd).max() > 1e-3          # the table matters to the loss
    np.testing.assert_allclose(got, fd, rtol=1e-6, atol=1e-8, err_msg=f"d {name}")


# ---------------------------------------------------------------------------------------------
# NumPy path: the document mask

# (shape, document lengths): seqlen_q < seqlen_k, seqlen_q > seqlen_k (queries 77.. are in
# documents no key is in: rows without keys), equal on tile multiples.
DOC_CASES = [((2, 77, 130, 4, 2, 32), [30, 20, 50, 30]),
             ((1, 130, 77, 2, 1, 16), [20, 45, 12, 40, 13]),
             ((2, 128, 128, 3, 3, 16), [64, 10, 54])]


def _doc_call(q, k, v, dout, causal, **kw):
    out, lse = cf.flash_attention(q, k, v, causal=causal, return_lse=True, **kw)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, **kw)
    return out, lse, *grads


@pytest.mark.parametrize("per_batch", [False, True], ids=["shared", "per-batch"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape,lengths", DOC_CASES, ids=["q77-k130", "q130-k77", "q128-k128"])
def test_document_mask_matches_reference_with_dense_mask(shape, lengths, causal, per_batch):
    b, sq, sk, h, hk, d = shape
    q, k, v, dout = inputs(shape, seed=sq + 2 * sk + causal)
    doc = doc_ids(lengths, batch=b if per_batch else None, seed=sq)
    got = _doc_call(q, k, v, dout, causal, mask_mod=doc_mod(doc))
    dense = doc_dense(doc, sq, sk)
    scale = d ** -0.5
    ref = (*attention_ref(q, k, v, scale, causal, mask=dense),
           *attention_ref_backward(dout, q, k, v, scale, causal, mask=dense))
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert_close64(name, g, r)
    assert (np.isneginf(got[1]) == np.isneginf(ref[1])).all()
    if sq > sk:
        assert np.isneginf(got[1]).any()           # rows whose document has no key
    plain = cf.flash_attention(q, k, v, causal=causal)
    assert rel_err(got[0], plain) > 1e-3           # the mask hides something


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_from_mask_mod_as_block_mask_gives_the_mask_mods_result(causal):
    """The same rule given as ``mask_mod=`` and as ``block_mask=from_mask_mod(...)``: bit for
    bit with the call's own classification (block 128), within rounding with 64-blocks (other
    tiles, other order of the sums); the mask skips the blocks no document crosses."""
    shape = (2, 150, 200, 4, 2, 16)
    b, sq, sk, h, hk, d = shape
    q, k, v, dout = inputs(shape, seed=40 + causal)
    mod = doc_mod(doc_ids([70, 60, 70], batch=b, seed=3))
    direct = _doc_call(q, k, v, dout, causal, mask_mod=mod)
    same = masks.from_mask_mod(mod, sq, sk, batch=b, nheads=h)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), direct,
                          _doc_call(q, k, v, dout, causal, block_mask=same)):
        np.testing.assert_array_equal(x, y, err_msg=name)
    small = masks.from_mask_mod(mod, sq, sk, batch=b, block_size=64)
    assert small.block_size == (64, 64) and small.heads == 1
    assert not small.blocks.all()                   # some blocks are skipped
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), direct,
                          _doc_call(q, k, v, dout, causal, block_mask=small)):
        assert_close64(name, y, x)


def test_mask_mod_that_varies_over_the_batch_keeps_the_union_of_the_blocks():
    """Batch entry 0 sees only keys < 64, entry 1 only keys >= 64: each 64-block is empty
    for one entry and full for the other, so every block is kept (partial), and each entry
    still gets its own mask."""
    shape = (2, 100, 128, 2, 2, 16)
    q, k, v, dout = inputs(shape, seed=50)
    rule = cf.MaskMod(python=lambda b, h, q_idx, kv_idx: (kv_idx < 64) == (b == 0))
    mask = masks.from_mask_mod(rule, 100, 128, batch=2, block_size=64)
    assert mask.blocks.all()
    assert (mask.kv_partial == mask.kv_counts).all()     # no block is full for both entries
    got = _doc_call(q, k, v, dout, False, mask_mod=rule)
    dense = (np.arange(128)[None, :] < 64) == (np.arange(2)[:, None] == 0)     # (b, sk)
    dense = np.broadcast_to(dense[:, None, None, :], (2, 1, 100, 128))
    ref = (*attention_ref(q, k, v, 0.25, False, mask=dense),
           *attention_ref_backward(dout, q, k, v, 0.25, False, mask=dense))
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert_close64(name, g, r)


def _brute_force_blocks(rule, batch, nheads, sq, sk, bq, bk):
    """(kept, full) per (head, query block, key block) from the dense rule: kept where some
    batch entry sees an element, full where every entry sees every element."""
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(nheads)[None, :, None, None]
    seen = np.broadcast_to(rule(b, h, np.arange(sq)[:, None], np.arange(sk)[None, :]),
                           (batch, nheads, sq, sk))
    nbq, nbk = -(-sq // bq), -(-sk // bk)
    kept = np.zeros((nheads, nbq, nbk), bool)
    full = np.zeros_like(kept)
    for i in range(nbq):
        for j in range(nbk):
            tile = seen[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            kept[:, i, j] = tile.any(axis=(0, 2, 3))
            full[:, i, j] = tile.all(axis=(0, 2, 3))
    return kept, full


def _per_head_rule(doc):
    """Documents per batch entry, and head h does not see the keys 128 m .. 128 m + 127 with
    m % 3 == h except on the diagonal: blocks differ per head and per batch entry."""
    def rule(b, h, q_idx, kv_idx, doc=doc):
        return ((((kv_idx >> 7) % 3) != h) & (doc[b, q_idx] == doc[b, kv_idx])) \
            | (q_idx == kv_idx)

    cuda = "(kv_idx >> 7) % 3 != h && doc(b, q_idx) == doc(b, kv_idx) || q_idx == kv_idx"
    return cuda, rule


@pytest.mark.parametrize("sq,sk,block_size", [(300, 300, 64), (250, 390, (128, 64)),
                                              (390, 250, (64, 128))])
def test_from_mask_mod_classifies_blocks_like_brute_force(sq, sk, block_size):
    doc = doc_ids([100, 150, 140], batch=2, seed=sq)
    _, rule = _per_head_rule(doc)
    mask = masks.from_mask_mod(cf.MaskMod(python=rule), sq, sk, batch=2, nheads=3,
                               block_size=block_size)
    bq, bk = mask.block_size
    kept, full = _brute_force_blocks(rule, 2, 3, sq, sk, bq, bk)
    np.testing.assert_array_equal(mask.blocks, kept)
    assert not (kept[0] == kept[1]).all()             # the blocks differ per head
    # The partial blocks (listed first) are the kept ones the rule cuts, and the last key
    # block where seqlen_k is not a multiple of block_k (the sequence tail).
    tail = np.zeros(kept.shape[2], bool)
    tail[-1] = sk % bk != 0
    partial = kept & (~full | tail)
    for hd in range(3):
        for i in range(kept.shape[1]):
            n, n_partial = mask.kv_counts[hd, i], mask.kv_partial[hd, i]
            listed = mask.kv_indices[hd, i, :n]
            assert sorted(listed) == list(np.flatnonzero(kept[hd, i]))
            assert sorted(listed[:n_partial]) == list(np.flatnonzero(partial[hd, i]))


# ---------------------------------------------------------------------------------------------
# NumPy path: a nonlinear score_mod, and plain callables

def _scale_mod(kind, scale2, grad_arrays=()):
    """``scale2[h] * score`` or ``scale2[h] * tanh(score)`` with its Python gradient (which
    gets the score before the mod); d scale2 when asked."""
    f = (lambda s: s) if kind == "linear" else np.tanh
    df = (lambda s: np.ones_like(s)) if kind == "linear" else (lambda s: 1 - np.tanh(s) ** 2)

    def rule(score, b, h, q_idx, kv_idx, scale2):
        return scale2[h] * f(score)

    def grad(score, dscore, b, h, q_idx, kv_idx, scale2, **d):
        if "d_scale2" in d:
            hh, contrib = np.broadcast_arrays(h, dscore * f(score))
            np.add.at(d["d_scale2"], hh, contrib)
        return dscore * scale2[h] * df(score)

    return cf.ScoreMod(python=rule, python_grad=grad, arrays={"scale2": scale2},
                       grad_arrays=grad_arrays)


@pytest.mark.parametrize("kind", ["linear", "tanh"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nonlinear_score_mod_gradients_match_finite_differences(kind, causal):
    q, k, v, dout = inputs((2, 5, 6, 4, 2, 3), seed=60 + causal)
    q, k, v = 2 * q, 2 * k, 2 * v                     # scores beyond tanh's linear range
    scale2 = np.array([0.5, 1.5, -1.0, 2.0])
    mod = _scale_mod(kind, scale2, grad_arrays=("scale2",))
    assert_gradients_match_finite_differences(q, k, v, dout, score_mod=mod, causal=causal)
    _assert_table_grad_matches_fd(q, k, v, dout,
                                  lambda t: _scale_mod(kind, t, grad_arrays=("scale2",)),
                                  scale2, "scale2", causal=causal)


def test_nonlinear_score_mod_forward_matches_reference():
    """scale2[h] * tanh(s) over several tiles, against the reference's scores rebuilt by hand
    (the mod of q k^T * scale as a bias: f(s) - s)."""
    shape = (2, 77, 130, 4, 2, 16)
    q, k, v, dout = inputs(shape, seed=61)
    scale2 = np.array([0.5, 2.0, -1.0, 3.0], np.float32)
    out, lse = cf.flash_attention(q, k, v, score_mod=_scale_mod("tanh", scale2),
                                  return_lse=True)
    s = np.einsum("bihd,bjhd->bhij", q, np.repeat(k, 2, axis=2)) * 0.25
    bias = scale2.astype(np.float64)[None, :, None, None] * np.tanh(s) - s
    ref_out, ref_lse = attention_ref(q, k, v, 0.25, False, bias=bias)
    assert_close64("out", out, ref_out)
    assert_close64("lse", lse, ref_lse)


def test_no_grad_arrays_gives_three_gradients():
    q, k, v, dout = inputs((1, 20, 20, 4, 2, 8), seed=62)
    mod = _scale_mod("tanh", np.ones(4))
    out, lse = cf.flash_attention(q, k, v, score_mod=mod, return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, score_mod=mod)
    assert len(grads) == 3 and all(isinstance(g, np.ndarray) for g in grads)


@pytest.mark.parametrize("sq,sk", [(70, 70), (50, 90), (90, 50)])
def test_plain_callables_on_numpy(sq, sk):
    """A lambda score_mod spelling ALiBi (slope 0.3) equals alibi_slopes; a lambda mask_mod
    spelling the bottom-right causal rule equals causal=True; their backward without a
    gradient rule is refused, and with one (a ScoreMod of the same lambda) matches."""
    q, k, v, dout = inputs((2, sq, sk, 2, 1, 16), seed=sq + sk)
    slopes = np.float32([0.3, 0.3])
    alibi = cf.flash_attention(q, k, v, alibi_slopes=slopes, causal=True, return_lse=True)
    shift = sk - sq

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - np.float32(0.3) * np.abs(q_idx + shift - kv_idx)

    def causal_rule(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + shift

    got = cf.flash_attention(q, k, v, score_mod=score_mod, mask_mod=causal_rule,
                             return_lse=True)
    for name, g, r in zip(("out", "lse"), got, alibi):
        assert_close64(name, g, r)
    assert (np.isneginf(got[1]) == np.isneginf(alibi[1])).all()
    with pytest.raises(ValueError, match="python_grad"):
        cf.flash_attention_backward(dout, q, k, v, *got, score_mod=score_mod,
                                    mask_mod=causal_rule)
    with_grad = cf.ScoreMod(python=score_mod, python_grad=lambda s, ds, *idx: ds)
    grads = cf.flash_attention_backward(dout, q, k, v, *got, score_mod=with_grad,
                                        mask_mod=causal_rule)
    ref = cf.flash_attention_backward(dout, q, k, v, *alibi, alibi_slopes=slopes, causal=True)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert_close64(name, g, r)


def test_t5_bias_and_document_mask_together_on_numpy():
    shape = (2, 77, 130, 4, 2, 16)
    b, sq, sk, h, hk, d = shape
    q, k, v, dout = inputs(shape, seed=70)
    W = 130
    bias = np.random.default_rng(71).standard_normal((h, 2 * W)).astype(np.float32)
    doc = doc_ids([40, 50, 40], batch=2, seed=72)
    kw = dict(causal=True, score_mod=t5_mod(bias, W), mask_mod=doc_mod(doc))
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    dq, dk, dv, grads = cf.flash_attention_backward(dout, q, k, v, out, lse, **kw)
    dense = dict(bias=t5_dense(bias, sq, sk, W), mask=doc_dense(doc, sq, sk))
    ref_out, ref_lse = attention_ref(q, k, v, 0.25, True, **dense)
    *ref_grads, ds = attention_ref_backward(dout, q, k, v, 0.25, True, return_ds=True, **dense)
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv", "d bias"),
                              (out, lse, dq, dk, dv, grads["bias"]),
                              (ref_out, ref_lse, *ref_grads, t5_bias_grad(ds, W))):
        assert_close64(name, got, ref)


# ---------------------------------------------------------------------------------------------
# Refused calls

def _nvrtc_or_skip():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


@pytest.mark.parametrize("score,mask,where", [
    ("float x = score;\nreturn x + ;", None, "score_mod(2)"),
    ("score + tbl[h]", None, 'identifier "tbl" is undefined'),
    (None, "struct R { int x; }; return R{1};", "mask_mod(1)"),
    (None, "return make_float2(0.f, 1.f);", "mask_mod(1)"),
], ids=["syntax-line-2", "undeclared-array", "mask-returns-struct", "mask-returns-float2"])
def test_snippet_that_does_not_compile_raises_snippet_error(score, mask, where):
    _nvrtc_or_skip()
    sm = cf.ScoreMod(score) if score is not None else None
    mm = cf.MaskMod(mask) if mask is not None else None
    with pytest.raises(cf.SnippetError) as info:
        mods.check_prelude(mods.prelude(sm, mm))
    assert where in str(info.value) and where in info.value.log
    assert isinstance(info.value, ValueError)


def test_gradient_snippet_errors_name_the_gradient_snippet():
    _nvrtc_or_skip()
    sm = cf.ScoreMod("score", grad="float g = dscore;\n\nreturn g * ;")
    with pytest.raises(cf.SnippetError, match=r"score_mod\.grad\(3\)"):
        mods.check_prelude(mods.prelude(sm, None))


def test_snippets_that_compile_pass_the_check():
    """The README's T5 and document snippets (and a body with several lines) compile."""
    _nvrtc_or_skip()
    bias = np.zeros((4, 512), np.float32)
    doc = np.zeros(256, np.int32)
    body = cf.ScoreMod("float s = score;\nif (kv_idx > q_idx) s -= 1.f;\nreturn s;")
    assert mods.check_prelude(mods.prelude(t5_mod(bias, 256), doc_mod(doc)))
    assert mods.check_prelude(mods.prelude(body, doc_mod(doc[None].repeat(2, 0))))


@pytest.mark.parametrize("code,gathers", [
    ("score - slopes[h] * fabsf((float)(q_idx - kv_idx))", False),
    ("score - 0.5f", False),
    ("score + slopes[h] + slopes[0]", False),
    ("score + bias(h, kv_idx - q_idx + 4)", True),
    ("score + bias(min(max(kv_idx - q_idx, -2), 2) + 2, h)", True),
    ("doc[q_idx] == doc[kv_idx] ? score : score - 1.f", True),
])
def test_score_mods_that_read_a_table_per_score_are_told_from_the_rest(code, gathers):
    """mods.gathers: loads per score in the snippet's PTX (the Hopper forward's head dim 64
    takes two consumers for such a snippet, _launch.sm90_fwd_call_tile)."""
    _nvrtc_or_skip()
    arrays = {"slopes": np.zeros(4, np.float32), "bias": np.zeros((5, 9), np.float32),
              "doc": np.zeros(16, np.int32)}
    sm = cf.ScoreMod(code, arrays={n: a for n, a in arrays.items() if n in code})
    text = mods.prelude(sm, None)
    assert mods.gathers(text) == gathers
    # The kernels read it from the prelude (their score step's copy for the sequences' ends).
    assert mods.reads_table(text) == gathers


def test_undeclared_gradient_array_is_refused():
    """d_bias exists only for arrays named in grad_arrays."""
    _nvrtc_or_skip()
    sm = cf.ScoreMod("score + bias[0]", grad="d_bias.add(0, dscore); return dscore;",
                     arrays={"bias": np.zeros(3, np.float32)})
    with pytest.raises(cf.SnippetError, match="d_bias"):
        mods.check_prelude(mods.prelude(sm, None))


@pytest.mark.parametrize("make,exc,match", [
    (lambda: cf.ScoreMod("score", arrays={"tbl": np.zeros(3, np.complex64)}), TypeError,
     "'tbl'.*complex64"),
    (lambda: cf.MaskMod("true", arrays={"tbl": np.zeros(3, np.float16)}), TypeError,
     "'tbl'.*float16"),
    (lambda: cf.ScoreMod("score", arrays={"score": np.zeros(3)}), ValueError, "'score'"),
    (lambda: cf.ScoreMod("score", arrays={"d_x": np.zeros(3)}), ValueError, "'d_x'"),
    (lambda: cf.MaskMod("true", arrays={"q_idx": np.zeros(3)}), ValueError, "'q_idx'"),
    (lambda: cf.ScoreMod("score", arrays={"2x": np.zeros(3)}), ValueError, "'2x'"),
    (lambda: cf.ScoreMod("score", arrays={f"a{i}": np.zeros(3) for i in range(9)}), ValueError,
     "at most 8"),
    (lambda: cf.ScoreMod("score", arrays={"t": np.zeros((1,) * 5)}), ValueError, "'t'"),
    (lambda: cf.ScoreMod("score", arrays={"t": np.zeros((3, 0))}), ValueError, "'t'"),
    (lambda: cf.ScoreMod("score", arrays={"t": [1.0, 2.0]}), TypeError, "'t'"),
    (lambda: cf.ScoreMod("score", arrays=[np.zeros(3)]), TypeError, "dict"),
    (lambda: cf.ScoreMod("score", arrays={"ids": np.zeros(3, np.int32)}, grad_arrays="ids"),
     TypeError, "'ids'.*float"),
    (lambda: cf.ScoreMod("score", arrays={"t": np.zeros(3)}, grad_arrays=("u",)), ValueError,
     "'u'"),
    (lambda: cf.ScoreMod(), ValueError, "needs a rule"),
    (lambda: cf.MaskMod(), ValueError, "needs a rule"),
    (lambda: cf.ScoreMod(42), TypeError, "cuda"),
    (lambda: cf.ScoreMod("  "), TypeError, "cuda"),
    (lambda: cf.ScoreMod("score", python="score + 1"), TypeError, "callable"),
], ids=["complex64", "float16", "name-score", "name-d_x", "name-q_idx", "not-identifier",
        "nine-arrays", "five-dims", "zero-size", "a-list", "not-a-dict", "grad-of-int-array",
        "grad-of-unknown-array", "no-score-rule", "no-mask-rule", "cuda-not-str",
        "cuda-blank", "python-not-callable"])
def test_bad_mods_are_refused_at_construction(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def _small():
    return inputs((1, 20, 24, 2, 2, 8), seed=80)


def _t5_small():
    return t5_mod(np.zeros((2, 48), np.float32), 24)


@pytest.mark.parametrize("kw,match", [
    (dict(score_mod=_t5_small(), softcap=5.0), "softcap"),
    (dict(score_mod=_t5_small(), alibi_slopes=np.float32([0.1, 0.2])), "alibi_slopes"),
    (dict(mask_mod=doc_mod(np.zeros(24, np.int32)), window_size=(4, 4)), "window_size"),
    (dict(mask_mod=doc_mod(np.zeros(24, np.int32)),
          block_mask=masks.causal(20, 24, block_size=64)), "block_mask"),
    (dict(score_mod=cf.ScoreMod("score")), "python"),
    (dict(mask_mod=cf.MaskMod("true")), "python"),
    (dict(score_mod=cf.ScoreMod(python=lambda s, *i, a: s, arrays={"a": np.zeros(1)}),
          mask_mod=cf.MaskMod(python=lambda *i, a: True, arrays={"a": np.zeros(1)})),
     "alike"),
    (dict(score_mod=cf.ScoreMod(python=lambda s, *i, **a: s,
                                arrays={f"s{i}": np.zeros(1) for i in range(5)}),
          mask_mod=cf.MaskMod(python=lambda *i, **a: True,
                              arrays={f"m{i}": np.zeros(1) for i in range(4)})), "at most 8"),
], ids=["score_mod-softcap", "score_mod-alibi", "mask_mod-window", "mask_mod-block_mask",
        "score_mod-cuda-only", "mask_mod-cuda-only", "same-array-name", "nine-arrays-together"])
def test_refused_combinations_raise_value_error_on_numpy(kw, match):
    q, k, v, dout = _small()
    before = [x.copy() for x in (q, k, v, dout)]
    with pytest.raises(ValueError, match=match):
        cf.flash_attention(q, k, v, **kw)
    out, lse = cf.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=match):
        cf.flash_attention_backward(dout, q, k, v, out, lse, **kw)
    for x, y in zip((q, k, v, dout), before):
        np.testing.assert_array_equal(x, y)


def test_score_mod_and_mask_mod_of_the_wrong_type_are_type_errors():
    q, k, v, _ = _small()
    with pytest.raises(TypeError, match="score_mod"):
        cf.flash_attention(q, k, v, score_mod="score + 1")
    with pytest.raises(TypeError, match="mask_mod"):
        cf.flash_attention(q, k, v, mask_mod=True)


def test_backward_without_python_grad_is_refused_on_numpy():
    q, k, v, dout = _small()
    mod = cf.ScoreMod("score", grad="dscore", python=lambda s, *i: 2 * s)
    out, lse = cf.flash_attention(q, k, v, score_mod=mod, return_lse=True)
    with pytest.raises(ValueError, match="python_grad"):
        cf.flash_attention_backward(dout, q, k, v, out, lse, score_mod=mod)


def test_mask_from_a_mask_mod_does_not_combine():
    rule = doc_mod(np.zeros(100, np.int32))
    a = masks.from_mask_mod(rule, 100, 100, block_size=64)
    b = masks.causal(100, 100, block_size=64)
    for op in (lambda: a & b, lambda: b | a):
        with pytest.raises(ValueError, match="mask_mod"):
            op()


def test_mask_classified_for_another_batch_is_refused():
    """A mask from from_mask_mod(batch=1) of a rule that varies over the batch has not
    seen entry 1's blocks: a batch-2 call with it is refused, not silently wrong."""
    q, k, v, _ = inputs((2, 64, 128, 2, 2, 8), seed=81)
    rule = cf.MaskMod(python=lambda b, h, q_idx, kv_idx: (kv_idx < 64) == (b == 0))
    mask = masks.from_mask_mod(rule, 64, 128, batch=1, block_size=64)
    assert mask.blocks.tolist() == [[[True, False]]]
    with pytest.raises(ValueError, match="batch"):
        cf.flash_attention(q, k, v, block_mask=mask)
    # batch=None promises the rule ignores b: no check then.
    shared = masks.from_mask_mod(doc_mod(np.zeros(128, np.int32)), 64, 128, block_size=64)
    cf.flash_attention(q, k, v, block_mask=shared)


# ---------------------------------------------------------------------------------------------
# GPU: against the NumPy path's float64 results

@dataclass(frozen=True)
class GpuCase:
    dtype: str              # float16, bfloat16, float32, float64
    batch: int
    sq: int
    sk: int
    nheads: int
    nheads_k: int
    d: int
    causal: bool
    mods: str               # "t5", "doc" or "both"
    shift: float = 0.0      # added to every entry of the T5 bias table
    clamp: int = 0          # > 0: the T5 offsets clamped to [-clamp, clamp] (t5_mod)

    @property
    def id(self):
        return (f"{self.dtype}-{self.mods}-b{self.batch}-q{self.sq}-k{self.sk}-h{self.nheads}"
                f"k{self.nheads_k}-d{self.d}-{'causal' if self.causal else 'full'}"
                + (f"-shift{self.shift:g}" if self.shift else "")
                + (f"-clamp{self.clamp}" if self.clamp else ""))

    @property
    def seed(self):
        return (self.sq * 7 + self.sk * 3 + self.d + self.causal * 11
                + ("t5", "doc", "both").index(self.mods) * 5)


GPU_SHAPES = [(2, 300, 300, 4, 2, 64), (1, 257, 400, 4, 1, 128), (2, 400, 257, 2, 2, 64)]
GPU_CASES = [GpuCase(dtype, *shape, causal, kind)
             for dtype in ("float16", "bfloat16", "float32", "float64")
             for shape in GPU_SHAPES for kind in ("t5", "doc", "both")
             for causal in (False, True)]
GPU_CASES += [GpuCase(dtype, 1, 333, 200, 6, 2, 96, True, "both")
              for dtype in ("float16", "bfloat16")]
# On an H100/H200 the Hopper backward at head dim 256 (its wide kernel), and a bias table too
# large for its shared memory (the gradient added by global atomics, not staged).
GPU_CASES += [GpuCase("bfloat16", 2, 200, 129, 4, 2, 256, True, "both"),
              GpuCase("float16", 1, 300, 257, 4, 2, 256, False, "doc"),
              GpuCase("float16", 1, 1100, 1200, 4, 2, 128, False, "t5")]
# Every score lifted by 20 in fp16, with query rows past the last tile's end (the tail): a
# zero score of such a row must not become a probability (e^20 is inf in fp16's P).
SHIFTED = [GpuCase("float16", 2, 100, 130, 2, 2, 64, causal, "t5", shift=20.0)
           for causal in (False, True)]
GPU_CASES += SHIFTED
# Clamped offsets: most warps add a whole fragment register's dS to one table entry (one
# reduction across the warp), the lanes near the diagonal to a few (cuda/user.cuh).
GPU_CASES += [GpuCase(dtype, 2, 300, 333, 4, 2, d, causal, "t5", clamp=16)
              for dtype, d in (("bfloat16", 128), ("float16", 64), ("float32", 64))
              for causal in (False, True)]


def _t5_width(case):
    """The T5 table's W (its offsets' bound) and its clamp flag."""
    return (case.clamp, True) if case.clamp else (max(case.sq, case.sk), False)


def _gpu_mods(case, xp, bias, doc):
    score = t5_mod(xp.asarray(bias), *_t5_width(case)) if case.mods in ("t5", "both") else None
    mask = doc_mod(xp.asarray(doc)) if case.mods in ("doc", "both") else None
    return score, mask


def check_gpu_case(case, deterministic, monkeypatch):
    import cupy
    from gpu_checks import FP64_RTOL
    from cupyflash import _launch
    # fp16/bf16 on sm_90: the Hopper backward must be what runs (user mods included).
    hopper_runs = []
    real = _launch._backward_sm90
    monkeypatch.setattr(_launch, "_backward_sm90",
                        lambda *a, **kw: (hopper_runs.append(True), real(*a, **kw))[1])
    shape = (case.batch, case.sq, case.sk, case.nheads, case.nheads_k, case.d)
    host = inputs(shape, np_dtype(case.dtype), seed=case.seed)
    q, k, v, dout = (cupy.asarray(x) for x in host)
    W, clamp = _t5_width(case)
    rng = np.random.default_rng(case.seed + 5)
    bias = (case.shift + 0.5 * rng.standard_normal((case.nheads, 2 * W + clamp))).astype(np.float32)
    doc = doc_ids([60, 140, 100, 100], batch=case.batch, seed=case.seed)[:, :max(case.sq, case.sk)]
    score, mask = _gpu_mods(case, cupy, bias, doc)
    kw = dict(causal=case.causal, score_mod=score, mask_mod=mask)
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                        **kw)
    assert len(grads) == (4 if score is not None else 3)
    # (deterministic with a mask_mod's block mask: the generic pass, _launch.bwd_family)
    if (case.dtype in ("float16", "bfloat16") and _launch._hopper_allowed()
            and not (deterministic and mask is not None)):
        assert hopper_runs, "the Hopper backward did not run"
    if deterministic and case.dtype in ("float16", "bfloat16"):
        again = cf.flash_attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
        assert bool((grads[0].view(cupy.uint16) == again[0].view(cupy.uint16)).all()), \
            "dq differs between two deterministic runs"

    # The reference: the NumPy path in float64 on the same inputs.
    host64 = [x.astype(np.float64) for x in host]
    score64, mask64 = _gpu_mods(case, np, bias, doc)
    kw64 = dict(causal=case.causal, score_mod=score64, mask_mod=mask64)
    ref_out, ref_lse = cf.flash_attention(*host64[:3], return_lse=True, **kw64)
    refs = cf.flash_attention_backward(host64[3], *host64[:3], ref_out, ref_lse, **kw64)

    assert out.shape == q.shape and out.dtype == q.dtype
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
    # Widened on the device: CuPy holds bfloat16 as raw 16-bit data.
    got = [cupy.asnumpy(a.astype(cupy.float64)) for a in (out, lse, *grads[:3])]
    assert (np.isneginf(got[1]) == np.isneginf(ref_lse)).all(), \
        "lse is -inf exactly on the rows without keys"
    for name, a in zip(("out", "lse", "dq", "dk", "dv"), got):
        assert not np.isnan(a).any(), f"{name} has NaN"

    scale = case.d ** -0.5
    dense = {}
    if score is not None:
        dense["bias"] = cupy.asarray(t5_dense(bias, case.sq, case.sk, W, clamp))
    if mask is not None:
        dense["mask"] = cupy.asarray(doc_dense(doc, case.sq, case.sk))
    if case.dtype == "float64":
        for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got,
                              (ref_out, ref_lse, *refs[:3])):
            err = rel_err(g, r)
            assert err < FP64_RTOL, f"{name}: relative error {err:.2e}"
    else:
        naive_out, naive_lse = (cupy.asnumpy(x) for x in attention_naive(
            q, k, v, scale, case.causal, case.dtype, **dense))
        assert_rule("out", got[0], ref_out, naive_out, FWD_FACTOR)
        assert_rule("lse", got[1], ref_lse, naive_lse, FWD_FACTOR)
        naives = attention_naive_backward(dout, q, k, v, scale, case.causal, case.dtype,
                                          **dense)
        magnitude = max(float(np.abs(r).max()) for r in refs[:3])
        for name, g, r, n in zip(("dq", "dk", "dv"), got[2:], refs[:3], naives):
            assert_rule(name, g, r, cupy.asnumpy(n), BWD_FACTOR, magnitude)
    if score is not None:
        d_bias = grads[3]["bias"]
        # The kernels add the gradient up in float64 for float64 inputs, else in float32.
        wide = case.dtype == "float64"
        assert isinstance(d_bias, cupy.ndarray)
        assert d_bias.dtype == (cupy.float64 if wide else cupy.float32)
        assert d_bias.shape == bias.shape
        # The naive baseline: dS of a naive implementation in the input dtype (float32 for
        # float32 inputs), summed in the gradient's dtype.
        naive_dtype = "float32" if case.dtype == "float32" else case.dtype
        *_, naive_ds = attention_naive_backward(dout, q, k, v, scale, case.causal, naive_dtype,
                                                return_ds=True, **dense)
        naive_bias = t5_bias_grad(cupy.asnumpy(naive_ds), W, np.float64 if wide else np.float32,
                                  clamp)
        assert_rule("d bias", cupy.asnumpy(d_bias), refs[3]["bias"], naive_bias, BWD_FACTOR)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GPU_CASES])
def test_mods_match_numpy_path_on_gpu(case, deterministic, monkeypatch):
    if deterministic and case.dtype not in ("float16", "bfloat16"):
        pytest.skip("the plain kernels have one backward")
    check_gpu_case(case, deterministic, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in SHIFTED])
def test_shifted_scores_on_the_generic_kernels_on_gpu(case, monkeypatch):
    monkeypatch.setenv("CUPYFLASH_KERNELS", "generic")
    check_gpu_case(case, False, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,block_size", [(300, 300, 64), (250, 390, (128, 64)),
                                              (390, 250, 128)])
def test_from_mask_mod_on_gpu_classifies_like_the_cpu(sq, sk, block_size):
    import cupy
    doc = doc_ids([100, 150, 140], batch=2, seed=sq)
    cuda, rule = _per_head_rule(doc)
    on_gpu = masks.from_mask_mod(cf.MaskMod(cuda, arrays={"doc": cupy.asarray(doc)}), sq, sk,
                                 batch=2, nheads=3, block_size=block_size)
    on_cpu = masks.from_mask_mod(cf.MaskMod(python=rule), sq, sk, batch=2, nheads=3,
                                 block_size=block_size)
    assert not (on_cpu.blocks[0] == on_cpu.blocks[1]).all()      # the blocks differ per head
    assert not on_cpu.blocks.all()
    for name in ("blocks", "kv_indices", "kv_counts", "kv_partial", "q_indices", "q_counts",
                 "q_partial"):
        np.testing.assert_array_equal(getattr(on_gpu, name), getattr(on_cpu, name),
                                      err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32", "fp64"])
@pytest.mark.parametrize("sq,sk", [(200, 333), (333, 200), (256, 256)])
def test_mask_mod_spelling_causal_equals_causal_on_gpu(dtype, sq, sk):
    import cupy
    from gpu_checks import FP64_RTOL, Case, check_backward, check_forward, make_inputs
    case = Case(dtype, sq, sk, 64, True, batch=2, nheads=4, nheads_k=2)
    q, k, v, dout = make_inputs(case, seed=sq + sk)
    scale = case.d ** -0.5
    rule = cf.MaskMod(f"kv_idx <= q_idx + {sk - sq}")     # the shift as a literal
    out, lse = cf.flash_attention(q, k, v, mask_mod=rule, return_lse=True)
    check_forward(case, q, k, v, out, lse, scale)        # the causal reference
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, mask_mod=rule)
    check_backward(case, dout, q, k, v, grads, scale)
    causal_out, causal_lse = cf.flash_attention(q, k, v, causal=True, return_lse=True)
    assert bool((cupy.isneginf(lse) == cupy.isneginf(causal_lse)).all())
    if dtype == "fp64":
        causal_grads = cf.flash_attention_backward(dout, q, k, v, causal_out, causal_lse,
                                                   causal=True)
        for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                              (causal_out, causal_lse, *causal_grads)):
            assert rel_err(g, r) < FP64_RTOL, name


@pytest.mark.gpu
def test_refused_calls_on_gpu():
    import cupy
    q, k, v, dout = (cupy.asarray(x.astype(np.float16)) for x in _small())
    bias = cupy.zeros((2, 48), cupy.float32)
    with pytest.raises(NotImplementedError, match="score_mod"):
        cf.flash_attention(q, k, v, score_mod=t5_mod(bias, 24), dropout_p=0.1, seed=1)
    with pytest.raises(ValueError, match="CUDA rule"):
        cf.flash_attention(q, k, v, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(cf.SnippetError, match=r"score_mod\(2\)"):
        cf.flash_attention(q, k, v, score_mod=cf.ScoreMod("float x = score;\nreturn x + ;"))
    out, lse = cf.flash_attention(q, k, v, score_mod=cf.ScoreMod("score * 0.5f"),
                                  return_lse=True)
    with pytest.raises(ValueError, match="grad="):
        cf.flash_attention_backward(dout, q, k, v, out, lse,
                                    score_mod=cf.ScoreMod("score * 0.5f"))
    with pytest.raises(TypeError, match="bias"):    # a mod's host array with device inputs
        cf.flash_attention(q, k, v, score_mod=t5_mod(np.zeros((2, 48), np.float32), 24))
