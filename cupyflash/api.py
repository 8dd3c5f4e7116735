"""Public functions: exact FlashAttention forward and backward."""
import math
import os
import sys

import numpy as np

from . import _arrays, _config, _spec, _validate, mods


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                    block_mask=None, score_mod=None, mask_mod=None, return_lse=False):
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
        (softmax(s) * keep / (1 - p)) v`` with ``keep`` a Bernoulli(1 - p) mask per (batch,
        head, query, key), generated on the fly from ``seed`` and ``offset`` and never
        stored; ``cupyflash.dropout_mask`` returns it. ``p`` is ``dropout_p`` at the
        generator's 1/256 resolution (``cupyflash.dropout.effective_p``: the nearest multiple
        of 1/256, at least 1/256). lse is that of the softmax before dropout. 0 (the default)
        is no dropout and costs nothing. On the GPU, dropout with ``softcap``,
        ``alibi_slopes`` or a ``score_mod`` raises NotImplementedError.
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
        A mask from ``cupyflash.masks.from_mask_mod`` also applies its rule per element.
    score_mod : cupyflash.ScoreMod or callable, optional
        A rule of the caller's for the scores (``cupyflash.mods``): each score ``s = q.k *
        softmax_scale`` of query ``q_idx``, key ``kv_idx``, batch entry ``b`` and query head
        ``h`` becomes ``score_mod(s, b, h, q_idx, kv_idx)`` before the masks and the softmax.
        Its CUDA snippet runs on the GPU, its ``python`` rule (or the callable itself) on
        NumPy inputs. Not with ``softcap`` or ``alibi_slopes`` (write them into the rule), nor
        with ``dropout_p > 0`` on the GPU (NotImplementedError).
    mask_mod : cupyflash.MaskMod or callable, optional
        A rule for which keys each query sees, ``mask_mod(b, h, q_idx, kv_idx) -> bool``,
        ANDed with ``causal``. The call first classifies its blocks (``masks.from_mask_mod``
        over this call's batch and heads; build that mask once and pass it as
        ``block_mask=`` to save the classification on every call). Not with ``block_mask`` or
        ``window_size``.
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
    ``flash_attention_backward``. PyTorch tensors traced by ``torch.compile`` or
    ``torch.export`` go to the custom operators of ``cupyflash.torch`` (no graph break).
    """
    if _traced_by_torch(q):
        from . import torch as torch_ops
        return torch_ops.traced_forward(
            q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
            offset=offset, block_mask=block_mask, score_mod=score_mod, mask_mod=mask_mod,
            return_lse=_validate.check_flag("return_lse", return_lse))
    key = _plain_signature((q, k, v, alibi_slopes),
                           ("fwd", causal, softmax_scale, window_size, softcap, dropout_p, return_lse),
                           block_mask, score_mod, mask_mod)
    checked = _CHECKED.get(key)
    if checked is not None:
        spec, scale, return_lse = checked
        _, seed, offset = _validate.check_dropout(dropout_p, seed, offset)   # they change per step
        with _arrays.launch_context(_checked_caller(q)):
            out, lse = _forward_gpu(q, k, v, scale, spec, None, alibi_slopes, seed, offset, [])
        return (out, lse) if return_lse else out
    causal = _validate.check_flag("causal", causal)
    return_lse = _validate.check_flag("return_lse", return_lse)
    score_mod, mask_mod = _check_mods(score_mod, mask_mod, block_mask, window_size)
    window_size = _validate.check_window_size(window_size, block_mask)
    dropout_p, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
    (q, k, v), alibi_slopes, user, kind, xp = _as_backend(
        (q, k, v), ("q", "k", "v"), alibi_slopes, score_mod, mask_mod, block_mask)
    _validate.check_forward(q, k, v, softmax_scale)
    user_mods = _user_mods(score_mod, mask_mod, block_mask, xp)
    block_mask = _mask_of(mask_mod, block_mask, q, k, xp)
    spec, scale = _call_spec(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             dropout_p, block_mask, score_mod, user_mods)
    _remember(key, (spec, scale, return_lse))
    with _arrays.launch_context(kind):
        if xp is np:
            from . import _numpy_backend
            out, lse = _numpy_backend.forward(q, k, v, scale, spec, block_mask, alibi_slopes,
                                              seed, offset, score_mod, dict(user))
        else:
            out, lse = _forward_gpu(q, k, v, scale, spec, block_mask, alibi_slopes, seed, offset,
                                    user)
        out = _arrays.to_caller(out, kind)
        return (out, _arrays.to_caller(lse, kind)) if return_lse else out


def flash_attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             dropout_p=0.0, seed=None, offset=0, block_mask=None,
                             score_mod=None, mask_mod=None, deterministic=False):
    """Gradients of ``flash_attention`` with respect to q, k and v.

    Parameters
    ----------
    dout : array like ``out``, the gradient of the loss with respect to ``out``.
    q, k, v, out, lse : the forward's inputs, output and lse (``return_lse=True``).
    causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed, offset, block_mask, score_mod, mask_mod
        Exactly as given to the forward that made ``out`` and ``lse``. Nothing records
        them there, so they cannot be checked: other values give wrong gradients, silently.
        The gradient goes through the softcap (``1 - tanh(s / softcap)**2``); the ALiBi
        slopes are constants (no gradient). With dropout the mask is regenerated from
        ``seed`` and ``offset`` (never stored): ``dv = (P * keep / (1 - dropout_p))^T
        dout``, and ``dP = dout v^T`` is dropped and scaled the same way. A score_mod needs
        its gradient rule (``grad`` on the GPU, ``python_grad`` on NumPy inputs; ValueError
        without).
    deterministic : bool
        Compute dq in its own query-block-parallel pass instead of adding it up with
        atomics, so that repeated calls give bit-identical dq (a little slower).

    Returns
    -------
    dq, dk, dv : arrays shaped like q, k and v. With grouped heads, dk and dv are summed
        over the query heads of each group.
    grads : dict, only with a score_mod that names ``grad_arrays``
        The gradients of those arrays by name, shaped like them (float32 on the GPU, float64
        for float64 inputs and on the NumPy path), as a fourth result.
    """
    if _traced_by_torch(q):
        from . import torch as torch_ops
        return torch_ops.traced_backward(
            dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            dropout_p=dropout_p, seed=seed, offset=offset, block_mask=block_mask,
            score_mod=score_mod, mask_mod=mask_mod, deterministic=deterministic)
    key = _plain_signature((dout, q, k, v, out, lse, alibi_slopes),
                           ("bwd", causal, softmax_scale, window_size, softcap, dropout_p, deterministic),
                           block_mask, score_mod, mask_mod)
    checked = _CHECKED.get(key)
    if checked is not None:
        spec, scale, deterministic = checked
        _, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
        with _arrays.launch_context(_checked_caller(q)):
            return _backward_gpu(dout, q, k, v, out, lse, scale, spec, None, alibi_slopes, seed, offset,
                                 deterministic, None, [])
    causal = _validate.check_flag("causal", causal)
    deterministic = _validate.check_flag("deterministic", deterministic)
    score_mod, mask_mod = _check_mods(score_mod, mask_mod, block_mask, window_size)
    window_size = _validate.check_window_size(window_size, block_mask)
    dropout_p, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
    names = ("dout", "q", "k", "v", "out", "lse")
    arrays, alibi_slopes, user, kind, xp = _as_backend(
        (dout, q, k, v, out, lse), names, alibi_slopes, score_mod, mask_mod, block_mask)
    dout, q, k, v, out, lse = arrays
    _validate.check_backward(dout, q, k, v, out, lse, softmax_scale)
    user_mods = _user_mods(score_mod, mask_mod, block_mask, xp)
    gradient = None if score_mod is None else (
        score_mod.grad if xp is not np else score_mod.python_grad)
    if score_mod is not None and gradient is None:
        which = "grad= (CUDA)" if xp is not np else "python_grad="
        raise ValueError(f"score_mod has no gradient rule for these inputs: the backward needs "
                         f"d loss / d score from dscore; give the ScoreMod {which}")
    block_mask = _mask_of(mask_mod, block_mask, q, k, xp)
    spec, scale = _call_spec(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes,
                             dropout_p, block_mask, score_mod, user_mods)
    _remember(key, (spec, scale, deterministic))
    with _arrays.launch_context(kind):
        if xp is np:
            from . import _numpy_backend
            grads = _numpy_backend.backward(dout, q, k, v, out, lse, scale, spec, block_mask,
                                            alibi_slopes, seed, offset, score_mod, dict(user))
        else:
            grads = _backward_gpu(dout, q, k, v, out, lse, scale, spec, block_mask,
                                  alibi_slopes, seed, offset, deterministic, score_mod, user)
        if len(grads) == 4:
            return (*(_arrays.to_caller(g, kind) for g in grads[:3]),
                    {n: _arrays.to_caller(g, kind) for n, g in grads[3].items()})
        return tuple(_arrays.to_caller(g, kind) for g in grads)


# The checked calls by signature (``_signature``), each with what its checks made of its
# options (CallSpec, scale, ...): a loop that calls again with arrays of the same shapes and
# the same options skips the checks (about a third of an eager call's host time). Only calls
# whose arrays are all CuPy ndarrays, with no block mask or user mods, are kept: everything
# their checks read is then in the signature. (check_supported, inside _forward_gpu and
# _backward_gpu, still runs: it raises for the GPU of the call.)
MAX_CHECKED = 1024
_CHECKED = {}


def _signature(arrays, options):
    """The key of a call with ``arrays`` (None where absent) and ``options``: each array's
    shape, strides, dtype and device, and each option's type and value (a tuple's, element by
    element); None where any array is not a CuPy ndarray or an option is unhashable, and
    where CUPYFLASH_LAUNCH_PLANS=0 (every call checked and prepared afresh, _launch._planned)."""
    cp = sys.modules.get("cupy")
    if cp is None or os.environ.get("CUPYFLASH_LAUNCH_PLANS") == "0":
        return None
    shapes = []
    for a in arrays:
        if a is None:
            shapes.append(None)
        elif type(a) is cp.ndarray:
            shapes.append((a.shape, a.strides, a.dtype, a.data.device_id))
        else:
            return None
    key = (tuple(shapes), _typed(options))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _plain_signature(arrays, options, block_mask, score_mod, mask_mod):
    """``_signature`` of a dense call, None with a block mask or user mods (their objects'
    contents are not in a signature)."""
    if block_mask is None and score_mod is None and mask_mod is None:
        return _signature(arrays, options)
    return None


def _checked_caller(q):
    """The Caller of a call found by its signature: its arrays are CuPy ndarrays on q's GPU
    (what _arrays.as_backend makes of them)."""
    return _arrays.Caller("cupy", q.data.device_id, q)


def _typed(value):
    if type(value) is tuple:
        return (tuple, tuple(_typed(x) for x in value))
    return (type(value), value)


def _remember(key, checked):
    """Keep a call's ``checked`` options under its signature (``key``: None keeps nothing) once
    its checks have passed."""
    if key is None:
        return
    if len(_CHECKED) >= MAX_CHECKED:
        _CHECKED.clear()
    _CHECKED[key] = checked


def _traced_by_torch(q):
    """True when ``torch.compile`` (Dynamo) or ``torch.export`` traces this call with PyTorch
    tensors, which have no data to read then: the call goes to cupyflash.torch's custom
    operators instead. Imports PyTorch only when q is a tensor (so it is loaded already).
    Not ``torch.compiler.is_compiling()``: it stays true through a whole compile session,
    in which an operator's real body (which calls this function) could also run."""
    if type(q).__module__.split(".")[0] != "torch":
        return False
    import torch
    return torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting()


