"""Local attention (``window_size``), ``softcap`` and ALiBi (``alibi_slopes``), alone and
combined with each other, ``causal``, GQA/MQA, odd shapes and strided inputs.

One table of cases (``CASES``, each a ``Variant``) and one check (``check_case(xp, case)``:
forward and backward through the public API against tests/reference.py's float64 attention,
which spells the three features on its own). The check takes the array module, so that the
same table runs on CuPy by adding a test parametrized over the table with the ``gpu`` marker
(skipped where CuPy sees no GPU, tests/conftest.py); here it runs on the NumPy path. Tolerances:
float64 within 1e-12 of max(max|ref|, 1) (as tests/test_numpy_path.py), other dtypes
FlashAttention's rule against a naive implementation in that dtype (2x forward, 3x gradients).

Then the semantics one by one (windows of width 0, causal folded into the window, rows that see
no key, the bias as documented, the cap's bound), gradients against central finite differences
of the NumPy forward, and the adapters where PyTorch or JAX is installed.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _numpy_backend
from reference import (assert_gradients_match_finite_differences, assert_rule, attention_naive,
                       attention_naive_backward, attention_ref, attention_ref_backward,
                       np_dtype, random_array, rel_err)

F64_REL = 1e-12
FWD_FACTOR, BWD_FACTOR = 2, 3


@dataclass(frozen=True)
class Variant:
    """One call: sizes, the variant keywords and how the inputs sit in memory.

    ``alibi``: None, ``"heads"`` (slopes of shape (nheads,)) or ``"batch"`` ((batch,
    nheads)). ``strided``: q and dout are head-major buffers seen transposed, k and v slices
    of one packed (batch, seqlen_k, nheads_k, 2, headdim) buffer."""
    batch: int
    sq: int
    sk: int
    nheads: int
    nheads_k: int
    d: int
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None
    dtype: str = "float64"
    strided: bool = False
    seed: int = 0

    @property
    def id(self):
        parts = [self.dtype, f"b{self.batch}-q{self.sq}-k{self.sk}-h{self.nheads}"
                 f"k{self.nheads_k}-d{self.d}"]
        if self.causal:
            parts.append("causal")
        if self.window_size != (-1, -1):
            parts.append("window{}_{}".format(*self.window_size))
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        if self.alibi:
            parts.append(f"alibi-{self.alibi}")
        if self.strided:
            parts.append("strided")
        return "-".join(parts)

    @property
    def scale(self):
        return self.d ** -0.5

    def inputs(self, xp):
        """q, k, v, dout (standard normal, in ``dtype``) and the slopes (float32, positive,
        1/256..1 like ALiBi's geometric ones, or None), the same for the same case."""
        b, sq, sk, h, hk, d = self.batch, self.sq, self.sk, self.nheads, self.nheads_k, self.d
        dtype, seed = np_dtype(self.dtype), self.seed
        if self.strided:
            q = random_array(xp, (b, h, sq, d), dtype, seed).transpose(0, 2, 1, 3)
            kv = random_array(xp, (b, sk, hk, 2, d), dtype, seed + 1)
            k, v = kv[:, :, :, 0], kv[:, :, :, 1]
            dout = random_array(xp, (b, h, sq, d), dtype, seed + 3).transpose(0, 2, 1, 3)
        else:
            q = random_array(xp, (b, sq, h, d), dtype, seed)
            k = random_array(xp, (b, sk, hk, d), dtype, seed + 1)
            v = random_array(xp, (b, sk, hk, d), dtype, seed + 2)
            dout = random_array(xp, (b, sq, h, d), dtype, seed + 3)
        slopes = None
        if self.alibi is not None:
            shape = (h,) if self.alibi == "heads" else (b, h)
            host = 2.0 ** -np.random.default_rng(seed + 4).uniform(0, 8, shape)
            slopes = xp.asarray(host.astype(np.float32))
        return q, k, v, dout, slopes

    def keywords(self, slopes):
        """The variant's keywords of flash_attention and of the reference."""
        return dict(window_size=self.window_size, softcap=self.softcap, alibi_slopes=slopes)


def check_case(xp, case, f64_rel=F64_REL, deterministic=False, inputs=None):
    """Forward and backward of ``case`` on ``xp`` arrays through the public API, against the
    float64 reference: shapes and dtypes, lse -inf exactly where the reference has it, no NaN,
    and the tolerance of the module docstring (``f64_rel`` for float64). ``inputs``: (q, k, v,
    dout, slopes) to use instead of the case's random ones."""
    q, k, v, dout, slopes = case.inputs(xp) if inputs is None else inputs
    variant = case.keywords(slopes)
    out, lse = cf.flash_attention(q, k, v, causal=case.causal, return_lse=True, **variant)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                        deterministic=deterministic, **variant)
    ref_out, ref_lse = attention_ref(q, k, v, case.scale, case.causal, **variant)
    ref_grads = attention_ref_backward(dout, q, k, v, case.scale, case.causal, **variant)

    assert out.shape == q.shape and out.dtype == q.dtype
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
    for name, a in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert not bool(xp.isnan(a.astype(xp.float64)).any()), f"{name} has NaN"
    assert bool((xp.isneginf(lse) == xp.isneginf(ref_lse)).all()), \
        "lse is -inf exactly on the rows without keys"
    if case.dtype == "float64":
        for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                  (ref_out, ref_lse, *ref_grads)):
            err = rel_err(got, ref)
            assert err < f64_rel, f"{name}: relative error {err:.2e}"
        return
    naive_out, naive_lse = attention_naive(q, k, v, case.scale, case.causal, case.dtype,
                                           **variant)
    assert_rule("out", out, ref_out, naive_out, FWD_FACTOR)
    assert_rule("lse", lse, ref_lse, naive_lse, FWD_FACTOR)
    naive_grads = attention_naive_backward(dout, q, k, v, case.scale, case.causal, case.dtype,
                                           **variant)
    magnitude = max(float(xp.abs(r).max()) for r in ref_grads)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
        assert_rule(name, g, r, n, BWD_FACTOR, magnitude)


