"""Tile-table tuning: time candidate tiles of the tensor-core kernels side by side.

    python benchmarks/tune.py --out DIR [--headdims 64 128] [--seqlen 8192] [--passes fwd bwd]

For each head dim and pass, every candidate tile replaces the table's entry in turn
(cupyflash._config), and ours is timed with cupyflash.bench (bf16, 2048/headdim heads,
batch x seqlen = 16K tokens, causal and not). Writes DIR/tune.json and prints a table; the
notes in benchmarks/NOTES.md say what was kept.
"""
import argparse
from pathlib import Path

from cupyflash import _config, bench

B, F = _config.BwdTile, _config.FwdTile
CANDIDATES = {
    ("fwd", 64): [F(128, 64, 4, stages=2), F(128, 64, 4), F(128, 128, 4), F(128, 128, 8), F(64, 64, 4)],
    ("fwd", 128): [F(128, 64, 4), F(128, 32, 4), F(128, 64, 8), F(64, 64, 4), F(128, 32, 4, stages=2),
                   F(64, 64, 4, stages=2), F(128, 64, 8, stages=2)],
    ("fwd", 160): [F(128, 64, 8), F(64, 64, 4)],
    ("fwd", 192): [F(128, 64, 8), F(64, 64, 4)],
    ("fwd", 256): [F(128, 64, 8), F(64, 64, 4), F(128, 32, 8), F(64, 32, 4), F(64, 32, 4, stages=2)],
    ("bwd", 64): [B(128, 128, 8, km=2), B(128, 128, 8, km=2, stages=2), B(128, 64, 8, km=2, stages=2),
                  B(128, 64, 8, km=2), B(128, 128, 8, km=4, stages=2)],
    ("bwd", 128): [B(128, 64, 8, km=2, stages=2), B(128, 64, 8, km=2), B(128, 64, 8, km=4, stages=2)],
}
TABLES = {"fwd": _config._FWD, "bwd": _config._BWD}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--passes", nargs="+", default=["fwd", "bwd"])
    args = ap.parse_args()
    rows = []
    for (pass_, hd), tiles in CANDIDATES.items():
        if hd not in args.headdims or pass_ not in args.passes:
            continue
        table = TABLES[pass_]
        kept = table[hd]
        for t in tiles:
            table[hd] = [t]
            for causal in (False, True):
                case = bench.Case.dense(args.seqlen, hd, causal)
                sets = bench.input_sets(case)
                try:
                    row = bench.measure(bench.Ours(case, sets), pass_, args.reps, memory=False)
                except Exception as e:   # a tile that fails to compile or launch
                    row = bench.failed_row(case, "cupyflash", pass_, e)
                row["tile"] = repr(t)
                rows.append(row)
                print(bench.progress_line(row), row["tile"], flush=True)
        table[hd] = kept
    bench.write_json(Path(args.out) / "tune.json", bench.report("tile sweep", rows))
    print("\n=== tune table ===")
    for r in rows:
        val = f"{r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s" if "ms" in r else r.get("error", "")[:80]
        print(f"d={r['headdim']:<4} {r['pass']:<4} {r['tile']:<62} causal={r['causal']!s:<5} {val}")


if __name__ == "__main__":
    main()
