"""Every kernel instantiation the config table can pick compiles through NVRTC with no local
memory: no register spills and no stack frame. Complete for sm_80 and sm_90; for sm_86 (99 KB
of shared memory) only the smaller tiles that sm_80 never picks: the two have the same register
file, and on the instantiations both pick ptxas's register counts stay close (within 22 with
NVRTC 13.5, none spilling on either).

NVRTC needs no GPU, so this runs in CI. The compiles run in parallel, one process per core,
in pieces of a few instantiations; deselect them with ``-m "not compile"``."""
import concurrent.futures
import multiprocessing
import os

import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash import _compile, _config  # noqa: E402
from cupyflash._compile import nvrtc_compile  # noqa: E402
from cupyflash._launch import kernel_names  # noqa: E402

pytestmark = pytest.mark.compile

ARCHS = ("sm_80", "sm_90", "sm_86")
FILES = ("fwd.cu", "bwd.cu", "generic.cu")
# Instantiations per NVRTC program: small pieces keep every core busy to the end, and parsing
# the source again for each piece costs little beside ptxas's work on the kernels.
PIECE = 4


def names_to_check(arch, filename):
    names = kernel_names(_config.SMEM_LIMIT[int(arch[3:])])[filename]
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
        futures = {pool.submit(nvrtc_compile, filename, names, arch): (arch, filename)
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
