"""The NumPy mirrors of FwdParams / BwdParams agree with the C++ structs on size and every
field offset: NVRTC compiles static_asserts generated from the NumPy dtypes."""
import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash import _compile  # noqa: E402
from cupyflash._launch import BLOCK_LIST, BWD_PARAMS, FWD_PARAMS, TENSOR_REF  # noqa: E402


def _asserts(cname, dtype):
    lines = [f"static_assert(sizeof({cname}) == {dtype.itemsize}, \"sizeof {cname}\");"]
    for field, (fdt, offset) in dtype.fields.items():
        lines.append(f"static_assert(__builtin_offsetof({cname}, {field}) == {offset}, "
                     f"\"{cname}.{field}\");")
    return "\n".join(lines)


@pytest.mark.parametrize("cname,dtype", [("TensorRef", TENSOR_REF), ("BlockList", BLOCK_LIST),
                                         ("FwdParams", FWD_PARAMS),
                                         ("BwdParams", BWD_PARAMS)])
def test_params_struct_layout_matches_numpy_dtype(cname, dtype):
    from cupy_backends.cuda.libs import nvrtc
    src = _compile.source("params.cuh") + "\n" + _asserts(cname, dtype) + "\n"
    prog = nvrtc.createProgram(src, "layout.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(_compile.NVRTC_OPTIONS) + ["-arch=compute_80"])
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            if '"__builtin_offsetof" is undefined' in log:
                pytest.skip("this NVRTC has no __builtin_offsetof (seen with 13.0; 13.5 has it)")
            pytest.fail(log)
    finally:
        nvrtc.destroyProgram(prog)
