"""Tensor maps for the bulk tensor copy engine (TMA) of sm_90 GPUs.

A tensor map describes a strided tensor in device memory and the box one copy brings into
shared memory; the sm_90a kernels receive it by value (cuda/sm90.cuh's ``TmaDesc``, a
``__grid_constant__`` parameter). It is made on the host by the driver's
``cuTensorMapEncodeTiled``, called here through ctypes: CuPy binds no tensor-map call, and one
driver function does not justify a dependency on cuda-bindings. The call needs no context and
touches no device memory; it only checks and packs its arguments.
"""
import ctypes
import functools

import numpy as np

# CUtensorMapDataType, CUtensorMapSwizzle and CUtensorMapL2promotion (cuda.h).
_DATA_TYPES = {"float16": 6, "float32": 7, "bfloat16": 9}
SWIZZLE_128B = 3
# L2 promotion of 256 bytes: 1.1% faster than 128 on the d=128 2K forward, the same elsewhere
# (H200, benchmarks/NOTES.md).
_L2_PROMOTION_256B = 3
DESC_BYTES = 128
# One copy's box: at most 256 elements per dimension; with the 128-byte swizzle, rows of at
# most 128 bytes.
MAX_BOX = 256
SWIZZLE_ROW_BYTES = 128

TMA_DESC = np.dtype([("words", np.uint64, DESC_BYTES // 8)])


@functools.lru_cache(maxsize=None)
def _encode_tiled():
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p,
                  u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def tiled(ptr, dtype, dims, strides, box, swizzle=SWIZZLE_128B):
    """The tensor map (a read-only 0-d ``TMA_DESC`` array, for a kernel argument) of a tensor
    at device address ``ptr`` of ``dtype`` ("float16", "bfloat16", "float32") with sizes
    ``dims`` in elements, innermost first (the innermost contiguous), ``strides`` the byte
    strides of ``dims[1:]``, copied in boxes of ``box`` elements per dimension. Elements of a
    box outside the tensor arrive as zeros. Raises ValueError for what the copy engine cannot
    describe, RuntimeError if the driver refuses. The last maps made are kept: a training
    loop hands the same buffers (a caching allocator's) call after call, and each encoding
    costs microseconds of host time."""
    return _tiled(int(ptr), dtype, tuple(dims), tuple(strides), tuple(box), swizzle)


@functools.lru_cache(maxsize=256)
def _tiled(ptr, dtype, dims, strides, box, swizzle):
    rank = len(dims)
    if not 1 <= rank <= 5 or len(strides) != rank - 1 or len(box) != rank:
        raise ValueError(f"tensor map of rank {rank}: {len(strides)} strides, {len(box)} box sizes")
    item = 4 if dtype == "float32" else 2
    if ptr % 16 or any(s % 16 for s in strides):
        raise ValueError(f"tensor map: address {ptr:#x} and strides {strides} must be multiples of 16 bytes")
    if not all(1 <= b <= MAX_BOX for b in box):
        raise ValueError(f"tensor map: box {box} must be 1..{MAX_BOX} per dimension")
    if swizzle == SWIZZLE_128B and box[0] * item > SWIZZLE_ROW_BYTES:
        raise ValueError(f"tensor map: a 128-byte swizzle takes rows of at most {SWIZZLE_ROW_BYTES} bytes, "
                         f"not {box[0]} x {item}")
    # The driver writes the map to a 64-byte aligned address.
    scratch = np.zeros(DESC_BYTES + 64, np.uint8)
    at = scratch.ctypes.data + (-scratch.ctypes.data) % 64
    as_u64 = (ctypes.c_uint64 * rank)
    as_u32 = (ctypes.c_uint32 * rank)
    err = _encode_tiled()(at, _DATA_TYPES[dtype], rank, ptr, as_u64(*dims),
                          (ctypes.c_uint64 * max(rank - 1, 1))(*strides), as_u32(*box),
                          as_u32(*([1] * rank)), 0, swizzle, _L2_PROMOTION_256B, 0)
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err} (dims {dims}, "
                           f"strides {strides}, box {box})")
    desc = np.zeros((), TMA_DESC)
    ctypes.memmove(desc.ctypes.data, at, DESC_BYTES)
    desc.flags.writeable = False
    return desc
