"""Block-sparse forward and backward on the GPU against the masked float64 reference.

With ``block_mask=mask`` the result must equal dense attention under the element mask
``mask.to_dense()`` (broadcast over the query heads when ``mask.heads == 1``), ANDed with the
call's ``causal``. The reference gets that element mask through ``mask=`` and applies the same
tolerance rule as tests/test_gpu_dense.py: fp16/bf16 within 2x (out) or 3x (dq, dk, dv) the
error of a naive same-dtype implementation, float32/float64 to their own precision.

Every builder of ``cupyflash.masks`` is covered, with sequence tails inside partial blocks
(1000 and 777 are not multiples of 64), seqlen_q != seqlen_k both ways, block sizes 64, 128
and mixed, per-head masks, GQA/MQA, causal calls, rows and key columns that see nothing, the
deterministic backward, and an all-kept mask against the dense kernels.
"""
from dataclasses import dataclass

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cupyflash as cf  # noqa: E402
from cupyflash import masks  # noqa: E402

try:
    from gpu_checks import (DTYPES, HALF, assert_bit_identical_grads,  # noqa: E402
                            assert_rows_without_keys, has_nan, make_inputs, params,
                            run_and_check, seed_of, wide)
except ImportError:
    from tests.gpu_checks import (DTYPES, HALF, assert_bit_identical_grads,  # noqa: E402
                                  assert_rows_without_keys, has_nan, make_inputs, params,
                                  run_and_check, seed_of, wide)

pytestmark = pytest.mark.gpu

# Tails inside partial blocks on both sides, seqlen_q != seqlen_k both ways, and one even pair.
SEQLEN_PAIRS = ((1000, 1000), (777, 1000), (1000, 777), (1024, 1024))
BLOCK_SIZES = (128, 64, (64, 128), (128, 64))

# Builder parameters: windows that are not multiples of the block size, so that the band
# cuts blocks; strides and global blocks small enough to leave most blocks out at ~1000 tokens.
WINDOW = 200
STRIDE = 3
GLOBAL_BLOCKS = 1
RANDOM_BLOCKS = 2
RANDOM_DENSITY = 0.4
GRID_DENSITY = 0.5


@dataclass(frozen=True)
class Case:
    pattern: str          # a key of BUILDERS
    dtype: str
    sq: int
    sk: int
    d: int = 64
    causal: bool = False  # the call's flag
    block: object = 128   # int or (block_q, block_k)
    batch: int = 1
    nheads: int = 2
    nheads_k: int = 2
    mask_heads: int = 1   # 1: one layout for all heads; nheads: one layout per query head

    @property
    def id(self):
        heads = f"h{self.nheads}" if self.nheads == self.nheads_k else \
            f"h{self.nheads}k{self.nheads_k}"
        block = "x".join(map(str, self.block)) if isinstance(self.block, tuple) else self.block
        per_head = f"-mask{self.mask_heads}heads" if self.mask_heads > 1 else ""
        return (f"{self.pattern}-{self.dtype}-b{self.batch}-{heads}-q{self.sq}-k{self.sk}-"
                f"d{self.d}-bs{block}{per_head}-{'causal' if self.causal else 'full'}")


def _block_pair(block):
    return block if isinstance(block, tuple) else (block, block)


