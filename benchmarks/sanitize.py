"""compute-sanitizer over every kernel family, at small sizes with odd tails.

    python benchmarks/sanitize.py                       # plain run, then the four tools
    python benchmarks/sanitize.py --tools racecheck --log-dir DIR
    python benchmarks/sanitize.py --list                # the cases (no GPU needed)

First the driver runs every case without a sanitizer, spread over processes: that compiles the
kernels into CuPy's disk cache (``CUPY_CACHE_DIR``, default ``./.cupy_cache``) and checks the
results. Then each tool (memcheck, racecheck, synccheck, initcheck) is one
``compute-sanitizer --tool X --error-exitcode 1 python3 sanitize.py --driver`` run over all
cases (initcheck with the generic kernels only: TOOL_ENV), the tools side by side (``--jobs``), next to a run of the same tool over a small kernel
with an error of the kind it looks for planted in it (``--planted``), which must be reported:
it shows that the tool sees this process's kernels and allocations. Prints one line per tool
with its error count (from "ERROR SUMMARY: N errors", racecheck's "RACECHECK SUMMARY"), then
``sanitize: ...`` with all counts, and exits 1 on any sanitizer error, failed check, missed
planted error or timeout.

The cases cover the forward kernel, the backward with atomic dQ (dK/dV pass and dQ
conversion) and the deterministic backward (its own dQ pass), block-sparse forward and
backward, the plain float32/float64 kernels, every dtype, every head-dim bucket's tile shape
(head dims 27, 32, 40, 64, 72, 96, 128, 160, 192, 200, 224, 256), sequence tails (1, 17, 97,
130, 200, 255, 257, 300) with seqlen_q != seqlen_k both ways, causal and not (rows that see no
key included), GQA and MQA, packed variable-length batches, and KV caches (the decode
kernels: the append, one split and several with the merge, contiguous and paged).

The driver allocates with plain cudaMalloc (``cupy.cuda.set_allocator(None)``): inside a block
of CuPy's pool an out-of-bounds access lands in memory memcheck counts as allocated. Its
inputs are drawn and its references computed on the host (tests/reference.py, the tolerance
rule of tests/gpu_checks.py), so the only device work under the tools is copies and our
kernels.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests import gpu_checks  # noqa: E402

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# memcheck: 256 bytes of padding after every allocation, so that a read past the end of one
# array is not a valid read of the next one.
TOOL_ARGS = {"memcheck": ("--padding", "256")}
# initcheck runs the generic kernels only: under it each case of the Hopper forward (whose
# global reads are the copy engine's) took 25-50 s on an H200, the whole run past any sane
# limit. memcheck, racecheck and synccheck cover the Hopper kernels.
TOOL_ENV = {"initcheck": {"CUPYFLASH_KERNELS": "generic"}}


@dataclass(frozen=True)
class Case(gpu_checks.Case):
    block: tuple = None      # (block_q, block_k) of a BlockMask, None for dense
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False      # ALiBi slopes of shape (batch, nheads)
    dropout: float = 0.0     # dropout_p (seed 7, offset 1)
    user: bool = False       # user mods: a relative-position bias score_mod (with the table's
                             # gradient) and a document mask_mod
    packed: tuple = None     # a packed batch (flash_attention_varlen): ((sq, sk), ...) per
                             # sequence; the case's sq and sk are the longest's
    cache: tuple = None      # a KV cache (flash_attention_with_kvcache, forward only): (the
                             # entries' lengths before the call, page size (0: contiguous),
                             # num_splits); sk is each entry's capacity, one new key appended

    @property
    def id(self):
        return (super().id + (f"-bs{self.block[0]}x{self.block[1]}" if self.block else "")
                + (f"-w{self.window[0]}_{self.window[1]}" if self.window != (-1, -1) else "")
                + (f"-cap{self.softcap:g}" if self.softcap else "")
                + ("-alibi" if self.alibi else "")
                + (f"-drop{self.dropout:g}" if self.dropout else "")
                + ("-usermods" if self.user else "")
                + ("-packed" + "_".join(f"{a}x{b}" for a, b in self.packed) if self.packed else "")
                + ("-cache{}-page{}-splits{}".format("_".join(map(str, self.cache[0])), *self.cache[1:])
                   if self.cache else ""))

    def user_tables(self):
        """The user mods' arrays (NumPy): bias (nheads, sq + sk) and document ids (sk,)."""
        import numpy as np
        bias = np.sin(np.arange(self.nheads * (self.sq + self.sk), dtype=np.float32)
                      ).reshape(self.nheads, self.sq + self.sk)
        doc = (np.arange(self.sk, dtype=np.int32) * 3) // self.sk
        return bias, doc

    def user_mods(self, xp):
        import cupyflash as cf
        bias, doc = (xp.asarray(a) for a in self.user_tables())
        at = f"bias.offset(h, kv_idx - q_idx + {self.sq})"
        return dict(score_mod=cf.ScoreMod(f"score + bias[{at}]",
                                          grad=f"d_bias.add({at}, dscore);\nreturn dscore;",
                                          arrays={"bias": bias}, grad_arrays=("bias",)),
                    mask_mod=cf.MaskMod(f"doc[max(min(q_idx + {self.sk - self.sq}, {self.sk - 1}), 0)]"
                                        f" == doc[kv_idx]", arrays={"doc": doc}))

    def user_reference(self):
        """The dense bias (nheads, sq, sk) and element mask (sq, sk) of the user mods."""
        import numpy as np
        bias, doc = self.user_tables()
        i, j = np.arange(self.sq)[:, None], np.arange(self.sk)[None, :]
        return (bias[:, j - i + self.sq].astype(np.float64),
                doc[np.clip(i + self.sk - self.sq, 0, self.sk - 1)] == doc[j])

    def keywords(self, xp):
        """The variant keywords of flash_attention, the slopes as ``xp`` arrays."""
        import numpy as np
        slopes = None
        if self.alibi:
            slopes = xp.asarray(0.5 ** (1 + np.arange(self.batch * self.nheads, dtype=np.float32)
                                        .reshape(self.batch, self.nheads) / 2))
        drop = dict(dropout_p=self.dropout, seed=7, offset=1) if self.dropout else {}
        return dict(window_size=self.window, softcap=self.softcap, alibi_slopes=slopes, **drop)

    def reference_keywords(self):
        """The keywords of tests/reference.py's functions (the keep-mask, scaled, for dropout)."""
        import numpy as np
        from tests.reference import dropout_scale
        kw = self.keywords(np)
        p, seed, offset = kw.pop("dropout_p", 0.0), kw.pop("seed", None), kw.pop("offset", 0)
        kw["dropout"] = dropout_scale(np, self.batch, self.nheads, self.sq, self.sk, p, seed,
                                      offset)
        return kw

    @property
    def modes(self):
        """Backward variants: atomic dQ and the deterministic dQ pass for the tensor-core
        kernels; the plain kernels have one; a KV cache has no backward."""
        if self.cache:
            return ()
        return ("atomic", "deterministic") if self.dtype in gpu_checks.HALF else ("plain",)


