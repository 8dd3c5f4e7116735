"""Every kernel instantiation the config table can pick compiles through NVRTC with no local
memory: no register spills and no stack frame. Complete for sm_80 and sm_90 (with the Hopper
kernels of cuda/fwd_sm90.cu and cuda/bwd_sm90.cu, for sm_90a, and the decode kernels of
cuda/decode.cu); for sm_86 (99 KB
of shared memory) only the smaller tiles that sm_80 never picks: the two have the same register
file, and on the instantiations both pick ptxas's register counts stay close (within 22 with
NVRTC 13.5, none spilling on either).

NVRTC needs no GPU, so this runs in CI. The compiles run in parallel, one process per core,
in pieces of a few instantiations; deselect them with ``-m "not compile"``."""
import concurrent.futures
import dataclasses
import multiprocessing
import os

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash import _compile, _config, _launch  # noqa: E402
from cupyflash._compile import nvrtc_compile  # noqa: E402
from cupyflash._launch import kernel_names  # noqa: E402

pytestmark = pytest.mark.compile

ARCHS = ("sm_80", "sm_90", "sm_86")
FILES = ("fwd.cu", "bwd.cu", "generic.cu", "fwd_sm90.cu", "bwd_sm90.cu", "decode.cu")
# Instantiations per NVRTC program: small pieces keep every core busy to the end, and parsing
# the source again for each piece costs little beside ptxas's work on the kernels.
PIECE = 4


def names_to_check(arch, filename):
    """The instantiations of ``filename`` to compile for ``arch``; the Hopper kernels' files
    (``_compile.ARCH_SPECIFIC``) under sm_90, compiled for their own target (sm_90a)."""
    names = kernel_names(_config.SMEM_LIMIT[int(arch[3:])], hopper=arch == "sm_90")[filename]
    if arch == "sm_86":
        on_sm80 = set(kernel_names(_config.SMEM_LIMIT[80])[filename])
        names = [n for n in names if n not in on_sm80]
    return names


CASES = [(arch, f) for arch in ARCHS for f in FILES if names_to_check(arch, f)]

# A local array indexed at run time lives on the stack: ptxas reports a stack frame and no
# spills. The __noinline__ function gets a block of ptxas figures of its own, printed after
# those of each kernel that calls it.
STACK_PROBE = r"""
__device__ __noinline__ float scatter_sum(const float* in, int i) {
    float a[64];
    for (int j = 0; j < 64; ++j) a[j] = in[j];
    for (int j = 0; j < 64; ++j) a[(j * i) % 64] += 1.f;
    float s = 0.f;
    for (int j = 0; j < 64; ++j) s += a[j] * j;
    return s;
}
__global__ void stack_kernel(float* out, int i) {
    float a[64];
    for (int j = 0; j < 64; ++j) a[j] = out[j];
    for (int j = 0; j < 64; ++j) a[(j * i) % 64] += 1.f;
    for (int j = 0; j < 64; ++j) out[j] = a[j];
}
__global__ void callee_stack_kernel(float* out, int i) { out[0] = scatter_sum(out, i); }
__global__ void register_kernel(float* out) { out[0] = 1.f; }
"""


def local_memory(stats):
    """The instantiations of ``stats`` (nvrtc_compile's) with spill stores or loads or a
    stack frame."""
    return {n: s for n, s in stats.items() if any(s[1:])}


@pytest.fixture(scope="session")
def ptxas_stats(request):
    """{(arch, filename): (stats by name, compile errors)} for the cases selected in this
    session, all compiled at once across a pool of processes."""
    cases = [tuple(item.callspec.params[p] for p in ("arch", "filename"))
             for item in request.session.items
             if getattr(item, "function", None) is test_compiles_without_local_memory]
    pieces = [(case, names[i:i + PIECE]) for case in cases
              for names in [names_to_check(*case)] for i in range(0, len(names), PIECE)]
    results = {case: ({}, []) for case in cases}
    # spawn: this process may hold a CUDA context already, which a forked child must not use.
    with concurrent.futures.ProcessPoolExecutor(
            max_workers=min(os.cpu_count() or 1, len(pieces)),
            mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(nvrtc_compile, filename, names,
                               _compile.ARCH_SPECIFIC.get(filename, arch)): (arch, filename)
                   for (arch, filename), names in pieces}
        for future in concurrent.futures.as_completed(futures):
            stats, errors = results[futures[future]]
            try:
                stats.update(future.result())
            except RuntimeError as e:
                errors.append(str(e))
    return results


