"""Public functions: exact FlashAttention forward and backward."""
import math

import numpy as np

from . import _arrays, _config, _spec, _validate


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                    block_mask=None, return_lse=False):
    """Exact attention ``softmax(q k^T * softmax_scale) v``, computed tile by tile.

    Parameters
    ----------
    q : array, (batch, seqlen_q, nheads, headdim)
    k, v : arrays, (batch, seqlen_k, nheads_k, headdim)
        ``nheads % nheads_k == 0``: query head ``h`` uses kv head ``h // (nheads // nheads_k)``
        (grouped-query / multi-query attention). float16, bfloat16 (tensor cores, fp32
        accumulation), float32 or float64 (at their own precision). Any strides with the
        last dimension contiguous are read in place. headdim <= 256.
        NumPy arrays run the same tiled algorithm on the CPU in float64 (the reference);
        CuPy arrays and objects with ``__dlpack__`` run on their GPU.
    causal : bool
        Mask keys after the query. With ``seqlen_q != seqlen_k`` the mask is aligned to the
        bottom-right corner: query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``::

            seqlen_q=2, seqlen_k=5:     seqlen_q=5, seqlen_k=2:
              1 1 1 1 0                   0 0
              1 1 1 1 1                   0 0
                                          0 0
                                          1 0
                                          1 1

        A row that sees no key gets output 0 and lse ``-inf``.
    softmax_scale : float, optional
        Defaults to ``headdim ** -0.5``.
    window_size : (int, int)
        ``(left, right)``, local (sliding-window) attention as in FlashAttention 2, aligned
        bottom-right like ``causal``: query ``i`` sees keys ``j`` with ``i + seqlen_k -
        seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right``; -1 leaves that side
        unbounded (the default ``(-1, -1)`` is no window). With ``causal`` the right side is
        0. Not yet with ``block_mask`` (ValueError)::

            seqlen_q=4, seqlen_k=6,     window_size=(2, 0)
            window_size=(1, 1):         (or (2, -1) with causal):
              0 1 1 1 0 0                 1 1 1 0 0 0
              0 0 1 1 1 0                 0 1 1 1 0 0
              0 0 0 1 1 1                 0 0 1 1 1 0
              0 0 0 0 1 1                 0 0 0 1 1 1

    softcap : float
        > 0: each score ``s = q.k * softmax_scale`` becomes ``softcap * tanh(s / softcap)``
        (Gemma 2, Grok), so that scores stay within ``(-softcap, softcap)``; 0 (the
        default) leaves them as they are.
    alibi_slopes : array, optional
        float32, (nheads,) or (batch, nheads), of q's kind and device. ALiBi: the bias
        ``-alibi_slopes[b, h] * |i + seqlen_k - seqlen_q - j|`` is added to the (capped)
        score of query ``i`` and key ``j``. Order of the score's steps, as in FlashAttention
        2: ``q.k * softmax_scale``, softcap, ALiBi bias, then the masks (causal, window,
        block mask) and the softmax.
    dropout_p : float
        In ``[0, 1)``. Dropout of the attention weights as in FlashAttention 2: ``out =
        (softmax(s) * keep / (1 - dropout_p)) v`` with ``keep`` a Bernoulli(1 - dropout_p)
        mask per (batch, head, query, key), generated on the fly from ``seed`` and
        ``offset`` and never stored; ``cupyflash.dropout_mask`` returns it. lse is that of
        the softmax before dropout. 0 (the default) is no dropout and costs nothing. NumPy
        path only for now: GPU inputs (CuPy, or device arrays through DLPack) with
        ``dropout_p > 0`` raise NotImplementedError.
    seed : int, optional
        In ``[0, 2**64)``, the key of the generator (Philox4x32-10). Required when
        ``dropout_p > 0``: none is drawn implicitly, because the backward must be given the
        same seed to regenerate the same mask (ValueError without one).
    offset : int
        In ``[0, 2**32)``: another stream of bits under the same seed, e.g. one per training
        step or per layer.
    block_mask : BlockMask, optional
        Block-sparse attention: only the kept blocks are visited (masked-out blocks cost no
        memory traffic and no math). The result equals dense attention with the element mask
        ``block_mask.to_dense()`` (and the causal mask if ``causal``); see ``cupyflash.masks``.
    return_lse : bool
        Also return ``lse = log(sum_j exp(s_ij))`` (natural log, ``s_ij`` the final scores,
        bias included), (batch, nheads, seqlen_q), float32 (float64 for float64 inputs),
        which the backward pass needs.

    Returns
    -------
    out : array like q (same kind, device and dtype), or ``(out, lse)``.

    Notes
    -----
    NaN and infinity follow the arithmetic, on every path: a NaN in query row ``i`` makes row
    ``i`` of out and lse NaN and changes no other row; a NaN, or a +inf score, from key ``j``
    makes NaN exactly the rows that see key ``j`` (masks, ``causal`` and ``window_size``
    decide which); a key whose score is -inf gets weight 0, and a row left with no key of
    nonzero weight gets 0 and lse ``-inf``. Masks never create NaN. ``softcap`` maps a
    score of +-inf to +-softcap (``tanh``): under it an infinite score is an ordinary one,
    and only NaN spreads. Non-finite values in
    ``v`` reach the rows that see them, and may also reach rows of the same tile that do not
    (``0 * NaN`` in the matrix product).

    Arrays of other frameworks are read in place through DLPack and the results are handed
    back the same way, without copies. The kernels run on the inputs' GPU and are queued on
    the caller's current stream: PyTorch's current stream when q is a PyTorch tensor, else
    CuPy's current stream (JAX orders its work against ours through DLPack). Nothing
    synchronizes the host. Host and device arrays cannot be mixed in one call; device arrays
    of different frameworks on one GPU can, and the results take q's kind. The same holds for
    ``flash_attention_backward``.
    """
    causal = _validate.check_flag("causal", causal)
    return_lse = _validate.check_flag("return_lse", return_lse)
    window_size = _validate.check_window_size(window_size, block_mask)
    dropout_p, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
    (q, k, v), alibi_slopes, kind, xp = _as_backend((q, k, v), ("q", "k", "v"), alibi_slopes)
    _validate.check_forward(q, k, v, softmax_scale)
    spec, scale = _call_spec(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             dropout_p, block_mask)
    with _arrays.launch_context(kind):
        if xp is np:
            from . import _numpy_backend
            out, lse = _numpy_backend.forward(q, k, v, scale, spec, block_mask, alibi_slopes,
                                              seed, offset)
        else:
            out, lse = _forward_gpu(q, k, v, scale, spec, block_mask, alibi_slopes, seed, offset)
        out = _arrays.to_caller(out, kind)
        return (out, _arrays.to_caller(lse, kind)) if return_lse else out