# ---------------------------------------------------------------------------------------------
# The table

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim): equal seqlens on tile multiples,
# seqlen_q > seqlen_k with GQA, seqlen_q < seqlen_k, MQA off tile multiples, one query, one key.
SHAPES = [(2, 128, 128, 2, 2, 64), (1, 150, 97, 4, 2, 40), (1, 97, 150, 6, 2, 96),
          (2, 65, 130, 3, 1, 40), (1, 1, 70, 2, 2, 16), (1, 70, 1, 2, 1, 16)]
# The variants, alone and combined (and none, the baseline); each runs with and without
# causal on every shape.
VARIANTS = [
    dict(),
    dict(window_size=(0, 0)),
    dict(window_size=(16, 16)),
    dict(window_size=(5, 0)),
    dict(window_size=(0, 70)),
    dict(window_size=(-1, 3)),
    dict(window_size=(40, -1)),
    dict(window_size=(1000, 1000)),
    dict(softcap=0.5),
    dict(softcap=30.0),
    dict(alibi="heads"),
    dict(alibi="batch"),
    dict(window_size=(20, 4), softcap=2.0),
    dict(window_size=(8, 8), alibi="heads"),
    dict(softcap=5.0, alibi="batch"),
    dict(window_size=(33, 0), softcap=1.0, alibi="heads"),
]
CASES = [Variant(*shape, causal=causal, seed=100 * n + 2 * i + causal, **variant)
         for n, shape in enumerate(SHAPES) for i, variant in enumerate(VARIANTS)
         for causal in (False, True)]
# Low precision (the rule) and strided views, on the shapes where tiles are cut.
CASES += [dataclasses.replace(case, dtype="float32", seed=case.seed + 50)
          for case in CASES if case.sq in (150, 97) and case.causal]
CASES += [dataclasses.replace(case, strided=True, seed=case.seed + 70)
          for case in CASES if case.sq == 65 and case.dtype == "float64"]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_variant_matches_reference_on_numpy(case):
    check_case(np, case)


# On the GPU: every row of the table in every dtype, and larger shapes whose windows cross
# many tiles (and skip whole tiles on both sides), with and without the score modifiers.
GPU_VARIANTS = [c for c in CASES if c.dtype == "float64"]
GPU_CASES = [dataclasses.replace(c, dtype=dtype) for c in GPU_VARIANTS
             for dtype in ("float16", "bfloat16", "float32", "float64")]
