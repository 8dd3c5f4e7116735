"""KV-cache decoding: the bandwidth our decode kernels draw from the cache, against the copy
bandwidth of the same GPU and against PyTorch.

    python benchmarks/bench_decode.py --out DIR [--quick]

bf16, head dim 128, 32 query heads over 8 KV heads, one query token per sequence, every
sequence's cache full: batch 1, 8 and 64 x contexts 1K, 4K, 8K, 32K and 128K (--quick: 8K and
32K), caches contiguous and paged (pages of 16 and 256 rows over the same memory, the block
table a random permutation of the pages). Effective bandwidth = the K and V bytes of the
contexts / time; the copy bandwidth is a device-to-device copy of 4 GiB in the same run (2 x
bytes / time: it reads and writes them).

A cell whose K and V bytes are under twice the GPU's L2 (batch 1 up to 8K here) rotates among
copies of its cache (``cache_copies`` in the JSON: enough that the others' bytes fill the L2
twice), so that no call finds its cache in L2; every implementation's calls take the copies in
turn. Our calls run as CUDA graph replays, as serving engines run decode steps: inside a capture the
lengths are trusted (an eager call reads them to the host to check them first; its time is in
the JSON too, ``eager_ms``, and that of eager calls with ``check_lengths=False``,
``eager_unchecked_ms``: CUDA-event times, the host's own time per call not included). Peers,
timed eagerly (one launch each): PyTorch SDPA at seqlen_q = 1 with enable_gqa on the contiguous
cache (each backend that accepts it), and for paged caches a gather of the pages by the block
table followed by SDPA (cuDNN, else the first backend that runs), where the gathered copy fits.
Writes DIR/bench_decode.json and prints the table last.
"""
import argparse
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cupyflash import bench  # noqa: E402
from cupyflash._gpu import gpu_or_reason  # noqa: E402

NHEADS, NHEADS_K, HEADDIM = 32, 8, 128
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 4096, 8192, 32768, 131072)
QUICK_CONTEXTS = (8192, 32768)
PAGES = (16, 256)
GATHER_LIMIT = 16 << 30          # bytes of K and V the gather baseline may copy
MAX_COPIES = 32                  # caches one cell rotates among at most


def kv_bytes(batch, context):
    """The K and V bytes of ``batch`` full caches of ``context`` keys (bf16)."""
    return 2 * batch * context * NHEADS_K * HEADDIM * 2


