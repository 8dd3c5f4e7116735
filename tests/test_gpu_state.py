"""State around the kernels: compile caches under threads, CuPy's disk cache when it is
damaged or read-only, and results that do not depend on the process.

Each case runs in child processes (this file run as a script, below ``__main__``) with their
own ``CUPY_CACHE_DIR``, so the in-process caches start empty and the disk cache is what the
test makes it. A child counts NVRTC compiles per kernel name (CuPy's calls into NVRTC
wrapped), and prints the SHA-256 of every result's bytes.

What CuPy does, and so what we test: a cache file that fails CuPy's checksum (truncated,
garbage) is compiled again and rewritten; a read-only cache serves the kernels it holds, and a
kernel missing from it fails with an OSError naming the directory (cupyflash/_compile.py),
unless ``CUPY_CACHE_IN_MEMORY=1``.
"""
import collections
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

cp = pytest.importorskip("cupy")

import cupyflash as cf  # noqa: E402

try:
    from gpu_checks import Case, check_backward, check_forward, make_inputs  # noqa: E402
except ImportError:
    from tests.gpu_checks import Case, check_backward, check_forward, make_inputs  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT = 300
# The user a root test runs the read-only children as (root ignores permission bits).
NOBODY = 65534


@dataclass(frozen=True)
class Config(Case):
    deterministic: bool = True


CONFIGS = {
    # Threads: two per config; the two bf16 configs share the preprocess and dQ-conversion
    # kernels.
    "threads_bf16_d64_causal_gqa": Config("bf16", 200, 300, 64, True, 1, 4, 2, False),
    "threads_fp16_d128_full": Config("fp16", 130, 97, 128, False),
    "threads_fp32_d40_causal": Config("fp32", 97, 130, 40, True),
    "threads_bf16_d72_full": Config("bf16", 64, 64, 72, False, 2, 2, 2, False),
    # Damaged and read-only caches.
    "cache_bf16_d64_causal": Config("bf16", 130, 97, 64, True),
    "cache_fp32_d32_full": Config("fp32", 17, 33, 32, False),
    # Reproducibility across processes (the backward deterministic).
    "repro_bf16_d128_causal_gqa": Config("bf16", 1000, 1100, 128, True, 1, 4, 2),
    "repro_fp16_d64_full": Config("fp16", 777, 777, 64, False, 2),
    "repro_fp32_d72_causal": Config("fp32", 300, 257, 72, True, 1, 4, 2),
}
THREAD_CONFIGS = [n for n in CONFIGS if n.startswith("threads_")]
CACHE_CONFIGS = [n for n in CONFIGS if n.startswith("cache_")]
REPRO_CONFIGS = [n for n in CONFIGS if n.startswith("repro_")]
THREADS = 8


# --- the child ---------------------------------------------------------------------------

def _count_compiles():
    """Count NVRTC compiles per name expression (our kernels; CuPy's own have none)."""
    from cupy_backends.cuda.libs import nvrtc
    counts, names_of, lock = collections.Counter(), {}, threading.Lock()
    add_name, compile_program = nvrtc.addNameExpression, nvrtc.compileProgram

    def counting_add_name(prog, name):
        with lock:
            names_of.setdefault(prog, []).append(name)
        return add_name(prog, name)

    def counting_compile(prog, options):
        result = compile_program(prog, options)
        with lock:
            counts.update(names_of.pop(prog, ()))
        return result

    nvrtc.addNameExpression, nvrtc.compileProgram = counting_add_name, counting_compile
    return counts


def _call(config, q, k, v, dout):
    out, lse = cf.flash_attention(q, k, v, causal=config.causal, return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=config.causal,
                                        deterministic=config.deterministic)
    return out, lse, grads


def _hashes(out, lse, grads):
    arrays = dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)))
    return {n: hashlib.sha256(cp.asnumpy(a).tobytes()).hexdigest() for n, a in arrays.items()}


def _check(config, inputs, results):
    q, k, v, dout = inputs
    out, lse, grads = results
    scale = config.d ** -0.5
    check_forward(config, q, k, v, out, lse, scale)
    check_backward(config, dout, q, k, v, grads, scale)


def _seed(name):
    return zlib.crc32(name.encode())


def _child_run(names, check):
    """Each config once, in order, on the default stream; the compile counts are taken
    before the checks (which compile CuPy's own kernels)."""
    compiles = _count_compiles()
    runs = []
    for name in names:
        inputs = make_inputs(CONFIGS[name], _seed(name))
        runs.append((name, inputs, _call(CONFIGS[name], *inputs)))
    counted = dict(compiles)
    for name, inputs, results in runs if check else ():
        _check(CONFIGS[name], inputs, results)
    return {"hashes": {name: _hashes(*results) for name, _, results in runs},
            "compiles": counted}


