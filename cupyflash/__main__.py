"""Command line: ``python -m cupyflash [demo | warmup | bench]``.

``demo`` (the default) runs the forward and backward on random inputs, on the GPU when there
is one (else on the NumPy path with small shapes), and prints time, TFLOP/s, the error against
a float64 reference and the peak device memory. ``warmup`` compiles every kernel the tile
table can pick on the current GPU, so that later calls start without compiling. ``bench``
compares forward and backward TFLOP/s with every peer that is importable (naive CuPy
attention, PyTorch SDPA's flash, cuDNN and memory-efficient backends), and fwd+bwd time and
peak memory with naive attention, on the GPU; ``--plot`` draws TFLOP/s against seqlen.
"""
import argparse
import functools
import sys
import time

import numpy as np

from . import _spec, bench as _bench
from ._gpu import gpu_or_reason
from ._config import MAX_HEADDIM
from ._validate import DTYPES
from .api import flash_attention, flash_attention_backward

GPU_SHAPE = (2, 4096, 16, 128)
CPU_SHAPE = (1, 256, 2, 64)

# --- float64 reference for one (batch, head) slice -------------------------------------

def reference_one_head(q, k, v, dout, scale, causal):
    """Plain float64 attention and its gradients for q (sq, d), k and v (sk, d), dout (sq, d).

    Written independently of the tiled code: the full score matrix, one softmax (the
    visibility rule is the one of ``_spec``).
    Returns out, dq, dk, dv.
    """
    q, k, v, dout = (np.asarray(a, np.float64) for a in (q, k, v, dout))
    sq, sk = q.shape[0], k.shape[0]
    s = q @ k.T * scale
    s[~_spec.visible(np.arange(sq), np.arange(sk), sq, sk, _spec.band(causal))] = -np.inf
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=1, keepdims=True)
    p /= np.where(l > 0, l, 1.0)                # rows without keys stay 0
    out = p @ v
    ds = p * (dout @ v.T - (dout * out).sum(axis=1, keepdims=True))
    return out, ds @ k * scale, ds.T @ q * scale, p.T @ dout


# --- demo -------------------------------------------------------------------------------

class BadOption(Exception):
    """The library rejected what a command-line option asked for (a usage error)."""


