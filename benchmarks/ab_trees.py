"""A/B of CUDA source trees in one device call: our dense rows only, each tree timed in its
own process (``cupyflash._compile.CUDA_DIR`` pointed at it, so every tree really compiles and
runs its own kernels), the trees interleaved rep by rep so that clock drift hits them alike.

    git archive HEAD cuda | tar -x -C /tmp && mv /tmp/cuda base    # a tree of a commit
    python benchmarks/ab_trees.py --reps 2 base=base new=cuda -- 128:2048:0:fwd,bwd 256:8192:1:fwd

A tree that holds a ``cupyflash`` package beside its ``cuda`` folder (``git archive HEAD
cupyflash cuda``) is a whole-package tree: its process imports that package (PYTHONPATH), for
changes on the host side too; ``new=.`` is the working tree's. ``--warm`` first runs every
tree once, all at the same time and untimed, so that their kernels compile in parallel (on a
machine whose CuPy cache lacks them, the first round otherwise compiles one kernel at a time).

A cell is headdim:seqlen:causal(0/1):passes[:rule], at the bench's shapes (16K tokens, 2048 =
heads x headdim); a rule of bench_variants.py's ours_keywords (softcap, alibi, user_alibi,
window, window_LEFT_RIGHT, ...; rules joined by + together, e.g. user_alibi+document) times ours
with it (TFLOP/s counted as for plain attention).
A cell decode:batch:context:layout (contiguous, page16, page256) times a decode call of
bench_decode.py's shapes as it does (CUDA graph replays), in microseconds. A cell
varlen:causal(0/1):pass(fwd/bwd):check[:rule[:headdim]] (checked: the offsets read, maximums
found there; max: read, maximums given; unchecked: check_offsets=False; a rule as above; a head
dim other than 128 with 2048 / headdim heads) times bench_varlen.py's packed batch eagerly,
LOOP calls back to back between two events (the median over ``--calls`` loops), in ms per
call: what a loop of such calls costs, host work included. ``--peer`` adds cuDNN
SDPA's rows once, in the first tree's first rep (dense cells). The table gives TFLOP/s
(decode: us, varlen: ms) per rep for each tree; untracked trees in the repository root
travel to the device machine with the working tree.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def run_tree(tree, cells, dtype, reps, peer):
    """One process's rows: ``tree`` compiled and timed at every cell."""
    from cupyflash import _compile
    _compile.CUDA_DIR = Path(tree).resolve()
    _compile.source.cache_clear()
    from cupyflash import bench
    from cupyflash.bench import cases, peers
    rows = []
    for cell in cells:
        if cell.startswith(("decode:", "varlen:")):
            rows.append((decode_row if cell.startswith("decode:") else varlen_row)(cell, reps))
            bench.release_memory()   # the cell's arrays, freed on return
            continue
        d, s, causal, passes, *rule = cell.split(":")
        case = cases.Case.dense(int(s), int(d), causal == "1", dtype)
        if rule:   # one of bench_variants.py's rules, ours only
            import bench_variants as bv
            runner = bv.OursWith(case, cases.input_sets(case), rule[0],
                                 **bv.ours_keywords(rule[0], case.nheads, case.seqlen))
            found = []
            bv.timed(runner, passes.split(","), reps, rule[0], found)
            del runner
            bench.release_memory()
        else:
            impls = ["cupyflash"] + (["sdpa_cudnn"] if peer else [])
            found = peers.compare(case, impls, tuple(passes.split(",")), reps=reps)
        rows += [{k: r.get(k) for k in ("impl", "pass", "ms", "tflops", "error", "mismatch")} | {"cell": cell}
                 for r in found]
    return rows


def decode_row(cell, reps):
    """A decode cell's row: the median of ``reps`` graph replays of one call, in ms."""
    import cupy as cp
    import cupyflash as cf
    from cupyflash import bench
    import bench_decode as bd   # after cupyflash: its path entry must not pick the package
    _, batch, context, layout = cell.split(":")
    batch, context = int(batch), int(context)
    k, v, table = bd.as_layout(cp, *bd.random_cache(cp, batch, context), layout)
    q = cp.random.standard_normal((batch, 1, bd.NHEADS, bd.HEADDIM), dtype=cp.float32).astype(k.dtype)
    lens = cp.full(batch, context, cp.int32)
    stream, graph, _ = bench.timing.graph_of(
        lambda: cf.flash_attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table))
    with stream:
        result = bench.time_calls(bench.CupyClock(), [lambda: graph.launch(stream)], reps)
    return {"impl": "cupyflash", "pass": "decode", "ms": result["ms"], "cell": cell}


LOOP = 8   # calls per event pair of a varlen cell


