"""The host's time of one eager call, per kind of call: how long the Python side takes from
entry to return while the GPU is idle (every launch is asynchronous, so this is the time the
caller's thread spends, and, for a call on an idle GPU, time the GPU waits).

    python benchmarks/probe_host.py --out DIR [--calls 200] [--profile 100]

bf16, d=128, shapes small enough that the GPU never holds the host back: a dense forward
and backward (causal, 2 x 1024 x 16 heads), a packed forward (8 sequences of 64-1024 tokens)
checked without maximums, checked with them and unchecked, and a decode step (batch 1, 32
query heads over 8 KV heads, 8K keys, contiguous and paged by 256, the paged one also with
check_lengths=False). Each call runs after a
synchronize, with launch plans (cupyflash/_launch.py) and without (CUPYFLASH_LAUNCH_PLANS=0),
in turns of 20 calls; the median and quartiles over ``--calls`` calls of each go to
DIR/probe_host.json, and the functions that take the most of ``--profile`` planned calls'
time (cProfile, own time) to DIR/probe_host_profile.txt. ``--breakdown`` also times the
stages of each planned call (the functions of BREAKDOWN, each call's time inside them,
inclusive) into DIR/probe_host.json's ``breakdown``.
"""
import os
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cupyflash import bench  # noqa: E402
from cupyflash._gpu import gpu_or_reason  # noqa: E402


def cases(cp, cf):
    """{name: a call of no arguments}."""
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16

    def randn(*shape):
        return cp.random.standard_normal(shape, dtype=cp.float32).astype(bf16)

    q, k, v, dout = (randn(2, 1024, 16, 128) for _ in range(4))
    out, lse = cf.flash_attention(q, k, v, causal=True, return_lse=True)
    lens = np.random.default_rng(0).integers(64, 1025, 8)
    cu = cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    total, longest = int(lens.sum()), int(lens.max())
    pq, pk, pv = (randn(total, 16, 128) for _ in range(3))
    qd = randn(1, 1, 32, 128)
    kc, vc = randn(1, 8192, 8, 128), randn(1, 8192, 8, 128)
    kp, vp = randn(32, 256, 8, 128), randn(32, 256, 8, 128)
    table = cp.asarray(np.random.default_rng(1).permutation(32).astype(np.int32)[None])
    seqlens = cp.asarray(np.array([8192], np.int32))
    return {
        "dense_fwd": lambda: cf.flash_attention(q, k, v, causal=True, return_lse=True),
        "dense_bwd": lambda: cf.flash_attention_backward(dout, q, k, v, out, lse, causal=True),
        "varlen_fwd": lambda: cf.flash_attention_varlen(pq, pk, pv, cu, cu, causal=True),
        "varlen_fwd_max": lambda: cf.flash_attention_varlen(pq, pk, pv, cu, cu, longest, longest,
                                                            causal=True),
        "varlen_fwd_unchecked": lambda: cf.flash_attention_varlen(
            pq, pk, pv, cu, cu, longest, longest, causal=True, check_offsets=False),
        "decode_contiguous": lambda: cf.flash_attention_with_kvcache(qd, kc, vc, cache_seqlens=seqlens),
        "decode_page256": lambda: cf.flash_attention_with_kvcache(qd, kp, vp, cache_seqlens=seqlens,
                                                                  block_table=table),
        "decode_page256_unchecked": lambda: cf.flash_attention_with_kvcache(
            qd, kp, vp, cache_seqlens=seqlens, block_table=table, check_lengths=False),
    }


# The stages timed by --breakdown: (module, function) of cupyflash.
BREAKDOWN = [("api", "_as_backend"), ("_validate", "check_forward"), ("api", "_call_spec"),
             ("api", "_forward_gpu"), ("api", "_backward_gpu"), ("_launch", "check_supported"),
             ("_launch", "_planned"), ("_launch", "_run"), ("_launch", "dq_buffer"),
             ("_arrays", "to_caller"), ("_arrays", "HostCopy.__init__"), ("_arrays", "HostCopy.wait"),
             ("varlen", "_PackedCall.of"), ("varlen", "_PackedCall.signature"), ("varlen", "_PackedCall.again"),
             ("varlen", "_PackedCall._longest"), ("_validate", "check_cu_seqlens"),
             ("kvcache", "_gpu"), ("_validate", "check_kvcache"), ("kvcache", "_Cache.host_lengths"),
             ("kvcache", "_Cache.layout"), ("_launch", "decode"), ("_launch", "kvcache_append")]


