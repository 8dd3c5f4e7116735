"""Property-based fuzzing of the NumPy path (no GPU) against the plain float64 reference.

NumPy inputs go through the public API (``flash_attention`` with ``return_lse=True``, then
``flash_attention_backward``) and are compared with tests/reference.py's full-matrix float64
attention (with ``block_mask.to_dense()``, or a mask_mod's dense spelling, as the element
mask, and a score_mod's dense spelling in the scores):

- float64: out, lse and dq, dk, dv within 1e-12 of max(max|ref|, 1), as test_numpy_path.py;
  the gradients of a score_mod's arrays within 1e-12 of max(their terms' sizes, 1);
- float32: FlashAttention's rule (DESIGN.md) against a naive float32 implementation: 2x its
  error for out and lse, 3x for the gradients, the arrays' among them (as
  test_numpy_path.py checks low precision);
- lse is -inf exactly on the rows that see no key; there out and dq are exactly 0, and dk, dv
  are exactly 0 on keys that no query sees; no NaN, and no floating-point warning other than
  underflow is raised on the way.

Cases (tests/strategies.py) cover batch, seqlen_q and seqlen_k 1..300 (tile edges 63/64/65,
127/128/129, 255/256/257, unequal both ways), GQA/MQA, head dims 1..256, float64 and float32,
causal, window_size (dense only: the call refuses it with a block mask), softcap, ALiBi slopes
per head or per (batch, head), dropout (the reference applies the public keep-mask), user mods
from strategies.py's library (score_mods: a T5-style bucketed relative bias with its table's
gradient, ALiBi spelled as a score_mod, a learned tanh cap per head with its gradient;
mask_mods: documents, prefix-LM, a local window per head; each alone or a pair, where the call
allows them), packed and padded strided layouts, an explicit softmax_scale, block masks of
every builder (block sizes 64/128 per side, shared or per head, with or without the mask's own
causal) and the deterministic flag, under a work budget that keeps the NumPy loops fast.
Two more families: packed variable-length batches (``packed_cases``: up to 5 sequences of 0..130
queries and keys each, empty ones included, causal, window or softcap; each sequence against
the reference alone, forward and backward) and KV caches (``cache_cases``: contiguous or paged
by 16/32/48 rows under a shuffled table, lengths 0 to full, appends of 0..4 keys, 1..4 queries:
the appended rows in place, no other row touched, out and lse over each entry's prefix).

Budget: a fixed number of examples per family (DENSE_EXAMPLES = 250, SPARSE_EXAMPLES = 150,
MODS_EXAMPLES = 100; user mods come in about half the dense and block-sparse cases that allow
them, and in every case of the third family; PACKED_EXAMPLES = CACHE_EXAMPLES = 60, about 3 s
together), drawn derandomized so CI sees the same cases on every run. Measured on the 2-core CPU-only development machine: the whole file takes 6.5-11 s;
while other jobs competed for its two cores, 700 examples once took 80 s (NumPy's two BLAS
threads then wait on each other), so these 500 stay under a minute even then. The line "fuzz
examples run per family (NumPy path): ..." at the end of pytest's output gives the counts.

A failure prints the falsifying ``Case(...)`` (whose ``seed`` fixes the inputs) and a
``@reproduce_failure`` line. To re-run that case alone, from the repository root::

    PYTHONPATH=.:tests python3 -c "from strategies import *; import test_fuzz_numpy as t; \
t.check_case(Case(...))"
"""
import numpy as np
import pytest

pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import cupyflash as cf  # noqa: E402

try:
    from reference import (assert_rule, attention_naive, attention_naive_backward,  # noqa: E402
                           attention_ref, attention_ref_backward, rel_err)
    from strategies import (FUZZ_PROFILE, ExampleCounts, alibis,  # noqa: E402
                            assert_zero_where_unseen, block_masks, cache_cases, cases, dropouts,
                            layouts, maybe_windows, packed_cases, shapes, softcaps, user_mods)
except ImportError:
    from tests.reference import (assert_rule, attention_naive,  # noqa: E402
                                 attention_naive_backward, attention_ref,
                                 attention_ref_backward, rel_err)
    from tests.strategies import (FUZZ_PROFILE, ExampleCounts, alibis,  # noqa: E402
                                  assert_zero_where_unseen, block_masks, cache_cases, cases,
                                  dropouts, layouts, maybe_windows, packed_cases, shapes,
                                  softcaps, user_mods)

F64_REL = 1e-12
FWD_FACTOR, BWD_FACTOR = 2, 3

DENSE_EXAMPLES = 250
SPARSE_EXAMPLES = 150
MODS_EXAMPLES = 100
PACKED_EXAMPLES = 60
CACHE_EXAMPLES = 60

# float64 is the NumPy path's own precision (the tight check): drawn twice as often. fp16/bf16
# inputs are left to the GPU fuzz: the NumPy path's backward takes out rounded to them, so its
# gradients can miss the rule by luck of the naive implementation on small shapes.
CPU_DTYPES = st.sampled_from(("fp64", "fp64", "fp32"))
# The NumPy path loops over 64 x 64 tiles (or the mask's blocks), per head for per-head masks:
# these bounds keep one example near 0.1 s.
CPU_SHAPES = dict(max_seqlen=300, max_batch=2, max_kv_heads=3, max_group=3,
                  max_scores=2**17, max_work=2**22)

