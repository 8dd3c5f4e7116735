"""Dense forward and backward on the GPU against a float64 reference computed on the GPU.

fp16/bf16 follow FlashAttention's rule (DESIGN.md): our error against the float64 reference is
at most 2x (out) or 3x (dq, dk, dv) the error of a naive same-dtype implementation. float32 and
float64 must match the reference to their own precision (float32 error rules out TF32).
lse is compared with the float64 lse of the same (dtype-rounded) inputs.
"""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cupyflash as cf  # noqa: E402
from cupyflash import _launch  # noqa: E402

try:
    from gpu_checks import (DTYPES, HALF, Case, assert_bit_identical_grads,  # noqa: E402
                            assert_rows_without_keys, assert_tight, check_backward,
                            check_forward, has_nan, make_inputs, params, run_and_check,
                            seed_of)
    from reference import attention_ref, attention_ref_backward  # noqa: E402
except ImportError:
    from tests.gpu_checks import (DTYPES, HALF, Case, assert_bit_identical_grads,  # noqa: E402
                                  assert_rows_without_keys, assert_tight, check_backward,
                                  check_forward, has_nan, make_inputs, params, run_and_check,
                                  seed_of)
    from tests.reference import attention_ref, attention_ref_backward  # noqa: E402

pytestmark = pytest.mark.gpu

HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)

# (seqlen_q, seqlen_k): every length of the issue in both roles, seqlen_q != seqlen_k both ways.
SEQLEN_PAIRS = ((1, 17), (17, 1), (97, 255), (255, 97), (128, 128), (128, 1023), (1023, 128),
                (1023, 1025), (1025, 1023), (1, 2048), (2048, 17), (2048, 2048))

def _main_cases():
    cases = []
    for j, dtype in enumerate(DTYPES):
        for i, (sq, sk) in enumerate(SEQLEN_PAIRS):
            # Each (pair, dtype) gets its own head dim, so every head dim meets 4 pairs.
            d = HEAD_DIMS[(i + 3 * j) % len(HEAD_DIMS)]
            small = sq * sk <= 255 * 255
            b, h = (2, 3) if small else (1, 2)
            for causal in (False, True):
                cases.append(Case(dtype, sq, sk, d, causal, b, h, h))
    return cases


@pytest.mark.parametrize("case", params(_main_cases()))
def test_forward_backward_match_reference(case, request):
    q, k, v, dout = make_inputs(case, seed_of(request))
    run_and_check(case, q, k, v, dout)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_causal_launch_groups_with_a_short_last_group(dtype, deterministic, request, monkeypatch):
    """Causal passes start their (head, batch) pairs in groups (_launch._tile_grid); in groups
    of 4 over 2 x 3 pairs the last group is short, and its spare blocks must write nothing."""
    monkeypatch.setattr(_launch, "_launch_group", lambda pairs, tiles, pair_bytes=0, l2_part=1: min(pairs, 4))
    case = Case(dtype, 300, 300, 64, True, 2, 3, 3)
    q, k, v, dout = make_inputs(case, seed_of(request))
    run_and_check(case, q, k, v, dout, deterministic=deterministic)


def _head_layout_cases():
    cases = []
    for dtype in DTYPES:
        for causal in (False, True):
            cases.append(Case(dtype, 255, 1023, 64, causal, 2, 16, 2))    # GQA, 8 query heads per kv head
            cases.append(Case(dtype, 1023, 255, 128, causal, 2, 8, 1))    # MQA
    return cases


@pytest.mark.parametrize("case", params(_head_layout_cases()))
def test_grouped_heads_gqa_mqa(case, request):
    q, k, v, dout = make_inputs(case, seed_of(request))
    run_and_check(case, q, k, v, dout)


def _strided_cases(packing):
    cases = []
    for dtype in ("bf16", "fp16", "fp32"):
        for causal in (False, True):
            if packing == "qkv":
                cases.append(Case(dtype, 255, 255, 80, causal, 2, 4, 4))
            else:
                cases.append(Case(dtype, 97, 1025, 59, causal, 2, 4, 2))
    return cases


