"""The variants' speed targets (issue 15, Part 2), measured in one run, bf16, head dim 128:

    python benchmarks/bench_variants.py --out DIR [--seqlen 8192] [--window-seqlen 32768]
                                        [--parts ours flex window fa4] [--reps 20]
                                        [--kernels generic|auto] [--rules RULE ...]

- Score modifiers, at ``--seqlen`` (16K tokens, 16 heads), causal and not, forward and
  backward: ours plain, ``softcap=30``, ALiBi (ALiBi's geometric slopes), both, and
  ``dropout_p=0.1``. Targets: softcap and ALiBi <= 1.10 x ours plain of the same causal flag
  and pass, dropout <= 1.25 x.
- FlexAttention (torch.compile(flex_attention)) on the same rules beside ours: plain, softcap,
  ALiBi, a T5-style relative-position bias (a table of 2 * 128 - 1 buckets, also learned:
  relative_bias_dtable, its gradient part of the backward), a document
  mask (8 documents of random lengths, causal inside each) and prefix-LM (a 1024-token
  prefix seen by every query, then causal); ours runs the last three as user mods
  (``cupyflash.ScoreMod`` / ``MaskMod``, the block masks built once by ``from_mask_mod``; the
  relative bias with and without the table's gradient).
- FlashAttention-4 (``--parts fa4``, where ``flash_attn.cute`` imports: benchmarks/fa4_wheels.sh)
  on the rules it has built in: plain and ``softcap=30`` beside ours, and the window against its
  own dense causal; and ALiBi as its own user score_mod (``fa4_alibi_mods``: slopes (h + 1) / 32,
  no table). Its ratios are written as ``peer_ratios`` (our targets measured on a peer).
- User mods spelling built-ins: ALiBi as a score_mod, and causal as a mask_mod (not causal
  calls with its block mask). Target: within 1.05 x the built-in of the same pass.
- Window: ``window_size=(1024, 0)`` (a sliding window over the past 1024 keys, the causal side
  closed) at ``--window-seqlen`` (batch 1, 16 heads) against dense causal at the same shape.
  Target: time <= 1.3 x the dense causal time x (visible elements of the window / visible
  elements of causal), both counted exactly.

Our rows run the generic kernels unless ``--kernels auto``: on sm_90 the Hopper forward
covers plain attention only so far, and each variant is measured against plain attention on
the same kernels. Every row times the median over calls on rotating input sets
(cupyflash.bench). Writes
DIR/variants_targets.json and prints the table with the ratios last.
"""
import argparse
import os
from pathlib import Path

import numpy as np

import cupyflash as cf
from cupyflash import bench
from cupyflash.bench.cases import cp
from cupyflash.bench.peers import Fa4, _TorchRunner, flex

HEADDIM, SOFTCAP, PREFIX, DOCUMENTS, WINDOW = 128, 30.0, 1024, 8, (1024, 0)
MOD_TARGET, DROPOUT_TARGET, WINDOW_TARGET, USER_TARGET = 1.10, 1.25, 1.3, 1.05
BUCKETS = 127   # relative bias: distances clamped to [-127, 127]
DROPOUT_P = 0.1


def alibi_slopes(nheads):
    """ALiBi's geometric slopes 2^(-8 h / nheads), h = 1..nheads."""
    return 2.0 ** (-8.0 * np.arange(1, nheads + 1) / nheads)


def document_ids(seqlen, seed=0):
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, seqlen), DOCUMENTS - 1,
                                                      replace=False))
    return np.repeat(np.arange(DOCUMENTS), np.diff(np.concatenate([[0], cuts, [seqlen]])))


class OursWith(bench.Ours):
    """Ours with the variant keywords of one rule (a user mask_mod's block mask as the mask)."""

    def __init__(self, case, sets32, rule, **keywords):
        super().__init__(case, sets32)
        self.mask = keywords.pop("block_mask", self.mask)
        self.deterministic = keywords.pop("deterministic", False)   # the backward's mode alone
        self.rule, self.keywords = rule, keywords

    def forward(self, s):
        return cf.flash_attention(s[0], s[1], s[2], causal=self.case.causal, block_mask=self.mask,
                                  return_lse=True, **self.keywords)

    def backward(self, s, saved):
        return cf.flash_attention_backward(s[3], s[0], s[1], s[2], saved[0], saved[1],
                                           causal=self.case.causal, block_mask=self.mask,
                                           deterministic=self.deterministic, **self.keywords)


