"""Property-based fuzzing of the GPU kernels against the float64 reference on the GPU.

One hypothesis test per kernel family, each with its own number of examples (``EXAMPLES``):

=====================  ========  ====================================================
family                 examples  what runs
=====================  ========  ====================================================
fwd_half               500       fp16/bf16 tensor-core forward, dense; variants
                                 (window, softcap, ALiBi, dropout), user mods
bwd_atomic             450       fp16/bf16 forward + backward, dQ added up by atomics;
                                 variants, user mods
bwd_deterministic      300       fp16/bf16 forward + deterministic backward, run twice:
                                 the two dq, dk, dv must be bit-identical; variants,
                                 user mods
sparse                 450       fp16/bf16 block-sparse forward + backward (either dQ);
                                 softcap, ALiBi, dropout
plain                  300       fp32/fp64 kernels, dense or block-sparse, fwd + bwd;
                                 variants (a window only dense), user mods
packed                 150       fp16/bf16 packed batches (flash_attention_varlen), fwd
                                 + bwd; causal, a window or softcap
kv_cache               150       fp16/bf16 KV caches (flash_attention_with_kvcache):
                                 appends, contiguous and paged, decoding and chunked
                                 prefill; causal, a window or softcap
=====================  ========  ====================================================

2,300 examples in all; ``CUPYFLASH_FUZZ_EXAMPLES=N`` runs N in all, in the same shares. At
the end pytest prints "fuzz examples run per family (GPU): ..." with the counts of examples
that ran and passed.

Cases (tests/strategies.py): batch, seqlen_q and seqlen_k 1..2048 (tile edges 63/64/65,
127/128/129, ..., 1023/1024/1025, unequal both ways), GQA/MQA, head dims 1..256, causal,
packed and padded strided layouts (aligned and unaligned rows), an explicit softmax_scale, for
the block-sparse families masks of every builder (block sizes 64/128 per side, shared or per
head, with or without the mask's own causal).

Variants (``VARIANTS``, ``variant_cases``): each example draws one set of the built-in
features ``window_size`` (either side unbounded, 0..8 or anything up to seqlen_q + seqlen_k),
``softcap`` (0.1..50), ALiBi (float32 slopes in [1/256, 1], per head or per (batch, head)) and
dropout (p from 1e-3 to 0.95, any seed and offset), by weight. Drawn on the CPU from four
seeds, a third to a half of each family's examples had none, each feature came up in 11-30% of
them (mostly about a fifth), and 60-90% of the examples with any had one alone. Only what the
GPU runs: no dropout with softcap, ALiBi or a score_mod (NotImplementedError), no window with a
block mask or a mask_mod (ValueError); the sparse family draws no window, and in plain an
example with a window has no block mask. Where fp16/bf16 gradients are checked, dropout leaves
out shapes and windows whose rows would see one key only (``variant_cases`` says why). These
kernels are compiled beforehand by ``python -m cupyflash warmup``.

User mods, in the families that say so, in about one example in ``MODS_ONE_IN``: from
strategies.py's library (score_mods: a T5-style bucketed relative bias with its table's
gradient, ALiBi spelled as a score_mod, a learned tanh cap per head with its gradient;
mask_mods: documents, prefix-LM, a local window per head; alone or a pair; a score_mod only
without softcap, ALiBi and dropout, a mask_mod only where there is no block mask or window).
The sizes stay under a budget (``GPU_SHAPES``). Measured on an H200 with our kernels compiled
beforehand (``python -m cupyflash warmup``, or in parallel), CuPy's own kernels for the
reference not: 179 s for the 2,000 examples, 92 s of it in the first family (which also
compiles those CuPy kernels); that was before user mods and variants. The mods' kernels cannot
be compiled beforehand (one set per snippet pair): drawn on the CPU from six seeds, 60-110
examples of a run had user mods (before variants, which now take some of the examples that
allowed a score_mod), which needed 45-80 kernels (pair x dtype x head-dim bucket x band x pass;
more where a tile spills and the next is tried), 0.3-2.5 s of NVRTC each on the 2-core
development machine (sm_90). The reference's dropout keep-mask is generated on the host
(``cupyflash.dropout_mask``): about 0.1 s for 8M scores on that machine.

Checks (tests/gpu_checks.py, unchanged tolerances): fp16/bf16 within 2x (out) and 3x (dq, dk,
dv) the error of a naive same-dtype implementation against the float64 reference; fp32 and
fp64 to their own precision; lse against the float64 lse, -inf exactly on rows without keys;
no NaN anywhere, every element compared. Besides: out and dq exactly 0 on rows that see no
key, dk and dv exactly 0 on keys no query sees. The outputs cannot be poisoned through the
public API (it allocates them), so an element the kernels never write shows only as a wrong
value or a NaN. The reference and the naive implementation apply the case's variant
(``check_forward`` / ``check_backward`` take tests/reference.py's keywords): the window, cap
and slopes as given, dropout as the public keep-mask (``Case.dropout_scale``), a mask_mod as
an element mask and a score_mod in its dense spelling. Where ALiBi or a score_mod moves the
scores far from 0, the fp32 and fp64 bounds widen to 4 roundings of the largest |lse|
(``gpu_checks.tight_rtol``), and where a result's terms cancel they add 4 roundings of the sums
of the terms' absolute values (``gpu_checks.assert_tight``). The gradients of a score_mod's arrays (float32, float64 for
fp64): their error against the float64 reference given the out the kernels were handed within
3x a naive implementation's error, plus 1e-6 of the sizes of their terms
(``gpu_checks.assert_table_rule`` says why).

The fp16/bf16 rule compares largest errors, which says something only over enough rows: with
a handful, the naive implementation can land near the exact answer by luck. And the backward
computes D = rowsum(dout * out) from out as the forward returned it, rounded to fp16/bf16 (as
FlashAttention does): at head dims below ~8 that one rounding can outweigh all of the naive
implementation's error in dq. So the fp16/bf16 families draw at least HALF_*_MIN_ROWS query
and key rows, and head dims from HALF_BWD_MIN_HEADDIM where gradients are checked (numbers
below); the forward-only family and fp32/fp64 draw head dims down to 1.

Reproducing a failure. Each run draws its examples from a fresh seed, printed in the summary
line: ``CUPYFLASH_FUZZ_SEED=N`` draws the same examples again. The report prints the
falsifying ``Case(...)``, whose ``seed`` fixes the inputs (and ``mask.seed`` the mask), and a
``@reproduce_failure`` line. To re-run one case alone, from the repository root::

    PYTHONPATH=.:tests python3 -c "from strategies import *; import test_fuzz_gpu as t; \
t.check_case(Case(...))"

(``t.check_forward_case`` for a failure of ``fwd_half``; ``t.check_packed(("bf16",
PackedCase(...)))`` and ``t.check_cache(("bf16", CacheCase(...)))`` for the last two).

The packed and kv_cache families (strategies.py's ``packed_cases`` and ``cache_cases``, the
NumPy fuzz's cases at least HALF_BWD_MIN_ROWS query and key rows, head dims from
HALF_BWD_MIN_HEADDIM, and HALF_FWD_MIN_ROWS query rows) check each call's rows against the
references of its sequences or entries stitched together: the rule runs over the whole call.
150 examples each ran in 43 s on an H200 (kernels partly in the carried cache).

Run the families side by side (``pytest -n 7 tests/test_fuzz_gpu.py``; pytest-xdist): the
workers share one seed and the summary adds up their counts (tests/conftest.py). On an H200
machine of 16 cores, with the kernels compiled as examples needed them (a partly filled cache),
all seven took 230-274 s, the longest family (bwd_atomic) 225-268 s; one after another they
did not finish within a 530 s device call.
"""
import functools
import os
import random

