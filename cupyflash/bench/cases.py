"""What is measured: the cases (shapes, dtypes, mask patterns), their FLOPs and inputs.

Dense cases keep batch x seqlen at 16K tokens and nheads x headdim at 2048. Block-sparse ones
are batch 1, 16 heads, head dim 128, bf16, with 128 x 128 blocks: ``random`` (10% of the
blocks, a layout per head), ``sliding_window`` (1024 keys, causal call) and ``causal`` (the
causal mask as a BlockMask). FLOPs (DESIGN.md): forward ``4*b*h*sq*sk*d``, halved for causal,
scaled by the visible fraction for block-sparse masks; backward 2.5x the forward;
forward+backward 3.5x.
"""
import dataclasses
import functools

import numpy as np

from .. import masks

# The package's one import of CuPy: the other modules take cp from here.
try:
    import cupy as cp
except Exception:  # ImportError, or a broken CuPy install: _gpu.gpu_or_reason says why
    cp = None

TOKENS = 16 * 1024           # batch x seqlen of the dense cases
HEAD_WIDTH = 2048            # nheads x headdim of the dense cases
SETS = 3                     # input sets the timed calls rotate among
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
PASSES = tuple(PASS_FLOP_FACTOR)
DENSE_IMPLS = ("cupyflash", "naive", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "fa4", "flex")
# flex compiles a kernel per shape and pass (torch.compile): asked for by name, not by default
DEFAULT_DENSE_IMPLS = tuple(i for i in DENSE_IMPLS if i != "flex")
SPARSE_IMPLS = ("cupyflash", "flex")
SPARSE_PATTERNS = ("random", "sliding_window", "causal")
SPARSE_BATCH, SPARSE_NHEADS, SPARSE_HEADDIM, SPARSE_BLOCK = 1, 16, 128, 128
RANDOM_DENSITY = 0.10
WINDOW = 1024


def np_dtype(name):
    """NumPy dtype of a name, bfloat16 (ml_dtypes) included."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def error_text(e):
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


# --- cases and FLOPs --------------------------------------------------------------------------

def attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, density=1.0, pass_="fwd"):
    """FLOPs of DESIGN.md: forward 4*b*h*sq*sk*d times the visible fraction (0.5 for causal),
    backward 2.5x, forward+backward 3.5x."""
    return (4.0 * batch * nheads * seqlen_q * seqlen_k * headdim * density
            * PASS_FLOP_FACTOR[pass_])


def tflops(flop, ms):
    return flop / (ms * 1e-3) / 1e12


@functools.lru_cache(maxsize=8)
def pattern_mask(pattern, seqlen):
    """(BlockMask or None, causal flag of the call) of a named block-sparse pattern."""
    if pattern == "dense":
        return None, False
    if pattern == "random":
        return masks.random(seqlen, seqlen, RANDOM_DENSITY, 0, block_size=SPARSE_BLOCK,
                            nheads=SPARSE_NHEADS), False
    if pattern == "sliding_window":
        return masks.sliding_window(seqlen, seqlen, WINDOW, block_size=SPARSE_BLOCK), True
    if pattern == "causal":
        return masks.causal(seqlen, seqlen, block_size=SPARSE_BLOCK), False
    raise ValueError(f"unknown pattern {pattern!r}")


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark shape: q, k, v, dout are (batch, seqlen, nheads, headdim) of ``dtype``."""
    batch: int
    seqlen: int
    nheads: int
    headdim: int
    dtype: str = "bfloat16"
    causal: bool = False
    pattern: str = "dense"

    @classmethod
    def dense(cls, seqlen, headdim=128, causal=False, dtype="bfloat16"):
        return cls(max(1, TOKENS // seqlen), seqlen, HEAD_WIDTH // headdim, headdim, dtype,
                   causal)

    @classmethod
    def sparse(cls, pattern, seqlen):
        """A block-sparse pattern; ``"dense"`` gives the unmasked baseline at the same shape."""
        return cls(SPARSE_BATCH, seqlen, SPARSE_NHEADS, SPARSE_HEADDIM, "bfloat16",
                   pattern_mask(pattern, seqlen)[1], pattern)

    @property
    def block_mask(self):
        return pattern_mask(self.pattern, self.seqlen)[0]

    @property
    def density(self):
        """Visible fraction of the score matrix (0.5 for dense causal, DESIGN.md's rule)."""
        mask = self.block_mask
        if mask is None:
            return 0.5 if self.causal else 1.0
        if self.causal and not mask.causal:     # ANDing with the causal mask adds its rule
            mask = mask & masks.causal(mask.seqlen_q, mask.seqlen_k, block_size=mask.block_size)
        return mask.density

    def flop(self, pass_):
        return attention_flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim,
                               self.density, pass_)

    def label(self):
        mask = "" if self.pattern == "dense" else f" {self.pattern}"
        return (f"{self.dtype} b={self.batch} s={self.seqlen} h={self.nheads} d={self.headdim}"
                f"{' causal' if self.causal else ''}{mask}")

    def fields(self):
        return dict(dataclasses.asdict(self), density=self.density)


def input_sets(case, n=SETS, seed=0):
    """``n`` float32 sets (q, k, v, dout), standard normal: each runner rounds them to its
    dtype the same way, torch's through DLPack."""
    rng = cp.random.default_rng(seed)
    shape = (case.batch, case.seqlen, case.nheads, case.headdim)
    return [tuple(rng.standard_normal(shape, dtype=cp.float32) for _ in range(4))
            for _ in range(n)]
