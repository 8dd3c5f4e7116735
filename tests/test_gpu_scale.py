"""Scale: a 1M-token causal forward and backward, and tensors past 2**31 elements.

- 1M tokens (batch 1, seqlen 2**20, 16 heads, head dim 128, bf16, causal): the seconds of the
  forward and the backward, and the peak of device memory in use during each (CuPy's pool,
  followed by a MemoryHook), which must stay within 1.1x of the buffers the call cannot do
  without. Sampled query rows of out, lse and dq, and the last keys' dk and dv (only the last
  queries see them), are checked against a float64 reference of just those rows.
- More than 2**31 elements in one tensor (where 32-bit element offsets would wrap): many
  batches of a short sequence, or one long key sequence; the results at the far end of the
  tensors (the last batches, the last heads, every key) against the float64 reference.

Inputs are drawn on the GPU (the host path of tests/reference.py would hold float64 copies of
tens of GiB); each element is an independent draw, so a wrapped offset reads values unlike
the right ones. Skipped where free device memory is too small. ``pytest -s`` prints the
figures; they are also junit properties.
"""
import math
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

import cupyflash as cf  # noqa: E402
from cupyflash import _launch  # noqa: E402

try:
    from gpu_checks import (BWD_FACTOR, DTYPES, FWD_FACTOR, Case, assert_lse,  # noqa: E402
                            check_backward, check_forward)
    from reference import (assert_rule, attention_naive, attention_naive_backward,  # noqa: E402
                           attention_ref, attention_ref_backward, round_to)
except ImportError:
    from tests.gpu_checks import (BWD_FACTOR, DTYPES, FWD_FACTOR, Case, assert_lse,  # noqa: E402
                                  check_backward, check_forward)
    from tests.reference import (assert_rule, attention_naive,  # noqa: E402
                                 attention_naive_backward, attention_ref, attention_ref_backward,
                                 round_to)

pytestmark = pytest.mark.gpu

GiB = 2**30
PEAK_LIMIT = 1.1                 # peak in use over the unavoidable buffers
# Device memory the float64 reference of one sampled chunk needs on top of the test's arrays
# (a few (rows, seqlen_k) float64 matrices and float64 copies of one head's K and V).
REFERENCE_BYTES = 14 * GiB
CHUNK = 2**26                    # elements per step of the input generation
LARGE_ALLOCATION = 256 * 2**20   # allocations listed with where they came from
SOURCE_DIRS = tuple(str(Path(__file__).resolve().parent.parent / d)
                    for d in ("cupyflash", "tests"))


def _nbytes(shape, dtype):
    return math.prod(shape) * np.dtype(dtype).itemsize


def _require_free(nbytes):
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    free = cp.cuda.Device().mem_info[0]
    if free < nbytes:
        pytest.skip(f"needs {nbytes / GiB:.1f} GiB of free device memory, {free / GiB:.1f} free")


def _random(shape, dtype, seed):
    """Standard-normal values in ``dtype``, drawn in float32 on the GPU in chunks and rounded
    to nearest even (bfloat16 on the bits: CuPy has no bfloat16 arithmetic)."""
    out = cp.empty(shape, dtype)
    flat = out.reshape(-1)
    bits = flat.view(cp.uint16) if dtype.name == "bfloat16" else None
    rng = cp.random.default_rng(seed)
    for start in range(0, flat.size, CHUNK):
        x = rng.standard_normal(min(CHUNK, flat.size - start), dtype=cp.float32)
        stop = start + x.size
        if bits is not None:
            bits[start:stop] = (round_to(x, "bfloat16").view(cp.uint32) >> 16).astype(cp.uint16)
        else:
            flat[start:stop] = x.astype(dtype)
    return out