def _check_mods(score_mod, mask_mod, block_mask, window_size):
    """``score_mod`` and ``mask_mod`` as mods.ScoreMod / MaskMod (or None); a mask_mod
    replaces a block mask and cannot be combined with one or with a window."""
    score_mod, mask_mod = mods.as_score_mod(score_mod), mods.as_mask_mod(mask_mod)
    if mask_mod is not None and block_mask is not None:
        raise ValueError("mask_mod and block_mask cannot be combined: a mask_mod makes its own "
                         "block mask (masks.from_mask_mod); write the blocks into the rule")
    if mask_mod is not None and tuple(window_size) != (-1, -1):
        raise ValueError("mask_mod and window_size cannot be combined yet; write the window "
                         "into the rule")
    return score_mod, mask_mod


def _rule_mask(mask_mod, block_mask):
    """The call's mask rule: ``mask_mod=``, or a BlockMask's own (the block mask is validated
    later; anything else has none)."""
    return mask_mod if mask_mod is not None else getattr(block_mask, "mask_mod", None)


def _user_mods(score_mod, mask_mod, block_mask, xp):
    """Each mod has the rule its inputs run: CUDA code for GPU inputs, checked through NVRTC
    (SnippetError) before anything is allocated, or a Python callable for NumPy inputs.
    Returns the kernels' ``struct UserMods`` (``mods.prelude``; "" on the NumPy path)."""
    mask_mod = _rule_mask(mask_mod, block_mask)
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is None:
            continue
        if xp is not np and mod.cuda is None:
            raise ValueError(f"{name} has no CUDA rule (cuda=) for GPU inputs")
        if xp is np and mod.python is None:
            raise ValueError(f"{name} has no python rule (python=) for NumPy inputs")
    if xp is np:
        return ""
    text = mods.prelude(score_mod, mask_mod)
    if text:
        mods.check_prelude(text)
    return text