def varlen_row(cell, reps):
    """A varlen cell's row: the median over ``reps`` loops of LOOP eager calls, in ms per call."""
    import statistics
    import cupy as cp
    import cupyflash as cf
    from cupyflash import bench
    import bench_varlen as bv   # after cupyflash, as bench_decode above
    _, causal, pass_, check, *more = cell.split(":")
    rule, headdim = (more + ["", ""])[:2]
    causal = causal == "1"
    headdim = int(headdim or bv.HEADDIM)
    nheads = bv.NHEADS * bv.HEADDIM // headdim   # the same bytes and FLOPs per token as the bench
    lens = bv.lengths(16)
    total, longest = int(lens.sum()), int(lens.max())
    cu = bv.offsets(cp, lens)
    cp.random.seed(1)   # drawn on the GPU: the host's draw of 4 x 135M values takes seconds
    q, k, v, dout = (cp.random.standard_normal((total, nheads, headdim), dtype=cp.float32)
                     .astype(bench.np_dtype(bv.DTYPE)) for _ in range(4))
    mods = {}
    if rule:
        import bench_variants
        mods = bench_variants.ours_keywords(rule, nheads, longest)
    out, lse = cf.flash_attention_varlen(q, k, v, cu, cu, causal=causal, return_lse=True, **mods)
    args, kw = {"checked": ((), {}), "max": ((longest, longest), {}),
                "unchecked": ((longest, longest), {"check_offsets": False})}[check]
    kw = {**kw, **mods}
    if pass_ == "fwd":
        def call():
            return cf.flash_attention_varlen(q, k, v, cu, cu, *args, causal=causal, return_lse=True, **kw)
    else:
        def call():
            return cf.flash_attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, *args, causal=causal, **kw)
    clock, times = bench.CupyClock(), []
    for i in range(reps + 2):   # two loops of warm-up
        clock.synchronize()
        start = clock.event()
        results = [call() for _ in range(LOOP)]
        end = clock.event()
        end.synchronize()
        del results
        if i >= 2:
            times.append(clock.elapsed_ms(start, end) / LOOP)
    return {"impl": "cupyflash", "pass": pass_, "ms": statistics.median(times), "cell": cell}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", help="name=dir (then -- and the cells)")
    ap.add_argument("--reps", type=int, default=2, help="rounds over the trees")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per row")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--peer", action="store_true", help="cuDNN SDPA's rows in the first round")
    ap.add_argument("--json", help="also write every row (with its tree and rep) to this file")
    ap.add_argument("--warm", action="store_true",
                    help="first run every tree once at the same time, untimed: their kernels compile in parallel")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, cells = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if not cells or not (args.one or args.trees):
        ap.error("name=dir trees and, after --, at least one cell (headdim:seqlen:causal:passes)")
    if args.one:
        rows = run_tree(args.one, cells, args.dtype, args.calls, args.peer)
        print("ROWS " + json.dumps(rows), flush=True)
        return 0
    trees = [t.split("=", 1) for t in args.trees]

    def command(tree, calls, peer):
        package = Path(tree, "cupyflash").is_dir()
        cmd = [sys.executable, __file__, "--one", str(Path(tree, "cuda")) if package else tree,
               "--dtype", args.dtype, "--calls", str(calls), *(["--peer"] if peer else []), "--", *cells]
        return cmd, dict(os.environ, PYTHONPATH=str(Path(tree).resolve())) if package else os.environ

    if args.warm:
        warming = []
        for name, tree in trees:
            cmd, env = command(tree, 1, False)
            warming.append((name, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                   text=True)))
        for name, w in warming:
            _, err = w.communicate()
            if w.returncode:
                print(f"{name}: warm-up failed\n{err[-3000:]}", flush=True)
    table, failed, everything = {}, False, []
    for rep in range(args.reps):
        for i, (name, tree) in enumerate(trees):
            cmd, env = command(tree, args.calls, args.peer and i == 0 and rep == 0)
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            found = [line for line in p.stdout.splitlines() if line.startswith("ROWS ")]
            if not found:
                print(f"{name}: failed\n{p.stderr[-3000:]}", flush=True)
                failed = True
                continue
            for r in json.loads(found[0][5:]):
                everything.append(dict(r, tree=name, rep=rep))
                label = name if r["impl"] == "cupyflash" else r["impl"]
                value = (f"{r['ms'] * 1e3:.1f}" if r["pass"] == "decode" else
                         f"{r['ms']:.3f}" if r["cell"].startswith("varlen:") else
                         f"{r['tflops']:.0f}" if r.get("tflops") else (r.get("error") or "?"))
                table.setdefault((r["cell"], r["pass"]), {}).setdefault(label, []).append(
                    value + (" MISMATCH" if r.get("mismatch") else ""))
    for (cell, pass_), by_tree in table.items():
        print(f"{cell} {pass_}: " + "  ".join(f"{n} {'/'.join(v)}" for n, v in by_tree.items()), flush=True)
    if args.json:
        from cupyflash import bench
        bench.write_json(args.json, bench.report("ab_trees", everything, trees=dict(trees), cells=cells,
                                                 dtype=args.dtype, calls=args.calls))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