class FlexWith(_TorchRunner):
    """torch.compile(flex_attention) with the score_mod / block mask of one rule."""
    impl = "flex"

    def __init__(self, case, sets32, rule):
        self.flex = flex()
        super().__init__(case, sets32)
        torch, fa, n, h = self.torch, self.flex.fa, case.seqlen, case.nheads
        self.rule, self.score_mod, self.block_mask, self.tables = rule, None, None, ()
        if case.causal or rule in ("document", "prefix_lm"):
            doc = torch.from_numpy(document_ids(n)).cuda()

            def mask_mod(b, hh, q, kv):
                if rule == "document":
                    return (doc[q] == doc[kv]) & (q >= kv)
                if rule == "prefix_lm":
                    return (q >= kv) | (kv < PREFIX)
                return q >= kv
            self.block_mask = fa.create_block_mask(mask_mod, None, None, n, n, device="cuda")
        if rule == "softcap":
            def score_mod(s, b, hh, q, kv):
                return SOFTCAP * torch.tanh(s / SOFTCAP)
            self.score_mod = score_mod
        elif rule == "alibi":
            slopes = torch.from_numpy(alibi_slopes(h).astype(np.float32)).cuda()

            def score_mod(s, b, hh, q, kv):
                return s - slopes[hh] * (q - kv).abs()
            self.score_mod = score_mod
        elif rule.startswith("relative_bias"):
            # relative_bias_dtable: the table learned, its gradient part of the backward.
            table = torch.randn(2 * 128 - 1, h, device="cuda", dtype=torch.float32,
                                requires_grad=rule.endswith("dtable"))
            self.tables = (table,) if table.requires_grad else ()

            def score_mod(s, b, hh, q, kv):
                return s + table[(q - kv).clamp(-127, 127) + 127, hh]
            self.score_mod = score_mod

    def forward(self, s):
        return (self.flex.attend(s[0], s[1], s[2], score_mod=self.score_mod,
                                 block_mask=self.block_mask),)

    def backward(self, s, saved):
        return self.torch.autograd.grad(saved[0], (*s[:3], *self.tables), s[3],
                                        retain_graph=True)


def visible_fraction(seqlen, window):
    """Visible elements of (seqlen x seqlen) under a band, over seqlen^2."""
    i = np.arange(seqlen)
    left, right = window
    lo = np.zeros(seqlen) if left < 0 else np.maximum(i - left, 0)
    hi = np.full(seqlen, seqlen - 1) if right < 0 else np.minimum(i + right, seqlen - 1)
    return float(np.maximum(hi - lo + 1, 0).sum()) / seqlen ** 2


def ours_keywords(rule, nheads, seqlen=None):
    if "+" in rule:   # for ab_trees.py's cells: rules together (a score_mod with a mask_mod)
        return {k: v for r in rule.split("+") for k, v in ours_keywords(r, nheads, seqlen).items()}
    if rule in USER_RULES:
        return user_keywords(rule, nheads, seqlen)
    if rule == "softcap":
        return dict(softcap=SOFTCAP)
    if rule == "alibi":
        return dict(alibi_slopes=cp.asarray(alibi_slopes(nheads), cp.float32))
    if rule == "softcap_alibi":
        return dict(softcap=SOFTCAP, alibi_slopes=cp.asarray(alibi_slopes(nheads), cp.float32))
    if rule == "dropout":
        return dict(dropout_p=DROPOUT_P, seed=0)
    if rule == "deterministic":   # the backward's mode, for ab_trees.py's cells
        return dict(deterministic=True)
    if rule == "window":   # for ab_trees.py's cells; the window part here builds its own calls
        return dict(window_size=WINDOW)
    if rule == "t5_offset":   # for ab_trees.py's cells: the README's relative bias, unclamped offsets
        bias = cp.random.standard_normal((nheads, 2 * seqlen), dtype=cp.float32)
        return dict(score_mod=cf.ScoreMod(f"score + bias[bias.offset(h, kv_idx - q_idx + {seqlen})]",
                                          grad="dscore", arrays={"bias": bias}))
    if rule.startswith("window_"):   # window_LEFT_RIGHT, for ab_trees.py's cells
        return dict(window_size=tuple(int(x) for x in rule.split("_")[1:]))
    return {}


FLEX_RULES = ("plain", "softcap", "alibi", "relative_bias", "relative_bias_dtable")
USER_RULES = ("user_alibi", "user_causal", "relative_bias", "relative_bias_dtable", "document",
              "prefix_lm")


