"""Benchmark machinery: cases, FLOPs, timing, memory, the implementations compared, reports.

The one place shared by ``python -m cupyflash bench``, the pytest-benchmark suite
(``benchmarks/test_bench.py``) and the scripts in ``benchmarks/``.

- **Cases**: shape, dtype, causal flag, mask pattern. Dense cases keep batch x seqlen at 16K
  tokens and nheads x headdim at 2048. Block-sparse ones are batch 1, 16 heads, head dim 128,
  bf16, with 128 x 128 blocks: ``random`` (10% of the blocks, a layout per head),
  ``sliding_window`` (1024 keys, causal call) and ``causal`` (the causal mask as a BlockMask).
- **FLOPs** (DESIGN.md): forward ``4*b*h*sq*sk*d``, halved for causal, scaled by the visible
  fraction for block-sparse masks; backward 2.5x the forward; forward+backward 3.5x.
- **Time**: CUDA events around each call, after warm-up; the median over calls that rotate
  among 3 input sets (so no call finds its inputs in L2). Each call is queued behind a spin
  kernel just long enough to cover the time Python takes to queue it, so the GPU runs the
  call's kernels back to back and the events time the GPU's work, not the launch overhead.
- **Memory**: the peak device memory one call takes above what was held before it (inputs
  excluded; outputs, saved tensors and scratch included): CuPy's pool through a MemoryHook,
  torch's allocator through ``max_memory_allocated``.
- **Implementations** (runners): ``cupyflash``; ``naive``, the standard attention of the
  FlashAttention paper in CuPy (matmul, softmax, matmul; the backward by hand); PyTorch SDPA
  with one backend forced (``sdpa_flash``: FlashAttention 2, ``sdpa_cudnn``,
  ``sdpa_efficient``); FlexAttention (``flex``, block-sparse cases). Torch is imported only
  when a torch runner is made. A runner that cannot run a case here raises ``Unavailable``
  with the reason; ``compare`` turns that, and any peer's failure, into a row that says so.
"""
import dataclasses
import datetime
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from . import api, masks

try:
    import cupy as cp
    _CUPY_ERROR = None
except Exception as e:  # ImportError, or a broken CuPy install: the NumPy path needs neither
    cp = None
    _CUPY_ERROR = f"CuPy is not importable ({type(e).__name__}: {e})"

