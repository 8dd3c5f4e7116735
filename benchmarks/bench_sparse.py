"""Block-sparse attention speed: time against our own dense time, beside FlexAttention.

    python benchmarks/bench_sparse.py --out DIR [--quick] [--no-flex]

bf16, head dim 128, batch 1, 16 heads, seqlen 8192 and 32768 (--quick: 8192 only). Patterns,
all with 128 x 128 blocks:
  random          masks.random(density=0.10, seed=0, nheads=16): one layout per head
  sliding_window  masks.sliding_window(window=1024) with causal=True at call time: each query
                  sees the keys of the blocks that meet the 1024 keys ending at itself
  causal          masks.causal(...) as a block mask (no causal flag at call time)
Each is timed forward (with lse) and backward, as the median of per-call CUDA-event times
after warm-up (same method as bench_dense.py), and divided by our dense time (no mask, not
causal) at the same shape: with block skipping working, the ratio follows the density (the
fraction of visible elements, the call's causal included).

FlexAttention (torch.compile(flex_attention)) runs the same element masks on the same data
(rounded to bf16 the same way) with its own dense time for its ratio: causal and the window
through create_block_mask with a mask_mod (checked element by element against our
to_dense() at a small size), the per-head random layout through BlockMask.from_kv_blocks
from our block lists (a mask_mod over a 16 x 32K x 32K lookup would be built element by
element). Max |ours - flex| of the outputs is recorded as a check that both ran the same
mask. FlexAttention is skipped, with the reason recorded, where torch or its compile is
missing or fails. Writes DIR/bench_sparse.json and prints a table last.
"""
import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import cupy as cp
import ml_dtypes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupyflash as cf  # noqa: E402
from cupyflash import masks  # noqa: E402
from bench_dense import (_CpEvent, _TorchEvent, _cp_delay, _fmt, _git_commit,  # noqa: E402
                         _versions, time_calls)

HEADDIM = 128
NHEADS = 16
BATCH = 1
BLOCK = 128
SEQLENS = (8192, 32768)
QUICK_SEQLENS = (8192,)
SETS = 2
RANDOM_DENSITY = 0.10
WINDOW = 1024
PATTERNS = ("dense", "random", "sliding_window", "causal")
# Ours vs FlexAttention on the same bf16 inputs: rounding differs by ~1% of max|out| at most;
# a different element mask moves whole rows by their own size.
FLEX_AGREE_RTOL = 0.05
FLEX_CHECK_SEQLEN = 4096
BF16 = np.dtype(ml_dtypes.bfloat16)


def reps_for(seqlen, reps):
    """Per-call medians need >= 10 samples; at 32K one dense backward takes ~0.1 s."""
    return (max(reps, 10), 3) if seqlen <= 8192 else (10, 2)


# ---- patterns -------------------------------------------------------------------------------

def build(pattern, seqlen):
    """(BlockMask or None, call causal) of a pattern."""
    if pattern == "dense":
        return None, False
    if pattern == "random":
        return masks.random(seqlen, seqlen, RANDOM_DENSITY, 0, block_size=BLOCK,
                            nheads=NHEADS), False
    if pattern == "sliding_window":
        return masks.sliding_window(seqlen, seqlen, WINDOW, block_size=BLOCK), True
    if pattern == "causal":
        return masks.causal(seqlen, seqlen, block_size=BLOCK), False
    raise ValueError(f"unknown pattern {pattern!r}")


def visible_fraction(mask, call_causal):
    """Fraction of the (heads x seqlen_q x seqlen_k) elements attended, the call's causal
    flag included (at block level: ANDing with the causal block mask adds the element rule)."""
    if mask is None:
        return 1.0
    if call_causal and not mask.causal:
        mask = mask & masks.causal(mask.seqlen_q, mask.seqlen_k, block_size=mask.block_size)
    return mask.density


# ---- ours -----------------------------------------------------------------------------------