COUNTS = ExampleCounts("fuzz examples run per family (NumPy path)")


@pytest.fixture(autouse=True, scope="module")
def _report_counts(request):
    COUNTS.register(request.config)


def check_case(case):
    """Forward and backward of ``case`` through the public API against the reference."""
    q, k, v, dout = case.inputs(np)
    mask = case.block_mask()
    variant = case.variant(np)
    user = case.user_mods(np)
    call = dict(causal=case.causal, softmax_scale=case.softmax_scale, block_mask=mask,
                **variant, **case.dropout.keywords(), **user)
    # Underflow (exp of a very negative score) is ordinary; NaN, inf and division by zero
    # are not.
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, lse = cf.flash_attention(q, k, v, return_lse=True, **call)
        grads = cf.flash_attention_backward(dout, q, k, v, out, lse,
                                            deterministic=case.deterministic, **call)
    elem = case.element_mask(mask, np)
    variant.update(dropout=case.dropout_scale(np), score_mod=case.dense_score_mod(np))
    ref_out, ref_lse = attention_ref(q, k, v, case.scale, case.causal, elem, **variant)
    ref_grads = attention_ref_backward(dout, q, k, v, case.scale, case.causal, elem, **variant)
    # A score_mod with grad_arrays adds their gradients to the results; the reference gives
    # them (empty without grad_arrays) and the sizes of their terms.
    tables = grads[3] if len(grads) == 4 else {}
    grads = grads[:3]
    ref_tables, sizes = ref_grads[3:] if user["score_mod"] is not None else ({}, {})
    ref_grads = ref_grads[:3]
    assert set(tables) == set(ref_tables), \
        f"table gradients {sorted(tables)}, expected {sorted(ref_tables)}"
    for name, t in tables.items():
        assert type(t) is np.ndarray and t.dtype == np.float64, f"d {name}: {type(t)} {t.dtype}"
        assert t.shape == ref_tables[name].shape, f"d {name}: shape {t.shape}"

    assert type(out) is np.ndarray and out.shape == q.shape and out.dtype == q.dtype
    expected_lse = np.float64 if case.dtype == "fp64" else np.float32
    assert lse.shape == (case.batch, case.nheads, case.sq) and lse.dtype == expected_lse
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{name}: {g.shape} {g.dtype}"
    for name, a in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert not np.isnan(a.astype(np.float64)).any(), f"{name} has NaN"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse),
                                  err_msg="lse is -inf exactly on the rows without keys")
    assert_zero_where_unseen(case, elem, out, *grads)

    if case.dtype == "fp64":
        for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                  (ref_out, ref_lse, *ref_grads)):
            err = rel_err(got, ref)
            assert err < F64_REL, f"{name}: relative error {err:.2e} >= {F64_REL:.0e}"
        # A table entry is a sum of terms that may cancel: measured at their sizes' scale.
        for name, t in tables.items():
            err = float(np.abs(t - ref_tables[name]).max())
            top = max(float(sizes[name].max()), 1.0)
            assert err < F64_REL * top, f"d {name}: error {err:.2e}, terms up to {top:.2e}"
        return
    dtype = case.np_dtype
    naive_out, naive_lse = attention_naive(q, k, v, case.scale, case.causal, dtype, elem,
                                           **variant)
    assert_rule("out", out, ref_out, naive_out, FWD_FACTOR)
    assert_rule("lse", lse, ref_lse, naive_lse, FWD_FACTOR)
    naive_grads = attention_naive_backward(dout, q, k, v, case.scale, case.causal, dtype, elem,
                                           **variant)
    # One magnitude for the three gradients, as gpu_checks.check_backward does.
    magnitude = max(float(np.abs(r).max()) for r in ref_grads)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
        assert_rule(name, g, r, n, BWD_FACTOR, magnitude)
    for name, t in tables.items():
        assert_rule(f"d {name}", t, ref_tables[name], naive_grads[3][name], BWD_FACTOR,
                    float(sizes[name].max()))


def _checked(case, family, check=check_case):
    try:
        check(case)
    except AssertionError as e:
        raise AssertionError(f"{e}\n  {case!r}") from e
    COUNTS.passed(family)


@settings(FUZZ_PROFILE, max_examples=DENSE_EXAMPLES)
@given(cases(dtype=CPU_DTYPES, shape=shapes(**CPU_SHAPES), window=maybe_windows,
             softcap=softcaps(), alibi=alibis(), dropout=dropouts(), layout=layouts,
             mods=user_mods))
def test_numpy_path_dense_matches_reference(case):
    _checked(case, "dense")


@settings(FUZZ_PROFILE, max_examples=SPARSE_EXAMPLES)
@given(cases(dtype=CPU_DTYPES, shape=shapes(**CPU_SHAPES), softcap=softcaps(),
             alibi=alibis(), dropout=dropouts(), layout=layouts, mask=block_masks,
             mods=user_mods))
