"""What a user score_mod costs the forward (issue 16: user score_mods within 10% of plain
attention), bf16, 16K tokens at 8K (bench_variants' shapes), Hopper kernels where they run:

    python benchmarks/probe_user_score_mod.py --out DIR [--label NAME] [--rounds N]

Rules, each timed over the same inputs beside plain attention in one process, rounds
interleaved (d=128 non-causal and causal, d=64 non-causal):

- plain, alibi, softcap: the built-in rules;
- user_alibi: bench_variants' score_mod spelling ALiBi (``(float)(q_idx - kv_idx)``: an
  int-to-float conversion per score, which runs on the pipe of exp2);
- user_alibi_alu: the same with that conversion done on the ALU and FMA pipes (the float
  1.5 x 2^23 plus the integer, minus 1.5 x 2^23; exact below 2^22);
- user_const: ``score - 0.5f``, a snippet that does nearly nothing: the user path's own cost.

Writes DIR/probe_user_score_mod[_NAME].json (rows: round, d, causal, rule, ms, tflops) and
prints each rule's best time over plain's. The package imported (PYTHONPATH) is the one timed.
"""
import argparse
import os
import sys
from pathlib import Path

import cupy as cp

import cupyflash as cf
from cupyflash import bench
from cupyflash.bench import cases

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_variants as bv  # noqa: E402

RULES = ("plain", "alibi", "user_alibi", "user_alibi_alu", "user_const", "softcap")
CASES = ((128, False), (128, True), (64, False))


def keywords(rule, nheads):
    if rule == "user_alibi_alu":
        slopes = cp.asarray(bv.alibi_slopes(nheads), cp.float32)
        return dict(score_mod=cf.ScoreMod(
            "score - slopes[h] * fabsf(__int_as_float(0x4B400000 + (q_idx - kv_idx)) - 12582912.f)",
            grad="dscore", arrays={"slopes": slopes}))
    if rule == "user_const":
        return dict(score_mod=cf.ScoreMod("score - 0.5f", grad="dscore"))
    return bv.ours_keywords(rule, nheads, 8192)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    os.environ["CUPYFLASH_KERNELS"] = "auto"
    rows = []
    for rnd in range(args.rounds):
        for d, causal in CASES:
            case = cases.Case.dense(8192, d, causal, "bfloat16")
            sets = cases.input_sets(case)
            for rule in RULES:
                found = []
                bv.timed(bv.OursWith(case, sets, rule, **keywords(rule, case.nheads)), ["fwd"],
                         args.reps, rule, found)
                rows += [dict(round=rnd, d=d, causal=causal, rule=rule, ms=r.get("ms"),
                              tflops=r.get("tflops"), error=r.get("error")) for r in found]
                bench.release_memory()
            del sets
            bench.release_memory()
    doc = bench.report("probe_user_score_mod", rows, label=args.label, dtype="bfloat16")
    suffix = f"_{args.label}" if args.label else ""
    bench.write_json(Path(args.out) / f"probe_user_score_mod{suffix}.json", doc)
    for d, causal in CASES:
        best = {rule: min(r["ms"] for r in rows if (r["d"], r["causal"], r["rule"]) == (d, causal, rule))
                for rule in RULES}
        print(d, "causal" if causal else "full",
              "  ".join(f"{rule} {best[rule] / best['plain']:.3f}" for rule in RULES))


if __name__ == "__main__":
    main()
