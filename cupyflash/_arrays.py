"""The package boundary: the caller's arrays in, NumPy or CuPy inside, the caller's kind out.

Rules (README "Using it from PyTorch / JAX / CuPy / NumPy"):

- Inputs may be NumPy arrays, CuPy arrays, or any object with ``__dlpack__`` (PyTorch, JAX,
  ...). Nothing is copied: device arrays become CuPy views through DLPack (any strides),
  host ones NumPy views.
- Host and device arrays never mix in one call (TypeError naming the host arguments: moving
  them would be a copy). Device arrays of different frameworks on one GPU may mix, since
  each converts without a copy; the results take the kind of ``q``.
- Results come back as ``q``'s kind, on ``q``'s device, without a copy: ``torch.from_dlpack``
  or ``jax.dlpack.from_dlpack`` of the CuPy result (or of the NumPy result on the host).
- Work is queued on the caller's current stream (``launch_context``): PyTorch's current stream
  of the device when ``q`` is a PyTorch tensor, otherwise CuPy's current stream (JAX has no
  user-visible stream; JAX orders its own work against ours through the DLPack ``stream``
  argument). Nothing here synchronizes the host.
- Memory: a PyTorch caller's results and scratch come from PyTorch's allocator; other
  callers' from CuPy's, except scratch inside a CUDA graph capture (``scratch``). Host work
  a capture cannot hold is refused before it runs (``refuse_in_capture``).
"""
import contextlib
import functools
import sys
from typing import NamedTuple, Optional

import numpy as np

# DLPack device types (dlpack.h).
_HOST_DEVICE_TYPES = {1: "CPU", 3: "CUDA host (pinned)", 11: "ROCm host (pinned)"}
_GPU_DEVICE_TYPES = {2: "CUDA", 10: "ROCm", 13: "CUDA managed"}


class Caller(NamedTuple):
    """Who called: the framework of ``q`` and where the call runs."""
    framework: str          # "numpy", "cupy", "torch", "jax" or "dlpack" (another framework)
    device: Optional[int]   # GPU ordinal, None on the host
    like: object            # q as given: results are made of its kind


def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def framework(a):
    """"numpy", "cupy", "torch", "jax", "dlpack" (any other object with ``__dlpack__``), or
    None. Looks only at frameworks already imported: it never imports one."""
    if isinstance(a, np.ndarray):
        return "numpy"
    for name, attr in (("cupy", "ndarray"), ("torch", "Tensor"), ("jax", "Array")):
        module = sys.modules.get(name)
        cls = getattr(module, attr, None) if module is not None else None
        if cls is not None and isinstance(a, cls):
            return name
    if hasattr(a, "__dlpack__"):
        return "dlpack"
    return None


def _is_tracer(a):
    # JAX tracers (under jit, vmap, grad tracing) are jax.Array instances with no buffer.
    return any(c.__name__.endswith("Tracer") for c in type(a).__mro__)


def _device_of(a, kind, name):
    """(on_host, device ordinal or None) of one input."""
    if kind == "numpy":
        return True, None
    if kind == "cupy":
        return False, a.device.id
    try:
        dev_type, dev_id = (int(x) for x in a.__dlpack_device__())
    except AttributeError:
        raise TypeError(f"{name}: objects with __dlpack__ must also have __dlpack_device__, "
                        f"{type(a).__name__} has not") from None
    if dev_type in _HOST_DEVICE_TYPES:
        return True, None
    if dev_type in _GPU_DEVICE_TYPES:
        return False, dev_id
    raise TypeError(f"{name}: unsupported DLPack device type {dev_type} of "
                    f"{type(a).__name__}; expected a host (CPU) or a CUDA array")


def as_backend(arrays, names):
    """Convert ``arrays`` to NumPy (all on the host) or CuPy (all on GPUs) without copying.

    Returns (converted arrays, caller, xp), where ``caller`` (a ``Caller``) tells
    ``launch_context`` and ``to_caller`` where to run and what to return. Raises TypeError
    naming the argument for an object that is not an array, and for host arrays mixed with
    device arrays.
    """
    kinds = []
    for a, n in zip(arrays, names):
        if _is_tracer(a):
            raise TypeError(f"{n} is a JAX tracer ({type(a).__name__}): cupyflash.flash_attention "
                            f"runs eagerly on concrete arrays; under jax.jit, grad or vmap use "
                            f"cupyflash.jax.flash_attention")
        kind = framework(a)
        if kind is None:
            raise TypeError(f"{n} must be a NumPy array, a CuPy array or an object with "
                            f"__dlpack__, got {type(a).__name__}")
        kinds.append(kind)
    places = [_device_of(a, kind, n) for a, kind, n in zip(arrays, kinds, names)]
    host = [n for n, (on_host, _) in zip(names, places) if on_host]
    if host and len(host) < len(names):
        device = [f"{n} ({k})" for n, k, (on_host, _) in zip(names, kinds, places) if not on_host]
        raise TypeError(
            f"{', '.join(f'{n} ({k})' for n, k, (h, _) in zip(names, kinds, places) if h)} "
            f"{'is' if len(host) == 1 else 'are'} on the host but {', '.join(device)} "
            f"{'is' if len(device) == 1 else 'are'} on a GPU; the arrays of one call must be of "
            f"one kind, all host or all device (moving them would be a copy: do it yourself, "
            f"e.g. cupy.asarray(...) or tensor.cuda())")
    first = names.index("q") if "q" in names else 0
    caller = Caller(kinds[first], places[first][1], arrays[first])
    if host:
        return [_host_view(a, k, n) for a, k, n in zip(arrays, kinds, names)], caller, np
    cp = _cupy()
    if cp is None:
        raise RuntimeError("CuPy is needed for device arrays; install cupyflash[cuda13] or "
                           "cupyflash[cuda12]")
    with launch_context(caller) as launch:
        _join_cupy_stream(kinds, launch)
        converted = [a if k == "cupy" else _device_view(cp, a, k, n)
                     for a, k, n in zip(arrays, kinds, names)]
    return converted, caller, cp


