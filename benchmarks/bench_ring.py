"""Ring attention across the GPUs of one machine: time against fewer GPUs, the share of the
communication hidden behind compute, peak memory, sampled rows against float32, and the
longest sequence that runs.

    python benchmarks/bench_ring.py --out DIR [--seqlens 1048576 ...] [--worlds 2 4]
    python benchmarks/bench_ring.py --out DIR --memory-gib 12 [--worlds 1 2]

bf16, causal, batch 1, 16 heads, head dim 128, the zigzag layout, the default head groups;
one process per GPU over CuPy's NCCL. The inputs are made in blocks of seqlen / 16 rows, each
from its own seed, so a rank makes only its shard and every world sees the same sequence.

Scaling (the default): for each seqlen, one call each way on GPU 0 (``one_gpu``; skipped where
it does not fit), then for each world W, timed with CUDA events on each rank after a barrier,
the slowest rank's time counted:
- ``ring``: ring_attention / ring_attention_backward over W GPUs;
- ``compute``: the same calls with an adapter that moves nothing (the attention alone);
- ``comm``: the same bytes exchanged with no attention (the transfers alone).
``compute`` and ``comm`` only up to ``--overlap-max`` tokens. Hidden share = (compute + comm -
ring) / comm. Efficiency = time at the smallest GPU count that ran the size x that count /
(time x W). Peak memory: the CuPy pool's bytes after the ring's backward (it keeps what it
took), and the device's bytes in use (NCCL's and the context's too). Sampled rows: 16 query
rows per rank, out and lse against a float32 reference over all keys, each rank adding the
terms of its own keys (no rank gathers the sequence).

Longest sequence (``--memory-gib X``): with the CuPy pool of each GPU limited to X GiB, the
longest sequence (a multiple of 4096 tokens) whose forward and backward run, for one call on
one GPU (world 1) and for the ring over W GPUs, found by bisection from a first guess; memory
per token is the same at any X, so the ratio carries to the whole card. Each probe records the
pool's and the device's bytes against the unavoidable ones (q, k, v, dout, out, dq, dk, dv,
lse), and every ring probe that ran checks its sampled rows (after lifting the limit).

Writes DIR/bench_ring.json (scaling) or DIR/bench_ring_memory.json after every step and prints
a table last.
"""
import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADS, HEADDIM, SAMPLED, BLOCKS, GRANULE, WARM_ROWS = 16, 128, 16, 16, 4096, 16384


def _flops(seqlen):
    fwd = 4 * seqlen ** 2 * HEADS * HEADDIM / 2
    return {"fwd": fwd, "bwd": 2.5 * fwd}


def _blocks_of(world, rank):
    """The input blocks rank ``rank`` of ``world`` holds, in its shard's order (world 0: all)."""
    if world == 0:
        return list(range(BLOCKS))
    from cupyflash.distributed import chunks_of
    per = BLOCKS // (2 * world)
    return [c * per + i for c in chunks_of(rank, world) for i in range(per)]


def _inputs(cp, seqlen, seed, blocks):
    """q, k, v, dout (bf16) made of the given blocks of the sequence, in that order."""
    import ml_dtypes
    dtype = np.dtype(ml_dtypes.bfloat16)
    n = seqlen // BLOCKS
    arrays = []
    for t in range(4):
        x = cp.empty((1, n * len(blocks), HEADS, HEADDIM), dtype)
        for j, b in enumerate(blocks):
            rs = cp.random.RandomState(seed * 1000 + t * BLOCKS + b)
            x[:, j * n:(j + 1) * n] = rs.standard_normal((1, n, HEADS, HEADDIM), dtype=cp.float32).astype(dtype)
        arrays.append(x)
    cp.get_default_memory_pool().free_all_blocks()
    return arrays


def _time(cp, fn, reps, warmup):
    start, end = cp.cuda.Event(), cp.cuda.Event()
    if warmup:
        fn()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return min(times)


