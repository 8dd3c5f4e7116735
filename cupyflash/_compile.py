"""Run-time compilation of the CUDA sources in ``cuda/`` through NVRTC.

Sources are assembled in Python: every ``#include "x.cuh"`` of our own is replaced by
the header's text (once per header), so the source string handed to CuPy contains every
line that is compiled. CuPy's on-disk cache hashes that string, which makes its key change
whenever any ``.cu``/``.cuh`` changes. Modules are compiled lazily and memoized per
(device, source, name expressions), each key compiled once even when threads ask for it at
the same time. A module is keyed by its source text, not a file name: a changed header, or
a user's snippet spliced into a source, is a new key.

CuPy's disk cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``) may be read-only
where it already holds every kernel a call needs. A kernel missing from a read-only cache
raises an OSError naming the directory: NVRTC has compiled it, but CuPy cannot store it
(``CUPY_CACHE_IN_MEMORY=1`` compiles without the disk cache). Damaged cache files (truncated,
garbage) fail CuPy's checksum and are compiled again and rewritten.
"""
import functools
import os
import re
import threading
from pathlib import Path

CUDA_DIR = next(p for p in (Path(__file__).parent / "cuda", Path(__file__).parent.parent / "cuda")
                if p.is_dir())

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)

# -std=c++17 for `if constexpr`; fast exp2 comes from ex2.approx written in the source.
NVRTC_OPTIONS = ("-std=c++17",)


def _expand(name, seen):
    text = (CUDA_DIR / name).read_text()

    def sub(match):
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return _expand(header, seen)

    return _INCLUDE.sub(sub, text)


# The line of cuda/user.cuh after which a call's user mods (cupyflash/mods.py) are spliced.
USER_MODS_MARK = "// @user-mods\n"


@functools.lru_cache(maxsize=64)
def source(name, user_mods=""):
    """The full text of ``cuda/<name>`` with our headers inlined, and the ``struct UserMods``
    text of a call's snippets (``mods.prelude``) spliced in after cuda/user.cuh."""
    text = _expand(name, set())
    if user_mods:
        assert text.count(USER_MODS_MARK) == 1, f"{name} does not include user.cuh once"
        text = text.replace(USER_MODS_MARK, USER_MODS_MARK + user_mods)
    return text


def template_name(kernel, *args):
    """The one place where a template instantiation's name is spelled, used both to
    instantiate it (NVRTC name expression) and to look it up after compiling."""
    def spell(a):
        if isinstance(a, bool):
            return "true" if a else "false"
        return str(a)
    return f"{kernel}<{', '.join(spell(a) for a in args)}>"


def _once_per_key(fn):
    """Memoize ``fn`` by its arguments so that it runs once per key under concurrency:
    functools.lru_cache runs the function once per thread that misses at the same time, which
    for ``_module`` is one NVRTC compile each. A lock per key lets different keys compile in
    parallel. ``fn`` never returns None; an exception is not cached (the next call tries
    again). ``cache_clear()`` as lru_cache's."""
    results, locks, guard = {}, {}, threading.Lock()

    @functools.wraps(fn)
    def memoized(*args):
        result = results.get(args)
        if result is not None:
            return result
        with guard:
            lock = locks.setdefault(args, threading.Lock())
        with lock:
            if args not in results:
                results[args] = fn(*args)
            return results[args]

    def cache_clear():
        with guard:
            results.clear()
            locks.clear()

    memoized.cache_clear = cache_clear
    return memoized


@_once_per_key
def _module(device_id, code, names):
    import cupy
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=code, options=NVRTC_OPTIONS,
                                name_expressions=list(names))
        try:
            # CuPy compiles at the first get_function; here it runs under this key's lock.
            module.compile()
        except OSError as e:
            error = _cache_error(e)
            if error is None:
                raise
            raise error from e
    return module


def _cache_error(e):
    """A clearer OSError for one raised while CuPy writes into its kernel cache, else None."""
    cache_dir = str(_cache_dir())
    if not e.filename or os.path.dirname(os.path.abspath(e.filename)) != cache_dir:
        return None
    # OSError(errno, text) gives the errno's subclass (PermissionError, ...), as CuPy raised.
    return OSError(e.errno, f"CuPy's kernel cache directory {cache_dir} cannot be written "
                            f"({e.strerror}): a kernel compiled by cupyflash could not be "
                            f"stored. Set CUPY_CACHE_DIR to a writable directory, or "
                            f"CUPY_CACHE_IN_MEMORY=1 to compile without the disk cache")


# Files whose kernels use Hopper's arch-specific instructions (wgmma, setmaxnreg): compiled
# for sm_90a by NVRTC directly (CuPy's RawModule appends its own -arch=sm_90). The result is
# kept in CuPy's cache directory in CuPy's file format (the hex SHA-1 of the rest, then the
# rest: the kernel's lowered name, a NUL byte, "s" where ptxas serialized its wgmma else "-",
# the cubin), under a key of everything that changes it (CUBIN_FORMAT: this layout's); a file
# that fails the check is compiled again and rewritten, a read-only directory is used for
# reading, CUPY_CACHE_IN_MEMORY=1 keeps it off the disk, as CuPy's own.
ARCH_SPECIFIC = {"fwd_sm90.cu": "sm_90a", "bwd_sm90.cu": "sm_90a"}
CUBIN_FORMAT = "2"


def _cache_dir():
    return Path(os.path.abspath(os.environ.get("CUPY_CACHE_DIR")
                                or os.path.expanduser("~/.cupy/kernel_cache")))


