"""The NumPy path (the CPU reference and fallback), checked without a GPU."""
import ml_dtypes
import numpy as np
import pytest

import cupyflash as cf
from cupyflash import _numpy_backend, _spec
from reference import (attention_naive, attention_naive_backward, attention_ref,
                       attention_ref_backward, assert_rule, random_array, random_inputs,
                       rel_err)

F64_REL = 1e-12


def run_fwd_bwd(q, k, v, causal, seed, softmax_scale=None):
    """Forward and backward through the public API, with a fresh random dout."""
    out, lse = cf.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                  return_lse=True)
    dout = random_array(np, q.shape, q.dtype, seed)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=causal,
                                        softmax_scale=softmax_scale)
    return out, lse, dout, grads


def check_against_ref(b, sq, sk, h, hk, d, causal, seed, softmax_scale=None):
    q, k, v = random_inputs(np, (b, sq, h, d), (b, sk, hk, d), np.float64, seed)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out, lse, dout, (dq, dk, dv) = run_fwd_bwd(q, k, v, causal, seed + 10, softmax_scale)
    out_ref, lse_ref = attention_ref(q, k, v, scale, causal)
    grads_ref = attention_ref_backward(dout, q, k, v, scale, causal)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_err(out, out_ref) < F64_REL
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    assert rel_err(lse, lse_ref) < F64_REL
    for name, g, g_ref in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref):
        assert g.shape == g_ref.shape, name
        assert not np.isnan(g).any(), name
        assert rel_err(g, g_ref) < F64_REL, name


# --- agreement with the full-matrix float64 reference ---------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_float64_matches_reference(causal):
    check_against_ref(2, 128, 128, 3, 3, 32, causal, seed=1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (97, 97), (1, 97), (97, 1),
                                   (17, 130), (130, 17), (65, 129)])
def test_odd_seqlens(sq, sk, causal):
    check_against_ref(1, sq, sk, 2, 2, 16, causal, seed=sq * 1000 + sk)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [1, 7, 59])
def test_odd_head_dims(d, causal):
    check_against_ref(1, 33, 70, 2, 2, d, causal, seed=d)


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_4_to_1(causal):
    check_against_ref(2, 40, 75, 8, 2, 16, causal, seed=3)


@pytest.mark.parametrize("causal", [False, True])
def test_mqa_single_kv_head(causal):
    check_against_ref(1, 75, 40, 4, 1, 16, causal, seed=4)


def test_explicit_softmax_scale():
    check_against_ref(1, 20, 30, 2, 2, 8, True, seed=5, softmax_scale=0.37)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(65, 65), (100, 191), (191, 100), (63, 129)])
def test_tiled_backend_matches_reference_off_tile_multiples(sq, sk, causal):
    """The tiles of _numpy_backend (64 x 64) do not divide these seqlens."""
    q, k, v = random_inputs(np, (2, sq, 2, 24), (2, sk, 1, 24), np.float64, seed=sq + sk)
    scale = 24 ** -0.5
    spec = _spec.CallSpec.of(q, causal=causal)
    out, lse = _numpy_backend.forward(q, k, v, scale, spec)
    out_ref, lse_ref = attention_ref(q, k, v, scale, causal)
    assert rel_err(out, out_ref) < F64_REL
    assert rel_err(lse, lse_ref) < F64_REL
    dout = random_array(np, q.shape, np.float64, seed=7)
    grads = _numpy_backend.backward(dout, q, k, v, out, lse, scale, spec)
    for g, g_ref in zip(grads, attention_ref_backward(dout, q, k, v, scale, causal)):
        assert rel_err(g, g_ref) < F64_REL


# --- gradients against finite differences ---------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(3, 5), (5, 3)])
def test_gradients_match_finite_differences(sq, sk, causal):
    q, k, v = random_inputs(np, (1, sq, 2, 4), (1, sk, 2, 4), np.float64, seed=sq * 10 + sk)
    dout = random_array(np, q.shape, np.float64, seed=99)
    out, lse = cf.flash_attention(q, k, v, causal=causal, return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=causal)

    def loss(q_, k_, v_):
        return float((cf.flash_attention(q_, k_, v_, causal=causal) * dout).sum())

    eps = 1e-6
    inputs = [q, k, v]
    for idx, (name, g) in enumerate(zip(("dq", "dk", "dv"), grads)):
        fd = np.zeros_like(g)
        for pos in np.ndindex(g.shape):
            plus = [x.copy() for x in inputs]
            minus = [x.copy() for x in inputs]
            plus[idx][pos] += eps
            minus[idx][pos] -= eps
            fd[pos] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg=name)