def _join_cupy_stream(kinds, launch):
    """CuPy inputs were made on CuPy's current stream; when the launch stream is another
    (PyTorch's), order it after that stream's work with an event (no host wait). Inputs of
    other frameworks are ordered by the DLPack ``stream`` argument of their export."""
    if launch is None or "cupy" not in kinds:
        return
    if launch.outer.ptr != launch.stream.ptr:
        launch.stream.wait_event(launch.outer.record())


def _host_view(a, kind, name):
    """A NumPy view of a host array (NumPy, or a CPU tensor through DLPack)."""
    if kind == "numpy":
        return a
    if kind == "torch":
        a = a.detach()
    try:
        return np.from_dlpack(a)
    except (BufferError, TypeError, RuntimeError, ValueError) as e:
        err = e
    # NumPy's DLPack import has no bfloat16: reinterpret the 16-bit data instead.
    if kind == "torch" and str(a.dtype) == "torch.bfloat16":
        import ml_dtypes
        torch = sys.modules["torch"]
        return a.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if hasattr(a, "__array__"):
        return np.asarray(a)            # JAX host arrays in bfloat16 (ml_dtypes)
    raise TypeError(f"{name}: NumPy cannot import this host {type(a).__name__} through DLPack "
                    f"({type(err).__name__}: {err})") from err


def _device_view(cp, a, kind, name):
    """A CuPy view of a device array through DLPack. ``cupy.from_dlpack`` hands the producer
    CuPy's current stream (the launch stream: we are inside ``launch_context``), so the
    producer orders its pending writes of ``a`` before our kernels."""
    if kind == "torch":
        a = a.detach()                  # PyTorch refuses to export tensors that need grad
    try:
        return cp.from_dlpack(a)
    except (BufferError, TypeError, ValueError, NotImplementedError) as e:
        dtype = str(getattr(a, "dtype", "?"))
        hint = (" (bfloat16 through DLPack needs CuPy >= 14 with ml_dtypes installed)"
                if "bfloat16" in dtype else "")
        raise TypeError(f"{name}: CuPy {cp.__version__} cannot import this {dtype} "
                        f"{type(a).__name__} through DLPack{hint}: {type(e).__name__}: "
                        f"{e}") from e


class _StreamHandle:
    """A raw cudaStream_t in the CUDA stream protocol, for ``cupy.cuda.Stream.from_external``."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _torch_stream(cp, device):
    """PyTorch's current stream of ``device`` as a CuPy stream (same cudaStream_t)."""
    torch = sys.modules["torch"]
    ptr = torch.cuda.current_stream(device).cuda_stream
    if ptr == 0:
        return cp.cuda.Stream.null
    if hasattr(cp.cuda.Stream, "from_external"):        # CuPy >= 14
        return cp.cuda.Stream.from_external(_StreamHandle(ptr))
    return cp.cuda.ExternalStream(ptr, device)


class _Launch(NamedTuple):
    stream: object      # the launch stream (PyTorch's current stream, as a CuPy stream)
    outer: object       # CuPy's current stream it replaced for the context's duration


@contextlib.contextmanager
def launch_context(caller):
    """Make ``caller``'s device and stream current in CuPy for the duration.

    Host calls: nothing. Device calls: ``cupy.cuda.Device(caller.device)``; for PyTorch
    callers, PyTorch's current stream of that device is also made CuPy's current stream,
    so that our kernels, allocations and DLPack exchanges are ordered with the caller's
    work, and PyTorch's allocator CuPy's (``_TorchMalloc``). CuPy, JAX and other callers
    keep CuPy's current stream and allocator. Yields ``(stream, outer)`` when it changed
    CuPy's current stream (``outer``: the one it replaced), else None.
    """
    if caller.device is None:
        yield None
        return
    cp = _cupy()
    with cp.cuda.Device(caller.device):
        if caller.framework != "torch":
            yield None
            return
        outer = cp.cuda.get_current_stream()
        stream = _torch_stream(cp, caller.device)
        with stream, cp.cuda.using_allocator(_TorchMalloc(cp, caller.device)):
            yield _Launch(stream, outer)


