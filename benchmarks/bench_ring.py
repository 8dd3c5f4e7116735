"""Ring attention across the GPUs of one machine: time against one GPU, the share of the
communication hidden behind compute, peak memory, and sampled rows against float32.

    python benchmarks/bench_ring.py --out DIR [--seqlen 1048576] [--world N] [--reps 2]

bf16, causal, batch 1, 16 heads, head dim 128, the zigzag layout; one process per GPU over
CuPy's NCCL (``--world``, default every GPU). Timed with CUDA events on each rank after a
barrier, the slowest rank's time counted:
- ``one_gpu``: flash_attention and its backward over the whole sequence on GPU 0;
- ``ring``: ring_attention / ring_attention_backward over ``world`` GPUs;
- ``compute``: the same calls with an adapter that moves nothing (the attention alone);
- ``comm``: the same exchanges with no attention (the transfers alone).
Hidden share = (compute + comm - ring) / comm. Scaling efficiency = one_gpu / (world x ring).
Peak memory: the CuPy pool's bytes after the ring's backward (it keeps what it took). Sampled
rows: 16 query rows per rank, out against a float32 reference over all keys (gathered).
Writes DIR/bench_ring.json and prints a table last.
"""
import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADS, HEADDIM, SAMPLED = 16, 128, 16


def _inputs(cp, seqlen, seed):
    """q, k, v, dout of the whole sequence (the same in every process for one seed)."""
    import ml_dtypes
    dtype = np.dtype(ml_dtypes.bfloat16)
    rs = cp.random.RandomState(seed)
    return [rs.standard_normal((1, seqlen, HEADS, HEADDIM), dtype=cp.float32).astype(dtype) for _ in range(4)]


def _time(cp, fn, reps):
    start, end = cp.cuda.Event(), cp.cuda.Event()
    fn()                              # warm-up (compiles)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return min(times)