def flash_attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             dropout_p=0.0, seed=None, offset=0, block_mask=None,
                             deterministic=False):
    """Gradients of ``flash_attention`` with respect to q, k and v.

    Parameters
    ----------
    dout : array like ``out``, the gradient of the loss with respect to ``out``.
    q, k, v, out, lse : the forward's inputs, output and lse (``return_lse=True``).
    causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed, offset, block_mask
        Exactly as given to the forward that made ``out`` and ``lse``. Nothing records
        them there, so they cannot be checked: other values give wrong gradients, silently.
        The gradient goes through the softcap (``1 - tanh(s / softcap)**2``); the ALiBi
        slopes are constants (no gradient). With dropout the mask is regenerated from
        ``seed`` and ``offset`` (never stored): ``dv = (P * keep / (1 - dropout_p))^T
        dout``, and ``dP = dout v^T`` is dropped and scaled the same way.
    deterministic : bool
        Compute dq in its own query-block-parallel pass instead of adding it up with
        atomics, so that repeated calls give bit-identical dq (a little slower).

    Returns
    -------
    dq, dk, dv : arrays shaped like q, k and v. With grouped heads, dk and dv are summed
        over the query heads of each group.
    """
    causal = _validate.check_flag("causal", causal)
    deterministic = _validate.check_flag("deterministic", deterministic)
    window_size = _validate.check_window_size(window_size, block_mask)
    dropout_p, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
    names = ("dout", "q", "k", "v", "out", "lse")
    arrays, alibi_slopes, kind, xp = _as_backend((dout, q, k, v, out, lse), names,
                                                 alibi_slopes)
    dout, q, k, v, out, lse = arrays
    _validate.check_backward(dout, q, k, v, out, lse, softmax_scale)
    spec, scale = _call_spec(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             dropout_p, block_mask)
    with _arrays.launch_context(kind):
        if xp is np:
            from . import _numpy_backend
            grads = _numpy_backend.backward(dout, q, k, v, out, lse, scale, spec, block_mask,
                                            alibi_slopes, seed, offset)
        else:
            grads = _backward_gpu(dout, q, k, v, out, lse, scale, spec, block_mask,
                                  alibi_slopes, seed, offset, deterministic)
        return tuple(_arrays.to_caller(g, kind) for g in grads)