def _time_cpu(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def _demo_row(xp, device, dtype, shape, causal, repeats):
    b, s, h, d = shape
    rng = np.random.default_rng(0)
    fwd = lambda: flash_attention(q, k, v, causal=causal, return_lse=True)  # noqa: E731
    try:
        host = [rng.standard_normal((b, s, h, d), np.float32).astype(dtype) for _ in range(4)]
        q, k, v, dout = host if xp is None else [xp.asarray(a) for a in host]
        out, lse = fwd()
    except (TypeError, ValueError, MemoryError) as e:
        # The first call validates; by the library's convention a TypeError is about the dtype
        # and a ValueError about the shape, which names the option to change.
        option, value = (("--dtype", np.dtype(dtype).name) if isinstance(e, TypeError)
                         else ("--shape", ",".join(map(str, shape))))
        raise BadOption(f"argument {option}: {value}: {str(e).splitlines()[0]}") from e
    bwd = lambda: flash_attention_backward(dout, q, k, v, out, lse, causal=causal)  # noqa: E731
    if xp is None:
        fwd_ms, bwd_ms = _time_cpu(fwd, repeats), _time_cpu(bwd, repeats)
        fwd_mem = bwd_mem = None
    else:
        clock = _bench.CupyClock()
        fwd_ms, bwd_ms = (_bench.time_calls(clock, [fn], repeats, warmup=2)["ms"]
                          for fn in (fwd, bwd))
        fwd_mem, bwd_mem = clock.peak_bytes(fwd), clock.peak_bytes(bwd)
    grads = bwd()
    to_host = (lambda a: a) if xp is None else xp.asnumpy    # whole arrays: plain copies
    got = [to_host(a)[0, :, 0] for a in (out, *grads)]
    ref = reference_one_head(*(a[0, :, 0] for a in host), d ** -0.5, causal)
    errs = [float(np.max(np.abs(g.astype(np.float64) - r))) for g, r in zip(got, ref)]
    flops = _bench.attention_flops(b, h, s, s, d, 0.5 if causal else 1.0)
    return [device, np.dtype(dtype).name, f"({b}, {s}, {h}, {d})", str(causal),
            f"{fwd_ms:.3f}", f"{_bench.tflops(flops, fwd_ms):.3g}",
            f"{bwd_ms:.3f}", f"{_bench.tflops(2.5 * flops, bwd_ms):.3g}",
            f"{errs[0]:.2e}", f"{max(errs[1:]):.2e}",
            "-" if fwd_mem is None else f"{fwd_mem / 2**20:.0f} / {bwd_mem / 2**20:.0f}"]


def demo(args):
    cp, why = (None, "--cpu given") if args.cpu else gpu_or_reason()
    if cp is not None:
        dev = cp.cuda.Device()
        name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
        cc = int(dev.compute_capability)
        device = f"cupy {name} (sm_{cc})"
        dtypes = args.dtype or (["bfloat16", "float16"] if cc >= 80 else ["float32"])
        shape = args.shape or GPU_SHAPE
        repeats = args.repeats or 10
    else:
        print(f"{why}: running the NumPy path on the CPU, small shapes\n")
        device = "numpy (CPU)"
        dtypes = args.dtype or ["float64"]
        shape = args.shape or CPU_SHAPE
        repeats = args.repeats or 3
    try:
        rows = [_demo_row(cp, device, _bench.np_dtype(dt), shape, causal, repeats)
                for dt in dtypes for causal in (False, True)]
    except BadOption as e:
        args.usage_error(str(e))
    header = ["implementation", "dtype", "shape (b, s, h, d)", "causal", "fwd ms", "fwd TFLOP/s",
              "bwd ms", "bwd TFLOP/s", "err out", "err dq/dk/dv", "peak MiB fwd / bwd"]
    print(_bench.table_text(header, rows))
    print("\nFLOPs: forward 4*b*h*s*s*d (halved for causal), backward 2.5x forward.")
    print("Times: median of " + ("per-call CUDA-event times of " if cp is not None else "")
          + f"{repeats} calls after warm-up.")
    print("Errors: max |x - ref| over batch 0, head 0, against a float64 reference.")
    if cp is not None:
        print("Peak MiB: device memory taken from CuPy's pool during one call "
              "(outputs and scratch).")
    return 0


# --- warmup -----------------------------------------------------------------------------

def warmup(args):
    cp, why = gpu_or_reason()
    if cp is None:
        print(f"warmup needs a CUDA GPU: {why}", file=sys.stderr)
        return 1
    from . import _compile, _launch
    wanted = {_launch.ELEM[d] for d in (args.dtype or DTYPES)}
    dev = cp.cuda.Device()
    hopper = dev.compute_capability == "90"
    names = [(f, n) for f, ns in _launch.kernel_names(_launch._smem_limit(), hopper).items()
             for n in ns if n.split("<")[1].split(",")[0].rstrip(">").strip() in wanted]
    failed = []
    t0 = time.perf_counter()
    for filename, name in names:
        try:
            arch = _compile.ARCH_SPECIFIC.get(filename)
            if arch:
                _compile.get_arch_kernel(dev.id, _compile.source(filename), name, arch)
            else:
                _compile.get_kernel(_compile.source(filename), name)
        except Exception as e:  # report every kernel that fails, not only the first
            failed.append(f"  {filename} {name}: {type(e).__name__}: {str(e).splitlines()[0]}")
    seconds = time.perf_counter() - t0
    print(f"compiled {len(names) - len(failed)} of {len(names)} kernels for device {dev.id} "
          f"(sm_{dev.compute_capability}) in {seconds:.1f} s")
    if failed:
        print("failed:\n" + "\n".join(failed), file=sys.stderr)
        return 1
    return 0


# --- bench ------------------------------------------------------------------------------

BENCH_DTYPES = ("bfloat16", "float16")
BENCH_HEADDIMS = (64, 128, 256)
BENCH_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_HEADDIMS = (128,)
QUICK_SEQLENS = (1024, 4096, 16384)
NAIVE_SEQLENS = (4096, 8192)     # the targets against naive attention are set here
NAIVE_MAX_SEQLEN = 8192          # beyond, naive's seqlen^2 matrices crowd an 80 GB GPU


def bench(args):
    cp, why = gpu_or_reason()
    if cp is None:
        print(f"bench needs a CUDA GPU: {why}", file=sys.stderr)
        return 1
    if args.plot:
        try:
            _bench.pyplot()                 # fail now, not after the run
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 2
    headdims, seqlens = ((QUICK_HEADDIMS, QUICK_SEQLENS) if args.quick
                         else (BENCH_HEADDIMS, BENCH_SEQLENS))
    headdims, seqlens = args.headdim or headdims, args.seqlen or seqlens
    dtypes = args.dtype or (BENCH_DTYPES[:1] if args.quick else BENCH_DTYPES)
    impls = args.impl or _bench.DEFAULT_DENSE_IMPLS
    log = functools.partial(print, flush=True)
    gpu = _bench.gpu_name()
    log(f"{gpu}: {', '.join(dtypes)}, batch x seqlen = {_bench.TOKENS} tokens, nheads x headdim = "
        f"{_bench.HEAD_WIDTH}; median of {args.reps} calls after {args.warmup} warm-up calls")
    t0 = time.perf_counter()
    rows = []
    for dtype in dtypes:
        for d in headdims:
            for causal in (False, True):
                for s in seqlens:
                    use = [i for i in impls if i != "naive" or s <= NAIVE_MAX_SEQLEN]
                    rows += _bench.compare(_bench.Case.dense(s, d, causal, dtype), use,
                                           ("fwd", "bwd"), args.reps, args.warmup, log=log)
    if "naive" in impls:
        for s in NAIVE_SEQLENS:
            rows += _bench.compare(_bench.Case.dense(s, 128, False), impls, ("fwdbwd",),
                                   args.reps, args.warmup, memory=True, log=log)
    wall = time.perf_counter() - t0
    _bench.add_ratios(rows)
    if args.json:
        doc = _bench.report("dense attention: forward (with lse), backward, forward+backward "
                            "with peak memory, against peers", rows, quick=args.quick,
                            reps=args.reps, warmup=args.warmup, wall_s=round(wall, 1))
        log(f"wrote {_bench.write_json(args.json, doc)}")
    if args.plot:
        try:
            _bench.plot(rows, args.plot, title=f"{gpu}, batch x seqlen = 16K tokens, "
                                               f"nheads x headdim = 2048")
            log(f"wrote {args.plot}")
        except Exception as e:  # the table below is still worth printing
            log(f"plot failed: {_bench.error_text(e)}")
    log(f"\n{len(rows)} rows in {wall:.0f} s\n=== bench table ===")
    log(_bench.format_report(rows))
    log("FLOPs: forward 4*b*h*s*s*d (halved for causal), backward 2.5x, fwd+bwd 3.5x. "
        "x/flash: TFLOP/s over SDPA flash's (FlashAttention 2). Peak MiB: device memory one "
        "fwd+bwd call takes above its inputs.")
    return 1 if any(r["impl"] == "cupyflash" and "error" in r for r in rows) else 0


def _shape(text):
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected four positive integers b,s,h,d, got {text!r}")
    if shape[3] > MAX_HEADDIM:
        raise argparse.ArgumentTypeError(f"head dim d is at most {MAX_HEADDIM}, got {text!r}")
    return shape


def _int_at_least(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value
    return parse


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # The docstring's RST literals would show their backticks in --help.
    parser = argparse.ArgumentParser(prog="python -m cupyflash",
                                     description=__doc__.split("\n")[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", metavar="{demo,warmup,bench}")
    p = sub.add_parser("demo", help="time forward and backward, check against float64 (default)")
    p.add_argument("--cpu", action="store_true", help="use the NumPy path even with a GPU")
    p.add_argument("--shape", type=_shape, help="b,s,h,d (default GPU %s, CPU %s)"
                   % (",".join(map(str, GPU_SHAPE)), ",".join(map(str, CPU_SHAPE))))
    p.add_argument("--dtype", action="append", choices=DTYPES,
                   help="repeat for several (default bf16 and fp16 on sm_80+, else float32; "
                        "float64 on the CPU)")
    p.add_argument("--repeats", type=_int_at_least(1),
                   help="timed calls (default 10 on GPU, 3 on CPU)")
    p.set_defaults(func=demo, usage_error=p.error)
    p = sub.add_parser("warmup", help="compile every kernel for the current GPU")
    p.add_argument("--dtype", action="append", choices=DTYPES,
                   help="only kernels of this dtype (repeat for several; default all)")
    p.set_defaults(func=warmup)
    p = sub.add_parser("bench", help="TFLOP/s and memory against naive attention and PyTorch "
                                     "SDPA, as a table (and a figure)")
    p.add_argument("--quick", action="store_true",
                   help="%s, d=%s, seqlen %s (default %s, d=%s, seqlen %s)" % (
                       BENCH_DTYPES[0], QUICK_HEADDIMS[0], ",".join(map(str, QUICK_SEQLENS)),
                       " and ".join(BENCH_DTYPES), ",".join(map(str, BENCH_HEADDIMS)),
                       ",".join(map(str, BENCH_SEQLENS))))
    p.add_argument("--dtype", action="append", choices=BENCH_DTYPES,
                   help="only this dtype (repeatable)")
    p.add_argument("--plot", metavar="FILE.png", help="draw TFLOP/s against seqlen (matplotlib)")
    p.add_argument("--json", metavar="FILE", help="write every row, with GPU, date, commit and "
                                                  "versions (commit real runs to "
                                                  "benchmarks/results/)")
    p.add_argument("--impl", action="append", choices=_bench.DENSE_IMPLS,
                   help="only these implementations (repeatable; default all that import "
                        "but flex, which compiles per shape)")
    p.add_argument("--headdim", action="append", type=int, choices=BENCH_HEADDIMS,
                   help="only this head dim (repeatable)")
    p.add_argument("--seqlen", action="append", type=int, choices=BENCH_SEQLENS,
                   help="only this seqlen (repeatable)")
    p.add_argument("--reps", type=_int_at_least(1), default=20,
                   help="timed calls per number (default 20)")
    p.add_argument("--warmup", type=_int_at_least(0), default=3,
                   help="calls before timing (default 3)")
    p.set_defaults(func=bench)
    args = parser.parse_args(argv or ["demo"])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