import numpy as np

import pytest

pytest.importorskip("hypothesis")
cp = pytest.importorskip("cupy")

from hypothesis import given, reject, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import cupyflash as cf  # noqa: E402

try:
    from gpu_checks import (BWD_FACTOR, DTYPES, FWD_FACTOR, assert_lse,  # noqa: E402
                            check_backward, check_forward)
    from reference import (assert_rule, attention_naive, attention_naive_backward,  # noqa: E402
                           attention_ref, attention_ref_backward)
    from strategies import (FUZZ_PROFILE, HALF, MASK_BLOCK_SIZES, PLAIN,  # noqa: E402
                            Dropout, ExampleCounts, alibis_on, assert_zero_where_unseen,
                            block_masks, cache_cases, cases, dropouts_on, layouts,
                            maybe_block_masks, no_mask, no_mods, no_window, packed_cases,
                            shapes, softcaps_on, user_mods, windows)
except ImportError:
    from tests.gpu_checks import (BWD_FACTOR, DTYPES, FWD_FACTOR, assert_lse,  # noqa: E402
                                  check_backward, check_forward)
    from tests.reference import (assert_rule, attention_naive,  # noqa: E402
                                 attention_naive_backward, attention_ref, attention_ref_backward)
    from tests.strategies import (FUZZ_PROFILE, HALF, MASK_BLOCK_SIZES,  # noqa: E402
                                  PLAIN, Dropout, ExampleCounts, alibis_on,
                                  assert_zero_where_unseen, block_masks, cache_cases, cases,
                                  dropouts_on, layouts, maybe_block_masks, no_mask, no_mods,
                                  no_window, packed_cases, shapes, softcaps_on, user_mods,
                                  windows)

