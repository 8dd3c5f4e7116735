"""Attention from a KV cache, for decoding and chunked prefill (FlashAttention's
``flash_attn_with_kvcache``)."""
import dataclasses
import sys

import numpy as np

from . import _arrays, _config, _spec, _validate
from .api import _CHECKED, _as_backend, _call_spec, _checked_caller, _remember, _signature


def flash_attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens,
                                 block_table=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, softmax_scale=None,
                                 num_splits=0, return_lse=False, check_lengths=True):
    """Attention of a few new queries per sequence over the keys of a KV cache, after
    appending the new keys and values to it.

    Parameters
    ----------
    q : array, (batch, seqlen_q, nheads, headdim)
        The new queries (1 per sequence when decoding, a chunk of the prompt in chunked
        prefill).
    k_cache, v_cache : arrays, updated in place
        Contiguous: (batch, capacity, nheads_k, headdim), entry ``b``'s keys at rows
        ``0 .. cache_seqlens[b] - 1``. Paged (with ``block_table``): (num_pages, page_size,
        nheads_k, headdim), ``page_size`` a multiple of 16; entry ``b``'s key ``j`` at row
        ``j % page_size`` of page ``block_table[b, j // page_size]``. q's dtype and kind.
    k, v : arrays, optional
        (batch, seqlen_new, nheads_k, headdim): keys and values written into the caches at
        rows ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1`` before attending, as
        FlashAttention does (``cache_seqlens`` itself is the caller's to advance).
    cache_seqlens : int or int32 array (batch,)
        Keys in each entry's cache before this call. Entry ``b`` then attends to its first
        ``cache_seqlens[b] + seqlen_new`` keys.
    block_table : int32 array (batch, pages_per_seq), optional
        The pages of each entry (paged caches).
    causal, window_size, softcap, alibi_slopes, softmax_scale, return_lse
        As for ``flash_attention``, with the mask aligned to each entry's bottom-right
        corner: query ``i`` sees key ``j <= i + cache_seqlens[b] + seqlen_new - seqlen_q``.
    num_splits : int
        Split each entry's keys over this many thread blocks, merged by their lse (split-KV,
        for few long sequences), at most 128 (as FlashAttention; a larger count runs 128);
        0 picks it from the SM count and the lengths.

    check_lengths : bool
        True (the default): the lengths and the block table are read to the host and checked
        before anything is written (a copy of a few bytes that waits for the stream): an
        append past the capacity or a page index out of range raises ValueError and leaves
        the caches untouched. False: they are not read (no copy, no wait; FlashAttention's
        behaviour) and are trusted, as inside a CUDA graph capture, where they cannot be
        read: wrong ones write and read out of place, unreported. Trusted lengths need the
        decode kernels (fp16/bf16, rows 16-byte aligned); the grids then cover the capacity.
        NumPy inputs are always checked.

    Returns
    -------
    out like q, or ``(out, lse)`` with lse (batch, nheads, seqlen_q).
    """
    lengths_array = hasattr(cache_seqlens, "shape")
    key = _signature((q, k_cache, v_cache, k, v, cache_seqlens if lengths_array else None, block_table,
                      alibi_slopes),
                     ("kvcache", None if lengths_array else cache_seqlens, causal, window_size, softcap,
                      softmax_scale, num_splits, return_lse, check_lengths))
    checked = _CHECKED.get(key)
    if checked is not None:
        spec, scale, causal, window_size, softcap, num_splits, return_lse, check_lengths = checked
        cache = _Cache(q.shape[0], k_cache, block_table, cache_seqlens if lengths_array else None,
                       None if lengths_array else cache_seqlens, 0 if k is None else k.shape[1])
        with _arrays.launch_context(_checked_caller(q)):
            out, lse = _gpu(sys.modules["cupy"], cache, q, k_cache, v_cache, k, v, spec, scale, alibi_slopes,
                            num_splits, causal, window_size, softcap, check_lengths)
        return (out, lse) if return_lse else out
    causal = _validate.check_flag("causal", causal)
    return_lse = _validate.check_flag("return_lse", return_lse)
    check_lengths = _validate.check_flag("check_lengths", check_lengths)
    window_size = _validate.check_window_size(window_size, None)
    num_splits = _validate.check_int("num_splits", num_splits, 0, 1024)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and their values)")
    seqlens_int = None
    if not lengths_array:
        seqlens_int = _validate.check_int("cache_seqlens", cache_seqlens, 0, _validate.INT32_LIMIT - 1)
    names = ["q", "k_cache", "v_cache"]
    arrays = [q, k_cache, v_cache]
    for name, a in (("k", k), ("v", v), ("cache_seqlens", None if seqlens_int is not None else cache_seqlens),
                    ("block_table", block_table)):
        if a is not None:
            names.append(name)
            arrays.append(a)
    converted, alibi_slopes, _, kind, xp = _as_backend(arrays, names, alibi_slopes)
    got = dict(zip(names, converted))
    q, k_cache, v_cache = got["q"], got["k_cache"], got["v_cache"]
    k, v, block_table = got.get("k"), got.get("v"), got.get("block_table")
    seqlens = got.get("cache_seqlens")
    _validate.check_kvcache(q, k_cache, v_cache, k, v, seqlens, block_table, softmax_scale)
    cache = _Cache(q.shape[0], k_cache, block_table, seqlens, seqlens_int,
                   0 if k is None else k.shape[1])
    spec, scale = _call_spec(q, k_cache, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             0.0, None, None, "")
    spec = dataclasses.replace(spec, seq=_spec.SEQ_PAGED if cache.paged else _spec.SEQ_CACHE)
    _remember(key, (spec, scale, causal, window_size, softcap, num_splits, return_lse, check_lengths))
    with _arrays.launch_context(kind):
        if xp is np:
            lens = cache.host_lengths()
            _append(np, cache, k_cache, v_cache, k, v, lens)
            out, lse = _gathered(np, cache, q, k_cache, v_cache, lens, causal, window_size, softcap,
                                 alibi_slopes, scale)
        else:
            out, lse = _gpu(xp, cache, q, k_cache, v_cache, k, v, spec, scale, alibi_slopes,
                            num_splits, causal, window_size, softcap, check_lengths)
        out = _arrays.to_caller(out, kind)
        return (out, _arrays.to_caller(lse, kind)) if return_lse else out


