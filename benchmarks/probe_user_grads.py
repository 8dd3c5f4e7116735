"""The backward of a relative-position bias under gradient snippets of different index
patterns (issue 16: user score_mods' array gradients), fp16, batch 2 x 8K, 16 heads, d=128:

    python benchmarks/probe_user_grads.py --out DIR [--label NAME]

- nograd: the bias without its table's gradient;
- clamped: the table learned, offsets clamped to [-127, 127] (T5's far buckets: most scores of
  a long sequence add to one of two entries per head);
- const0: every score adds to one element;
- full: a table with an entry per offset (2 x 8K - 1 per head), so that a thread's adds move
  to another element at every score.

Times the backward call as the bench does (``cupyflash.bench.time_calls``: the median of 6
CUDA-event times after 2 calls) and writes DIR/probe_user_grads[_NAME].json. The package imported (PYTHONPATH) is the one timed.
"""
import argparse
from pathlib import Path

import cupy as cp

import cupyflash as cf
from cupyflash import bench

BATCH, SEQLEN, HEADS, HEADDIM = 2, 8192, 16, 128
CLAMPED = "min(max(q_idx - kv_idx, -127), 127) + 127, h"
FULL = f"kv_idx - q_idx + {SEQLEN - 1}, h"
SNIPPETS = {
    "nograd": (CLAMPED, "dscore"),
    "clamped": (CLAMPED, f"d_table.add(table.offset({CLAMPED}), dscore);\nreturn dscore;"),
    "const0": (CLAMPED, "d_table.add(0, dscore);\nreturn dscore;"),
    "full": (FULL, f"d_table.add(table.offset({FULL}), dscore);\nreturn dscore;"),
}


def backward_ms(q, k, v, dout, mod):
    out, lse = cf.flash_attention(q, k, v, score_mod=mod, return_lse=True)
    call = lambda: cf.flash_attention_backward(dout, q, k, v, out, lse, score_mod=mod)  # noqa: E731
    return bench.time_calls(bench.CupyClock(), [call], reps=6, warmup=2)["ms"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    rng = cp.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((BATCH, SEQLEN, HEADS, HEADDIM), dtype=cp.float32)
                     .astype(cp.float16) for _ in range(4))
    rows = []
    for name, (at, grad) in SNIPPETS.items():
        entries = 2 * 127 + 1 if at == CLAMPED else 2 * SEQLEN - 1
        table = rng.standard_normal((entries, HEADS), dtype=cp.float32)
        mod = cf.ScoreMod(f"score + table({at})", grad=grad, arrays={"table": table},
                          grad_arrays=() if name == "nograd" else ("table",))
        ms = backward_ms(q, k, v, dout, mod)
        rows.append(dict(snippet=name, grad=grad, ms=ms))
        print(f"{name:8s} bwd {ms:8.3f} ms", flush=True)
    doc = bench.report("probe_user_grads", rows, label=args.label, dtype="float16",
                       shape=[BATCH, SEQLEN, HEADS, HEADDIM])
    suffix = f"_{args.label}" if args.label else ""
    bench.write_json(Path(args.out) / f"probe_user_grads{suffix}.json", doc)


if __name__ == "__main__":
    main()