BIG_SHAPES = ((2, 1000, 777, 4, 2, 64), (1, 777, 1000, 2, 1, 128), (1, 1024, 1024, 2, 2, 96))
GPU_CASES += [Variant(*shape, causal=causal, window_size=window, dtype=dtype, seed=7)
              for shape in BIG_SHAPES
              for window in ((100, 50), (-1, 30), (200, -1), (0, 0), (300, 0))
              for causal in (False, True)
              for dtype in ("float16", "bfloat16")]
GPU_CASES += [Variant(*shape, causal=causal, dtype=dtype, seed=11, **mods)
              for shape in BIG_SHAPES
              for mods in (dict(softcap=30.0), dict(softcap=2.0, alibi="batch"),
                           dict(alibi="heads", window_size=(300, 0)))
              for causal in (False, True)
              for dtype in ("float16", "bfloat16")]
GPU_CASES += [dataclasses.replace(c, strided=True, seed=c.seed + 70)
              for c in GPU_CASES if c.sq == 1000 and not c.causal]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GPU_CASES])
def test_variant_matches_reference_on_gpu(case, deterministic):
    import cupy
    from gpu_checks import FP64_RTOL
    if deterministic and case.dtype not in ("float16", "bfloat16"):
        pytest.skip("the plain kernels have one backward")
    check_case(cupy, case, f64_rel=FP64_RTOL, deterministic=deterministic)


def saturating_inputs(xp, case):
    """q, k, v, dout for ``case`` (no slopes) whose scores reach far past +-softcap: every key
    is a positive multiple (0.5 to 4) of one direction u, every query a multiple f of u with f
    in [-12, 12] times softcap / scale, so that a row's scores all sit near -softcap, all near
    +softcap, or in between (plus noise of 0.1)."""
    rng = np.random.default_rng(case.seed)
    u = rng.standard_normal(case.d)
    u /= np.linalg.norm(u)
    along = lambda coef: coef[..., None] * u   # noqa: E731
    k = along(rng.uniform(0.5, 4.0, (case.batch, case.sk, case.nheads_k)))
    f = rng.uniform(-12.0, 12.0, (case.batch, case.sq, case.nheads)) * case.softcap / case.scale
    q = along(f)
    v = rng.standard_normal(k.shape)
    dout = rng.standard_normal(q.shape)
    arrays = [(a + 0.1 * rng.standard_normal(a.shape)).astype(np_dtype(case.dtype))
              for a in (q, k)] + [a.astype(np_dtype(case.dtype)) for a in (v, dout)]
    return (*(xp.asarray(a) for a in arrays), None)


