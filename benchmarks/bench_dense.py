"""Dense attention speed: cupyflash against PyTorch SDPA's flash backend (FlashAttention 2).

    python benchmarks/bench_dense.py --out DIR [--quick]

bf16, head dim 128, 16 heads, batch x seqlen = 16K tokens, causal and not. Each number is the
median of per-call CUDA-event times after warm-up, rotating among 3 random input sets. The
calls are queued behind a spin kernel so that the GPU runs them back to back and the times do
not include Python's launch overhead. FLOPs (DESIGN.md): forward 4*b*h*s*s*d, halved for
causal; backward 2.5x the forward. Writes DIR/bench_dense.json and prints a table.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

import cupy as cp
import ml_dtypes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupyflash as cf  # noqa: E402

HEADDIM = 128
NHEADS = 16
TOKENS = 16 * 1024
SEQLENS = (1024, 2048, 4096, 8192)
QUICK_SEQLENS = (1024, 8192)
SETS = 3
BF16 = np.dtype(ml_dtypes.bfloat16)

_SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
""", "spin")


def flops(batch, seqlen, causal):
    fwd = 4.0 * batch * NHEADS * seqlen * seqlen * HEADDIM
    if causal:
        fwd /= 2
    return fwd, 2.5 * fwd


def tflops(flop, ms):
    return flop / (ms * 1e-3) / 1e12


def time_calls(calls, reps, warmup, record, delay):
    """Median and min (ms) of per-call times. ``calls`` is a list of zero-argument functions
    (one per input set), used in turn; ``record`` makes and records an event, ``delay`` queues
    a spin kernel that keeps the GPU busy while Python queues the timed calls."""
    for i in range(warmup):
        calls[i % len(calls)]()
    events = []
    delay()
    events.append(record())
    for i in range(reps):
        calls[i % len(calls)]()
        events.append(record())
    events[-1].synchronize()
    times = [events[i].elapsed(events[i + 1]) for i in range(reps)]
    return statistics.median(times), min(times)


# ---- ours -------------------------------------------------------------------------------

def _cp_record():
    e = cp.cuda.Event()
    e.record()
    return e


class _CpEvent:
    """CuPy events with the elapsed() of torch's, so that time_calls serves both."""

    def __init__(self):
        self.e = _cp_record()

    def synchronize(self):
        self.e.synchronize()

    def elapsed(self, other):
        return cp.cuda.get_elapsed_time(self.e, other.e)


def _cp_delay(ms):
    cycles = int(ms * 1e-3 * 2.2e9)       # H100 SM clock is at most ~2 GHz: at least ms long
    _SPIN((1,), (1,), (np.int64(cycles),))


def make_sets(batch, seqlen, seed):
    """SETS float32 input sets (q, k, v, dout), each (batch, seqlen, NHEADS, HEADDIM)."""
    rng = cp.random.default_rng(seed)
    shape = (batch, seqlen, NHEADS, HEADDIM)
    return [tuple(rng.standard_normal(shape, dtype=cp.float32) for _ in range(4))
            for _ in range(SETS)]


def bench_ours(sets32, causal, reps, warmup, delay_ms):
    sets = [tuple(a.astype(BF16) for a in s) for s in sets32]
    fwd_calls = [lambda s=s: cf.flash_attention(s[0], s[1], s[2], causal=causal,
                                                return_lse=True) for s in sets]
    fwd_ms, fwd_min = time_calls(fwd_calls, reps, warmup, _CpEvent, lambda: _cp_delay(delay_ms))
    saved = [cf.flash_attention(q, k, v, causal=causal, return_lse=True)
             for q, k, v, _ in sets]
    bwd_calls = [lambda s=s, o=o: cf.flash_attention_backward(
        s[3], s[0], s[1], s[2], o[0], o[1], causal=causal) for s, o in zip(sets, saved)]
    bwd_ms, bwd_min = time_calls(bwd_calls, reps, warmup, _CpEvent,
                                 lambda: _cp_delay(2.5 * delay_ms))
    cp.cuda.Device().synchronize()             # raises on any kernel fault
    out = saved[0][0]
    grads = bwd_calls[0]()
    bad = [n for n, a in (("out", out), ("lse", saved[0][1])) + tuple(zip(("dq", "dk", "dv"), grads))
           if bool(cp.isnan(a.astype(cp.float32)).any())]
    if bad:
        raise RuntimeError(f"NaN in {', '.join(bad)}")
    return dict(fwd_ms=fwd_ms, fwd_min_ms=fwd_min, bwd_ms=bwd_ms, bwd_min_ms=bwd_min), \
        out.astype(cp.float32)


# ---- PyTorch SDPA (flash backend) ---------------------------------------------------------

def _torch():
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch, SDPBackend, sdpa_kernel


class _TorchEvent:
    def __init__(self):
        import torch
        self.e = torch.cuda.Event(enable_timing=True)
        self.e.record()

    def synchronize(self):
        self.e.synchronize()

    def elapsed(self, other):
        return self.e.elapsed_time(other.e)