def timed_stages(spent):
    """Wrap the BREAKDOWN functions (in every cupyflash module that holds them) so that each
    adds its inclusive time to ``spent[name]``; returns a function that undoes it."""
    import importlib
    undo = []
    modules = [importlib.import_module(f"cupyflash.{m}") for m in
               ("api", "_validate", "_launch", "_arrays", "varlen", "kvcache")]
    for module_name, name in BREAKDOWN:
        owner = importlib.import_module(f"cupyflash.{module_name}")
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, attr)

        def wrapper(*a, __f=original, __n=f"{module_name}.{name}", **kw):
            start = time.perf_counter()
            try:
                return __f(*a, **kw)
            finally:
                spent[__n] = spent.get(__n, 0.0) + time.perf_counter() - start
        holders = [owner] + ([m for m in modules if getattr(m, attr, None) is original] if not path else [])
        for holder in holders:
            setattr(holder, attr, wrapper)
            undo.append((holder, attr, original))
    return lambda: [setattr(h, a, o) for h, a, o in reversed(undo)]


def host_times(cp, call, calls):
    """Seconds from entry to return of ``calls`` calls, each after a synchronize."""
    times = []
    for _ in range(calls):
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    cp.cuda.Device().synchronize()
    return np.array(times)


def profile(cp, call, calls):
    """The top of cProfile's table (own time) over ``calls`` calls."""
    prof = cProfile.Profile()
    for _ in range(calls):
        cp.cuda.Device().synchronize()
        prof.enable()
        call()
        prof.disable()
    cp.cuda.Device().synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", type=int, default=100)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    cp, why = gpu_or_reason()
    if why:
        sys.exit(f"probe_host needs a GPU: {why}")
    import cupyflash as cf
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, profiles = [], []
    for name, call in cases(cp, cf).items():
        if args.only and name not in args.only.split(","):
            continue
        times = {"0": [], "1": []}
        for turn in range(-1, max(1, args.calls // 20)):
            for plans in times:
                os.environ["CUPYFLASH_LAUNCH_PLANS"] = plans
                t = host_times(cp, call, 5 if turn < 0 else 20)   # turn -1: compiles, fills caches
                if turn >= 0:
                    times[plans].append(t)
        for plans, label in (("0", "fresh"), ("1", "planned")):
            t = np.concatenate(times[plans]) * 1e6
            rows.append({"case": name, "launch": label, "median_us": float(np.median(t)), "calls": t.size,
                         "q1_us": float(np.percentile(t, 25)), "q3_us": float(np.percentile(t, 75))})
            print(f"{name:22s} {label:8s} {rows[-1]['median_us']:8.1f} us  ({rows[-1]['q1_us']:.1f} - "
                  f"{rows[-1]['q3_us']:.1f})", flush=True)
        if args.breakdown:
            spent = {}
            undo = timed_stages(spent)
            whole = host_times(cp, call, 100).sum()
            undo()
            rows.append({"case": name, "launch": "planned", "breakdown_us": {
                k: round(v / 100 * 1e6, 1) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
                "total_us": round(whole / 100 * 1e6, 1)})
            print(f"  {name} stages (us per call, inclusive):", rows[-1]["total_us"], rows[-1]["breakdown_us"],
                  flush=True)
        if args.profile:
            profiles.append(f"=== {name}\n" + profile(cp, call, args.profile))
    doc = bench.report("probe_host", rows)
    doc["config"] = {"statistic": "host time per call, entry to return (perf_counter), the GPU idle "
                                  "before each call; median and quartiles",
                     "turns": "20 calls with launch plans, 20 without, in turn", "dtype": "bfloat16",
                     "headdim": 128}
    bench.write_json(out / "probe_host.json", doc)
    (out / "probe_host_profile.txt").write_text("\n".join(profiles))


if __name__ == "__main__":
    main()