CASES = (
    # Tensor-core kernels, dense.
    Case("bf16", 130, 97, 128, True, nheads=4, nheads_k=2),    # GQA; 33 rows see no key
    Case("fp16", 17, 130, 40, False),                          # d=64 bucket, two K/V buffers
    Case("bf16", 97, 17, 72, True, batch=2, nheads=3, nheads_k=1),   # MQA, d=96 bucket
    Case("fp16", 1, 97, 256, True),
    Case("bf16", 130, 1, 256, False),
    Case("fp16", 97, 130, 128, False, nheads=2, nheads_k=1),
    Case("bf16", 130, 130, 64, True),
    Case("fp16", 200, 230, 64, True, nheads=2),    # 192-row tiles from 128 rows before row 0
    Case("fp16", 130, 97, 200, False),                         # d=256 bucket, 56 zero columns
    Case("bf16", 17, 97, 160, True),
    Case("bf16", 97, 130, 27, False),                          # rows not 16-byte multiples
    Case("bf16", 64, 64, 32, True),                            # whole tiles
    Case("bf16", 1, 1, 64, False),
    Case("fp16", 257, 255, 64, False, batch=2),                # several two-buffer steps
    Case("fp16", 300, 257, 96, True, nheads=4, nheads_k=2),
    Case("bf16", 256, 256, 128, True, batch=2, nheads=3, nheads_k=3),   # launch groups
    # More tiles than an H100's or H200's SMs: each persistent block of the Hopper forward
    # takes several.
    Case("bf16", 130, 97, 64, False, nheads=70, nheads_k=10),
    Case("fp16", 200, 130, 128, True, nheads=68, nheads_k=17),
    # Above head dim 128 (strided blocks): tiles of several key blocks, and of one; under a
    # window, tiles that see no key before tiles of one and two.
    Case("bf16", 300, 257, 256, False, nheads=70, nheads_k=10),
    Case("fp16", 200, 60, 192, False, nheads=140, nheads_k=35),
    Case("fp16", 300, 100, 256, False, nheads=140, nheads_k=35, window=(10, 0)),
    Case("bf16", 257, 300, 192, False),
    Case("fp16", 200, 200, 224, True),
    # Block-sparse (block rows and columns that see nothing where there are three or more).
    Case("bf16", 130, 200, 64, False, block=(64, 128)),
    Case("fp16", 200, 130, 128, True, nheads=4, nheads_k=2, block=(128, 64)),
    Case("fp32", 97, 130, 40, False, block=(64, 64)),
    Case("fp64", 130, 97, 72, True, block=(64, 64)),
    # Window, softcap and ALiBi (alone, together, with GQA, a block mask and the plain kernels).
    Case("bf16", 300, 257, 128, True, nheads=4, nheads_k=2, window=(70, 0), softcap=10.0,
         alibi=True),
    Case("fp16", 257, 300, 64, False, window=(40, 30), alibi=True),
    Case("bf16", 130, 97, 96, False, batch=2, softcap=5.0),
    # softcap alone in bf16: the fixed softmax base (the Hopper forward above head dim 128);
    # rows without keys.
    Case("bf16", 200, 129, 256, True, nheads=4, nheads_k=2, softcap=4.0),
    Case("fp16", 97, 130, 256, True, softcap=20.0, alibi=True),
    Case("bf16", 260, 300, 256, False, batch=2, window=(64, 16), alibi=True),
    # softcap at head dim 64: three consumers (192-row tiles from 128 rows before row 0).
    Case("fp16", 200, 230, 64, True, nheads=2, softcap=3.0, alibi=True),
    Case("bf16", 257, 255, 64, False, softcap=4.0),
    Case("bf16", 200, 130, 64, False, block=(64, 64), softcap=3.0, alibi=True),
    Case("fp32", 130, 97, 72, True, window=(30, 10), softcap=4.0, alibi=True),
    Case("fp64", 97, 130, 40, False, softcap=2.0, alibi=True),
    # User mods (score_mod with a table gradient, mask_mod classified on the GPU).
    Case("bf16", 300, 257, 128, True, nheads=4, nheads_k=2, user=True),
    Case("fp16", 130, 200, 64, False, batch=2, user=True),
    Case("fp32", 130, 97, 64, True, user=True),
    Case("bf16", 200, 129, 256, True, nheads=4, nheads_k=2, user=True),
    # Dropout (dense, causal with GQA, window, block mask, plain kernels).
    Case("bf16", 300, 257, 128, True, nheads=4, nheads_k=2, dropout=0.2),
    Case("fp16", 257, 300, 64, False, window=(40, 30), dropout=0.5),
    Case("fp16", 200, 130, 96, False, block=(64, 64), dropout=0.1),
    Case("fp32", 130, 97, 72, True, dropout=0.3),
    # Plain float32 / float64 kernels.
    Case("fp32", 17, 130, 72, True, nheads=4, nheads_k=2),
    Case("fp64", 130, 97, 40, False, batch=2),
    Case("fp64", 1, 17, 256, True),
    Case("fp32", 130, 1, 256, False),
    Case("fp32", 255, 300, 128, False, nheads=4, nheads_k=1),
    Case("fp64", 257, 97, 96, True, nheads=3, nheads_k=1),
    # Packed batches: tiles that reach into the next sequence, a sequence without keys and one
    # without queries (Hopper kernels for bf16/fp16 at every head-dim family, generic for fp32).
    Case("bf16", 200, 257, 128, True, nheads=4, nheads_k=2,
         packed=((1, 3), (130, 97), (0, 5), (17, 0), (200, 257), (64, 64))),
    Case("fp16", 130, 130, 64, False, packed=((97, 130), (130, 1), (5, 17))),
    Case("fp16", 200, 257, 128, False, nheads=4, nheads_k=2, alibi=True,
         packed=((200, 257), (1, 3), (130, 97))),   # 80-query backward steps
    Case("bf16", 130, 200, 256, True, packed=((130, 200), (33, 17), (1, 1))),
    Case("fp32", 130, 97, 72, True, nheads=4, nheads_k=2, packed=((130, 97), (0, 3), (17, 40))),
    # KV caches (the decode kernels): empty, partial and full entries, contiguous and paged
    # (the pages shuffled), one split and several, chunked prefill with a band.
    Case("bf16", 1, 256, 128, False, batch=3, nheads=8, nheads_k=2, cache=((0, 100, 255), 0, 0)),
    Case("fp16", 1, 512, 64, False, batch=2, nheads=4, nheads_k=4, cache=((300, 511), 16, 3)),
    Case("bf16", 3, 512, 256, True, batch=2, nheads=6, nheads_k=1, window=(100, 0), softcap=5.0,
         cache=((17, 400), 256, 0)),
)

