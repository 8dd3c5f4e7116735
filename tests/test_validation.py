"""Bad arguments raise NumPy-style errors that name the argument, before any work is done."""
import ml_dtypes
import numpy as np
import pytest

import cupyflash as cf

rng = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def qkv(b=2, sq=5, sk=7, h=4, hk=2, d=16, dtype=np.float32):
    return rand(b, sq, h, d, dtype=dtype), rand(b, sk, hk, d, dtype=dtype), \
        rand(b, sk, hk, d, dtype=dtype)


def bwd_args(dtype=np.float32, **kw):
    """(dout, q, k, v, out, lse) with a real forward's out and lse."""
    q, k, v = qkv(dtype=dtype, **kw)
    out, lse = cf.flash_attention(q, k, v, return_lse=True)
    return [rand(*q.shape, dtype=dtype), q, k, v, out, lse]


def backward(args, **kw):
    return cf.flash_attention_backward(*args, **kw)


# --- dtypes ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.bool_])
def test_unsupported_dtype_is_type_error(name, dtype):
    args = dict(zip("qkv", qkv()))
    args[name] = args[name].astype(dtype)
    with pytest.raises(TypeError, match=f"^{name}: unsupported dtype"):
        cf.flash_attention(**args)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_supported_dtypes_pass_validation(dtype):
    out = cf.flash_attention(*qkv(b=1, sq=3, sk=3, h=1, hk=1, d=8, dtype=dtype))
    assert out.dtype == dtype


def test_mixed_dtypes_in_forward_is_type_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="^v has dtype float64 but q has float32"):
        cf.flash_attention(q, k, v.astype(np.float64))


@pytest.mark.parametrize("index, name", [(0, "dout"), (4, "out")])
def test_mixed_dtypes_in_backward_is_type_error(index, name):
    args = bwd_args()
    args[index] = args[index].astype(np.float16)
    with pytest.raises(TypeError, match=f"^{name} has dtype float16"):
        backward(args)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.float64])
def test_lse_dtype_for_float32_inputs_is_type_error(dtype):
    args = bwd_args()
    args[5] = args[5].astype(dtype)
    with pytest.raises(TypeError, match="^lse: dtype must be float32"):
        backward(args)


def test_lse_may_be_float64_for_float64_inputs():
    args = bwd_args(dtype=np.float64)
    assert args[5].dtype == np.float64
    backward(args)
    args[5] = args[5].astype(np.float32)
    backward(args)


# --- shapes ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_4d_is_value_error(name):
    args = dict(zip("qkv", qkv()))
    args[name] = args[name][0]
    with pytest.raises(ValueError, match=f"^{name} must be 4-D"):
        cf.flash_attention(**args)


def test_batch_mismatch_is_value_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^k: batch 1 .* q's batch 2"):
        cf.flash_attention(q, k[:1], v[:1])


def test_headdim_mismatch_is_value_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^k: headdim 8 .* q's headdim 16"):
        cf.flash_attention(q, np.ascontiguousarray(k[..., :8]), np.ascontiguousarray(v[..., :8]))


@pytest.mark.parametrize("axis", [1, 2, 3])
def test_k_and_v_shapes_differ_is_value_error(axis):
    q, k, v = qkv()
    v = np.ascontiguousarray(np.take(v, range(1), axis=axis))
    with pytest.raises(ValueError, match="^v shape .* must equal k's shape"):
        cf.flash_attention(q, k, v)


def test_nheads_not_multiple_of_nheads_k_is_value_error():
    q, k, v = qkv(h=4, hk=3)
    with pytest.raises(ValueError, match="nheads_k"):
        cf.flash_attention(q, k, v)


@pytest.mark.parametrize("name, axis, dim", [
    ("q", 0, "batch"), ("q", 1, "seqlen_q"), ("q", 2, "nheads"), ("q", 3, "headdim"),
    ("k", 1, "seqlen_k"), ("k", 2, "nheads_k"),
])
def test_size_zero_is_value_error(name, axis, dim):
    shapes = {"q": [2, 5, 4, 16], "k": [2, 7, 2, 16]}
    shapes[name][axis] = 0
    if axis in (0, 3):              # batch and headdim are shared: empty them everywhere
        shapes["q" if name == "k" else "k"][axis] = 0
    q, k = rand(*shapes["q"]), rand(*shapes["k"])
    with pytest.raises(ValueError, match=f"^{name}: {dim} .*must be >= 1, got 0"):
        cf.flash_attention(q, k, k.copy())


def test_headdim_above_256_is_value_error():
    q, k, v = qkv(b=1, sq=2, sk=2, h=1, hk=1, d=257)
    with pytest.raises(ValueError, match="^q: headdim must be <= 256, got 257"):
        cf.flash_attention(q, k, v)


def test_seqlen_of_2_to_the_31_is_value_error():
    # Zero strides give a huge logical array without memory; the check runs before any read.
    q = rand(1, 1, 1, 8)
    k = np.lib.stride_tricks.as_strided(rand(1, 1, 1, 8), shape=(1, 2**31, 1, 8),
                                        strides=(0, 0, 0, 4))
    with pytest.raises(ValueError, match=r"^k: seqlen_k .*must be < 2\*\*31"):
        cf.flash_attention(q, k, k)