class _Silent:
    """A ring adapter that moves nothing: the attention of every step, on stale buffers."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def start(self, sends, recvs):
        from cupyflash.distributed import _Done
        return _Done()


def _rank(rank, world, nccl_id, args, results):
    import cupy as cp
    from cupy.cuda import nccl
    from cupyflash import distributed as cfd
    cp.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(world, nccl_id, rank)
    ring = cfd.as_ring(comm)
    full = _inputs(cp, args.seqlen, args.seed)
    q, k, v, dout = (cfd.shard(x, rank, world) for x in full)
    del full
    cp.get_default_memory_pool().free_all_blocks()
    one = cp.ones(1, cp.float32)

    def barrier():
        comm.allReduce(one.data.ptr, one.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cp.cuda.get_current_stream().ptr)
        cp.cuda.get_current_stream().synchronize()

    row = {}
    for name, group in (("ring", ring), ("compute", _Silent(rank, world))):
        kept = {}

        def fwd(group=group, kept=kept):
            barrier()
            kept["out"], kept["lse"] = cfd.ring_attention(q, k, v, group, causal=True, return_lse=True)

        def bwd(group=group, kept=kept):
            barrier()
            cfd.ring_attention_backward(dout, q, k, v, kept["out"], kept["lse"], group, causal=True)
        row[f"{name}_fwd_ms"] = _time(cp, fwd, args.reps)
        row[f"{name}_bwd_ms"] = _time(cp, bwd, args.reps)
        if name == "ring":
            row["peak_bytes"] = cp.get_default_memory_pool().total_bytes()
            out = kept["out"]
    # The transfers alone: the forward's world - 1 exchanges of k and v, the backward's also
    # its world exchanges of the float32 dK/dV.
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
    row["comm_fwd_ms"] = _time(cp, comm_fwd, args.reps)
    row["comm_bwd_ms"] = _time(cp, comm_bwd, args.reps)
    # Sampled rows against float32 over every key (gathered from the ranks).
    rng = np.random.default_rng(rank)
    local = np.sort(rng.choice(q.shape[1], SAMPLED, replace=False))
    c = q.shape[1] // 2
    chunks = cfd.chunks_of(rank, world)
    positions = np.array([chunks[i // c] * c + i % c for i in local])
    keys = [cp.empty((world,) + k.shape, k.dtype) for _ in range(2)]
    for x, dst in zip((k, v), keys):
        comm.allGather(x.data.ptr, dst.data.ptr, x.nbytes, nccl.NCCL_UINT8, cp.cuda.get_current_stream().ptr)
    kf, vf = (cfd.unshard(list(x)).astype(cp.float32)[0] for x in keys)
    qs = q[0, cp.asarray(local)].astype(cp.float32)                                   # (rows, h, d)
    s = cp.einsum("rhd,khd->hrk", qs, kf) * HEADDIM ** -0.5
    s = cp.where(cp.arange(kf.shape[0])[None, None, :] <= cp.asarray(positions)[None, :, None], s, -cp.inf)
    p = cp.exp(s - s.max(axis=2, keepdims=True))
    ref = cp.einsum("hrk,khd->rhd", p / p.sum(axis=2, keepdims=True), vf)
    row["sampled_max_abs_err"] = float(abs(out[0, cp.asarray(local)].astype(cp.float32) - ref).max())
    row["sampled_ref_max_abs"] = float(abs(ref).max())
    results.put((rank, row))


def _one_gpu(cp, cf, args):
    """The whole sequence on GPU 0, one call each way: fwd_ms, bwd_ms, peak_bytes."""
    q, k, v, dout = _inputs(cp, args.seqlen, args.seed)
    kept = {}

    def fwd():
        kept["out"], kept["lse"] = cf.flash_attention(q, k, v, causal=True, return_lse=True)

    def bwd():
        cf.flash_attention_backward(dout, q, k, v, kept["out"], kept["lse"], causal=True)
    return dict(fwd_ms=_time(cp, fwd, args.reps), bwd_ms=_time(cp, bwd, args.reps),
                peak_bytes=cp.get_default_memory_pool().total_bytes())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, default=1 << 20)
    ap.add_argument("--world", type=int, default=0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import cupy as cp
    from cupy.cuda import nccl
    import cupyflash as cf
    from cupyflash import bench
    world = args.world or cp.cuda.runtime.getDeviceCount()
    one = _one_gpu(cp, cf, args)
    cp.get_default_memory_pool().free_all_blocks()
    ctx = mp.get_context("spawn")
    results, nccl_id = ctx.Queue(), nccl.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, world, nccl_id, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    ranks = dict(results.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    flops = {"fwd": 4 * args.seqlen ** 2 * HEADS * HEADDIM / 2, "bwd": 2.5 * 4 * args.seqlen ** 2 * HEADS * HEADDIM / 2}
    rows, lines = [], [f"| pass | 1 GPU ms | {world} GPUs ms | efficiency | TFLOP/s per GPU | hidden comm |",
                       "|---|---|---|---|---|---|"]
    for ps in ("fwd", "bwd"):
        ring = max(r[f"ring_{ps}_ms"] for r in ranks.values())
        compute = max(r[f"compute_{ps}_ms"] for r in ranks.values())
        comm = max(r[f"comm_{ps}_ms"] for r in ranks.values())
        row = dict(impl="ring", pass_=ps, seqlen=args.seqlen, world=world, one_gpu_ms=one[f"{ps}_ms"],
                   ms=ring, compute_ms=compute, comm_ms=comm,
                   efficiency=one[f"{ps}_ms"] / (world * ring),
                   tflops_per_gpu=flops[ps] / world / (ring * 1e-3) / 1e12,
                   hidden=min(1.0, max(0.0, (compute + comm - ring) / comm)) if comm > 0 else None)
        rows.append(row)
        lines.append(f"| {ps} | {one[f'{ps}_ms']:.1f} | {ring:.1f} | {row['efficiency']:.2f} | "
                     f"{row['tflops_per_gpu']:.0f} | {row['hidden']:.2f} |")
    doc = bench.report("ring", rows, heads=HEADS, headdim=HEADDIM, dtype="bfloat16", causal=True,
                       layout="zigzag", one_gpu=one, ranks={str(r): x for r, x in sorted(ranks.items())})
    bench.write_json(Path(args.out) / "bench_ring.json", doc)
    print(json.dumps({r: {k: x[k] for k in ("peak_bytes", "sampled_max_abs_err", "sampled_ref_max_abs")}
                      for r, x in ranks.items()}))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