def bench_sdpa(tmod, sets32, causal, reps, warmup, delay_ms):
    torch, SDPBackend, sdpa_kernel = tmod
    F = torch.nn.functional
    cycles = int(delay_ms * 1e-3 * 2.2e9)
    sleep = getattr(torch.cuda, "_sleep", None) or (lambda c: _SPIN((1,), (1,), (np.int64(c),)))
    # Same data as ours: the float32 sets cross by DLPack and are rounded to bf16 the same way.
    # Stored (b, s, h, d) like ours; SDPA sees the (b, h, s, d) view.
    sets = []
    for s in sets32:
        q, k, v, dout = (torch.from_dlpack(a).to(torch.bfloat16) for a in s)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        sets.append((q, k, v, dout.transpose(1, 2)))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=causal)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with torch.no_grad():
            fwd_calls = [lambda s=s: attend(s[0], s[1], s[2]) for s in sets]
            fwd_ms, fwd_min = time_calls(fwd_calls, reps, warmup, _TorchEvent,
                                         lambda: sleep(cycles))
            out0 = attend(*sets[0][:3]).transpose(1, 2).float()
        outs = [attend(q, k, v) for q, k, v, _ in sets]
        bwd_calls = [lambda s=s, o=o: torch.autograd.grad(o, s[:3], s[3], retain_graph=True)
                     for s, o in zip(sets, outs)]
        bwd_ms, bwd_min = time_calls(bwd_calls, reps, warmup, _TorchEvent,
                                     lambda: sleep(int(2.5 * cycles)))
    torch.cuda.synchronize()
    return dict(fwd_ms=fwd_ms, fwd_min_ms=fwd_min, bwd_ms=bwd_ms, bwd_min_ms=bwd_min), \
        cp.from_dlpack(out0.contiguous())


# ---- report --------------------------------------------------------------------------------

def _git_commit():
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions(tmod):
    rt = cp.cuda.runtime.runtimeGetVersion()
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cupy": cp.__version__, "torch": tmod[0].__version__ if tmod else None,
            "cuda_runtime": f"{rt // 1000}.{rt % 1000 // 10}",
            "cuda_driver": cp.cuda.runtime.driverGetVersion(),
            "cupyflash": cf.__version__}


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def table(rows):
    head = ("impl", "causal", "seqlen", "batch", "fwd ms", "fwd TFLOP/s", "bwd ms",
            "bwd TFLOP/s", "fwd ours/sdpa", "bwd ours/sdpa")
    lines = []
    for r in rows:
        lines.append((r["impl"], str(r["causal"]), str(r["seqlen"]), str(r["batch"]),
                      _fmt(r.get("fwd_ms"), ".3f"), _fmt(r.get("fwd_tflops"), ".1f"),
                      _fmt(r.get("bwd_ms"), ".3f"), _fmt(r.get("bwd_tflops"), ".1f"),
                      _fmt(r.get("fwd_ratio"), ".2f"), _fmt(r.get("bwd_ratio"), ".2f")))
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(l, widths)) for l in lines]
    notes = [f"{r['impl']} causal={r['causal']} seqlen={r['seqlen']}: {r['error']}"
             for r in rows if r.get("error")]
    return "\n".join(out + notes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_dense.json")
    ap.add_argument("--quick", action="store_true", help=f"seqlens {QUICK_SEQLENS} only")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    reps = max(args.reps, 10)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmod = _torch()
    if tmod is None:
        print("torch with CUDA not found: SDPA rows skipped")
    gpu = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{gpu}: bf16, d={HEADDIM}, nheads={NHEADS}, {TOKENS} tokens, {reps} reps")

    rows = []
    for seqlen in (QUICK_SEQLENS if args.quick else SEQLENS):
        batch = TOKENS // seqlen
        sets32 = make_sets(batch, seqlen, seed=seqlen)
        for causal in (False, True):
            fwd_flop, bwd_flop = flops(batch, seqlen, causal)
            # Spin long enough to cover queueing all timed calls (well under 1 ms each).
            delay_ms = 10 + 1.0 * reps
            got = {}
            results = {}
            for impl in ["cupyflash"] + (["sdpa_flash"] if tmod else []):
                row = dict(impl=impl, causal=causal, seqlen=seqlen, batch=batch, nheads=NHEADS,
                           headdim=HEADDIM, dtype="bfloat16", fwd_flop=fwd_flop,
                           bwd_flop=bwd_flop, reps=reps)
                try:
                    if impl == "cupyflash":
                        t, results[impl] = bench_ours(sets32, causal, reps, args.warmup, delay_ms)
                    else:
                        t, results[impl] = bench_sdpa(tmod, sets32, causal, reps, args.warmup,
                                                      delay_ms)
                    row.update(t)
                    row["fwd_tflops"] = tflops(fwd_flop, t["fwd_ms"])
                    row["bwd_tflops"] = tflops(bwd_flop, t["bwd_ms"])
                except Exception as e:  # one failing case must not hide the others
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    cp.cuda.Device().synchronize()
                got[impl] = row
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
            ours, sdpa = got.get("cupyflash"), got.get("sdpa_flash")
            if ours and sdpa and "error" not in ours and "error" not in sdpa:
                ours["fwd_ratio"] = ours["fwd_tflops"] / sdpa["fwd_tflops"]
                ours["bwd_ratio"] = ours["bwd_tflops"] / sdpa["bwd_tflops"]
                diff = float(cp.abs(results["cupyflash"] - results["sdpa_flash"]).max())
                ours["max_abs_diff_out_vs_sdpa"] = diff
            del results
        del sets32
        cp.get_default_memory_pool().free_all_blocks()
        if tmod:
            tmod[0].cuda.empty_cache()

    report = {
        "benchmark": "dense attention, forward (with lse) and backward",
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "versions": _versions(tmod),
        "config": dict(dtype="bfloat16", headdim=HEADDIM, nheads=NHEADS, tokens=TOKENS,
                       input_sets=SETS, reps=reps, warmup=args.warmup, statistic="median",
                       flops="fwd 4*b*h*s*s*d (halved for causal), bwd 2.5x fwd"),
        "rows": rows,
    }
    path = out_dir / "bench_dense.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {path}")
    print("=== bench_dense table ===")
    print(table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
