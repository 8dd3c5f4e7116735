"""One forward and one backward at bf16, d=128, seqlen 8K (batch 2, 16 heads), after a
warm-up, for a profiler to look at:

    ncu -k regex:flash_ --launch-skip 4 -c 3 --section SpeedOfLight ... python benchmarks/profile_once.py
"""
import cupy as cp
import ml_dtypes

import cupyflash as cf

shape = (2, 8192, 16, 128)
q, k, v, dout = (cp.random.standard_normal(shape, dtype=cp.float32).astype(ml_dtypes.bfloat16)
                 for _ in range(4))
for _ in range(2):
    out, lse = cf.flash_attention(q, k, v, return_lse=True)
    cf.flash_attention_backward(dout, q, k, v, out, lse)
cp.cuda.Device().synchronize()