TOKENS = 16 * 1024           # batch x seqlen of the dense cases
HEAD_WIDTH = 2048            # nheads x headdim of the dense cases
SETS = 3                     # input sets the timed calls rotate among
PASS_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
PASSES = tuple(PASS_FLOP_FACTOR)
DENSE_IMPLS = ("cupyflash", "naive", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
SPARSE_IMPLS = ("cupyflash", "flex")
SPARSE_PATTERNS = ("random", "sliding_window", "causal")
SPARSE_BATCH, SPARSE_NHEADS, SPARSE_HEADDIM, SPARSE_BLOCK = 1, 16, 128, 128
RANDOM_DENSITY = 0.10
WINDOW = 1024

# Targets of the benchmark issue, checked in the report.
TARGET_VS_FLASH = 1.0                    # fwd and bwd TFLOP/s over SDPA flash's
TARGET_VS_FLASH_HEADDIMS = (64, 128)
TARGET_VS_FLASH_SEQLENS = (1024, 16384)  # inclusive range
TARGET_SPEEDUP_VS_NAIVE = (4096, 3.0)    # (seqlen, fwd+bwd time of naive / ours)
TARGET_MEMORY_VS_NAIVE = (8192, 10.0)    # (seqlen, fwd+bwd peak memory of naive / ours)

# A peer whose output differs from ours by more than this fraction of max|out| ran another
# computation (another mask, scale or layout): bf16 rounding stays near 1%.
AGREE_RTOL = 0.05
SPIN_CYCLES_PER_MS = 2.2e6   # above any current GPU's SM clock: a spin lasts at least its ms
PROBE_SPIN_MS = 20.0         # GPU kept busy while the queueing time of one call is measured
MIN_SPIN_MS = 1.0            # the shortest spin queued before a timed call
FLEX_CHECK_SEQLEN = 4096     # flex mask_mods are checked against our element masks at this size


class Unavailable(Exception):
    """This implementation cannot run this case here (missing package, unsupported case)."""


def gpu_or_reason():
    """(cupy, None) when CuPy sees a CUDA GPU, else (None, why not, in plain words)."""
    if cp is None:
        return None, _CUPY_ERROR
    from ._gpu import no_gpu_reason
    why = no_gpu_reason(cp.cuda.runtime)
    return (cp, None) if why is None else (None, why)


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


# --- clocks: events, spin, peak memory ----------------------------------------------------

_SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


@functools.lru_cache(maxsize=None)
def _spin_kernel():
    return cp.RawKernel(_SPIN_SOURCE, "spin")


class CupyClock:
    """Events, spin kernel and peak memory for work on CuPy's current stream."""

    @staticmethod
    def event():
        e = cp.cuda.Event()
        e.record()
        return e

    @staticmethod
    def elapsed_ms(start, end):
        return cp.cuda.get_elapsed_time(start, end)

    @staticmethod
    def spin(ms):
        if ms > 0:
            _spin_kernel()((1,), (1,), (np.int64(ms * SPIN_CYCLES_PER_MS),))

    @staticmethod
    def synchronize():
        cp.cuda.get_current_stream().synchronize()

    def peak_bytes(self, fn):
        """Peak bytes held from CuPy's pool during ``fn()`` above what was held before."""
        class PoolPeak(cp.cuda.MemoryHook):
            name = "cupyflash_bench_peak"

            def __init__(self):
                super().__init__()
                self.sizes, self.current, self.peak = {}, 0, 0

            def malloc_postprocess(self, **kw):
                self.sizes[kw["mem_ptr"]] = kw["mem_size"]
                self.current += kw["mem_size"]
                self.peak = max(self.peak, self.current)

            def free_postprocess(self, **kw):
                self.current -= self.sizes.pop(kw["mem_ptr"], 0)

        hook = PoolPeak()
        with hook:
            result = fn()
            self.synchronize()
        del result
        return hook.peak


class TorchClock:
    """Events, spin kernel and peak memory for work on torch's current stream."""

    def __init__(self, torch):
        self.torch = torch

    def event(self):
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    @staticmethod
    def elapsed_ms(start, end):
        return start.elapsed_time(end)

    def spin(self, ms):
        if ms > 0:
            self.torch.cuda._sleep(int(ms * SPIN_CYCLES_PER_MS))

    def synchronize(self):
        self.torch.cuda.synchronize()

    def peak_bytes(self, fn):
        """Peak bytes of torch's allocator during ``fn()`` above what was held before."""
        cuda = self.torch.cuda
        cuda.synchronize()
        cuda.reset_peak_memory_stats()
        base = cuda.memory_allocated()
        result = fn()
        cuda.synchronize()
        del result
        return cuda.max_memory_allocated() - base


def release_memory():
    """Give cached device memory back (CuPy's pool, torch's cache) between cases."""
    if cp is not None:
        cp.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# --- timing ---------------------------------------------------------------------------------

class Timing:
    """CUDA-event times of ``calls`` (one per input set, used in turn), one call per round.

    ``before()`` queues the spin, ``__call__`` times one call and waits for it: they are
    pytest-benchmark's setup and target (``benchmark.pedantic(timing, setup=timing.before,
    rounds=n, iterations=1)``); ``run(n)`` does the same without pytest.
    """

    def __init__(self, clock, calls):
        self.clock, self.calls = clock, list(calls)
        self.times, self.spin_ms, self.first_call_s, self._next = [], 0.0, None, 0

    def warm_up(self, n):
        t0 = time.perf_counter()
        self.calls[0]()
        self.clock.synchronize()
        self.first_call_s = time.perf_counter() - t0     # includes compiling, if any
        for i in range(1, max(n, 1)):
            self.calls[i % len(self.calls)]()
        # How long Python takes to queue a call, measured while the GPU is kept busy: the
        # slowest of one call per input set. A spin shorter than a call's queueing leaves the
        # GPU idle inside the timed window (seen on the H100: medians 2-3x the minimum in a few
        # cells with a spin of twice one probe), hence the wide margin.
        queue_ms = 0.0
        for call in self.calls:
            self.clock.spin(PROBE_SPIN_MS)
            t0 = time.perf_counter()
            call()
            queue_ms = max(queue_ms, 1e3 * (time.perf_counter() - t0))
            self.clock.synchronize()
        # A call that waits for the GPU while queueing gains nothing from a spin.
        self.spin_ms = (0.0 if queue_ms > 0.5 * PROBE_SPIN_MS
                        else max(MIN_SPIN_MS, 3.0 * queue_ms + 0.1))

    def before(self):
        self.clock.spin(self.spin_ms)

    def __call__(self):
        call = self.calls[self._next % len(self.calls)]
        self._next += 1
        start = self.clock.event()
        call()
        end = self.clock.event()
        end.synchronize()
        self.times.append(self.clock.elapsed_ms(start, end))

    def run(self, reps):
        for _ in range(reps):
            self.before()
            self()
        return self

    def summary(self):
        return dict(ms=statistics.median(self.times), min_ms=min(self.times),
                    reps=len(self.times), spin_ms=round(self.spin_ms, 3),
                    first_call_s=round(self.first_call_s, 3))


def time_calls(clock, calls, reps, warmup=3):
    """``Timing.summary()`` of ``calls`` after ``warmup`` calls and ``reps`` timed ones."""
    timing = Timing(clock, calls)
    timing.warm_up(warmup)
    return timing.run(reps).summary()


# --- runners ----------------------------------------------------------------------------------

class Runner:
    """One implementation at one case: zero-argument calls per pass, one per input set.

    Subclasses set ``impl``, ``clock``, ``sets`` (tuples q, k, v, dout in their own layout)
    and define ``forward(s)`` (a tuple whose first item is the output; the rest is what the
    backward needs), ``backward(s, saved)`` and ``output()``.
    """
    impl = None
    note = ""

    def __init__(self, case):
        self.case = case

    def calls(self, pass_):
        if pass_ == "fwd":
            return [functools.partial(self.forward, s) for s in self.sets]
        if pass_ == "bwd":
            saved = [self.forward(s) for s in self.sets]
            return [functools.partial(self.backward, s, f) for s, f in zip(self.sets, saved)]
        if pass_ == "fwdbwd":
            return [functools.partial(self.forward_backward, s) for s in self.sets]
        raise ValueError(f"unknown pass {pass_!r}")

    def forward_backward(self, s):
        return self.backward(s, self.forward(s))


class Ours(Runner):
    impl = "cupyflash"

    def __init__(self, case, sets32):
        super().__init__(case)
        self.clock = CupyClock()
        dtype = np_dtype(case.dtype)
        self.sets = [tuple(a.astype(dtype) for a in s) for s in sets32]
        self.mask = case.block_mask

    def forward(self, s):
        return api.flash_attention(s[0], s[1], s[2], causal=self.case.causal,
                                   block_mask=self.mask, return_lse=True)

    def backward(self, s, saved):
        return api.flash_attention_backward(s[3], s[0], s[1], s[2], saved[0], saved[1],
                                            causal=self.case.causal, block_mask=self.mask)

    def output(self):
        return self.forward(self.sets[0])[0].astype(cp.float32)


class Naive(Runner):
    """Standard attention (the FlashAttention paper's baseline) in CuPy: S = Q K^T, P =
    softmax(S * scale), O = P V, with S and P written to device memory. Matmuls run in the
    case's dtype (cuBLAS, fp32 accumulation), the softmax in float32 in place, and P is kept in
    the dtype for the backward: dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)),
    dQ = dS K * scale, dK = dS^T Q * scale. One input set: each call moves GiBs, so the L2
    cache cannot flatter it."""
    impl = "naive"
    BYTES_PER_SCORE = 16   # at the backward's peak: P, dP and dP * P in fp32, P in the dtype

    def __init__(self, case, sets32):
        super().__init__(case)
        if case.pattern != "dense":
            raise Unavailable("naive runs dense attention only")
        b, s, h = case.batch, case.seqlen, case.nheads
        need = self.BYTES_PER_SCORE * b * h * s * s
        free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
        if need > 0.9 * free:
            raise Unavailable(f"needs ~{need / 2**30:.0f} GiB for its seqlen^2 matrices, "
                              f"{free / 2**30:.0f} GiB free")
        self.clock = CupyClock()
        self.dtype = np_dtype(case.dtype)
        self.scale = case.headdim ** -0.5
        self.bias = None
        try:   # the whole path once on a tiny input: CuPy may lack some ops in this dtype
            tiny = tuple(cp.ones((1, 1, 16, 16), self.dtype) for _ in range(4))
            self.backward(tiny, self.forward(tiny))
            self.clock.synchronize()
        except Exception as e:
            self.note = f"runs float16: CuPy lacks {case.dtype} here ({error_text(e)})"
            self.dtype = np.dtype(np.float16)
        # (b, h, s, d), contiguous: each head's matrices are one batched matmul operand.
        self.sets = [tuple(cp.ascontiguousarray(a.astype(self.dtype).transpose(0, 2, 1, 3))
                           for a in sets32[0])]
        if case.causal:       # added to the scores: -inf on the keys after each query
            self.bias = cp.zeros((s, s), cp.float32)
            self.bias[~cp.tri(s, dtype=bool)] = -cp.inf

    def forward(self, s):
        q, k, v = s[:3]
        scores = cp.matmul(q, k.swapaxes(-1, -2)).astype(cp.float32)
        scores *= self.scale
        if self.bias is not None:
            scores += self.bias
        scores -= scores.max(axis=-1, keepdims=True)
        cp.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        p = scores.astype(self.dtype)
        del scores
        return cp.matmul(p, v), p

    def backward(self, s, saved):
        q, k, v, dout = s
        p = saved[1]
        dv = cp.matmul(p.swapaxes(-1, -2), dout)
        dp = cp.matmul(dout, v.swapaxes(-1, -2)).astype(cp.float32)
        p32 = p.astype(cp.float32)
        rowsum = (dp * p32).sum(axis=-1, keepdims=True)
        dp -= rowsum
        dp *= p32
        dp *= self.scale                 # dS * scale once, instead of on dQ and on dK
        del p32
        ds = dp.astype(self.dtype)
        del dp
        return cp.matmul(ds, k), cp.matmul(ds.swapaxes(-1, -2), q), dv

    def output(self):
        return self.forward(self.sets[0])[0].transpose(0, 2, 1, 3).astype(cp.float32)


def _torch():
    try:
        import torch
    except Exception as e:
        raise Unavailable(f"torch is not importable ({error_text(e)})") from None
    if not torch.cuda.is_available():
        raise Unavailable("torch sees no CUDA device")
    return torch


class _TorchRunner(Runner):
    """Torch peers get the same float32 data through DLPack, rounded to the dtype by torch,
    in their own contiguous (batch, nheads, seqlen, headdim) layout. The forward runs with
    grad mode on, so that it saves what the backward needs (ours returns lse likewise)."""

    def __init__(self, case, sets32):
        super().__init__(case)
        self.torch = torch = _torch()
        self.clock = TorchClock(torch)
        dtype = getattr(torch, case.dtype)
        self.sets = []
        for s in sets32:
            q, k, v, dout = (torch.from_dlpack(a).to(dtype).transpose(1, 2).contiguous()
                             for a in s)
            self.sets.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout))

    def backward(self, s, saved):
        # retain_graph: the bwd pass replays one forward's graph.
        return self.torch.autograd.grad(saved[0], s[:3], s[3], retain_graph=True)

    def output(self):
        out = self.forward(self.sets[0])[0].detach()
        return cp.from_dlpack(out.transpose(1, 2).float().contiguous())


