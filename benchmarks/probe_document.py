"""The document mask of bench_variants.py (8 documents of random lengths, causal inside each;
bf16, batch 2 x 8K, 16 heads, d=128), spelled several ways, forward and backward:

    python benchmarks/probe_document.py --out DIR [--label NAME]

- ``mask_mod``: as bench_variants.py runs it: ``doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx``
  as a MaskMod, the call not causal, the block mask from ``masks.from_mask_mod``;
- ``causal_mask_mod``: ``doc[q_idx] == doc[kv_idx]`` as the MaskMod and ``causal=True``;
- ``blocks_only``: the first spelling's block mask without its mask_mod (every listed block
  computed whole: wrong outputs, timing only), to show what the per-element mask costs;
- ``varlen``: the documents as a packed batch (``flash_attention_varlen``, causal), the
  layout FlashAttention users pack documents in;
- ``causal``: plain causal attention at the same shape, for scale.

Times as the bench does (``cupyflash.bench.time_calls``: median of 10 CUDA-event times after 3
calls; standard normal inputs). Writes DIR/probe_document[_NAME].json.
"""
import argparse
from pathlib import Path

import cupy as cp
import numpy as np

import cupyflash as cf
from cupyflash import bench, masks

BATCH, SEQLEN, HEADS, HEADDIM, DOCUMENTS = 2, 8192, 16, 128, 8


def document_ids(seed=0):
    """bench_variants.py's documents: DOCUMENTS pieces cut at random points."""
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, SEQLEN), DOCUMENTS - 1, replace=False))
    return np.repeat(np.arange(DOCUMENTS), np.diff(np.concatenate([[0], cuts, [SEQLEN]])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    rng = cp.random.default_rng(0)
    bf16 = bench.np_dtype("bfloat16")
    q, k, v, dout = (rng.standard_normal((BATCH, SEQLEN, HEADS, HEADDIM), dtype=cp.float32).astype(bf16)
                     for _ in range(4))
    ids = document_ids()
    doc = cp.asarray(ids, cp.int32)
    both = cf.MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", arrays={"doc": doc})
    same = cf.MaskMod("doc[q_idx] == doc[kv_idx]", arrays={"doc": doc})
    both_mask = masks.from_mask_mod(both, SEQLEN, SEQLEN)
    spellings = {
        "mask_mod": dict(block_mask=both_mask),
        "causal_mask_mod": dict(block_mask=masks.from_mask_mod(same, SEQLEN, SEQLEN, causal=True), causal=True),
        "blocks_only": dict(block_mask=masks.BlockMask(both_mask.blocks, both_mask.block_size,
                                                       seqlen_q=SEQLEN, seqlen_k=SEQLEN)),
        "causal": dict(causal=True),
    }
    rows = []

    def timed(name, fwd, bwd):
        row = dict(spelling=name)
        for pass_, call in (("fwd", fwd), ("bwd", bwd)):
            row[f"{pass_}_ms"] = bench.time_calls(bench.CupyClock(), [call], reps=10, warmup=3)["ms"]
        rows.append(row)
        print(f"{name:16s} fwd {row['fwd_ms']:.4f} ms  bwd {row['bwd_ms']:.4f} ms", flush=True)

    for name, kw in spellings.items():
        out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
        timed(name, lambda kw=kw: cf.flash_attention(q, k, v, return_lse=True, **kw),
              lambda kw=kw, out=out, lse=lse: cf.flash_attention_backward(dout, q, k, v, out, lse, **kw))
    # The same documents packed: each batch entry's documents one after another.
    lengths = np.diff(np.concatenate([[0], np.flatnonzero(np.diff(ids)) + 1, [SEQLEN]]))
    cu = cp.asarray(np.concatenate([[0], np.cumsum(np.tile(lengths, BATCH))]), cp.int32)
    pq, pk, pv, pdo = (x.reshape(BATCH * SEQLEN, HEADS, HEADDIM) for x in (q, k, v, dout))
    longest = int(lengths.max())
    out, lse = cf.flash_attention_varlen(pq, pk, pv, cu, cu, longest, longest, causal=True, return_lse=True)
    timed("varlen",
          lambda: cf.flash_attention_varlen(pq, pk, pv, cu, cu, longest, longest, causal=True, return_lse=True),
          lambda: cf.flash_attention_varlen_backward(pdo, pq, pk, pv, out, lse, cu, cu, longest, longest,
                                                     causal=True))
    doc_json = bench.report("probe_document", rows, label=args.label, dtype="bfloat16",
                            shape=[BATCH, SEQLEN, HEADS, HEADDIM], documents=lengths.tolist())
    suffix = f"_{args.label}" if args.label else ""
    bench.write_json(Path(args.out) / f"probe_document{suffix}.json", doc_json)


if __name__ == "__main__":
    main()