def cache_copies(nbytes, l2_bytes):
    """How many copies of a cache of ``nbytes`` (K and V) the timed calls rotate among: one
    where it is at least twice the L2, else enough that the other copies fill the L2 twice
    over before a copy is read again (at most MAX_COPIES)."""
    if nbytes >= 2 * l2_bytes:
        return 1
    return min(MAX_COPIES, 1 + -(-2 * l2_bytes // nbytes))


def copy_bandwidth(cp, clock, reps):
    src = cp.ones(1 << 30, cp.float32)   # 4 GiB
    dst = cp.empty_like(src)
    result = bench.time_calls(clock, [lambda: cp.copyto(dst, src)], reps)
    return 2 * src.nbytes / (result["ms"] * 1e-3) / 1e9


def random_cache(cp, batch, context):
    import ml_dtypes
    dtype = np.dtype(ml_dtypes.bfloat16)
    k = cp.empty((batch, context, NHEADS_K, HEADDIM), dtype)
    v = cp.empty_like(k)
    for b in range(batch):   # one entry at a time: the float32 draw is twice the entry
        k[b] = cp.random.standard_normal(k.shape[1:], dtype=cp.float32).astype(dtype)
        v[b] = cp.random.standard_normal(k.shape[1:], dtype=cp.float32).astype(dtype)
    return k, v


def as_layout(cp, k_cache, v_cache, layout):
    """The caches as ``layout`` ("contiguous", "page16", "page256"): the same memory cut into
    pages, the block table a random permutation of them (seed 0). Returns k, v, table."""
    if layout == "contiguous":
        return k_cache, v_cache, None
    batch, page = k_cache.shape[0], int(layout[4:])
    kc, vc = (x.reshape(-1, page, NHEADS_K, HEADDIM) for x in (k_cache, v_cache))
    perm = np.random.default_rng(0).permutation(kc.shape[0]).astype(np.int32)
    return kc, vc, cp.asarray(perm.reshape(batch, -1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, action="append", choices=BATCHES,
                    help="only this batch (repeatable)")
    args = ap.parse_args()
    _, why = gpu_or_reason()
    if why:
        sys.exit(f"bench_decode needs a GPU: {why}")
    import cupy as cp
    import cupyflash as cf
    clock = bench.CupyClock()
    copy_gbps = copy_bandwidth(cp, clock, args.reps)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from cupyflash.bench.timing import TorchClock
        tclock = TorchClock(torch)
    except Exception as e:  # no torch: the peer rows say why
        torch, torch_error = None, bench.error_text(e)
    rows = []
    l2_bytes = cp.cuda.Device().attributes["L2CacheSize"]

    def add(impl, layout, batch, context, result, **extra):
        kv = kv_bytes(batch, context)
        row = dict(impl=impl, layout=layout, batch=batch, context=context, kv_bytes=kv, **result, **extra)
        if "ms" in result:
            row["gbps"] = kv / (result["ms"] * 1e-3) / 1e9
            row["of_copy"] = row["gbps"] / copy_gbps
            print(f"{impl:22s} {layout:10s} b={batch:2d} ctx={context:6d}: {result['ms'] * 1e3:8.1f} us "
                  f"{row['gbps']:6.0f} GB/s ({row['of_copy']:.2f} of copy)", flush=True)
        rows.append(row)

    for batch in args.batch or BATCHES:
        for context in (QUICK_CONTEXTS if args.quick else CONTEXTS):
            copies = cache_copies(kv_bytes(batch, context), l2_bytes)
            caches = [random_cache(cp, batch, context) for _ in range(copies)]
            q = cp.random.standard_normal((batch, 1, NHEADS, HEADDIM), dtype=cp.float32).astype(caches[0][0].dtype)
            lens = cp.full(batch, context, cp.int32)
            for layout in ("contiguous",) + tuple(f"page{p}" for p in PAGES):
                sets = [as_layout(cp, k_cache, v_cache, layout) for k_cache, v_cache in caches]

                def ours(kc, vc, table, check=True):
                    return cf.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                           check_lengths=check)
                calls = [functools.partial(ours, *s) for s in sets]
                eager = bench.time_calls(clock, calls, args.reps)
                unchecked = bench.time_calls(clock, [functools.partial(c, check=False) for c in calls], args.reps)
                stream, graphs, _results = bench.timing.graphs_of(calls)
                with stream:
                    replay = bench.time_calls(clock, [functools.partial(g.launch, stream) for g in graphs],
                                              args.reps)
                add("cupyflash", layout, batch, context, replay, eager_ms=eager["ms"],
                    eager_unchecked_ms=unchecked["ms"], cache_copies=copies)
                del graphs, _results
                if torch is None:
                    add("sdpa", layout, batch, context, {"error": torch_error})
                    continue
                qt = torch.from_dlpack(q).transpose(1, 2)
                if layout == "contiguous":
                    kvs = [tuple(torch.from_dlpack(x).transpose(1, 2) for x in (kc, vc)) for kc, vc, _ in sets]
                    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
                        def sdpa(kt, vt, name=name):
                            with sdpa_kernel(getattr(SDPBackend, name)):
                                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                        try:
                            add(f"sdpa_{name.lower()}", layout, batch, context,
                                bench.time_calls(tclock, [functools.partial(sdpa, *kv) for kv in kvs], args.reps),
                                cache_copies=copies)
                        except Exception as e:  # a backend that refuses the call: its row says why
                            add(f"sdpa_{name.lower()}", layout, batch, context, {"error": bench.error_text(e)})
                elif kv_bytes(batch, context) <= GATHER_LIMIT:
                    paged = [(torch.from_dlpack(kc), torch.from_dlpack(vc), torch.from_dlpack(table).long())
                             for kc, vc, table in sets]

                    def gather_sdpa(kp, vp, tt):
                        kg, vg = (x[tt].reshape(batch, context, NHEADS_K, HEADDIM).transpose(1, 2) for x in (kp, vp))
                        for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
                            try:
                                with sdpa_kernel(getattr(SDPBackend, name)):
                                    return torch.nn.functional.scaled_dot_product_attention(qt, kg, vg, enable_gqa=True)
                            except RuntimeError:
                                continue
                        raise RuntimeError("no SDPA backend took the gathered cache")
                    try:
                        add("gather_sdpa", layout, batch, context,
                            bench.time_calls(tclock, [functools.partial(gather_sdpa, *x) for x in paged], args.reps),
                            cache_copies=copies)
                    except Exception as e:  # its row says why
                        add("gather_sdpa", layout, batch, context, {"error": bench.error_text(e)})
                else:
                    add("gather_sdpa", layout, batch, context, {"skipped": "the gathered copy would not fit"})
            del caches, sets
            bench.release_memory()
    doc = bench.report("decode", rows, nheads=NHEADS, nheads_k=NHEADS_K, headdim=HEADDIM, dtype="bfloat16",
                       copy_gbps=copy_gbps, l2_bytes=l2_bytes,
                       timing="cupyflash: CUDA graph replays; peers: eager calls")
    bench.write_json(Path(args.out) / "bench_decode.json", doc)
    print(summary(rows, copy_gbps))


def summary(rows, copy_gbps):
    """Per (batch, context): our GB/s and fraction of the copy bandwidth per layout, the best
    SDPA backend's GB/s (contiguous) and the gather baseline's (page 16)."""
    def get(impl, layout, b, c):
        r = [x for x in rows if x["impl"] == impl and x["layout"] == layout and x["batch"] == b
             and x["context"] == c and "gbps" in x]
        return r[0] if r else None
    lines = [f"copy bandwidth {copy_gbps:.0f} GB/s",
             "| batch | context | contiguous | page 16 | page 256 | best SDPA (contiguous) | gather + SDPA (page 16) |",
             "|---|---|---|---|---|---|---|"]
    for b, c in sorted({(r["batch"], r["context"]) for r in rows}):
        cells = [str(b), f"{c // 1024}K"]
        for layout in ("contiguous", "page16", "page256"):
            r = get("cupyflash", layout, b, c)
            cells.append(f"{r['gbps']:.0f} ({r['of_copy']:.2f})" if r else "-")
        sdpa = [r for r in rows if r["impl"].startswith("sdpa") and r["batch"] == b and r["context"] == c
                and "gbps" in r]
        best = max(sdpa, key=lambda r: r["gbps"]) if sdpa else None
        cells.append(f"{best['gbps']:.0f} ({best['impl'][5:]})" if best else "-")
        g = get("gather_sdpa", "page16", b, c)
        cells.append(f"{g['gbps']:.0f}" if g else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