def _as_backend(arrays, names, alibi_slopes, score_mod=None, mask_mod=None, block_mask=None):
    """``_arrays.as_backend`` of the call's arrays, the slopes and the user mods' arrays
    among them, so that they convert, and mix or not, as q does. Returns (arrays, slopes,
    the mods' arrays as [(name, C-contiguous array)] in slot order, caller, xp)."""
    slots = mods.slots(score_mod, _rule_mask(mask_mod, block_mask))
    extra = ([alibi_slopes] if alibi_slopes is not None else []) + [a for _, _, a in slots]
    extra_names = (["alibi_slopes"] if alibi_slopes is not None else []) + \
        [f"{owner} array {name!r}" for owner, name, _ in slots]
    converted, kind, xp = _arrays.as_backend((*arrays, *extra), (*names, *extra_names))
    n = len(arrays)
    slopes = converted[n] if alibi_slopes is not None else None
    user = [(name, xp.ascontiguousarray(a))
            for (_, name, _), a in zip(slots, converted[n + (alibi_slopes is not None):])]
    return converted[:n], slopes, user, kind, xp


def _mask_of(mask_mod, block_mask, q, k, xp):
    """The block mask of the call: the one given, or the blocks of ``mask_mod`` classified
    over this call's batch and heads, where the call runs."""
    if mask_mod is None:
        return block_mask
    if xp is not np:
        _arrays.refuse_in_capture(
            xp, "a mask_mod without block_mask is classified into blocks at every call (with a "
                "copy to the host)", "build its BlockMask once with BlockMask.from_mask_mod "
                                     "before capturing and pass block_mask=")
    from . import masks
    return masks.classify_mask_mod(mask_mod, q.shape[1], k.shape[1], batch=q.shape[0],
                                   nheads=q.shape[2], on_gpu=xp is not np)


