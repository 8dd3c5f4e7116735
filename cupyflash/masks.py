"""Block-sparse attention masks: ``BlockMask`` and the builders of common layouts.

A ``BlockMask`` says, for each (head, query block, key block), whether the block is attended
to. Blocks are ``block_q x block_k`` elements (each 64 or 128); the last block of each side
may be cut short by the sequence end. Inside a kept block every element (within the sequences)
is visible, unless the mask is ``causal``: then query ``i`` also needs key ``j <= i + seqlen_k -
seqlen_q`` (bottom-right alignment, as ``flash_attention(causal=True)``)::

    seqlen_q = 3 blocks, seqlen_k = 4 blocks,          element rule inside the kept blocks
    blocks (1 = kept):                                  (causal, seqlen_q=2, seqlen_k=5):
        key block   0 1 2 3                               1 1 1 1 0
        q block 0   1 1 0 0                               1 1 1 1 1
        q block 1   0 1 1 0
        q block 2   1 0 1 1

The kernels do not read this boolean grid: they read, per (head, query block), the list of key
blocks to visit, the ``partial`` ones (which need the element mask: causal diagonal, sequence
tail) first, then the full ones; and the transposed lists (per key block, the query blocks that
visit it) for the backward pass. Blocks in which no element is visible are left out of the
lists, so they cost nothing. ``BlockMask.tile_lists`` gives the same lists in units of a
kernel's tiles, which may be smaller than the mask's blocks.

Builders (each returns a ``BlockMask``; ``block_size`` is 64 or 128, or a pair
``(block_q, block_k)``; random ones are deterministic given ``seed``):
``causal``, ``sliding_window``, ``strided``, ``longformer``, ``bigbird``, ``random``, and
``from_mask_mod`` (the blocks of a user rule, ``cupyflash.MaskMod``).
Masks combine with ``&`` (blocks kept by both) and ``|`` (blocks kept by either).
"""
import collections
import functools
import numbers

import numpy as np

from . import _spec, mods
from ._config import MASK_BLOCK_SIZES as BLOCK_SIZES, cdiv
from ._validate import INT32_LIMIT, check_flag, check_int as _check_int

__all__ = ["BlockMask", "TileLists", "causal", "sliding_window", "strided", "longformer",
           "bigbird", "random", "from_mask_mod"]

TILE_MIN, TILE_MAX = 16, 128
# Device copies of the visiting lists kept per mask (see BlockMask.tile_lists).
DEVICE_LISTS_KEPT = 16

TileLists = collections.namedtuple(
    "TileLists", ["kv_idx", "kv_count", "kv_partial", "q_idx", "q_count", "q_partial"])
TileLists.__doc__ = """Visiting lists in units of tiles (int32, C-contiguous).

kv_idx (heads, nqt, nkt): for each (head, query tile), the key tiles to visit, the
    ``kv_partial`` ones that need element masking first, then the full ones (ascending within
    each group), padded with 0 after ``kv_count`` entries.
q_idx (heads, nkt, nqt), q_count, q_partial: the transposed lists (for each key tile, the query
    tiles that visit it), in the same order convention.
"""


# ---------------------------------------------------------------------------------------------
# Argument checks (NumPy style: TypeError for types, ValueError for values, naming the argument)

def _check_seqlen(name, value):
    return _check_int(name, value, 1, INT32_LIMIT - 1)


def _check_seed(seed):
    """Seeds are integers >= 0: None (fresh entropy) would break the promise that the same
    call gives the same mask."""
    return _check_int("seed", seed, 0)


def _block_pair(block_size):
    """``block_size`` (int or pair) -> (block_q, block_k), each 64 or 128."""
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a pair (block_q, block_k), got "
                             f"{block_size!r}")
        pair = tuple(block_size)
    else:
        pair = (block_size, block_size)
    for name, b in zip(("block_q", "block_k"), pair):
        if isinstance(b, bool) or not isinstance(b, numbers.Integral):
            raise TypeError(f"block_size: {name} must be an integer, got {type(b).__name__}")
        if int(b) not in BLOCK_SIZES:
            raise ValueError(f"block_size: {name} must be 64 or 128, got {int(b)}")
    return int(pair[0]), int(pair[1])