def test_numpy_path_block_sparse_matches_reference(case):
    _checked(case, "block_sparse")


# Every case with mods: the variants they refuse are left out, block masks with a score_mod
# alone are drawn by the family above.
@settings(FUZZ_PROFILE, max_examples=MODS_EXAMPLES)
@given(cases(dtype=CPU_DTYPES, shape=shapes(**CPU_SHAPES), dropout=dropouts(), layout=layouts,
             mods=lambda score, mask: user_mods(score, mask, one_in=1)))
def test_numpy_path_user_mods_match_reference(case):
    _checked(case, "user_mods")


def check_packed(case):
    """A packed call and its backward (float64, NumPy path) against the reference on each
    sequence alone: within F64_REL; a sequence without keys gives out 0, lse -inf, dq 0, one
    without queries dk = dv = 0."""
    q, k, v, dout = case.inputs(np)
    cq, ck = case.offsets()
    kw = case.keywords()
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        out, lse = cf.flash_attention_varlen(q, k, v, cq, ck, return_lse=True, **kw)
        dq, dk, dv = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cq, ck, **kw)
    assert out.shape == q.shape and lse.shape == (case.nheads, q.shape[0])
    scale = case.d ** -0.5
    for b in range(len(case.lens_q)):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rq.start == rq.stop:
            assert not dk[rk].any() and not dv[rk].any(), f"sequence {b}: keys without queries got gradients"
            continue
        if rk.start == rk.stop:
            assert not out[rq].any() and np.isneginf(lse[:, rq]).all() and not dq[rq].any(), \
                f"sequence {b}: rows without keys"
            continue
        one = (q[None, rq], k[None, rk], v[None, rk])
        ref_out, ref_lse = attention_ref(*one, scale, case.causal, **case.variant())
        ref_grads = attention_ref_backward(dout[None, rq], *one, scale, case.causal, **case.variant())
        got = (out[None, rq], lse[None, :, rq], dq[None, rq], dk[None, rk], dv[None, rk])
        np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(ref_lse),
                                      err_msg=f"sequence {b}: lse -inf exactly on rows without keys")
        for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, (ref_out, ref_lse, *ref_grads)):
            assert not np.isnan(g).any(), f"sequence {b}: {name} has NaN"
            err = rel_err(g, r)
            assert err < F64_REL, f"sequence {b}: {name} relative error {err:.2e}"


def check_cache(case):
    """An append and attention over a KV cache (float64, NumPy path): the new keys land at
    each entry's length, no other cache row changes, and each entry's out and lse are the
    reference's over its first seqlens[b] + new keys."""
    q, k_cache, v_cache, k, v, table = case.inputs(np)
    before = k_cache.copy(), v_cache.copy()
    seqlens = np.asarray(case.seqlens, np.int32)
    out, lse = cf.flash_attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                               block_table=table, return_lse=True, **case.keywords())
    rows = []   # (cache index of each row of entry b's keys), as (slot, row) pairs
    for b in range(case.batch):
        n = int(seqlens[b]) + case.new
        j = np.arange(n)
        if table is None:
            at = (np.full(n, b), j)
        else:
            at = (table[b, j // case.page_size], j % case.page_size)
        rows.append(at)
        if case.new:
            new = slice(int(seqlens[b]), n)
            assert np.array_equal(k_cache[at[0][new], at[1][new]], k[b]), f"entry {b}: appended keys"
            assert np.array_equal(v_cache[at[0][new], at[1][new]], v[b]), f"entry {b}: appended values"
        if n == 0:
            assert not out[b].any() and np.isneginf(lse[b]).all(), f"entry {b}: no keys"
            continue
        ref_out, ref_lse = attention_ref(q[b:b + 1], k_cache[at][None], v_cache[at][None], case.d ** -0.5,
                                         case.causal, **case.variant())
        np.testing.assert_array_equal(np.isneginf(lse[b:b + 1]), np.isneginf(ref_lse),
                                      err_msg=f"entry {b}: lse -inf exactly on rows without keys")
        for name, g, r in (("out", out[b:b + 1], ref_out), ("lse", lse[b:b + 1], ref_lse)):
            assert not np.isnan(g).any(), f"entry {b}: {name} has NaN"
            err = rel_err(g, r)
            assert err < F64_REL, f"entry {b}: {name} relative error {err:.2e}"
    untouched = np.ones(k_cache.shape[:2], bool)
    for b, at in enumerate(rows):
        untouched[at[0][int(seqlens[b]):], at[1][int(seqlens[b]):]] = False
    for name, now, was in (("k_cache", k_cache, before[0]), ("v_cache", v_cache, before[1])):
        assert np.array_equal(now[untouched], was[untouched]), f"{name}: a row outside the appends changed"


@settings(FUZZ_PROFILE, max_examples=PACKED_EXAMPLES)
@given(packed_cases())
def test_numpy_path_packed_batches_match_reference(case):
    _checked(case, "packed", check_packed)


@settings(FUZZ_PROFILE, max_examples=CACHE_EXAMPLES)
@given(cache_cases())
def test_numpy_path_kv_caches_match_reference(case):
    _checked(case, "kv_cache", check_cache)
