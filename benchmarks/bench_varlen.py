"""Packed variable-length batches: our varlen calls against dense attention at the mean length
and against SDPA on the batch padded to its longest sequence.

    python benchmarks/bench_varlen.py --out DIR [--quick]

bf16, 16 heads, head dim 128; 16 sequences whose lengths are drawn uniformly from [64, 8192]
(seed 0; --quick: 8 sequences). Rows, each timed forward (with lse) and backward like every
benchmark here (cupyflash.bench.timing: median of per-call CUDA-event times after warm-up,
two input sets in turn):
  varlen        cupyflash.flash_attention_varlen on the packed batch (each call reads the
                offsets to the host to check them: one small copy and a wait per call)
  varlen_max    the same calls with the maximums given (FlashAttention's call): the grids take
                them, and the check of the offsets waits until just before the launch, so the
                host prepares the launch while the GPU runs what the read waits behind
                (a loop of such calls: benchmarks/ab_trees.py's varlen cells)
  varlen_unchecked  the same calls with the maximums given and check_offsets=False (no read,
                no wait: the host queues ahead as for dense calls)
  varlen_graph  the same calls captured in a CUDA graph (maximums given, offsets trusted) and
                replayed: the kernels without the host's part
  dense_mean    cupyflash.flash_attention on batch x mean length (the same token count)
  varlen_equal  flash_attention_varlen on that same equal-length batch, packed: the cost of
                the packed addressing alone
  dense_each    one dense call per sequence of the drawn batch, each timed alone, summed: the
                cost of the length mix alone (the packed call should match it, less launches)
  sdpa_cudnn_padded, sdpa_flash_padded
                torch SDPA on (sequences, longest, heads, d), the batch padded to its longest
                sequence, no mask (a correct padded call also needs a key mask, which these
                backends do not take: this is the cost padding cannot go below)
TFLOP/s are counted on the real tokens (4 h d sum(sq_i sk_i), halved for causal; backward
2.5x) for every row, so that a padded row shows the work it wastes. Writes DIR/bench_varlen.json
and prints a table last.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cupyflash import bench  # noqa: E402
from cupyflash._gpu import gpu_or_reason  # noqa: E402

NHEADS, HEADDIM, DTYPE = 16, 128, "bfloat16"
LENGTHS = (64, 8192)


def lengths(n, seed=0):
    return np.random.default_rng(seed).integers(LENGTHS[0], LENGTHS[1] + 1, n)


def offsets(cp, lens):
    """The batch's int32 cu_seqlens on the GPU."""
    return cp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))


def real_flops(lens, causal, pass_):
    return sum(bench.attention_flops(1, NHEADS, int(s), int(s), HEADDIM, 0.5 if causal else 1.0, pass_)
               for s in lens)


