"""JAX: ``flash_attention`` with ``jax.custom_vjp``, eager and under ``jax.jit``, ``jax.vmap``.

``import cupyflash.jax`` needs JAX (0.11 is the version tested); ``import cupyflash`` never
imports this module.

One function, two routes to the same kernels, chosen per call by what JAX hands it:

- Concrete arrays (eager calls, and ``jax.grad`` outside ``jax.jit``): GPU arrays are read in
  place through DLPack, the kernels run on CuPy's current stream of the arrays' GPU, and the
  results come back as JAX arrays sharing our memory. JAX orders its pending writes of the
  inputs before our kernels, and its later reads of the results after them, by the
  ``stream`` argument of the DLPack exchange (no host synchronization).
- Tracers (inside ``jax.jit``, ``jax.vmap``, ``lax.scan``, ``jax.checkpoint``, and ``jax.grad``
  of any of them): the forward and the backward each become one XLA custom call, made with
  ``jax.experimental.buffer_callback``. When the compiled program reaches the call, XLA calls
  back into Python with its own buffers and, on the GPU, its CUDA stream; the kernels
  (compiled by NVRTC at their first use, as in eager calls) are launched on that stream,
  reading XLA's buffers in place, and their results are copied into the buffers XLA
  allocated for them, on the same stream (one device-to-device copy of out and lse in the
  forward, of dq, dk and dv in the backward; nothing goes through the host). Scratch memory
  comes from CuPy's pool, as in eager calls.

Why ``buffer_callback``: it is JAX's own XLA FFI handler (registered by jaxlib for the CPU
and CUDA platforms), which decodes XLA's call frame, hands over the buffers with their shapes
and dtypes, the stream, and turns a Python exception into an XLA error. Registering a
handler of our own from Python (a ``ctypes`` function implementing the XLA FFI C API) would
mirror that C ABI in ``ctypes`` structures kept by hand in step with each XLA release (its
error API, execution stages, handler bundle and metadata have changed between releases), for
no gain: either way the handler is Python code of this process. ``buffer_callback`` lives in
``jax.experimental``; a JAX without it raises ImportError here, at the first traced call.

The options are not XLA attributes: the callback is a Python closure over them, so every
keyword works under ``jax.jit`` as it does eagerly, a ``BlockMask`` (its cached device lists
are reused from call to call), user ``score_mod``/``mask_mod`` rules and their arrays
included. They are constants of the compiled program: ``jax.jit`` traces the Python values
it sees (pass masks and mods through a closure, not as arguments of the jitted function).
``alibi_slopes`` is an operand of the call (it may be traced).

``jax.vmap``: the custom calls use ``vmap_method="broadcast_all"``: arrays that are not mapped
are broadcast along the mapped axis (a copy), and the callback folds the mapped axes into the
batch axis, so that one launch covers the whole mapped batch. So entry ``i`` of a vmapped axis
of size ``n`` over a batch of ``batch`` is batch entry ``i * batch + b`` inside: a
``score_mod``/``mask_mod`` sees that index as ``b``, dropout draws a different mask for each
mapped entry (a Python loop with one seed would repeat one mask), and a BlockMask classified
for a given batch (``masks.from_mask_mod(..., batch=...)``) is refused (ValueError) unless
classified with ``batch=None``.

Errors: the shapes and dtypes of the arrays, the options and a BlockMask's geometry are
checked when the call is traced, with the exceptions and messages of eager calls. What only
the running call knows (whether a mod has a rule for the platform it runs on, a BlockMask
classified for another batch than vmap's folded one) raises inside the callback, and JAX
reports it as a ``JaxRuntimeError`` that carries the original message.

Not supported: forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``: TypeError),
higher-order gradients (NotImplementedError), gradients with respect to ``softmax_scale``, ``softcap`` and ``alibi_slopes``
(constants of the call), a traced dropout ``seed`` (a Python int is required: the backward
regenerates the forward's mask from it), ``jax.export`` or any serialization of a program
that calls this function (the callback is Python code of this process), and programs over
arrays sharded across several devices (XLA has no partitioning rule for the call).

CPU arrays (``jax.devices("cpu")``) run cupyflash's NumPy path, eagerly and under ``jax.jit``:
useful for tests without a GPU, not for speed.
"""
import contextlib
import functools

try:
    import jax
except ImportError as e:           # pragma: no cover - depends on the environment
    raise ImportError("cupyflash.jax needs JAX (pip install jax); the rest of cupyflash "
                      "works without it") from e
import numpy as np

from . import _arrays, _config, _validate, api

__all__ = ["flash_attention"]


