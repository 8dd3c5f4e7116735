"""The implementations compared (runners) and the measuring of one case.

``cupyflash``; ``naive``, the standard attention of the FlashAttention paper in CuPy (matmul,
softmax, matmul; the backward by hand); PyTorch SDPA with one backend forced (``sdpa_flash``:
FlashAttention 2, ``sdpa_cudnn``, ``sdpa_efficient``); FlashAttention-4 (``fa4``: pip
flash-attn-4, the CuTe DSL kernels, dense cases); FlexAttention (``flex``, block-sparse
cases, and dense ones when asked for). Torch is imported only when a torch runner is made. A
runner that cannot run a case here raises ``Unavailable`` with the reason; ``compare`` turns
that, and any peer's failure, into a row that says so.
"""
import functools

import numpy as np

from .. import _launch, _spec, api

from .cases import SPARSE_BLOCK, cp, error_text, input_sets, np_dtype, pattern_mask, tflops
from .reports import progress_line
from .timing import CupyClock, Timing, TorchClock, release_memory

# A peer whose output differs from ours by more than this fraction of max|out| ran another
# computation (another mask, scale or layout): bf16 rounding stays near 1%.
AGREE_RTOL = 0.05
FLEX_CHECK_SEQLEN = 4096     # flex mask_mods are checked against our element masks at this size


class Unavailable(Exception):
    """This implementation cannot run this case here (missing package, unsupported case)."""


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

    def kernels(self, pass_):
        """Which kernels ran: the forward's family (``_launch.kernel_family``) and the
        backward's (``_launch.bwd_family``, atomic dQ as these calls run it)."""
        q, k, v, dout = self.sets[0][:4]
        spec = _spec.CallSpec.of(q, causal=self.case.causal, block_mask=self.mask)
        fwd = _launch.kernel_family(spec, self.mask, q, k, v)
        bwd = _launch.bwd_family(spec, self.mask, q, k, v, dout)
        return {"fwd": fwd, "bwd": bwd}.get(pass_, fwd if fwd == bwd else f"{fwd} fwd, {bwd} bwd")


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
    in their own contiguous layout: (batch, nheads, seqlen, headdim) where ``heads_first``,
    else ours, (batch, seqlen, nheads, headdim). The forward runs with grad mode on, so that
    it saves what the backward needs (ours returns lse likewise)."""
    heads_first = True

    def __init__(self, case, sets32):
        super().__init__(case)
        self.torch = torch = _torch()
        self.clock = TorchClock(torch)
        dtype = getattr(torch, case.dtype)
        self.sets = []
        for s in sets32:
            q, k, v, dout = (self._layout(torch.from_dlpack(a).to(dtype)).contiguous() for a in s)
            self.sets.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout))

    def _layout(self, x):
        """Our (batch, seqlen, nheads, headdim) as this peer takes it, and back (a swap)."""
        return x.transpose(1, 2) if self.heads_first else x

    def backward(self, s, saved):
        # retain_graph: the bwd pass replays one forward's graph.
        return self.torch.autograd.grad(saved[0], s[:3], s[3], retain_graph=True)

    def output(self):
        out = self.forward(self.sets[0])[0].detach()
        return cp.from_dlpack(self._layout(out).float().contiguous())


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


class Fa4(_TorchRunner):
    """FlashAttention-4 (``flash_attn.cute.flash_attn_func``: pip flash-attn-4, kernels written
    in NVIDIA's CuTe DSL and compiled on first use), on dense cases, in our layout."""
    impl = "fa4"
    heads_first = False

    def __init__(self, case, sets32, **keywords):
        if case.pattern != "dense":
            raise Unavailable("FlashAttention-4 is compared on dense cases only")
        self.keywords = keywords   # flash_attn_func's own for the variants (softcap, window_size, score_mod)
        _torch()
        try:
            from flash_attn.cute import flash_attn_func
        except Exception as e:
            raise Unavailable(f"flash_attn.cute (pip flash-attn-4) is not importable "
                              f"({error_text(e)})") from None
        self.attend = flash_attn_func
        super().__init__(case, sets32)

    def forward(self, s):
        out = self.attend(s[0], s[1], s[2], causal=self.case.causal, **self.keywords)
        return out if isinstance(out, tuple) else (out,)   # (out, lse) in the releases seen


class FlexRunner(_TorchRunner):
    """torch.compile(flex_attention) with a BlockMask equal to the case's element mask."""
    impl = "flex"

    def __init__(self, case, sets32):
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
        """(flex BlockMask or None, how it was built) for a case: a block-sparse one's pattern,
        a dense causal one's rule, none for a dense one."""
        mask, seqlen = case.block_mask, case.seqlen
        if mask is None and case.causal:   # a dense causal case (its queries and keys align)
            return (self.fa.create_block_mask(self.mask_mod("causal", None), None, None, seqlen,
                                              seqlen, device="cuda"), "create_block_mask(causal)")
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
    if impl == "fa4":
        return Fa4(case, sets32)
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
    if hasattr(runner, "kernels"):
        row["kernels"] = runner.kernels(pass_)
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