def _call_spec(q, k, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
               block_mask, score_mod, user_mods, batch=None):
    """Checks the rest of the call against q and k; returns its CallSpec and softmax scale.
    ``user_mods`` is the GPU kernels' text of the mods (``_user_mods``); ``batch``: the
    number of sequences of a packed batch (q is then its (1, total_q, ...) view)."""
    scale = _scale(softmax_scale, q.shape[-1])
    softcap = _validate.check_softcap(softcap, q.dtype)
    _validate.check_alibi_slopes(alibi_slopes, q, batch)
    mask_mod = None
    if block_mask is not None:
        _validate.check_block_mask(block_mask, q, k)
        if block_mask.mask_batch not in (None, q.shape[0]):
            # Its blocks (and which are full) are those of the entries it was classified over.
            raise ValueError(f"block_mask: built by from_mask_mod for batch="
                             f"{block_mask.mask_batch}, but q has batch {q.shape[0]}; build it "
                             f"with this batch (or batch=None for a rule that ignores b)")
        causal = causal or block_mask.causal
        mask_mod = block_mask.mask_mod
    if score_mod is not None and (softcap or alibi_slopes is not None):
        raise ValueError("score_mod cannot be combined with softcap or alibi_slopes: write "
                         "them into the score_mod")
    spec = _spec.CallSpec.of(q, causal=causal, window_size=window_size, softcap=softcap,
                             alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                             block_mask=block_mask, score_mod=score_mod, mask_mod=mask_mod,
                             user_mods=user_mods)
    return spec, scale


