"""Dropout (``dropout_p``, ``seed``, ``offset``) and its generator.

- The generator: cupyflash.dropout's NumPy Philox4x32-10 against Random123's published
  known-answer vectors; ``dropout_mask`` against the spec of its docstring written out element
  by element; keep rates; seeds and offsets. cuda/philox.cuh compiles through NVRTC for sm_80
  without local memory, and on a GPU gives the NumPy generator's words and masks bit for bit.
- The NumPy path, forward and backward, against tests/reference.py's float64 attention with
  the public keep-mask (odd shapes, seqlen_q != seqlen_k both ways, causal, GQA/MQA, the other
  variants and block masks), under the tolerance of tests/test_variants.py (float64 within
  1e-12 of max(max|ref|, 1), float32 FlashAttention's rule); gradients against finite
  differences; dropout_p = 0 is no dropout bit for bit.
- The same table on the GPU in every dtype, atomic and deterministic, and larger shapes:
  the kernels drop exactly the public mask's elements. Dropout with softcap or ALiBi refuses
  on the GPU with NotImplementedError before anything runs (no kernels yet).
"""
from dataclasses import dataclass, replace

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _compile, _launch
from cupyflash.dropout import philox4x32_10, threshold
from reference import (assert_gradients_match_finite_differences, assert_rule, attention_naive,
                       attention_naive_backward, attention_ref, attention_ref_backward,
                       dropout_scale, random_array, rel_err)

F64_REL = 1e-12
FWD_FACTOR, BWD_FACTOR = 2, 3

# Random123's kat_vectors for philox4x32_10: (counter, key, output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


# ---------------------------------------------------------------------------------------------
# The generator

@pytest.mark.parametrize("ctr,key,expected", KAT, ids=["zeros", "ones", "pi"])
def test_philox_matches_random123_known_answers(ctr, key, expected):
    assert tuple(int(w) for w in philox4x32_10(ctr, key)) == expected


def test_philox_is_elementwise_over_arrays():
    """Arrays of counters and keys give, element by element, the scalar calls' words."""
    ctrs = np.array([c for c, _, _ in KAT], np.uint32).T
    keys = np.array([k for _, k, _ in KAT], np.uint32).T
    words = np.stack(philox4x32_10(tuple(ctrs), tuple(keys)))
    assert words.dtype == np.uint32
    np.testing.assert_array_equal(words.T, np.array([e for _, _, e in KAT], np.uint32))