class Sdpa(_TorchRunner):
    """torch.nn.functional.scaled_dot_product_attention with one backend forced."""
    BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                "sdpa_efficient": "EFFICIENT_ATTENTION"}

    def __init__(self, impl, case, sets32):
        if case.pattern != "dense":
            raise Unavailable("SDPA is compared on dense cases only")
        torch = _torch()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        name = self.BACKENDS[impl]
        if not hasattr(SDPBackend, name):
            raise Unavailable(f"torch {torch.__version__} has no SDPBackend.{name}")
        self.impl, self.backend, self.sdpa_kernel = impl, getattr(SDPBackend, name), sdpa_kernel
        super().__init__(case, sets32)

    def forward(self, s):
        with self.sdpa_kernel(self.backend):
            return (self.torch.nn.functional.scaled_dot_product_attention(
                s[0], s[1], s[2], is_causal=self.case.causal),)


class FlexRunner(_TorchRunner):
    """torch.compile(flex_attention) with a BlockMask equal to the case's element mask."""
    impl = "flex"

    def __init__(self, case, sets32):
        if case.pattern == "dense" and case.causal:
            raise Unavailable("FlexAttention is compared on the block-sparse cases")
        self.flex = flex()
        super().__init__(case, sets32)
        self.block_mask, self.note = self.flex.block_mask(case)

    def forward(self, s):
        return (self.flex.attend(s[0], s[1], s[2], block_mask=self.block_mask),)


