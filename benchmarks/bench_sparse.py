"""Block-sparse attention speed: time against our own dense time, beside FlexAttention.

    python benchmarks/bench_sparse.py --out DIR [--quick] [--no-flex]

bf16, head dim 128, batch 1, 16 heads, seqlen 8192 and 32768 (--quick: 8192 only). Patterns
(cupyflash/bench.py), all with 128 x 128 blocks:
  random          masks.random(density=0.10, seed=0, nheads=16): one layout per head
  sliding_window  masks.sliding_window(window=1024) with causal=True at call time: each query
                  sees the keys of the blocks that meet the 1024 keys ending at itself
  causal          masks.causal(...) as a block mask (no causal flag at call time)
Each is timed forward (with lse) and backward like every benchmark here (cupyflash.bench:
median of per-call CUDA-event times after warm-up, rotating inputs) and divided by the same
implementation's dense time (no mask, not causal) at the same shape: with block skipping
working, the ratio follows the density (the fraction of visible elements, the call's causal
included). TFLOP/s count the visible elements only.

FlexAttention (torch.compile(flex_attention)) runs the same element masks on the same data:
causal and the window through create_block_mask with a mask_mod (checked element by element
against our to_dense() at a small size), the per-head random layout through
BlockMask.from_kv_blocks from our block lists. Its output is checked against ours. It is
skipped, with the reason, where torch or its compile is missing or fails. Writes
DIR/bench_sparse.json and prints a table last.
"""
import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cupyflash import bench  # noqa: E402
from cupyflash._gpu import gpu_or_reason  # noqa: E402

SEQLENS = (8192, 32768)
QUICK_SEQLENS = (8192,)
PATTERNS = ("dense",) + bench.SPARSE_PATTERNS


def reps_for(seqlen, reps):
    """(timed calls, warm-up calls): at 32K one dense backward takes ~0.1 s."""
    return (max(reps, 10), 3) if seqlen <= 8192 else (10, 2)


def add_dense_ratios(rows):
    """``vs_dense``: time over the same implementation's dense time at the same seqlen/pass."""
    dense = {(r["impl"], r["seqlen"], r["pass"]): r["ms"] for r in rows
             if r["pattern"] == "dense" and "ms" in r}
    for r in rows:
        base = dense.get((r["impl"], r["seqlen"], r["pass"]))
        if base and "ms" in r:
            r["vs_dense"] = r["ms"] / base


def table(rows):
    header = ["pattern", "seqlen", "density", "impl", "fwd ms", "fwd/dense", "fwd TFLOP/s",
              "bwd ms", "bwd/dense", "bwd TFLOP/s", "note"]
    lines = []
    for (key, impl), by_pass in bench.pivot(rows, ("fwd", "bwd")).items():
        first = next(iter(by_pass.values()))
        cells = [first["pattern"], first["seqlen"], bench.fmt(first["density"], ".4f"), impl]
        notes = []
        for p in ("fwd", "bwd"):
            r = by_pass.get(p, {})
            cells += [bench.fmt(r.get("ms"), ".3f"), bench.fmt(r.get("vs_dense"), ".3f"),
                      bench.fmt(r.get("tflops"), ".1f")]
            status = bench.row_status(r) if r else ""
            if status and status not in notes:
                notes.append(status)
        lines.append(cells + ["; ".join(notes)[:100]])
    return bench.table_text(header, lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_sparse.json")
    ap.add_argument("--quick", action="store_true", help=f"seqlens {QUICK_SEQLENS} only")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--flex-max-seqlen", type=int, default=max(SEQLENS),
                    help="run FlexAttention only up to this seqlen (each shape compiles anew)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    cp, why = gpu_or_reason()
    if cp is None:
        print(f"bench_sparse needs a CUDA GPU; none is usable ({why})", file=sys.stderr)
        return 1
    log = functools.partial(print, flush=True)
    log(f"{bench.gpu_name()}: bf16, d={bench.SPARSE_HEADDIM}, batch={bench.SPARSE_BATCH}, "
        f"nheads={bench.SPARSE_NHEADS}, block {bench.SPARSE_BLOCK}")

    rows = []
    t0 = time.perf_counter()
    for seqlen in (QUICK_SEQLENS if args.quick else SEQLENS):
        reps, warmup = reps_for(seqlen, args.reps)
        use_flex = not args.no_flex and seqlen <= args.flex_max_seqlen
        impls = bench.SPARSE_IMPLS if use_flex else ("cupyflash",)
        for pattern in PATTERNS:
            rows += bench.compare(bench.Case.sparse(pattern, seqlen), impls, ("fwd", "bwd"),
                                   reps, warmup, log=log)
    wall = time.perf_counter() - t0
    add_dense_ratios(rows)

    doc = bench.report(
        "block-sparse attention, forward (with lse) and backward, vs dense", rows,
        batch=bench.SPARSE_BATCH, nheads=bench.SPARSE_NHEADS, headdim=bench.SPARSE_HEADDIM,
        block=bench.SPARSE_BLOCK, random_density=bench.RANDOM_DENSITY, window=bench.WINDOW,
        vs_dense="time / the same implementation's dense (no mask, not causal) time at the "
                 "same shape",
        density="fraction of visible elements, call causal included", wall_s=round(wall, 1))
    path = bench.write_json(Path(args.out) / "bench_sparse.json", doc)
    log(f"\nwrote {path} ({wall:.0f} s)")
    log("=== bench_sparse table ===")
    log(table(rows))
    return 1 if any(r["impl"] == "cupyflash" and "error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