def make_sets(seqlen, seed):
    """SETS float32 input sets (q, k, v, dout), each (BATCH, seqlen, NHEADS, HEADDIM)."""
    rng = cp.random.default_rng(seed)
    shape = (BATCH, seqlen, NHEADS, HEADDIM)
    return [tuple(rng.standard_normal(shape, dtype=cp.float32) for _ in range(4))
            for _ in range(SETS)]


def bench_ours(sets16, mask, causal, reps, warmup):
    fwd_calls = [lambda s=s: cf.flash_attention(s[0], s[1], s[2], causal=causal,
                                                block_mask=mask, return_lse=True)
                 for s in sets16]
    delay_ms = 10 + 1.0 * reps
    fwd_ms, fwd_min = time_calls(fwd_calls, reps, warmup, _CpEvent, lambda: _cp_delay(delay_ms))
    saved = [f() for f in fwd_calls]
    bwd_calls = [lambda s=s, o=o: cf.flash_attention_backward(
        s[3], s[0], s[1], s[2], o[0], o[1], causal=causal, block_mask=mask)
        for s, o in zip(sets16, saved)]
    bwd_ms, bwd_min = time_calls(bwd_calls, reps, warmup, _CpEvent,
                                 lambda: _cp_delay(2.5 * delay_ms))
    cp.cuda.Device().synchronize()             # raises on any kernel fault
    out, lse = saved[0]
    grads = bwd_calls[0]()
    bad = [n for n, a in (("out", out), ("lse", lse)) + tuple(zip(("dq", "dk", "dv"), grads))
           if bool(cp.isnan(a.astype(cp.float32)).any())]
    if bad:
        raise RuntimeError(f"NaN in {', '.join(bad)}")
    return dict(fwd_ms=fwd_ms, fwd_min_ms=fwd_min, bwd_ms=bwd_ms, bwd_min_ms=bwd_min), \
        out.astype(cp.float32)


# ---- FlexAttention --------------------------------------------------------------------------