@functools.lru_cache(maxsize=None)
def _flex_or_reason():
    try:
        return Flex(), None
    except Unavailable as e:
        return None, str(e)


def flex():
    """The process's ``Flex`` (compiled once), or ``Unavailable``."""
    helper, why = _flex_or_reason()
    if helper is None:
        raise Unavailable(why)
    return helper


class Flex:
    """torch, the compiled flex_attention and block masks equal to our patterns."""

    def __init__(self):
        torch = _torch()
        try:
            from torch.nn.attention import flex_attention as fa
            import torch._dynamo
            import torch._functorch.config
        except Exception as e:
            raise Unavailable(f"FlexAttention is not importable ({error_text(e)})") from None
        # One compiled graph per (mask_mod, shape): raise dynamo's recompile limit (8 by
        # default, then it silently runs eager, which materializes the scores).
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        # The bwd pass replays one backward graph (retain_graph=True), which compiled
        # backwards with donated buffers refuse.
        torch._functorch.config.donated_buffer = False
        self.torch, self.fa = torch, fa
        self.attend = torch.compile(fa.flex_attention, dynamic=False)

    @staticmethod
    def mask_mod(pattern, mask):
        """An element mask_mod equal to our pattern, or None (use our block lists)."""
        if pattern == "causal":
            def causal_mod(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx
            return causal_mod
        if pattern == "sliding_window":
            # Our window is kept at block granularity: under causal, query block qb sees key
            # blocks qb - reach .. qb. Read reach off the last block row of the mask.
            last = np.flatnonzero(mask.blocks[0, -1])
            reach = mask.blocks.shape[1] - 1 - int(last[0])
            block = mask.block_q

            def window_mod(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx // block - kv_idx // block <= reach)
            return window_mod
        return None

    def check_mask_mod(self, mod, pattern):
        """Raise unless ``mod`` gives our element mask (call causal included) at a small size."""
        torch = self.torch
        mask, call_causal = pattern_mask(pattern, FLEX_CHECK_SEQLEN)
        ours = mask.to_dense()[0]
        if call_causal:
            ours = np.tril(ours)
        n = FLEX_CHECK_SEQLEN
        zero = torch.zeros((), dtype=torch.int64)
        theirs = mod(zero, zero, torch.arange(n)[:, None], torch.arange(n)[None, :])
        theirs = torch.broadcast_to(theirs, (n, n)).numpy()
        if not np.array_equal(ours, theirs):
            raise RuntimeError(f"flex mask_mod for {pattern} differs from our element mask in "
                               f"{int((ours != theirs).sum())} elements at seqlen {n}")

    def from_lists(self, mask, causal, seqlen):
        """A flex BlockMask from our visiting lists: partial blocks (those that need the
        causal rule) take the causal mask_mod, full ones none."""
        torch = self.torch
        assert (mask.block_q, mask.block_k) == (SPARSE_BLOCK, SPARSE_BLOCK)
        assert seqlen % SPARSE_BLOCK == 0
        causal = causal or mask.causal
        lists = mask.tile_lists(SPARSE_BLOCK, SPARSE_BLOCK, causal)
        idx, count, n_part = lists.kv_idx, lists.kv_count, lists.kv_partial
        slots = np.arange(idx.shape[-1])
        part_idx = np.where(slots < n_part[..., None], idx, 0)
        n_full = count - n_part
        shifted = np.take_along_axis(idx, np.minimum(slots + n_part[..., None],
                                                     idx.shape[-1] - 1), axis=-1)
        full_idx = np.where(slots < n_full[..., None], shifted, 0)

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))[None].cuda()

        mod = (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx) if causal else None
        args = (dev(n_part), dev(part_idx), dev(n_full), dev(full_idx))
        try:
            return self.fa.BlockMask.from_kv_blocks(*args, BLOCK_SIZE=SPARSE_BLOCK,
                                                    mask_mod=mod, seq_lengths=(seqlen, seqlen))
        except TypeError:      # older torch: no seq_lengths
            return self.fa.BlockMask.from_kv_blocks(*args, BLOCK_SIZE=SPARSE_BLOCK,
                                                    mask_mod=mod)

    def block_mask(self, case):
        """(flex BlockMask or None, how it was built) for a block-sparse case."""
        mask, seqlen = case.block_mask, case.seqlen
        if mask is None:
            return None, "no mask"
        mod = self.mask_mod(case.pattern, mask)
        if mod is None:
            return self.from_lists(mask, case.causal, seqlen), "from_kv_blocks(our block lists)"
        self.check_mask_mod(mod, case.pattern)
        try:
            bm = self.fa.create_block_mask(mod, None, None, seqlen, seqlen, device="cuda",
                                           BLOCK_SIZE=SPARSE_BLOCK)
            return bm, "create_block_mask(mask_mod)"
        except Exception as e:  # it builds the seqlen x seqlen element mask: may run out
            self.torch.cuda.empty_cache()
            return (self.from_lists(mask, case.causal, seqlen),
                    f"from_kv_blocks(our block lists); create_block_mask failed: "
                    f"{error_text(e)}")