pytestmark = pytest.mark.gpu

# Shares of the examples per family, in 46ths (see the table above).
SHARES = {"fwd_half": 10, "bwd_atomic": 9, "bwd_deterministic": 6, "sparse": 9, "plain": 6,
          "packed": 3, "kv_cache": 3}
TOTAL_EXAMPLES = int(os.environ.get("CUPYFLASH_FUZZ_EXAMPLES", "2300"))
EXAMPLES = {family: max(1, -(-TOTAL_EXAMPLES * share // sum(SHARES.values())))
            for family, share in SHARES.items()}
# A fresh seed per run, so that every run tries other cases; the summary line prints it and
# CUPYFLASH_FUZZ_SEED=N draws the same examples again.
_seed_text = os.environ.get("CUPYFLASH_FUZZ_SEED", "").strip()
FUZZ_SEED = int(_seed_text) if _seed_text else random.SystemRandom().randrange(2**32)

# Up to 8M scores per call (the float64 reference holds a few (batch, nheads, seqlen_q,
# seqlen_k) arrays of them) and 2**30 multiply-adds per matmul; up to 96 (batch x heads), so
# that seqlen 1 can still reach HALF_BWD_MIN_ROWS query rows.
GPU_SHAPES = dict(max_seqlen=2048, max_batch=3, max_kv_heads=4, max_group=8,
                  max_scores=2**23, max_work=2**30)
# Measured with the NumPy path (float64 inside; out rounded once to fp16/bf16), whose error is
# the floor of any kernel's, as a fraction of the gradient rule's bound. Over 3,000 random
# cases at head dims >= 16 by min(query rows, key rows): 11 of 846 failed below 8 rows, 1 of
# 706 at 8-15, worst 0.97 at 16-31, 0.71 at 32-63, 0.57 from 64 on. Over 1,200 cases of
# >= 64 rows by head dim: worst 0.92 at d=1, 0.86 at d=3, 0.59 up to d=8, 0.43 from d=12 on.
# The first GPU run (H200) failed one case at d=1 where the kernels' dq error was 1.12x the
# bound and the NumPy path's 1.01x. out stayed below 0.5x of its bound in every measurement.
HALF_FWD_MIN_ROWS = 32
HALF_BWD_MIN_ROWS = 64
HALF_BWD_MIN_HEADDIM = 16
# User mods in about one example in MODS_ONE_IN (CUPYFLASH_FUZZ_MODS_ONE_IN=N) of the families
# that draw them: each pair of snippets is compiled at first use for each dtype, head-dim
# bucket, band and pass it meets, 0.3-2.5 s of NVRTC per kernel (a 2-core machine, sm_90), so
# that a higher share mostly adds compile time. The documents and local windows of the
# fp16/bf16 families hold HALF_MIN_KEYS keys or more, so that not every row sees one key only:
# there dS = 0 exactly in the reference and in a naive implementation alike, while the
# kernels' dS = P (dP - D) is fp32 noise (dP and D = rowsum(dout * out) summed in different
# orders), and the rule would hold that noise to an error of 0. Built-in windows under which
# every row sees one key ((0, 0), or (0, any) with causal) showed it on the H200 (seed
# 2070014269: bf16 d=189 and fp16 d=208, dk off by 4.7e-6 and 4.2e-6 where the slack for
# gradients of size ~4 is 4.1e-6): the gradient families draw none (``variant_cases``). With
# dropout the same rows fail in earnest, and windows drawn with it keep HALF_MIN_KEYS too.
MODS_ONE_IN = int(os.environ.get("CUPYFLASH_FUZZ_MODS_ONE_IN", "16"))
HALF_MIN_KEYS = 8


# The built-in variants: each example draws one of these sets of features, by weight, so
# that about two in five examples draw none (the plain paths: hypothesis favours the first
# choice a little), each feature comes up in about a fifth, mostly alone. Dropout never comes
# with softcap or ALiBi (nor with a score_mod: ``variant_cases``), which the GPU refuses
# (NotImplementedError). A window comes without a block mask (ValueError), and without a
# mask_mod (``cases`` draws none there).
VARIANTS = {(): 6, ("window",): 3, ("softcap",): 3, ("alibi",): 3, ("dropout",): 5,
            ("window", "softcap"): 1, ("window", "alibi"): 1, ("softcap", "alibi"): 1,
            ("window", "dropout"): 1, ("window", "softcap", "alibi"): 1}


def half_mods(score, mask):
    return user_mods(score, mask, min_keys=HALF_MIN_KEYS, one_in=MODS_ONE_IN)


def plain_mods(score, mask):
    return user_mods(score, mask, one_in=MODS_ONE_IN)


@st.composite
def variant_cases(draw, *, shape, mods=no_mods, mask=no_mask, with_window=True,
                  half_grads=False, **fields):
    """A ``cases(...)`` of ``shape`` with one of ``VARIANTS``: those with a window only where
    ``with_window`` (they draw no block mask, the others ``mask``), a score_mod from ``mods``
    only without dropout.

    ``half_grads``: the family checks fp16/bf16 gradients. test_dropout.py leaves out
    fp16/bf16 dropout at seqlen_k = 1: every row sees one key, so dS = P (keep dP / (1 - p)
    - D) is exactly 0, in the naive reference too (D = rowsum(P dP)), while the kernels take
    D = rowsum(dout * out) from out rounded to fp16/bf16 (FlashAttention's D; out = v / (1 -
    p) is not a fp16/bf16 value), which leaves dq, dk at the output's rounding where the rule
    allows ~0. The same holds wherever rows that see one key come without rows that see a
    few (whose naive error is of that size): measured with the NumPy path on the CPU, whose
    backward takes D from the rounded out too, a block mask whose last key block holds one
    key (seqlen_k = 64 n + 1) and is all that some query blocks keep failed the rule by 1.2x
    to 2,200x, and a window (0, 0) failed it as seqlen_k = 1 does. So with dropout: no seqlen_k
    of one key per block (seqlen_k = 1 does not come up with these families' min_rows and
    GPU_SHAPES, 64 n + 1 where block masks are drawn), and a window bounds each side at
    HALF_MIN_KEYS keys or more, or not at all (rows at the ends of the band that see fewer
    come with rows that see 2, 3, ... keys, as under causal). Without dropout these
    families draw no window under which every row sees one key (the comment at
    HALF_MIN_KEYS)."""
    s = draw(shape)
    # The last key block holds one key: the whole sequence's, or a block mask's.
    one_key = s.sk == 1 or (mask is not no_mask and
                            any(s.sk % size == 1 for size in MASK_BLOCK_SIZES))
    choices = [features for features, weight in VARIANTS.items() for _ in range(weight)
               if (with_window or "window" not in features)
               and not (half_grads and "dropout" in features and one_key)]
    features = draw(st.sampled_from(choices))
    dropout = "dropout" in features
    min_side = HALF_MIN_KEYS if half_grads and dropout else 0
    case = draw(cases(
        shape=st.just(s),
        window=functools.partial(windows, min_side=min_side) if "window" in features
        else no_window,
        softcap=softcaps_on() if "softcap" in features else st.just(0.0),
        alibi=alibis_on() if "alibi" in features else st.just(None),
        dropout=dropouts_on() if dropout else st.just(Dropout()),
        mask=no_mask if "window" in features else mask,
        mods=(lambda score, mask: mods(False, mask)) if dropout else mods,
        **fields))
    left, right = case.window_size
    if half_grads and left == 0 and (right == 0 or case.causal):
        reject()
    return case


COUNTS = ExampleCounts("fuzz examples run per family (GPU)")


@pytest.fixture(autouse=True, scope="module")
def _report_counts(request):
    COUNTS.register(request.config, note=f"seed {FUZZ_SEED} (CUPYFLASH_FUZZ_SEED={FUZZ_SEED} "
                                         f"draws these examples again)")


def fuzz(family):
    """The family's settings: its number of examples, drawn from FUZZ_SEED."""
    def wrap(test):
        test = settings(FUZZ_PROFILE, max_examples=EXAMPLES[family], derandomize=False)(test)
        return seed(FUZZ_SEED)(test)
    return wrap


def _forward(case):
    """Runs and checks the forward of ``case``; returns what the backward needs: the inputs,
    the call's keywords, the element mask, the reference's variant keywords, (out, lse)."""
    q, k, v, dout = case.inputs(cp)
    mask = case.block_mask()
    elem = case.element_mask(mask, cp)
    variant = case.variant(cp)
    call = dict(causal=case.causal, softmax_scale=case.softmax_scale, block_mask=mask,
                **variant, **case.dropout.keywords(), **case.user_mods(cp))
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **call)
    # The reference applies dropout with the public keep-mask, a score_mod in its dense
    # spelling (a mask_mod is in elem).
    ref = dict(variant, dropout=case.dropout_scale(cp), score_mod=case.dense_score_mod(cp))
    check_forward(case, q, k, v, out, lse, case.scale, elem, **ref)
    assert_zero_where_unseen(case, elem, out)
    return (q, k, v, dout), call, elem, ref, (out, lse)


def check_forward_case(case):
    """The forward of ``case`` against the reference."""
    _forward(case)


def check_case(case):
    """Forward and backward of ``case`` against the reference; with ``case.deterministic``
    the backward runs twice and must give the same bits."""
    (q, k, v, dout), call, elem, ref, (out, lse) = _forward(case)

    def backward():
        return cf.flash_attention_backward(dout, q, k, v, out, lse,
                                           deterministic=case.deterministic, **call)

    grads = backward()
    check_backward(case, dout, q, k, v, grads, case.scale, elem, out=out, lse=lse, **ref)
    assert_zero_where_unseen(case, elem, out, *grads[:3])
    if case.deterministic:
        # dq, dk and dv; a table's gradient is added up by atomics in either backward.
        for name, a, b in zip(("dq", "dk", "dv"), grads, backward()):
            bits = f"u{a.itemsize}"
            assert bool((a.view(bits) == b.view(bits)).all()), \
                f"{name} differs between two deterministic runs"


def _run(family, check, case):
    try:
        check(case)
    except AssertionError as e:
        raise AssertionError(f"{e}\n  {case!r}") from e
    COUNTS.passed(family)


@fuzz("fwd_half")
@given(variant_cases(dtype=st.sampled_from(HALF), layout=layouts, deterministic=st.just(False),
                     shape=shapes(**GPU_SHAPES, min_rows=HALF_FWD_MIN_ROWS), mods=half_mods))
def test_fwd_half_dense(case):
    _run("fwd_half", check_forward_case, case)


@fuzz("bwd_atomic")
@given(variant_cases(dtype=st.sampled_from(HALF), layout=layouts, deterministic=st.just(False),
                     shape=shapes(**GPU_SHAPES, min_rows=HALF_BWD_MIN_ROWS,
                                  min_headdim=HALF_BWD_MIN_HEADDIM),
                     mods=half_mods, half_grads=True))
def test_bwd_half_atomic_dq(case):
    _run("bwd_atomic", check_case, case)


@fuzz("bwd_deterministic")
@given(variant_cases(dtype=st.sampled_from(HALF), layout=layouts, deterministic=st.just(True),
                     shape=shapes(**GPU_SHAPES, min_rows=HALF_BWD_MIN_ROWS,
                                  min_headdim=HALF_BWD_MIN_HEADDIM),
                     mods=half_mods, half_grads=True))
def test_bwd_half_deterministic(case):
    _run("bwd_deterministic", check_case, case)


@fuzz("sparse")
@given(variant_cases(dtype=st.sampled_from(HALF), layout=layouts, mask=block_masks,
                     with_window=False,
                     shape=shapes(**GPU_SHAPES, min_rows=HALF_BWD_MIN_ROWS,
                                  min_headdim=HALF_BWD_MIN_HEADDIM),
                     half_grads=True))
def test_block_sparse_half(case):
    _run("sparse", check_case, case)


@fuzz("plain")
@given(variant_cases(dtype=st.sampled_from(PLAIN), layout=layouts, mask=maybe_block_masks,
                     shape=shapes(**GPU_SHAPES), mods=plain_mods))
def test_plain_fp32_fp64(case):
    _run("plain", check_case, case)


# --- packed batches and KV caches --------------------------------------------------------------
# The fp16/bf16 rule compares largest errors over a whole call, so the references of the
# sequences (entries) are stitched into the call's layout and the rule runs once over all of
# its rows: a short sequence alone would be a handful of rows (see the note above).

def check_packed(args):
    """flash_attention_varlen and its backward in fp16/bf16 against the float64 reference of
    each sequence, stitched: out within FWD_FACTOR and dq, dk, dv within BWD_FACTOR of a naive
    same-dtype implementation's error over the whole call; lse -inf exactly on the rows of
    sequences without keys; out, lse of those and dk, dv of keys without queries exactly 0."""
    dtype_name, case = args
    dtype = DTYPES[dtype_name]
    q, k, v, dout = (x.astype(dtype) for x in case.inputs(cp))
    cq, ck = case.offsets()
    offsets = cp.asarray(cq), cp.asarray(ck)
    kw = case.keywords()
    out, lse = cf.flash_attention_varlen(q, k, v, *offsets, return_lse=True, **kw)
    grads = cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, *offsets, **kw)
    scale = case.d ** -0.5
    refs = {n: cp.zeros(x.shape, cp.float64) for n, x in (("out", q), ("dq", q), ("dk", k), ("dv", k))}
    naives = {n: cp.zeros_like(r) for n, r in refs.items()}
    ref_lse = cp.full(lse.shape, -cp.inf)
    for b in range(len(case.lens_q)):
        rq, rk = slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))
        if rk.start == rk.stop:   # the references' zeros and -inf, exactly
            assert not bool(out[rq].astype(cp.float32).any()), f"sequence {b}: rows without keys"
        if rq.start == rq.stop:
            assert not bool(grads[1][rk].astype(cp.float32).any() or grads[2][rk].astype(cp.float32).any()), \
                f"sequence {b}: keys without queries got gradients"
        if rq.start == rq.stop or rk.start == rk.stop:
            continue
        one = (q[None, rq], k[None, rk], v[None, rk])
        o, l = attention_ref(*one, scale, case.causal, **case.variant())
        refs["out"][rq], ref_lse[:, rq] = o[0], l[0]
        naives["out"][rq] = attention_naive(*one, scale, case.causal, dtype, **case.variant())[0][0]
        for name, r, n in zip(("dq", "dk", "dv"),
                              attention_ref_backward(dout[None, rq], *one, scale, case.causal, **case.variant()),
                              attention_naive_backward(dout[None, rq], *one, scale, case.causal, dtype,
                                                       **case.variant())):
            at = rq if name == "dq" else rk
            refs[name][at], naives[name][at] = r[0], n[0]
    assert_rule("out", out, refs["out"], naives["out"], FWD_FACTOR)
    assert_lse(lse, ref_lse, dtype_name)
    magnitude = max(float(cp.abs(refs[n]).max()) for n in ("dq", "dk", "dv"))
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert_rule(name, g, refs[name], naives[name], BWD_FACTOR, magnitude)


