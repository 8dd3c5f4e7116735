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


def check_alibi_slopes(alibi_slopes, q, batch=None):
    """``alibi_slopes``: float32 (nheads,) or (batch, nheads), on q's device, with a
    contiguous last dimension (float32 only, as FlashAttention 2 takes them). ``batch``:
    the number of sequences where it is not q's first dimension (a packed batch)."""
    if alibi_slopes is None:
        return
    b, _, h, _ = q.shape
    b = b if batch is None else batch
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


def check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale):
    """A packed call's arrays (cupyflash.varlen): q (total_q, nheads, headdim), k and v
    (total_k, nheads_k, headdim), int32 offsets of batch + 1 entries each; then the dense
    call's checks on the (1, total, nheads, headdim) views."""
    named = {"q": q, "k": k, "v": v}
    for name, a in named.items():
        if a.ndim != 3:
            raise ValueError(f"{name} must be 3-D ({'total_q' if name == 'q' else 'total_k'}, "
                             f"nheads, headdim) for a packed batch, got {a.ndim}-D shape "
                             f"{tuple(a.shape)}")
    _check_shape("v", v, "k's shape", k.shape)
    for name, a, dims in (("q", q, ("total_q", "nheads", "headdim")),
                          ("k", k, ("total_k", "nheads_k", "headdim"))):
        for axis, dim in enumerate(dims):
            if a.shape[axis] < 1:
                raise ValueError(f"{name}: {dim} (axis {axis}) must be >= 1, got "
                                 f"{a.shape[axis]} (shape {tuple(a.shape)})")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k: headdim {k.shape[2]} (axis 2) does not match q's headdim "
                         f"{q.shape[2]}")
    for name, c in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if c.dtype.name != "int32":
            raise TypeError(f"{name}: dtype must be int32, got {c.dtype.name}")
        if c.ndim != 1 or c.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape "
                             f"{tuple(c.shape)}")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.shape[0]} entries but cu_seqlens_q "
                         f"has {cu_seqlens_q.shape[0]}: both must be batch + 1")
    batch = cu_seqlens_q.shape[0] - 1
    if _is_cupy(q) and batch > MAX_GRID_YZ:
        raise ValueError(f"cu_seqlens_q: batch must be <= {MAX_GRID_YZ} on the GPU (CUDA grid "
                         f"limit), got {batch}")
    _check_devices({"q": q, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k})
    check_forward(q[None], k[None], v[None], softmax_scale)


def check_cu_seqlens(name, offsets, total, max_seqlen):
    """Host int32 ``offsets`` of a packed batch: 0 first, ``total`` (the rows of its array)
    last, never decreasing. Returns the longest sequence's length, which ``max_seqlen``
    (None: not given) must not be below."""
    offsets = np.asarray(offsets, np.int64)
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {offsets[0]}")
    lengths = np.diff(offsets)
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must not decrease: {name}[{i + 1}] = {offsets[i + 1]} < "
                         f"{name}[{i}] = {offsets[i]}")
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1] = {offsets[-1]} must equal the packed array's rows "
                         f"({total})")
    longest = int(lengths.max())
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen_{name[-1]} = {max_seqlen} is below the longest "
                         f"sequence of {name} ({longest})")
    return longest


def check_like(name, a, ref_name, ref):
    """``a`` has ``ref``'s shape and dtype."""
    _check_shape(name, a, f"{ref_name}'s shape", ref.shape)
    if a.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {a.dtype.name} but {ref_name} has {ref.dtype.name}")
    _check_last_dim_contiguous({name: a})
    _check_devices({ref_name: ref, name: a})


