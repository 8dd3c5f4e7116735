"""A/B timing of kernel source trees: the same cases timed with cuda/ and with edited copies.

    python benchmarks/variants.py --out DIR base=cuda v1=exp/v1 [--headdims 128] [--flash]
                                  [--waves 2 8] [--causal-only]

Each NAME=DIR replaces the directory the kernels are compiled from (cupyflash._compile) and
times ours (bf16, 2048/headdim heads, 16K tokens, causal and not) with cupyflash.bench;
``--flash`` adds SDPA flash on the same cases. Every variant's kernels are compiled first in
parallel processes into CuPy's disk cache; the variants are then timed in turn, twice, so
that drift of the GPU shows as a difference between the two rounds. ``--waves`` times each tree
with each given launch-group size of the causal passes (``_launch.LAUNCH_GROUP_WAVES``). Writes DIR/variants.json
and prints a table.
"""
import argparse
import multiprocessing as mp
import os
from pathlib import Path

from cupyflash import _compile, _config, _launch, _spec, bench

PASSES = ("fwd", "bwd")


def use_tree(path):
    _compile.CUDA_DIR = Path(path).resolve()
    _compile.source.cache_clear()
    _compile._module.cache_clear()
    _launch._kernel.cache_clear()


def compile_one(item):
    tree, filename, name = item
    use_tree(tree)
    try:
        _compile.get_kernel(_compile.source(filename), name)
        return None
    except Exception as e:
        return f"{tree} {name}: {bench.error_text(e)[:2000]}"


def needed(headdims):
    """(file, kernel) of each kernel a dense bf16 call at these head dims runs."""
    import cupy
    limit = cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    tn = _compile.template_name
    yield "bwd.cu", tn("bwd_preprocess_kernel", "bf16")
    yield "bwd.cu", tn("bwd_convert_dq_kernel", "bf16", 0)
    for hd in headdims:
        f, b = _config.tile("fwd", hd, limit), _config.tile("bwd", hd, limit)
        for causal in (False, True):
            spec = _spec.CallSpec("bfloat16", hd, window=_spec.band(causal))
            yield "fwd.cu", _launch.fwd_name(spec, "bf16", hd, f)
            yield "bwd.cu", _launch.bwd_dkdv_name(spec, "bf16", hd, b, True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("trees", nargs="+", help="NAME=DIR")
    ap.add_argument("--headdims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--passes", nargs="+", default=list(PASSES))
    ap.add_argument("--flash", action="store_true")
    ap.add_argument("--waves", type=int, nargs="+", default=[_launch.LAUNCH_GROUP_WAVES])
    ap.add_argument("--causal-only", action="store_true")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)

    items = [(tree, f, n) for tree in trees.values() for f, n in needed(args.headdims)]
    with mp.get_context("spawn").Pool(os.cpu_count()) as pool:
        for err in pool.imap_unordered(compile_one, items):
            if err:
                print("COMPILE FAILED", err, flush=True)

    rows = []
    for rnd in range(2):
        runs = [(name, tree, waves) for name, tree in trees.items() for waves in args.waves]
        for k, (name, tree, waves) in enumerate(runs):
            use_tree(tree)
            _launch.LAUNCH_GROUP_WAVES = waves
            label = f"{name}/w{waves}" if len(args.waves) > 1 else name
            for hd in args.headdims:
                for causal in (True,) if args.causal_only else (False, True):
                    case = bench.Case.dense(args.seqlen, hd, causal)
                    sets = bench.input_sets(case)
                    runners = [bench.Ours(case, sets)]
                    if args.flash and rnd == 0 and k == 0:   # the peer once, beside the first run
                        runners.append(bench.make_runner("sdpa_flash", case, sets))
                    for runner in runners:
                        for pass_ in args.passes:
                            try:
                                row = bench.measure(runner, pass_, args.reps, memory=False)
                            except Exception as e:
                                row = bench.failed_row(case, runner.impl, pass_, e)
                            row["variant"] = label if runner.impl == "cupyflash" else runner.impl
                            row["round"] = rnd
                            rows.append(row)
                            print(bench.progress_line(row), row["variant"], rnd, flush=True)
    bench.write_json(Path(args.out) / "variants.json", bench.report("variants", rows, trees=trees))
    print("\n=== variants table ===")
    for r in rows:
        val = f"{r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s" if "ms" in r else r.get("error", "")[:80]
        print(f"{r['variant']:<12} round {r['round']} d={r['headdim']:<4} causal={r['causal']!s:<5} "
              f"{r['pass']:<4} {val}")


if __name__ == "__main__":
    main()