class PeakInUse(cp.cuda.MemoryHook):
    """The high-water mark of CuPy's pool bytes in use while enabled, and every allocation of
    LARGE_ALLOCATION bytes or more with the line of our code that made it."""
    name = "cupyflash_test_peak_in_use"

    def __init__(self):
        super().__init__()
        self.pool = cp.get_default_memory_pool()
        self.peak = self.pool.used_bytes()
        self.large = []

    def malloc_postprocess(self, **kw):
        self.peak = max(self.peak, self.pool.used_bytes())
        if kw["mem_size"] >= LARGE_ALLOCATION:
            ours = [f for f in traceback.extract_stack()[:-1]
                    if f.filename.startswith(SOURCE_DIRS)]
            where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {ours[-1].line}" \
                if ours else "?"
            self.large.append((kw["mem_size"], where))


def _measure(fn):
    """(result, seconds, peak bytes in use, large allocations) of ``fn()``."""
    cp.cuda.Device().synchronize()
    hook = PeakInUse()
    t0 = time.perf_counter()
    with hook:
        result = fn()
        cp.cuda.Device().synchronize()
    return result, time.perf_counter() - t0, hook.peak, hook.large


def _assert_all(checks):
    """Run every check, then fail with all their messages (one failing check does not hide
    the state of the others)."""
    failures = []
    for check in checks:
        try:
            check()
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


def _report(record_property, name, value):
    record_property(name, value)
    print(f"{name}: {value}")


# --- 1M tokens -------------------------------------------------------------------------------