@pytest.mark.parametrize("case", params(_strided_cases("qkv")))
def test_strided_packed_qkv(case, request):
    """q, k, v are slices of one (batch, seqlen, 3, nheads, headdim) tensor, read in place."""
    q, k, v, dout = make_inputs(case, seed_of(request))
    qkv = cp.stack([q, k, v], axis=2)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    run_and_check(case, q, k, v, dout)


@pytest.mark.parametrize("case", params(_strided_cases("kv")))
def test_strided_packed_kv_and_head_major_q(case, request):
    """k, v are slices of one (batch, seqlen_k, nheads_k, 2, headdim) tensor; q is stored
    head-major (batch, nheads, seqlen_q, headdim) and seen through a transposed view."""
    q, k, v, dout = make_inputs(case, seed_of(request))
    kv = cp.stack([k, v], axis=3)
    k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    q = cp.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    dout = cp.ascontiguousarray(dout.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not (k.flags.c_contiguous or q.flags.c_contiguous)
    run_and_check(case, q, k, v, dout)


def _empty_row_cases():
    cases = []
    for dtype in DTYPES:
        cases.append(Case(dtype, 97, 17, 64, True, 2, 2, 2))
        cases.append(Case(dtype, 1025, 128, 40, True, 1, 2, 1))
    return cases


@pytest.mark.parametrize("case", params(_empty_row_cases()))
def test_causal_rows_without_keys_are_zero(case, request):
    """Causal with seqlen_q > seqlen_k, bottom-right aligned: the first seqlen_q - seqlen_k
    queries see no key. Their output and dq are 0, lse is -inf, and no NaN appears."""
    q, k, v, dout = make_inputs(case, seed_of(request))
    out, lse, (dq, dk, dv) = run_and_check(case, q, k, v, dout)
    empty = case.sq - case.sk
    for name, a in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not has_nan(a), f"{name} has NaN"
    assert_rows_without_keys(out, lse, dq, slice(None, empty), slice(empty, None))


def _poisoned_pool(nbytes_list, copies=4):
    """A new CuPy memory pool whose only free blocks have exactly these sizes and are filled
    with 0xFF bytes (NaN in every float format), so that cp.empty outputs made under it land
    on them. A new pool: the default one may keep unpoisoned free chunks of these sizes inside
    blocks that earlier tests still partly use (free_all_blocks cannot release those)."""
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        blocks = [cp.empty(n, cp.uint8) for n in nbytes_list for _ in range(copies)]
        for a in blocks:
            a.fill(255)
        cp.cuda.Device().synchronize()
        del a
        blocks.clear()
    return pool


def _poison_cases():
    cases = []
    for dtype in DTYPES:
        cases.append(Case(dtype, 97, 255, 40, False, 2, 3, 3))
        cases.append(Case(dtype, 255, 97, 111, True, 2, 4, 2))
        # d=64 causal: the forward's 192-row tiles start 128 rows before row 0.
        cases.append(Case(dtype, 200, 230, 64, True, 2, 4, 2))
    return cases


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "blockmask"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", params(_poison_cases()))
def test_every_output_element_is_written(case, deterministic, sparse, request):
    """Outputs are allocated on NaN-filled memory; any element the kernels skip shows as NaN.
    Covers both dQ passes, and a block mask with an empty block row and column (their rows of
    out/lse and of dq, dk, dv must still be written: zeros, -inf). The fp32 dQ buffer lands on
    NaN too: the preprocess kernel must zero every tile the passes read."""
    q, k, v, dout = make_inputs(case, seed_of(request))
    mask = None
    if sparse:
        grid = np.ones((-(-case.sq // 64), -(-case.sk // 64)), bool)
        grid[1, :] = False
        grid[:, 0] = False
        mask = cf.BlockMask.from_dense(grid, 64, seqlen_q=case.sq, seqlen_k=case.sk)
    acc = 8 if case.dtype == "fp64" else 4
    lse_bytes = case.batch * case.nheads * case.sq * acc
    accum = _launch.dq_accum_shape(q.shape)
    pool = _poisoned_pool(sorted({q.nbytes, k.nbytes, v.nbytes, lse_bytes, q.size * 4,
                                  int(np.prod(accum)) * 4}))
    scale = case.d ** -0.5
    with cp.cuda.using_allocator(pool.malloc):
        for shape, dtype in ((q.shape, q.dtype), (accum, cp.float32)):
            probe = cp.empty(shape, dtype)
            assert bool((probe.view(cp.uint8) == 255).all()), "test setup: the pool was not poisoned"
            del probe
        out, lse = cf.flash_attention(q, k, v, causal=case.causal, softmax_scale=scale,
                                      block_mask=mask, return_lse=True)
        dq, dk, dv = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                                 softmax_scale=scale, block_mask=mask,
                                                 deterministic=deterministic)
    for name, a in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not has_nan(a), f"{name} has NaN: an element was never written"
    elem = None if mask is None else cp.asarray(mask.to_dense())
    check_forward(case, q, k, v, out, lse, scale, mask=elem)
    check_backward(case, dout, q, k, v, (dq, dk, dv), scale, mask=elem)


def test_float64_backward_widens_a_float32_lse(request):
    """A float32 lse given with float64 inputs (the validator accepts it) is read as float64,
    so the gradients are right to float32 precision, not garbage."""
    case = Case("fp64", 97, 130, 64, True, 2, 4, 2)
    q, k, v, dout = make_inputs(case, seed_of(request))
    scale = case.d ** -0.5
    out, lse = cf.flash_attention(q, k, v, causal=True, return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse.astype(cp.float32), causal=True)
    refs = attention_ref_backward(dout, q, k, v, scale, True)
    magnitude = max(float(cp.abs(cp.asarray(r)).max()) for r in refs)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g.dtype == cp.float64
        # lse rounded to float32 moves P by up to |lse| * 2**-24 relative.
        assert_tight(name, g, r, 1e-5, magnitude)


def _deterministic_cases():
    return [Case(dtype, 1023, 1025, 128, causal, 2, 4, 2)
            for dtype in HALF for causal in (False, True)]


@pytest.mark.parametrize("case", params(_deterministic_cases()))
def test_deterministic_backward_is_bit_identical(case, request):
    q, k, v, dout = make_inputs(case, seed_of(request))
    out, lse, first = run_and_check(case, q, k, v, dout, deterministic=True)
    scale = case.d ** -0.5
    second = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                         softmax_scale=scale, deterministic=True)
    assert_bit_identical_grads(first, second)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float32_does_not_use_tf32(causal, request):
    """TF32 keeps 10 mantissa bits (relative error ~1e-3); true fp32 stays near 1e-6."""
    case = Case("fp32", 255, 1023, 128, causal, 2, 2, 2)
    q, k, v, dout = make_inputs(case, seed_of(request))
    scale = case.d ** -0.5
    out, lse = cf.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    dq, dk, dv = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                             softmax_scale=scale)
    ref_out, _ = attention_ref(q, k, v, scale, causal)
    refs = attention_ref_backward(dout, q, k, v, scale, causal)
    assert_tight("out", out, ref_out, 1e-5)
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        assert_tight(name, g, r, 1e-5)


def test_the_tight_bound_allows_for_cancelling_terms_and_not_for_tf32(request):
    """dv of a single key is dout summed over the queries: its fp32 rounding follows the sum
    of |dout| (the fuzz's seed 4233577063 drew 171 queries whose sum cancelled to 1/1000 of
    it), while an error of TF32's size (2**-11 of that sum) still fails."""
    case = Case("fp32", 171, 1, 1, False)
    q, k, v, dout = make_inputs(case, seed_of(request))
    out, lse, (dq, dk, dv) = run_and_check(case, q, k, v, dout)
    *refs, sizes = attention_ref_backward(dout, q, k, v, 1.0, False, term_sizes=True)
    tf32 = float(sizes[2].max()) * 2.0 ** -11
    with pytest.raises(AssertionError, match="dv: max error"):
        assert_tight("dv", refs[2].astype(cp.float32) + tf32, refs[2], 1e-5, sizes=sizes[2])