def user_keywords(rule, nheads, seqlen):
    """Ours' keywords for the rules written as user mods (the same rules as FlexWith's)."""
    if rule == "user_alibi":
        slopes = cp.asarray(alibi_slopes(nheads), cp.float32)
        return dict(score_mod=cf.ScoreMod(
            "score - slopes[h] * fabsf((float)(q_idx - kv_idx))", grad="dscore",
            arrays={"slopes": slopes}))
    if rule.startswith("relative_bias"):
        table = cp.random.standard_normal((2 * BUCKETS + 1, nheads), dtype=cp.float32)
        at = f"min(max(q_idx - kv_idx, -{BUCKETS}), {BUCKETS}) + {BUCKETS}, h"
        dtable = rule.endswith("dtable")
        grad = f"d_table.add(table.offset({at}), dscore);\nreturn dscore;" if dtable \
            else "dscore"
        return dict(score_mod=cf.ScoreMod(f"score + table({at})", grad=grad,
                                          arrays={"table": table},
                                          grad_arrays=("table",) if dtable else ()))
    rules = {"user_causal": "kv_idx <= q_idx",
             "document": "doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx",
             "prefix_lm": f"kv_idx <= q_idx || kv_idx < {PREFIX}"}
    arrays = {"doc": cp.asarray(document_ids(seqlen), cp.int32)} if rule == "document" else {}
    mask = cf.MaskMod(rules[rule], arrays=arrays)
    return dict(block_mask=cf.masks.from_mask_mod(mask, seqlen, seqlen))


def timed(runner, passes, reps, label, rows):
    for pass_ in passes:
        try:
            row = bench.measure(runner, pass_, reps, memory=False)
        except Exception as e:
            row = bench.failed_row(runner.case, runner.impl, pass_, e)
        row["rule"] = label
        rows.append(row)
        print(bench.progress_line(row), label, flush=True)