def _mask_by_the_spec(batch, nheads, sq, sk, p, seed, offset):
    """dropout_mask written from cupyflash.dropout's docstring, one element at a time."""
    key = (seed & 0xffffffff, seed >> 32)
    bound = min(max(round(p * 256), 1), 255)
    mask = np.empty((batch, nheads, sq, sk), bool)
    for b, h, i, j in np.ndindex(mask.shape):
        gi, gj = (i // 32) * 8 + i % 8, (j // 32) * 8 + j % 8
        word = int(philox4x32_10((gj, gi, b * nheads + h, offset), key)[(i // 8) % 4])
        mask[b, h, i, j] = (word >> (8 * ((j // 8) % 4))) & 0xff >= bound
    return mask


@pytest.mark.parametrize("sizes,p,seed,offset", [
    ((2, 3, 37, 21), 0.3, 12345, 0),
    ((1, 2, 16, 48), 0.5, 2**64 - 1, 2**32 - 1),
    ((1, 1, 70, 66), 0.1, 99, 0),
    ((1, 1, 9, 40), 0.9, 2**40 + 7, 3),
])
def test_dropout_mask_follows_the_spec_element_by_element(sizes, p, seed, offset):
    expected = _mask_by_the_spec(*sizes, p, seed, offset)
    np.testing.assert_array_equal(cf.dropout_mask(*sizes, p, seed, offset), expected)


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    keep = cf.dropout_mask(2, 4, 333, 1030, p, seed=7, offset=1)
    assert keep.shape == (2, 4, 333, 1030) and keep.dtype == bool
    assert abs(keep.mean() - (1 - p)) < 0.01
    # The rate p is used at (a multiple of 1/256): 2.7M draws put the mean within 0.002 of it.
    assert abs(keep.mean() - (1 - cf.dropout.effective_p(p))) < 0.002
    # No structure along rows or columns: each row's and column's rate is near 1 - p too.
    assert abs(keep.mean(axis=(0, 1, 2)) - (1 - p)).max() < 0.1
    assert abs(keep.mean(axis=(0, 1, 3)) - (1 - p)).max() < 0.1


def test_threshold_edges():
    assert threshold(0.0) == 0 and threshold(0.5) == 128 and threshold(0.1) == 26
    assert threshold(np.nextafter(1.0, 0.0)) == 255
    # Any p > 0 drops something: the smallest rate is 1/256, not 0.
    assert threshold(1e-9) == 1 and cf.dropout.effective_p(1e-9) == 1 / 256
    assert cf.dropout.effective_p(0.25) == 0.25 and cf.dropout.effective_p(0.1) == 26 / 256
    assert cf.dropout_mask(1, 2, 40, 50, 0.0, seed=3).all()


def test_same_seed_and_offset_reproduce_other_seeds_and_offsets_differ():
    args = (2, 2, 50, 70, 0.5)
    base = cf.dropout_mask(*args, seed=1, offset=0)
    np.testing.assert_array_equal(base, cf.dropout_mask(*args, seed=1, offset=0))
    for other in (dict(seed=2, offset=0), dict(seed=1, offset=1), dict(seed=1 + 2**32,
                                                                       offset=0)):
        # Independent masks agree on about half the elements at p = 0.5.
        assert abs((cf.dropout_mask(*args, **other) == base).mean() - 0.5) < 0.02, other
    # Heads and batch entries draw different bits, too.
    assert abs((base[0, 0] == base[0, 1]).mean() - 0.5) < 0.05
    assert abs((base[0, 0] == base[1, 0]).mean() - 0.5) < 0.05


def test_masks_of_longer_sequences_and_more_batch_extend_the_mask():
    """The bits of (b, h, i, j) depend on nheads, seed and offset, not on batch or the
    sequence lengths."""
    small = cf.dropout_mask(1, 3, 20, 33, 0.4, seed=9, offset=5)
    big = cf.dropout_mask(2, 3, 70, 41, 0.4, seed=9, offset=5)
    np.testing.assert_array_equal(big[:1, :, :20, :33], small)


def test_dropout_mask_of_large_sizes_is_cut_in_chunks_consistently(monkeypatch):
    """Chunks of whole heads and of 32-row bands give the same bits as one call."""
    whole = cf.dropout_mask(2, 3, 100, 90, 0.3, seed=4)
    from cupyflash import dropout
    for chunk in (100 * 90 * 2, 100 * 90, 16 * 90, 1):
        monkeypatch.setattr(dropout, "_CHUNK", chunk)
        np.testing.assert_array_equal(cf.dropout_mask(2, 3, 100, 90, 0.3, seed=4), whole)


# ---------------------------------------------------------------------------------------------
# cuda/philox.cuh: NVRTC on the CPU, the same bits on a GPU

KERNELS = r"""
extern "C" __global__ void philox_words(const unsigned* ctr, const unsigned* key, unsigned* out,
                                        int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const uint4 w = philox4x32_10(make_uint4(ctr[4 * t], ctr[4 * t + 1], ctr[4 * t + 2],
                                             ctr[4 * t + 3]),
                                  make_uint2(key[2 * t], key[2 * t + 1]));
    out[4 * t] = w.x; out[4 * t + 1] = w.y; out[4 * t + 2] = w.z; out[4 * t + 3] = w.w;
}

// The keep-mask as a kernel finds it: one thread per group of 16 elements, grid (groups
// of columns, groups of rows, b * nheads + h).
extern "C" __global__ void keep_mask(unsigned char* mask, int seqlen_q, int seqlen_k,
                                     unsigned long long seed, unsigned offset,
                                     unsigned threshold) {
    const unsigned gj = blockIdx.x * blockDim.x + threadIdx.x, gi = blockIdx.y, bh = blockIdx.z;
    const int i = (gi / 8) * 32 + gi % 8, j = (gj / 8) * 32 + gj % 8;
    if (i >= seqlen_q || j >= seqlen_k) return;
    const uint4 w = dropout_words(bh, dropout_group(i), dropout_group(j), offset, philox_key(seed));
    for (int a = 0; a < 4; ++a)
        for (int c = 0; c < 4; ++c)
            if (i + 8 * a < seqlen_q && j + 8 * c < seqlen_k)
                mask[(static_cast<long long>(bh) * seqlen_q + i + 8 * a) * seqlen_k + j + 8 * c] =
                    dropout_kept(w, a, c, threshold);
}
"""
SOURCE = (_compile.CUDA_DIR / "philox.cuh").read_text() + KERNELS


def test_philox_header_compiles_for_sm80_without_local_memory():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    log, _, _ = _compile.nvrtc_run(SOURCE, "philox_test.cu", (), "sm_80", _compile.ptxas_log_options())
    names = ("philox_words", "keep_mask")
    stats = _compile._parse_ptxas(log, {n: n for n in names})
    assert set(stats) == set(names), log
    assert not any(any(s[1:]) for s in stats.values()), f"local memory: {stats}"


@pytest.mark.gpu
def test_philox_header_gives_the_numpy_words_and_masks_on_the_gpu():
    import cupy
    module = cupy.RawModule(code=SOURCE, options=_compile.NVRTC_OPTIONS)
    rng = np.random.default_rng(0)
    ctr = np.concatenate([np.array([c for c, _, _ in KAT], np.uint32),
                          rng.integers(0, 2**32, (1000, 4), dtype=np.uint32)])
    key = np.concatenate([np.array([k for _, k, _ in KAT], np.uint32),
                          rng.integers(0, 2**32, (1000, 2), dtype=np.uint32)])
    out = cupy.zeros(ctr.shape, cupy.uint32)
    n = len(ctr)
    module.get_function("philox_words")(((n + 127) // 128,), (128,),
                                        (cupy.asarray(ctr), cupy.asarray(key), out, np.int32(n)))
    expected = np.stack(philox4x32_10(tuple(ctr.T), tuple(key.T)), axis=1)
    np.testing.assert_array_equal(out.get(), expected)

    for (b, h, sq, sk), p, seed, offset in (((2, 3, 77, 130), 0.3, 2**64 - 5, 11),
                                            ((1, 2, 16, 8), 0.9, 0, 2**32 - 1)):
        mask = cupy.full((b * h, sq, sk), 2, cupy.uint8)     # 2: an element left unwritten
        groups_i, groups_j = -(-sq // 32) * 8, -(-sk // 32) * 8
        module.get_function("keep_mask")(
            ((groups_j + 63) // 64, groups_i, b * h), (64,),
            (mask, np.int32(sq), np.int32(sk), np.uint64(seed), np.uint32(offset),
             np.uint32(threshold(p))))
        np.testing.assert_array_equal(mask.get().reshape(b, h, sq, sk),
                                      cf.dropout_mask(b, h, sq, sk, p, seed, offset))


@pytest.mark.gpu
def test_dropout_mask_returns_cupy_arrays_for_xp_cupy():
    import cupy
    keep = cf.dropout_mask(1, 2, 30, 40, 0.2, seed=1, xp=cupy)
    assert isinstance(keep, cupy.ndarray) and keep.dtype == bool
    np.testing.assert_array_equal(keep.get(), cf.dropout_mask(1, 2, 30, 40, 0.2, seed=1))


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(softcap=2.0), dict(alibi_slopes=np.float32([0.5, 0.25]))],
                         ids=["softcap", "alibi"])
def test_dropout_with_a_score_modifier_on_the_gpu_refuses_and_runs_nothing(monkeypatch, kw):
    import cupy
    q = cupy.asarray(random_array(np, (1, 40, 2, 16), np.float16, 1))
    kw = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    out, lse = cf.flash_attention(q, q, q, return_lse=True, **kw)
    ran = []
    monkeypatch.setattr(_launch, "_launch", lambda *a, **k: ran.append(a))
    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    with pytest.raises(NotImplementedError, match="dropout"):
        cf.flash_attention(q, q, q, dropout_p=0.1, seed=0, **kw)
    with pytest.raises(NotImplementedError, match="dropout"):
        cf.flash_attention_backward(out, q, q, q, out, lse, dropout_p=0.1, seed=0, **kw)
    assert not ran and pool.used_bytes() == used


# ---------------------------------------------------------------------------------------------
# The NumPy path against the reference

@dataclass(frozen=True)
class Case:
    batch: int
    sq: int
    sk: int
    nheads: int
    nheads_k: int
    d: int
    p: float = 0.2
    causal: bool = False
    dtype: str = "float64"
    variant: tuple = ()         # extra keywords as (name, value) pairs: window_size, softcap
    alibi: bool = False
    block: int = 0              # > 0: a random block mask of that block size
    seed: int = 0

    @property
    def id(self):
        parts = [self.dtype, f"b{self.batch}-q{self.sq}-k{self.sk}-h{self.nheads}"
                 f"k{self.nheads_k}-d{self.d}", f"p{self.p:g}"]
        parts += ["causal"] * self.causal + [f"{k}{v}" for k, v in self.variant]
        parts += ["alibi"] * self.alibi + [f"mask{self.block}"] * bool(self.block)
        return "-".join(str(x).replace(" ", "") for x in parts)

    def run(self, xp=np, deterministic=False):
        """Inputs, keywords of the call, its forward and backward on ``xp`` arrays (returned
        as NumPy arrays), and the reference's."""
        b, sq, sk, h, hk, d = self.batch, self.sq, self.sk, self.nheads, self.nheads_k, self.d
        s = self.seed
        q, dout = (random_array(np, (b, sq, h, d), self.dtype, s + i) for i in (0, 3))
        k, v = (random_array(np, (b, sk, hk, d), self.dtype, s + i) for i in (1, 2))
        variant = dict(self.variant)
        if self.alibi:
            variant["alibi_slopes"] = 2.0 ** -np.arange(1, h + 1, dtype=np.float32)
        mask = None
        if self.block:
            mask = cf.masks.random(sq, sk, 0.6, s, self.block, nheads=h)
        seed, offset = 1000 + s, 3 * s
        on = {n: xp.asarray(a) for n, a in dict(variant, q=q, k=k, v=v, dout=dout).items()
              if isinstance(a, np.ndarray)}
        call = dict(causal=self.causal, block_mask=mask, dropout_p=self.p, seed=seed,
                    offset=offset, **dict(variant, **{n: on[n] for n in variant if n in on}))
        out, lse = cf.flash_attention(on["q"], on["k"], on["v"], return_lse=True, **call)
        grads = cf.flash_attention_backward(on["dout"], on["q"], on["k"], on["v"], out, lse,
                                            deterministic=deterministic, **call)
        if xp is not np:
            out, lse, grads = xp.asnumpy(out), xp.asnumpy(lse), tuple(map(xp.asnumpy, grads))
        ref = dict(variant, dropout=dropout_scale(np, b, h, sq, sk, self.p, seed, offset))
        elem = None if mask is None else mask.to_dense()
        scale = d ** -0.5
        refs = (*attention_ref(q, k, v, scale, self.causal, elem, **ref),
                *attention_ref_backward(dout, q, k, v, scale, self.causal, elem, **ref))
        naive = None
        if self.dtype != "float64":
            naive = (*attention_naive(q, k, v, scale, self.causal, self.dtype, elem, **ref),
                     *attention_naive_backward(dout, q, k, v, scale, self.causal, self.dtype,
                                               elem, **ref))
        return (out, lse, *grads), refs, naive


NAMES = ("out", "lse", "dq", "dk", "dv")
# Tile edges cut (seqlen 17, 97, 150), seqlen_q != seqlen_k both ways, GQA and MQA, one query,
# one key, seqlens that are not multiples of the 16-row Philox groups.
SHAPES = [(2, 64, 64, 2, 2, 32), (1, 80, 80, 4, 1, 16), (1, 97, 150, 4, 2, 40),
          (1, 150, 97, 6, 2, 24), (2, 17, 33, 3, 1, 16), (1, 1, 70, 2, 2, 8),
          (1, 70, 1, 2, 1, 8)]
CASES = [Case(*shape, p=p, causal=causal, seed=10 * n + causal)
         for n, shape in enumerate(SHAPES) for p in (0.17, 0.6) for causal in (False, True)]
CASES += [Case(1, 97, 150, 4, 2, 40, p=0.3, causal=True, dtype="float32", seed=70),
          Case(2, 150, 97, 6, 3, 24, p=0.5, dtype="float32", seed=71),
          Case(1, 130, 90, 4, 2, 16, p=0.25, variant=(("window_size", (20, 5)),), seed=72),
          Case(1, 90, 130, 4, 1, 16, p=0.4, causal=True,
               variant=(("softcap", 2.0), ("window_size", (30, -1))), alibi=True, seed=73),
          Case(2, 150, 200, 4, 2, 16, p=0.3, block=64, seed=74),
          Case(1, 200, 150, 2, 2, 16, p=0.1, causal=True, block=128, seed=75),
          Case(1, 33, 47, 2, 1, 8, p=0.95, seed=76)]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_dropout_on_the_numpy_path_matches_the_reference(case):
    # Underflow is ordinary; NaN, inf and division by zero are not.
    with np.errstate(divide="raise", over="raise", invalid="raise"):
        check(*case.run())


# On the GPU: the table's cases without score modifiers in every dtype, and shapes whose
# tiles and 16-row Philox groups are cut in many places. Left out: fp16/bf16 with one key
# (seqlen_k = 1). There dS = P (keep dP / (1 - p) - D) is exactly 0, and the naive reference,
# which takes D = rowsum(P dP), gets 0; the kernels take D = rowsum(dout * out) from the
# rounded output (FlashAttention's D), and out = v / (1 - p) rounded to fp16/bf16 leaves dq at
# the output's rounding (measured on the H200: 2e-4 to 2e-2, the rule's bound ~1e-5).
GPU_CASES = [replace(c, dtype=dtype) for c in CASES
             if c.dtype == "float64" and not c.alibi and "softcap" not in dict(c.variant)
             for dtype in ("float16", "bfloat16", "float32", "float64")
             if not (c.sk == 1 and dtype in ("float16", "bfloat16"))]
GPU_CASES += [Case(*shape, p=p, causal=causal, dtype=dtype, seed=90 + causal, variant=variant)
              for shape in ((2, 1000, 777, 4, 2, 64), (1, 777, 1000, 2, 1, 128))
              for p, variant in ((0.1, ()), (0.5, (("window_size", (100, 30)),)))
              for causal in (False, True) for dtype in ("float16", "bfloat16")]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in GPU_CASES])
def test_dropout_on_the_gpu_matches_the_reference(case, deterministic):
    import cupy
    from gpu_checks import FP64_RTOL
    if deterministic and case.dtype not in ("float16", "bfloat16"):
        pytest.skip("the plain kernels have one backward")
    check(*case.run(cupy, deterministic), f64_rel=FP64_RTOL)


def check(got, refs, naive, f64_rel=F64_REL):
    """Forward and backward results against the float64 reference (and the naive one in
    ``dtype`` for the tolerance rule)."""
    for name, g in zip(NAMES, got):
        assert not np.isnan(g.astype(np.float64)).any(), f"{name} has NaN"
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(refs[1]))
    if naive is None:
        for name, g, r in zip(NAMES, got, refs):
            assert rel_err(g, r) < f64_rel, f"{name}: relative error {rel_err(g, r):.2e}"
        return
    for name, g, r, n in zip(NAMES[:2], got, refs, naive):
        assert_rule(name, g, r, n, FWD_FACTOR)
    magnitude = max(float(np.abs(r).max()) for r in refs[2:])
    for name, g, r, n in zip(NAMES[2:], got[2:], refs[2:], naive[2:]):
        assert_rule(name, g, r, n, BWD_FACTOR, magnitude)


def test_the_cases_cover_the_combinations():
    assert {(c.causal, c.sq == c.sk, c.nheads == c.nheads_k) for c in CASES} == {
        (a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)}


def _inputs(shape_q=(2, 90, 4, 16), shape_kv=(2, 70, 2, 16), seed=50):
    q = random_array(np, shape_q, np.float64, seed)
    k, v = (random_array(np, shape_kv, np.float64, seed + i) for i in (1, 2))
    return q, k, v, random_array(np, shape_q, np.float64, seed + 3)


def _both(q, k, v, dout, **kw):
    out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
    return (out, lse, *cf.flash_attention_backward(dout, q, k, v, out, lse, **kw))


@pytest.mark.parametrize("seed", [None, 5])
def test_dropout_p_0_is_no_dropout_bit_for_bit(seed):
    q, k, v, dout = _inputs()
    plain = _both(q, k, v, dout, causal=True)
    for got, want in zip(_both(q, k, v, dout, causal=True, dropout_p=0.0, seed=seed,
                               offset=9), plain):
        np.testing.assert_array_equal(got, want)


def test_lse_is_that_of_the_undropped_softmax():
    q, k, v, _ = _inputs()
    _, plain = cf.flash_attention(q, k, v, return_lse=True)
    out, lse = cf.flash_attention(q, k, v, return_lse=True, dropout_p=0.7, seed=1)
    np.testing.assert_array_equal(lse, plain)


def test_same_seed_reproduces_other_seeds_and_offsets_differ():
    q, k, v, dout = _inputs()
    first = _both(q, k, v, dout, dropout_p=0.3, seed=11, offset=2)
    for got, want in zip(_both(q, k, v, dout, dropout_p=0.3, seed=11, offset=2), first):
        np.testing.assert_array_equal(got, want)
    for other in (dict(seed=12, offset=2), dict(seed=11, offset=3)):
        out = cf.flash_attention(q, k, v, dropout_p=0.3, **other)
        assert (out != first[0]).mean() > 0.9, other


def test_each_kept_weight_is_scaled_and_each_dropped_one_is_zero():
    """With v the identity (one key per value dimension), out[i] is row i of the dropped,
    scaled attention matrix itself. p = 0.4 is used as 102/256 (a multiple of 1/256)."""
    sq, sk, p = 40, 24, 0.4
    q = random_array(np, (1, sq, 1, sk), np.float64, 60)
    k = random_array(np, (1, sk, 1, sk), np.float64, 61)
    v = np.eye(sk)[None, :, None, :]
    out, lse = cf.flash_attention(q, k, v, return_lse=True, dropout_p=p, seed=8)
    s = np.einsum("id,jd->ij", q[0, :, 0], k[0, :, 0]) * sk ** -0.5
    probs = np.exp(s - lse[0, 0][:, None])
    keep = cf.dropout_mask(1, 1, sq, sk, p, seed=8)[0, 0]
    np.testing.assert_allclose(out[0, :, 0], np.where(keep, probs / (1 - 102 / 256), 0.0), rtol=1e-13,
                               atol=1e-16)


def test_causal_rows_without_keys_stay_zero_under_dropout():
    q, k, v, dout = _inputs(shape_q=(1, 90, 2, 8), shape_kv=(1, 30, 2, 8))
    out, lse, dq, dk, dv = _both(q, k, v, dout, causal=True, dropout_p=0.5, seed=3)
    assert (out[:, :60] == 0).all() and (dq[:, :60] == 0).all()
    assert np.isneginf(lse[:, :, :60]).all() and np.isfinite(lse[:, :, 60:]).all()


@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True),
    dict(softcap=1.5, window_size=(2, 1), alibi_slopes=np.float32([0.3, 0.9])),
], ids=["plain", "causal", "variants"])
@pytest.mark.parametrize("sq,sk", [(12, 20), (20, 12)])
def test_gradients_match_finite_differences(sq, sk, kw):
    """Shapes past one 16-row Philox group, so that every word of a group is used."""
    kw = dict(kw, dropout_p=0.35, seed=2**63 + 1, offset=4)
    q, k, v = (random_array(np, shape, np.float64, seed) for shape, seed in
               (((1, sq, 2, 3), 30), ((1, sk, 1, 3), 31), ((1, sk, 1, 3), 32)))
    dout = random_array(np, q.shape, np.float64, seed=33)
    assert_gradients_match_finite_differences(q, k, v, dout, **kw)


def test_dropout_mask_validates_its_sizes():
    with pytest.raises(ValueError, match="batch"):
        cf.dropout_mask(2**20, 2**13, 1, 1, 0.1, 0)
    with pytest.raises(TypeError, match="nheads"):
        cf.dropout_mask(1, 2.0, 1, 1, 0.1, 0)