def _child_threads(names):
    """THREADS threads, each on its own stream, make their first calls at once (a barrier);
    config i % len(names) for thread i. The compile counts are taken before the checks."""
    compiles = _count_compiles()
    barrier = threading.Barrier(THREADS)
    runs, errors = [None] * THREADS, []

    def work(i):
        name = names[i % len(names)]
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                inputs = make_inputs(CONFIGS[name], _seed(name))
                barrier.wait()
                results = _call(CONFIGS[name], *inputs)
            stream.synchronize()
            runs[i] = (name, inputs, results)
        except BaseException:
            errors.append(traceback.format_exc())
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("a thread failed:\n" + "\n".join(errors))
    counted = dict(compiles)
    hashes = collections.defaultdict(list)
    for name, inputs, results in runs:
        _check(CONFIGS[name], inputs, results)
        hashes[name].append(_hashes(*results))
    return {"hashes": hashes, "compiles": counted}


def _child(argv):
    """``probe``; ``threads NAME...``; ``run NAME... [--check]``. Prints one line of JSON."""
    mode, names = argv[0], argv[1:]
    if mode == "probe":
        result = {"devices": cp.cuda.runtime.getDeviceCount()}
    elif mode == "threads":
        result = _child_threads(names)
    elif mode == "run":
        result = _child_run([n for n in names if n != "--check"], "--check" in names)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(result))


# --- the parent --------------------------------------------------------------------------

def _run_child(args, cache_dir=None, env=None, as_user=None):
    """Run this file as a child; returns (exit status, parsed JSON or None, stderr)."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), child_env.get("PYTHONPATH")) if p)
    if cache_dir is not None:
        child_env["CUPY_CACHE_DIR"] = str(cache_dir)
    child_env.update(env or {})
    def preexec():
        os.setgroups([])
        os.setgid(as_user)
        os.setuid(as_user)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], cwd=ROOT,
                          env=child_env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, preexec_fn=None if as_user is None else preexec)
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    return proc.returncode, result, proc.stderr


def _ok(args, **kw):
    rc, result, stderr = _run_child(args, **kw)
    assert rc == 0, f"child {args} failed (exit {rc}):\n{stderr[-4000:]}"
    return result


@pytest.fixture
def scratch():
    """A fresh directory that another user may enter (for the read-only children)."""
    path = Path(tempfile.mkdtemp(prefix="cupyflash_state_"))
    path.chmod(0o755)
    yield path
    for p in (path, *path.rglob("*")):
        if p.is_dir():
            p.chmod(0o755)
    shutil.rmtree(path)


def _unprivileged_user(cache_dir):
    """None when this process is not root (permission bits apply); else NOBODY, after a probe
    that it can run a child (read the checkout and ``cache_dir``, open the GPU)."""
    if os.geteuid() != 0:
        return None
    rc, _, stderr = _run_child(["probe"], cache_dir=cache_dir, as_user=NOBODY)
    if rc != 0:
        pytest.skip(f"as root, a read-only cache needs another user; uid {NOBODY} cannot run "
                    f"the child: {stderr.strip().splitlines()[-1:]}")
    return NOBODY


def _make_read_only(path):
    for p in path.iterdir():
        p.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    path.chmod(0o555)


def _valid_cache_files(path):
    """Files that pass CuPy's check: the hex SHA-1 of the rest, then the rest."""
    valid = 0
    for p in path.iterdir():
        data = p.read_bytes()
        valid += data[:40] == hashlib.sha1(data[40:]).hexdigest().encode()
    return valid


def test_first_calls_from_eight_threads_compile_each_kernel_once(scratch):
    """Eight threads, two per configuration, each on its own stream, call at once with empty
    in-process caches and an empty disk cache: every kernel is compiled exactly once and
    every result passes the reference checks; the two threads of a config agree bit for bit."""
    result = _ok(["threads", *THREAD_CONFIGS], cache_dir=scratch / "cache")
    compiles = result["compiles"]
    print(f"{len(compiles)} kernels compiled by {THREADS} threads: {sorted(compiles)}")
    again = {name: n for name, n in compiles.items() if n != 1}
    assert not again, f"compiled more than once: {again}"
    assert len(compiles) >= 2 * len(THREAD_CONFIGS), f"too few compiles counted: {compiles}"
    for name, runs in result["hashes"].items():
        assert len(runs) == THREADS // len(THREAD_CONFIGS)
        assert all(r == runs[0] for r in runs), f"{name}: threads disagree: {runs}"