class Flex:
    """torch, the compiled flex_attention and the block-mask helpers, or the reason why not."""

    def __init__(self):
        self.error = None
        try:
            import torch
            from torch.nn.attention import flex_attention as fa
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            import torch._dynamo
            # One compiled graph per (mask_mod, shape): raise dynamo's recompile limit (8 by
            # default, then it silently runs eager, which materializes the scores).
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 64)
            # The timing replays one backward graph (retain_graph=True), which compiled
            # backwards with donated buffers refuse.
            import torch._functorch.config
            torch._functorch.config.donated_buffer = False
            self.torch, self.fa = torch, fa
            self.attend = torch.compile(fa.flex_attention, dynamic=False)
        except Exception as e:
            self.torch = None
            self.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]

    def mask_mod(self, pattern, mask):
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
        mask, call_causal = build(pattern, FLEX_CHECK_SEQLEN)
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

    def from_lists(self, mask, call_causal, seqlen):
        """A flex BlockMask from our visiting lists: partial blocks (those that need the
        causal rule) take the causal mask_mod, full ones none."""
        torch = self.torch
        assert (mask.block_q, mask.block_k) == (BLOCK, BLOCK) and seqlen % BLOCK == 0
        causal = call_causal or mask.causal
        lists = mask.tile_lists(BLOCK, BLOCK, causal)
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
            return self.fa.BlockMask.from_kv_blocks(*args, BLOCK_SIZE=BLOCK, mask_mod=mod,
                                                    seq_lengths=(seqlen, seqlen))
        except TypeError:      # older torch: no seq_lengths
            return self.fa.BlockMask.from_kv_blocks(*args, BLOCK_SIZE=BLOCK, mask_mod=mod)

    def block_mask(self, pattern, mask, call_causal, seqlen):
        """(flex BlockMask or None, how it was built)."""
        if mask is None:
            return None, "none (dense)"
        mod = self.mask_mod(pattern, mask)
        if mod is None:
            return self.from_lists(mask, call_causal, seqlen), "from_kv_blocks(our block lists)"
        self.check_mask_mod(mod, pattern)
        try:
            bm = self.fa.create_block_mask(mod, None, None, seqlen, seqlen, device="cuda",
                                           BLOCK_SIZE=BLOCK)
            return bm, "create_block_mask(mask_mod)"
        except Exception as e:  # it builds the seqlen x seqlen element mask: may run out
            self.torch.cuda.empty_cache()
            return (self.from_lists(mask, call_causal, seqlen),
                    f"from_kv_blocks(our block lists); create_block_mask failed: {_error(e)}")

    def bench(self, sets32, block_mask, reps, warmup):
        torch = self.torch
        cycles = int((10 + 1.0 * reps) * 1e-3 * 2.2e9)
        sleep = getattr(torch.cuda, "_sleep", None)
        delay = (lambda c: sleep(c)) if sleep else (lambda c: _cp_delay(c / 2.2e6))
        # Same data as ours, rounded to bf16 the same way, stored (b, h, s, d) as flex wants.
        sets = []
        for s in sets32:
            q, k, v, dout = (torch.from_dlpack(a).to(torch.bfloat16).transpose(1, 2).contiguous()
                             for a in s)
            sets.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout))

        def attend(s):
            return self.attend(s[0], s[1], s[2], block_mask=block_mask)

        # Grad mode stays on (one compiled graph for both passes): the forward then writes
        # the logsumexp, as ours does with return_lse=True.
        t0 = time.perf_counter()
        out0 = attend(sets[0])
        torch.autograd.grad(out0, sets[0][:3], sets[0][3])
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        fwd_calls = [lambda s=s: attend(s) for s in sets]
        fwd_ms, fwd_min = time_calls(fwd_calls, reps, warmup, _TorchEvent,
                                     lambda: delay(cycles))
        outs = [attend(s) for s in sets]
        bwd_calls = [lambda s=s, o=o: torch.autograd.grad(o, s[:3], s[3], retain_graph=True)
                     for s, o in zip(sets, outs)]
        bwd_ms, bwd_min = time_calls(bwd_calls, reps, warmup, _TorchEvent,
                                     lambda: delay(int(2.5 * cycles)))
        torch.cuda.synchronize()
        out = cp.from_dlpack(outs[0].detach().transpose(1, 2).float().contiguous())
        return dict(fwd_ms=fwd_ms, fwd_min_ms=fwd_min, bwd_ms=bwd_ms, bwd_min_ms=bwd_min,
                    first_call_s=compile_s), out


# ---- report ---------------------------------------------------------------------------------

def _error(e):
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


COLUMNS = (("pattern", "pattern", "s"), ("seqlen", "seqlen", "d"), ("density", "density", ".4f"),
           ("ours fwd ms", "fwd_ms", ".3f"), ("ours bwd ms", "bwd_ms", ".3f"),
           ("ours fwd/dense", "fwd_vs_dense", ".3f"), ("ours bwd/dense", "bwd_vs_dense", ".3f"),
           ("flex fwd ms", "flex_fwd_ms", ".3f"), ("flex bwd ms", "flex_bwd_ms", ".3f"),
           ("flex fwd/dense", "flex_fwd_vs_dense", ".3f"),
           ("flex bwd/dense", "flex_bwd_vs_dense", ".3f"))


