"""The one tile-configuration table, and the numbers the Python side shares.

Keyed by (pass, head-dim bucket) for the fp16/bf16 sm_80+ mma.sync kernels (both 16-bit
dtypes take the same tiles); the
shared-memory budget of the device picks a smaller tile where the big one does not fit
(sm_86/sm_89 have 99 KB per block, sm_80 163 KB, sm_90 227 KB). The kernels
``static_assert`` what they assume of these numbers (warps own 16-row slices, tiles are
multiples of 16, ...).
"""
import math
from dataclasses import dataclass

import numpy as np

LOG2E = math.log2(math.e)
# Positions are 32-bit in the kernels: sums such as seqlen_k + row + tile stay below this.
SEQLEN_SUM_LIMIT = 2**31 - 256
# CUDA's limit on gridDim.y and gridDim.z (heads and batch of the dense grids).
MAX_GRID_YZ = 65535


def cdiv(a, b):
    return -(-a // b)


def lse_dtype(dtype):
    """lse (and D) are float32, or float64 for float64 inputs."""
    return np.float64 if dtype == np.float64 else np.float32

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 256)
MAX_HEADDIM = HEAD_DIM_BUCKETS[-1]

# Plain (fp32/fp64) kernels: one warp per query (or key) row, keys in chunks of 32.
GENERIC_WARPS = 8
GENERIC_CHUNK = 32

# Block sizes a BlockMask may have per side; tiles are at most the smallest.
MASK_BLOCK_SIZES = (64, 128)
MAX_BLOCK = max(MASK_BLOCK_SIZES)

# The padding of a shared-memory row of a 16-bit tile, in elements: 16 bytes, which moves
# consecutive rows by four banks so that ldmatrix and 16-byte stores hit all 32 banks.
SMEM_PAD = 8


def head_dim_bucket(d):
    for b in HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    raise ValueError(f"head dim {d} is above {MAX_HEADDIM}")


class _Tile:
    # Features (CallSpec.extras: "softcap", "alibi", "dropout", "user", "varlen") whose kernels spill at this
    # tile, the register file full already: calls with one take the next tile.
    spills_with = frozenset()

    def fits(self, hd, smem_limit):
        return self.smem_bytes(hd) <= smem_limit


@dataclass(frozen=True)
class FwdTile(_Tile):
    br: int      # query rows per thread block
    bc: int      # keys per iteration
    warps: int
    # Buffers of K and V in non-causal calls (2: the next key block's loads under all of a
    # step's math, one barrier per step). Causal calls take 1: at d=64 the double-buffered
    # causal kernel needs 218 registers, 2 blocks per SM instead of 3, and was 6-9% slower
    # (1-3% with 3 blocks forced by a launch bound).
    stages: int = 1
    spills_with: frozenset = frozenset()

    def stages_for(self, causal):
        return 1 if causal else self.stages

    def smem_bytes(self, hd, causal=False):
        return (self.br + 2 * self.stages_for(causal) * self.bc) * (hd + SMEM_PAD) * 2

    def fits(self, hd, smem_limit):
        # A double-buffered tile only where two of its blocks fit: on sm_86/sm_89 (99 KB) it
        # would run one block per SM where the single-buffered tile runs two.
        return self.smem_bytes(hd) * self.stages <= smem_limit


@dataclass(frozen=True)
class BwdTile(_Tile):
    bc: int      # keys per thread block (dK/dV stay in registers)
    br: int      # query rows per iteration
    warps: int
    atomic_only: bool = False   # spills in the deterministic variant (no dQ atomics)
    km: int = 1       # 16-row slices of keys (and dQ rows) per warp
    stages: int = 1   # buffers of Q, dO, lse and D (2: the next step's loads under the math)
    spills_with: frozenset = frozenset()

    def smem_bytes(self, hd):
        k_v = 2 * self.bc * (hd + SMEM_PAD) * 2                         # K, V
        p_ds = 2 * self.bc * (self.br + SMEM_PAD) * 2                   # P^T, dS^T
        stage = 2 * self.br * (hd + SMEM_PAD) * 2 + 2 * self.br * 4     # Q, dO, lse and D rows
        return k_v + p_ds + self.stages * stage


@dataclass(frozen=True)
class DqTile(_Tile):
    br: int
    bc: int
    warps: int

    def smem_bytes(self, hd):
        return (2 * self.br + 2 * self.bc) * (hd + SMEM_PAD) * 2