def make_runner(impl, case, sets32):
    """The runner of ``impl`` at ``case`` on the float32 input sets; ``Unavailable`` if it
    cannot run here."""
    if impl == "cupyflash":
        return Ours(case, sets32)
    if impl == "naive":
        return Naive(case, sets32)
    if impl in Sdpa.BACKENDS:
        return Sdpa(impl, case, sets32)
    if impl == "flex":
        return FlexRunner(case, sets32)
    raise ValueError(f"unknown implementation {impl!r}")


# --- measuring ----------------------------------------------------------------------------

def case_row(case, impl, pass_):
    return dict(impl=impl, **{"pass": pass_}, **case.fields(), flop=case.flop(pass_))


def result_row(runner, pass_, timing, memory=True):
    """The row of a finished ``Timing``, with TFLOP/s and (``memory``) the peak memory of one
    more call."""
    row = case_row(runner.case, runner.impl, pass_)
    row.update(timing.summary())
    row["tflops"] = tflops(row["flop"], row["ms"])
    if memory:
        row["peak_bytes"] = int(runner.clock.peak_bytes(timing.calls[0]))
    if runner.note:
        row["note"] = runner.note
    return row


def measure(runner, pass_, reps=20, warmup=3, memory=True):
    timing = Timing(runner.clock, runner.calls(pass_))
    timing.warm_up(warmup)
    return result_row(runner, pass_, timing.run(reps), memory)