# bf16 calls with softcap alone run the Hopper forward's softmax on a fixed base above head
# dim 128 where softcap * log2(e) <= 64 (cupyflash/_launch.py, BOUNDED_LOG2): p from 2^-64 to
# 2^64, O divided by the tensor cores' sum of the rounded p (rows of tied saturated scores
# among them). 44 is near that end, 50 past it (the running max), 0.05 the other end; fp16
# always keeps the running max, as head dims up to 128 do. The rows near -softcap have lse
# near -softcap: fp16 at 44 and 50 made dk and dv NaN when the Hopper backward gave the query
# rows past the end (a tile's tail) the last row's lse.
@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("softcap", [0.05, 44.0, 50.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_scores_at_both_ends_of_the_cap_on_gpu(dtype, softcap, causal, d):
    import cupy
    from gpu_checks import FP64_RTOL
    case = Variant(2, 200, 300, 4, 2, d, causal=causal, softcap=softcap, dtype=dtype, seed=31)
    check_case(cupy, case, f64_rel=FP64_RTOL, inputs=saturating_inputs(cupy, case))


@pytest.mark.parametrize("dtype,softcap,alibi,fixed", [
    ("bfloat16", 30.0, False, True), ("bfloat16", 44.3, False, True),
    ("bfloat16", 44.4, False, False), ("bfloat16", 30.0, True, False),
    ("bfloat16", 0.0, False, False), ("float16", 30.0, False, False),
    ("float16", 1.0, False, False)])
def test_which_calls_have_bounded_scores(dtype, softcap, alibi, fixed):
    from cupyflash import _launch, _spec
    q = np.zeros((1, 8, 2, 64), np_dtype(dtype))
    spec = _spec.CallSpec.of(q, causal=False, softcap=softcap,
                             alibi_slopes=np.ones(2, np.float32) if alibi else None)
    assert _launch.bounded_scores(spec) == fixed


def test_the_table_covers_every_combination():
    seen = {(c.causal, c.window_size != (-1, -1), bool(c.softcap), c.alibi is not None)
            for c in CASES}
    assert len(seen) == 16
    assert {c.dtype for c in CASES} == {"float64", "float32"} and any(c.strided for c in CASES)


# ---------------------------------------------------------------------------------------------
# Window semantics

def _run(q, k, v, **kw):
    # Underflow (exp of a very negative score) is ordinary; NaN, inf and division by zero
    # are not.
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        return cf.flash_attention(q, k, v, return_lse=True, **kw)


@pytest.mark.parametrize("sq,sk", [(90, 90), (40, 130), (130, 40)])
def test_window_0_0_each_query_sees_exactly_its_diagonal_key(sq, sk):
    q, k, v = (random_array(np, (1, s, 2, 16), np.float64, seed) for s, seed in
               ((sq, 1), (sk, 2), (sk, 3)))
    out, lse = _run(q, k, v, window_size=(0, 0))
    for i in range(sq):
        j = i + sk - sq
        if 0 <= j < sk:
            np.testing.assert_array_equal(out[0, i], v[0, j])      # weight exactly 1
            score = (q[0, i] * k[0, j]).sum(axis=-1) * 16 ** -0.5
            np.testing.assert_allclose(lse[0, :, i], score, rtol=1e-13, atol=1e-13)
        else:
            assert (out[0, i] == 0).all() and np.isneginf(lse[0, :, i]).all()


@pytest.mark.parametrize("left", [0, 3, 64, -1])
def test_causal_closes_the_window_on_the_right(left):
    """causal with (left, right) for any right is the window (left, 0)."""
    q, k, v = (random_array(np, (1, s, 2, 16), np.float64, seed) for s, seed in
               ((100, 4), (130, 5), (130, 6)))
    expected = _run(q, k, v, window_size=(left, 0))
    for right in (-1, 0, 7):
        got = _run(q, k, v, causal=True, window_size=(left, right))
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


def test_window_past_both_sequence_ends_is_no_window_bit_for_bit():
    q, k, v = (random_array(np, (2, s, 2, 24), np.float64, seed) for s, seed in
               ((75, 7), (140, 8), (140, 9)))
    plain = _run(q, k, v)
    wide = _run(q, k, v, window_size=(140 + 75, 140 + 75))
    for a, b in zip(wide, plain):
        np.testing.assert_array_equal(a, b)


def test_window_rows_without_keys_are_zero_and_lse_neg_inf():
    """seqlen_q = 100, seqlen_k = 20, window (2, 0): row i sees keys i - 82 .. i - 80, so
    rows 0..79 see none; their out and dq are 0, lse -inf, and nothing is NaN."""
    q, k, v = (random_array(np, (2, s, 2, 8), np.float64, seed) for s, seed in
               ((100, 10), (20, 11), (20, 12)))
    dout = random_array(np, q.shape, np.float64, 13)
    out, lse = _run(q, k, v, window_size=(2, 0))
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        dq, dk, dv = cf.flash_attention_backward(dout, q, k, v, out, lse, window_size=(2, 0))
    assert (out[:, :80] == 0).all() and np.isneginf(lse[:, :, :80]).all()
    assert np.isfinite(lse[:, :, 80:]).all() and (dq[:, :80] == 0).all()
    for a in (out, lse, dq, dk, dv):
        assert not np.isnan(a).any()


def test_window_visits_only_the_key_blocks_of_the_band(monkeypatch):
    """A (32, 32) window over 1024 keys: each 64-row query block visits at most 3 of the 16
    key blocks (the tiles the band crosses), not all of them."""
    visits = []
    real = _numpy_backend.key_blocks

    def spy(*args, **kw):
        visits.append(real(*args, **kw))
        return visits[-1]

    monkeypatch.setattr(_numpy_backend, "key_blocks", spy)
    q = random_array(np, (1, 1024, 1, 16), np.float64, 14)
    _run(q, q, q, window_size=(32, 32))
    assert len(visits) == 16 and max(len(v) for v in visits) == 3
    # The band is 65 keys wide, narrower than two blocks: an edge crosses every visited one.
    assert all(partial for v in visits for _, partial in v)


# ---------------------------------------------------------------------------------------------
# softcap and ALiBi semantics

def test_softcap_bounds_the_scores():
    """Scores in (-softcap, softcap): lse <= softcap + log(number of keys), even for scores
    that would be in the thousands without the cap."""
    q, k, v = (random_array(np, (1, 50, 2, 32), np.float64, seed) * 30 for seed in (15, 16, 17))
    _, lse = _run(q, k, v, softcap=3.0)
    assert (lse <= 3.0 + np.log(50)).all() and (lse >= -3.0 + np.log(50)).all()
    _, plain = _run(q, k, v)
    assert plain.max() > 100


def test_softcap_turns_infinite_scores_into_ordinary_ones():
    """tanh(+-inf) = +-1: a query with an infinite element gets scores of +-softcap, a finite
    row equal to the reference's, where without the cap it would be NaN."""
    q, k, v = (random_array(np, (1, 20, 2, 8), np.float64, seed) for seed in (18, 19, 20))
    q[0, 4, 1, 2] = np.inf
    out, lse = cf.flash_attention(q, k, v, softcap=2.0, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, 8 ** -0.5, False, softcap=2.0)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert rel_err(out, ref_out) < F64_REL and rel_err(lse, ref_lse) < F64_REL
    assert np.isnan(cf.flash_attention(q, k, v)[0, 4, 1]).all()


def test_alibi_adds_minus_slope_times_the_distance_from_the_diagonal():
    """With q = 0 every score is the bias alone: query i weighs key j by exp(-slope * |i + sk
    - sq - j|), computed here by hand."""
    sq, sk = 5, 9
    q = np.zeros((2, sq, 2, 4))
    k, v = (random_array(np, (2, sk, 1, 4), np.float64, seed) for seed in (21, 22))
    slopes = np.float32([[0.5, 0.25], [1.0, 0.125]])
    out, lse = cf.flash_attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    for b in range(2):
        for h in range(2):
            for i in range(sq):
                w = np.exp(-float(slopes[b, h]) * np.abs(i + sk - sq - np.arange(sk)))
                np.testing.assert_allclose(out[b, i, h], w @ v[b, :, 0] / w.sum(), rtol=1e-13)
                np.testing.assert_allclose(lse[b, h, i], np.log(w.sum()), rtol=1e-13)


def test_alibi_zero_slopes_and_shared_slopes():
    """Zero slopes are no bias, bit for bit; (nheads,) slopes equal the same slopes given per
    batch, bit for bit."""
    q, k, v = (random_array(np, (2, 70, 4, 16), np.float64, seed) for seed in (23, 24, 25))
    plain = _run(q, k, v, causal=True)
    zero = _run(q, k, v, causal=True, alibi_slopes=np.zeros(4, np.float32))
    slopes = np.float32([0.5, 0.25, 0.125, 0.0625])
    shared = _run(q, k, v, alibi_slopes=slopes)
    per_batch = _run(q, k, v, alibi_slopes=np.stack([slopes, slopes]))
    for a, b in zip(zero + shared, plain + per_batch):
        np.testing.assert_array_equal(a, b)


def test_nan_in_a_query_row_under_every_variant_changes_only_that_row():
    q, k, v = (random_array(np, (1, 90, 2, 16), np.float64, seed) for seed in (26, 27, 28))
    kw = dict(causal=True, window_size=(10, 0), softcap=4.0,
              alibi_slopes=np.float32([0.5, 0.25]))
    clean_out, clean_lse = _run(q, k, v, **kw)
    q[0, 50, 1, 3] = np.nan
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    assert np.isnan(out[0, 50, 1]).all() and np.isnan(lse[0, 1, 50])
    out[0, 50, 1], lse[0, 1, 50] = clean_out[0, 50, 1], clean_lse[0, 1, 50]
    np.testing.assert_array_equal(out, clean_out)
    np.testing.assert_array_equal(lse, clean_lse)


# ---------------------------------------------------------------------------------------------
# Gradients against finite differences of the forward

@pytest.mark.parametrize("kw", [
    dict(softcap=0.7),
    dict(softcap=3.0, causal=True),
    dict(alibi_slopes=np.float32([0.5, 0.2])),
    dict(window_size=(1, 2)),
    dict(softcap=1.5, window_size=(2, 1), alibi_slopes=np.float32([[0.3, 0.9]])),
    dict(softcap=1.5, window_size=(2, -1), alibi_slopes=np.float32([0.3, 0.9]), causal=True),
], ids=["softcap", "softcap-causal", "alibi", "window", "all-three", "all-three-causal"])
@pytest.mark.parametrize("sq,sk", [(4, 6), (6, 4)])
def test_gradients_match_finite_differences(sq, sk, kw):
    q, k, v = (random_array(np, shape, np.float64, seed) * 2 for shape, seed in
               (((1, sq, 2, 3), 30), ((1, sk, 1, 3), 31), ((1, sk, 1, 3), 32)))
    dout = random_array(np, q.shape, np.float64, seed=33)
    assert_gradients_match_finite_differences(q, k, v, dout, **kw)


# ---------------------------------------------------------------------------------------------
# The adapters take the keywords (CPU tensors run the NumPy path): the variants with ALiBi
# slopes (converted to the framework's arrays), dropout, and user mods.

SLOPES = np.float32([[0.5, 0.25, 0.125, 0.0625]])
TABLE = np.linspace(-1, 1, 4 * 80, dtype=np.float32).reshape(4, 80)
DOCS = np.repeat(np.arange(4, dtype=np.int32), 10)
ADAPTER_CASES = {
    "variants": (dict(causal=True, window_size=(6, 0), softcap=2.5), SLOPES),
    "dropout": (dict(causal=True, dropout_p=0.25, seed=77, offset=1), None),
    # A relative bias and a document mask (the NumPy arrays stay constants of the call).
    "user mods": (dict(causal=True, score_mod=cf.ScoreMod(
        python=lambda s, b, h, q, k, bias: s + bias[h, k - q + 40],
        python_grad=lambda s, ds, b, h, q, k, bias: ds, arrays={"bias": TABLE}),
        mask_mod=cf.MaskMod(python=lambda b, h, q, k, doc: doc[q + 10] == doc[k],
                            arrays={"doc": DOCS})), None),
}
adapter_cases = pytest.mark.parametrize("kw,slopes", list(ADAPTER_CASES.values()),
                                        ids=list(ADAPTER_CASES))


def _adapter_inputs(kw, slopes):
    """float32 NumPy inputs (JAX's default precision) and the NumPy path's results for them,
    which the adapters must give bit for bit."""
    q, k, v = (random_array(np, shape, np.float32, seed) for shape, seed in
               (((1, 30, 4, 8), 40), ((1, 40, 2, 8), 41), ((1, 40, 2, 8), 42)))
    dout = random_array(np, q.shape, np.float32, 43)
    out, lse = cf.flash_attention(q, k, v, return_lse=True, alibi_slopes=slopes, **kw)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, alibi_slopes=slopes, **kw)
    return (q, k, v, dout), (out, *grads)


@adapter_cases
def test_torch_adapter_forwards_the_variant_keywords(kw, slopes):
    torch = pytest.importorskip("torch")
    import cupyflash.torch as cft
    host, expected = _adapter_inputs(kw, slopes)
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in host[:3])
    slopes = None if slopes is None else torch.from_numpy(slopes)
    out = cft.flash_attention(q, k, v, alibi_slopes=slopes, **kw)
    out.backward(torch.from_numpy(host[3]))
    for got, want in zip((out.detach(), q.grad, k.grad, v.grad), expected):
        np.testing.assert_array_equal(got.numpy(), want)


@adapter_cases
def test_jax_adapter_forwards_the_variant_keywords(kw, slopes):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import cupyflash.jax as cfj
    host, expected = _adapter_inputs(kw, slopes)
    cpu = jax.devices("cpu")[0]
    q, k, v, dout = (jax.device_put(jnp.asarray(x), cpu) for x in host)
    slopes = None if slopes is None else jax.device_put(jnp.asarray(slopes), cpu)

    def loss(q, k, v):
        return jnp.sum(cfj.flash_attention(q, k, v, alibi_slopes=slopes, **kw) * dout)

    out = cfj.flash_attention(q, k, v, alibi_slopes=slopes, **kw)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for got, want in zip((out, *grads), expected):
        np.testing.assert_array_equal(np.asarray(got), want)