def _append(xp, cache, k_cache, v_cache, k, v, lens):
    """The new keys and values into the caches (the host path, and the GPU's gathered one)."""
    if k is None:
        return
    b_idx, pos = cache.new_positions(lens)
    page, row = cache.cache_rows(b_idx, pos)
    k_cache[page, row] = k.reshape((-1,) + k.shape[2:])
    v_cache[page, row] = v.reshape((-1,) + v.shape[2:])


def _gathered(xp, cache, q, k_cache, v_cache, lens, causal, window_size, softcap, alibi_slopes, scale):
    """Each entry's keys gathered from the cache into a packed batch, then
    flash_attention_varlen: the path of the NumPy arrays, of the dtypes and head dims the
    decode kernels do not take, and the gather-then-attend baseline."""
    from .varlen import flash_attention_varlen
    b, sq, h, d = q.shape
    keys = lens.keys
    b_idx = np.repeat(np.arange(b), keys)
    pos = np.concatenate([np.arange(n) for n in keys]) if keys.sum() else np.zeros(0, np.int64)
    page, row = cache.cache_rows(b_idx, pos)
    packed_k = k_cache[xp.asarray(page), xp.asarray(row)]
    packed_v = v_cache[xp.asarray(page), xp.asarray(row)]
    cu_q = xp.asarray(np.arange(0, b * sq + 1, sq, dtype=np.int32))
    cu_k = xp.asarray(np.concatenate([[0], np.cumsum(keys)]).astype(np.int32))
    if packed_k.shape[0] == 0:   # no keys anywhere: every row sees none
        return xp.zeros(q.shape, q.dtype), xp.full((b, h, sq), -np.inf, _config.lse_dtype(q.dtype))
    out, lse = flash_attention_varlen(q.reshape(b * sq, h, d), packed_k, packed_v, cu_q, cu_k, causal=causal,
                                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                      softmax_scale=scale, return_lse=True)
    return out.reshape(q.shape), xp.ascontiguousarray(lse.reshape(h, b, sq).transpose(1, 0, 2))