def failed_row(case, impl, pass_, e):
    row = case_row(case, impl, pass_)
    if isinstance(e, Unavailable):
        row["skipped"] = str(e)
    else:
        row["error"] = error_text(e)
    return row


def compare(case, impls, passes, reps=20, warmup=3, memory=False, log=None):
    """Rows of each implementation at ``case`` for each pass, on the same input sets.

    An implementation that cannot run gives rows with ``skipped`` (the reason) or ``error``
    instead of raising. Each peer's output is compared with ours (``max_abs_diff_vs_ours``);
    a difference above AGREE_RTOL x max|out| is recorded as ``mismatch``.
    """
    sets = input_sets(case)
    rows, reference = [], None
    for impl in impls:
        new, runner = [], None
        try:
            runner = make_runner(impl, case, sets)
        except Exception as e:  # Unavailable, or a peer failing to set up
            new = [failed_row(case, impl, p, e) for p in passes]
        for p in passes if runner is not None else ():
            try:
                new.append(measure(runner, p, reps, warmup, memory))
            except Exception as e:  # one failing pass must not hide the others
                new.append(failed_row(case, impl, p, e))
                release_memory()
        if runner is not None and any("ms" in r for r in new):
            try:
                out = runner.output()
                if impl == "cupyflash":
                    reference = out
                elif reference is not None:
                    diff = float(cp.abs(out - reference).max())
                    top = float(cp.abs(reference).max())
                    for r in new:
                        r["max_abs_diff_vs_ours"] = diff
                        if not diff <= AGREE_RTOL * top:
                            r["mismatch"] = (f"max|out - ours| {diff:.3g} > {AGREE_RTOL} x "
                                             f"max|ours| ({top:.3g})")
                del out
            except Exception as e:
                for r in new:
                    r["mismatch"] = f"output check failed: {error_text(e)}"
        del runner
        release_memory()
        for r in new:
            if log:
                log(progress_line(r))
        rows += new
    return rows


# --- reports --------------------------------------------------------------------------------

