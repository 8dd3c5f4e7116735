"""Hypothesis strategies for fuzzing cupyflash, built around one frozen description of a call.

A ``Case`` holds everything a call and its check need (dtype, shape, causal, softmax_scale,
window_size, softcap, ALiBi, dropout, user mods, memory layout, block mask, deterministic flag
and the seed of the random inputs) as plain values, so that its repr is a complete, runnable
reproducer: ``Case(...).inputs(np)`` gives the same arrays every time,
``Case(...).block_mask()`` the same mask, ``Case(...).variant(np)`` the same variant keywords
(ALiBi slopes included), ``Case(...).dropout`` the dropout keywords,
``Case(...).dropout_scale(np)`` the reference's dropout multiplier, ``Case(...).user_mods(np)``
the ``score_mod``/``mask_mod`` keywords (their arrays drawn from ``mods.seed``) and
``Case(...).dense_score_mod(np)`` / ``Case(...).element_mask(...)`` the reference's spelling of
them.

Strategies are small pieces that a test composes::

    cases(dtype=st.sampled_from(HALF),
          shape=shapes(max_seqlen=2048, ...),       # the sizes, under a work budget
          layout=layouts,                           # shape -> strategy, like the rest:
          mask=block_masks,                         #   they depend on the drawn shape
          deterministic=st.just(True))

A new call feature (dropout, ...) becomes one more field of ``Case`` with a default that turns
it off, one more keyword of ``cases`` whose default draws that value, and whatever the feature
needs in ``inputs``/``block_mask``/``variant``; existing tests keep drawing the same cases
(``window_size``, ``softcap``, ``alibi``, ``dropout`` and ``mods`` came in this way:
``windows``, ``softcaps``, ``alibis``, ``dropouts``, ``user_mods``).

User mods come from a small fixed library (``SCORE_MODS``, ``MASK_MODS``): the GPU compiles
its kernels per snippet text, so the texts are a fixed handful and only the contents of their
arrays vary with the case. Each entry holds its CUDA snippets, its Python rules for the NumPy
path, and a dense spelling of the same rule for tests/reference.py, written apart from the
Python rule so that a wrong rule on either path shows as a mismatch.

Packed batches and KV caches have descriptions of their own (``PackedCase``, ``CacheCase``,
drawn by ``packed_cases`` and ``cache_cases``), reproducible the same way.

Helpers shared by the fuzz tests live here too: ``Case.visibility`` (which query rows and keys
see nothing), ``assert_zero_where_unseen`` (exact zeros there), the settings profiles and the
per-family example counts printed at the end of the pytest session.
"""
import collections
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from hypothesis import HealthCheck, reject, settings
from hypothesis import strategies as st

import cupyflash as cf
from cupyflash import masks

try:
    from reference import dropout_scale, get_xp, np_dtype, random_array, visible
except ImportError:
    from tests.reference import dropout_scale, get_xp, np_dtype, random_array, visible

# The keys gpu_checks.DTYPES uses, and the dtype each stands for.
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
HALF = ("bf16", "fp16")
PLAIN = ("fp32", "fp64")

MAX_HEADDIM = 256
MASK_BLOCK_SIZES = (64, 128)
MASK_BUILDERS = ("grid", "causal", "sliding_window", "strided", "longformer", "bigbird",
                 "random")
# Builders that can give each query head its own layout.
PER_HEAD_BUILDERS = ("grid", "random", "bigbird")
LAYOUT_KINDS = ("contiguous", "qkv_packed", "kv_packed", "padded")

# Lengths that sit on, just below and just above the tile and mask-block edges (16, 32, 64 and
# 128 rows or keys), and the odd ones of DESIGN.md; drawn alongside arbitrary lengths.
SPECIAL_SEQLENS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 127, 128, 129, 191, 192,
                   193, 255, 256, 257, 383, 511, 512, 513, 1023, 1024, 1025, 2047, 2048)
# Head dims at the edges of the head-dim buckets (32, 64, ..., 256), powers of two and not.
SPECIAL_HEADDIMS = (1, 2, 3, 8, 16, 24, 31, 32, 33, 40, 59, 63, 64, 65, 80, 96, 97, 111, 127,
                    128, 129, 160, 161, 192, 200, 224, 225, 255, 256)


# ---------------------------------------------------------------------------------------------
# The frozen descriptions

@dataclass(frozen=True)
class Shape:
    batch: int
    sq: int
    sk: int
    nheads: int
    nheads_k: int
    d: int


@dataclass(frozen=True)
class Layout:
    """How q, k, v and dout sit in memory (always with a contiguous last dimension).

    - ``contiguous``: four separate C-contiguous arrays.
    - ``qkv_packed`` (seqlen_q == seqlen_k): q, k and v are head slices of one (batch, seqlen,
      nheads + 2 * nheads_k, d) buffer; with nheads == nheads_k that is exactly a (batch,
      seqlen, 3, nheads, d) qkv buffer.
    - ``kv_packed``: k and v are slices of one (batch, seqlen_k, nheads_k, 2, d) buffer; q and
      dout are stored head-major (batch, nheads, seqlen, d) and seen through a transposed view.
    - ``padded``: each tensor is the view ``buf[pb:, ps:, ph:, pd:pd + d]`` of a bigger buffer
      with ``pad = (pb, ps, ph, pd)`` elements of room before it along each axis: wider batch,
      row and head strides, and base pointers and rows that need not be 16-byte aligned.
    The rest of every buffer holds random data too, so a read of the wrong element shows.
    """
    kind: str = "contiguous"
    pad: tuple = (0, 0, 0, 0)