def flash_attention(q, k, v, causal=False, softmax_scale=None, block_mask=None, *,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                    seed=None, offset=0, score_mod=None, mask_mod=None):
    """``cupyflash.flash_attention`` for JAX arrays, differentiable with ``jax.grad``, usable
    inside ``jax.jit`` and ``jax.vmap``.

    Parameters
    ----------
    q : jax.Array, (batch, seqlen_q, nheads, headdim)
    k, v : jax.Array, (batch, seqlen_k, nheads_k, headdim)
        float16, bfloat16, float32 (or float64 with ``jax_enable_x64``), on one GPU (or the
        CPU, where the NumPy path runs). Concrete arrays or tracers (``jax.jit``,
        ``jax.vmap``, ...): see the module docstring.
    causal, softmax_scale, block_mask, window_size, softcap, alibi_slopes, dropout_p, seed, offset, score_mod, mask_mod
        As in ``cupyflash.flash_attention``; fixed for the call (not differentiated).
        ``alibi_slopes`` a float32 JAX array on q's device; ``seed`` a Python int, required
        with ``dropout_p > 0``. The arrays of a user mod are constants here: the gradients
        of its ``grad_arrays`` come from ``cupyflash.flash_attention_backward``.

    Returns
    -------
    out : jax.Array like q.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupyflash.jax as cfj
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 4, 64), jnp.bfloat16)
    >>> dq = jax.grad(lambda q: cfj.flash_attention(q, q, q).astype(jnp.float32).sum())(q)
    >>> step = jax.jit(jax.grad(lambda q: cfj.flash_attention(q, q, q, causal=True)
    ...                         .astype(jnp.float32).sum()))
    """
    causal = _validate.check_flag("causal", causal)
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                   softcap=softcap, dropout_p=dropout_p, seed=seed, offset=offset,
                   block_mask=block_mask, score_mod=score_mod, mask_mod=mask_mod)
    return _differentiable(options)(q, k, v, alibi_slopes)


def _differentiable(options):
    """A fresh custom_vjp function per call with the options closed over (so a BlockMask
    need not be hashable, as nondiff_argnums would require). The slopes are an argument,
    not a closure constant, because they may be a tracer; they get no gradient."""
    forward_call = _without_jvp(lambda *arrays: _forward_call(*arrays, options))
    backward_call = _without_jvp(lambda *arrays: _backward_call(*arrays, options))

    @jax.custom_vjp
    def attention(q, k, v, alibi_slopes):
        if _traced(q, k, v, alibi_slopes):
            return forward_call(q, k, v, alibi_slopes)[0]
        return api.flash_attention(q, k, v, alibi_slopes=alibi_slopes, **options)

    def forward(q, k, v, alibi_slopes):
        if _traced(q, k, v, alibi_slopes):
            out, lse = forward_call(q, k, v, alibi_slopes)
        else:
            out, lse = api.flash_attention(q, k, v, alibi_slopes=alibi_slopes,
                                           return_lse=True, **options)
        return out, (q, k, v, out, lse, alibi_slopes)

    def backward(residuals, dout):
        if _traced(dout, *residuals):
            return (*backward_call(dout, *residuals), None)
        # A score_mod's table gradients (a 4th result) are not inputs of this function.
        grads = api.flash_attention_backward(dout, *residuals[:5], alibi_slopes=residuals[5],
                                             **options)
        return (*grads[:3], None)

    attention.defvjp(forward, backward)
    return attention


def _without_jvp(function):
    """``function`` (a custom call) with its derivative refused in our words: else JAX's own
    rule for ``buffer_callback`` answers a higher-order gradient, suggesting custom_jvp."""
    function = jax.custom_jvp(function)
    function.defjvp(_refuse_jvp)
    return function


def _refuse_jvp(primals, tangents):
    raise NotImplementedError("cupyflash.jax.flash_attention has no higher-order gradients "
                              "(its forward and backward passes are not differentiable)")


def _traced(*arrays):
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


# --- the custom calls (traced route) ---------------------------------------------------------

class _Abstract:
    """Shape and dtype of a traced array, with the C-contiguous strides that XLA's buffers
    of a custom call have: enough for the checks of ``cupyflash._validate`` at trace time."""

    def __init__(self, a):
        self.shape, self.dtype = tuple(a.shape), np.dtype(a.dtype)
        self.ndim, self.itemsize = len(self.shape), self.dtype.itemsize
        strides, step = [], self.itemsize
        for n in reversed(self.shape):
            strides.insert(0, step)
            step *= n
        self.strides = tuple(strides)


def _check_at_trace(q, k, v, alibi_slopes, options, dout=None, out=None, lse=None):
    """The checks of ``cupyflash.flash_attention`` (and of the backward, given ``dout``,
    ``out`` and ``lse``) that need no data, so that a wrong call fails when it is traced,
    with the eager call's exception and message."""
    q, k, v, alibi_slopes, dout, out, lse = (
        None if a is None else _Abstract(a) for a in (q, k, v, alibi_slopes, dout, out, lse))
    _validate.check_window_size(options["window_size"], options["block_mask"])
    _validate.check_dropout(options["dropout_p"], options["seed"], options["offset"])
    _validate.check_softcap(options["softcap"], q.dtype)
    if dout is None:
        _validate.check_forward(q, k, v, options["softmax_scale"])
    else:
        _validate.check_backward(dout, q, k, v, out, lse, options["softmax_scale"])
    _validate.check_alibi_slopes(alibi_slopes, q)
    if options["block_mask"] is not None:
        _validate.check_block_mask(options["block_mask"], q, k)