@pytest.mark.parametrize("arch,filename", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_compiles_without_local_memory(ptxas_stats, arch, filename):
    stats, errors = ptxas_stats[arch, filename]
    assert not errors, "\n".join(errors)
    names = names_to_check(arch, filename)
    assert set(stats) == set(names), f"ptxas reported no figures for {set(names) - set(stats)}"
    local = local_memory(stats)
    assert not local, ("local memory (registers, spill store bytes, spill load bytes, stack "
                       f"frame bytes) on {arch}: {local}")


def test_a_stack_frame_is_local_memory(monkeypatch):
    monkeypatch.setattr(_compile, "source", lambda filename, user_mods="": STACK_PROBE)
    names = ["stack_kernel", "callee_stack_kernel", "register_kernel"]
    stats = nvrtc_compile("probe.cu", names, "sm_80")
    assert set(stats) == set(names)
    assert set(local_memory(stats)) == {"stack_kernel", "callee_stack_kernel"}, stats


# A register of wgmma's accumulators written on a divergent path before the product: ptxas
# makes every wgmma of the kernel wait for the previous one, and says so only in its log.
SERIAL_PROBE = r"""
__global__ void serial_probe(float* out, unsigned long long a, unsigned long long b) {
    float d[32];
    for (int i = 0; i < 32; ++i) d[i] = out[i];
    if (threadIdx.x % 2) {
        d[0] += 1.f;
        wgmma_ss<bf16>(d, a, b, true);
    }
    wgmma_commit();
    wgmma_wait<0>();
    for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}
"""


def test_serialized_wgmma_fails_the_compile_check(monkeypatch):
    pieces = _compile.source("sm90.cuh")
    monkeypatch.setattr(_compile, "source", lambda filename, user_mods="": pieces + SERIAL_PROBE)
    with pytest.raises(RuntimeError, match="serialized wgmma"):
        nvrtc_compile("probe.cu", ["serial_probe"], "sm_90a")


# User mods: kernels with a snippet are compiled per snippet at run time (their tile is the
# largest without local memory, checked then); the table's "user" tiles, their fallback, must
# compile clean for the README's kind of rules: a relative-position bias with its table's
# gradient, and a document mask (alone too: the Hopper kernels then make its verdicts beside
# the products, in registers of their own).
def _user_mod_names(score, mask, arch):
    import numpy as np
    from cupyflash import _spec, mods
    from cupyflash._compile import template_name
    bias, doc = np.zeros((16, 1024), np.float32), np.zeros(64, np.int32)
    at = "bias.offset(h, kv_idx - q_idx + 512)"
    sm = mods.ScoreMod(f"score + bias[{at}]", grad=f"d_bias.add({at}, dscore);\nreturn dscore;",
                       arrays={"bias": bias}, grad_arrays=("bias",)) if score else None
    mm = mods.MaskMod("doc[q_idx] == doc[kv_idx]", arrays={"doc": doc}) if mask else None
    text = mods.prelude(sm, mm)
    names = {f: [] for f in FILES}
    limits = (128, 128) if mask else ()
    for window in (_spec.NO_WINDOW, _spec.CAUSAL):
        spec = _spec.CallSpec("float16", 0, window=window, score_mod=score, mask_mod=mask,
                              user_mods=text, sparse=mask)
        variant = spec.variant()
        for hd in (64, 128):
            t = _config.tile("fwd", hd, _config.SMEM_LIMIT[80], *limits, extras=spec.extras)
            names["fwd.cu"].append(_launch.fwd_name(spec, "fp16", hd, t))
            for atomic in (True, False):
                t = _config.tile("bwd", hd, _config.SMEM_LIMIT[80], *limits,
                                 deterministic=not atomic, extras=spec.extras)
                names["bwd.cu"].append(_launch.bwd_dkdv_name(spec, "fp16", hd, t, atomic))
            t = _config.tile("dq", hd, _config.SMEM_LIMIT[80], *limits, extras=spec.extras)
            names["bwd.cu"].append(_launch.bwd_dq_name(spec, "fp16", hd, t))
            for elem in ("float", "double"):
                for kernel in ("generic_fwd_kernel", "generic_bwd_dq_kernel",
                               "generic_bwd_dkdv_kernel"):
                    names["generic.cu"].append(template_name(kernel, elem, hd,
                                                             spec.variant(band_at_run_time=True)))
        # The Hopper kernels run user mods on sm_90 at every head dim (one per kernel shape;
        # a score_mod's three-consumer forward and its two-consumer fallback at 64, its 80-key
        # forward and its 64-key fallback at 256).
        for hd in (64, 128, 256) if arch == "sm_90" else ():
            at_hd = dataclasses.replace(spec, headdim=hd)
            tile = _launch.sm90_fwd_tile(at_hd, "mask" if mask else None)
            for g, keys in sorted({tile, (2, _launch.sm90_fwd_keys(at_hd, "mask"))}):
                names["fwd_sm90.cu"].append(template_name("flash_fwd_sm90_kernel", "fp16", hd, variant, g, keys))
            names["bwd_sm90.cu"].append(
                template_name("flash_bwd_sm90_wide_kernel", "fp16", variant) if hd == 256 else
                template_name("flash_bwd_sm90_kernel", "fp16", hd, _launch.sm90_bwd_rows(hd), variant))
    return text, names


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("score,mask", [(True, False), (False, True), (True, True)], ids=["score", "mask", "both"])
def test_user_mod_kernels_compile_without_local_memory(arch, score, mask):
    text, names = _user_mod_names(score, mask, arch)
    jobs = [(f, sorted(set(ns))) for f, ns in names.items() if ns]
    with concurrent.futures.ProcessPoolExecutor(
            max_workers=min(len(jobs), os.cpu_count() or 1),
            mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(nvrtc_compile, *zip(*[(f, ns, _compile.ARCH_SPECIFIC.get(f, arch), text)
                                                      for f, ns in jobs])))
    stats = {n: s for r in results for n, s in r.items()}
    assert set(stats) == {n for _, ns in jobs for n in ns}
    # The Hopper forward's too: with this table lookup per score it spilled 300-450 bytes at
    # head dim 64 until its score step's copy for the sequences' ends stopped clamping every
    # element (cuda/score_mod.cuh, user_apply_tail; NOTES.md).
    local = {n: s for n, s in stats.items() if any(s[1:])}
    assert not local, f"local memory (registers, spill st/ld, stack) with {arch}: {local}"


def test_serialized_wgmma_is_read_from_the_log_and_kept_with_the_cached_kernel(tmp_path, monkeypatch):
    """``_launch.sm90_bwd_step``'s check of a user score_mod's kernel: whether ptxas serialized
    a Hopper kernel's wgmma, from NVRTC's log when the kernel is compiled and from CuPy's
    cache directory when it is read back (no compile then): the probe above (serialized) and
    the plain 80-row backward (not: the compile checks hold every table kernel to that)."""
    from cupyflash import _spec
    plain = _spec.CallSpec("bfloat16", 128)
    kernels = [(_compile.source("sm90.cuh") + SERIAL_PROBE, "serial_probe", True),
               (_compile.source("bwd_sm90.cu"), _launch._bwd_sm90_name(plain, 128, 80), False)]
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    for code, name, serialized in kernels:
        _compile._arch_cubin.cache_clear()
        assert _compile.wgmma_serialized(code, name, "sm_90a") == serialized
    assert len(list(tmp_path.glob("cupyflash_sm_90a_*.cubin"))) == 2
    _compile._arch_cubin.cache_clear()
    monkeypatch.setattr(_compile, "_nvrtc_cubin", None)   # a compile now would raise
    for code, name, serialized in kernels:
        assert _compile.wgmma_serialized(code, name, "sm_90a") == serialized
    _compile._arch_cubin.cache_clear()