def check_packed_lse(lse, q):
    """A packed forward's lse: (nheads, total_q), float32 (or float64 for float64 q)."""
    expected = (q.shape[1], q.shape[0])
    if lse.ndim != 2 or tuple(lse.shape) != expected:
        raise ValueError(f"lse shape {tuple(lse.shape)} must be (nheads, total_q) = {expected}")
    allowed = ("float32", "float64") if q.dtype.name == "float64" else ("float32",)
    if lse.dtype.name not in allowed:
        raise TypeError(f"lse: dtype must be {' or '.join(allowed)} for {q.dtype.name} "
                        f"inputs, got {lse.dtype.name}")
    _check_devices({"q": q, "lse": lse})


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale):
    """flash_attention_with_kvcache's arrays: q (batch, seqlen_q, nheads, headdim); the caches
    (batch, capacity, nheads_k, headdim), or pages (num_pages, page_size, nheads_k, headdim)
    with an int32 (batch, pages_per_seq) block_table, page_size a multiple of 16; the new k, v
    (batch, seqlen_new, nheads_k, headdim); int32 (batch,) cache_seqlens."""
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k is not None:
        named.update(k=k, v=v)
    _check_dtypes(named)
    _check_ndim(named)
    _check_last_dim_contiguous(named)
    batch, _, nheads, d = q.shape
    for name, n in (("q: batch", batch), ("q: seqlen_q", q.shape[1]), ("q: nheads", nheads),
                    ("q: headdim", d), ("k_cache: nheads_k", k_cache.shape[2])):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    _check_shape("v_cache", v_cache, "k_cache's shape", k_cache.shape)
    if k_cache.shape[3] != d:
        raise ValueError(f"k_cache: headdim {k_cache.shape[3]} (axis 3) does not match q's headdim {d}")
    from ._config import MAX_HEADDIM
    if d > MAX_HEADDIM:
        raise ValueError(f"q: headdim must be <= {MAX_HEADDIM}, got {d}")
    if nheads % k_cache.shape[2]:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads_k of the caches "
                         f"({k_cache.shape[2]})")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache: batch {k_cache.shape[0]} (axis 0) does not match q's batch "
                             f"{batch} (a paged cache needs block_table)")
    else:
        if block_table.dtype.name != "int32":
            raise TypeError(f"block_table: dtype must be int32, got {block_table.dtype.name}")
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table shape {tuple(block_table.shape)} must be (batch, "
                             f"pages_per_seq) with batch {batch}")
        if k_cache.shape[1] % 16:
            raise ValueError(f"k_cache: page_size {k_cache.shape[1]} (axis 1) must be a multiple of 16")
    if cache_seqlens is not None:
        if cache_seqlens.dtype.name != "int32":
            raise TypeError(f"cache_seqlens: dtype must be int32, got {cache_seqlens.dtype.name}")
        if tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens shape {tuple(cache_seqlens.shape)} must be (batch,) = ({batch},)")
    if k is not None:
        expected = (batch, k.shape[1]) + tuple(k_cache.shape[2:])
        for name, a in (("k", k), ("v", v)):
            if tuple(a.shape) != expected or a.shape[1] < 1:
                raise ValueError(f"{name} shape {tuple(a.shape)} must be (batch, seqlen_new, nheads_k, "
                                 f"headdim) = {expected} with seqlen_new >= 1")
    _check_devices({**named, **({"cache_seqlens": cache_seqlens} if cache_seqlens is not None else {}),
                    **({"block_table": block_table} if block_table is not None else {})})
    _check_scale(softmax_scale, q.dtype)


def check_cache_lengths(start, keys, capacity, table, page_size, num_pages):
    """Host lengths of a KV cache: cache_seqlens >= 0, the keys after the append within the
    capacity, and (paged) every page an entry uses in [0, num_pages)."""
    if (start < 0).any():
        b = int(np.argmax(start < 0))
        raise ValueError(f"cache_seqlens[{b}] = {start[b]} must be >= 0")
    if (keys > capacity).any():
        b = int(np.argmax(keys > capacity))
        raise ValueError(f"the cache is too small for the append: entry {b} would hold {keys[b]} keys "
                         f"(cache_seqlens[{b}] = {start[b]} plus {keys[b] - start[b]} new), its capacity "
                         f"is {capacity}")
    if table is not None:
        used = np.arange(table.shape[1])[None, :] * page_size < keys[:, None]
        bad = used & ((table < 0) | (table >= num_pages))
        if bad.any():
            b, j = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(f"block_table[{b}, {j}] = {table[b, j]} is out of range for {num_pages} pages")