class _TorchMalloc:
    """A CuPy allocator drawing from PyTorch's caching allocator on PyTorch's current stream:
    results and scratch of a PyTorch caller are PyTorch's memory, counted and reused by it,
    and inside ``torch.cuda.graph`` they come from the graph's private pool, so a replay finds
    them where the capture put them."""

    def __init__(self, cp, device):
        self.cp, self.device = cp, device

    def __call__(self, size):
        torch = sys.modules["torch"]
        block = torch.empty(size, dtype=torch.uint8, device=self.device)
        memory = self.cp.cuda.UnownedMemory(block.data_ptr(), size, block)
        return self.cp.cuda.MemoryPointer(memory, 0)


@functools.lru_cache(maxsize=None)
def _capture_pool(device_id):
    """The device's memory pool for ``scratch`` inside CuPy captures (one CuPy MemoryPool)."""
    return _cupy().cuda.MemoryPool()


class HostCopy:
    """Small device arrays copied to the host on CuPy's current stream: queued together into
    pinned buffers, waited for together (``wait``, one wait for the stream, not one per
    array), with host work free to run in between. An array given twice is copied once."""

    def __init__(self, arrays):
        import cupyx
        cp = _cupy()
        self._order = [next(i for i, b in enumerate(arrays) if b is a) for a in arrays]
        self._pinned = {}
        for i in dict.fromkeys(self._order):
            a = cp.ascontiguousarray(arrays[i])
            self._pinned[i] = a.get(out=cupyx.empty_pinned(a.shape, a.dtype), blocking=False)
        self._done = cp.cuda.Event(disable_timing=True)
        self._done.record()

    def wait(self):
        """The NumPy copies, in the order given (their own memory, not the pinned buffers)."""
        self._done.synchronize()
        return [np.array(self._pinned[i]) for i in self._order]


def capturing(cp):
    """Whether CuPy's current stream is being captured into a CUDA graph."""
    return cp.cuda.runtime.streamIsCapturing(cp.cuda.get_current_stream().ptr) != 0


def refuse_in_capture(cp, what, fix="make the same call once before capturing (same shapes, "
                                        "dtypes, options and block_mask)"):
    """Raise RuntimeError when host work (a compile, a copy from the host: ``what``) would run
    inside a CUDA graph capture, where it would invalidate the capture or be left out of
    the graph."""
    if capturing(cp):
        raise RuntimeError(f"{what}, which cannot run inside a CUDA graph capture: {fix}")


@contextlib.contextmanager
def scratch(cp):
    """Allocations of a call's own buffers (not its results), released before it returns.

    Inside a CUDA graph capture of a CuPy (not PyTorch) caller they come from a memory pool of
    their own (``_capture_pool``), which no array outside a capture is given: a replay writes
    them where the capture put them. From CuPy's pool, a buffer released during the capture
    could be handed to an array that every replay would then overwrite. The graphs captured
    in a process share that pool, one call's scratch reusing another's, as the calls of one
    graph do: replay graphs one after another on one stream, not side by side. (A PyTorch
    caller's buffers are PyTorch's, from the graph's own pool: ``_TorchMalloc``.)"""
    if not capturing(cp) or isinstance(cp.cuda.get_allocator(), _TorchMalloc):
        yield
        return
    with cp.cuda.using_allocator(_capture_pool(cp.cuda.Device().id).malloc):
        yield


def to_caller(result, caller):
    """``result`` (a CuPy or NumPy array) as ``caller``'s kind, without a copy.

    PyTorch: ``torch.from_dlpack``. JAX: ``jax.dlpack.from_dlpack`` on the GPU; on the host
    ``jax.device_put`` to the caller's CPU device (which may copy). Other DLPack frameworks: their array-API namespace's
    ``from_dlpack`` when they have ``__array_namespace__``, else the CuPy/NumPy array as is.
    Call it inside ``launch_context(caller)`` so that the consumer's stream argument names
    the launch stream.
    """
    kind = caller.framework
    if kind in ("numpy", "cupy"):
        return result
    if kind == "torch":
        torch = sys.modules["torch"]
        if isinstance(result, np.ndarray) and result.dtype.name == "bfloat16":
            return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(result)
    if kind == "jax":
        import jax.dlpack
        if isinstance(result, np.ndarray):
            return jax.device_put(result, next(iter(caller.like.devices())))
        return jax.dlpack.from_dlpack(result)
    namespace = getattr(caller.like, "__array_namespace__", None)
    if namespace is not None:
        return namespace().from_dlpack(result)
    return result
