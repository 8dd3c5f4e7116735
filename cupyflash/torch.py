"""PyTorch autograd for cupyflash: ``flash_attention`` as a ``torch.autograd.Function``.

``import cupyflash.torch`` needs PyTorch; ``import cupyflash`` never imports this module.

The forward saves q, k, v, out and lse (the lse is float32, ``batch * nheads * seqlen_q``
numbers; nothing of size ``seqlen_q x seqlen_k`` is kept) and the backward calls
``cupyflash.flash_attention_backward``. Tensors are read in place through DLPack (any
strides with a contiguous last dimension), and the kernels run on PyTorch's current stream
of the tensors' device. CUDA tensors run the GPU kernels; CPU tensors run the NumPy path.

Not supported: ``torch.compile`` traces around the call (a graph break: the function is not
a registered custom op), double backward, and gradients with respect to ``softmax_scale``,
``softcap``, ``alibi_slopes`` and a user mod's arrays (constants of the call, as in
FlashAttention 2). Dropout
takes an explicit ``seed`` (PyTorch's generator is not drawn from): the backward regenerates
the forward's mask from the saved seed and offset.
"""
try:
    import torch
except ImportError as e:           # pragma: no cover - depends on the environment
    raise ImportError("cupyflash.torch needs PyTorch (pip install torch); the rest of "
                      "cupyflash works without it") from e

from . import _validate, api

__all__ = ["flash_attention", "FlashAttentionFunction"]


class FlashAttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, causal, softmax_scale, block_mask, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, score_mod=None, mask_mod=None)`` ->
    out, differentiable in q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, block_mask, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                score_mod=None, mask_mod=None):
        options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                       softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                       seed=seed, offset=offset, block_mask=block_mask, score_mod=score_mod,
                       mask_mod=mask_mod)
        out, lse = api.flash_attention(q, k, v, return_lse=True, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        # The slopes are an input that gets no gradient: kept as is, like the other options.
        ctx.options = options
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # Autograd may hand a broadcast gradient (e.g. of out.sum(), all strides 0); the
        # kernels read any strides but need the last dimension contiguous.
        if dout.shape[-1] > 1 and dout.stride(-1) != 1:
            dout = dout.contiguous()
        # A score_mod's table gradients (a 4th result) are not inputs of this function.
        dq, dk, dv = api.flash_attention_backward(dout, q, k, v, out, lse, **ctx.options)[:3]
        return (dq, dk, dv) + (None,) * 11


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                    block_mask=None, score_mod=None, mask_mod=None):
    """``cupyflash.flash_attention`` for PyTorch tensors, with autograd.

    Parameters
    ----------
    q : torch.Tensor, (batch, seqlen_q, nheads, headdim)
    k, v : torch.Tensor, (batch, seqlen_k, nheads_k, headdim)
        float16, bfloat16, float32 or float64, on one CUDA device (or all on the CPU, where
        the NumPy path runs). ``nheads % nheads_k == 0`` (GQA/MQA). Note the layout:
        ``torch.nn.functional.scaled_dot_product_attention`` takes (batch, nheads, seqlen,
        headdim); pass ``x.transpose(1, 2)`` of such tensors (read in place, no copy).
    causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed, offset, block_mask, score_mod, mask_mod
        As in ``cupyflash.flash_attention`` (causal and the window are aligned bottom-right
        when ``seqlen_q != seqlen_k``); ``alibi_slopes`` a float32 tensor on q's device;
        ``seed`` an int, required with ``dropout_p > 0`` (the backward reuses it). The arrays
        of a user mod are constants here (no autograd through them): the gradients of its
        ``grad_arrays`` come from ``cupyflash.flash_attention_backward``.

    Returns
    -------
    out : torch.Tensor like q. ``out.backward(...)`` gives q.grad, k.grad and v.grad (k and v
        summed over the query heads of each group).

    Examples
    --------
    >>> import torch, cupyflash.torch as cft
    >>> q = torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16,
    ...                 requires_grad=True)
    >>> out = cft.flash_attention(q, q, q, causal=True)
    >>> out.float().square().sum().backward()
    """
    return FlashAttentionFunction.apply(q, k, v, _validate.check_flag("causal", causal),
                                        softmax_scale, block_mask, window_size, softcap,
                                        alibi_slopes, dropout_p, seed, offset, score_mod,
                                        mask_mod)
