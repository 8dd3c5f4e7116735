"""Summaries of the CSVs benchmarks/profile_ncu.sh writes:

    python benchmarks/ncu_summary.py DIR            # per kernel: counters, op mix, stalls
    python benchmarks/ncu_summary.py DIR --regions  # ... and instructions grouped by how often they ran

For each kernel of sass_ours.csv and sass_sdpa.csv: executed instructions by opcode, warp
stall reasons, shared-memory wavefronts (and the excess from bank conflicts); from the details
CSVs, the counters in which our kernel and FlashAttention 2's differ.
"""
import argparse
import collections
import csv
import os
import re

OPCODE = re.compile(r"(@!?U?P\w+\s+)?([A-Z0-9_]+)")


def sass_kernels(path):
    """{kernel name: [row dict per SASS instruction]}."""
    out, cur, hdr = {}, None, None
    with open(path) as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "Kernel Name":
                cur, hdr = r[1], None
                out[cur] = []
            elif r[0] == "Address":
                hdr = r
            elif cur and hdr:
                out[cur].append(dict(zip(hdr, r)))
    return out


def num(x):
    try:
        return int(x)
    except (TypeError, ValueError):
        return 0


def opcode(row):
    m = OPCODE.match(row["Source"].strip())
    return m.group(2) if m else "?"


def summarize(name, rows, regions):
    ops, stalls = collections.Counter(), collections.Counter()
    wave, excess = collections.Counter(), 0
    stall_keys = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    for r in rows:
        n = num(r["Instructions Executed"])
        ops[opcode(r)] += n
        for k in stall_keys:
            stalls[k[6:]] += num(r[k])
        wave[opcode(r)] += num(r.get("L1 Wavefronts Shared"))
        excess += num(r.get("L1 Wavefronts Shared Excessive"))
    total, samples = sum(ops.values()), max(sum(stalls.values()), 1)
    print(f"== {name[:110]}\n   executed {total / 1e6:.0f}M instructions, "
          f"shared wavefronts {sum(wave.values()) / 1e6:.0f}M (excess {excess / 1e6:.1f}M)")
    print("   ops:    " + "  ".join(f"{k} {v / 1e6:.0f}M" for k, v in ops.most_common(16)))
    print("   stalls: " + "  ".join(f"{k} {100 * v / samples:.0f}%" for k, v in stalls.most_common(10)))
    if regions:
        # Runs of consecutive instructions with one execution count are one code region.
        start, prev, mix = 0, None, collections.Counter()
        def flush(end):
            if prev and prev * (end - start) >= 0.01 * total:
                print(f"   [{start:5d}, {end:5d}) x{prev:>10,d} = {prev * (end - start) / 1e6:7.1f}M  "
                      + " ".join(f"{k}:{v}" for k, v in mix.most_common(7)))
        for i, r in enumerate(rows):
            n = num(r["Instructions Executed"])
            if n != prev:
                flush(i)
                start, prev, mix = i, n, collections.Counter()
            mix[opcode(r)] += 1
        flush(len(rows))


def details(path):
    """{kernel id: {(section, metric): (value, unit)}} and the kernel names."""
    out, names = {}, {}
    with open(path) as f:
        rows = list(csv.reader(f))
    hdr = rows[0]
    i = {k: hdr.index(k) for k in ("ID", "Kernel Name", "Section Name", "Metric Name",
                                   "Metric Unit", "Metric Value")}
    for r in rows[1:]:
        out.setdefault(r[i["ID"]], {})[(r[i["Section Name"]], r[i["Metric Name"]])] = \
            (r[i["Metric Value"]], r[i["Metric Unit"]])
        names[r[i["ID"]]] = r[i["Kernel Name"]]
    return out, names


def compare(dir_):
    paths = [os.path.join(dir_, f"details_{x}.csv") for x in ("ours", "sdpa")]
    if not all(os.path.exists(p) for p in paths):
        return
    (ours, on), (sdpa, sn) = details(paths[0]), details(paths[1])
    def pick(d, names, word):
        return next((d[k] for k in d if word in names[k]), None)
    wanted = ("Duration", "Executed Instructions", "Issued Ipc Active", "Registers Per Thread",
              "Achieved Active Warps Per SM", "Warp Cycles Per Issued Instruction",
              "L1/TEX Cache Throughput", "Compute (SM) Throughput", "Local Memory Spilling Requests")
    for label, a, b in (("forward", pick(ours, on, "fwd"), pick(sdpa, sn, "flash_fwd")),
                        ("dK/dV", pick(ours, on, "dkdv"), pick(sdpa, sn, "dq_dk_dv"))):
        if not (a and b):
            continue
        print(f"== {label}: ours vs FlashAttention 2")
        for key in a:
            if key[1] in wanted and key in b:
                print(f"   {key[1]:<40} {a[key][0]:>16} {b[key][0]:>16} {a[key][1]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--regions", action="store_true")
    args = ap.parse_args()
    compare(args.dir)
    for impl in ("ours", "sdpa"):
        path = os.path.join(args.dir, f"sass_{impl}.csv")
        if os.path.exists(path):
            for name, rows in sass_kernels(path).items():
                if rows and any(w in name for w in ("flash_fwd", "dkdv", "dq_dk_dv", "bwd_dq")):
                    summarize(name, rows, args.regions)


if __name__ == "__main__":
    main()
