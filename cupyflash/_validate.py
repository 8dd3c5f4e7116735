"""Argument checks, run before any allocation or launch.

The arrays arrive as all NumPy or all CuPy (``_arrays.as_backend`` ran first). Every error
names the argument, says what was expected and what was given, with NumPy's exception types:
TypeError for dtypes and for a softmax_scale, softcap, dropout_p, window_size, seed or offset
that is not a number (or pair of integers, or integer), ValueError for shapes, strides,
devices and values.
"""
import math
import numbers

import numpy as np

from ._config import LOG2E, MAX_GRID_YZ, SEQLEN_SUM_LIMIT

DTYPES = ("float16", "bfloat16", "float32", "float64")

# Dims, seqlens and strides go to the kernels as int32 fields of the params struct.
INT32_LIMIT = 2**31

# (dimension name, axis) of a (batch, seqlen, heads, headdim) tensor, per argument.
_AXES_Q = (("batch", 0), ("seqlen_q", 1), ("nheads", 2), ("headdim", 3))
_AXES_KV = (("batch", 0), ("seqlen_k", 1), ("nheads_k", 2), ("headdim", 3))


def check_flag(name, value):
    """``value`` as a bool. Only bool and NumPy bool are flags: ``"False"`` is truthy, and 2,
    None or an array would silently pick a mode the caller did not name."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} "
                    f"{_short_repr(value)}")


def check_int(name, value, minimum, maximum=None):
    """``value`` as an int in ``[minimum, maximum]``; bools are not integers here."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} "
                        f"{_short_repr(value)}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def _short_repr(value, limit=60):
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_forward(q, k, v, softmax_scale):
    named = {"q": q, "k": k, "v": v}
    _check_dtypes(named)
    _check_ndim(named)
    _check_sizes(q, k, v)
    _check_last_dim_contiguous(named)
    _check_devices(named)
    _check_scale(softmax_scale, q.dtype)


def check_backward(dout, q, k, v, out, lse, softmax_scale):
    named = {"q": q, "k": k, "v": v, "out": out, "dout": dout}
    _check_dtypes(named)
    _check_ndim(named)
    _check_sizes(q, k, v)
    for name in ("out", "dout"):
        _check_shape(name, named[name], "q's shape", q.shape)
    _check_lse(lse, q)
    _check_last_dim_contiguous(named)
    _check_devices({**named, "lse": lse})
    _check_scale(softmax_scale, q.dtype)


def _check_dtypes(named):
    for name, a in named.items():
        if a.dtype.name not in DTYPES:
            raise TypeError(f"{name}: unsupported dtype {a.dtype.name}; expected one of "
                            f"{', '.join(DTYPES)}")
    first, a0 = next(iter(named.items()))
    for name, a in named.items():
        if a.dtype != a0.dtype:
            raise TypeError(f"{name} has dtype {a.dtype.name} but {first} has "
                            f"{a0.dtype.name}; {', '.join(named)} must share one dtype")


def _check_ndim(named):
    for name, a in named.items():
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, nheads, headdim), "
                             f"got {a.ndim}-D shape {tuple(a.shape)}")


def _check_shape(name, a, expected_what, expected):
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{name} shape {tuple(a.shape)} must equal {expected_what} "
                         f"{tuple(expected)}")