def _gpu(cp, cache, q, k_cache, v_cache, k, v, spec, scale, alibi_slopes, num_splits, causal,
         window_size, softcap, check_lengths):
    from . import _launch
    capturing = _arrays.capturing(cp)
    decode = _launch.decode_supported(spec, q, k_cache, v_cache, k, v)
    if not decode and (capturing or not check_lengths):
        gather = ("flash_attention_with_kvcache gathers the cache on the host for these inputs "
                  "(not fp16/bf16, or rows not 16-byte aligned), which reads the lengths: ")
        if capturing:
            raise RuntimeError(gather + "that cannot run inside a CUDA graph capture")
        raise ValueError(gather + "check_lengths=False cannot skip the read there")
    lens = None if capturing or not check_lengths else cache.host_lengths()
    layout = cache.layout(lens)
    _launch.check_supported(spec, None)
    if k is not None:
        _launch.kvcache_append(k_cache, v_cache, k, v, layout)
    if not decode:
        return _gathered(cp, cache, q, k_cache, v_cache, lens, causal, window_size, softcap,
                         alibi_slopes, scale)
    out = cp.empty(q.shape, q.dtype)
    lse = cp.empty((q.shape[0], q.shape[2], q.shape[1]), _config.lse_dtype(q.dtype))
    with _arrays.scratch(cp):
        _launch.decode(q, k_cache, v_cache, out, lse, scale, spec, alibi_slopes, layout, num_splits)
    return out, lse


class _Lengths:
    """A cache's lengths read to the host and checked: ``start`` (cache_seqlens) and ``keys``
    (after the append), int64 NumPy arrays."""

    def __init__(self, start, keys):
        self.start, self.keys = start, keys


class _Cache:
    """Where an entry's keys are: rows of its slice of a contiguous cache, or of its pages."""

    def __init__(self, batch, k_cache, block_table, seqlens, seqlens_int, new_keys):
        self.batch, self.block_table, self.new_keys = batch, block_table, new_keys
        self.seqlens, self.seqlens_int = seqlens, seqlens_int
        self.paged = block_table is not None
        self.page_size = k_cache.shape[1]
        self.capacity = (block_table.shape[1] * self.page_size) if self.paged else k_cache.shape[1]
        self.num_pages = k_cache.shape[0]

    def host_lengths(self):
        """The lengths and the block table on the host, checked: the append fits each entry's
        capacity, the pages it uses exist."""
        given = [a for a in (self.seqlens, self.block_table) if a is not None]
        if given and not isinstance(given[0], np.ndarray):
            given = _arrays.HostCopy(given).wait()
        given = iter(given)
        start = (np.full(self.batch, self.seqlens_int, np.int64) if self.seqlens is None
                 else np.asarray(next(given), np.int64))
        keys = start + self.new_keys
        table = np.asarray(next(given), np.int64) if self.paged else None
        _validate.check_cache_lengths(start, keys, self.capacity, table, self.page_size, self.num_pages)
        self.table_host = table
        return _Lengths(start, keys)

    def new_positions(self, lens):
        """(entry, position) of each appended row, host arrays in (entry, row) order."""
        b_idx = np.repeat(np.arange(self.batch), self.new_keys)
        pos = (lens.start[:, None] + np.arange(self.new_keys)[None, :]).reshape(-1)
        return b_idx, pos

    def cache_rows(self, b_idx, pos):
        """(first index, row) of the cache tensors holding entry ``b_idx``'s key ``pos``."""
        if not self.paged:
            return b_idx, pos
        return self.table_host[b_idx, pos // self.page_size], pos % self.page_size

    def layout(self, lens):
        """The kernels' view (_launch.Cache): device lengths, the table, the longest entry
        (the capacity where the lengths could not be read)."""
        import cupy as cp
        from . import _launch
        seqlens = self.seqlens
        if seqlens is None:
            seqlens = cp.full(self.batch, self.seqlens_int, cp.int32)
        longest = int(lens.keys.max()) if lens is not None else self.capacity
        return _launch.Cache(cp.ascontiguousarray(seqlens), None if not self.paged else cp.ascontiguousarray(self.block_table),
                             self.new_keys, self.page_size if self.paged else 0,
                             self.block_table.shape[1] if self.paged else 0, longest)