def table(rows):
    head = [c[0] for c in COLUMNS]
    lines = [[str(r[k]) if spec in ("s", "d") else _fmt(r.get(k), spec)
              for _, k, spec in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(l, widths)) for l in lines]
    for r in rows:
        for key in ("error", "flex_error"):
            if r.get(key):
                who = "ours" if key == "error" else "flex"
                out.append(f"{who} {r['pattern']} seqlen={r['seqlen']}: {r[key]}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_sparse.json")
    ap.add_argument("--quick", action="store_true", help=f"seqlens {QUICK_SEQLENS} only")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--flex-max-seqlen", type=int, default=max(SEQLENS),
                    help="run FlexAttention only up to this seqlen (each shape compiles anew)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    flex = None if args.no_flex else Flex()
    if flex is not None and flex.error:
        print(f"FlexAttention skipped: {flex.error}")
    use_flex = flex is not None and flex.error is None
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{gpu}: bf16, d={HEADDIM}, batch={BATCH}, nheads={NHEADS}, block {BLOCK}")

    rows = []
    t_start = time.perf_counter()
    for seqlen in (QUICK_SEQLENS if args.quick else SEQLENS):
        reps, warmup = reps_for(seqlen, args.reps)
        sets32 = make_sets(seqlen, seed=seqlen)
        sets16 = [tuple(a.astype(BF16) for a in s) for s in sets32]
        dense = {}
        for pattern in PATTERNS:
            row = dict(pattern=pattern, seqlen=seqlen, batch=BATCH, nheads=NHEADS,
                       headdim=HEADDIM, dtype="bfloat16", block=BLOCK, reps=reps)
            ours_out = None
            mask, call_causal = None, False
            try:
                mask, call_causal = build(pattern, seqlen)
                row["call_causal"] = call_causal
                row["density"] = visible_fraction(mask, call_causal)
                row["mask_density"] = mask.density if mask is not None else 1.0
                t, ours_out = bench_ours(sets16, mask, call_causal, reps, warmup)
                row.update(t)
                if pattern == "dense":
                    dense["ours"] = t
                if "ours" in dense:
                    row["fwd_vs_dense"] = t["fwd_ms"] / dense["ours"]["fwd_ms"]
                    row["bwd_vs_dense"] = t["bwd_ms"] / dense["ours"]["bwd_ms"]
            except Exception as e:  # one failing pattern must not hide the others
                traceback.print_exc()
                row["error"] = _error(e)
                cp.cuda.Device().synchronize()
            if use_flex and "density" in row and seqlen <= args.flex_max_seqlen:
                try:
                    bm, how = flex.block_mask(pattern, mask, call_causal, seqlen)
                    row["flex_block_mask"] = how
                    t, flex_out = flex.bench(sets32, bm, reps, warmup)
                    row.update({f"flex_{k}": x for k, x in t.items()})
                    if pattern == "dense":
                        dense["flex"] = t
                    if "flex" in dense:
                        row["flex_fwd_vs_dense"] = t["fwd_ms"] / dense["flex"]["fwd_ms"]
                        row["flex_bwd_vs_dense"] = t["bwd_ms"] / dense["flex"]["bwd_ms"]
                    if ours_out is not None:
                        diff = float(cp.abs(ours_out - flex_out).max())
                        top = float(cp.abs(ours_out).max())
                        row["max_abs_diff_out_vs_flex"] = diff
                        if diff > FLEX_AGREE_RTOL * top:
                            row["flex_error"] = (f"outputs disagree: max|ours - flex| {diff:.3e}"
                                                 f" > {FLEX_AGREE_RTOL} x max|out| ({top:.3e})")
                    del flex_out, bm
                except Exception as e:  # flex is a comparison: record and go on
                    traceback.print_exc()
                    row["flex_error"] = _error(e)
                finally:
                    flex.torch.cuda.synchronize()
                    flex.torch.cuda.empty_cache()
            rows.append(row)
            print("\n".join(table([row]).splitlines()[1:]), flush=True)
            del ours_out
        del sets32, sets16
        cp.get_default_memory_pool().free_all_blocks()
    wall = time.perf_counter() - t_start

    report = {
        "benchmark": "block-sparse attention, forward (with lse) and backward, vs dense",
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "versions": _versions((flex.torch,) if use_flex else None),
        "config": dict(dtype="bfloat16", headdim=HEADDIM, batch=BATCH, nheads=NHEADS,
                       block=BLOCK, random_density=RANDOM_DENSITY, window=WINDOW,
                       input_sets=SETS, statistic="median",
                       ratio="time / the same implementation's dense (no mask, not causal) "
                             "time at the same shape",
                       density="fraction of visible elements, call causal included",
                       wall_s=round(wall, 1)),
        "flex_skipped": None if use_flex else ("--no-flex" if flex is None else flex.error),
        "rows": rows,
    }
    path = out_dir / "bench_sparse.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {path} ({wall:.0f} s)")
    print("=== bench_sparse table ===")
    print(table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