def _unavoidable(tokens):
    """Bytes a forward and backward cannot do without over ``tokens`` rows: q, k, v, dout, out,
    dq, dk, dv (bf16) and lse (float32)."""
    return tokens * HEADS * (8 * HEADDIM * 2 + 4)


def _used_bytes(cp):
    free, total = cp.cuda.runtime.memGetInfo()
    return total - free


class _Silent:
    """A ring adapter that moves nothing: the attention of every step, on stale buffers."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def start(self, sends, recvs):
        from cupyflash.distributed import _Done
        return _Done()


def _communicator(cp, rank, world, nccl_id):
    from cupy.cuda import nccl
    cp.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(world, nccl_id, rank)
    one = cp.ones(1, cp.float32)

    def barrier():
        comm.allReduce(one.data.ptr, one.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cp.cuda.get_current_stream().ptr)
        cp.cuda.get_current_stream().synchronize()
    return comm, barrier


def _all_gather(cp, comm, x):
    """(world,) + x.shape: every rank's x."""
    from cupy.cuda import nccl
    x = cp.ascontiguousarray(x)
    dst = cp.empty((comm.size(),) + x.shape, x.dtype)
    comm.allGather(x.data.ptr, dst.data.ptr, x.nbytes, nccl.NCCL_UINT8, cp.cuda.get_current_stream().ptr)
    return dst