def rows_for(lens, causal, reps):
    import cupy as cp
    import cupyflash as cf
    from cupyflash.bench import timing
    dtype = bench.np_dtype(DTYPE)
    total, n = int(lens.sum()), len(lens)
    cu = offsets(cp, lens)
    mean = int(round(total / n))
    rows = []

    def add(impl, pass_, result, shape):
        flop = real_flops(lens, causal, pass_)
        rows.append(dict(impl=impl, pass_=pass_, causal=causal, sequences=n, total_tokens=total,
                         longest=int(lens.max()), mean=mean, shape=shape,
                         tflops=bench.tflops(flop, result["ms"]), **result))
        print(f"{impl:20s} {pass_} causal={causal}: {result['ms']:.3f} ms "
              f"{rows[-1]['tflops']:.0f} TFLOP/s", flush=True)

    def sets(shape_q, shape_kv):
        rng = np.random.default_rng(1)
        return [tuple(cp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype)
                      for s in (shape_q, shape_kv, shape_kv, shape_q)) for _ in range(2)]

    clock = timing.CupyClock()
    packed = sets((total, NHEADS, HEADDIM), (total, NHEADS, HEADDIM))
    fwd = [(s, cf.flash_attention_varlen(s[0], s[1], s[2], cu, cu, causal=causal, return_lse=True))
           for s in packed]
    # Eager calls: the offsets read and checked (the maximums found there, or given: then the
    # check waits for the launch), then neither read nor waited for (check_offsets=False).
    longest = int(lens.max())
    for impl, args, kw in (("varlen", (), {}),
                           ("varlen_max", (longest, longest), {}),
                           ("varlen_unchecked", (longest, longest), {"check_offsets": False})):
        add(impl, "fwd", timing.time_calls(clock, [
            lambda s=s: cf.flash_attention_varlen(s[0], s[1], s[2], cu, cu, *args, causal=causal,
                                                  return_lse=True, **kw)
            for s in packed], reps), list(packed[0][0].shape))
        add(impl, "bwd", timing.time_calls(clock, [
            lambda s=s, o=o: cf.flash_attention_varlen_backward(s[3], s[0], s[1], s[2], o[0], o[1], cu, cu,
                                                                *args, causal=causal, **kw)
            for s, o in fwd], reps), list(packed[0][0].shape))
    # The same calls as CUDA graph replays: the maximums given, the offsets trusted, no read
    # to the host between calls (the kernels' time alone).

    def graph_fwd(s=packed[0]):
        return cf.flash_attention_varlen(s[0], s[1], s[2], cu, cu, longest, longest, causal=causal,
                                         return_lse=True)
    fwd_stream, fwd_graph, fwd_result = timing.graph_of(graph_fwd)

    def graph_bwd(s=packed[0], o=fwd_result):
        return cf.flash_attention_varlen_backward(s[3], s[0], s[1], s[2], o[0], o[1], cu, cu, longest,
                                                  longest, causal=causal)
    bwd_stream, bwd_graph, bwd_result = timing.graph_of(graph_bwd)
    for pass_, stream, graph in (("fwd", fwd_stream, fwd_graph), ("bwd", bwd_stream, bwd_graph)):
        with stream:
            add("varlen_graph", pass_, timing.time_calls(clock, [lambda g=graph, st=stream: g.launch(st)], reps),
                list(packed[0][0].shape))
    del fwd, packed, fwd_result, bwd_result, fwd_graph, bwd_graph
    timing.release_memory()

    # Dense at the mean length: the same token count in equal sequences.
    dense = sets((n, mean, NHEADS, HEADDIM), (n, mean, NHEADS, HEADDIM))
    fwd = [(s, cf.flash_attention(s[0], s[1], s[2], causal=causal, return_lse=True)) for s in dense]
    for pass_, calls in (("fwd", [lambda s=s: cf.flash_attention(s[0], s[1], s[2], causal=causal,
                                                                 return_lse=True) for s in dense]),
                         ("bwd", [lambda s=s, o=o: cf.flash_attention_backward(s[3], s[0], s[1], s[2], o[0], o[1],
                                                                               causal=causal)
                                  for s, o in fwd])):
        result = timing.time_calls(clock, calls, reps)
        # FLOPs of the equal-length batch itself, for the within-10% comparison.
        flop = bench.attention_flops(n, NHEADS, mean, mean, HEADDIM, 0.5 if causal else 1.0, pass_)
        rows.append(dict(impl="dense_mean", pass_=pass_, causal=causal, sequences=n, total_tokens=n * mean,
                         longest=mean, mean=mean, shape=[n, mean, NHEADS, HEADDIM],
                         tflops=bench.tflops(flop, result["ms"]), **result))
        print(f"{'dense_mean':20s} {pass_} causal={causal}: {result['ms']:.3f} ms "
              f"{rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
    # The same equal-length batch packed.
    cu_eq = cp.arange(0, n * mean + 1, mean, dtype=cp.int32)
    eq = [tuple(a.reshape(n * mean, NHEADS, HEADDIM) for a in s) for s in dense]
    fwd = [(s, cf.flash_attention_varlen(s[0], s[1], s[2], cu_eq, cu_eq, causal=causal, return_lse=True))
           for s in eq]
    for pass_, calls in (("fwd", [lambda s=s: cf.flash_attention_varlen(s[0], s[1], s[2], cu_eq, cu_eq, causal=causal,
                                                                        return_lse=True) for s in eq]),
                         ("bwd", [lambda s=s, o=o: cf.flash_attention_varlen_backward(
                             s[3], s[0], s[1], s[2], o[0], o[1], cu_eq, cu_eq, causal=causal) for s, o in fwd])):
        result = timing.time_calls(clock, calls, reps)
        flop = bench.attention_flops(n, NHEADS, mean, mean, HEADDIM, 0.5 if causal else 1.0, pass_)
        rows.append(dict(impl="varlen_equal", pass_=pass_, causal=causal, sequences=n, total_tokens=n * mean,
                         longest=mean, mean=mean, shape=[n * mean, NHEADS, HEADDIM],
                         tflops=bench.tflops(flop, result["ms"]), **result))
        print(f"{'varlen_equal':20s} {pass_} causal={causal}: {result['ms']:.3f} ms "
              f"{rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
    del fwd, dense, eq
    timing.release_memory()

    # Each sequence alone, dense: the times summed.
    each = {"fwd": 0.0, "bwd": 0.0}
    for length in lens:
        one = sets((1, int(length), NHEADS, HEADDIM), (1, int(length), NHEADS, HEADDIM))
        fwd = [(s, cf.flash_attention(s[0], s[1], s[2], causal=causal, return_lse=True)) for s in one]
        each["fwd"] += timing.time_calls(clock, [lambda s=s: cf.flash_attention(s[0], s[1], s[2], causal=causal,
                                                                                return_lse=True) for s in one],
                                         reps)["ms"]
        each["bwd"] += timing.time_calls(clock, [lambda s=s, o=o: cf.flash_attention_backward(
            s[3], s[0], s[1], s[2], o[0], o[1], causal=causal) for s, o in fwd], reps)["ms"]
        del fwd, one
    for pass_, ms in each.items():
        add("dense_each", pass_, {"ms": ms, "reps": reps}, [int(x) for x in lens])
    timing.release_memory()

    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # torch missing: the padded rows say why
        rows.append(dict(impl="sdpa_padded", causal=causal, error=bench.error_text(e)))
        return rows
    tclock = timing.TorchClock(torch)
    longest = int(lens.max())
    for impl, backend in (("sdpa_cudnn_padded", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_flash_padded", SDPBackend.FLASH_ATTENTION)):
        g = torch.Generator(device="cuda").manual_seed(2)
        padded = [tuple(torch.randn((n, NHEADS, longest, HEADDIM), device="cuda", generator=g,
                                    dtype=torch.bfloat16).requires_grad_(i < 3) for i in range(4))
                  for _ in range(2)]

        def forward(s):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(s[0], s[1], s[2], is_causal=causal)
        try:
            outs = [(s, forward(s)) for s in padded]
            for pass_, calls in (("fwd", [lambda s=s: forward(s) for s in padded]),
                                 ("bwd", [lambda s=s, o=o: torch.autograd.grad(o, s[:3], s[3], retain_graph=True)
                                          for s, o in outs])):
                add(impl, pass_, timing.time_calls(tclock, calls, reps), [n, longest, NHEADS, HEADDIM])
        except Exception as e:  # a backend that refuses the shape: its row says why
            rows.append(dict(impl=impl, causal=causal, error=bench.error_text(e)))
        del padded
        timing.release_memory()
    return rows


def table(rows):
    lines = []
    for causal in (False, True):
        def ms(impl, pass_):
            r = [x for x in rows if x.get("impl") == impl and x.get("pass_") == pass_ and x["causal"] == causal]
            return r[0] if r else None
        for pass_ in ("fwd", "bwd"):
            v, d = ms("varlen", pass_), ms("dense_mean", pass_)
            cells = [f"{'causal' if causal else 'full'} {pass_}",
                     f"{v['tflops']:.0f}" if v else "-", f"{d['tflops']:.0f}" if d else "-",
                     f"{v['tflops'] / d['tflops']:.2f}" if v and d else "-"]
            for impl in ("varlen_max", "varlen_unchecked", "varlen_graph"):
                g = ms(impl, pass_)
                cells += [f"{g['tflops']:.0f}" if g else "-", f"{g['tflops'] / d['tflops']:.2f}" if g and d else "-"]
            for impl in ("sdpa_cudnn_padded", "sdpa_flash_padded"):
                p = ms(impl, pass_)
                cells.append(f"{p['ms']:.2f} ms ({p['ms'] / v['ms']:.2f}x ours)" if p and v else "-")
            for impl in ("varlen_equal", "dense_each"):
                p = ms(impl, pass_)
                cells.append(f"{p['tflops']:.0f}" if p else "-")
            lines.append("| " + " | ".join(cells) + " |")
    head = ("| pass | varlen TFLOP/s | dense at mean | ratio | maximums given | ratio | unchecked offsets | ratio |"
            " graph replays | ratio | SDPA cuDNN padded | SDPA flash padded | packed equal | dense each |\n"
            + "|---" * 14 + "|")
    return head + "\n" + "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    _, why = gpu_or_reason()
    if why:
        sys.exit(f"bench_varlen needs a GPU: {why}")
    lens = lengths(8 if args.quick else 16)
    rows = []
    for causal in (False, True):
        rows += rows_for(lens, causal, args.reps)
    doc = bench.report("varlen", rows, nheads=NHEADS, headdim=HEADDIM, dtype=DTYPE,
                               lengths=[int(x) for x in lens], length_range=list(LENGTHS))
    bench.write_json(Path(args.out) / "bench_varlen.json", doc)
    print(table(rows))


if __name__ == "__main__":
    main()
