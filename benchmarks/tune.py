"""Tile-table tuning: time candidate tiles of the tensor-core kernels side by side.

    python benchmarks/tune.py --out DIR [--headdims 64 128] [--seqlen 8192]

For each head dim and pass, every candidate tile replaces the table's entry in turn
(cupyflash._config), and forward / backward are timed at bf16, 16 heads, batch x seqlen =
16K tokens, causal and not, with bench_dense's timing (CUDA events, median, rotating inputs).
Writes DIR/tune.json and prints a table; the notes in benchmarks/NOTES.md say what was kept.
"""
import argparse
import json
import sys
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dense as bd  # noqa: E402
from cupyflash import _config  # noqa: E402

FWD = {
    64: [_config.FwdTile(128, 64, 4), _config.FwdTile(128, 128, 4), _config.FwdTile(128, 64, 8),
         _config.FwdTile(64, 64, 4)],
    128: [_config.FwdTile(128, 64, 8), _config.FwdTile(128, 64, 4), _config.FwdTile(128, 32, 4),
          _config.FwdTile(64, 64, 4)],
}
BWD = {
    64: [_config.BwdTile(128, 64, 8), _config.BwdTile(128, 128, 8), _config.BwdTile(64, 64, 8)],
    128: [_config.BwdTile(64, 64, 8), _config.BwdTile(128, 64, 8), _config.BwdTile(64, 64, 4),
          _config.BwdTile(64, 128, 8), _config.BwdTile(128, 32, 8)],
}


def run(hd, seqlen, causal, reps):
    bd.HEADDIM = hd
    bd.NHEADS = 2048 // hd
    batch = bd.TOKENS // seqlen
    sets = bd.make_sets(batch, seqlen, seed=hd + seqlen)
    res, _ = bd.bench_ours(sets, causal, reps, 3, 2.0)
    f, b = bd.flops(batch, seqlen, causal)
    return res["fwd_ms"], bd.tflops(f, res["fwd_ms"]), res["bwd_ms"], bd.tflops(b, res["bwd_ms"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for hd in args.headdims:
        fwd0, bwd0 = list(_config._FWD[hd]), list(_config._BWD[hd])
        for pass_, cands in (("fwd", FWD[hd]), ("bwd", BWD[hd])):
            for t in cands:
                _config._FWD[hd] = [t] if pass_ == "fwd" else fwd0
                _config._BWD[hd] = [t] if pass_ == "bwd" else bwd0
                for causal in (False, True):
                    try:
                        fms, ftf, bms, btf = run(hd, args.seqlen, causal, args.reps)
                        ms, tf = (fms, ftf) if pass_ == "fwd" else (bms, btf)
                        rows.append(dict(hd=hd, pass_=pass_, tile=repr(t), causal=causal,
                                         ms=ms, tflops=tf))
                    except Exception as e:   # a tile that fails to compile or launch
                        rows.append(dict(hd=hd, pass_=pass_, tile=repr(t), causal=causal,
                                         error=f"{type(e).__name__}: {e}"[:300]))
                    print(rows[-1], flush=True)
        _config._FWD[hd], _config._BWD[hd] = fwd0, bwd0
    meta = dict(gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                date=bd.datetime.datetime.now(bd.datetime.timezone.utc).isoformat(),
                commit=bd._git_commit(), seqlen=args.seqlen, tokens=bd.TOKENS)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tune.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("\n=== tune table ===")
    for r in rows:
        val = f"{r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s" if "ms" in r else r["error"][:80]
        print(f"d={r['hd']:<4} {r['pass_']:<4} {r['tile']:<40} causal={r['causal']!s:<5} {val}")


if __name__ == "__main__":
    main()
