"""Ring attention across processes, one GPU each, over NCCL: CuPy's communicator and a
torch.distributed group, and the README's two launch examples. Needs two GPUs (skipped
otherwise); the ring's arithmetic is tested on one device and on NumPy in
tests/test_distributed.py."""
import multiprocessing as mp
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2


def _gpus():
    try:
        import cupy as cp
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver: no GPU
        return 0


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_gpus() < WORLD, reason=f"needs {WORLD} GPUs")]


def launch_blocks():
    """The README's launch examples by name (``<!-- launch: NAME -->`` before a python block)."""
    pattern = re.compile(r"<!-- launch: (\w+) -->\s*```python\n(.*?)```", re.S)
    return dict(pattern.findall((ROOT / "README.md").read_text()))


def _run(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_readme_torchrun_example(tmp_path):
    pytest.importorskip("torch.distributed")
    script = tmp_path / "ring_torch.py"
    script.write_text(launch_blocks()["ring_torch"])
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={WORLD}", str(script)], tmp_path)
    assert len(re.findall(r"^\d \d", out, re.M)) == WORLD, out


def test_readme_cupy_example(tmp_path):
    script = tmp_path / "ring_cupy.py"
    script.write_text(launch_blocks()["ring_cupy"])
    out = _run([sys.executable, str(script)], tmp_path)
    assert len(re.findall(r"^\d \d", out, re.M)) == WORLD, out


def _rank(rank, nccl_id, config, results):
    """One rank over CuPy's NCCL: its shards of the full inputs (the same seed everywhere),
    ring forward and backward; the results to the parent as host arrays."""
    import cupy as cp
    from cupy.cuda import nccl
    sys.path.insert(0, str(ROOT / "tests"))
    from cupyflash import distributed as cfd
    from gpu_checks import DTYPES
    from reference import random_array
    cp.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(WORLD, nccl_id, rank)
    dtype, seqlen, h, hk, d, causal, seed = config
    full = [random_array(cp, (2, seqlen, n, d), DTYPES[dtype], seed + i) for i, n in enumerate((h, hk, hk, h))]
    q, k, v, dout = (cfd.shard(x, rank, WORLD) for x in full)
    out, lse = cfd.ring_attention(q, k, v, comm, causal=causal, return_lse=True)
    grads = cfd.ring_attention_backward(dout, q, k, v, out, lse, comm, causal=causal)
    results.put((rank, [cp.asnumpy(x) for x in (out, lse) + tuple(grads)]))


@pytest.mark.parametrize("causal", [False, True])
def test_cupy_nccl_ring_under_the_rule(causal):
    """Two processes over CuPy's NCCL (zigzag, GQA 4 / 2, chunks of 97 rows): out, lse and the
    gradients, unsharded, against the float64 reference on GPU 0 by the tolerance rule."""
    import cupy as cp
    from cupy.cuda import nccl
    from cupyflash import distributed as cfd
    from gpu_checks import DTYPES, Case, check_backward, check_forward
    from reference import random_array
    config = ("bf16", WORLD * 2 * 97, 4, 2, 128, causal, 7 + causal)
    ctx = mp.get_context("spawn")
    results, nccl_id = ctx.Queue(), nccl.get_unique_id()
    procs = [ctx.Process(target=_rank, args=(r, nccl_id, config, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
        assert p.exitcode == 0
    dtype, seqlen, h, hk, d, _, seed = config
    full = [random_array(cp, (2, seqlen, n, d), DTYPES[dtype], seed + i) for i, n in enumerate((h, hk, hk, h))]
    out, lse, dq, dk, dv = (cp.asarray(cfd.unshard([got[r][i] for r in range(WORLD)], axis=2 if i == 1 else 1))
                            for i in range(5))
    case = Case(dtype, seqlen, seqlen, d, causal, batch=2, nheads=h, nheads_k=hk)
    check_forward(case, *full[:3], out, lse, d ** -0.5)
    check_backward(case, full[3], *full[:3], (dq, dk, dv), d ** -0.5, out=out, lse=lse)
    assert np.isfinite(cp.asnumpy(lse)).all()