def _grid(case, seed, density=GRID_DENSITY):
    """A random (mask_heads, nbq, nbk) bool block grid."""
    bq, bk = _block_pair(case.block)
    shape = (case.mask_heads, -(-case.sq // bq), -(-case.sk // bk))
    return np.random.default_rng(seed).random(shape) < density


BUILDERS = {
    "causal": lambda c, s: masks.causal(c.sq, c.sk, block_size=c.block),
    "sliding_window": lambda c, s: masks.sliding_window(c.sq, c.sk, WINDOW, block_size=c.block),
    "strided": lambda c, s: masks.strided(c.sq, c.sk, STRIDE, block_size=c.block),
    "longformer": lambda c, s: masks.longformer(c.sq, c.sk, WINDOW, GLOBAL_BLOCKS,
                                                block_size=c.block),
    "bigbird": lambda c, s: masks.bigbird(c.sq, c.sk, WINDOW, GLOBAL_BLOCKS, RANDOM_BLOCKS, s,
                                          block_size=c.block, nheads=c.mask_heads),
    "random": lambda c, s: masks.random(c.sq, c.sk, RANDOM_DENSITY, s, block_size=c.block,
                                        nheads=c.mask_heads),
    # A block grid given directly, and the same with the mask's own element-level causal rule.
    "grid": lambda c, s: cf.BlockMask.from_dense(_grid(c, s), block_size=c.block,
                                                 seqlen_q=c.sq, seqlen_k=c.sk),
    "grid_causal": lambda c, s: cf.BlockMask.from_dense(_grid(c, s), block_size=c.block,
                                                        seqlen_q=c.sq, seqlen_k=c.sk,
                                                        causal=True),
}
BUILDER_NAMES = ("causal", "sliding_window", "strided", "longformer", "bigbird", "random")


def _mask(case, seed):
    mask = BUILDERS[case.pattern](case, seed % 2**31)
    assert mask.heads == case.mask_heads, \
        f"test setup: mask has {mask.heads} heads, expected {case.mask_heads}"
    assert (mask.block_q, mask.block_k) == _block_pair(case.block)
    assert (mask.seqlen_q, mask.seqlen_k) == (case.sq, case.sk)
    assert 0.0 < mask.density < 1.0, \
        f"test setup: density {mask.density} leaves nothing to test"
    return mask


def _check_case(case, request, deterministic=False):
    seed = seed_of(request)
    mask = _mask(case, seed)
    q, k, v, dout = make_inputs(case, seed)
    return mask, (q, k, v, dout), run_and_check(case, q, k, v, dout, deterministic,
                                                block_mask=mask)


# ---------------------------------------------------------------------------------------------
# Every builder, every dtype

def _builder_cases():
    cases = []
    for i, pattern in enumerate(BUILDER_NAMES):
        for j, dtype in enumerate(DTYPES):
            # Each builder meets every seqlen pair and every block size over the four dtypes.
            sq, sk = SEQLEN_PAIRS[(i + j) % len(SEQLEN_PAIRS)]
            block = BLOCK_SIZES[(i + 3 * j) % len(BLOCK_SIZES)]
            d = (64, 128)[(i + j) % 2]
            batch = 2 if j % 2 else 1
            cases.append(Case(pattern, dtype, sq, sk, d, False, block, batch))
    return cases


@pytest.mark.parametrize("case", params(_builder_cases()))
def test_builder_masks_match_reference(case, request):
    _check_case(case, request)


# ---------------------------------------------------------------------------------------------
# Block sizes 64, 128 and mixed, on a random block grid given to BlockMask.from_dense

def _block_size_cases():
    cases = []
    for i, block in enumerate(BLOCK_SIZES):
        for dtype in ("bf16", "fp16", "fp32"):
            sq, sk = ((1000, 777), (777, 1000))[i % 2]
            cases.append(Case("grid", dtype, sq, sk, (128, 64)[i % 2], False, block, 2, 2, 2))
    return cases


@pytest.mark.parametrize("case", params(_block_size_cases()))
def test_block_sizes_from_dense_grid(case, request):
    _check_case(case, request)


# ---------------------------------------------------------------------------------------------
# One layout per query head

def _per_head_cases():
    cases = []
    for dtype in ("bf16", "fp16", "fp32"):
        cases.append(Case("random", dtype, 1000, 777, 64, False, 64, 2, 4, 4, mask_heads=4))
        cases.append(Case("bigbird", dtype, 777, 1000, 128, False, 128, 1, 4, 4, mask_heads=4))
        cases.append(Case("grid", dtype, 1024, 1000, 64, False, (64, 128), 2, 4, 4,
                          mask_heads=4))
    return cases


@pytest.mark.parametrize("case", params(_per_head_cases()))
def test_per_head_masks(case, request):
    _check_case(case, request)


# ---------------------------------------------------------------------------------------------
# A causal call with a mask, and a mask that carries the causal rule itself

def _causal_cases():
    cases = []
    patterns = ("random", "sliding_window", "longformer", "strided", "grid_causal", "causal")
    for i, pattern in enumerate(patterns):
        for j, dtype in enumerate(("bf16", "fp16", "fp32")):
            sq, sk = ((777, 1000), (1000, 777))[(i + j) % 2]
            block = BLOCK_SIZES[(i + j) % len(BLOCK_SIZES)]
            call_causal = pattern != "grid_causal"
            cases.append(Case(pattern, dtype, sq, sk, (64, 128)[i % 2], call_causal, block))
    return cases


@pytest.mark.parametrize("case", params(_causal_cases()))
def test_causal_with_mask(case, request):
    """Bottom-right causal ANDed with the mask; with seqlen_q > seqlen_k the first rows see
    no key at all."""
    _check_case(case, request)


# ---------------------------------------------------------------------------------------------
# Grouped heads

def _gqa_cases():
    cases = []
    for dtype in ("bf16", "fp16", "fp32"):
        # One layout per query head: the 4 query heads of a kv head have different masks,
        # so dk/dv sum over different sets of queries.
        cases.append(Case("random", dtype, 1000, 777, 128, False, 128, 2, 8, 2, mask_heads=8))
        cases.append(Case("grid", dtype, 777, 1000, 64, True, (128, 64), 1, 8, 2,
                          mask_heads=8))
        # MQA with one shared layout.
        cases.append(Case("sliding_window", dtype, 1000, 1000, 64, False, 64, 1, 8, 1))
    return cases


@pytest.mark.parametrize("case", params(_gqa_cases()))
def test_grouped_heads_with_mask(case, request):
    _check_case(case, request)


# ---------------------------------------------------------------------------------------------
# Rows and key columns that see nothing

def _empty_cases():
    cases = []
    for i, dtype in enumerate(DTYPES):
        sq, sk = ((777, 1000), (1000, 777))[i % 2]
        cases.append(Case("grid", dtype, sq, sk, 64, False, (128, 64, (64, 128), 128)[i], 2))
    cases.append(Case("grid", "bf16", 777, 1000, 128, True, 128, 2))
    return cases


@pytest.mark.parametrize("case", params(_empty_cases()))
def test_empty_block_rows_and_columns(case, request):
    """Block row 1 and the last (partial) block row keep no block; so do key block column 2
    and the last (partial) one. Rows without keys give out 0, lse -inf and dq 0; keys no
    query sees give dk = dv = 0; no NaN anywhere."""
    seed = seed_of(request)
    grid = _grid(case, seed % 2**31, density=0.7)
    grid[:, 1, :] = False
    grid[:, -1, :] = False
    grid[:, :, 2] = False
    grid[:, :, -1] = False
    mask = cf.BlockMask.from_dense(grid[0], block_size=case.block, seqlen_q=case.sq,
                                   seqlen_k=case.sk)
    q, k, v, dout = make_inputs(case, seed)
    out, lse, (dq, dk, dv) = run_and_check(case, q, k, v, dout, block_mask=mask)

    elem = mask.to_dense()[0]
    if case.causal:
        rows, cols = np.arange(case.sq)[:, None], np.arange(case.sk)[None, :]
        elem = elem & (cols <= rows + case.sk - case.sq)
    empty_rows = cp.asarray(np.flatnonzero(~elem.any(axis=1)))
    empty_cols = cp.asarray(np.flatnonzero(~elem.any(axis=0)))
    bq, bk = _block_pair(case.block)
    assert empty_rows.size >= bq + (case.sq - 1) % bq + 1, "test setup: too few empty rows"
    assert empty_cols.size >= bk + (case.sk - 1) % bk + 1, "test setup: too few empty keys"

    for name, a in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not has_nan(a), f"{name} has NaN"
    seen_rows = cp.asarray(np.flatnonzero(elem.any(axis=1)))
    assert_rows_without_keys(out, lse, dq, empty_rows, seen_rows)
    assert bool((wide(dk[:, empty_cols]) == 0).all()), "dk is not 0 on keys no query sees"
    assert bool((wide(dv[:, empty_cols]) == 0).all()), "dv is not 0 on keys no query sees"


# ---------------------------------------------------------------------------------------------
# Deterministic backward

def _deterministic_cases():
    return [Case("random", dtype, 1000, 777, 128, causal, 128, 2, 4, 2, mask_heads=4)
            for dtype in HALF for causal in (False, True)]


@pytest.mark.parametrize("case", params(_deterministic_cases()))
def test_deterministic_backward_with_mask_is_bit_identical(case, request):
    mask, (q, k, v, dout), (out, lse, first) = _check_case(case, request, deterministic=True)
    second = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                         softmax_scale=case.d ** -0.5, block_mask=mask,
                                         deterministic=True)
    assert_bit_identical_grads(first, second)


# ---------------------------------------------------------------------------------------------
# A mask that keeps every block is dense attention

def _all_kept_cases():
    cases = []
    for dtype in ("bf16", "fp16", "fp32"):
        # seqlen_k a multiple of the block: every block is full, visited in the dense order.
        cases.append(Case("grid_all", dtype, 1000, 1024, 128, False, 128, 2, 4, 2))
        # A key tail: the tail block is partial, visited first, so only the rule applies.
        cases.append(Case("grid_all", dtype, 777, 1000, 64, False, 128, 1, 2, 2))
        cases.append(Case("grid_all", dtype, 1000, 777, 64, True, 128, 1, 2, 2))
    return cases


@pytest.mark.parametrize("case", params(_all_kept_cases()))
def test_mask_of_all_blocks_equals_dense(case, request):
    """Every block kept: the same result as no mask. Non-causal with seqlen_k a multiple of
    the block size, the sparse kernels visit the same key blocks in the same order as the
    dense ones, so out and lse must be bit-identical."""
    seed = seed_of(request)
    bq, bk = _block_pair(case.block)
    grid = np.ones((-(-case.sq // bq), -(-case.sk // bk)), bool)
    mask = cf.BlockMask.from_dense(grid, block_size=case.block, seqlen_q=case.sq,
                                   seqlen_k=case.sk)
    assert mask.density == 1.0
    q, k, v, dout = make_inputs(case, seed)
    out, lse, grads = run_and_check(case, q, k, v, dout, block_mask=mask)

    scale = case.d ** -0.5
    dense_out, dense_lse = cf.flash_attention(q, k, v, causal=case.causal, softmax_scale=scale,
                                              return_lse=True)
    if not case.causal and case.sk % bk == 0:
        assert bool((out.view(cp.uint8) == dense_out.view(cp.uint8)).all()), \
            (f"out differs from the dense kernel's (max |diff| "
             f"{float(cp.abs(wide(out) - wide(dense_out)).max()):.3e})")
        assert bool((lse == dense_lse).all()), "lse differs from the dense kernel's"
    else:
        # The tail block (partial) is visited first, so sums round differently: the sparse
        # result was held to the rule above; here both must agree on the rows without keys.
        assert bool((cp.isneginf(lse) == cp.isneginf(dense_lse)).all()), \
            "lse is -inf on other rows than the dense kernel's"


def test_calls_from_ever_new_streams_keep_a_bounded_list_cache():
    """Each stream gets its own device copy of a mask's lists; a caller that moves through
    new streams must not grow that cache without end, and every call stays right (the forward
    is bit-reproducible, so each must equal the first)."""
    mask = masks.random(300, 400, RANDOM_DENSITY, seed=5, block_size=64)
    rng = np.random.default_rng(6)
    q, k, v = (cp.asarray(rng.standard_normal(s).astype(np.float16))
               for s in ((1, 300, 2, 64), (1, 400, 2, 64), (1, 400, 2, 64)))
    first = cf.flash_attention(q, k, v, block_mask=mask)
    for _ in range(masks.DEVICE_LISTS_KEPT + 8):
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            out = cf.flash_attention(q, k, v, block_mask=mask)
        stream.synchronize()
        assert bool((out.view(cp.uint16) == first.view(cp.uint16)).all())
        assert len(mask._device_lists) <= masks.DEVICE_LISTS_KEPT