def check_cache(args):
    """flash_attention_with_kvcache in fp16/bf16: the new keys land at each entry's length
    bit for bit and no other cache row changes; out within FWD_FACTOR of a naive same-dtype
    implementation's error over the whole call against each entry's float64 reference over its
    keys, stitched; lse -inf exactly on rows without keys."""
    dtype_name, case = args
    dtype = DTYPES[dtype_name]
    q, k_cache, v_cache, k, v, table = case.inputs(cp)
    q, k_cache, v_cache = (x.astype(dtype) for x in (q, k_cache, v_cache))
    k, v = (None if x is None else x.astype(dtype) for x in (k, v))
    before = k_cache.copy(), v_cache.copy()
    seqlens = np.asarray(case.seqlens, np.int32)
    out, lse = cf.flash_attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cp.asarray(seqlens),
                                               block_table=table, return_lse=True, **case.keywords())
    host_table = None if table is None else cp.asnumpy(table)
    ref_out, naive_out = cp.zeros(q.shape, cp.float64), cp.zeros(q.shape, cp.float64)
    ref_lse = cp.full(lse.shape, -cp.inf)
    untouched = np.ones(k_cache.shape[:2], bool)
    for b in range(case.batch):
        n = int(seqlens[b]) + case.new
        j = np.arange(n)
        at = (np.full(n, b), j) if host_table is None else (host_table[b, j // case.page_size], j % case.page_size)
        at = tuple(cp.asarray(x) for x in at)
        untouched[tuple(cp.asnumpy(x)[int(seqlens[b]):] for x in at)] = False
        if case.new:
            new = slice(int(seqlens[b]), n)
            for name, cache, x in (("k", k_cache, k), ("v", v_cache, v)):
                assert bool((cache[at[0][new], at[1][new]].view(cp.uint16) == x[b].view(cp.uint16)).all()), \
                    f"entry {b}: appended {name}"
        if n == 0:
            continue
        one = (q[b:b + 1], k_cache[at][None], v_cache[at][None])
        o, l = attention_ref(*one, case.d ** -0.5, case.causal, **case.variant())
        ref_out[b], ref_lse[b] = o[0], l[0]
        naive_out[b] = attention_naive(*one, case.d ** -0.5, case.causal, dtype, **case.variant())[0][0]
    assert_rule("out", out, ref_out, naive_out, FWD_FACTOR)
    assert_lse(lse, ref_lse, dtype_name)
    mask = cp.asarray(untouched)
    for name, now, was in (("k_cache", k_cache, before[0]), ("v_cache", v_cache, before[1])):
        assert bool((now[mask].view(cp.uint16) == was[mask].view(cp.uint16)).all()), \
            f"{name}: a row outside the appends changed"


@fuzz("packed")
@given(st.tuples(st.sampled_from(HALF), packed_cases(min_rows=HALF_BWD_MIN_ROWS, min_headdim=HALF_BWD_MIN_HEADDIM)))
def test_packed_half(args):
    _run("packed", check_packed, args)


@fuzz("kv_cache")
@given(st.tuples(st.sampled_from(HALF), cache_cases(min_rows=HALF_FWD_MIN_ROWS)))
def test_kv_cache_half(args):
    _run("kv_cache", check_cache, args)
