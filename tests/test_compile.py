"""Every kernel instantiation the config table can pick compiles through NVRTC, for sm_80 and
sm_90 (and the smaller tiles picked on 99 KB parts, for sm_86), with no local-memory spills.
NVRTC needs no GPU, so this runs in CI."""
import pytest

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash import _config  # noqa: E402
from cupyflash._compile import nvrtc_compile  # noqa: E402
from cupyflash._launch import kernel_names  # noqa: E402

CASES = [(arch, f) for arch in ("sm_80", "sm_90", "sm_86") for f in ("fwd.cu", "bwd.cu", "generic.cu")]


@pytest.mark.parametrize("arch,filename", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_every_instantiation_compiles_without_spills(arch, filename):
    smem = _config.SMEM_LIMIT[int(arch[3:])]
    names = kernel_names(smem)[filename]
    if arch == "sm_86" and filename == "generic.cu":
        pytest.skip("the plain kernels do not depend on the shared-memory size")
    stats = nvrtc_compile(filename, names, arch)
    assert set(stats) == set(names), f"ptxas reported no figures for {set(names) - set(stats)}"
    spilled = {n: s for n, s in stats.items() if s[1] or s[2]}
    assert not spilled, f"register spills (regs, store bytes, load bytes, stack) on {arch}: {spilled}"