# User mods ("user") run code of unknown register cost per element: _launch takes the largest
# tile whose kernel does not spill with the snippet, from these.
_USER = frozenset({"user"})   # the d=64 causal forward with a T5-style score_mod spilled 8 bytes
_MODS = frozenset({"softcap", "alibi", "user"})
_ALL = _MODS | {"dropout"}
# Packed batches (SEQ_PACKED) hold a sequence's offsets beside everything a dense kernel holds:
# the largest tiles, at 255 registers (128 at d=96) already, spilled 4-28 bytes with them.
_VARLEN = frozenset({"varlen"})

# Largest first; the first tile whose shared memory fits the device is taken.
_FWD = {
    32: [FwdTile(128, 64, 4), FwdTile(64, 64, 2)],
    64: [FwdTile(128, 64, 4, stages=2, spills_with=_USER), FwdTile(128, 64, 4, spills_with=_USER),
         FwdTile(64, 64, 4)],
    96: [FwdTile(128, 64, 4, spills_with=_USER), FwdTile(64, 64, 4)],
    128: [FwdTile(128, 64, 4, spills_with=_USER | _VARLEN), FwdTile(64, 64, 4)],
    160: [FwdTile(64, 64, 4)],
    192: [FwdTile(64, 64, 4)],
    256: [FwdTile(64, 64, 4), FwdTile(64, 32, 4)],
}
_BWD = {
    32: [BwdTile(128, 64, 8), BwdTile(64, 64, 8)],
    64: [BwdTile(128, 128, 8, atomic_only=True, km=2, stages=2, spills_with=_MODS | _VARLEN),
         BwdTile(128, 128, 8, km=2, spills_with=_ALL | _VARLEN), BwdTile(128, 64, 8),
         BwdTile(64, 64, 8)],
    96: [BwdTile(64, 64, 8, spills_with=_USER | _VARLEN), BwdTile(64, 32, 4)],
    128: [BwdTile(128, 64, 8, atomic_only=True, km=2, stages=2, spills_with=_USER | _VARLEN),
          BwdTile(128, 64, 8, atomic_only=True, km=2, spills_with=_USER | _VARLEN),
          BwdTile(128, 64, 8, spills_with=_USER | _VARLEN), BwdTile(64, 64, 8), BwdTile(64, 32, 4)],
    160: [BwdTile(64, 64, 8), BwdTile(32, 32, 4)],
    192: [BwdTile(64, 64, 8), BwdTile(32, 32, 4)],
    256: [BwdTile(64, 64, 8), BwdTile(32, 32, 4)],
}
_DQ = {
    32: [DqTile(64, 64, 4)],
    64: [DqTile(64, 64, 4)],
    96: [DqTile(64, 64, 4)],
    128: [DqTile(64, 64, 4), DqTile(64, 32, 4)],
    160: [DqTile(64, 32, 4)],
    192: [DqTile(64, 32, 4)],
    256: [DqTile(64, 32, 4), DqTile(32, 32, 2)],
}
_TABLES = {"fwd": _FWD, "bwd": _BWD, "dq": _DQ}

# Shared memory per block on the architectures we compile for (bytes, opt-in maximum).
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def tiles(pass_, hd, smem_limit, max_q=MAX_BLOCK, max_k=MAX_BLOCK, deterministic=False):
    """Every tile of the table that fits, largest first, whatever the features."""
    for t in _TABLES[pass_][hd]:
        if deterministic and getattr(t, "atomic_only", False):
            continue
        if t.fits(hd, smem_limit) and t.br <= max_q and t.bc <= max_k:
            yield t


def tile(pass_, hd, smem_limit, max_q=MAX_BLOCK, max_k=MAX_BLOCK, deterministic=False,
         extras=()):
    """The tile for ``pass_`` ("fwd", "bwd" or "dq") at head-dim bucket ``hd``. A block-sparse
    mask bounds the tile by its block sizes (``max_q`` x ``max_k``) so that every kernel tile
    lies inside one mask block; ``deterministic`` picks the dK/dV tile of the pass without dQ
    atomics; ``extras`` (CallSpec.extras) skips tiles whose kernels with those features
    spill."""
    for t in tiles(pass_, hd, smem_limit, max_q, max_k, deterministic):
        if not t.spills_with.intersection(extras):
            return t
    raise RuntimeError(f"no {pass_} tile for head dim {hd} fits {smem_limit} bytes of shared "
                       f"memory and {max_q} x {max_k} mask blocks")