# One error of each tool's kind: a read one element past an array (memcheck), warps writing
# the same shared words without a barrier (racecheck), a barrier only half the block reaches
# (synccheck), a read of memory nothing wrote (initcheck).
PLANTED_SOURCE = r"""
extern "C" __global__ void memcheck(const float* x, float* y, int n) {
    if (threadIdx.x == 0) y[0] = x[n];
}
extern "C" __global__ void racecheck(const float* x, float* y, int n) {
    __shared__ float s[32];
    s[threadIdx.x % 32] = threadIdx.x;
    y[threadIdx.x] = s[(threadIdx.x + 1) % 32];
}
extern "C" __global__ void synccheck(const float* x, float* y, int n) {
    if (threadIdx.x < 16) __syncthreads();
    y[threadIdx.x] = 1.f;
}
extern "C" __global__ void initcheck(const float* x, float* y, int n) {
    y[threadIdx.x] = x[threadIdx.x];
}
"""
PLANTED_THREADS = 64


# --- the driver: what runs under each tool ---------------------------------------------------

def _block_mask(case):
    """A BlockMask for the case: block row 1 and block column 1 dropped (where there are
    three or more, so that some rows and keys see nothing) and the last block of row 0
    (a row with a shorter list)."""
    import numpy as np
    import cupyflash as cf
    bq, bk = case.block
    grid = np.ones((-(-case.sq // bq), -(-case.sk // bk)), bool)
    if grid.shape[0] >= 3:
        grid[1] = False
    if grid.shape[1] >= 3:
        grid[:, 1] = False
    if grid.shape[1] >= 2:
        grid[0, -1] = False
    return cf.BlockMask.from_dense(grid, (bq, bk), seqlen_q=case.sq, seqlen_k=case.sk)


def _host_inputs(case):
    from tests.reference import random_inputs
    import numpy as np
    seed = zlib.crc32(case.id.encode())
    shape_q = (case.batch, case.sq, case.nheads, case.d)
    shape_kv = (case.batch, case.sk, case.nheads_k, case.d)
    if case.packed:
        totals = [sum(n) for n in zip(*case.packed)]
        shape_q, shape_kv = (totals[0], case.nheads, case.d), (totals[1], case.nheads_k, case.d)
    q, k, v = random_inputs(np, shape_q, shape_kv, gpu_checks.DTYPES[case.dtype], seed)
    dout = random_inputs(np, shape_q, shape_q, gpu_checks.DTYPES[case.dtype], seed + 3)[0]
    return q, k, v, dout


def _offsets(case):
    """cu_seqlens_q, cu_seqlens_k (NumPy int32) of a packed case."""
    import numpy as np
    return tuple(np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in zip(*case.packed))


def _run_packed(case, host):
    """_run_gpu of a packed case: out (total_q, h, d), lse (h, total_q), the gradients."""
    import cupy as cp
    import cupyflash as cf
    q, k, v, dout = (cp.asarray(x) for x in host)
    cu = [cp.asarray(c) for c in _offsets(case)]
    assert not case.dropout, "a packed case's sequences are checked as dense ones: no dropout"
    kw = case.keywords(cp)
    if kw["alibi_slopes"] is not None:   # each sequence the slopes of a dense case of batch 1
        kw["alibi_slopes"] = cp.tile(kw["alibi_slopes"][:1], (len(case.packed), 1))
    out, lse = cf.flash_attention_varlen(q, k, v, *cu, causal=case.causal, return_lse=True, **kw)
    grads = {mode: tuple(cp.asnumpy(x) for x in cf.flash_attention_varlen_backward(
                 dout, q, k, v, out, lse, *cu, causal=case.causal, deterministic=mode == "deterministic", **kw))
             for mode in case.modes}
    return cp.asnumpy(out), cp.asnumpy(lse), grads


def _check_packed(case, host, result):
    """Each sequence of a packed case by _check, as a dense case of its own; sequences without
    keys must give out 0 and lse -inf, keys without queries dk = dv = 0."""
    import dataclasses
    import numpy as np
    q, k, v, dout = host
    out, lse, grads = result
    cq, ck = _offsets(case)
    for b, (sq, sk) in enumerate(case.packed):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if sq == 0:
            assert all((g[i][rk] == 0).all() for g in grads.values() for i in (1, 2)), f"dk, dv of sequence {b}"
        elif sk == 0:
            assert (out[rq] == 0).all() and np.isneginf(lse[:, rq]).all(), f"out, lse of sequence {b}"
        else:
            one = dataclasses.replace(case, sq=sq, sk=sk, batch=1, packed=None)
            _check(one, (q[None, rq], k[None, rk], v[None, rk], dout[None, rq]),
                   (out[None, rq], lse[None, :, rq],
                    {m: (g[0][None, rq], g[1][None, rk], g[2][None, rk]) for m, g in grads.items()}), None)


def _cache_inputs(case):
    """q (batch, sq, h, d), the caches (batch, sk, hk, d) and the new key and value (batch, 1,
    hk, d) of a KV-cache case, on the host."""
    from tests.reference import random_inputs
    import numpy as np
    seed = zlib.crc32(case.id.encode())
    dtype = gpu_checks.DTYPES[case.dtype]
    q, k, v = random_inputs(np, (case.batch, case.sq, case.nheads, case.d),
                            (case.batch, case.sk, case.nheads_k, case.d), dtype, seed)
    _, k_new, v_new = random_inputs(np, (1,), (case.batch, 1, case.nheads_k, case.d), dtype, seed + 5)
    return q, k, v, k_new, v_new


def _run_cache(case, host):
    """out and lse of a KV-cache case, with the caches laid out in pages when it has them."""
    import cupy as cp
    import numpy as np
    import cupyflash as cf
    q, k, v, k_new, v_new = (cp.asarray(x) for x in host)
    lens, page, splits = case.cache
    table = None
    if page:
        count = case.batch * case.sk // page
        order = np.random.default_rng(1).permutation(count)
        paged = []
        for x in (k, v):
            pages = cp.empty((count, page) + x.shape[2:], x.dtype)
            pages[cp.asarray(order)] = x.reshape(pages.shape)
            paged.append(pages)
        k, v = paged
        table = cp.asarray(order.reshape(case.batch, -1).astype(np.int32))
    kw = case.keywords(cp)
    out, lse = cf.flash_attention_with_kvcache(
        q, k, v, k=k_new, v=v_new, cache_seqlens=cp.asarray(np.asarray(lens, np.int32)), block_table=table,
        causal=case.causal, num_splits=splits, return_lse=True, window_size=kw["window_size"],
        softcap=kw["softcap"])
    return cp.asnumpy(out), cp.asnumpy(lse)


def _check_cache(case, host, result):
    """Each entry against the reference over its valid keys (the cache's prefix and the new
    key), by _check_forward."""
    import dataclasses
    import numpy as np
    q, k, v, k_new, v_new = host
    out, lse = result
    for b, n in enumerate(case.cache[0]):
        one = dataclasses.replace(case, sk=n + 1, batch=1, cache=None)
        keys, values = (np.concatenate([x[b:b + 1, :n], new[b:b + 1]], axis=1) for x, new in ((k, k_new), (v, v_new)))
        _check_forward(one, q[b:b + 1], keys, values, out[b:b + 1], lse[b:b + 1], one.reference_keywords(), None)


def _run_gpu(case, host, block_mask):
    """out, lse and {mode: (dq, dk, dv)}, copied to the host."""
    import cupy as cp
    import cupyflash as cf
    q, k, v, dout = (cp.asarray(x) for x in host)
    scale = case.d ** -0.5
    variant = case.keywords(cp)
    if case.user:
        variant.update(case.user_mods(cp))
    out, lse = cf.flash_attention(q, k, v, causal=case.causal, softmax_scale=scale,
                                  block_mask=block_mask, return_lse=True, **variant)
    grads = {}
    for mode in case.modes:
        g = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                        softmax_scale=scale, block_mask=block_mask,
                                        deterministic=mode == "deterministic", **variant)
        grads[mode] = tuple(cp.asnumpy(x) for x in g[:3])
    return cp.asnumpy(out), cp.asnumpy(lse), grads


def _assert_close(name, got, ref, rtol, magnitude):
    import numpy as np
    got = got.astype(np.float64)
    assert np.isfinite(got).all(), f"{name} is not finite everywhere"
    err = float(np.abs(got - ref).max())
    assert err <= rtol * max(magnitude, 1e-30), \
        f"{name}: max error {err:.3e} > {rtol:.1e} * {magnitude:.3e}"


def _check(case, host, result, block_mask):
    """The results against the float64 reference on the host, by tests/gpu_checks.py's rule."""
    import numpy as np
    from tests.reference import assert_rule, attention_naive_backward, attention_ref_backward
    q, k, v, dout = host
    out, lse, grads = result
    scale = case.d ** -0.5
    mask = None if block_mask is None else block_mask.to_dense()
    variant = case.reference_keywords()
    if case.user:
        variant["bias"], mask = case.user_reference()
    _check_forward(case, q, k, v, out, lse, variant, mask)
    refs = attention_ref_backward(dout, q, k, v, scale, case.causal, mask=mask, **variant)
    magnitude = max(float(np.abs(r).max()) for r in refs)
    names = ("dq", "dk", "dv")
    if case.dtype in gpu_checks.HALF:
        naives = attention_naive_backward(dout, q, k, v, scale, case.causal, q.dtype, mask=mask,
                                          **variant)
        for mode, g in grads.items():
            for name, got, ref, naive in zip(names, g, refs, naives):
                assert_rule(f"{name} ({mode})", got, ref, naive, gpu_checks.BWD_FACTOR, magnitude)
    else:
        rtol = _rtol(case)
        for mode, g in grads.items():
            for name, got, ref in zip(names, g, refs):
                _assert_close(f"{name} ({mode})", got, ref, rtol, magnitude)


def _rtol(case):
    return gpu_checks.fp32_rtol(case.sq, case.sk) if case.dtype == "fp32" else gpu_checks.FP64_RTOL


def _check_forward(case, q, k, v, out, lse, variant, mask):
    """out and lse against the float64 reference (the tolerance rule for 16-bit dtypes)."""
    import numpy as np
    from tests.reference import assert_rule, attention_naive, attention_ref
    ref_out, ref_lse = attention_ref(q, k, v, case.d ** -0.5, case.causal, mask=mask, **variant)
    if case.dtype in gpu_checks.HALF:
        naive_out, _ = attention_naive(q, k, v, case.d ** -0.5, case.causal, q.dtype, mask=mask, **variant)
        assert_rule("out", out, ref_out, naive_out, gpu_checks.FWD_FACTOR)
    else:
        _assert_close("out", out, ref_out, _rtol(case), float(np.abs(ref_out).max()))
    lse = lse.astype(np.float64)
    seen = np.isfinite(ref_lse)
    assert (np.isneginf(lse) == ~seen).all(), "lse is not -inf exactly on the rows without keys"
    err = np.abs(lse[seen] - ref_lse[seen])
    bound = gpu_checks.LSE_RTOL[case.dtype] * np.maximum(np.abs(ref_lse[seen]), 1.0)
    assert (err <= bound).all(), f"lse: max error {float(err.max(initial=0)):.3e}"


def planted(tool):
    """Launch the kernel with ``tool``'s kind of error (see PLANTED_SOURCE)."""
    import cupy as cp
    cp.cuda.set_allocator(None)
    x = cp.empty(PLANTED_THREADS, cp.float32)
    if tool != "initcheck":
        x.fill(1)
    y = cp.zeros(PLANTED_THREADS, cp.float32)
    kernel = cp.RawModule(code=PLANTED_SOURCE).get_function(tool)
    kernel((1,), (PLANTED_THREADS,), (x, y, cp.int32(PLANTED_THREADS)))
    cp.cuda.Device().synchronize()
    print(f"planted: {tool} kernel ran")
    return 0


def driver(ids):
    """Run and check the cases (all, or those named); the exit status is 3 if a check failed."""
    import cupy as cp
    from cupyflash import _launch, _spec
    cp.cuda.set_allocator(None)
    cases = [c for c in CASES if not ids or c.id in ids]
    failed = skipped = 0
    for case in cases:
        t0 = time.perf_counter()
        block_mask = _block_mask(case) if case.block else None
        host = _cache_inputs(case) if case.cache else _host_inputs(case)
        kw = case.keywords(cp)
        kw.pop("seed", None), kw.pop("offset", None)
        spec = _spec.CallSpec.of(host[0], causal=case.causal, block_mask=block_mask, **kw)
        try:
            _launch.check_supported(spec, block_mask)
        except (TypeError, ValueError) as e:   # this GPU cannot run it (no tensor cores, ...)
            skipped += 1
            print(f"skip {case.id}: {e}", flush=True)
            continue
        try:
            if case.cache:
                _check_cache(case, host, _run_cache(case, host))
            elif case.packed:
                _check_packed(case, host, _run_packed(case, host))
            else:
                _check(case, host, _run_gpu(case, host, block_mask), block_mask)
            print(f"ok   {case.id} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except AssertionError as e:
            failed += 1
            print(f"FAIL {case.id}: {e}", flush=True)
    print(f"driver: {len(cases)} cases, {failed} failed, {skipped} skipped", flush=True)
    return 3 if failed else 0


# --- the runner ------------------------------------------------------------------------------

def _find_sanitizer():
    found = os.environ.get("COMPUTE_SANITIZER") or shutil.which("compute-sanitizer")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/compute-sanitizer",
                    "/usr/local/cuda*/bin/compute-sanitizer",
                    "/usr/local/cuda*/compute-sanitizer/compute-sanitizer",
                    "/opt/nvidia/*/compute-sanitizer"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def _driver_cmd(ids):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--driver"]
    for i in ids:
        cmd += ["--case", i]
    return cmd


def _run_logged(cmd, log_path, env, timeout):
    """(exit status or None on timeout, seconds, log text)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return rc, time.perf_counter() - t0, Path(log_path).read_text(errors="replace")


def _driver_summary(text):
    m = re.findall(r"^driver: (\d+) cases, (\d+) failed, (\d+) skipped", text, re.M)
    if not m:
        return None, "driver did not finish"
    _, failed, skipped = (int(x) for x in m[-1])
    note = f"checks {'ok' if not failed else f'{failed} FAILED'}"
    return failed, note + (f", {skipped} skipped" if skipped else "")


def _error_count(text):
    """The tool's error count (racecheck prints its own summary instead of ERROR SUMMARY)."""
    m = re.findall(r"ERROR SUMMARY: (\d+) errors?", text) or \
        re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?", text)
    return int(m[-1]) if m else None


def _warning_note(text):
    m = re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \(\d+ errors?, (\d+) warnings?",
                   text)
    return f", {m[-1]} warnings" if m else ""


def _excerpt(text, limit=60):
    """The first reports of a sanitizer log and every failed check, for the console."""
    lines = text.splitlines()
    keep = [l for l in lines if l.startswith(("FAIL ", "skip "))]
    first = next((i for i, l in enumerate(lines) if l.startswith("========= ")
                  and "COMPUTE-SANITIZER" not in l and "ERROR SUMMARY" not in l), None)
    if first is not None:
        keep += lines[first:first + limit]
    return keep


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tools", default=",".join(TOOLS),
                    help="comma-separated, from " + ", ".join(TOOLS))
    ap.add_argument("--case", action="append", default=[], help="a case id (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the case ids and exit")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--planted", choices=TOOLS, help=argparse.SUPPRESS)
    ap.add_argument("--no-plain", action="store_true",
                    help="skip the plain run (the kernels are already in the disk cache)")
    ap.add_argument("--jobs", type=int, default=len(TOOLS), help="tools run side by side")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per tool")
    ap.add_argument("--log-dir", help="where each run's full log goes (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.list:
        for c in CASES:
            print(c.id)
        return 0
    unknown = set(args.case) - {c.id for c in CASES}
    if unknown:
        ap.error(f"unknown case(s): {', '.join(sorted(unknown))} (see --list)")
    if args.driver:
        return driver(set(args.case))
    if args.planted:
        return planted(args.planted)
    tools = [t for t in args.tools.split(",") if t]
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        ap.error(f"unknown tool(s) {bad}, expected some of {TOOLS}")

    env = dict(os.environ)
    env.setdefault("CUPY_CACHE_DIR", str(ROOT / ".cupy_cache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sanitize_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ids = args.case or [c.id for c in CASES]
    print(f"sanitize: {len(ids)} cases, tools {', '.join(tools)}; logs in {log_dir}; "
          f"CUPY_CACHE_DIR={env['CUPY_CACHE_DIR']}", flush=True)
    ok = True

    if not args.no_plain:
        jobs = max(1, min(os.cpu_count() or 1, len(ids)))
        groups = [ids[i::jobs] for i in range(jobs)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(jobs) as pool:
            runs = list(pool.map(lambda g: _run_logged(_driver_cmd(g[1]),
                                                       log_dir / f"plain_{g[0]}.log", env,
                                                       args.timeout),
                                 enumerate(groups)))
        failed = [l for _, _, text in runs for l in text.splitlines() if l.startswith("FAIL ")]
        crashed = [text for rc, _, text in runs if rc not in (0, 3)]
        print(f"plain run (compiles into the cache): {len(ids)} cases in {jobs} processes, "
              f"{time.perf_counter() - t0:.0f} s, {len(failed)} failed checks, "
              f"{len(crashed)} crashed", flush=True)
        for line in failed:
            print("  " + line)
        if crashed:
            print("  the first crash:\n    " + "\n    ".join(crashed[0].splitlines()[-30:]))
        ok = not failed and not crashed

    sanitizer = _find_sanitizer()
    if sanitizer is None:
        print("sanitize: compute-sanitizer not found (PATH, /usr/local/cuda*/bin; or set "
              "COMPUTE_SANITIZER)")
        return 1
    t0 = time.perf_counter()

    def run_tool(job):
        tool, what = job
        script = [sys.executable, str(Path(__file__).resolve()), "--planted", tool] \
            if what == "planted" else _driver_cmd(args.case)
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1", *TOOL_ARGS.get(tool, ()),
               *script]
        return _run_logged(cmd, log_dir / f"{tool}{'_planted' if what == 'planted' else ''}.log",
                           {**env, **TOOL_ENV.get(tool, {})}, args.timeout)

    jobs = [(t, w) for t in tools for w in ("cases", "planted")]
    with ThreadPoolExecutor(max(1, 2 * args.jobs)) as pool:
        runs = dict(zip(jobs, pool.map(run_tool, jobs)))
    wall = time.perf_counter() - t0
    counts = []
    for tool in tools:
        rc, sec, text = runs[tool, "cases"]
        errors = _error_count(text)
        failed, note = _driver_summary(text)
        planted_errors = _error_count(runs[tool, "planted"][2])
        caught = bool(planted_errors)
        status = "TIMEOUT" if rc is None else f"exit {rc}"
        print(f"{tool:<10} {'?' if errors is None else errors} errors{_warning_note(text)}, "
              f"{note}, {sec:.0f} s ({status}); planted error "
              f"{'reported' if caught else 'NOT REPORTED'} ({planted_errors} errors)", flush=True)
        if errors != 0 or failed != 0 or rc is None:
            ok = False
            for line in _excerpt(text) or text.splitlines()[-30:]:
                print("    " + line)
        if not caught:
            ok = False
            print("    " + "\n    ".join(runs[tool, "planted"][2].splitlines()[-20:]))
        counts.append(f"{tool} {'?' if errors is None else errors}")
    print(f"sanitize: {', '.join(counts)} errors; {'all clean' if ok else 'NOT CLEAN'}; "
          f"tools {wall:.0f} s wall")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
