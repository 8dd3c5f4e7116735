"""Reports: the JSON of a run (GPU, date, commit, versions), the tables printed last, the
figure, and the targets of the benchmark issue they are checked against."""
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from .cases import HEAD_WIDTH, SETS, TOKENS, cp

# Targets of the benchmark issue, checked in the report.
TARGET_VS_FLASH = 1.0                    # fwd and bwd TFLOP/s over SDPA flash's
TARGET_VS_FLASH_HEADDIMS = (64, 128)
TARGET_VS_FLASH_SEQLENS = (1024, 16384)  # inclusive range
TARGET_SPEEDUP_VS_NAIVE = (4096, 3.0)    # (seqlen, fwd+bwd time of naive / ours)
TARGET_MEMORY_VS_NAIVE = (8192, 10.0)    # (seqlen, fwd+bwd peak memory of naive / ours)


# --- reports --------------------------------------------------------------------------------

def git_commit():
    """$GIT_COMMIT, else ``git rev-parse HEAD`` where it answers with a hash, else unknown."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out if re.fullmatch(r"[0-9a-f]{7,40}", out) else "unknown"


def gpu_name():
    return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()


def versions():
    from .. import __version__
    rt = cp.cuda.runtime.runtimeGetVersion()
    found = {"python": platform.python_version(), "numpy": np.__version__,
             "cupy": cp.__version__, "cuda_runtime": f"{rt // 1000}.{rt % 1000 // 10}",
             "cuda_driver": cp.cuda.runtime.driverGetVersion(), "cupyflash": __version__}
    try:
        # The compiler of our kernels: its register allocation moves their speed by a few %.
        from cupy_backends.cuda.libs import nvrtc
        found["nvrtc"] = "%d.%d" % nvrtc.getVersion()
    except Exception:  # a version we cannot read is left out of the report
        pass
    for name in ("torch", "triton"):
        if name in sys.modules:
            found[name] = getattr(sys.modules[name], "__version__", "?")
    if "flash_attn.cute" in sys.modules:   # the fa4 peer ran: its release and its compiler's
        from importlib import metadata
        for dist in ("flash-attn-4", "nvidia-cutlass-dsl-libs-base"):
            try:
                found[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                found[dist] = "?"
    return found


def report(benchmark, rows, **config):
    """The JSON document of a run: what, where, when, which code, which versions, the rows."""
    return {
        "benchmark": benchmark,
        "gpu": gpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "versions": versions(),
        "config": dict(tokens=TOKENS, head_width=HEAD_WIDTH, input_sets=SETS,
                       statistic="median of per-call CUDA-event times after warm-up",
                       flops="fwd 4*b*h*s*s*d x visible fraction (0.5 causal), "
                             "bwd 2.5x fwd, fwd+bwd 3.5x fwd",
                       peak_bytes="device memory one call takes above what was held before",
                       **config),
        "rows": rows,
    }


def write_json(path, document):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))
    return path


def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and x == x else "-"


def table_text(header, lines):
    """Right-aligned columns, a rule under the header."""
    lines = [[str(c) for c in line] for line in lines]
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths))
                     for r in [header, ["-" * w for w in widths], *lines])


def row_status(row):
    """'' for a clean timed row, else what went wrong (skipped, error, mismatch, note)."""
    for key in ("error", "skipped", "mismatch", "note"):
        if row.get(key):
            return f"{key}: {row[key]}"
    return ""


def progress_line(row):
    head = (f"{row['impl']:>14} {row['pass']:<6} {row['dtype']} d={row['headdim']} "
            f"s={row['seqlen']}{' causal' if row['causal'] else ''}"
            f"{'' if row['pattern'] == 'dense' else ' ' + row['pattern']}")
    if "ms" not in row:
        return f"{head}: {row_status(row)}"
    mem = f", {row['peak_bytes'] / 2**20:.0f} MiB" if "peak_bytes" in row else ""
    kernels = f" [{row['kernels']}]" if "kernels" in row else ""
    return f"{head}: {row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s{mem}{kernels}"


CASE_FIELDS = ("pattern", "dtype", "headdim", "nheads", "batch", "seqlen", "causal")


def _case_key(row):
    return tuple(row[f] for f in CASE_FIELDS)


def pivot(rows, passes):
    """{(case key, impl): {pass: row}} of the rows of ``passes``, in first-seen order."""
    groups = {}
    for r in rows:
        if r["pass"] in passes:
            groups.setdefault((_case_key(r), r["impl"]), {})[r["pass"]] = r
    return groups


def add_ratios(rows):
    """Adds ``vs_sdpa_flash`` (TFLOP/s over SDPA flash's at the same case and pass) to every
    timed row, and ``speedup_vs_naive`` / ``memory_vs_naive`` (naive's time or peak memory
    over this row's) to fwd+bwd rows."""
    index = {(_case_key(r), r["pass"], r["impl"]): r for r in rows if "ms" in r}
    for (key, pass_, impl), r in index.items():
        flash = index.get((key, pass_, "sdpa_flash"))
        if flash is not None:
            r["vs_sdpa_flash"] = r["tflops"] / flash["tflops"]
        naive = index.get((key, pass_, "naive"))
        if pass_ == "fwdbwd" and naive is not None and impl != "naive":
            r["speedup_vs_naive"] = naive["ms"] / r["ms"]
            if r.get("peak_bytes") and "peak_bytes" in naive:
                r["memory_vs_naive"] = naive["peak_bytes"] / r["peak_bytes"]
    return rows


def _in_flash_target(row):
    lo, hi = TARGET_VS_FLASH_SEQLENS
    return (row["impl"] == "cupyflash" and row["pattern"] == "dense"
            and row["pass"] in ("fwd", "bwd") and row["headdim"] in TARGET_VS_FLASH_HEADDIMS
            and lo <= row["seqlen"] <= hi)


def _case_cells(key, sparse):
    pattern, dtype, d, _, _, seqlen, causal = key
    return ([pattern] if sparse else []) + [dtype, d, "yes" if causal else "no", seqlen]


def _case_header(groups):
    """(header cells of the case, whether a mask column is needed) of pivoted rows."""
    sparse = any(key[0] != "dense" for key, _ in groups)
    return (["mask"] if sparse else []) + ["dtype", "d", "causal", "seqlen"], sparse


def speed_table(rows):
    """fwd and bwd side by side per (case, implementation), ratios vs SDPA flash; ratios of
    ours below TARGET_VS_FLASH carry a '!' and are listed under the table."""
    groups = pivot(rows, ("fwd", "bwd"))
    if not groups:
        return ""
    header, sparse = _case_header(groups)
    header += ["impl", "fwd ms", "fwd TFLOP/s", "fwd/flash", "bwd ms", "bwd TFLOP/s",
               "bwd/flash", "note"]
    lines, below, checked = [], [], 0
    for (key, impl), by_pass in groups.items():
        _, dtype, d, _, _, seqlen, causal = key
        cells = _case_cells(key, sparse) + [impl]
        notes = []
        for p in ("fwd", "bwd"):
            r = by_pass.get(p, {})
            ratio = fmt(r.get("vs_sdpa_flash"), ".2f")
            if r and _in_flash_target(r):
                checked += 1
                if r.get("vs_sdpa_flash", TARGET_VS_FLASH) < TARGET_VS_FLASH:
                    ratio += "!"
                    below.append(f"{p} {dtype} d={d} {'causal' if causal else 'non-causal'} "
                                 f"seqlen={seqlen}: {r['vs_sdpa_flash']:.3f}x")
            cells += [fmt(r.get("ms"), ".3f"), fmt(r.get("tflops"), ".1f"), ratio]
            if r and row_status(r) and row_status(r) not in notes:
                notes.append(row_status(r))
        lines.append(cells + ["; ".join(notes)[:90]])
    out = [table_text(header, lines)]
    lo, hi = TARGET_VS_FLASH_SEQLENS
    target = (f"target: cupyflash fwd and bwd >= {TARGET_VS_FLASH:.1f}x SDPA flash for "
              f"d = {' and '.join(map(str, TARGET_VS_FLASH_HEADDIMS))}, seqlen {lo}..{hi}")
    if below:
        out.append(f"{target}; {len(below)} of {checked} cells below (marked !):")
        out += [f"  {b}" for b in below]
    elif checked:
        no_flash = sum(1 for by in groups.values() for r in by.values()
                       if _in_flash_target(r) and "vs_sdpa_flash" not in r)
        out.append(f"{target}: {checked - no_flash} of {checked} cells measured against SDPA "
                   f"flash, none below" + (f" ({no_flash} without an SDPA flash time)"
                                           if no_flash else ""))
    return "\n".join(out)


def memory_table(rows):
    """fwd+bwd time and peak memory per (case, implementation), ratios to naive, and the
    targets against naive."""
    groups = pivot(rows, ("fwdbwd",))
    if not groups:
        return ""
    header, sparse = _case_header(groups)
    header += ["impl", "fwd+bwd ms", "TFLOP/s", "peak MiB", "naive time / this",
               "naive memory / this", "note"]
    lines = []
    for (key, impl), by_pass in groups.items():
        r = by_pass["fwdbwd"]
        mib = r["peak_bytes"] / 2**20 if "peak_bytes" in r else None
        lines.append(_case_cells(key, sparse) + [
                      impl, fmt(r.get("ms"), ".3f"), fmt(r.get("tflops"), ".1f"), fmt(mib, ".0f"),
                      fmt(r.get("speedup_vs_naive"), ".2f"), fmt(r.get("memory_vs_naive"), ".1f"),
                      row_status(r)[:90]])
    out = [table_text(header, lines)]
    for (seqlen, goal), field, what in ((TARGET_SPEEDUP_VS_NAIVE, "speedup_vs_naive", "faster"),
                                        (TARGET_MEMORY_VS_NAIVE, "memory_vs_naive",
                                         "less peak memory")):
        hits = [by["fwdbwd"] for (key, impl), by in groups.items()
                if impl == "cupyflash" and key[0] == "dense" and key[5] == seqlen
                and field in by["fwdbwd"]]
        for r in hits:
            verdict = "met" if r[field] >= goal else "NOT met"
            out.append(f"target: cupyflash fwd+bwd {what} than naive by >= {goal:g}x at seqlen "
                       f"{seqlen} ({r['dtype']} d={r['headdim']}"
                       f"{' causal' if r['causal'] else ''}): {r[field]:.2f}x, {verdict}")
        if not hits:
            out.append(f"target: fwd+bwd {what} than naive by >= {goal:g}x at seqlen {seqlen}: "
                       f"not measured")
    return "\n".join(out)


def format_report(rows):
    """Both tables of the rows (those that have rows), ratios added."""
    add_ratios(rows)
    parts = [speed_table(rows), memory_table(rows)]
    return "\n\n".join(p for p in parts if p)


def plot(rows, path, title=""):
    """TFLOP/s against seqlen, one line per implementation: a forward and a backward panel per
    (dtype, head dim, causal) of the dense rows. Needs matplotlib."""
    plt = pyplot()
    rows = [r for r in rows if r["pattern"] == "dense" and "tflops" in r]
    configs = sorted({(r["dtype"], r["headdim"], r["causal"]) for r in rows
                      if r["pass"] in ("fwd", "bwd")})
    if not configs:
        raise ValueError("no timed forward or backward rows to plot")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(len(configs), 2, figsize=(11, 3.4 * len(configs)), squeeze=False)
    for i, (dtype, d, causal) in enumerate(configs):
        for j, pass_ in enumerate(("fwd", "bwd")):
            ax = axes[i][j]
            for impl in impls:
                pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                             if r["impl"] == impl and r["pass"] == pass_ and r["dtype"] == dtype
                             and r["headdim"] == d and r["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            seqlens = sorted({r["seqlen"] for r in rows if r["pass"] in ("fwd", "bwd")})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [f"{s // 1024}K" if s >= 1024 else str(s) for s in seqlens])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"{'forward' if pass_ == 'fwd' else 'backward'}, {dtype}, d={d}, "
                         f"{'causal' if causal else 'non-causal'}", fontsize=10)
            ax.set_xlabel("seqlen (batch x seqlen = 16K tokens)")
            ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    # Leave the suptitle its own band above the first row of panels.
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot on a file backend, or an error saying how to install it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(f"plotting needs matplotlib ({e}): pip install matplotlib, or "
                           f"pip install 'cupyflash[bench]'") from None
    return plt
