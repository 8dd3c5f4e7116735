"""Where block-sparse time goes beyond the visible blocks (issue 16's block-sparse target:
time over our dense time <= density + 0.02), bf16, batch 1, 16 heads, d=128, 128 x 128 blocks
(bench_sparse's shape):

    python benchmarks/probe_sparse.py --out DIR [--label NAME]
    python benchmarks/probe_sparse.py --once random 0.1 8192   # one forward and backward, for ncu

The sweep times the forward (with lse) and the backward of random masks at several densities
and of sliding windows of several widths, at 8K and 16K, beside dense: a line through the
random masks' times against their visible blocks gives the time per block (its slope) and
what a call pays whatever it skips (its intercept), for each pass. Times as the bench does
(``cupyflash.bench.time_calls``, median of 8 CUDA-event times after 3 calls; standard normal
inputs). Writes DIR/probe_sparse[_NAME].json and prints the fits last.
"""
import argparse
from pathlib import Path

import cupy as cp
import numpy as np

import cupyflash as cf
from cupyflash import bench, masks

HEADS, HEADDIM, BLOCK = 16, 128, 128
DENSITIES = (0.05, 0.1, 0.2, 0.4)
WINDOWS = (512, 1024, 2048)


def inputs(seqlen):
    rng = cp.random.default_rng(0)
    bf16 = bench.np_dtype("bfloat16")
    return [rng.standard_normal((1, seqlen, HEADS, HEADDIM), dtype=cp.float32).astype(bf16) for _ in range(4)]


def mask_of(pattern, value, seqlen):
    """(BlockMask or None, causal flag)."""
    if pattern == "dense":
        return None, False
    if pattern == "random":
        return masks.random(seqlen, seqlen, value, 0, block_size=BLOCK, nheads=HEADS), False
    return masks.sliding_window(seqlen, seqlen, int(value), block_size=BLOCK), True


def calls(tensors, mask, causal):
    q, k, v, dout = tensors
    out, lse = cf.flash_attention(q, k, v, causal=causal, block_mask=mask, return_lse=True)
    fwd = lambda: cf.flash_attention(q, k, v, causal=causal, block_mask=mask, return_lse=True)  # noqa: E731
    bwd = lambda: cf.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, block_mask=mask)  # noqa: E731
    return fwd, bwd


def visible_blocks(mask, causal, seqlen):
    """Blocks the kernels visit, summed over heads."""
    n = seqlen // BLOCK
    if mask is None:
        return HEADS * n * (n + 1) // 2 if causal else HEADS * n * n
    blocks = mask.blocks & np.tril(np.ones((n, n), dtype=bool)) if causal else mask.blocks
    return int(np.broadcast_to(blocks, (HEADS, n, n)).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--label", default="")
    ap.add_argument("--once", nargs=3, metavar=("PATTERN", "VALUE", "SEQLEN"))
    args = ap.parse_args()
    if args.once:
        pattern, value, seqlen = args.once[0], float(args.once[1]), int(args.once[2])
        fwd, bwd = calls(inputs(seqlen), *mask_of(pattern, value, seqlen))
        fwd()
        bwd()
        cp.cuda.Device().synchronize()
        return
    rows = []
    for seqlen in (8192, 16384):
        tensors = inputs(seqlen)
        cases = [("dense", 0)] + [("random", d) for d in DENSITIES] + [("window", w) for w in WINDOWS]
        for pattern, value in cases:
            mask, causal = mask_of(pattern, value, seqlen)
            fwd, bwd = calls(tensors, mask, causal)
            blocks = visible_blocks(mask, causal, seqlen)
            row = dict(pattern=pattern, value=value, seqlen=seqlen, blocks=blocks)
            for name, call in (("fwd", fwd), ("bwd", bwd)):
                row[f"{name}_ms"] = bench.time_calls(bench.CupyClock(), [call], reps=8, warmup=3)["ms"]
            rows.append(row)
            print(f"{seqlen:6d} {pattern:7s} {value:7g} blocks {blocks:7d} fwd {row['fwd_ms']:.4f} "
                  f"bwd {row['bwd_ms']:.4f}", flush=True)
    fits = {}
    for seqlen in (8192, 16384):
        rnd = [r for r in rows if r["seqlen"] == seqlen and r["pattern"] == "random"]
        x = np.array([r["blocks"] for r in rnd], dtype=float)
        for name in ("fwd", "bwd"):
            slope, icept = np.polyfit(x, [r[f"{name}_ms"] for r in rnd], 1)
            dense = next(r for r in rows if r["seqlen"] == seqlen and r["pattern"] == "dense")
            fits[f"{seqlen}_{name}"] = dict(us_per_block=slope * 1e3, intercept_us=icept * 1e3,
                                            dense_us=dense[f"{name}_ms"] * 1e3,
                                            dense_us_per_block=dense[f"{name}_ms"] * 1e3 / dense["blocks"])
            print(f"{seqlen} {name}: {slope * 1e3 * 1e3:.2f} ns a block (dense "
                  f"{dense[f'{name}_ms'] * 1e6 / dense['blocks']:.2f}), intercept {icept * 1e3:.1f} us "
                  f"= {icept / dense[f'{name}_ms']:.4f} of dense", flush=True)
    doc = bench.report("probe_sparse", rows, label=args.label, dtype="bfloat16",
                       shape=[1, "seqlen", HEADS, HEADDIM])
    doc["fits"] = fits
    suffix = f"_{args.label}" if args.label else ""
    bench.write_json(Path(args.out) / f"probe_sparse{suffix}.json", doc)


if __name__ == "__main__":
    main()
