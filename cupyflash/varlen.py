"""Packed variable-length batches (FlashAttention's ``varlen`` calls).

A batch of sequences of different lengths is packed along one axis, with no padding: q is
``(total_q, nheads, headdim)``, k and v ``(total_k, nheads_k, headdim)``, and sequence ``b``
holds rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of q and rows ``cu_seqlens_k[b] ..
cu_seqlens_k[b + 1] - 1`` of k and v. Each sequence attends to its own keys only, as one
dense call per sequence would (causal and windows aligned to each sequence's own bottom-right
corner), and no work is spent on padding. lse comes packed as ``(nheads, total_q)``.
"""
import contextlib
import dataclasses

import numpy as np

from . import _arrays, _config, _spec, _validate, mods
from .api import (_CHECKED, _as_backend, _backward_gpu, _call_spec, _checked_caller, _forward_gpu, _remember,
                  _signature, _user_mods)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, *, causal=False, softmax_scale=None,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                           seed=None, offset=0, score_mod=None, return_lse=False,
                           check_offsets=True):
    """``flash_attention`` on a packed batch of sequences of different lengths.

    Parameters
    ----------
    q : array, (total_q, nheads, headdim)
    k, v : arrays, (total_k, nheads_k, headdim)
        The sequences one after another (module docstring); dtypes, strides, GQA and the
        kinds of arrays as for ``flash_attention``.
    cu_seqlens_q, cu_seqlens_k : int32 arrays, (batch + 1,)
        Where each sequence starts, and ``total`` last: ``0 = cu[0] <= cu[1] <= ... <=
        cu[batch] = total``. Of q's kind and device. A sequence may be empty (no queries, or
        no keys: its rows then get output 0 and lse ``-inf``).
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence's length (or more), which sizes the GPU grids. They are read
        from the offsets when not given.
    check_offsets : bool
        True (the default): the offsets are read to the host and checked before the launch,
        a copy of 4 (batch + 1) bytes that waits for the stream, so the host cannot queue
        work ahead of the GPU across the call. With both maximums given the wait comes just
        before the launch, after the host has prepared it. False: they are not read (no
        copy, no wait; FlashAttention's behaviour), both maximums must be given, and the
        offsets are trusted: wrong ones give wrong results or memory faults, unreported.
        Inside a CUDA graph capture they cannot be read, and are trusted as with False.
        NumPy inputs are always checked (their read costs nothing).
    causal, softmax_scale, window_size, softcap, dropout_p, seed, offset, score_mod, return_lse
        As for ``flash_attention``, per sequence: ``b`` (of a score_mod, and of the dropout
        mask) is the sequence's index and ``q_idx``, ``kv_idx`` are positions inside it.
        block_mask and mask_mod are not taken by packed calls.
    alibi_slopes : array, optional
        float32, (nheads,) or (batch, nheads), one row per sequence.

    Returns
    -------
    out : array like q, or ``(out, lse)`` with lse ``(nheads, total_q)`` (float32, float64
        for float64 inputs).
    """
    _refuse_traced(q)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
            window_size, softcap, alibi_slopes, dropout_p, seed, offset, score_mod, check_offsets)
    key = _PackedCall.signature(args, (), return_lse)
    call = _PackedCall.again(key, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, (), dropout_p, seed, offset)
    if call is None:
        call = _PackedCall.of(*args, (), ())
        return_lse = _validate.check_flag("return_lse", return_lse)
        _remember(key, (call.options(), return_lse))
    else:
        call, return_lse = call
    q, k, v = call.arrays
    with _arrays.launch_context(call.kind), call.packed() as packed:
        if call.xp is np:
            out, lse = _numpy_forward(call, packed)
        else:
            out, lse = _gpu_forward(call, packed)
        out = _arrays.to_caller(out, call.kind)
        return (out, _arrays.to_caller(lse, call.kind)) if return_lse else out


def flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q=None, max_seqlen_k=None, *, causal=False,
                                    softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                                    score_mod=None, deterministic=False, check_offsets=True):
    """Gradients of ``flash_attention_varlen`` with respect to q, k and v.

    ``dout`` and ``out`` are like q, ``lse`` the forward's ``(nheads, total_q)``; every other
    argument exactly as given to the forward (nothing records them: other values give wrong
    gradients, silently). ``deterministic`` as for ``flash_attention_backward``,
    ``check_offsets`` as for ``flash_attention_varlen``. Returns
    ``dq, dk, dv`` shaped like q, k and v (and the score_mod's array gradients as a fourth
    result, as ``flash_attention_backward`` does).
    """
    _refuse_traced(q)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
            window_size, softcap, alibi_slopes, dropout_p, seed, offset, score_mod, check_offsets)
    key = _PackedCall.signature(args, (dout, out, lse), deterministic)
    call = _PackedCall.again(key, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, (dout, out, lse),
                             dropout_p, seed, offset)
    if call is None:
        deterministic = _validate.check_flag("deterministic", deterministic)
        call = _PackedCall.of(*args, (dout, out, lse), ("dout", "out", "lse"))
        q = call.arrays[0]
        for name, a in (("dout", call.extra[0]), ("out", call.extra[1])):
            _validate.check_like(name, a, "q", q)
        _validate.check_packed_lse(call.extra[2], q)
        gradient = None if call.score_mod is None else (
            call.score_mod.grad if call.xp is not np else call.score_mod.python_grad)
        if call.score_mod is not None and gradient is None:
            raise ValueError("score_mod has no gradient rule for these inputs: the backward needs "
                             "d loss / d score from dscore")
        _remember(key, (call.options(), deterministic))
    else:
        call, deterministic = call
    dout, out, lse = call.extra
    q, k, v = call.arrays
    with _arrays.launch_context(call.kind), call.packed() as packed:
        if call.xp is np:
            grads = _numpy_backward(call, packed, dout, out, lse)
        else:
            grads = _gpu_backward(call, packed, dout, out, lse, deterministic)
        result = tuple(_arrays.to_caller(g, call.kind) for g in grads[:3])
        if len(grads) == 4:
            return (*result, {n: _arrays.to_caller(g, call.kind) for n, g in grads[3].items()})
        return result


def _refuse_traced(q):
    from .api import _traced_by_torch
    if _traced_by_torch(q):
        raise NotImplementedError("flash_attention_varlen has no torch.compile operator yet; "
                                  "call it outside the compiled region")


@dataclasses.dataclass
class _PackedCall:
    """A packed call's validated arguments: arrays of one backend, its spec and scale."""
    arrays: tuple            # q, k, v
    extra: tuple             # the backward's dout, out, lse
    cu: tuple                # cu_seqlens_q, cu_seqlens_k (contiguous)
    maxima: tuple            # the given max_seqlen_q, max_seqlen_k (None: read them)
    check: bool              # read and check the offsets (check_offsets)
    spec: object
    scale: float
    alibi_slopes: object
    score_mod: object
    user: list
    seed: object
    offset: int
    kind: object
    xp: object

    @classmethod
    def of(cls, q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_size, softcap,
           alibi_slopes, dropout_p, seed, offset, score_mod, check_offsets, extra, extra_names):
        causal = _validate.check_flag("causal", causal)
        check = _validate.check_flag("check_offsets", check_offsets)
        score_mod = mods.as_score_mod(score_mod)
        window_size = _validate.check_window_size(window_size, None)
        dropout_p, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
        names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", *extra_names)
        arrays, alibi_slopes, user, kind, xp = _as_backend(
            (q, k, v, cu_q, cu_k, *extra), names, alibi_slopes, score_mod)
        q, k, v, cu_q, cu_k = arrays[:5]
        maxima = tuple(None if m is None else _validate.check_int(name, m, 0, _validate.INT32_LIMIT - 1)
                       for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)))
        if not check and None in maxima:
            raise ValueError("check_offsets=False needs max_seqlen_q and max_seqlen_k: the "
                             "offsets are not read to find the longest sequences")
        _validate.check_packed(q, k, v, cu_q, cu_k, softmax_scale)
        batch = cu_q.shape[0] - 1
        user_mods = _user_mods(score_mod, None, None, xp)
        spec, scale = _call_spec(q[None], k[None], causal, softmax_scale, window_size, softcap,
                                 alibi_slopes, dropout_p, None, score_mod, user_mods, batch=batch)
        spec = dataclasses.replace(spec, seq=_spec.SEQ_PACKED)
        cu = tuple(xp.ascontiguousarray(c) for c in (cu_q, cu_k))
        return cls((q, k, v), tuple(arrays[5:]), cu, maxima, check, spec, scale, alibi_slopes,
                   score_mod, user, seed, offset, kind, xp)

    @staticmethod
    def signature(args, extra, flag):
        """The key (api._signature) of a call with ``args`` (``of``'s, up to ``check_offsets``),
        the backward's ``extra`` arrays and the last flag (return_lse, deterministic), or None
        (a score_mod, arrays not CuPy's)."""
        (q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_size, softcap, alibi_slopes,
         dropout_p, seed, offset, score_mod, check_offsets) = args
        if score_mod is not None:
            return None
        return _signature((q, k, v, cu_q, cu_k, alibi_slopes, *extra),
                          ("varlen", max_q, max_k, causal, softmax_scale, window_size, softcap, dropout_p,
                           check_offsets, flag))

    def options(self):
        """The call without its arrays (what ``again`` keeps of it)."""
        return dataclasses.replace(self, arrays=(), extra=(), cu=(), alibi_slopes=None, seed=None, offset=0,
                                   kind=None)

    @staticmethod
    def again(key, q, k, v, cu_q, cu_k, alibi_slopes, extra, dropout_p, seed, offset):
        """(the call, its flag) for a signature whose checks passed before (``_remember``), with
        this call's arrays and dropout seed and offset (checked: they change per step), else
        None."""
        checked = _CHECKED.get(key)
        if checked is None:
            return None
        call, flag = checked
        _, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
        cu = tuple(call.xp.ascontiguousarray(c) for c in (cu_q, cu_k))
        return dataclasses.replace(call, arrays=(q, k, v), extra=tuple(extra), cu=cu, alibi_slopes=alibi_slopes,
                                   seed=seed, offset=offset, kind=_checked_caller(q)), flag

    @contextlib.contextmanager
    def packed(self):
        """The offsets as a _launch.Packed with the grids' maximum lengths, checked against
        the arrays after a read to the host, unless they are trusted (check_offsets=False, or
        a CUDA graph is being captured). Enter it inside ``launch_context``, so that the read
        waits on the caller's stream. With both maximums given the grids take them, and the
        check waits until the first launch inside the block
        (``_launch.checked_before_launch``): the host prepares that launch while the GPU
        finishes the work the read waits behind."""
        from . import _launch
        if self.xp is np:
            yield _launch.Packed(*self.cu, *self._longest(self.cu))
            return
        if not self.check or _arrays.capturing(self.xp):
            if None in self.maxima:
                raise RuntimeError("flash_attention_varlen reads cu_seqlens to the host to find "
                                   "the longest sequences, which cannot run inside a CUDA graph "
                                   "capture: pass max_seqlen_q and max_seqlen_k")
            yield _launch.Packed(*self.cu, *self.maxima)
            return
        copies = _arrays.HostCopy(self.cu)
        if None in self.maxima:
            yield _launch.Packed(*self.cu, *self._longest(copies.wait()))
            return
        with _launch.checked_before_launch(lambda: self._longest(copies.wait())):
            yield _launch.Packed(*self.cu, *self.maxima)

    def _longest(self, host):
        """Each side's longest sequence, its host offsets checked (ValueError)."""
        q, k, _ = self.arrays
        return [_validate.check_cu_seqlens(name, np.asarray(c), a.shape[0], m)
                for name, c, a, m in zip(("cu_seqlens_q", "cu_seqlens_k"), host, (q, k),
                                         self.maxima)]

    def sequences(self, packed):
        """(b, rows of q, rows of k) of each sequence with queries and keys (NumPy path)."""
        cu_q, cu_k = (np.asarray(c) for c in (packed.cu_seqlens_q, packed.cu_seqlens_k))
        for b in range(packed.batch):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if rq.stop > rq.start and rk.stop > rk.start:
                yield b, rq, rk

    def slopes_of(self, b):
        s = self.alibi_slopes
        return s[b:b + 1] if s is not None and s.ndim == 2 else s


