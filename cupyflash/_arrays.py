"""The package boundary: turn the caller's arrays into NumPy or CuPy arrays, and results
back into the caller's kind. Inside the package everything is NumPy (CPU path) or CuPy."""
import numpy as np


def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def array_kind(a):
    """"numpy", "cupy", or "dlpack" (any other object with __dlpack__)."""
    if isinstance(a, np.ndarray):
        return "numpy"
    cp = _cupy()
    if cp is not None and isinstance(a, cp.ndarray):
        return "cupy"
    if hasattr(a, "__dlpack__"):
        return "dlpack"
    return None


def as_backend(arrays, names):
    """Convert ``arrays`` (all of one kind) to NumPy or CuPy without copying.

    Returns (converted arrays, kind, xp). Raises TypeError naming the argument for an
    object that is not an array, and for a mix of host and device arrays.
    """
    kinds = []
    for a, n in zip(arrays, names):
        kind = array_kind(a)
        if kind is None:
            raise TypeError(f"{n} must be a NumPy array, a CuPy array or an object with "
                            f"__dlpack__, got {type(a).__name__}")
        kinds.append(kind)
    if len(set(kinds)) > 1:
        got = ", ".join(f"{n}: {k}" for n, k in zip(names, kinds))
        raise TypeError(f"all arrays must be of one kind (NumPy, CuPy or one DLPack framework), got {got}")
    kind = kinds[0]
    if kind == "numpy":
        return list(arrays), kind, np
    cp = _cupy()
    if cp is None:
        raise RuntimeError("CuPy is needed for device arrays; install cupyflash[cuda13] or [cuda12]")
    if kind == "cupy":
        return list(arrays), kind, cp
    return [cp.from_dlpack(a) for a in arrays], kind, cp


def to_caller(result, kind, like):
    """Return ``result`` (CuPy or NumPy) as the caller's kind; ``like`` is one of the
    caller's original arrays (its framework receives the result through DLPack)."""
    if kind in ("numpy", "cupy"):
        return result
    module = type(like).__module__.split(".")[0]
    if module == "torch":
        import torch
        return torch.from_dlpack(result)
    if module in ("jax", "jaxlib"):
        import jax.dlpack
        return jax.dlpack.from_dlpack(result)
    return result