def _forward_call(q, k, v, alibi_slopes, options):
    _check_at_trace(q, k, v, alibi_slopes, options)
    b, sq, h, _ = q.shape
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((b, h, sq), _config.lse_dtype(np.dtype(q.dtype))))
    run = functools.partial(_run_forward, options, _slopes_rank(alibi_slopes))
    operands = (q, k, v) + (() if alibi_slopes is None else (alibi_slopes,))
    return _buffer_callback()(run, results, vmap_method="broadcast_all")(*operands)


def _backward_call(dout, q, k, v, out, lse, alibi_slopes, options):
    _check_at_trace(q, k, v, alibi_slopes, options, dout, out, lse)
    results = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
    run = functools.partial(_run_backward, options, _slopes_rank(alibi_slopes))
    operands = (dout, q, k, v, out, lse) + (() if alibi_slopes is None else (alibi_slopes,))
    return _buffer_callback()(run, results, vmap_method="broadcast_all")(*operands)


def _buffer_callback():
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError as e:       # pragma: no cover - depends on the environment
        raise ImportError(f"cupyflash.jax under jax.jit / jax.vmap needs "
                          f"jax.experimental.buffer_callback, which JAX {jax.__version__} "
                          f"does not have (tested with JAX 0.11)") from e
    return buffer_callback


def _slopes_rank(alibi_slopes):
    return None if alibi_slopes is None else alibi_slopes.ndim


# --- the callbacks, run by XLA when the compiled program reaches the call --------------------

def _run_forward(options, slopes_rank, context, results, q, k, v, *slopes):
    with _on_platform(context, q) as view:
        q, k, v = (_fold(view(a), 4) for a in (q, k, v))
        alibi_slopes = _fold_slopes(view, slopes, slopes_rank, q.shape[0])
        out, lse = api.flash_attention(q, k, v, alibi_slopes=alibi_slopes, return_lse=True,
                                       **options)
        _fold(view(results[0]), 4)[...] = out
        _fold(view(results[1]), 3)[...] = lse


def _run_backward(options, slopes_rank, context, results, dout, q, k, v, out, lse, *slopes):
    with _on_platform(context, q) as view:
        dout, q, k, v, out = (_fold(view(a), 4) for a in (dout, q, k, v, out))
        lse = _fold(view(lse), 3)
        alibi_slopes = _fold_slopes(view, slopes, slopes_rank, q.shape[0])
        grads = api.flash_attention_backward(dout, q, k, v, out, lse,
                                             alibi_slopes=alibi_slopes, **options)
        # A score_mod's table gradients (a 4th result) are not results of the call.
        for result, grad in zip(results, grads[:3]):
            _fold(view(result), 4)[...] = grad


@contextlib.contextmanager
def _on_platform(context, buffer):
    """Yields the function that views XLA's buffers of this call as NumPy arrays (CPU
    platform) or CuPy arrays (GPU), with the buffers' GPU and XLA's stream made CuPy's
    current device and stream for the duration, so that the kernels, CuPy's allocations
    and the copies into the results are queued on XLA's stream after the work that wrote
    the inputs (no host synchronization)."""
    device_type, device = buffer.__dlpack_device__()
    if device_type in _arrays._HOST_DEVICE_TYPES:
        # Zero-copy: __array__ of a CPU buffer wraps its memory (bfloat16 through ml_dtypes).
        yield np.asarray
        return
    import cupy as cp
    with cp.cuda.Device(device), _external_stream(cp, context.stream, device):
        yield cp.from_dlpack


def _external_stream(cp, ptr, device):
    if hasattr(cp.cuda.Stream, "from_external"):        # CuPy >= 14
        return cp.cuda.Stream.from_external(_arrays._StreamHandle(ptr))
    return cp.cuda.ExternalStream(ptr, device)


def _fold(a, rank):
    """``a`` with the leading axes that ``vmap`` added (``vmap_method="broadcast_all"``)
    merged into its batch axis: XLA's buffers are C-contiguous, so this is a view."""
    return a if a.ndim == rank else a.reshape((-1,) + a.shape[a.ndim - rank + 1:])


def _fold_slopes(view, slopes, rank, batch):
    """The slopes for the folded batch: (nheads,) or (folded batch, nheads)."""
    if not slopes:
        return None
    a = view(slopes[0])
    if a.ndim == rank:
        return a
    if rank == 2:
        return _fold(a, 2)
    # (mapped..., nheads): one row per mapped entry, repeated over its batch entries.
    nheads = a.shape[-1]
    rows = a.reshape(-1, 1, nheads)
    per_row = batch // rows.shape[0]
    return rows.repeat(per_row, axis=1).reshape(batch, nheads)