def _numpy_forward(call, packed):
    from . import _numpy_backend
    q, k, v = call.arrays
    out = np.zeros(q.shape, q.dtype)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, _config.lse_dtype(q.dtype))
    for b, rq, rk in call.sequences(packed):
        o, l = _numpy_backend.forward(q[None, rq], k[None, rk], v[None, rk], call.scale, call.spec,
                                      None, call.slopes_of(b), call.seed, call.offset,
                                      call.score_mod, dict(call.user), batch0=b)
        out[rq], lse[:, rq] = o[0], l[0]
    return out, lse


def _numpy_backward(call, packed, dout, out, lse):
    from . import _numpy_backend
    q, k, v = call.arrays
    dq, dk, dv = (np.zeros(a.shape, a.dtype) for a in (q, k, v))
    wanted = call.score_mod.grad_arrays if call.score_mod is not None else ()
    sums = {n: np.zeros(np.shape(a)) for n, a in call.user if n in wanted}
    for b, rq, rk in call.sequences(packed):
        grads = _numpy_backend.backward(
            dout[None, rq], q[None, rq], k[None, rk], v[None, rk], out[None, rq], lse[None, :, rq],
            call.scale, call.spec, None, call.slopes_of(b), call.seed, call.offset,
            call.score_mod, dict(call.user), batch0=b)
        dq[rq], dk[rk], dv[rk] = (g[0] for g in grads[:3])
        for n, g in (grads[3].items() if len(grads) == 4 else ()):
            sums[n] += g
    return (dq, dk, dv, sums) if sums else (dq, dk, dv)


def _gpu_forward(call, packed):
    q, k, v = call.arrays
    out, lse = _forward_gpu(q[None], k[None], v[None], call.scale, call.spec, None, call.alibi_slopes,
                            call.seed, call.offset, call.user, packed=packed)
    return out[0], lse


def _gpu_backward(call, packed, dout, out, lse, deterministic):
    q, k, v = call.arrays
    grads = _backward_gpu(dout[None], q[None], k[None], v[None], out[None], lse, call.scale, call.spec,
                          None, call.alibi_slopes, call.seed, call.offset, deterministic, call.score_mod,
                          call.user, packed=packed)
    return (*(g[0] for g in grads[:3]), *grads[3:])