def fa4_alibi_mods():
    """FlashAttention-4's score_mod and its gradient for ALiBi, written in NVIDIA's CuTe DSL
    (FA4 compiles them into its kernels): score - slope_h |q - kv| with slope_h = (h + 1) / 32,
    a slope per head without a table (the geometric slopes would need an exponential per score
    or an aux tensor); the score's gradient passes through."""
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def alibi(score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        slope = (head_idx + 1).to(cutlass.Float32) * (1.0 / 32)
        return score - slope * cute.math.abs((q_idx - kv_idx).to(cutlass.Float32))

    @cute.jit
    def alibi_bwd(grad, score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    return dict(score_mod=alibi, score_mod_bwd=alibi_bwd)


def fa4_keywords(rule):
    if rule == "softcap":
        return dict(softcap=SOFTCAP)
    return fa4_alibi_mods() if rule == "user_alibi" else {}


def timed_peer(make, impl, case, rule, passes, reps, rows):
    """Time a peer's runner made by ``make()``; a peer that cannot run leaves failed rows."""
    try:
        runner = make()
    except Exception as e:
        rows += [dict(bench.failed_row(case, impl, p, e), rule=rule) for p in passes]
        return
    timed(runner, passes, reps, rule, rows)
    del runner
    bench.release_memory()


def timed_flex(case, sets, rule, passes, reps, rows):
    timed_peer(lambda: FlexWith(case, sets, rule), "flex", case, rule, passes, reps, rows)


def timed_fa4(case, sets, rule, passes, reps, rows, **keywords):
    timed_peer(lambda: Fa4(case, sets, **keywords), "fa4", case, rule, passes, reps, rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--window-seqlen", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--parts", nargs="+", default=["ours", "flex", "window"],
                    help="ours: our modifiers; flex: FlexAttention's rules; window: the window; "
                         "fa4: FlashAttention-4's plain, softcap, ALiBi score_mod and window")
    ap.add_argument("--rules", nargs="+", help="time only these rules (default: every one)")
    ap.add_argument("--kernels", choices=("generic", "auto"), default="generic",
                    help="CUPYFLASH_KERNELS for our calls; generic (the default) times every row "
                         "on the same kernels: the Hopper forward covers plain attention only")
    args = ap.parse_args()
    os.environ["CUPYFLASH_KERNELS"] = args.kernels
    ours, use_flex, use_fa4 = ("ours" in args.parts, "flex" in args.parts,
                               "fa4" in args.parts)

    def chosen(rules):
        return tuple(r for r in rules if args.rules is None or r in args.rules)

    passes = ("fwd", "bwd")
    rows = []

    for causal in (False, True):
        case = bench.Case.dense(args.seqlen, HEADDIM, causal)
        sets = bench.input_sets(case)
        for rule in chosen(("plain", "softcap", "alibi", "softcap_alibi", "dropout")) if ours else ():
            timed(OursWith(case, sets, rule, **ours_keywords(rule, case.nheads)), passes,
                  args.reps, rule, rows)
        for rule in chosen(("user_alibi", "relative_bias", "relative_bias_dtable")) if ours else ():
            timed(OursWith(case, sets, rule, **ours_keywords(rule, case.nheads, case.seqlen)),
                  passes, args.reps, rule, rows)
        for rule in chosen(FLEX_RULES) if use_flex else ():
            timed_flex(case, sets, rule, passes, args.reps, rows)
        for rule in chosen(("plain", "softcap", "user_alibi")) if use_fa4 else ():
            timed_fa4(case, sets, rule, passes, args.reps, rows, **fa4_keywords(rule))
        del sets
        bench.release_memory()

    # Mask rules (the call not causal: the rule says what is seen).
    case = bench.Case.dense(args.seqlen, HEADDIM, False)
    sets = bench.input_sets(case)
    for rule in chosen(("user_causal", "document", "prefix_lm")) if ours else ():
        timed(OursWith(case, sets, rule, **ours_keywords(rule, case.nheads, case.seqlen)),
              passes, args.reps, rule, rows)
    for rule in chosen(("document", "prefix_lm")) if use_flex else ():
        timed_flex(case, sets, rule, passes, args.reps, rows)
    del sets
    bench.release_memory()

    # Window against dense causal at the window's seqlen.
    share = visible_fraction(args.window_seqlen, WINDOW) / visible_fraction(args.window_seqlen,
                                                                            (-1, 0))
    if "window" in args.parts:
        wcase = bench.Case.dense(args.window_seqlen, HEADDIM, True)
        sets = bench.input_sets(wcase)
        timed(OursWith(wcase, sets, "plain"), passes, args.reps, "causal", rows)
        timed(OursWith(wcase, sets, "window", window_size=WINDOW), passes, args.reps,
              f"window{WINDOW}", rows)
        if use_fa4:
            timed_fa4(wcase, sets, "causal", passes, args.reps, rows)
            timed_fa4(wcase, sets, f"window{WINDOW}", passes, args.reps, rows, window_size=WINDOW)
        del sets
        bench.release_memory()

    ratios, peer_ratios = target_ratios(rows, share), target_ratios(rows, share, "fa4")
    bench.write_json(Path(args.out) / "variants_targets.json",
                     bench.report("variants_targets", rows, ratios=ratios, window_share=share,
                                  parts=args.parts, peer_ratios=peer_ratios))
    print("\n=== variants ===")
    for r in rows:
        val = (f"{r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s" if "ms" in r
               else (r.get("error") or r.get("skipped", ""))[:70])
        print(f"{r['impl']:<10} {r['rule']:<16} s={r['seqlen']:<6} causal={r['causal']!s:<5} "
              f"{r['pass']:<4} {val}")
    print("\n=== targets ===")
    for r in ratios:
        print(f"{r['what']:<44} {r['ratio']:6.3f}  target <= {r['target']:.2f}  "
              f"{'ok' if r['ratio'] <= r['target'] else 'BELOW TARGET'}")
    if peer_ratios:
        print("\n=== the same ratios, FlashAttention-4 ===")
        for r in peer_ratios:
            print(f"{r['what']:<44} {r['ratio']:6.3f}")


def target_ratios(rows, share, impl_of="cupyflash"):
    """One implementation's (ours unless said) time of each modifier over its plain time, and
    of the window over share x its causal time."""
    ms = {(r["impl"], r["rule"], r["causal"], r["pass"]): r["ms"] for r in rows if "ms" in r}
    out = []
    for (impl, rule, causal, pass_), t in ms.items():
        if impl != impl_of:
            continue
        # A user score_mod over plain too: the issue's own rule (its built-in below is stricter).
        if (rule in ("softcap", "alibi", "softcap_alibi", "dropout", "user_alibi")
                and (impl, "plain", causal, pass_) in ms):
            out.append(dict(what=f"{rule} causal={causal} {pass_} / plain",
                            target=DROPOUT_TARGET if rule == "dropout" else MOD_TARGET,
                            ratio=t / ms[impl, "plain", causal, pass_]))
        builtin = {"user_alibi": ("alibi", causal), "user_causal": ("plain", True)}.get(rule)
        if builtin and (impl, *builtin, pass_) in ms:
            out.append(dict(what=f"{rule} causal={causal} {pass_} / built-in {builtin[0]}",
                            target=USER_TARGET, ratio=t / ms[(impl, *builtin, pass_)]))
        if rule.startswith("window") and (impl, "causal", causal, pass_) in ms:
            out.append(dict(what=f"{rule} {pass_} / (share x causal)", target=WINDOW_TARGET,
                            ratio=t / (share * ms[impl, "causal", causal, pass_])))
    return out


if __name__ == "__main__":
    main()