def nvrtc_run(code, filename, names, arch, options=()):
    """Compile the instantiations ``names`` of ``code`` for ``arch`` with NVRTC alone (no GPU
    needed). Returns (the program log, {name: lowered name}, the cubin); raises RuntimeError
    with the log if compiling fails."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(code, filename, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, f"-arch={arch}", *options])
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{filename} failed for {arch}:\n{nvrtc.getProgramLog(prog)}") from e
        return (nvrtc.getProgramLog(prog), {n: nvrtc.getLoweredName(prog, n) for n in names},
                nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


# ptxas still compiles a kernel whose wgmma it could not keep asynchronous (for want of
# registers, or a register of an operand touched on a path it cannot prove uniform), and only
# says so in its log (with NVRTC 13.0, in its verbose log only).
WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"


def ptxas_log_options():
    """NVRTC options for ptxas's verbose log: from 12.9 NVRTC may answer a compile it has seen
    from its own cache, without any of ptxas's lines, unless told not to."""
    from cupy_backends.cuda.libs import nvrtc
    return ("--ptxas-options=-v",) + (("--no-cache",) if nvrtc.getVersion() >= (12, 9) else ())


def _nvrtc_cubin(code, name, arch):
    """(lowered name, cubin, whether ptxas serialized its wgmma) of instantiation ``name`` of
    ``code`` for ``arch``."""
    log, lowered, cubin = nvrtc_run(code, name.split("<")[0] + ".cu", (name,), arch, ptxas_log_options())
    return lowered[name], cubin, WGMMA_SERIALIZED in log


@_once_per_key
def _arch_cubin(code, name, arch):
    import hashlib
    from cupy_backends.cuda.libs import nvrtc
    if os.environ.get("CUPY_CACHE_IN_MEMORY") == "1":
        return _nvrtc_cubin(code, name, arch)
    key = hashlib.sha256("\0".join((code, name, arch, *NVRTC_OPTIONS, str(nvrtc.getVersion()),
                                     CUBIN_FORMAT)).encode()).hexdigest()
    path = _cache_dir() / f"cupyflash_{arch}_{key}.cubin"
    try:
        data = path.read_bytes()
    except OSError:
        data = b""
    if data[:40] == hashlib.sha1(data[40:]).hexdigest().encode():
        lowered, _, rest = data[40:].partition(b"\0")
        if rest[1:]:
            return lowered.decode(), rest[1:], rest[:1] == b"s"
    lowered, cubin, serialized = _nvrtc_cubin(code, name, arch)
    rest = lowered.encode() + b"\0" + (b"s" if serialized else b"-") + cubin
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(hashlib.sha1(rest).hexdigest().encode() + rest)
        os.replace(tmp, path)
    except OSError as e:
        error = _cache_error(e)
        if error is None:
            raise
        raise error from e
    return lowered, cubin, serialized


def wgmma_serialized(code, name, arch):
    """Whether ptxas serialized the wgmma of kernel ``name`` of ``code`` for ``arch`` (compiling
    it, or reading the cache): such a kernel runs, slower than it was written to."""
    return _arch_cubin(code, name, arch)[2]


@_once_per_key
def get_arch_kernel(device_id, code, name, arch):
    """Kernel ``name`` of ``code`` compiled for ``arch`` (a cupy.cuda.function.Function: launch
    it as a RawKernel; its attributes through the driver)."""
    import cupy
    lowered, cubin, _ = _arch_cubin(code, name, arch)
    with cupy.cuda.Device(device_id):
        module = cupy.cuda.function.Module()
        module.load(cubin)
        return module.get_function(lowered)


def get_kernel(code, name):
    """The compiled kernel ``name`` (a template name) of the source text ``code`` (``source(
    filename)``, or one with a user's snippet) on the current device. Each instantiation is its
    own small module so that a call compiles only what it launches."""
    import cupy
    device_id = cupy.cuda.Device().id
    module = _module(device_id, code, (name,))
    return module.get_function(name)


def nvrtc_compile(filename, names, arch, user_mods=""):
    """Compile instantiations for ``arch`` (e.g. "sm_80") with NVRTC alone, no GPU needed,
    with a call's user mods (``mods.prelude``) spliced in.

    Returns ``{name: (registers, spill_store_bytes, spill_load_bytes, stack_bytes)}``
    parsed from ptxas's verbose log. Raises RuntimeError with the log if compiling fails, and
    where ptxas serialized a kernel's wgmma instructions.
    """
    log, lowered, _ = nvrtc_run(source(filename, user_mods), filename, names, arch, ptxas_log_options())
    serialized = [line for line in log.splitlines() if WGMMA_SERIALIZED in line]
    if serialized:
        raise RuntimeError(f"{filename} for {arch}: ptxas serialized wgmma:\n" + "\n".join(serialized))
    return _parse_ptxas(log, {v: k for k, v in lowered.items()})


def _parse_ptxas(log, lowered):
    stats, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or \
            re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            # A device function that ptxas keeps apart gets its own block after the kernel's:
            # its figures are not the kernel's (its stack counts in the kernel's cumulative
            # stack size, read below).
            current = lowered.get(m.group(1))
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            s = stats.setdefault(current, [0, 0, 0, 0])
            s[3], s[1], s[2] = int(m.group(1)), int(m.group(2)), int(m.group(3))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            s = stats.setdefault(current, [0, 0, 0, 0])
            s[0] = int(m.group(1))
            m = re.search(r"(\d+) bytes cumulative stack size", line)
            if m:
                s[3] = max(s[3], int(m.group(1)))
    return {n: tuple(s) for n, s in stats.items()}