def _scale(softmax_scale, headdim):
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _forward_gpu(q, k, v, scale, spec, block_mask, alibi_slopes, seed, offset, user, packed=None):
    """Runs inside the caller's device and stream (``_arrays.launch_context``). ``packed``: the
    _launch.Packed of a packed batch, whose q, k, v come as (1, total, nheads, headdim) views
    and whose lse is (nheads, total_q)."""
    import cupy as cp
    from . import _launch
    _launch.check_supported(spec, block_mask)
    b, sq, h, _ = q.shape
    out = cp.empty(q.shape, q.dtype)
    lse = cp.empty((h, sq) if packed is not None else (b, h, sq), _config.lse_dtype(q.dtype))
    with _arrays.scratch(cp):
        _launch.forward(q, k, v, out, lse, scale, spec, block_mask, alibi_slopes, (seed, offset),
                        [a for _, a in user], packed=packed)
    return out, lse


def _backward_gpu(dout, q, k, v, out, lse, scale, spec, block_mask, alibi_slopes, seed, offset,
                  deterministic, score_mod, user, packed=None):
    """As _forward_gpu, for the backward."""
    import cupy as cp
    from . import _launch
    _launch.check_supported(spec, block_mask)
    dq = cp.empty(q.shape, q.dtype)
    dk = cp.empty(k.shape, k.dtype)
    dv = cp.empty(v.shape, v.dtype)
    wanted = score_mod.grad_arrays if score_mod is not None else ()
    gdtype = cp.float64 if q.dtype == cp.float64 else cp.float32   # the kernels' atomics
    _launch.settle()   # the fills and lse's conversion below are the first work queued
    grads = {slot: cp.zeros(a.shape, gdtype) for slot, (name, a) in enumerate(user)
             if name in wanted}
    with _arrays.scratch(cp):
        # The kernels read lse in its own dtype: a float32 lse given with float64 inputs is
        # widened.
        lse = cp.ascontiguousarray(lse, dtype=_config.lse_dtype(q.dtype))
        stats = cp.empty((2,) + lse.shape, lse.dtype)   # D and lse in log2 units
        # dQ in an fp32 buffer, added to by every key block: in any order, or in key order
        # where the Hopper pass runs deterministic=True (else dQ has a pass of its own).
        dq_accum = _launch.dq_buffer(spec, block_mask, deterministic, q, k, v, out, dout, dq, dk, dv,
                                     packed=packed)
        _launch.backward(dout, q, k, v, out, lse, dq, dk, dv, stats, dq_accum, scale, spec,
                         block_mask, alibi_slopes, (seed, offset), [a for _, a in user], grads,
                         deterministic=deterministic, packed=packed)
    if grads:
        return dq, dk, dv, {user[slot][0]: g for slot, g in grads.items()}
    return dq, dk, dv