def _sampled_check(cp, comm, rank, world, seqlen, q, k, v, out, lse):
    """Out and lse of SAMPLED random local rows against float32 over every key: each rank adds
    up, per sampled row of every rank, the max, sum and weighted values over its own keys;
    the partial sums are gathered and merged."""
    from cupyflash.distributed import chunks_of
    c = q.shape[1] // 2
    chunks = chunks_of(rank, world)
    local = np.sort(np.random.default_rng(rank).choice(q.shape[1], SAMPLED, replace=False))
    positions = np.array([chunks[i // c] * c + i % c for i in local])
    keys_at = cp.asarray(np.concatenate([np.arange(x * c, (x + 1) * c) for x in chunks]))
    rows = _all_gather(cp, comm, q[0, cp.asarray(local)])                  # (W, R, h, d)
    rows = rows.reshape(world * SAMPLED, HEADS, HEADDIM).astype(cp.float32)
    at = _all_gather(cp, comm, cp.asarray(positions)).reshape(-1)          # (W * R,)
    m = cp.full((world * SAMPLED, HEADS), -cp.inf, cp.float32)
    l = cp.zeros_like(m)
    o = cp.zeros((world * SAMPLED, HEADS, HEADDIM), cp.float32)
    for h in range(HEADS):
        s = rows[:, h] @ k[0, :, h].astype(cp.float32).T * HEADDIM ** -0.5   # (W * R, L)
        s = cp.where(keys_at[None, :] <= at[:, None], s, -cp.inf)
        m[:, h] = s.max(axis=1)
        p = cp.exp(s - cp.where(cp.isinf(m[:, h]), 0, m[:, h])[:, None])
        l[:, h] = p.sum(axis=1)
        o[:, h] = p @ v[0, :, h].astype(cp.float32)
    ms, ls, os_ = (_all_gather(cp, comm, x) for x in (m, l, o))            # (W, W * R, ...)
    mine = slice(rank * SAMPLED, (rank + 1) * SAMPLED)
    ms, ls, os_ = ms[:, mine], ls[:, mine], os_[:, mine]
    top = ms.max(axis=0)
    w = cp.exp(ms - top)
    total = (w * ls).sum(axis=0)
    ref = (w[..., None] * os_).sum(axis=0) / total[..., None]               # (R, h, d)
    ref_lse = top + cp.log(total)
    got = out[0, cp.asarray(local)].astype(cp.float32)
    got_lse = lse[0][:, cp.asarray(local)].T
    return dict(sampled_max_abs_err=float(abs(got - ref).max()), sampled_ref_max_abs=float(abs(ref).max()),
                sampled_lse_max_abs_err=float(abs(got_lse - ref_lse).max()))


def _forward_backward(cfd, ring, q, k, v, dout, head_groups):
    """One causal ring_attention and its backward: out, lse and the gradients."""
    out, lse = cfd.ring_attention(q, k, v, ring, causal=True, return_lse=True, head_groups=head_groups)
    return out, lse, cfd.ring_attention_backward(dout, q, k, v, out, lse, ring, causal=True,
                                                 head_groups=head_groups)


def _rank(rank, world, nccl_id, job, results):
    """One rank of a timed ring (job["mode"] == "time") or of a memory probe ("memory")."""
    import cupy as cp
    from cupyflash import distributed as cfd
    try:
        comm, barrier = _communicator(cp, rank, world, nccl_id)
        if job.get("limit"):
            cp.get_default_memory_pool().set_limit(size=job["limit"])
        seqlen = job["seqlen"]
        q, k, v, dout = _inputs(cp, seqlen, job["seed"], _blocks_of(world, rank))
        ring = cfd.as_ring(comm)
        if job["mode"] == "memory":
            barrier()
            out, lse, grads = _forward_backward(cfd, ring, q, k, v, dout, job["head_groups"])
            cp.cuda.get_current_stream().synchronize()
            row = dict(ok=True, pool_bytes=cp.get_default_memory_pool().total_bytes(), used_bytes=_used_bytes(cp),
                       unavoidable_bytes=_unavoidable(q.shape[1]))
            del grads
            cp.get_default_memory_pool().set_limit(size=0)     # the check's own arrays are not the ring's
            row.update(_sampled_check(cp, comm, rank, world, seqlen, q, k, v, out, lse))
            results.put((rank, row))
            return
        # A short ring first, untimed: its calls of 8K-row chunks take the kernels of the long
        # ones (80-query steps from 8K rows), so that no timed call compiles, warm-up or not.
        _forward_backward(cfd, ring, *(x[:, :WARM_ROWS] for x in (q, k, v, dout)), job["head_groups"])
        row = {}
        adapters = [("ring", ring)] + ([("compute", _Silent(rank, world))] if job["overlap"] else [])
        for name, group in adapters:
            kept = {}

            def fwd(group=group, kept=kept):
                barrier()
                kept["out"], kept["lse"] = cfd.ring_attention(q, k, v, group, causal=True, return_lse=True,
                                                              head_groups=job["head_groups"])

            def bwd(group=group, kept=kept):
                barrier()
                cfd.ring_attention_backward(dout, q, k, v, kept["out"], kept["lse"], group, causal=True,
                                            head_groups=job["head_groups"])
            row[f"{name}_fwd_ms"] = _time(cp, fwd, job["reps"], job["warmup"])
            row[f"{name}_bwd_ms"] = _time(cp, bwd, job["reps"], job["warmup"])
            if name == "ring":
                row["peak_bytes"] = cp.get_default_memory_pool().total_bytes()
                row["used_bytes"] = _used_bytes(cp)
                out, lse = kept["out"], kept["lse"]
        if job["overlap"]:
            # The transfers alone: the forward's W - 1 exchanges of k and v, the backward's also
            # its W exchanges of the float32 dK/dV.
            spare = [cp.empty_like(k), cp.empty_like(v)]
            grads = [cp.zeros(k.shape, cp.float32), cp.zeros(v.shape, cp.float32)]
            spare_grads = [cp.empty_like(g) for g in grads]

            def comm_fwd():
                barrier()
                for _ in range(world - 1):
                    ring.start([k, v], spare).wait()

            def comm_bwd():
                comm_fwd()
                for _ in range(world):
                    ring.start(grads, spare_grads).wait()
            row["comm_fwd_ms"] = _time(cp, comm_fwd, job["reps"], True)
            row["comm_bwd_ms"] = _time(cp, comm_bwd, job["reps"], True)
            del spare, grads, spare_grads
        row.update(_sampled_check(cp, comm, rank, world, seqlen, q, k, v, out, lse))
        results.put((rank, row))
    except cp.cuda.memory.OutOfMemoryError as e:
        results.put((rank, dict(ok=False, oom=str(e)[:200])))
    except BaseException as e:  # noqa: B902 (reported to the parent, which stops the others)
        results.put((rank, dict(ok=False, error=f"{type(e).__name__}: {e}"[:500])))
        raise


def _run_ring(world, job, timeout):
    """The ranks' results by rank; a rank that fails (or a timeout) stops the others."""
    from cupy.cuda import nccl
    ctx = mp.get_context("spawn")
    results, nccl_id = ctx.Queue(), nccl.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, world, nccl_id, job, results)) for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < world:
            rank, row = results.get(timeout=max(1.0, deadline - time.monotonic()))
            got[rank] = row
            if row.get("ok") is False:
                break
    except Exception:   # queue.Empty: a rank hangs (its peer failed inside NCCL)
        got.setdefault(-1, dict(ok=False, error=f"timeout after {timeout} s"))
    for p in procs:
        p.join(timeout=5 if all(r.get("ok", True) for r in got.values()) else 0.1)
        if p.is_alive():
            p.kill()
            p.join()
    return got


def _one_gpu(cp, cf, seqlen, args, memory=False):
    """The whole sequence on GPU 0, one call each way: times and peak bytes, or what went wrong."""
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    try:
        q, k, v, dout = _inputs(cp, seqlen, args.seed, _blocks_of(0, 0))
        kept = {}

        def fwd():
            kept["out"], kept["lse"] = cf.flash_attention(q, k, v, causal=True, return_lse=True)

        def bwd():
            kept["grads"] = cf.flash_attention_backward(dout, q, k, v, kept["out"], kept["lse"], causal=True)
        if memory:
            fwd()
            bwd()
            cp.cuda.get_current_stream().synchronize()
            return dict(ok=True, pool_bytes=pool.total_bytes(), used_bytes=_used_bytes(cp),
                        unavoidable_bytes=_unavoidable(seqlen))
        row = dict(fwd_ms=_time(cp, fwd, args.reps, True), bwd_ms=_time(cp, bwd, args.reps, True))
        return dict(row, ok=True, peak_bytes=pool.total_bytes(), used_bytes=_used_bytes(cp))
    except cp.cuda.memory.OutOfMemoryError as e:
        return dict(ok=False, oom=str(e)[:200])
    finally:
        kept = q = k = v = dout = None
        pool.free_all_blocks()


def _scaling(args, cp, cf, doc, path):
    lines = ["| tokens | GPUs | fwd ms | bwd ms | fwd eff. | bwd eff. | TFLOP/s per GPU fwd / bwd "
             "| hidden comm fwd / bwd | pool peak GiB | sampled err / max |", "|---" * 10 + "|"]
    for seqlen in args.seqlens:
        base = None      # (GPU count, fwd ms, bwd ms) of the smallest count that ran this size
        if not args.no_one_gpu:
            one = _one_gpu(cp, cf, seqlen, args)
            doc["rows"].append(dict(impl="one_gpu", seqlen=seqlen, world=1, **one))
            if one["ok"]:
                base = (1, one["fwd_ms"], one["bwd_ms"])
                flops = _flops(seqlen)
                lines.append(f"| {seqlen} | 1 | {one['fwd_ms']:.0f} | {one['bwd_ms']:.0f} | 1 | 1 | "
                             f"{flops['fwd'] / one['fwd_ms'] / 1e9:.0f} / {flops['bwd'] / one['bwd_ms'] / 1e9:.0f}"
                             f" | - | {one['peak_bytes'] / 2**30:.1f} | - |")
            bench_write(doc, path)
        for world in args.worlds:
            overlap = seqlen <= args.overlap_max
            job = dict(mode="time", seqlen=seqlen, seed=args.seed, reps=args.reps, overlap=overlap,
                       warmup=seqlen <= args.warmup_max, head_groups=args.head_groups)
            t0 = time.perf_counter()
            ranks = _run_ring(world, job, args.timeout)
            row = dict(impl="ring", seqlen=seqlen, world=world, wall_s=time.perf_counter() - t0,
                       ranks={str(r): x for r, x in sorted(ranks.items())})
            if all(x.get("ok", True) for x in ranks.values()):
                flops = _flops(seqlen)
                for ps in ("fwd", "bwd"):
                    ms = max(x[f"ring_{ps}_ms"] for x in ranks.values())
                    row[f"{ps}_ms"] = ms
                    row[f"{ps}_tflops_per_gpu"] = flops[ps] / world / ms / 1e9
                    if base is not None:
                        row[f"{ps}_efficiency"] = base[1 + (ps == "bwd")] * base[0] / (world * ms)
                        row["efficiency_against"] = base[0]
                    if overlap:
                        compute = max(x[f"compute_{ps}_ms"] for x in ranks.values())
                        comm = max(x[f"comm_{ps}_ms"] for x in ranks.values())
                        row[f"{ps}_compute_ms"], row[f"{ps}_comm_ms"] = compute, comm
                        row[f"{ps}_hidden"] = min(1.0, max(0.0, (compute + comm - ms) / comm))
                for key in ("peak_bytes", "used_bytes", "sampled_max_abs_err", "sampled_ref_max_abs",
                            "sampled_lse_max_abs_err"):
                    row[key] = max(x[key] for x in ranks.values())
                if base is None:
                    base = (world, row["fwd_ms"], row["bwd_ms"])
                    row["fwd_efficiency"] = row["bwd_efficiency"] = 1.0
                    row["efficiency_against"] = world
                hidden = (f"{row['fwd_hidden']:.2f} / {row['bwd_hidden']:.2f}" if overlap else "-")
                lines.append(f"| {seqlen} | {world} | {row['fwd_ms']:.0f} | {row['bwd_ms']:.0f} | "
                             f"{row['fwd_efficiency']:.3f} | {row['bwd_efficiency']:.3f} | "
                             f"{row['fwd_tflops_per_gpu']:.0f} / {row['bwd_tflops_per_gpu']:.0f} | {hidden} | "
                             f"{row['peak_bytes'] / 2**30:.1f} | {row['sampled_max_abs_err']:.2e} / "
                             f"{row['sampled_ref_max_abs']:.2f} |")
            else:
                lines.append(f"| {seqlen} | {world} | failed: {json.dumps(ranks)[:200]} |")
            doc["rows"].append(row)
            bench_write(doc, path)
            print(lines[-1], flush=True)
    return lines


def _longest(probe, guess):
    """Bisection over multiples of GRANULE from ``guess``: (longest that ran, shortest that
    did not, the probes)."""
    lo = hi = None
    s = max(GRANULE, guess // GRANULE * GRANULE)
    probes, step = [], 1.08     # until both sides are found, each step 1.5x the last
    while hi is None or lo is None or hi - lo > GRANULE:
        ok, info = probe(s)
        probes.append(dict(seqlen=s, **info))
        print(f"  probe {s}: {'ran' if ok else 'did not run'} {json.dumps(info)[:160]}", flush=True)
        step = 1 + (step - 1) * 1.5
        if ok:
            lo = s
            s = max(int(s * step), s + GRANULE) if hi is None else (lo + hi) // 2
        else:
            hi = s
            if s == GRANULE:
                break
            s = min(int(s / step), s - GRANULE) if lo is None else (lo + hi) // 2
        s = max(GRANULE, s // GRANULE * GRANULE)
        if lo is not None and hi is not None and s in (lo, hi):
            break
    return lo, hi, probes


def _memory(args, cp, cf, doc, path):
    limit = int(args.memory_gib * 2**30)
    lines = ["| GPUs | longest (tokens) | first that failed | tokens per GiB of pool | x one GPU |",
             "|---|---|---|---|---|"]
    for world in args.worlds:
        # First guess: one call holds ~40 KB per token (16 heads x 128 x bf16: q, k, v, out,
        # dout, dq, dk, dv and the float32 dQ buffer); the ring's shards about as much.
        guess = int(limit / (40 * 1024) * world)
        if world == 1:
            def probe(s):
                cp.get_default_memory_pool().set_limit(size=limit)
                try:
                    got = _one_gpu(cp, cf, s, args, memory=True)
                finally:
                    cp.get_default_memory_pool().set_limit(size=0)
                return got["ok"], got
        else:
            def probe(s, world=world):
                job = dict(mode="memory", seqlen=s, seed=args.seed, limit=limit, head_groups=args.head_groups)
                ranks = _run_ring(world, job, args.timeout)
                ok = len(ranks) == world and all(x.get("ok") for x in ranks.values())
                return ok, {str(r): x for r, x in sorted(ranks.items())}
        t0 = time.perf_counter()
        lo, hi, probes = _longest(probe, guess)
        row = dict(impl="one_gpu" if world == 1 else "ring", world=world, pool_limit_bytes=limit,
                   longest=lo, first_failed=hi, probes=probes, wall_s=time.perf_counter() - t0)
        doc["rows"].append(row)
        bench_write(doc, path)
        print(f"GPUs {world}: longest {lo}, first that failed {hi}", flush=True)
    one = [r["longest"] for r in doc["rows"] if r["world"] == 1 and r["longest"]]
    for row in doc["rows"]:
        if one and row["longest"]:
            row["x_one_gpu"] = row["longest"] / one[0]
        lines.append(f"| {row['world']} | {row['longest']} | {row['first_failed']} | "
                     f"{(row['longest'] or 0) / args.memory_gib:.0f} | {row.get('x_one_gpu', float('nan')):.2f} |")
    bench_write(doc, path)
    return lines


def bench_write(doc, path):
    from cupyflash import bench
    bench.write_json(path, doc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1 << 20])
    ap.add_argument("--worlds", type=int, nargs="+", default=None,
                    help="GPU counts (default: 2 up to every GPU, doubling; with --memory-gib also 1)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--warmup-max", type=int, default=1 << 20, help="untimed first call up to this many tokens")
    ap.add_argument("--overlap-max", type=int, default=1 << 20,
                    help="compute-only and transfer-only runs up to this many tokens")
    ap.add_argument("--no-one-gpu", action="store_true", help="no one-GPU call")
    ap.add_argument("--memory-gib", type=float, default=0, help="longest-sequence search under this pool limit")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a ring run may take")
    ap.add_argument("--head-groups", type=int, default=None, help="ring_attention's head_groups (default: its own)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import cupy as cp
    from cupy.cuda import nccl
    import cupyflash as cf
    from cupyflash import bench
    gpus = cp.cuda.runtime.getDeviceCount()
    if args.worlds is None:
        args.worlds = ([1] if args.memory_gib else []) + [w for w in (2, 4, 8) if w <= gpus]
    for seqlen in args.seqlens:
        if seqlen % BLOCKS or seqlen % (2 * max(args.worlds)):
            raise SystemExit(f"--seqlens: {seqlen} is not a multiple of {BLOCKS} and of 2 x the largest world")
    for w in args.worlds:
        if w > gpus or (w > 1 and BLOCKS % (2 * w)):
            raise SystemExit(f"--worlds: {w} is more than the {gpus} GPUs here or does not divide {BLOCKS // 2}")
    name = "bench_ring_memory" if args.memory_gib else "bench_ring"
    path = Path(args.out) / f"{name}.json"
    doc = bench.report(name, [], heads=HEADS, headdim=HEADDIM, dtype="bfloat16", causal=True, layout="zigzag",
                       gpus=gpus, memory_gib=args.memory_gib or None, reps=args.reps,
                       head_groups=args.head_groups, nccl=nccl.get_version(),
                       nccl_env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    lines = (_memory if args.memory_gib else _scaling)(args, cp, cf, doc, path)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