def _to_numpy(a, name):
    """A NumPy copy of a NumPy, CuPy or ``__dlpack__`` array (or a nested sequence)."""
    if isinstance(a, np.ndarray):
        return a
    module = type(a).__module__.split(".")[0]
    if module == "cupy":
        return a.get()
    if hasattr(a, "__dlpack__"):
        on_cpu = True
        if hasattr(a, "__dlpack_device__"):
            on_cpu = int(a.__dlpack_device__()[0]) == 1          # kDLCPU
        if on_cpu:
            return np.from_dlpack(a)
        import cupy
        return cupy.from_dlpack(a).get()
    if isinstance(a, (list, tuple)):
        return np.asarray(a)
    raise TypeError(f"{name} must be a NumPy, CuPy or DLPack array of bool, got "
                    f"{type(a).__name__}")


# ---------------------------------------------------------------------------------------------
# Geometry shared by the block lists, density and to_dense

def _visible_counts(tile_q, tile_k, seqlen_q, seqlen_k, window):
    """(nqt, nkt) int64: visible elements of each tile (within the sequences, under the band
    ``window`` of ``_spec.band``), in closed form: no element-level array is built."""
    r0 = np.arange(cdiv(seqlen_q, tile_q), dtype=np.int64) * tile_q
    c0 = np.arange(cdiv(seqlen_k, tile_k), dtype=np.int64) * tile_k
    r1 = np.minimum(r0 + tile_q, seqlen_q)
    c1 = np.minimum(c0 + tile_k, seqlen_k)
    width = (c1 - c0)[None, :]
    # _spec.key_range: row i sees keys [i + shift - left, i + shift + right + 1) clipped to
    # [0, seqlen_k). Of key tile [c0, c1) that is clip(end - c0, 0, w) - clip(begin - c0, 0,
    # w) keys, where the clipping to the sequence changes neither term (c0 >= 0, c1 <=
    # seqlen_k). Each term runs over consecutive integers as i does, so its sum over the rows
    # of a tile is a difference of the prefix sum G(x) = sum_{t=0}^{x-1} clip(t, 0, w).
    left, right = window
    shift = seqlen_k - seqlen_q

    def prefix(x, w):
        x = np.maximum(x, 0)
        ramp = x * (x - 1) // 2
        flat = w * (w + 1) // 2 + (x - w - 1) * w
        return np.where(x <= w + 1, ramp, flat)

    def summed(offset):
        """sum over the tile's rows i of clip(i + offset - c0, 0, w)."""
        t0 = r0[:, None] + offset - c0[None, :]
        t1 = r1[:, None] + offset - c0[None, :]
        return prefix(t1, width) - prefix(t0, width)

    seen = (r1 - r0)[:, None] * width if right < 0 else summed(shift + right + 1)
    return seen if left < 0 else seen - summed(shift - left)


def _sorted_lists(kept, partial):
    """Per row of the last axis: kept entries, partial ones first, each group ascending.
    Returns int32 (idx, count, n_partial), idx padded with 0."""
    rank = np.where(kept, np.where(partial, 0, 1), 2).astype(np.int8)
    order = np.argsort(rank, axis=-1, kind="stable")
    count = kept.sum(axis=-1)
    n_partial = (kept & partial).sum(axis=-1)
    slots = np.arange(kept.shape[-1])
    idx = np.where(slots < count[..., None], order, 0)
    return (np.ascontiguousarray(idx, dtype=np.int32),
            np.ascontiguousarray(count, dtype=np.int32),
            np.ascontiguousarray(n_partial, dtype=np.int32))


def _read_only(a):
    a.flags.writeable = False
    return a


# ---------------------------------------------------------------------------------------------

def _only_grows(counts):
    """Whether each row of ``counts`` (heads, blocks) never falls along the blocks, and some
    row rises."""
    steps = np.diff(counts, axis=1)
    return bool((steps >= 0).all() and (steps > 0).any())