def _check_sizes(q, k, v):
    _check_shape("v", v, "k's shape", k.shape)
    for name, a, axes in (("q", q, _AXES_Q), ("k", k, _AXES_KV)):
        for dim, axis in axes:
            n = a.shape[axis]
            if n < 1:
                raise ValueError(f"{name}: {dim} (axis {axis}) must be >= 1, got {n} "
                                 f"(shape {tuple(a.shape)})")
            if n >= INT32_LIMIT:
                raise ValueError(f"{name}: {dim} (axis {axis}) must be < 2**31, got {n}")
    if q.shape[1] + k.shape[1] >= SEQLEN_SUM_LIMIT:
        raise ValueError(f"seqlen_q + seqlen_k must be < 2**31 - 256 (32-bit positions in the "
                         f"kernels), got {q.shape[1]} + {k.shape[1]}")
    for dim, axis in (("batch", 0), ("headdim", 3)):
        if k.shape[axis] != q.shape[axis]:
            raise ValueError(f"k: {dim} {k.shape[axis]} (axis {axis}) does not match "
                             f"q's {dim} {q.shape[axis]}")
    from ._config import MAX_HEADDIM
    if q.shape[3] > MAX_HEADDIM:
        raise ValueError(f"q: headdim must be <= {MAX_HEADDIM}, got {q.shape[3]}")
    nheads, nheads_k = q.shape[2], k.shape[2]
    if nheads % nheads_k:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads_k of k and v "
                         f"({nheads_k})")
    if _is_cupy(q):
        for name, a, dim, axis in (("q", q, "nheads", 2), ("k", k, "nheads_k", 2),
                                   ("q", q, "batch", 0)):
            if a.shape[axis] > MAX_GRID_YZ:
                raise ValueError(f"{name}: {dim} must be <= {MAX_GRID_YZ} on the GPU "
                                 f"(CUDA grid limit), got {a.shape[axis]}")


def _check_lse(lse, q):
    expected = (q.shape[0], q.shape[2], q.shape[1])
    if lse.ndim != 3 or tuple(lse.shape) != expected:
        raise ValueError(f"lse shape {tuple(lse.shape)} must be (batch, nheads, seqlen_q) "
                         f"= {expected}")
    allowed = ("float32", "float64") if q.dtype.name == "float64" else ("float32",)
    if lse.dtype.name not in allowed:
        raise TypeError(f"lse: dtype must be {' or '.join(allowed)} for {q.dtype.name} "
                        f"inputs, got {lse.dtype.name}")


def _check_last_dim_contiguous(named):
    for name, a in named.items():
        item = a.itemsize
        if a.shape[-1] > 1 and a.strides[-1] != item:
            raise ValueError(f"{name}: the last dimension must be contiguous (stride "
                             f"{item} bytes), got strides {a.strides}; use a copy")
        if any(s % item for s in a.strides):
            raise ValueError(f"{name}: strides must be multiples of the item size {item}, "
                             f"got {a.strides}")


def _check_devices(named):
    ids = {name: a.device.id for name, a in named.items() if _is_cupy(a)}
    if len(set(ids.values())) > 1:
        got = ", ".join(f"{name}: {i}" for name, i in ids.items())
        raise ValueError(f"all arrays must be on one device, got {got}")


def _check_scale(scale, dtype):
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got "
                        f"{type(scale).__name__} {_short_repr(scale)}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {scale!r}")
    # Below float64 the kernels hold scale * log2(e) in a float32.
    if dtype != np.float64 and float(scale) * LOG2E >= float(np.finfo(np.float32).max):
        raise ValueError(f"softmax_scale {scale!r} is too large for {dtype} inputs: "
                         f"scale * log2(e) must fit a float32")


def check_window_size(window_size, block_mask):
    """``window_size`` as ``(left, right)`` Python ints, each -1 (unbounded) or >= 0.

    A sliding window together with a block mask is refused for now: the mask's lists are
    built for its own causal rule only."""
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(f"window_size must be a tuple (left, right) of two integers, got "
                        f"{type(window_size).__name__} {_short_repr(window_size)}")
    if len(window_size) != 2:
        raise ValueError(f"window_size must have two entries (left, right), got "
                         f"{len(window_size)}: {_short_repr(window_size)}")
    window = tuple(check_int(f"window_size[{i}]", w, -1, INT32_LIMIT - 1)
                   for i, w in enumerate(window_size))
    if block_mask is not None and window != (-1, -1):
        raise ValueError(f"window_size {window} and block_mask cannot be combined yet; pass "
                         f"window_size=(-1, -1) with a block_mask, or build the window into "
                         f"the mask (cupyflash.masks.sliding_window)")
    return window


