"""Kernel launches with attributes CuPy's launch does not take, through the driver's
``cuLaunchKernelEx`` (ctypes, as _tma.py's tensor maps: one driver call).

The one used: programmatic dependent launch (sm_90). A kernel launched so may start while
the kernel before it in the stream is still running, once every block of that kernel has
run ``griddepcontrol.launch_dependents`` (cuda/common.cuh's ``launch_dependents``) or exited;
it must then wait for the data it reads by itself: bwd.cu's dQ convert kernel polls a count
of finished blocks, decode.cu's merge kernel waits for the whole grid before it
(``wait_for_primary``). Where the attribute has no effect the launch is an ordinary one,
after the kernel before it: the waits then find everything done.
"""
import ctypes
import functools

import numpy as np

# CUlaunchAttributeID (cuda.h)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _Attribute(ctypes.Structure):
    # CUlaunchAttribute: the id, 4 bytes of padding, a 64-byte union (here its int member).
    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int32),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("smem", ctypes.c_uint32),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint32)]


@functools.lru_cache(maxsize=None)
def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx, or None where the driver has none (before CUDA 12)."""
    try:
        f = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f


def launch_dependent(function, grid, threads, smem, stream, args):
    """Launch the kernel ``function`` (a CUfunction handle) with the by-value parameters
    ``args`` (NumPy scalars, structured ones laid out as the kernel's structs) on ``stream`` as
    the programmatic dependent of the stream's previous kernel. False where the driver cannot
    (the caller then launches it the ordinary way); raises RuntimeError if the launch fails."""
    f = _launch_kernel_ex()
    if f is None:
        return False
    attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    config = _Config(grid=(ctypes.c_uint32 * 3)(*grid), block=(ctypes.c_uint32 * 3)(threads, 1, 1), smem=smem,
                     stream=stream, attrs=ctypes.pointer(attr), num_attrs=1)
    data = [np.frombuffer(a.tobytes(), np.uint8).copy() for a in args]   # copied at the launch
    pointers = (ctypes.c_void_p * len(data))(*(d.ctypes.data for d in data))
    err = f(ctypes.byref(config), function, pointers, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {err}")
    return True