# --- causal rows that see no key ------------------------------------------------------------

def test_causal_rows_without_keys_are_zero():
    sq, sk = 70, 5          # rows 0 .. 64 see no key (i + sk - sq < 0)
    q, k, v = random_inputs(np, (2, sq, 2, 8), (2, sk, 2, 8), np.float64, seed=11)
    with np.errstate(all="raise"):
        out, lse, dout, (dq, dk, dv) = run_fwd_bwd(q, k, v, True, seed=12)
    empty = sq - sk
    assert (out[:, :empty] == 0).all()
    assert np.isneginf(lse[:, :, :empty]).all()
    assert np.isfinite(lse[:, :, empty:]).all()
    assert (dq[:, :empty] == 0).all()
    for a in (out, lse, dq, dk, dv):
        assert not np.isnan(a).any()
    out_ref, _ = attention_ref(q, k, v, 8 ** -0.5, True)
    assert rel_err(out, out_ref) < F64_REL


def test_causal_rows_without_keys_float32_no_nan():
    q, k, v = random_inputs(np, (1, 9, 2, 8), (1, 3, 2, 8), np.float32, seed=13)
    with np.errstate(all="raise"):
        out, lse, _, grads = run_fwd_bwd(q, k, v, True, seed=14)
    assert np.isneginf(lse[:, :, :6]).all() and (out[:, :6] == 0).all()
    for a in (out, lse) + tuple(grads):
        assert not np.isnan(a).any()


# --- layouts, dtypes and return values ------------------------------------------------------

def test_strided_slices_of_packed_qkv_are_read_correctly():
    b, s, h, d = 2, 37, 3, 16
    qkv = random_array(np, (b, s, 3, h, d), np.float64, seed=15)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    out, lse, dout, grads = run_fwd_bwd(q, k, v, True, seed=16)
    qc, kc, vc = (np.ascontiguousarray(x) for x in (q, k, v))
    out_c, lse_c = cf.flash_attention(qc, kc, vc, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, out_c)
    np.testing.assert_array_equal(lse, lse_c)
    grads_c = cf.flash_attention_backward(dout, qc, kc, vc, out_c, lse_c, causal=True)
    for g, g_c in zip(grads, grads_c):
        np.testing.assert_array_equal(g, g_c)
    out_ref, _ = attention_ref(q, k, v, d ** -0.5, True)
    assert rel_err(out, out_ref) < F64_REL


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_low_precision_inputs_return_their_dtype(dtype):
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = random_inputs(np, (1, 50, 4, 16), (1, 70, 2, 16), dt, seed=17)
    out, lse, dout, grads = run_fwd_bwd(q, k, v, True, seed=18)
    assert out.dtype == dt and lse.dtype == np.float32
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == dt and g.shape == x.shape
    scale = 16 ** -0.5
    out_ref, lse_ref = attention_ref(q, k, v, scale, True)
    out_naive, lse_naive = attention_naive(q, k, v, scale, True, dtype)
    assert_rule("out", out, out_ref, out_naive, 2)
    assert_rule("lse", lse, lse_ref, lse_naive, 2)
    grads_ref = attention_ref_backward(dout, q, k, v, scale, True)
    grads_naive = attention_naive_backward(dout, q, k, v, scale, True, dtype)
    for name, g, g_ref, g_naive in zip(("dq", "dk", "dv"), grads, grads_ref, grads_naive):
        assert_rule(name, g, g_ref, g_naive, 3)


@pytest.mark.parametrize("dtype,lse_dtype", [("float64", np.float64), ("float32", np.float32),
                                             ("float16", np.float32)])
def test_return_lse_shape_and_dtype(dtype, lse_dtype):
    q, k, v = random_inputs(np, (2, 19, 4, 8), (2, 23, 2, 8), dtype, seed=19)
    result = cf.flash_attention(q, k, v, return_lse=True)
    assert isinstance(result, tuple) and len(result) == 2
    out, lse = result
    assert out.shape == q.shape and lse.shape == (2, 4, 19) and lse.dtype == lse_dtype
    only_out = cf.flash_attention(q, k, v)
    assert isinstance(only_out, np.ndarray)
    np.testing.assert_array_equal(only_out, out)