def _as_backend(arrays, names, alibi_slopes):
    """``_arrays.as_backend`` of the call's arrays, the slopes (when given) among them, so
    that they convert, and mix or not, as q does. Returns (arrays, slopes, caller, xp)."""
    if alibi_slopes is None:
        converted, kind, xp = _arrays.as_backend(arrays, names)
        return converted, None, kind, xp
    converted, kind, xp = _arrays.as_backend((*arrays, alibi_slopes), (*names, "alibi_slopes"))
    return converted[:-1], converted[-1], kind, xp


def _call_spec(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
               block_mask):
    """Checks the rest of the call against q and k; returns its CallSpec and softmax scale."""
    scale = _scale(softmax_scale, q.shape[-1])
    softcap = _validate.check_softcap(softcap, q.dtype)
    _validate.check_alibi_slopes(alibi_slopes, q)
    if block_mask is not None:
        _validate.check_block_mask(block_mask, q, k)
        causal = causal or block_mask.causal
    spec = _spec.CallSpec.of(q, causal=causal, window_size=window_size, softcap=softcap,
                             alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                             block_mask=block_mask)
    return spec, scale


def _scale(softmax_scale, headdim):
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _forward_gpu(q, k, v, scale, spec, block_mask, alibi_slopes, seed, offset):
    """Runs inside the caller's device and stream (``_arrays.launch_context``)."""
    import cupy as cp
    from . import _launch
    _launch.check_supported(spec, block_mask)
    b, sq, h, _ = q.shape
    out = cp.empty(q.shape, q.dtype)
    lse = cp.empty((b, h, sq), _config.lse_dtype(q.dtype))
    _launch.forward(q, k, v, out, lse, scale, spec, block_mask, alibi_slopes, (seed, offset))
    return out, lse


def _backward_gpu(dout, q, k, v, out, lse, scale, spec, block_mask, alibi_slopes, seed, offset,
                  deterministic):
    import cupy as cp
    from . import _launch
    _launch.check_supported(spec, block_mask)
    b, sq, h, _ = q.shape
    dq = cp.empty(q.shape, q.dtype)
    dk = cp.empty(k.shape, k.dtype)
    dv = cp.empty(v.shape, v.dtype)
    # The kernels read lse in its own dtype: a float32 lse given with float64 inputs is widened.
    lse = cp.ascontiguousarray(lse, dtype=_config.lse_dtype(q.dtype))
    stats = cp.empty((2, b, h, sq), _config.lse_dtype(q.dtype))   # D and lse in log2 units
    use_atomics = q.dtype.name in _launch.TENSOR_CORE and not deterministic
    dq_accum = cp.zeros(_launch.dq_accum_shape(q.shape), cp.float32) if use_atomics else None
    _launch.backward(dout, q, k, v, out, lse, dq, dk, dv, stats, dq_accum, scale, spec,
                     block_mask, alibi_slopes, (seed, offset))
    return dq, dk, dv