@dataclass(frozen=True)
class MaskSpec:
    """A ``BlockMask`` as the values that build it (``build``).

    ``builder`` is ``"grid"`` (``BlockMask.from_dense`` of a random block grid, each block kept
    with probability ``density``) or the name of a builder in ``cupyflash.masks``. ``heads``:
    1 (one layout for every head) or the call's nheads (grid, random, bigbird). ``causal``: the
    mask's own element-level causal rule: ``from_dense(causal=True)`` for a grid, ``& masks.
    causal(...)`` for the other builders (``masks.causal`` always has it). The remaining fields
    are the builders' parameters; ``seed`` draws the grid and the random blocks.
    """
    builder: str
    block_q: int = 128
    block_k: int = 128
    heads: int = 1
    causal: bool = False
    density: float = 0.5
    window: int = 1
    stride: int = 1
    global_blocks: int = 0
    random_blocks: int = 0
    seed: int = 0

    def build(self, seqlen_q, seqlen_k):
        block = (self.block_q, self.block_k)
        if self.builder == "grid":
            nbq, nbk = -(-seqlen_q // self.block_q), -(-seqlen_k // self.block_k)
            grid = np.random.default_rng(self.seed).random((self.heads, nbq, nbk)) < self.density
            # A shared layout is given 2-D, as a user would.
            return cf.BlockMask.from_dense(grid[0] if self.heads == 1 else grid, block,
                                           seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                           causal=self.causal)
        if self.builder == "causal":
            return masks.causal(seqlen_q, seqlen_k, block)
        if self.builder == "sliding_window":
            mask = masks.sliding_window(seqlen_q, seqlen_k, self.window, block)
        elif self.builder == "strided":
            mask = masks.strided(seqlen_q, seqlen_k, self.stride, block)
        elif self.builder == "longformer":
            mask = masks.longformer(seqlen_q, seqlen_k, self.window, self.global_blocks, block)
        elif self.builder == "bigbird":
            mask = masks.bigbird(seqlen_q, seqlen_k, self.window, self.global_blocks,
                                 self.random_blocks, self.seed, block, nheads=self.heads)
        elif self.builder == "random":
            mask = masks.random(seqlen_q, seqlen_k, self.density, self.seed, block,
                                nheads=self.heads)
        else:
            raise ValueError(f"unknown mask builder {self.builder!r}")
        return mask & masks.causal(seqlen_q, seqlen_k, block) if self.causal else mask


@dataclass(frozen=True)
class Dropout:
    """A call's dropout: probability ``p`` (0: off) and the generator's ``seed`` and
    ``offset``."""
    p: float = 0.0
    seed: int = 0
    offset: int = 0

    def keywords(self):
        """The keywords of flash_attention and flash_attention_backward."""
        return dict(dropout_p=self.p, seed=self.seed, offset=self.offset)

    def scale(self, xp, batch, nheads, seqlen_q, seqlen_k):
        """tests/reference.py's ``dropout`` multiplier (None without dropout)."""
        return dropout_scale(xp, batch, nheads, seqlen_q, seqlen_k, self.p, self.seed,
                             self.offset)


@dataclass(frozen=True)
class Mods:
    """A call's user mods: ``score`` a key of ``SCORE_MODS``, ``mask`` one of ``MASK_MODS``
    (None: without), their arrays drawn from ``seed``. ``min_keys``: the fewest keys a
    document or a local window of the mask mods holds (a row that sees one key has dS = 0
    exactly, which tests/test_fuzz_gpu.py's fp16/bf16 checks keep from being every row)."""
    score: Optional[str] = None
    mask: Optional[str] = None
    seed: int = 0
    min_keys: int = 1


@dataclass(frozen=True)
class Case:
    """One call: its dtype (a key of ``DTYPE_NAMES``), sizes, flags, layout, mask and the seed
    of its random inputs. The field names are the ones tests/gpu_checks.py reads."""
    dtype: str
    batch: int
    sq: int
    sk: int
    nheads: int
    nheads_k: int
    d: int
    causal: bool = False
    softmax_scale: Optional[float] = None
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None     # None, "heads" ((nheads,) slopes) or "batch" ((batch, nheads))
    dropout: Dropout = Dropout()
    mods: Mods = Mods()
    layout: Layout = Layout()
    mask: Optional[MaskSpec] = None
    deterministic: bool = False
    seed: int = 0

    @property
    def np_dtype(self):
        return np_dtype(DTYPE_NAMES[self.dtype])

    @property
    def scale(self):
        """The softmax scale the call uses (the reference needs it spelled out)."""
        return self.d ** -0.5 if self.softmax_scale is None else self.softmax_scale

    def block_mask(self):
        return None if self.mask is None else self.mask.build(self.sq, self.sk)

    def alibi_slopes(self, xp):
        """float32 slopes in [1/256, 1] (the range of ALiBi's geometric ones), drawn from
        the case's seed, or None."""
        if self.alibi is None:
            return None
        shape = (self.nheads,) if self.alibi == "heads" else (self.batch, self.nheads)
        host = 2.0 ** -np.random.default_rng(self.seed + 4).uniform(0, 8, shape)
        return xp.asarray(host.astype(np.float32))

    def variant(self, xp):
        """The keywords ``window_size``, ``softcap`` and ``alibi_slopes`` of the call (and of
        tests/reference.py's functions), the slopes as ``xp`` arrays."""
        return dict(window_size=self.window_size, softcap=self.softcap,
                    alibi_slopes=self.alibi_slopes(xp))

    def dropout_scale(self, xp):
        """The reference's ``dropout`` multiplier of this case, or None."""
        return self.dropout.scale(xp, self.batch, self.nheads, self.sq, self.sk)

    def _mod_arrays(self):
        """(score_mod's, mask_mod's) host arrays by name, drawn from ``mods.seed``."""
        rng = np.random.default_rng(self.mods.seed)
        score = SCORE_MODS[self.mods.score].arrays(self, rng) if self.mods.score else {}
        mask = MASK_MODS[self.mods.mask].arrays(self, rng) if self.mods.mask else {}
        return score, mask

    def user_mods(self, xp):
        """The keywords ``score_mod`` and ``mask_mod`` of the call (a ``cupyflash.ScoreMod``
        / ``MaskMod`` over ``xp`` arrays, or None)."""
        score, mask = self._mod_arrays()
        return dict(score_mod=SCORE_MODS[self.mods.score].build(score, xp) if score else None,
                    mask_mod=MASK_MODS[self.mods.mask].build(mask, xp) if mask else None)

    def dense_score_mod(self, xp):
        """The reference's ``score_mod`` (``_scores`` in tests/reference.py) spelling this
        case's, over ``xp`` arrays; None without one."""
        if self.mods.score is None:
            return None
        arrays = {n: xp.asarray(a) for n, a in self._mod_arrays()[0].items()}
        return functools.partial(SCORE_MODS[self.mods.score].dense, **arrays)

    def element_mask(self, block_mask, xp):
        """The element mask the reference applies on top of the band, as an ``xp`` array:
        ``block_mask.to_dense()`` (heads or 1, sq, sk), or the mask_mod's (batch or 1, heads
        or 1, sq, sk); None without either (the call refuses the two together)."""
        if block_mask is not None:
            return xp.asarray(block_mask.to_dense())
        if self.mods.mask is None:
            return None
        arrays = {n: xp.asarray(a) for n, a in self._mod_arrays()[1].items()}
        return MASK_MODS[self.mods.mask].dense(self.sq, self.sk, xp, **arrays)

    def inputs(self, xp):
        """q, k, v and dout of this case (NumPy or CuPy), laid out as ``self.layout`` says,
        standard-normal and never zero; the same arrays for the same case."""
        b, sq, sk, h, hk, d = (self.batch, self.sq, self.sk, self.nheads, self.nheads_k, self.d)
        seed = self.seed

        def fresh(shape, offset):
            return random_array(xp, shape, self.np_dtype, seed + offset)

        kind = self.layout.kind
        if kind == "contiguous":
            return fresh((b, sq, h, d), 0), fresh((b, sk, hk, d), 1), fresh((b, sk, hk, d), 2), \
                fresh((b, sq, h, d), 3)
        if kind == "qkv_packed":
            qkv = fresh((b, sq, h + 2 * hk, d), 0)
            return qkv[:, :, :h], qkv[:, :, h:h + hk], qkv[:, :, h + hk:], fresh((b, sq, h, d), 3)
        if kind == "kv_packed":
            kv = fresh((b, sk, hk, 2, d), 1)
            q = fresh((b, h, sq, d), 0).transpose(0, 2, 1, 3)
            dout = fresh((b, h, sq, d), 3).transpose(0, 2, 1, 3)
            return q, kv[:, :, :, 0], kv[:, :, :, 1], dout
        if kind == "padded":
            pb, ps, ph, pd = self.layout.pad

            def padded(shape, offset):
                n_b, n_s, n_h, _ = shape
                buf = fresh((n_b + pb, n_s + ps, n_h + ph, d + pd), offset)
                return buf[pb:, ps:, ph:, pd:pd + d]

            return padded((b, sq, h, d), 0), padded((b, sk, hk, d), 1), \
                padded((b, sk, hk, d), 2), padded((b, sq, h, d), 3)
        raise ValueError(f"unknown layout {kind!r}")

    def visibility(self, elem, xp=np):
        """Which key each query row sees, bool (batch or 1, heads or 1, seqlen_q, seqlen_k):
        ``elem`` (``element_mask``, or None) ANDed with the call's band (causal and
        window_size, tests/reference.py's ``visible``); None when every row sees every key."""
        banded = self.causal or self.window_size != (-1, -1)
        if elem is None and not banded:
            return None
        if elem is None:
            seen = xp.ones((1, 1, self.sq, self.sk), bool)
        else:
            seen = elem if elem.ndim == 4 else elem[None]
        if banded:
            seen = seen & visible(xp, self.sq, self.sk, self.causal, self.window_size)
        return seen


# ---------------------------------------------------------------------------------------------
# User mods: the library

@dataclass(frozen=True)
class ScoreModEntry:
    """A score_mod of the library: its CUDA rule and gradient, its Python rule and gradient
    (``cupyflash.ScoreMod``), ``arrays(case, rng)`` the host arrays it reads by name,
    ``grad_arrays`` those whose gradient the backward returns, and ``dense(s, **arrays)`` the
    same rule on the reference's (batch, nheads, seqlen_q, seqlen_k) scores, returning what
    tests/reference.py's ``_scores`` asks of a ``score_mod``."""
    cuda: str
    grad: str
    python: Callable
    python_grad: Callable
    arrays: Callable
    dense: Callable
    grad_arrays: tuple = ()

    def build(self, arrays, xp):
        return cf.ScoreMod(self.cuda, grad=self.grad, python=self.python,
                           python_grad=self.python_grad,
                           arrays={n: xp.asarray(a) for n, a in arrays.items()},
                           grad_arrays=self.grad_arrays)


@dataclass(frozen=True)
class MaskModEntry:
    """A mask_mod of the library: its CUDA and Python rules (``cupyflash.MaskMod``),
    ``arrays(case, rng)`` the host arrays it reads by name, and ``dense(seqlen_q, seqlen_k, xp,
    **arrays)`` its element mask, bool (batch or 1, nheads or 1, seqlen_q, seqlen_k)."""
    cuda: str
    python: Callable
    arrays: Callable
    dense: Callable

    def build(self, arrays, xp):
        return cf.MaskMod(self.cuda, python=self.python,
                          arrays={n: xp.asarray(a) for n, a in arrays.items()})


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _table_sum(terms, index, size, sizes):
    """The ``size`` sums of ``terms`` by flat table ``index`` (NumPy or CuPy arrays that
    broadcast together), on the host, added one term at a time in float64 for float64 terms,
    else in float32 (a naive implementation's order); of |terms| with ``sizes``."""
    terms, index = np.broadcast_arrays(_host(terms), _host(index))
    dtype = np.float64 if terms.dtype == np.float64 else np.float32
    out = np.zeros(size, dtype)
    np.add.at(out, index.ravel(), (np.abs(terms) if sizes else terms).ravel().astype(dtype))
    return out


# T5-style relative-position bias: the offset kv_idx - q_idx, moved to 0..2W by W (half the
# bucket table's length, W = max(seqlen_q, seqlen_k): the snippet text is the same for every
# shape), picks a bucket, and the bucket a per-head bias.
_OFFSET = "kv_idx - q_idx + bucket.shape(0) / 2"


def _relative_bias_arrays(case, rng):
    """bias (nheads, n) float32, n = 2..32 buckets, at one of three scales; bucket (2 W,)
    int32, the bucket of each offset, at random (T5's log-spaced map is one such; random ones
    make near and far offsets share entries, whose gradients then add up across the
    matrix)."""
    n = int(rng.integers(2, 33))
    scale = rng.choice((0.1, 1.0, 3.0))
    return {"bias": (scale * rng.standard_normal((case.nheads, n))).astype(np.float32),
            "bucket": rng.integers(0, n, 2 * max(case.sq, case.sk)).astype(np.int32)}


def _relative_bias(score, b, h, q_idx, kv_idx, bias, bucket):
    return score + bias[h, bucket[kv_idx - q_idx + len(bucket) // 2]]


def _relative_bias_grad(score, dscore, b, h, q_idx, kv_idx, bias, bucket, d_bias):
    hh, entry, ds = np.broadcast_arrays(h, bucket[kv_idx - q_idx + len(bucket) // 2], dscore)
    np.add.at(d_bias, (hh, entry), ds)
    return dscore


def _relative_bias_dense(s, bias, bucket):
    xp = get_xp(s)
    _, h, sq, sk = s.shape
    # (sq, sk): the bucket of key j seen from query i.
    entry = bucket[xp.arange(sk)[None, :] - xp.arange(sq)[:, None] + bucket.shape[0] // 2]
    heads = xp.arange(h)[:, None, None]

    def tables(ds, sizes=False):
        flat = heads * bias.shape[1] + entry
        return {"bias": _table_sum(ds, flat, bias.size, sizes).reshape(bias.shape)}

    return s + bias[heads, entry].astype(s.dtype), None, tables


# ALiBi spelled as a score_mod, with slopes per (batch entry, head) and the distance from the
# top-left diagonal (the built-in's is bottom-right). The slope is cast to the score's type
# first so that the float64 kernels multiply in float64.
def _linear_bias_arrays(case, rng):
    """slopes (batch, nheads) float32 in [1/256, 1], the range of ALiBi's."""
    return {"slopes": (2.0 ** -rng.uniform(0, 8, (case.batch, case.nheads))).astype(np.float32)}


def _linear_bias(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes[b, h] * np.abs(q_idx - kv_idx)


def _passes_through(score, dscore, b, h, q_idx, kv_idx, **arrays):
    return dscore


def _linear_bias_dense(s, slopes):
    xp = get_xp(s)
    _, _, sq, sk = s.shape
    distance = xp.abs(xp.arange(sq)[:, None] - xp.arange(sk)[None, :])

    def tables(ds, sizes=False):
        return {}

    return s - slopes.astype(s.dtype)[:, :, None, None] * distance, None, tables


# A nonlinear score_mod: a tanh cap per head, written in the snippet, whose cap is learned
# (its gradient gathers every element of the head).
def _tanh_cap_arrays(case, rng):
    """cap (nheads,) float32 from well inside the scores' range (0.5) to past it (8)."""
    return {"cap": rng.uniform(0.5, 8.0, case.nheads).astype(np.float32)}


def _tanh_cap(score, b, h, q_idx, kv_idx, cap):
    return cap[h] * np.tanh(score / cap[h])


def _tanh_cap_grad(score, dscore, b, h, q_idx, kv_idx, cap, d_cap):
    u = score / cap[h]
    t = np.tanh(u)
    hh, contrib = np.broadcast_arrays(h, dscore * (t - u * (1 - t * t)))
    np.add.at(d_cap, hh, contrib)
    return dscore * (1 - t * t)


def _tanh_cap_dense(s, cap):
    xp = get_xp(s)
    c = cap.astype(s.dtype)[:, None, None]
    capped = xp.tanh(s / c)
    heads = xp.arange(cap.shape[0])[:, None, None]

    def tables(ds, sizes=False):
        # d (c tanh(s / c)) / dc = tanh(s / c) - s / c * tanh'(s / c)
        terms = ds * (capped - s / c * (1 - capped * capped))
        return {"cap": _table_sum(terms, heads, cap.size, sizes)}

    return c * capped, 1 - capped * capped, tables


SCORE_MODS = {
    "relative_bias": ScoreModEntry(
        f"score + bias(h, bucket[{_OFFSET}])",
        grad=f"d_bias.add(bias.offset(h, bucket[{_OFFSET}]), dscore);\nreturn dscore;",
        python=_relative_bias, python_grad=_relative_bias_grad, arrays=_relative_bias_arrays,
        dense=_relative_bias_dense, grad_arrays=("bias",)),
    "linear_bias": ScoreModEntry(
        "score - static_cast<decltype(score)>(slopes(b, h)) * abs(q_idx - kv_idx)",
        grad="dscore", python=_linear_bias, python_grad=_passes_through,
        arrays=_linear_bias_arrays, dense=_linear_bias_dense),
    "tanh_cap": ScoreModEntry(
        "cap[h] * tanh(score / cap[h])",
        grad="const auto u = score / cap[h];\nconst auto t = tanh(u);\n"
             "d_cap.add(h, dscore * (t - u * (1 - t * t)));\nreturn dscore * (1 - t * t);",
        python=_tanh_cap, python_grad=_tanh_cap_grad, arrays=_tanh_cap_arrays,
        dense=_tanh_cap_dense, grad_arrays=("cap",)),
}


# Document mask: a query sees the keys of its own document (per batch entry).
def _document_arrays(case, rng):
    """doc (batch, L) int32, L = max(seqlen_q, seqlen_k): per batch entry 1 to 8 consecutive
    documents of random lengths, mods.min_keys tokens or more each (all L if fewer)."""
    length = max(case.sq, case.sk)
    span = min(case.mods.min_keys, length)
    ids = []
    for _ in range(case.batch):
        n = int(rng.integers(1, min(8, length // span) + 1))
        lengths = span + rng.multinomial(length - n * span, rng.dirichlet(np.ones(n)))
        ids.append(np.repeat(np.arange(n), lengths))
    return {"doc": np.stack(ids).astype(np.int32)}


def _document_dense(sq, sk, xp, doc):
    return (doc[:, :sq, None] == doc[:, None, :sk])[:, None]


# Prefix-LM: the keys of the prefix (its length per batch entry) are seen by every query, the
# others causally (aligned top-left; causal=True ANDs the built-in bottom-right rule).
def _prefix_arrays(case, rng):
    """prefix (batch,) int32 in 0..seqlen_k."""
    return {"prefix": rng.integers(0, case.sk + 1, case.batch).astype(np.int32)}


def _prefix_dense(sq, sk, xp, prefix):
    rows, cols = xp.arange(sq)[:, None], xp.arange(sk)[None, :]
    return ((cols <= rows)[None] | (cols[None] < prefix[:, None, None]))[:, None]


# A local window per head: the keys within width[h] of the query's index.
def _local_arrays(case, rng):
    """width (nheads,) int32: at least mods.min_keys // 2 (2 width + 1 keys on a row), then up
    to 8 more, or up to max(seqlen_q, seqlen_k)."""
    low = case.mods.min_keys // 2
    high = low + 8 if rng.random() < 0.5 else max(low, case.sq, case.sk)
    return {"width": rng.integers(low, high + 1, case.nheads).astype(np.int32)}


def _local_dense(sq, sk, xp, width):
    distance = xp.abs(xp.arange(sq)[:, None] - xp.arange(sk)[None, :])
    return (distance[None] <= width[:, None, None])[None]


MASK_MODS = {
    "document": MaskModEntry(
        "doc(b, q_idx) == doc(b, kv_idx)", arrays=_document_arrays, dense=_document_dense,
        python=lambda b, h, q_idx, kv_idx, doc: doc[b, q_idx] == doc[b, kv_idx]),
    "prefix_lm": MaskModEntry(
        "kv_idx <= q_idx || kv_idx < prefix[b]", arrays=_prefix_arrays, dense=_prefix_dense,
        python=lambda b, h, q_idx, kv_idx, prefix: (kv_idx <= q_idx) | (kv_idx < prefix[b])),
    "local": MaskModEntry(
        "abs(q_idx - kv_idx) <= width[h]", arrays=_local_arrays, dense=_local_dense,
        python=lambda b, h, q_idx, kv_idx, width: np.abs(q_idx - kv_idx) <= width[h]),
}


# ---------------------------------------------------------------------------------------------
# Strategies: the pieces

def _sizes(special, low, high):
    """``special`` values in [low, high] or any integer there. Hypothesis favours small
    integers, so a third branch draws from the upper three quarters of the range."""
    special = [n for n in special if low <= n <= high] or [low]
    return st.one_of(st.sampled_from(special), st.integers(low, high),
                     st.integers(max(low, high // 4), high))


def seqlens(max_seqlen):
    """Lengths 1..max_seqlen, the tile-edge values of SPECIAL_SEQLENS among them."""
    return _sizes(SPECIAL_SEQLENS, 1, max_seqlen)


@st.composite
def seqlen_pairs(draw, max_seqlen):
    """(seqlen_q, seqlen_k): equal, or different (either one the longer). Hypothesis likes to
    repeat a value it drew, so a repeated draw is moved by one to keep the pair unequal."""
    sq = draw(seqlens(max_seqlen))
    if max_seqlen == 1 or draw(st.booleans()):
        return sq, sq
    sk = draw(seqlens(max_seqlen))
    if sk == sq:
        sk = sq + 1 if sq < max_seqlen else sq - 1
    return sq, sk


def head_dims(max_headdim=MAX_HEADDIM, min_headdim=1):
    return _sizes(SPECIAL_HEADDIMS, min_headdim, max_headdim)


@st.composite
def shapes(draw, *, max_seqlen, max_headdim=MAX_HEADDIM, max_batch=2, max_kv_heads=3,
           max_group=4, max_scores, max_work, min_rows=1, min_headdim=1):
    """Sizes under a budget: ``batch * nheads * seqlen_q * seqlen_k <= max_scores`` (the
    reference's score matrices) and ``... * headdim <= max_work`` (its matmuls and the NumPy
    path's loops). The seqlens are drawn first, then the head dim, then the heads (nheads_k kv
    heads, ``group`` query heads each: MQA when nheads_k is 1) and the batch.

    ``min_rows``: at least this many query rows (``batch * nheads * seqlen_q``) and key rows
    (``batch * nheads_k * seqlen_k``); ``min_headdim``: the smallest head dim. FlashAttention's
    rule compares the largest error with a naive implementation's largest error, which is
    meaningful only over enough rows and, for the gradients, a wide enough head dim
    (tests/test_fuzz_gpu.py gives the numbers its fp16/bf16 checks need)."""
    if max_seqlen ** 2 > max_scores or max_seqlen ** 2 > max_work:
        raise ValueError("shapes: max_seqlen**2 must fit max_scores and max_work")
    sq, sk = draw(seqlen_pairs(max_seqlen))
    fit = sq * sk
    heads = [(hk, b, g) for hk in range(1, max_kv_heads + 1) for b in range(1, max_batch + 1)
             for g in range(1, max_group + 1)
             if b * hk * g * sq >= min_rows and b * hk * sk >= min_rows]
    # batch * nheads must fit the budget at the drawn head dim; the head dim takes what the
    # fewest heads that reach min_rows leave.
    fewest = min((hk * b * g for hk, b, g in heads), default=None)
    if fewest is None or fewest > max_scores // fit:
        reject()
    d_hi = min(max_headdim, max_work // (fit * fewest))
    if d_hi < min_headdim:
        reject()
    d = draw(head_dims(d_hi, min_headdim))
    units = min(max_scores // fit, max_work // (fit * d))          # batch * nheads at most
    heads = [(hk, b, g) for hk, b, g in heads if hk * b * g <= units]
    nheads_k = draw(st.sampled_from(sorted({hk for hk, _, _ in heads})))
    batch = draw(st.sampled_from(sorted({b for hk, b, _ in heads if hk == nheads_k})))
    group = draw(st.sampled_from([g for hk, b, g in heads if (hk, b) == (nheads_k, batch)]))
    return Shape(batch, sq, sk, nheads_k * group, nheads_k, d)


def softmax_scales(shape):
    """None (the default, headdim ** -0.5) or an explicit scale 0.1x..2x the default."""
    return st.one_of(st.none(), st.floats(0.1, 2.0).map(lambda f: f * shape.d ** -0.5))


@st.composite
def layouts(draw, shape, kinds=LAYOUT_KINDS):
    kinds = [k for k in kinds if k != "qkv_packed" or shape.sq == shape.sk]
    kind = draw(st.sampled_from(kinds))
    if kind != "padded":
        return Layout(kind)
    pad = draw(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 3),
                         st.integers(0, 9)))
    return Layout(kind, pad)


def no_window(shape):
    return st.just((-1, -1))


@st.composite
def windows(draw, shape, min_side=0):
    """``window_size`` for this shape: each side -1 (unbounded), small (min_side..min_side +
    8: tiles crossed by both edges, rows that see no key) or anything from min_side up to
    seqlen_q + seqlen_k (past the sequence ends, which is no bound)."""
    side = st.one_of(st.just(-1), st.integers(min_side, min_side + 8),
                     st.integers(min_side, max(min_side, shape.sq + shape.sk)))
    return (draw(side), draw(side))


def maybe_windows(shape):
    """No window half the time, else ``windows``."""
    return st.one_of(no_window(shape), windows(shape))


def softcaps_on():
    """A cap from well inside the scores' range to past it."""
    return st.floats(0.1, 50.0)


def softcaps():
    """0 (off) half the time, else ``softcaps_on``."""
    return st.one_of(st.just(0.0), softcaps_on())


def alibis_on():
    """Slopes per head or per (batch, head)."""
    return st.sampled_from(("heads", "batch"))


def alibis():
    """No ALiBi, slopes per head, or slopes per (batch, head)."""
    return st.sampled_from((None, None, "heads", "batch"))


def dropouts_on():
    """A probability from tiny to most keys dropped, with any seed and offset (both ends of
    their ranges among them)."""
    p = st.one_of(st.sampled_from((0.1, 0.5)), st.floats(1e-3, 0.95))
    seed = st.one_of(st.sampled_from((0, 2**64 - 1)), st.integers(0, 2**64 - 1))
    offset = st.one_of(st.sampled_from((0, 2**32 - 1)), st.integers(0, 2**32 - 1))
    return st.builds(Dropout, p, seed, offset)


def dropouts():
    """No dropout half the time, else ``dropouts_on``."""
    return st.one_of(st.just(Dropout()), dropouts_on())


def no_mask(shape):
    return st.none()


def mask_seeds():
    return st.integers(0, 2**31 - 1)


@st.composite
def block_masks(draw, shape, builders=MASK_BUILDERS):
    """A MaskSpec for this shape: any builder, block sizes 64/128 on each side, shared or
    per-head layouts, with or without the mask's own causal rule."""
    builder = draw(st.sampled_from(builders))
    fields = dict(builder=builder, block_q=draw(st.sampled_from(MASK_BLOCK_SIZES)),
                  block_k=draw(st.sampled_from(MASK_BLOCK_SIZES)))
    if builder in PER_HEAD_BUILDERS:
        fields["heads"] = draw(st.sampled_from(sorted({1, shape.nheads})))
    fields["causal"] = True if builder == "causal" else draw(st.booleans())
    if builder in ("grid", "random"):
        fields["density"] = draw(st.floats(0.0, 1.0))      # 0 and 1 come up among them
    if builder in ("sliding_window", "longformer", "bigbird"):
        fields["window"] = draw(st.integers(1, shape.sq + shape.sk))
    if builder == "strided":
        fields["stride"] = draw(st.integers(1, 4))
    if builder in ("longformer", "bigbird"):
        fields["global_blocks"] = draw(st.integers(0, 2))
    if builder == "bigbird":
        fields["random_blocks"] = draw(st.integers(0, 3))
    if builder in ("grid", "random", "bigbird"):
        fields["seed"] = draw(mask_seeds())
    return MaskSpec(**fields)


def maybe_block_masks(shape):
    return st.one_of(st.none(), block_masks(shape))


def no_mods(score, mask):
    return st.just(Mods())


@st.composite
def user_mods(draw, score, mask, min_keys=1, one_in=2):
    """Mods from the library in about one case in ``one_in``: a score_mod where ``score``
    (the call allows one: no softcap or ALiBi), a mask_mod where ``mask`` (no window or block
    mask), or both; the pair drawn as one value (so that each pair comes up alike), the
    arrays' contents from a drawn seed."""
    pairs = [(s, m) for s in (None, *SCORE_MODS) if score or s is None
             for m in (None, *MASK_MODS) if mask or m is None if (s, m) != (None, None)]
    if not pairs or not draw(st.sampled_from((False,) * (one_in - 1) + (True,))):
        return Mods()
    score_name, mask_name = draw(st.sampled_from(pairs))
    return Mods(score_name, mask_name, draw(st.integers(0, 2**31 - 1)), min_keys)


def input_seeds():
    # The inputs take seed .. seed + 3 (q, k, v, dout).
    return st.integers(0, 2**31 - 8)


@st.composite
def cases(draw, *, dtype, shape, causal=st.booleans(), softmax_scale=softmax_scales,
          window=no_window, softcap=st.just(0.0), alibi=st.just(None),
          dropout=st.just(Dropout()), layout=layouts, mask=no_mask, deterministic=st.booleans(),
          mods=no_mods):
    """A Case. ``dtype``, ``shape``, ``causal``, ``softcap`` (``softcaps``), ``alibi``
    (``alibis``), ``dropout`` (``dropouts``) and ``deterministic`` are strategies;
    ``softmax_scale``, ``window``, ``layout`` and ``mask`` are functions of the drawn Shape
    that return strategies (``no_mask``, ``block_masks``, ``maybe_block_masks``;
    ``no_window``, ``windows``, ``maybe_windows``, never with a mask: the call refuses the two
    together; ``layouts``, or e.g. ``lambda s: layouts(s, kinds=("contiguous",))``;
    ``softmax_scales``). ``mods`` (``no_mods``, ``user_mods``) is a function of the keyword
    arguments ``score`` and ``mask``, whether the rest of the case allows a score_mod and a
    mask_mod, that returns a strategy; it is drawn last."""
    s = draw(shape)
    fields = dict(dtype=draw(dtype), **dataclasses.asdict(s), causal=draw(causal),
                  softmax_scale=draw(softmax_scale(s)), window_size=draw(window(s)),
                  softcap=draw(softcap), alibi=draw(alibi), dropout=draw(dropout),
                  layout=draw(layout(s)), mask=draw(mask(s)), deterministic=draw(deterministic),
                  seed=draw(input_seeds()))
    # The call refuses a score_mod with softcap or ALiBi, and a mask_mod with a window or a
    # block mask.
    fields["mods"] = draw(mods(
        score=not fields["softcap"] and fields["alibi"] is None,
        mask=tuple(fields["window_size"]) == (-1, -1) and fields["mask"] is None))
    return Case(**fields)


# ---------------------------------------------------------------------------------------------
# Shared checks and settings

def assert_zero_where_unseen(case, elem, out, dq=None, dk=None, dv=None):
    """Query rows that see no key have out = 0 and dq = 0 exactly; keys that no query of
    their group sees have dk = dv = 0 exactly (NumPy or CuPy arrays; ``elem`` is the element
    mask of the case's block mask in the same array module, or None; the gradients may be
    left out)."""
    xp = get_xp(out)
    visible = case.visibility(elem, xp)
    if visible is None:
        return
    h, hk = case.nheads, case.nheads_k
    nb = visible.shape[0]                                       # batch or 1
    visible = xp.broadcast_to(visible, (nb, h, case.sq, case.sk))
    empty_rows = ~visible.any(axis=3).transpose(0, 2, 1)        # (nb, sq, h)
    unseen = ~visible.reshape(nb, hk, h // hk, case.sq, case.sk).any(axis=(2, 3))
    unseen = unseen.transpose(0, 2, 1)                          # (nb, sk, hk)
    for name, a, where in (("out", out, empty_rows), ("dq", dq, empty_rows),
                           ("dk", dk, unseen), ("dv", dv, unseen)):
        if a is None or not bool(where.any()):
            continue
        nonzero = int(((a.astype(xp.float64) != 0) & where[:, :, :, None]).sum())
        assert nonzero == 0, f"{name}: {nonzero} nonzero elements where nothing is visible"


# derandomize: the same examples on every run (reproducible, comparable before and after a
# kernel change); no deadline (the first call of a configuration compiles kernels); no example
# database (nothing written into the checkout); print_blob: a failure prints the
# @reproduce_failure line besides the falsifying Case.
settings.register_profile(
    "cupyflash-fuzz", deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_PROFILE = settings.get_profile("cupyflash-fuzz")


class ExampleCounts:
    """Examples that passed, per family, printed in pytest's terminal summary."""

    def __init__(self, title):
        self.title = title
        self.counts = collections.Counter()
        self.notes = []

    def passed(self, family):
        self.counts[family] += 1

    def register(self, config, note=None):
        if note and note not in self.notes:
            self.notes.append(note)
        if not config.pluginmanager.is_registered(self):
            config.pluginmanager.register(self)

    def pytest_sessionfinish(self, session):
        """In a pytest-xdist worker: the counts go to the controller (WorkerExampleCounts),
        which prints them; a worker prints no summary."""
        out = getattr(session.config, "workeroutput", None)
        if out is not None and self.counts:
            out.setdefault("example_counts", []).append((self.title, dict(self.counts), list(self.notes)))

    def merge(self, counts, notes):
        self.counts.update(counts)
        self.notes += [n for n in notes if n not in self.notes]

    def pytest_terminal_summary(self, terminalreporter):
        if not self.counts:
            return
        parts = ", ".join(f"{family} {n}" for family, n in self.counts.items())
        line = f"{self.title}: {parts} (total {sum(self.counts.values())})"
        terminalreporter.write_line(line + "".join(f"; {n}" for n in self.notes))


class WorkerExampleCounts:
    """The controller of a pytest-xdist run (tests/conftest.py registers it): the workers'
    ExampleCounts, added up by title and printed in its summary."""

    def __init__(self):
        self.by_title = {}

    def pytest_testnodedown(self, node, error):
        for title, counts, notes in getattr(node, "workeroutput", {}).get("example_counts", ()):
            self.by_title.setdefault(title, ExampleCounts(title)).merge(counts, notes)

    def pytest_terminal_summary(self, terminalreporter):
        for counts in self.by_title.values():
            counts.pytest_terminal_summary(terminalreporter)


# Packed variable-length batches and KV caches: their own small descriptions, reproducible the
# same way (``inputs(np)`` gives the same arrays for the same seed).

SPECIAL_PACKED_LENGTHS = (0, 1, 2, 15, 16, 17, 63, 64, 65)


@dataclass(frozen=True)
class PackedCase:
    """A flash_attention_varlen call: per-sequence lengths (0 allowed: no queries or no keys),
    heads, head dim, the variant keywords and the inputs' seed."""
    lens_q: tuple
    lens_k: tuple
    nheads: int
    nheads_k: int
    d: int
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    seed: int = 0

    def offsets(self):
        return tuple(np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (self.lens_q, self.lens_k))

    def inputs(self, xp):
        """q, k, v, dout (float64), packed."""
        tq, tk = sum(self.lens_q), sum(self.lens_k)
        shapes_ = ((tq, self.nheads, self.d), (tk, self.nheads_k, self.d), (tk, self.nheads_k, self.d),
                   (tq, self.nheads, self.d))
        return tuple(random_array(xp, s, np.float64, self.seed + i) for i, s in enumerate(shapes_))

    def variant(self):
        """The keywords beside causal (tests/reference.py's spelling too)."""
        return dict(window_size=self.window_size, softcap=self.softcap)

    def keywords(self):
        return dict(causal=self.causal, **self.variant())


@st.composite
def packed_cases(draw, *, max_batch=5, max_seqlen=130, max_work=2**21, min_rows=1, min_headdim=1):
    """Up to max_batch sequences, lengths 0..max_seqlen (tile edges, 0 and 1 favoured), keys
    as many as queries or drawn apart, GQA, head dims min_headdim..64, causal, a window or
    softcap (each alone or none), under ``sum(sq * sk) * nheads * d <= max_work``; at least
    ``min_rows`` query rows and key rows in all (the last sequence made longer where needed:
    the fp16/bf16 rule needs rows, tests/test_fuzz_gpu.py)."""
    batch = draw(st.integers(1, max_batch))
    length = _sizes(SPECIAL_PACKED_LENGTHS, 0, max_seqlen)

    def lengths(drawn):
        # At least one row in all: a packed array of no rows is refused (test_varlen).
        drawn = drawn if any(drawn) else (1,) + drawn[1:]
        short = max(0, min_rows - sum(drawn))
        return drawn[:-1] + (drawn[-1] + short,)
    lens_q = lengths(tuple(draw(st.lists(length, min_size=batch, max_size=batch))))
    lens_k = lens_q if draw(st.booleans()) else lengths(tuple(draw(st.lists(length, min_size=batch, max_size=batch))))
    nheads_k = draw(st.integers(1, 2))
    nheads = nheads_k * draw(st.integers(1, 3))
    pairs = max(sum(a * b for a, b in zip(lens_q, lens_k)), 1)
    d = draw(head_dims(max(min_headdim, min(64, max_work // (pairs * nheads))), min_headdim))
    extra = draw(st.sampled_from(("none", "window", "softcap")))
    window = draw(st.tuples(st.integers(-1, 40), st.integers(-1, 40))) if extra == "window" else (-1, -1)
    return PackedCase(lens_q, lens_k, nheads, nheads_k, d, draw(st.booleans()), window,
                      draw(st.floats(0.5, 30.0)) if extra == "softcap" else 0.0,
                      draw(st.integers(0, 2**16)))


@dataclass(frozen=True)
class CacheCase:
    """A flash_attention_with_kvcache call: ``page_size`` None for a contiguous cache, else
    pages of that many rows under a shuffled table with spare pages; ``seqlens`` the keys in
    each entry before the call, ``new`` the keys it appends (0: none)."""
    seqlens: tuple
    capacity: int
    new: int
    seqlen_q: int
    nheads: int
    nheads_k: int
    d: int
    page_size: Optional[int] = None
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    seed: int = 0

    @property
    def batch(self):
        return len(self.seqlens)

    def inputs(self, xp):
        """q, k_cache, v_cache, k, v (k and v None without an append), block_table."""
        rng_seed, b, hk, d = self.seed, self.batch, self.nheads_k, self.d
        q = random_array(xp, (b, self.seqlen_q, self.nheads, d), np.float64, rng_seed)
        table = None
        if self.page_size is None:
            cache = (b, self.capacity, hk, d)
        else:
            per_seq = -(-self.capacity // self.page_size)
            pages = b * per_seq + 2
            cache = (pages, self.page_size, hk, d)
            order = np.random.default_rng(rng_seed).permutation(pages)[:b * per_seq]
            table = xp.asarray(order.reshape(b, per_seq).astype(np.int32))
        k_cache, v_cache = (random_array(xp, cache, np.float64, rng_seed + i) for i in (1, 2))
        k = v = None
        if self.new:
            k, v = (random_array(xp, (b, self.new, hk, d), np.float64, rng_seed + i) for i in (3, 4))
        return q, k_cache, v_cache, k, v, table

    def variant(self):
        """The keywords beside causal (tests/reference.py's spelling too)."""
        return dict(window_size=self.window_size, softcap=self.softcap)

    def keywords(self):
        return dict(causal=self.causal, **self.variant())


@st.composite
def cache_cases(draw, *, max_batch=3, max_capacity=100, max_new=4, max_q=4, min_rows=1):
    """Contiguous caches and paged ones (pages of 16, 32 or 48 rows), lengths from 0 to the
    capacity left after the append (both ends favoured), appends of 0..max_new keys, one query
    (decoding) or a few (chunked prefill), GQA, head dims 1..64, causal, a window or softcap;
    at least ``min_rows`` query rows (batch x seqlen_q x nheads) in all, by more query heads
    per KV head where needed."""
    new = draw(st.integers(0, max_new))
    capacity = draw(st.integers(max(new, 1), max_capacity))
    room = capacity - new
    batch = draw(st.integers(1, max_batch))
    length = st.one_of(st.sampled_from((0, room)), st.integers(0, room))
    seqlens = tuple(draw(st.lists(length, min_size=batch, max_size=batch)))
    nheads_k = draw(st.integers(1, 2))
    extra = draw(st.sampled_from(("none", "window", "softcap")))
    seqlen_q = draw(st.integers(1, max_q))
    group = max(draw(st.integers(1, 4)), -(-min_rows // (batch * seqlen_q * nheads_k)))
    return CacheCase(seqlens, capacity, new, seqlen_q, nheads_k * group,
                     nheads_k, draw(head_dims(64)), draw(st.sampled_from((None, 16, 32, 48))),
                     draw(st.booleans()),
                     draw(st.tuples(st.integers(-1, 30), st.integers(-1, 30))) if extra == "window" else (-1, -1),
                     draw(st.floats(0.5, 30.0)) if extra == "softcap" else 0.0, draw(st.integers(0, 2**16)))