def test_numpy_in_numpy_out():
    q, k, v = random_inputs(np, (1, 10, 2, 8), (1, 12, 2, 8), np.float32, seed=20)
    out, lse, _, grads = run_fwd_bwd(q, k, v, False, seed=21)
    for a in (out, lse) + tuple(grads):
        assert type(a) is np.ndarray


# --- the visiting function ------------------------------------------------------------------

def test_key_blocks_skip_fully_masked_blocks():
    causal, dense = _spec.CAUSAL, _spec.NO_WINDOW
    # seqlen_q = seqlen_k = 200: query block i visits key blocks 0..i, only block i partial.
    for i in range(4):
        assert _numpy_backend.key_blocks(i, 200, 200, causal) == \
            [(j, j == i) for j in range(i + 1)]
    assert _numpy_backend.key_blocks(0, 200, 200, dense) == [(j, False) for j in range(4)]
    # seqlen_q = 130 > seqlen_k = 10: rows 0..119 see nothing, so query block 0 visits nothing.
    assert _numpy_backend.key_blocks(0, 130, 10, causal) == []
    assert _numpy_backend.key_blocks(1, 130, 10, causal) == [(0, True)]
    assert _numpy_backend.query_blocks(130, 10, causal) == [[(1, True), (2, True)]]
    assert _numpy_backend.query_blocks(200, 200, causal)[1] == [(1, True), (2, False), (3, False)]


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (5, 0), (0, 70), (64, 64),
                                    (100, -1), (-1, 3), (1000, 1000)])
@pytest.mark.parametrize("sq,sk", [(200, 200), (130, 10), (10, 130), (65, 191), (191, 65)])
def test_key_blocks_are_the_blocks_the_band_touches(sq, sk, window):
    """Visited: exactly the blocks with a visible element; partial: exactly those with a
    hidden one (element by element from _spec.visible)."""
    seen = _spec.visible(np.arange(sq), np.arange(sk), sq, sk, window)
    for i in range(-(-sq // 64)):
        expected = []
        for j in range(-(-sk // 64)):
            tile = seen[i * 64:(i + 1) * 64, j * 64:(j + 1) * 64]
            if tile.any():
                expected.append((j, not tile.all()))
        assert _numpy_backend.key_blocks(i, sq, sk, window) == expected, i


def test_reference_bf16_rounding_is_nearest_even():
    from reference import round_to
    x = random_array(np, (1000,), np.float32, seed=22) * 1e3
    x = np.concatenate([x, np.float32([1 + 2 ** -8, 1 + 3 * 2 ** -8, -0.0, np.inf, -np.inf,
                                       3.4e38])])
    expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(round_to(x, "bfloat16"), expected)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_term_sizes_bound_the_results_and_are_plain_sums_for_one_key(causal):
    # The GPU checks' fp32/fp64 slack (gpu_checks.assert_tight) scales with these sizes: each
    # bounds its result (triangle inequality), and with one key, where P = 1 and dS = 0, dv's
    # is the sum of |dout| over the queries of its group and out's is |v|.
    q, k, v = random_inputs(np, (2, 37, 4, 8), (2, 29, 2, 8), np.float64, 31)
    dout = random_array(np, q.shape, np.float64, 32)
    out, _, out_size = attention_ref(q, k, v, 0.3, causal, term_sizes=True, softcap=2.0)
    assert (out_size >= np.abs(out)).all()
    *grads, sizes = attention_ref_backward(dout, q, k, v, 0.3, causal, term_sizes=True,
                                           softcap=2.0)
    for g, size in zip(grads, sizes):
        assert g.shape == size.shape and (size >= np.abs(g)).all()
    one_k, one_v = k[:, :1], v[:, :1]
    out, _, out_size = attention_ref(q, one_k, one_v, 0.3, False, term_sizes=True)
    np.testing.assert_allclose(out_size, np.abs(np.repeat(one_v, 2, axis=2)).repeat(37, 1))
    *_, (dq_size, _, dv_size) = attention_ref_backward(dout, q, one_k, one_v, 0.3, False,
                                                       term_sizes=True)
    expected = np.abs(dout).sum(axis=1, keepdims=True).reshape(2, 1, 2, 2, 8).sum(axis=3)
    np.testing.assert_allclose(dv_size, expected)
    assert (dq_size > 0).all()
