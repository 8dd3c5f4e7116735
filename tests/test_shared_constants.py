"""Numbers that the kernels and the Python side both use agree: NVRTC compiles the kernel
sources with static_asserts generated from cupyflash._config / _launch (no GPU needed)."""
import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash import _compile, _config, _launch  # noqa: E402


def _compile_with(filename, asserts):
    from cupy_backends.cuda.libs import nvrtc
    src = _compile.source(filename) + "\n" + "\n".join(asserts) + "\n"
    prog = nvrtc.createProgram(src, filename, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(_compile.NVRTC_OPTIONS) + ["-arch=compute_80"])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_tile_constants():
    _compile_with("common.cuh", [
        f"static_assert(SMEM_PAD == {_config.SMEM_PAD}, \"SMEM_PAD\");",
        f"static_assert(LOG2E == {_config.LOG2E!r}f, \"LOG2E\");",
    ])


def test_plain_kernel_constants_and_shared_memory():
    asserts = [
        f"static_assert(generic_impl::kWarps == {_config.GENERIC_WARPS}, \"GENERIC_WARPS\");",
        f"static_assert(generic_impl::kChunk == {_config.GENERIC_CHUNK}, \"GENERIC_CHUNK\");",
    ]
    for ctype, itemsize in (("float", 4), ("double", 8)):
        for hd in _config.HEAD_DIM_BUCKETS:
            asserts.append(f"static_assert(generic_impl::kSmemBytes<{ctype}, {hd}> == "
                           f"{_launch._generic_smem(hd, itemsize)}, \"smem {ctype} {hd}\");")
    _compile_with("generic.cu", asserts)