class BlockMask(mods.Live):
    """A block-level attention mask, shared by all heads (``heads == 1``) or one per head.

    Build it with ``BlockMask.from_dense`` or a builder of ``cupyflash.masks``; pass it as
    ``block_mask=`` to ``flash_attention`` and ``flash_attention_backward``. The element mask
    it stands for (``to_dense()``) is: query ``i`` sees key ``j`` iff block ``(i // block_q,
    j // block_k)`` is kept and, if ``causal``, ``j <= i + seqlen_k - seqlen_q``. A call's own
    ``causal=True`` is ANDed with it. A row that sees no key gets output 0 and lse ``-inf``.

    Attributes
    ----------
    block_q, block_k : int
        Block sizes, 64 or 128 each.
    seqlen_q, seqlen_k : int
    causal : bool
        Element-level bottom-right causal rule inside the kept blocks.
    blocks : numpy.ndarray of bool, (heads, ceil(seqlen_q / block_q), ceil(seqlen_k / block_k))
        The kept blocks (read-only host copy).
    kv_indices, kv_counts, kv_partial : numpy.ndarray of int32, (heads, nbq, nbk), (heads, nbq)
        For each (head, query block) the key blocks to visit: the first ``kv_partial`` need
        element masking (causal diagonal or sequence tail), the rest up to ``kv_counts`` are
        full; each group ascending, padded with 0. Kept blocks with no visible element are
        left out.
    q_indices, q_counts, q_partial : numpy.ndarray of int32, (heads, nbk, nbq), (heads, nbk)
        The transposed lists: for each key block, the query blocks that visit it.
    """

    def __init__(self, blocks, block_size=128, *, seqlen_q, seqlen_k, causal=False):
        self._init(blocks, "blocks", block_size, seqlen_q, seqlen_k, causal)

    # A mask built from a user mask_mod (from_mask_mod): the rule, the batch it was classified
    # over (None: any), and its partial blocks (heads, nbq, nbk), where the rule hides some
    # elements and shows others.
    mask_mod = None
    mask_batch = None
    _mod_partial = None

    def _init(self, blocks, name, block_size, seqlen_q, seqlen_k, causal, mod_partial=None):
        """The constructor's work; ``name`` is what the caller called the block grid."""
        block_q, block_k = _block_pair(block_size)
        seqlen_q = _check_seqlen("seqlen_q", seqlen_q)
        seqlen_k = _check_seqlen("seqlen_k", seqlen_k)
        causal = check_flag("causal", causal)
        blocks = _to_numpy(blocks, name)
        if blocks.dtype != np.bool_:
            raise TypeError(f"{name}: dtype must be bool, got {blocks.dtype.name}")
        nbq, nbk = cdiv(seqlen_q, block_q), cdiv(seqlen_k, block_k)
        if blocks.ndim not in (2, 3):
            raise ValueError(f"{name} must be 2-D (nbq, nbk) or 3-D (heads, nbq, nbk), got "
                             f"{blocks.ndim}-D shape {blocks.shape}")
        if blocks.ndim == 2:
            blocks = blocks[None]
        if blocks.shape[0] < 1 or blocks.shape[1:] != (nbq, nbk):
            raise ValueError(
                f"{name} shape {blocks.shape[1:]} (query blocks, key blocks) must be "
                f"(ceil(seqlen_q / block_q), ceil(seqlen_k / block_k)) = "
                f"(ceil({seqlen_q} / {block_q}), ceil({seqlen_k} / {block_k})) = {(nbq, nbk)}"
                + ("" if blocks.shape[0] >= 1 else f", with heads >= 1, got {blocks.shape[0]}"))
        self.block_q, self.block_k = block_q, block_k
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.causal = causal
        self.blocks = _read_only(np.array(blocks, dtype=np.bool_, order="C"))
        self._mod_partial = mod_partial
        lists = self._lists(block_q, block_k, self.causal)
        (self.kv_indices, self.kv_counts, self.kv_partial,
         self.q_indices, self.q_counts, self.q_partial) = (_read_only(a) for a in lists)
        self._host_lists = {(block_q, block_k, self.causal): lists}
        self._device_lists = collections.OrderedDict()
        self._captured_lists = {}

    @classmethod
    def from_dense(cls, block_mask_bool, block_size=128, *, seqlen_q, seqlen_k, causal=False):
        """A mask from a boolean block grid.

        Parameters
        ----------
        block_mask_bool : bool array, (nbq, nbk) or (heads, nbq, nbk)
            NumPy, CuPy or any ``__dlpack__`` array; True where the block is kept. Exactly
            ``nbq = ceil(seqlen_q / block_q)``, ``nbk = ceil(seqlen_k / block_k)``. 2-D means
            one layout shared by all heads; 3-D with heads = nheads gives one per query head.
        block_size : int or (int, int)
            ``block_q`` and ``block_k``, each 64 or 128.
        seqlen_q, seqlen_k : int
        causal : bool
            Also apply the element-level bottom-right causal rule inside the kept blocks.
        """
        mask = cls.__new__(cls)
        mask._init(block_mask_bool, "block_mask_bool", block_size, seqlen_q, seqlen_k, causal)
        return mask

    @functools.cached_property
    def _rows_grow(self):
        """Whether later query blocks never see fewer key blocks than earlier ones, in every
        head, and some see more (causal-like: ``_launch.sm90_grouped``)."""
        return _only_grows(self.kv_counts)

    @functools.cached_property
    def _cols_shrink(self):
        """Whether later key blocks are never seen by more query blocks than earlier ones, in
        every head, and some by fewer (causal-like: ``_launch.sm90_grouped``)."""
        return _only_grows(-self.q_counts)

    # --- inspection --------------------------------------------------------------------------

    @property
    def heads(self):
        return self.blocks.shape[0]

    @property
    def block_size(self):
        return (self.block_q, self.block_k)

    @property
    def shape(self):
        """(heads, nbq, nbk)."""
        return self.blocks.shape

    @property
    def density(self):
        """Fraction of the (heads x seqlen_q x seqlen_k) elements that are visible
        (``to_dense().mean()``, computed at block level)."""
        counts = _visible_counts(self.block_q, self.block_k, self.seqlen_q, self.seqlen_k,
                                 _spec.band(self.causal))
        visible = int((self.blocks * counts[None]).sum())
        return visible / (self.heads * self.seqlen_q * self.seqlen_k)

    def to_dense(self):
        """The element mask, NumPy bool (heads, seqlen_q, seqlen_k): True where query i
        sees key j."""
        dense = self.blocks.repeat(self.block_q, axis=1).repeat(self.block_k, axis=2)
        dense = dense[:, :self.seqlen_q, :self.seqlen_k]
        if self.causal:
            dense = dense & _spec.visible(np.arange(self.seqlen_q), np.arange(self.seqlen_k),
                                          self.seqlen_q, self.seqlen_k, _spec.CAUSAL)
        return np.ascontiguousarray(dense)

    def __repr__(self):
        nbq, nbk = self.blocks.shape[1:]
        return (f"BlockMask(heads={self.heads}, blocks={nbq}x{nbk}, "
                f"block_size=({self.block_q}, {self.block_k}), seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, causal={self.causal}, density={self.density:.4f})")

    # --- combination -------------------------------------------------------------------------

    def _combine_check(self, other, op):
        if not isinstance(other, BlockMask):
            return NotImplemented
        if self.mask_mod is not None or other.mask_mod is not None:
            raise ValueError(f"BlockMask {op}: a mask built from a mask_mod does not combine; "
                             f"write the combined rule into the mask_mod")
        mine = (self.block_q, self.block_k, self.seqlen_q, self.seqlen_k)
        theirs = (other.block_q, other.block_k, other.seqlen_q, other.seqlen_k)
        if mine != theirs:
            raise ValueError(f"BlockMask {op}: both masks need the same (block_q, block_k, "
                             f"seqlen_q, seqlen_k), got {mine} and {theirs}")
        if 1 not in (self.heads, other.heads) and self.heads != other.heads:
            raise ValueError(f"BlockMask {op}: heads must match or one of them be 1, got "
                             f"{self.heads} and {other.heads}")
        return None

    def __and__(self, other):
        """Elements visible under both masks (causal if either is)."""
        bad = self._combine_check(other, "&")
        if bad is NotImplemented:
            return bad
        return BlockMask(self.blocks & other.blocks, self.block_size, seqlen_q=self.seqlen_q,
                         seqlen_k=self.seqlen_k, causal=self.causal or other.causal)

    def __or__(self, other):
        """Elements visible under either mask. Both must have the same ``causal``."""
        bad = self._combine_check(other, "|")
        if bad is NotImplemented:
            return bad
        if self.causal != other.causal:
            raise ValueError(
                "BlockMask |: cannot combine a causal mask with a non-causal one: the causal "
                "rule applies to every kept block of a mask, so the union would need it on "
                "some blocks only; combine masks of equal causal, or pass causal=True to the "
                "attention call instead")
        return BlockMask(self.blocks | other.blocks, self.block_size, seqlen_q=self.seqlen_q,
                         seqlen_k=self.seqlen_k, causal=self.causal)

    # --- visiting lists ----------------------------------------------------------------------

    def _lists(self, tile_q, tile_k, causal):
        """TileLists of NumPy int32 arrays (see ``tile_lists``)."""
        sq, sk = self.seqlen_q, self.seqlen_k
        nqt, nkt = cdiv(sq, tile_q), cdiv(sk, tile_k)
        rows0 = np.arange(nqt, dtype=np.int64) * tile_q      # first row of each query tile
        cols0 = np.arange(nkt, dtype=np.int64) * tile_k
        # Tiles divide blocks, so each tile lies inside one mask block.
        in_block = self.blocks[:, (rows0 // self.block_q)[:, None], (cols0 // self.block_k)[None]]
        window = _spec.band(causal)
        visible = _visible_counts(tile_q, tile_k, sq, sk, window) > 0
        kept = in_block & visible[None]
        # Both ends of the band grow with the row, so the tile's first row decides whether it
        # sees up to the tile's last key (or past the sequence end: the tail predicate), and
        # its last row within the sequence whether it sees the tile's first key.
        _, first_end = _spec.key_range(rows0, sq, sk, window)
        last_begin, _ = _spec.key_range(np.minimum(rows0 + tile_q, sq) - 1, sq, sk, window)
        partial = ((cols0[None, :] + tile_k > first_end[:, None])
                   | (cols0[None, :] < last_begin[:, None]))
        if self._mod_partial is not None:     # tiles of a block the mask_mod cuts
            partial = partial[None] | self._mod_partial[:, (rows0 // self.block_q)[:, None],
                                                        (cols0 // self.block_k)[None]]
        partial = np.broadcast_to(partial, kept.shape)
        kv = _sorted_lists(kept, partial)
        q = _sorted_lists(kept.transpose(0, 2, 1), partial.transpose(0, 2, 1))
        return TileLists(*kv, *q)

    def tile_lists(self, tile_q, tile_k, causal, xp=np):
        """The visiting lists in units of a kernel's tiles.

        Parameters
        ----------
        tile_q, tile_k : int
            Tile sizes, 16..128, dividing ``block_q`` and ``block_k``.
        causal : bool
            The call's causal flag; ORed with ``self.causal``.
        xp : module
            ``numpy`` or ``cupy``; CuPy arrays are placed on the current device.

        Returns
        -------
        TileLists of int32 C-contiguous arrays, ``nqt = ceil(seqlen_q / tile_q)``,
        ``nkt = ceil(seqlen_k / tile_k)``. A tile pair is kept iff its mask block is kept and
        at least one of its elements is visible (sequence bounds, causal); it is partial iff
        some element of it needs masking: ``nt * tile_k + tile_k > end(mt * tile_q)`` or
        ``nt * tile_k < begin(last row of the tile)``, with ``(begin, end) =
        _spec.key_range(row, ...)`` of the band (``end(i) = min(seqlen_k, i + 1 + seqlen_k -
        seqlen_q)`` if causal else ``seqlen_k``; ``begin`` is 0 under causal). Cached per
        (tile_q, tile_k, causal, xp, device, stream): device lists are copied and allocated
        on the stream of the calls that read them, so CuPy's pool can neither hand their
        memory out nor reuse it before those calls are done. The
        ``DEVICE_LISTS_KEPT`` most recently used device copies are kept (a caller that cycles
        through new streams would otherwise grow the cache without end); dropping one is safe
        for the same reason: its memory goes back to the pool on its own stream. Inside a CUDA
        graph capture nothing is copied: the lists of an earlier call on the device serve
        (RuntimeError where there is none) and are kept with the mask for its life.
        """
        for name, t, block in (("tile_q", tile_q, self.block_q), ("tile_k", tile_k,
                                                                   self.block_k)):
            t = _check_int(name, t, TILE_MIN, TILE_MAX)
            if block % t:
                raise ValueError(f"{name} ({t}) must divide the mask's block size ({block})")
        tile_q, tile_k = int(tile_q), int(tile_k)
        causal = check_flag("causal", causal) or self.causal
        host_key = (tile_q, tile_k, causal)
        host = self._host_lists.get(host_key)
        if host is None:
            host = self._host_lists[host_key] = self._lists(tile_q, tile_k, causal)
        if xp.__name__.split(".")[0] == "numpy":
            return host
        key = (tile_q, tile_k, causal, xp.cuda.Device().id, xp.cuda.get_current_stream().ptr)
        from . import _arrays
        if _arrays.capturing(xp):
            return self._lists_for_capture(key, xp)
        lists = self._device_lists.pop(key, None)
        if lists is None:
            lists = TileLists(*(xp.ascontiguousarray(xp.asarray(a)) for a in host))
            if len(self._device_lists) >= DEVICE_LISTS_KEPT:
                self._device_lists.popitem(last=False)
        self._device_lists[key] = lists          # most recently used last
        return lists

    def _lists_for_capture(self, key, xp):
        """Device lists inside a CUDA graph capture, without a copy: those of an earlier call
        on any stream of the device (a capture runs on a stream of its own), kept with the
        mask from then on, out of the recently-used eviction, since the graph reads them at
        every replay."""
        lists = self._captured_lists.get(key[:4])
        if lists is None:
            lists = next((lst for k, lst in reversed(self._device_lists.items())
                          if k[:4] == key[:4]), None)
        if lists is None:
            from . import _arrays
            _arrays.refuse_in_capture(xp, f"this block_mask's lists for {key[0]} x {key[1]} "
                                          f"tiles are copied to the device at the first call "
                                          f"that reads them")
        self._captured_lists[key[:4]] = lists
        return lists


# ---------------------------------------------------------------------------------------------
# Builders

def _geometry(seqlen_q, seqlen_k, block_size):
    """Validated (block_q, block_k, sq, sk) and the first/last element of each block as int64
    column (query) and row (key) vectors."""
    block_q, block_k = _block_pair(block_size)
    sq = _check_seqlen("seqlen_q", seqlen_q)
    sk = _check_seqlen("seqlen_k", seqlen_k)
    r0 = np.arange(cdiv(sq, block_q), dtype=np.int64) * block_q
    c0 = np.arange(cdiv(sk, block_k), dtype=np.int64) * block_k
    r1 = np.minimum(r0 + block_q, sq) - 1
    c1 = np.minimum(c0 + block_k, sk) - 1
    return (block_q, block_k), sq, sk, (r0[:, None], r1[:, None]), (c0[None], c1[None])


def _band_blocks(rows, cols, sq, sk, window):
    """(nbq, nbk) bool: some element of the block lies in the band ``window`` (``_spec.band``,
    ``left + right >= 0``)."""
    (r0, r1), (c0, c1) = rows, cols
    # Both ends of the band move right by one key per row and (left + right >= 0) each row's
    # keys reach the next row's: rows r0..r1 together see the one span [begin(r0), end(r1)).
    begin, _ = _spec.key_range(r0, sq, sk, window)
    _, end = _spec.key_range(r1, sq, sk, window)
    return (begin <= c1) & (c0 < end)


def _two_sided(window):
    """The band ``|i + seqlen_k - seqlen_q - j| < window`` as ``(left, right)``."""
    return (window - 1, window - 1)


def _make(blocks, block_size, sq, sk, causal=False):
    return BlockMask(blocks, block_size, seqlen_q=sq, seqlen_k=sk, causal=causal)


def causal(seqlen_q, seqlen_k, block_size=128):
    """Bottom-right causal attention as a block mask (``causal=True``): the blocks holding any
    key ``j <= i + seqlen_k - seqlen_q``; its element form equals ``causal=True`` exactly."""
    block_size, sq, sk, rows, cols = _geometry(seqlen_q, seqlen_k, block_size)
    return _make(_band_blocks(rows, cols, sq, sk, _spec.CAUSAL), block_size, sq, sk, causal=True)


def sliding_window(seqlen_q, seqlen_k, window, block_size=128):
    """Local band attention at block granularity.

    Key block ``kb`` is kept for query block ``qb`` iff some element pair of the block lies in
    the band ``|i + seqlen_k - seqlen_q - j| < window`` (query ``i`` aligned bottom-right, as
    causal is), i.e. every element of the band is visible, plus whatever else shares a block
    with it. The band is two-sided; pass ``causal=True`` to the call (or ``& causal(...)``)
    for a one-sided window. ``window`` is in elements, >= 1.
    """
    window = _check_int("window", window, 1)
    block_size, sq, sk, rows, cols = _geometry(seqlen_q, seqlen_k, block_size)
    return _make(_band_blocks(rows, cols, sq, sk, _two_sided(window)), block_size, sq, sk)


def strided(seqlen_q, seqlen_k, stride, block_size=128):
    """The Sparse Transformer strided pattern at block granularity.

    Key block ``kb`` is kept for query block ``qb`` iff ``|qb - kb| < stride`` (the local band
    of ``stride`` blocks on each side, on block indices, not aligned to the sequence ends) or
    ``kb % stride == stride - 1`` (the "summary" columns, whose keys every query reads). Two
    sided; combine with ``causal=True`` for the autoregressive form. ``stride`` >= 1 (blocks).
    """
    stride = _check_int("stride", stride, 1)
    block_size, sq, sk, rows, cols = _geometry(seqlen_q, seqlen_k, block_size)
    qb = rows[0] // block_size[0]
    kb = cols[0] // block_size[1]
    blocks = (np.abs(qb - kb) < stride) | (kb % stride == stride - 1)
    return _make(blocks, block_size, sq, sk)


def _global(blocks, global_blocks):
    blocks[:global_blocks, :] = True
    blocks[:, :global_blocks] = True
    return blocks


def longformer(seqlen_q, seqlen_k, window, global_blocks, block_size=128):
    """Longformer: the ``sliding_window`` band (``window`` elements) OR global blocks: the
    first ``global_blocks`` query blocks see every key, and every query sees the first
    ``global_blocks`` key blocks."""
    window = _check_int("window", window, 1)
    global_blocks = _check_int("global_blocks", global_blocks, 0)
    block_size, sq, sk, rows, cols = _geometry(seqlen_q, seqlen_k, block_size)
    blocks = _band_blocks(rows, cols, sq, sk, _two_sided(window))
    return _make(_global(blocks, global_blocks), block_size, sq, sk)


def bigbird(seqlen_q, seqlen_k, window, global_blocks, random_blocks, seed, block_size=128,
            nheads=1):
    """BigBird: ``longformer(window, global_blocks)`` plus, in each query block row (of each
    head if ``nheads > 1``), ``random_blocks`` key blocks drawn uniformly without replacement
    among the ones not already kept (all of them if fewer remain), with
    ``numpy.random.default_rng(seed)``: the same seed (an integer >= 0) gives the same mask."""
    window = _check_int("window", window, 1)
    global_blocks = _check_int("global_blocks", global_blocks, 0)
    random_blocks = _check_int("random_blocks", random_blocks, 0)
    seed = _check_seed(seed)
    nheads = _check_int("nheads", nheads, 1)
    block_size, sq, sk, rows, cols = _geometry(seqlen_q, seqlen_k, block_size)
    base = _global(_band_blocks(rows, cols, sq, sk, _two_sided(window)), global_blocks)
    blocks = np.repeat(base[None], nheads, axis=0)
    draw = np.random.default_rng(seed).random(blocks.shape)
    draw[blocks] = np.inf                        # already kept: never drawn
    ranks = np.argsort(np.argsort(draw, axis=-1, kind="stable"), axis=-1, kind="stable")
    blocks |= (ranks < random_blocks) & np.isfinite(draw)
    return _make(blocks, block_size, sq, sk)


def random(seqlen_q, seqlen_k, density, seed, block_size=128, nheads=1):
    """Each block kept independently with probability ``density`` (per head if ``nheads > 1``),
    drawn with ``numpy.random.default_rng(seed)``: the same seed (an integer >= 0) gives the
    same mask. Rows may end up empty: they give output 0 and lse ``-inf``."""
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise TypeError(f"density must be a real number, got {type(density).__name__}")
    if not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density!r}")
    seed = _check_seed(seed)
    nheads = _check_int("nheads", nheads, 1)
    block_size, sq, sk, rows, cols = _geometry(seqlen_q, seqlen_k, block_size)
    shape = (nheads, rows[0].shape[0], cols[0].shape[1])
    return _make(np.random.default_rng(seed).random(shape) < float(density), block_size, sq, sk)


def from_mask_mod(mask_mod, seqlen_q, seqlen_k, *, batch=None, nheads=None, block_size=128,
                  causal=False):
    """The BlockMask of a user rule: blocks where ``mask_mod`` shows no element are left out,
    blocks where it shows every element are full, the others partial (the kernels evaluate the
    rule per element there only). Pass the result as ``block_mask=`` to both passes.

    Parameters
    ----------
    mask_mod : cupyflash.MaskMod, or a callable ``(b, h, q_idx, kv_idx) -> bool`` (NumPy)
    seqlen_q, seqlen_k : int
    batch, nheads : int, optional
        The batch size and number of query heads of the calls. None promises that the rule
        does not depend on ``b`` (``h``): it is classified at 0 only, as FlexAttention's
        ``B=None`` / ``H=None``. Given, every (b, h) is classified; the blocks are per head
        (``heads = nheads``) and shared by the batch (a block is skipped only where it is
        empty for every batch entry, and full only where it is full for all).
    block_size : int or (int, int)
        64 or 128 per side.
    causal : bool
        Also apply the built-in causal rule (its diagonal needs no user code).

    The rule is classified on the GPU when the mask_mod has CUDA code and its arrays are on
    the GPU (or it has none and CuPy sees a GPU); else on the CPU with its ``python`` rule.
    Either way the block grid comes back to the host once (``nbq x nbk`` per head).
    """
    mask_mod = mods.as_mask_mod(mask_mod)
    return classify_mask_mod(mask_mod, seqlen_q, seqlen_k, batch=batch, nheads=nheads,
                             block_size=block_size, causal=causal, on_gpu=_on_gpu(mask_mod))


def classify_mask_mod(mask_mod, seqlen_q, seqlen_k, *, batch, nheads, block_size=128,
                      causal=False, on_gpu):
    """``from_mask_mod`` of a ``mods.MaskMod``, on the GPU or on the CPU as ``on_gpu`` says."""
    block_q, block_k = _block_pair(block_size)
    seqlen_q = _check_seqlen("seqlen_q", seqlen_q)
    seqlen_k = _check_seqlen("seqlen_k", seqlen_k)
    nb = 1 if batch is None else _check_int("batch", batch, 1, INT32_LIMIT - 1)
    nh = 1 if nheads is None else _check_int("nheads", nheads, 1, INT32_LIMIT - 1)
    if on_gpu:
        counts = _classify_gpu(mask_mod, seqlen_q, seqlen_k, block_q, block_k, nh, nb)
    else:
        counts = _classify_numpy(mask_mod, seqlen_q, seqlen_k, block_q, block_k, nh, nb)
    full = counts == nb * _visible_counts(block_q, block_k, seqlen_q, seqlen_k, _spec.NO_WINDOW)
    kept = counts > 0
    mask = BlockMask.__new__(BlockMask)
    mask.mask_mod, mask.mask_batch = mask_mod, batch
    mask._init(kept, "mask_mod", (block_q, block_k), seqlen_q, seqlen_k, causal,
               mod_partial=kept & ~full)
    return mask


def _on_gpu(mask_mod):
    from . import _arrays, _gpu
    if mask_mod.cuda is None:
        return False
    kinds = {_arrays.framework(a) for a in mask_mod.arrays.values()}
    if kinds:
        return kinds != {"numpy"}
    return _gpu.gpu_or_reason()[0] is not None


def _classify_gpu(mask_mod, seqlen_q, seqlen_k, block_q, block_k, heads, batch):
    import cupy
    from . import _arrays, _launch
    if mask_mod.cuda is None:
        raise ValueError("mask_mod has no CUDA rule (cuda=) to classify its blocks on the GPU")
    text = mods.prelude(None, mask_mod)
    mods.check_prelude(text)
    arrays = []
    if mask_mod.arrays:
        names = [f"mask_mod array {n!r}" for n in mask_mod.arrays]
        arrays, _, _ = _arrays.as_backend(tuple(mask_mod.arrays.values()), names)
        arrays = [cupy.ascontiguousarray(a) for a in arrays]
    return _launch.classify_blocks(text, arrays, seqlen_q, seqlen_k, block_q, block_k, heads,
                                   batch).get()


def _classify_numpy(mask_mod, seqlen_q, seqlen_k, block_q, block_k, heads, batch):
    if mask_mod.python is None:
        raise ValueError("mask_mod: no python rule to classify its blocks on the CPU (give "
                         "MaskMod(python=...), or CUDA code with arrays on the GPU)")
    arrays = {n: _to_numpy(a, f"mask_mod array {n!r}") for n, a in mask_mod.arrays.items()}
    nbq, nbk = cdiv(seqlen_q, block_q), cdiv(seqlen_k, block_k)
    counts = np.zeros((heads, nbq, nbk), np.int64)
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(heads)[None, :, None, None]
    cols = np.arange(seqlen_k)
    for i in range(nbq):
        rows = np.arange(i * block_q, min((i + 1) * block_q, seqlen_q))
        seen = np.broadcast_to(mask_mod.python(b, h, rows[None, None, :, None],
                                               cols[None, None, None, :], **arrays),
                               (batch, heads, len(rows), seqlen_k))
        per_key = seen.sum(axis=(0, 2))                           # (heads, seqlen_k)
        pad = nbk * block_k - seqlen_k
        counts[:, i] = np.pad(per_key, ((0, 0), (0, pad))).reshape(heads, nbk, block_k).sum(-1)
    return counts