def check_softcap(softcap, dtype):
    """``softcap`` as a float >= 0 (0 turns it off). Below float64 the kernels hold it (times
    log2(e)) in a float32: it must neither overflow there nor round to 0, which would turn
    the cap off unasked."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0 = off), got "
                        f"{type(softcap).__name__} {_short_repr(softcap)}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    f32 = np.finfo(np.float32)
    if dtype != np.float64 and softcap and not (
            float(f32.tiny) <= softcap and softcap * LOG2E < float(f32.max)):
        raise ValueError(f"softcap {softcap!r} is out of float32 range for {dtype} inputs "
                         f"(the kernels hold softcap * log2(e) in a float32)")
    return softcap


def check_alibi_slopes(alibi_slopes, q):
    """``alibi_slopes``: float32 (nheads,) or (batch, nheads), on q's device, with a
    contiguous last dimension (float32 only, as FlashAttention 2 takes them)."""
    if alibi_slopes is None:
        return
    b, _, h, _ = q.shape
    if alibi_slopes.dtype.name != "float32":
        raise TypeError(f"alibi_slopes: dtype must be float32, got {alibi_slopes.dtype.name}")
    if alibi_slopes.ndim not in (1, 2) or tuple(alibi_slopes.shape) not in ((h,), (b, h)):
        raise ValueError(f"alibi_slopes shape {tuple(alibi_slopes.shape)} must be (nheads,) "
                         f"= ({h},) or (batch, nheads) = ({b}, {h})")
    _check_last_dim_contiguous({"alibi_slopes": alibi_slopes})
    _check_devices({"q": q, "alibi_slopes": alibi_slopes})


def check_dropout(dropout_p, seed, offset, seed_required=False):
    """``(dropout_p, seed, offset)`` as (float, int or None, int): ``dropout_p`` in [0, 1),
    ``seed`` an integer in [0, 2**64) (uint64 key of the generator), ``offset`` in [0, 2**32).
    ``seed`` None is allowed only where ``dropout_p`` is 0 (unless ``seed_required``): a
    seed drawn silently could not be given to the backward, which must regenerate the mask."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1), got "
                        f"{type(dropout_p).__name__} {_short_repr(dropout_p)}")
    dropout_p = float(dropout_p)
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if seed is None:
        if dropout_p > 0 or seed_required:
            raise ValueError(f"seed must be given (an integer in [0, 2**64)) with dropout_p "
                             f"{dropout_p!r}: the backward needs the same seed and offset to "
                             f"regenerate the mask, so none is drawn implicitly")
    else:
        seed = check_int("seed", seed, 0, 2**64 - 1)
    offset = check_int("offset", offset, 0, 2**32 - 1)
    return dropout_p, seed, offset


def _is_cupy(a):
    return type(a).__module__.split(".")[0] == "cupy"


def check_block_mask(block_mask, q, k):
    """``block_mask`` is a BlockMask whose geometry fits q (batch, seqlen_q, nheads, d) and
    k (batch, seqlen_k, nheads_k, d): same seqlens, heads 1 or nheads."""
    from .masks import BlockMask
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cupyflash.BlockMask or None, got "
                        f"{type(block_mask).__name__}")
    for side, axis_name, mask_len, a in (("seqlen_q", "q", block_mask.seqlen_q, q),
                                         ("seqlen_k", "k", block_mask.seqlen_k, k)):
        if mask_len != a.shape[1]:
            raise ValueError(f"block_mask: {side} {mask_len} does not match {axis_name}'s "
                             f"{side} {a.shape[1]} (block_mask was built for seqlen_q="
                             f"{block_mask.seqlen_q}, seqlen_k={block_mask.seqlen_k}; q has "
                             f"seqlen_q={q.shape[1]}, k has seqlen_k={k.shape[1]})")
    nheads = q.shape[2]
    if block_mask.heads not in (1, nheads):
        raise ValueError(f"block_mask: heads must be 1 or q's nheads ({nheads}), got "
                         f"{block_mask.heads}")
