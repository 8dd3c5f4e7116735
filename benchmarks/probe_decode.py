"""Where the time of a batch-1 decode call goes: the split count swept, the split pass timed
without the merge, and the floor of a timed graph launch.

    python benchmarks/probe_decode.py --out DIR [--cases 8:8192,...] [--splits 0,1,2,...]
                                                [--layouts contiguous,page16,page256]

The cases of bench_decode.py (bf16, d=128, 32 query heads over 8 KV heads, one query token,
full caches, contiguous unless --layouts names others), timed the same way (CUDA graph
replays, one per CUDA-event pair):
- ``floor``: a graph of one empty kernel, and of two (the fixed cost any call pays, and what
  a second kernel adds);
- ``splits``: num_splits from the list below (0: the heuristic's pick), the whole call;
- ``split_pass``: the same graph without the merge kernel (its outputs are then wrong: timing
  only), so that whole - split_pass is the merge kernel's share;
- ``read_floor``: a graph of one kernel that only reads the case's K and V bytes (16-byte
  loads, a grid-stride loop over contiguous memory, every SM full), rotating among copies as
  bench_decode.py does where they would stay in the L2: what any one-kernel decode of that
  cache could reach at best, beside the copy bandwidth that the targets divide by.
Writes DIR/probe_decode.json and prints a table.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import (HEADDIM, NHEADS, NHEADS_K, as_layout, cache_copies, copy_bandwidth,  # noqa: E402
                          random_cache)
from cupyflash import bench  # noqa: E402

CASES = ((1, 8192), (1, 32768), (1, 131072), (8, 8192))
SPLITS = (0, 8, 16, 24, 32, 33, 48, 64, 66, 99, 132, 198, 264)
EMPTY = 'extern "C" __global__ void empty_kernel() {}'
# Reads n 16-byte chunks; the xor keeps the loads (its store almost never happens).
READ = r"""
extern "C" __global__ void read_kernel(const uint4* __restrict__ src, long long n, unsigned* out) {
    unsigned acc = 0;
#pragma unroll 4
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = __ldg(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def read_floor_ms(cp, clock, nbytes, reps):
    """Graph replays of read_kernel over ``nbytes``, rotating among copies (cache_copies)."""
    l2_bytes = cp.cuda.Device().attributes["L2CacheSize"]
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    kernel = cp.RawKernel(READ, "read_kernel")
    bufs = [cp.ones(nbytes // 4, cp.uint32) for _ in range(cache_copies(nbytes, l2_bytes))]
    out = cp.zeros(1, cp.uint32)
    calls = [lambda b=b: kernel((8 * sms,), (256,), (b, np.int64(nbytes // 16), out)) for b in bufs]
    stream, graphs, _ = bench.timing.graphs_of(calls)
    with stream:
        ms = bench.time_calls(clock, [lambda g=g: g.launch(stream) for g in graphs], reps)["ms"]
    del bufs
    bench.release_memory()
    return ms


def replay_ms(clock, call, reps):
    stream, graph, _result = bench.timing.graph_of(call)
    with stream:
        return bench.time_calls(clock, [lambda: graph.launch(stream)], reps)["ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--cases", help="batch:context pairs, comma-separated (default: %s)"
                    % ",".join(f"{b}:{c}" for b, c in CASES))
    ap.add_argument("--splits", help="num_splits values, comma-separated (default: %s)"
                    % ",".join(map(str, SPLITS)))
    ap.add_argument("--layouts", default="contiguous", help="contiguous, page16, page256, ...")
    args = ap.parse_args()
    cases = ([tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")] if args.cases
             else CASES)
    splits = [int(n) for n in args.splits.split(",")] if args.splits else SPLITS
    import cupy as cp
    import cupyflash as cf
    from cupyflash import _launch
    clock = bench.CupyClock()
    copy_gbps = copy_bandwidth(cp, clock, 20)
    empty = cp.RawKernel(EMPTY, "empty_kernel")
    rows = [dict(kind="floor", kernels=n, ms=replay_ms(clock, lambda n=n: [empty((1,), (32,), ()) for _ in range(n)],
                                                        args.reps)) for n in (1, 2)]
    launch = _launch._launch

    def without_merge(filename, name, *rest, **kw):
        if not name.startswith("flash_decode_merge_kernel"):
            launch(filename, name, *rest, **kw)

    for batch, context in cases:
        k_cache, v_cache = random_cache(cp, batch, context)
        q = cp.random.standard_normal((batch, 1, NHEADS, HEADDIM), dtype=cp.float32).astype(k_cache.dtype)
        lens = cp.full(batch, context, cp.int32)
        kv = 2 * k_cache.nbytes
        floor = read_floor_ms(cp, clock, kv, args.reps)
        rows.append(dict(kind="read_floor", batch=batch, context=context, bytes=kv, ms=floor,
                         of_copy=kv / (floor * 1e-3) / 1e9 / copy_gbps))
        for layout in args.layouts.split(","):
            kc, vc, table = as_layout(cp, k_cache, v_cache, layout)
            for n in splits:
                def call(n=n, kc=kc, vc=vc, table=table):
                    return cf.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                           num_splits=n)
                whole = replay_ms(clock, call, args.reps)
                _launch._launch = without_merge
                try:
                    split_pass = replay_ms(clock, call, args.reps)
                finally:
                    _launch._launch = launch
                rows.append(dict(kind="splits", batch=batch, context=context, layout=layout, num_splits=n,
                                 ms=whole, split_pass_ms=split_pass,
                                 of_copy=kv / (whole * 1e-3) / 1e9 / copy_gbps))
            del kc, vc, table
        del k_cache, v_cache
        bench.release_memory()
    doc = bench.report("probe_decode", rows, nheads=NHEADS, nheads_k=NHEADS_K, headdim=HEADDIM,
                       dtype="bfloat16", copy_gbps=copy_gbps, timing="CUDA graph replays")
    bench.write_json(Path(args.out) / "probe_decode.json", doc)
    lines = [f"copy {copy_gbps:.0f} GB/s; floor: one kernel {rows[0]['ms'] * 1e3:.1f} us, "
             f"two {rows[1]['ms'] * 1e3:.1f} us",
             "| batch | context | layout | splits | us | split pass us | of copy |", "|---|---|---|---|---|---|---|"]
    for r in rows[2:]:
        if r["kind"] == "read_floor":
            lines.append(f"| {r['batch']} | {r['context'] // 1024}K | read only | - | {r['ms'] * 1e3:.1f} | - | "
                         f"{r['of_copy']:.2f} |")
            continue
        lines.append(f"| {r['batch']} | {r['context'] // 1024}K | {r['layout']} | {r['num_splits']} | {r['ms'] * 1e3:.1f} | "
                     f"{r['split_pass_ms'] * 1e3:.1f} | {r['of_copy']:.2f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
