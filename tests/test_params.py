"""The C++ side and the Python side agree on what they share, checked by NVRTC (no GPU
needed) compiling the kernel sources with static_asserts generated from Python: the NumPy
mirrors of FwdParams / BwdParams (size and every field offset), and the constants of
cupyflash._config / _launch that the kernels repeat."""
import pytest

pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

from cupyflash import _compile, _config, _launch, _spec  # noqa: E402
from cupyflash._launch import (BLOCK_LIST, BWD_PARAMS, CACHE_PARAMS, FWD_PARAMS,  # noqa: E402
                               SCORE_PARAMS, TENSOR_REF, USER_PARAMS, VARLEN_PARAMS)


def _compile_log(filename, asserts):
    """None if cuda/<filename> compiles with the asserts appended, else NVRTC's log."""
    from cupy_backends.cuda.libs import nvrtc
    src = _compile.source(filename) + "\n" + "\n".join(asserts) + "\n"
    prog = nvrtc.createProgram(src, filename, [], [])
    try:
        nvrtc.compileProgram(prog, list(_compile.NVRTC_OPTIONS) + ["-arch=compute_80"])
        return None
    except nvrtc.NVRTCError:
        return nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


STRUCTS = [("TensorRef", TENSOR_REF), ("BlockList", BLOCK_LIST), ("ScoreParams", SCORE_PARAMS),
           ("UserParams", USER_PARAMS), ("VarlenParams", VARLEN_PARAMS), ("CacheParams", CACHE_PARAMS),
           ("FwdParams", FWD_PARAMS), ("BwdParams", BWD_PARAMS)]


@pytest.mark.parametrize("cname,dtype", STRUCTS)
def test_params_struct_size_matches_numpy_dtype(cname, dtype):
    log = _compile_log("params.cuh", [f"static_assert(sizeof({cname}) == {dtype.itemsize}, "
                                      f"\"sizeof {cname}\");"])
    assert log is None, log


@pytest.mark.parametrize("cname,dtype", STRUCTS)
def test_params_struct_offsets_match_numpy_dtype(cname, dtype):
    log = _compile_log("params.cuh", [
        f"static_assert(__builtin_offsetof({cname}, {field}) == {offset}, \"{cname}.{field}\");"
        for field, (_, offset) in dtype.fields.items()])
    if log and '"__builtin_offsetof" is undefined' in log:
        pytest.skip("this NVRTC has no __builtin_offsetof (seen with 13.0; 13.5 has it)")
    assert log is None, log


@pytest.mark.parametrize("filename,cname,dtype", [
    ("fwd_sm90.cu", "FwdSm90Params", _launch.FWD_SM90_PARAMS),
    ("bwd_sm90.cu", "BwdSm90Params", _launch.BWD_SM90_PARAMS),
    ("bwd_sm90.cu", "BesideParams", _launch.BESIDE_PARAMS),
    ("decode.cu", "DecodeParams", _launch.DECODE_PARAMS),
])
def test_kernel_parameters_match_numpy_dtype(filename, cname, dtype):
    """The structs that hold Params and more (the Hopper kernels' __grid_constant__ ones, the
    decode kernels'): size and every field's offset."""
    log = _compile_log(filename, [f"static_assert(sizeof({cname}) == {dtype.itemsize}, \"sizeof\");"] + [
        f"static_assert(__builtin_offsetof({cname}, {field}) == {offset}, \"{cname}.{field}\");"
        for field, (_, offset) in dtype.fields.items()])
    if log and '"__builtin_offsetof" is undefined' in log:
        pytest.skip("this NVRTC has no __builtin_offsetof (seen with 13.0; 13.5 has it)")
    assert log is None, log


@pytest.mark.parametrize("filename,asserts", [
    ("common.cuh", [f"static_assert(SMEM_PAD == {_config.SMEM_PAD}, \"SMEM_PAD\");",
                    f"static_assert(LOG2E == {_config.LOG2E!r}f, \"LOG2E\");",
                    f"static_assert(USER_ARRAYS == {_launch.USER_ARRAYS} && USER_NDIM == "
                    f"{_launch.USER_NDIM}, \"USER_ARRAYS\");"]),
    ("bwd.cu", [f"static_assert(PREPROCESS_ROWS == {_launch.PREPROCESS_ROWS} && PREPROCESS_THREADS == "
                f"{_launch.PREPROCESS_THREADS}, \"PREPROCESS\");",
                f"static_assert(DQ_CONVERT_THREADS == {_launch.DQ_CONVERT_THREADS}, "
                f"\"DQ_CONVERT_THREADS\");",
                f"static_assert(ACCUM_ALIGN == {_launch.VARLEN_ACCUM_ALIGN}, \"ACCUM_ALIGN\");",
                f"static_assert(SEQ_DENSE == {_spec.SEQ_DENSE} && SEQ_PACKED == {_spec.SEQ_PACKED} && "
                f"SEQ_CACHE == {_spec.SEQ_CACHE} && SEQ_PAGED == {_spec.SEQ_PAGED}, \"SEQ\");"]),
    ("bwd_sm90.cu", [f"static_assert(BESIDE_THREADS == {_launch.BESIDE_THREADS} && BESIDE_MAX_STAGES == "
                     f"{_launch.BESIDE_MAX_STAGES}, \"BESIDE\");"]),
    ("decode.cu", [f"static_assert(DECODE_KEYS == {_launch.DECODE_KEYS} && DECODE_WARPS * 32 == "
                   f"{_launch.DECODE_THREADS}, \"DECODE\");"] +
     [f"static_assert(decode_smem<{hd}>() == {_launch.decode_smem(hd)}, \"decode_smem {hd}\");"
      for hd in _config.HEAD_DIM_BUCKETS]),
], ids=["tile constants", "backward helper launches", "hopper backward", "decode launches"])
def test_constants_the_kernels_repeat(filename, asserts):
    log = _compile_log(filename, asserts)
    assert log is None, log


def test_plain_kernel_constants_and_shared_memory():
    asserts = [
        f"static_assert(generic_impl::kWarps == {_config.GENERIC_WARPS}, \"GENERIC_WARPS\");",
        f"static_assert(generic_impl::kChunk == {_config.GENERIC_CHUNK}, \"GENERIC_CHUNK\");",
    ]
    for ctype, itemsize in (("float", 4), ("double", 8)):
        for hd in _config.HEAD_DIM_BUCKETS:
            asserts.append(f"static_assert(generic_impl::kSmemBytes<{ctype}, {hd}> == "
                           f"{_launch._generic_smem(hd, itemsize)}, \"smem {ctype} {hd}\");")
    log = _compile_log("generic.cu", asserts)
    assert log is None, log


def test_driver_launch_structs_have_the_layout_of_cuda_h():
    """cupyflash/_driver.py's ctypes mirrors of CUlaunchAttribute and CUlaunchConfig: an id
    and a 64-byte union 8 bytes in; seven 32-bit sizes, then the stream, the attributes and
    their count at 8-byte alignment."""
    import ctypes
    from cupyflash import _driver
    assert ctypes.sizeof(_driver._Attribute) == 72 and _driver._Attribute.value.offset == 8
    c = _driver._Config
    assert (c.smem.offset, c.stream.offset, c.attrs.offset, c.num_attrs.offset, ctypes.sizeof(c)) == \
        (24, 32, 40, 48, 56)
