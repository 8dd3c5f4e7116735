"""Why CuPy can use no CUDA GPU here, in words that tell a user what to do about it.

The CUDA runtime answers "cudaErrorInsufficientDriver: CUDA driver version is insufficient"
both where the driver is too old and where there is no driver at all, which sends the owner
of a machine without a GPU off to upgrade a driver it does not have. The driver's version
(0 where none could be loaded) tells the cases apart.
"""
import os

NO_DEVICE = 100               # cudaErrorNoDevice
INSUFFICIENT_DRIVER = 35      # cudaErrorInsufficientDriver


def cuda_version_text(version):
    """CUDA's integer version (1000 * major + 10 * minor) as "major.minor"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def no_gpu_reason(runtime):
    """None when ``runtime`` (``cupy.cuda.runtime``) sees a CUDA GPU, else why not."""
    try:
        count, status, error = runtime.getDeviceCount(), None, None
    except runtime.CUDARuntimeError as e:
        count, status, error = 0, e.status, e
    if count > 0:
        return None
    driver = runtime.driverGetVersion()
    if driver == 0:
        return ("no NVIDIA driver found (libcuda could not be loaded), so this machine has no "
                "usable CUDA GPU")
    if status == INSUFFICIENT_DRIVER:
        built = runtime.runtimeGetVersion()
        return (f"the NVIDIA driver supports CUDA up to {cuda_version_text(driver)}, older than "
                f"the CUDA {cuda_version_text(built)} runtime this CuPy was built for: update "
                f"the driver, or install a CuPy built for CUDA {driver // 1000}")
    if status in (None, NO_DEVICE):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        return (f"the NVIDIA driver (CUDA {cuda_version_text(driver)}) is installed but finds "
                f"no GPU{hidden}")
    return f"CUDA cannot use the GPU ({error})"


def gpu_or_reason():
    """(cupy, None) when CuPy sees a CUDA GPU, else (None, why not, in plain words)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CuPy install
        return None, f"CuPy is not importable ({type(e).__name__}: {e})"
    why = no_gpu_reason(cupy.cuda.runtime)
    return (cupy, None) if why is None else (None, why)
