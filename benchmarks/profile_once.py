"""One forward and one backward at bf16 over 16K tokens, 2048/headdim heads (default d=128,
seqlen 8K, batch 2), after a warm-up, for a profiler to look at; ``--impl sdpa`` runs PyTorch
SDPA's flash backend (FlashAttention 2) on the same problem instead, to compare the two kernels' counters:

    ncu -k regex:flash_ --launch-skip 4 -c 3 --section SpeedOfLight ... python benchmarks/profile_once.py
"""
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--impl", choices=("ours", "sdpa"), default="ours")
parser.add_argument("--causal", action="store_true")
parser.add_argument("--headdim", type=int, default=128)
parser.add_argument("--seqlen", type=int, default=8192)
parser.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=(-1, -1),
                    help="window_size (ours only)")
args = parser.parse_args()
if args.impl == "sdpa" and tuple(args.window) != (-1, -1):
    parser.error("--window: SDPA's flash backend has no window")

shape = (max(1, 16384 // args.seqlen), args.seqlen, 2048 // args.headdim, args.headdim)
if args.impl == "ours":
    import cupy as cp
    import ml_dtypes

    import cupyflash as cf

    q, k, v, dout = (cp.random.standard_normal(shape, dtype=cp.float32).astype(ml_dtypes.bfloat16)
                     for _ in range(4))
    for _ in range(2):
        kw = dict(causal=args.causal, window_size=tuple(args.window))
        out, lse = cf.flash_attention(q, k, v, return_lse=True, **kw)
        cf.flash_attention_backward(dout, q, k, v, out, lse, **kw)
    cp.cuda.Device().synchronize()
else:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, dout = (torch.randn(shape[0], shape[2], shape[1], shape[3], device="cuda",
                                 dtype=torch.bfloat16) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(2):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
            out.backward(dout)
    torch.cuda.synchronize()