def git_commit():
    """$GIT_COMMIT, else ``git rev-parse HEAD`` where it answers with a hash, else unknown."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out if re.fullmatch(r"[0-9a-f]{7,40}", out) else "unknown"


def gpu_name():
    return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()


def versions():
    from . import __version__
    rt = cp.cuda.runtime.runtimeGetVersion()
    found = {"python": platform.python_version(), "numpy": np.__version__,
             "cupy": cp.__version__, "cuda_runtime": f"{rt // 1000}.{rt % 1000 // 10}",
             "cuda_driver": cp.cuda.runtime.driverGetVersion(), "cupyflash": __version__}
    try:
        # The compiler of our kernels: its register allocation moves their speed by a few %.
        from cupy_backends.cuda.libs import nvrtc
        found["nvrtc"] = "%d.%d" % nvrtc.getVersion()
    except Exception:  # a version we cannot read is left out of the report
        pass
    for name in ("torch", "triton"):
        if name in sys.modules:
            found[name] = getattr(sys.modules[name], "__version__", "?")
    return found


def report(benchmark, rows, **config):
    """The JSON document of a run: what, where, when, which code, which versions, the rows."""
    return {
        "benchmark": benchmark,
        "gpu": gpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "versions": versions(),
        "config": dict(tokens=TOKENS, head_width=HEAD_WIDTH, input_sets=SETS,
                       statistic="median of per-call CUDA-event times after warm-up",
                       flops="fwd 4*b*h*s*s*d x visible fraction (0.5 causal), "
                             "bwd 2.5x fwd, fwd+bwd 3.5x fwd",
                       peak_bytes="device memory one call takes above what was held before",
                       **config),
        "rows": rows,
    }


def write_json(path, document):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))
    return path


def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and x == x else "-"


def table_text(header, lines):
    """Right-aligned columns, a rule under the header."""
    lines = [[str(c) for c in line] for line in lines]
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths))
                     for r in [header, ["-" * w for w in widths], *lines])


def row_status(row):
    """'' for a clean timed row, else what went wrong (skipped, error, mismatch, note)."""
    for key in ("error", "skipped", "mismatch", "note"):
        if row.get(key):
            return f"{key}: {row[key]}"
    return ""


def progress_line(row):
    head = (f"{row['impl']:>14} {row['pass']:<6} {row['dtype']} d={row['headdim']} "
            f"s={row['seqlen']}{' causal' if row['causal'] else ''}"
            f"{'' if row['pattern'] == 'dense' else ' ' + row['pattern']}")
    if "ms" not in row:
        return f"{head}: {row_status(row)}"
    mem = f", {row['peak_bytes'] / 2**20:.0f} MiB" if "peak_bytes" in row else ""
    return f"{head}: {row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s{mem}"


CASE_FIELDS = ("pattern", "dtype", "headdim", "nheads", "batch", "seqlen", "causal")


def _case_key(row):
    return tuple(row[f] for f in CASE_FIELDS)


def pivot(rows, passes):
    """{(case key, impl): {pass: row}} of the rows of ``passes``, in first-seen order."""
    groups = {}
    for r in rows:
        if r["pass"] in passes:
            groups.setdefault((_case_key(r), r["impl"]), {})[r["pass"]] = r
    return groups


def add_ratios(rows):
    """Adds ``vs_sdpa_flash`` (TFLOP/s over SDPA flash's at the same case and pass) to every
    timed row, and ``speedup_vs_naive`` / ``memory_vs_naive`` (naive's time or peak memory
    over this row's) to fwd+bwd rows."""
    index = {(_case_key(r), r["pass"], r["impl"]): r for r in rows if "ms" in r}
    for (key, pass_, impl), r in index.items():
        flash = index.get((key, pass_, "sdpa_flash"))
        if flash is not None:
            r["vs_sdpa_flash"] = r["tflops"] / flash["tflops"]
        naive = index.get((key, pass_, "naive"))
        if pass_ == "fwdbwd" and naive is not None and impl != "naive":
            r["speedup_vs_naive"] = naive["ms"] / r["ms"]
            if r.get("peak_bytes") and "peak_bytes" in naive:
                r["memory_vs_naive"] = naive["peak_bytes"] / r["peak_bytes"]
    return rows


def _in_flash_target(row):
    lo, hi = TARGET_VS_FLASH_SEQLENS
    return (row["impl"] == "cupyflash" and row["pattern"] == "dense"
            and row["pass"] in ("fwd", "bwd") and row["headdim"] in TARGET_VS_FLASH_HEADDIMS
            and lo <= row["seqlen"] <= hi)


def _case_cells(key, sparse):
    pattern, dtype, d, _, _, seqlen, causal = key
    return ([pattern] if sparse else []) + [dtype, d, "yes" if causal else "no", seqlen]


def _case_header(groups):
    """(header cells of the case, whether a mask column is needed) of pivoted rows."""
    sparse = any(key[0] != "dense" for key, _ in groups)
    return (["mask"] if sparse else []) + ["dtype", "d", "causal", "seqlen"], sparse


def speed_table(rows):
    """fwd and bwd side by side per (case, implementation), ratios vs SDPA flash; ratios of
    ours below TARGET_VS_FLASH carry a '!' and are listed under the table."""
    groups = pivot(rows, ("fwd", "bwd"))
    if not groups:
        return ""
    header, sparse = _case_header(groups)
    header += ["impl", "fwd ms", "fwd TFLOP/s", "fwd/flash", "bwd ms", "bwd TFLOP/s",
               "bwd/flash", "note"]
    lines, below, checked = [], [], 0
    for (key, impl), by_pass in groups.items():
        _, dtype, d, _, _, seqlen, causal = key
        cells = _case_cells(key, sparse) + [impl]
        notes = []
        for p in ("fwd", "bwd"):
            r = by_pass.get(p, {})
            ratio = fmt(r.get("vs_sdpa_flash"), ".2f")
            if r and _in_flash_target(r):
                checked += 1
                if r.get("vs_sdpa_flash", TARGET_VS_FLASH) < TARGET_VS_FLASH:
                    ratio += "!"
                    below.append(f"{p} {dtype} d={d} {'causal' if causal else 'non-causal'} "
                                 f"seqlen={seqlen}: {r['vs_sdpa_flash']:.3f}x")
            cells += [fmt(r.get("ms"), ".3f"), fmt(r.get("tflops"), ".1f"), ratio]
            if r and row_status(r) and row_status(r) not in notes:
                notes.append(row_status(r))
        lines.append(cells + ["; ".join(notes)[:90]])
    out = [table_text(header, lines)]
    lo, hi = TARGET_VS_FLASH_SEQLENS
    target = (f"target: cupyflash fwd and bwd >= {TARGET_VS_FLASH:.1f}x SDPA flash for "
              f"d = {' and '.join(map(str, TARGET_VS_FLASH_HEADDIMS))}, seqlen {lo}..{hi}")
    if below:
        out.append(f"{target}; {len(below)} of {checked} cells below (marked !):")
        out += [f"  {b}" for b in below]
    elif checked:
        no_flash = sum(1 for by in groups.values() for r in by.values()
                       if _in_flash_target(r) and "vs_sdpa_flash" not in r)
        out.append(f"{target}: {checked - no_flash} of {checked} cells measured against SDPA "
                   f"flash, none below" + (f" ({no_flash} without an SDPA flash time)"
                                           if no_flash else ""))
    return "\n".join(out)


def memory_table(rows):
    """fwd+bwd time and peak memory per (case, implementation), ratios to naive, and the
    targets against naive."""
    groups = pivot(rows, ("fwdbwd",))
    if not groups:
        return ""
    header, sparse = _case_header(groups)
    header += ["impl", "fwd+bwd ms", "TFLOP/s", "peak MiB", "naive time / this",
               "naive memory / this", "note"]
    lines = []
    for (key, impl), by_pass in groups.items():
        r = by_pass["fwdbwd"]
        mib = r["peak_bytes"] / 2**20 if "peak_bytes" in r else None
        lines.append(_case_cells(key, sparse) + [
                      impl, fmt(r.get("ms"), ".3f"), fmt(r.get("tflops"), ".1f"), fmt(mib, ".0f"),
                      fmt(r.get("speedup_vs_naive"), ".2f"), fmt(r.get("memory_vs_naive"), ".1f"),
                      row_status(r)[:90]])
    out = [table_text(header, lines)]
    for (seqlen, goal), field, what in ((TARGET_SPEEDUP_VS_NAIVE, "speedup_vs_naive", "faster"),
                                        (TARGET_MEMORY_VS_NAIVE, "memory_vs_naive",
                                         "less peak memory")):
        hits = [by["fwdbwd"] for (key, impl), by in groups.items()
                if impl == "cupyflash" and key[0] == "dense" and key[5] == seqlen
                and field in by["fwdbwd"]]
        for r in hits:
            verdict = "met" if r[field] >= goal else "NOT met"
            out.append(f"target: cupyflash fwd+bwd {what} than naive by >= {goal:g}x at seqlen "
                       f"{seqlen} ({r['dtype']} d={r['headdim']}"
                       f"{' causal' if r['causal'] else ''}): {r[field]:.2f}x, {verdict}")
        if not hits:
            out.append(f"target: fwd+bwd {what} than naive by >= {goal:g}x at seqlen {seqlen}: "
                       f"not measured")
    return "\n".join(out)


def format_report(rows):
    """Both tables of the rows (those that have rows), ratios added."""
    add_ratios(rows)
    parts = [speed_table(rows), memory_table(rows)]
    return "\n\n".join(p for p in parts if p)


def plot(rows, path, title=""):
    """TFLOP/s against seqlen, one line per implementation: a forward and a backward panel per
    (dtype, head dim, causal) of the dense rows. Needs matplotlib."""
    plt = pyplot()
    rows = [r for r in rows if r["pattern"] == "dense" and "tflops" in r]
    configs = sorted({(r["dtype"], r["headdim"], r["causal"]) for r in rows
                      if r["pass"] in ("fwd", "bwd")})
    if not configs:
        raise ValueError("no timed forward or backward rows to plot")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(len(configs), 2, figsize=(11, 3.4 * len(configs)), squeeze=False)
    for i, (dtype, d, causal) in enumerate(configs):
        for j, pass_ in enumerate(("fwd", "bwd")):
            ax = axes[i][j]
            for impl in impls:
                pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                             if r["impl"] == impl and r["pass"] == pass_ and r["dtype"] == dtype
                             and r["headdim"] == d and r["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            seqlens = sorted({r["seqlen"] for r in rows if r["pass"] in ("fwd", "bwd")})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [f"{s // 1024}K" if s >= 1024 else str(s) for s in seqlens])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"{'forward' if pass_ == 'fwd' else 'backward'}, {dtype}, d={d}, "
                         f"{'causal' if causal else 'non-causal'}", fontsize=10)
            ax.set_xlabel("seqlen (batch x seqlen = 16K tokens)")
            ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    # Leave the suptitle its own band above the first row of panels.
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot on a file backend, or an error saying how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(f"plotting needs matplotlib ({e}): pip install matplotlib, or "
                           f"pip install 'cupyflash[bench]'") from None
    return plt