def test_damaged_cache_files_are_compiled_again(scratch):
    """Cache files truncated, emptied or overwritten with garbage: the next process compiles
    those kernels again, gets the same bits as before, and leaves valid files behind."""
    cache = scratch / "cache"
    first = _ok(["run", *CACHE_CONFIGS, "--check"], cache_dir=cache)
    assert first["compiles"], "the first run compiled nothing"
    files = sorted(cache.iterdir())
    for i, p in enumerate(files):
        data = p.read_bytes()
        p.write_bytes([data[:len(data) // 2], b"", os.urandom(len(data))][i % 3])
    assert _valid_cache_files(cache) == 0
    second = _ok(["run", *CACHE_CONFIGS], cache_dir=cache)
    assert set(first["hashes"]) == set(CACHE_CONFIGS)
    assert second["hashes"] == first["hashes"]
    assert set(second["compiles"]) == set(first["compiles"]), \
        "every damaged kernel is compiled again"
    assert _valid_cache_files(cache) >= len(first["compiles"])


def test_read_only_cache_serves_its_kernels_and_names_itself_when_one_is_missing(scratch):
    """A read-only cache that holds the kernels: correct results, nothing compiled. An empty
    read-only cache: the call fails with an OSError naming the directory; with
    CUPY_CACHE_IN_MEMORY=1 the same call compiles in memory and gives the same bits."""
    warm, empty = scratch / "warm", scratch / "empty"
    first = _ok(["run", *CACHE_CONFIGS, "--check"], cache_dir=warm)
    empty.mkdir()
    for path in (warm, empty):
        _make_read_only(path)
    user = _unprivileged_user(warm)

    served = _ok(["run", *CACHE_CONFIGS], cache_dir=warm, as_user=user)
    assert served["hashes"] == first["hashes"]
    assert served["compiles"] == {}, f"compiled although cached: {served['compiles']}"

    rc, _, stderr = _run_child(["run", *CACHE_CONFIGS], cache_dir=empty, as_user=user)
    assert rc != 0, "an unwritable, empty cache must fail"
    assert f"CuPy's kernel cache directory {empty} cannot be written" in stderr, stderr[-3000:]
    assert "CUPY_CACHE_IN_MEMORY=1" in stderr

    in_memory = _ok(["run", *CACHE_CONFIGS], cache_dir=empty, env={"CUPY_CACHE_IN_MEMORY": "1"},
                    as_user=user)
    assert in_memory["hashes"] == first["hashes"]
    assert not any(empty.iterdir())


def test_forward_and_deterministic_backward_are_bit_identical_across_processes():
    """out, lse and the deterministic dq, dk, dv hash the same in two processes (CuPy's disk
    cache as configured: the second process loads what the first compiled)."""
    first = _ok(["run", *REPRO_CONFIGS, "--check"])
    second = _ok(["run", *REPRO_CONFIGS])
    for name in REPRO_CONFIGS:
        assert second["hashes"][name] == first["hashes"][name], \
            f"{name}: {first['hashes'][name]} vs {second['hashes'][name]}"


if __name__ == "__main__":
    _child(sys.argv[1:])


SMEM_PROBE = """
__global__ void smem_probe(float* out) {
    extern __shared__ float s[];
    s[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[31 - threadIdx.x];
}
"""


@pytest.mark.parametrize("arch", [None, "sm_90a"])
def test_a_smaller_shared_memory_size_leaves_a_kernels_larger_opt_in(arch):
    """A kernel prepared for a launch of 100 KB of dynamic shared memory, then for one of 64
    KB, still launches with 100 KB: the opt-in is raised per size and never lowered (the
    64 KB one lowered it on the loaded function the first launch also holds)."""
    from cupyflash import _launch
    device = cp.cuda.Device()
    if device.attributes["MaxSharedMemoryPerBlockOptin"] < 100 * 1024:
        pytest.skip("needs 100 KB of shared memory per block")
    if arch and device.compute_capability != "90":
        pytest.skip("sm_90a needs an sm_90 GPU")
    big, small = 100 * 1024, 64 * 1024
    out = cp.full(32, cp.nan, cp.float32)
    first = _launch._kernel(SMEM_PROBE, "smem_probe", device.id, big, arch)
    _launch._kernel(SMEM_PROBE, "smem_probe", device.id, small, arch)((1,), (32,), (out,), shared_mem=small)
    out.fill(cp.nan)
    first((1,), (32,), (out,), shared_mem=big)
    assert (out == cp.arange(31, -1, -1, dtype=cp.float32)).all()