@pytest.mark.parametrize("index, name", [(0, "dout"), (4, "out")])
def test_dout_or_out_shape_differs_from_q_is_value_error(index, name):
    args = bwd_args()
    args[index] = np.ascontiguousarray(args[index][:, :-1])
    with pytest.raises(ValueError, match=f"^{name} shape .* must equal q's shape"):
        backward(args)


@pytest.mark.parametrize("bad", [lambda lse: lse[:, :, :-1], lambda lse: lse[:, :1],
                                 lambda lse: lse[..., None],
                                 lambda lse: lse.transpose(0, 2, 1)])
def test_lse_shape_is_value_error(bad):
    args = bwd_args()
    args[5] = np.ascontiguousarray(bad(args[5]))
    with pytest.raises(ValueError, match=r"^lse shape .* must be \(batch, nheads, seqlen_q\)"):
        backward(args)


# --- strides --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_last_dim_not_contiguous_is_value_error(name):
    args = dict(zip("qkv", qkv()))
    args[name] = rand(*args[name].shape[:3], 32)[..., ::2]
    with pytest.raises(ValueError, match=f"^{name}: the last dimension must be contiguous"):
        cf.flash_attention(**args)


def test_last_dim_not_contiguous_in_backward_is_value_error():
    args = bwd_args()
    args[0] = np.repeat(args[0], 2, axis=-1)[..., ::2]
    with pytest.raises(ValueError, match="^dout: the last dimension must be contiguous"):
        backward(args)


def test_headdim_1_with_any_last_stride_is_accepted():
    q, k, v = (a[..., ::4] for a in qkv(b=1, sq=3, sk=4, h=2, hk=1, d=4))
    assert q.shape[-1] == 1 and q.strides[-1] != q.itemsize
    cf.flash_attention(q, k, v)


def test_packed_qkv_slices_are_accepted():
    qkv_packed = rand(2, 9, 3, 4, 16)
    q, k, v = (qkv_packed[:, :, i] for i in range(3))
    cf.flash_attention(q, k, v)


def test_seqlen_sum_beyond_32_bit_positions_is_value_error():
    # Each seqlen alone is fine; their sum would overflow the kernels' 32-bit position math.
    q = np.lib.stride_tricks.as_strided(rand(1, 1, 1, 8), shape=(1, 2**30, 1, 8),
                                        strides=(0, 0, 0, 4))
    with pytest.raises(ValueError, match=r"^seqlen_q \+ seqlen_k must be < 2\*\*31 - 256"):
        cf.flash_attention(q, q, q)


# --- softmax_scale --------------------------------------------------------------------

def test_softmax_scale_overflowing_float32_is_value_error():
    with pytest.raises(ValueError, match="^softmax_scale .* too large for float32"):
        cf.flash_attention(*qkv(), softmax_scale=3e38)
    cf.flash_attention(*qkv(dtype=np.float64), softmax_scale=3e38)   # float64 holds it


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf"), -float("inf")])
def test_bad_softmax_scale_value_is_value_error(scale):
    with pytest.raises(ValueError, match="^softmax_scale must be a finite number > 0"):
        cf.flash_attention(*qkv(), softmax_scale=scale)
    with pytest.raises(ValueError, match="^softmax_scale"):
        backward(bwd_args(), softmax_scale=scale)


@pytest.mark.parametrize("scale", ["0.5", True, 1j, [0.5], np.array([0.5])])
def test_softmax_scale_not_a_real_number_is_type_error(scale):
    with pytest.raises(TypeError, match="^softmax_scale must be a real number"):
        cf.flash_attention(*qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", [0.25, 1, np.float32(0.5), np.float64(2.0)])
def test_real_softmax_scales_are_accepted(scale):
    cf.flash_attention(*qkv(), softmax_scale=scale)


# --- no side effects ------------------------------------------------------------------

def test_inputs_are_unchanged_after_an_error():
    args = bwd_args()
    args[5] = args[5].astype(np.float16)          # bad lse dtype: raises after other checks
    before = [a.copy() for a in args]
    with pytest.raises(TypeError):
        backward(args)
    q, k, v = args[1:4]
    with pytest.raises(ValueError):
        cf.flash_attention(q, k, v, softmax_scale=-1.0)
    for a, b in zip(args, before):
        np.testing.assert_array_equal(a, b)


# --- devices (GPU) --------------------------------------------------------------------

@pytest.mark.gpu
def test_arrays_on_different_devices_is_value_error():
    import cupy as cp
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = qkv()
    with cp.cuda.Device(0):
        q_d, k_d = cp.asarray(q), cp.asarray(k)
    with cp.cuda.Device(1):
        v_d = cp.asarray(v)
    with pytest.raises(ValueError, match="^all arrays must be on one device, got q: 0, k: 0, v: 1"):
        cf.flash_attention(q_d, k_d, v_d)


@pytest.mark.gpu
def test_host_and_device_arrays_mixed_is_type_error():
    import cupy as cp
    q, k, v = qkv()
    with pytest.raises(TypeError, match="one kind"):
        cf.flash_attention(cp.asarray(q), k, v)