N_TOKENS, N_HEADS, HEAD_DIM = 2**20, 16, 128
SAMPLED_HEADS = (0, 7, 8, 15)        # both halves of the heads
SAMPLED_ROWS = {"start": range(0, 64),
                "middle": range(N_TOKENS // 2 - 32, N_TOKENS // 2 + 32),
                "end": range(N_TOKENS - 128, N_TOKENS)}   # their keys' dk/dv are checked too


def _reference_rows(q, k, v, dout, head, rows, scale, dtype):
    """float64 reference and naive same-dtype results for query ``rows`` (a range) of one
    head, causal with seqlen_q == seqlen_k: the rows see keys ``j <= row``. dk and dv are
    returned for the keys from rows.start on: only these rows see those keys."""
    keys = rows.stop
    sel = (slice(None), slice(rows.start, rows.stop), slice(head, head + 1))
    kv = (slice(None), slice(0, keys), slice(head, head + 1))
    args = (q[sel], k[kv], v[kv])
    visible = (cp.arange(keys)[None, :] <= cp.arange(rows.start, rows.stop)[:, None])[None]
    ref_out, ref_lse = attention_ref(*args, scale, False, mask=visible)
    naive_out, _ = attention_naive(*args, scale, False, dtype, mask=visible)
    refs = attention_ref_backward(dout[sel], *args, scale, False, mask=visible)
    naives = attention_naive_backward(dout[sel], *args, scale, False, dtype, mask=visible)
    tail = (slice(None), slice(rows.start, keys))
    return ((ref_out, naive_out), ref_lse, (refs[0], naives[0]),
            [(r[tail], n[tail]) for r, n in zip(refs[1:], naives[1:])])


def _check_sampled(q, k, v, dout, out, lse, grads, scale):
    """The sampled rows of out, lse, dq (and dk, dv of the last keys) against the reference,
    by the tolerance rule over all samples together."""
    dq, dk, dv = grads
    got = {n: [] for n in ("out", "lse", "dq", "dk", "dv")}
    ref = {n: [] for n in got}
    naive = {n: [] for n in got}
    for head in SAMPLED_HEADS:
        for label, rows in SAMPLED_ROWS.items():
            sel = (0, slice(rows.start, rows.stop), head)
            (r_out, n_out), r_lse, (r_dq, n_dq), tails = _reference_rows(
                q, k, v, dout, head, rows, scale, q.dtype)
            for name, g, r, n in (("out", out[sel], r_out, n_out), ("dq", dq[sel], r_dq, n_dq)):
                got[name].append(g.astype(cp.float64))
                ref[name].append(r[0, :, 0])
                naive[name].append(n[0, :, 0])
            got["lse"].append(lse[0, head, rows.start:rows.stop])
            ref["lse"].append(r_lse[0, 0])
            if label == "end":
                for name, g, (r, n) in zip(("dk", "dv"), (dk, dv), tails):
                    got[name].append(g[sel].astype(cp.float64))
                    ref[name].append(r[0, :, 0])
                    naive[name].append(n[0, :, 0])
    cat = {n: (cp.concatenate(got[n]), cp.concatenate(ref[n]),
               cp.concatenate(naive[n]) if naive[n] else None) for n in got}
    magnitude = max(float(cp.abs(cat[n][1]).max()) for n in ("dq", "dk", "dv"))
    _assert_all([lambda: assert_rule("out", *cat["out"], FWD_FACTOR),
                 lambda: assert_lse(cat["lse"][0], cat["lse"][1], "bf16")]
                + [lambda n=name: assert_rule(n, *cat[n], BWD_FACTOR, magnitude)
                   for name in ("dq", "dk", "dv")])


def test_million_token_causal_forward_backward(record_property):
    shape = (1, N_TOKENS, N_HEADS, HEAD_DIM)
    dtype = DTYPES["bf16"]
    lse_shape = (1, N_HEADS, N_TOKENS)
    tensor = _nbytes(shape, dtype)
    lse_bytes = _nbytes(lse_shape, np.float32)
    fwd_needs = 5 * tensor + lse_bytes                  # q, k, v, dout; out, lse
    bwd_needs = (fwd_needs + 3 * tensor                 # dq, dk, dv
                 + _nbytes(_launch.dq_accum_shape(shape), np.float32)
                 + 2 * lse_bytes)                       # D and lse in log2 units
    _require_free(bwd_needs + REFERENCE_BYTES)
    scale = HEAD_DIM ** -0.5

    # The same instantiations on a small input: the timed calls do not compile.
    small = [_random((1, 256, N_HEADS, HEAD_DIM), dtype, s) for s in range(4)]
    o, l = cf.flash_attention(*small[:3], causal=True, return_lse=True)
    cf.flash_attention_backward(small[3], *small[:3], o, l, causal=True)
    del small, o, l
    base = cp.get_default_memory_pool().used_bytes()

    q, k, v, dout = (_random(shape, dtype, seed) for seed in (1, 2, 3, 4))
    cp.get_default_memory_pool().free_all_blocks()     # the generation's chunks
    (out, lse), fwd_s, fwd_peak, fwd_large = _measure(
        lambda: cf.flash_attention(q, k, v, causal=True, return_lse=True))
    grads, bwd_s, bwd_peak, bwd_large = _measure(
        lambda: cf.flash_attention_backward(dout, q, k, v, out, lse, causal=True))
    fwd_peak -= base
    bwd_peak -= base
    # What the whole process holds at this point (CUDA context, modules, the pool's cached
    # blocks included), as nvidia-smi would show it.
    free, total = cp.cuda.Device().mem_info
    pool_held = cp.get_default_memory_pool().total_bytes()

    flops = 4 * N_HEADS * N_TOKENS**2 * HEAD_DIM / 2
    _report(record_property, "million_fwd_seconds", round(fwd_s, 3))
    _report(record_property, "million_bwd_seconds", round(bwd_s, 3))
    _report(record_property, "million_fwd_tflops", round(flops / fwd_s / 1e12, 1))
    _report(record_property, "million_bwd_tflops", round(2.5 * flops / bwd_s / 1e12, 1))
    _report(record_property, "million_fwd_peak_gib", round(fwd_peak / GiB, 3))
    _report(record_property, "million_fwd_unavoidable_gib", round(fwd_needs / GiB, 3))
    _report(record_property, "million_bwd_peak_gib", round(bwd_peak / GiB, 3))
    _report(record_property, "million_bwd_unavoidable_gib", round(bwd_needs / GiB, 3))
    _report(record_property, "million_pool_held_gib", round(pool_held / GiB, 3))
    _report(record_property, "million_device_used_gib", round((total - free) / GiB, 3))
    for label, large in (("forward", fwd_large), ("backward", bwd_large)):
        for size, where in large:
            print(f"  {label} allocation {size / GiB:.3f} GiB at {where}")

    assert fwd_peak <= PEAK_LIMIT * fwd_needs, \
        f"forward peak {fwd_peak / GiB:.2f} GiB > {PEAK_LIMIT} x {fwd_needs / GiB:.2f} GiB"
    assert bwd_peak <= PEAK_LIMIT * bwd_needs, \
        f"backward peak {bwd_peak / GiB:.2f} GiB > {PEAK_LIMIT} x {bwd_needs / GiB:.2f} GiB"
    _check_sampled(q, k, v, dout, out, lse, grads, scale)


# --- past 2**31 elements ---------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    case: Case                 # the whole call
    checked: tuple             # (batch slice, head slice) pairs checked against the reference
    reference_bytes: int       # device memory the reference of one checked pair needs


LAYOUTS = {
    # q, k, v, out, dq, dk, dv and dq_accum each past 2**31 elements through the batch offset.
    "batches": Layout(Case("bf16", 1024, 1024, 128, True, batch=1032, nheads=16, nheads_k=16),
                      ((slice(0, 1), slice(None)), (slice(1030, 1032), slice(None))),
                      4 * GiB),
    # k, v, dk, dv past 2**31 elements through the row offset of one batch and head; every key
    # of the first and last head is checked (float64 copies of 2M keys, 100 x 2M scores).
    "long_keys": Layout(Case("bf16", 100, 2**21 + 1000, 128, False, batch=1, nheads=8,
                             nheads_k=8),
                        ((slice(None), slice(0, 1)), (slice(None), slice(7, 8))),
                        20 * GiB),
}


def _required_bytes(layout):
    case = layout.case
    shape_q = (case.batch, case.sq, case.nheads, case.d)
    shape_kv = (case.batch, case.sk, case.nheads_k, case.d)
    dtype = DTYPES[case.dtype]
    arrays = 4 * _nbytes(shape_q, dtype) + 4 * _nbytes(shape_kv, dtype)
    accum = _nbytes(_launch.dq_accum_shape(shape_q), np.float32)
    return arrays + accum + layout.reference_bytes


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensors_past_2_31_elements(layout, deterministic, record_property):
    case, checked = LAYOUTS[layout].case, LAYOUTS[layout].checked
    shape_q = (case.batch, case.sq, case.nheads, case.d)
    shape_kv = (case.batch, case.sk, case.nheads_k, case.d)
    assert max(math.prod(shape_q), math.prod(shape_kv)) > 2**31
    _require_free(_required_bytes(LAYOUTS[layout]))
    dtype = DTYPES[case.dtype]
    seed = 100 * list(LAYOUTS).index(layout)
    q, dout = _random(shape_q, dtype, seed), _random(shape_q, dtype, seed + 1)
    k, v = _random(shape_kv, dtype, seed + 2), _random(shape_kv, dtype, seed + 3)
    scale = case.d ** -0.5
    t0 = time.perf_counter()
    out, lse = cf.flash_attention(q, k, v, causal=case.causal, softmax_scale=scale,
                                  return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=case.causal,
                                        softmax_scale=scale, deterministic=deterministic)
    cp.cuda.Device().synchronize()
    _report(record_property, f"{layout}_{'det' if deterministic else 'atomic'}_seconds",
            round(time.perf_counter() - t0, 3))
    checks = []
    for b, h in checked:
        # The checks compare whole arrays: slice everything to the checked part.
        part = Case(case.dtype, case.sq, case.sk, case.d, case.causal,
                    batch=len(range(case.batch)[b]), nheads=len(range(case.nheads)[h]),
                    nheads_k=len(range(case.nheads_k)[h]))
        pq, pk, pv, pdout, pout = (a[b, :, h] for a in (q, k, v, dout, out))
        pgrads = tuple(g[b, :, h] for g in grads)
        checks += [lambda a=(part, pq, pk, pv, pout, lse[b, h]): check_forward(*a, scale),
                   lambda a=(part, pdout, pq, pk, pv, pgrads): check_backward(*a, scale)]
    _assert_all(checks)
