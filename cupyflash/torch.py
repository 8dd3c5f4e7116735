"""PyTorch: ``flash_attention`` with autograd, as ``torch.library`` custom operators.

``import cupyflash.torch`` needs PyTorch with ``torch.library.custom_op`` (2.4 and later;
tested with 2.11 and 2.13); ``import cupyflash`` never imports this module, nor PyTorch.

Two operators are registered, ``torch.ops.cupyflash.flash_attention`` (q, k, v and the
options -> out, lse) and ``torch.ops.cupyflash.flash_attention_backward`` (dout, q, k, v, out,
lse and the same options -> dq, dk, dv), each with a fake (meta) implementation that gives
the shapes and dtypes of its results, and the forward with an autograd formula that saves q,
k, v, out and lse (the lse is float32, ``batch * nheads * seqlen_q`` numbers; nothing of size
``seqlen_q x seqlen_k`` is kept) and calls the backward operator. So ``torch.compile``
traces a model that calls ``flash_attention`` with no graph break (``fullgraph=True``
works, forward and backward), and ``torch.export`` records the call as one node.
``cupyflash.flash_attention`` and ``cupyflash.flash_attention_backward`` called on tensors
while ``torch.compile`` or ``torch.export`` traces them go to the same operators (there the
backward gives dq, dk and dv only: a score_mod's ``grad_arrays`` raise NotImplementedError).

Inside, the operators call ``cupyflash.flash_attention`` / ``flash_attention_backward`` on the
tensors themselves: they are read in place through DLPack (any strides with a contiguous last
dimension), the kernels run on PyTorch's current stream of the tensors' device, and the
results come back without a copy. CUDA tensors run the GPU kernels; CPU tensors run the
NumPy path.

Python objects as operator arguments. An operator's arguments can only be tensors and plain
scalars, but ``block_mask`` (a ``cupyflash.BlockMask``), ``score_mod`` and ``mask_mod`` (a
``cupyflash.ScoreMod`` / ``MaskMod`` or a callable) are Python objects with cached state:
a BlockMask keeps its visiting lists, in tile units and on the device, from call to call, and
a mod carries Python callables and CUDA text. Turning them into tensors at every call would
rebuild those caches (host work and host-to-device copies per call), and a callable has no
tensor form at all. So each object is passed as an int *handle*, its ``id()``, and the
operators find the object by it when they run: every BlockMask, ScoreMod and MaskMod enters
``cupyflash.mods.live`` (a weak dictionary by id()) when it is made (built, copied or
unpickled), and a plain callable is made into its ScoreMod / MaskMod first.

- An eager call's objects are alive while it runs (the caller holds them), and its autograd
  context holds them strongly until the backward has run; ``mods.live`` holds nothing alive,
  so an object leaves it with its last reference and nothing accumulates across calls.
- A traced call (``torch.compiler.is_compiling()``: ``torch.compile`` and ``torch.export``)
  bakes the handle into the graph as a constant, valid for as long as the graph lives (a
  compiled backward runs after the forward's caller may have dropped the object), so the
  object is *pinned* here for the life of the process (one entry per object, however often
  it is traced, and per trace for a plain callable; a process that compiles over many
  short-lived masks keeps them all). Dynamo takes ``id(obj)`` of an object from outside the
  compiled function as a constant, guarded on the object's identity (another mask or mod
  object recompiles; a pinned object is never freed, so its id is never another's), and
  runs the pinning at trace time (``torch.compiler.assume_constant_result``, whose
  arguments must be constants: an int, or a function for a plain callable). The graph
  depends on nothing else of the object: the operators read the object itself when they
  run.

So build masks and mods once, outside the compiled function (module attributes, globals or
arguments: Dynamo does not trace their construction). An exported program holds handles of
this process: it runs here, but cannot be saved and loaded elsewhere with them.

Not supported: double backward, and gradients with respect to ``softmax_scale``,
``softcap``, ``alibi_slopes``, ``lse`` and a user mod's arrays (constants of the call, as in
FlashAttention 2; the mods' arrays are read when the kernels run, they are not inputs of the
graph). Dropout takes an explicit ``seed`` (PyTorch's generator is not drawn from): the
backward regenerates the forward's mask from the saved seed and offset.

Packed batches: ``flash_attention_varlen`` is ``cupyflash.flash_attention_varlen`` with
autograd, eager only (it may read the offsets to the host): ``torch.compile`` runs it outside
its graph.

Hugging Face transformers: ``hf_attention`` is an attention function of its
``AttentionInterface`` (transformers' (batch, heads, seq, headdim) layout, GQA without
``repeat_kv``, causal from the module, no attention mask: padding is refused), and
``register_hf_attention()`` registers it with the mask function it needs; then a model built
with ``attn_implementation="cupyfa"`` runs its attention here (tested with transformers 4.57
and 5.23). Importing this module does not import transformers.
"""
from typing import Optional

try:
    import torch
except ImportError as e:           # pragma: no cover - depends on the environment
    raise ImportError("cupyflash.torch needs PyTorch (pip install torch); the rest of "
                      "cupyflash works without it") from e
if not hasattr(torch.library, "custom_op"):   # pragma: no cover - depends on the environment
    raise ImportError(f"cupyflash.torch needs PyTorch >= 2.4 (torch.library.custom_op), "
                      f"found {torch.__version__}")

from . import _validate, api, masks, mods, varlen

__all__ = ["flash_attention", "flash_attention_varlen", "ring_attention", "hf_attention", "register_hf_attention"]

# --- Python objects passed to the operators by handle (see the module docstring) -------------

NO_OBJECT = -1          # the handle of None (id() is never negative)
_SLOPES = 4             # alibi_slopes' place among the operators' option arguments
_SEED_RANGE = 2**64     # seeds are uint64; the operators' ints are int64

_pinned = {}            # handle -> object, kept for the traced graphs that hold the handle


def _find(handle):
    """The BlockMask, ScoreMod or MaskMod of ``handle`` (None for NO_OBJECT)."""
    if handle == NO_OBJECT:
        return None
    obj = _pinned[handle] if handle in _pinned else mods.live.get(handle)
    if obj is None:
        raise RuntimeError(f"cupyflash.torch: no object has handle {handle} any more (the "
                           f"autograd graph of the call that passed it was freed)")
    return obj


@torch.compiler.assume_constant_result
def _pin_object(object_id):
    """The handle of a BlockMask or mod, ``object_id`` (its id()), for a traced graph: the
    object is kept for the life of the process. Under Dynamo, which takes id() of an object
    from outside the compiled function as a constant and guards the graph on that identity,
    this runs once, at trace time, and its result is baked into the graph."""
    _pinned[object_id] = mods.live[object_id]
    return object_id


@torch.compiler.assume_constant_result
def _pin_callable(fn, as_mod):
    """The handle of a plain callable ``score_mod`` / ``mask_mod``, for a traced graph: of its
    ScoreMod / MaskMod (``as_mod(fn)``), made and pinned at trace time. A callable made inside
    the compiled function has no identity to guard on, but Dynamo takes a function as a
    constant (its code and its closure's constants)."""
    mod = as_mod(fn)
    _pinned[id(mod)] = mod
    return id(mod)


def _traced_handle(obj, as_mod):
    if obj is None:
        return NO_OBJECT
    if isinstance(obj, (masks.BlockMask, mods.ScoreMod, mods.MaskMod)):
        return _pin_object(id(obj))
    return _pin_callable(obj, as_mod)


def _op_args(causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed, offset,
             block_mask, score_mod, mask_mod):
    """The operators' option arguments of a call (after q, k, v), and the objects its handles
    stand for, which the caller keeps until the operators have run."""
    causal = _validate.check_flag("causal", causal)
    window_size = list(_validate.check_window_size(window_size, block_mask))
    dropout_p, seed, offset = _validate.check_dropout(dropout_p, seed, offset)
    if seed is not None and seed >= _SEED_RANGE // 2:
        seed -= _SEED_RANGE                      # the same 64 bits, as an int64
    if block_mask is not None and not isinstance(block_mask, masks.BlockMask):
        raise TypeError(f"block_mask must be a cupyflash.BlockMask or None, got "
                        f"{type(block_mask).__name__}")
    if torch.compiler.is_compiling():
        objects = ()
        handles = (_traced_handle(block_mask, None),
                   _traced_handle(score_mod, mods.as_score_mod),
                   _traced_handle(mask_mod, mods.as_mask_mod))
    else:
        # A plain callable becomes its ScoreMod / MaskMod here, which registers itself.
        objects = (block_mask, mods.as_score_mod(score_mod), mods.as_mask_mod(mask_mod))
        handles = tuple(NO_OBJECT if o is None else id(o) for o in objects)
    return (causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed,
            offset, *handles), objects


def _api_options(causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed,
                 offset, block_mask, score_mod, mask_mod):
    """The keywords of ``cupyflash.flash_attention`` from the operators' option arguments."""
    return dict(causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size),
                softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                seed=None if seed is None else seed % _SEED_RANGE, offset=offset,
                block_mask=_find(block_mask), score_mod=_find(score_mod),
                mask_mod=_find(mask_mod))


# --- the operators ---------------------------------------------------------------------------

@torch.library.custom_op("cupyflash::flash_attention", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                softmax_scale: Optional[float], window_size: list[int], softcap: float,
                alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int],
                offset: int, block_mask: int, score_mod: int,
                mask_mod: int) -> tuple[torch.Tensor, torch.Tensor]:
    options = _api_options(causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                           seed, offset, block_mask, score_mod, mask_mod)
    return api.flash_attention(q, k, v, return_lse=True, **options)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@_forward_op.register_fake
def _forward_fake(q, k, v, *options):
    # Both paths return a fresh C-contiguous out and lse (whatever q's strides).
    b, sq, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=_lse_dtype(q))


@torch.library.custom_op("cupyflash::flash_attention_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, causal: bool,
                 softmax_scale: Optional[float], window_size: list[int], softcap: float,
                 alibi_slopes: Optional[torch.Tensor], dropout_p: float, seed: Optional[int],
                 offset: int, block_mask: int, score_mod: int, mask_mod: int,
                 deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout = _last_dim_contiguous(dout)
    options = _api_options(causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                           seed, offset, block_mask, score_mod, mask_mod)
    grads = api.flash_attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                         **options)
    # A score_mod's table gradients (a 4th result) are not inputs of the forward operator.
    return grads[:3]


def _last_dim_contiguous(dout):
    """Autograd may hand a broadcast gradient (e.g. of out.sum(), all strides 0); the kernels
    read any strides but need the last dimension contiguous."""
    return dout.contiguous() if dout.shape[-1] > 1 and dout.stride(-1) != 1 else dout


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, options[_SLOPES])
    ctx.mark_non_differentiable(lse)
    options[_SLOPES] = None                 # a tensor: it goes through save_for_backward
    ctx.options = options
    # An eager call's objects may be freed once it returns (mods.live holds them weakly); the
    # backward needs them until it runs.
    ctx.objects = [_find(h) for h in options[-3:]]


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes = ctx.saved_tensors
    options = list(ctx.options)
    options[_SLOPES] = alibi_slopes
    dq, dk, dv = torch.ops.cupyflash.flash_attention_backward(dout, q, k, v, out, lse, *options,
                                                             False)
    return (dq, dk, dv) + (None,) * len(options)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# --- the public function ---------------------------------------------------------------------

def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, seed=None, offset=0,
                    block_mask=None, score_mod=None, mask_mod=None):
    """``cupyflash.flash_attention`` for PyTorch tensors, with autograd, ``torch.compile``
    (no graph break) and ``torch.export``.

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
        ``grad_arrays`` come from ``cupyflash.flash_attention_backward``. Under
        ``torch.compile``, pass a BlockMask or mod built outside the compiled function (see
        the module docstring).

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
    >>> step = torch.compile(lambda q: cft.flash_attention(q, q, q, causal=True),
    ...                      fullgraph=True)
    """
    # ``objects`` is held until the operator (and its autograd context) has taken them.
    options, objects = _op_args(causal, softmax_scale, window_size, softcap, alibi_slopes,
                              dropout_p, seed, offset, block_mask, score_mod, mask_mod)
    out, _ = torch.ops.cupyflash.flash_attention(q, k, v, *options)
    return out


# --- packed variable-length batches ---------------------------------------------------------

class _VarlenAttention(torch.autograd.Function):
    """cupyflash.flash_attention_varlen and its backward: q, k, v, out, lse, the offsets and
    the ALiBi slopes saved; the other options kept as given."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options, deterministic):
        out, lse = varlen.flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=alibi_slopes,
                                                 return_lse=True, **options)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
        ctx.options, ctx.deterministic = options, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
        grads = varlen.flash_attention_varlen_backward(_last_dim_contiguous(dout), q, k, v, out, lse, cu_seqlens_q,
                                                       cu_seqlens_k, alibi_slopes=alibi_slopes,
                                                       deterministic=ctx.deterministic, **ctx.options)
        # A score_mod's table gradients (a 4th result) are constants here, as in flash_attention.
        return (*grads[:3], None, None, None, None, None)


@torch.compiler.disable
def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, score_mod=None,
                           deterministic=False, return_lse=False, check_offsets=True):
    """``cupyflash.flash_attention_varlen`` for PyTorch tensors, with autograd.

    q ``(total_q, nheads, headdim)``, k and v ``(total_k, nheads_k, headdim)`` and the int32
    offsets ``cu_seqlens_q`` / ``cu_seqlens_k`` ``(batch + 1,)`` on one device (CUDA, or all on
    the CPU for the NumPy path); every keyword as there, ``deterministic`` that of the
    backward, ``seed`` required with ``dropout_p > 0`` (the backward reuses it). Eager only:
    under ``torch.compile`` the call runs outside the graph (a graph break), since it may
    read the offsets to the host. Returns out like q (``out.backward(...)`` gives q.grad,
    k.grad and v.grad), or ``(out, lse)`` with lse ``(nheads, total_q)``, not differentiable.
    """
    options = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                   softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                   dropout_p=dropout_p, seed=seed, offset=offset, score_mod=score_mod,
                   check_offsets=check_offsets)
    deterministic = _validate.check_flag("deterministic", deterministic)
    return_lse = _validate.check_flag("return_lse", return_lse)
    out, lse = _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options, deterministic)
    return (out, lse) if return_lse else out


# --- ring attention (context parallelism) ---------------------------------------------------

class _RingAttention(torch.autograd.Function):
    """cupyflash.distributed's ring attention and its backward: out and lse of this rank's
    shard, q, k, v, out and lse saved (the backward passes the shards around the ring again)."""

    @staticmethod
    def forward(ctx, q, k, v, group, options):
        from . import distributed
        out, lse = distributed.ring_attention(q, k, v, group, return_lse=True, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.options = group, options
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        from . import distributed
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = distributed.ring_attention_backward(dout, q, k, v, out, lse, ctx.group, **ctx.options)
        return dq, dk, dv, None, None


def ring_attention(q, k, v, group=None, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                   softcap=0.0, layout="zigzag", head_groups=None, return_lse=False):
    """``cupyflash.distributed.ring_attention`` for PyTorch tensors, with autograd: this rank's
    shards of q, k and v (batch, seqlen_local, nheads, headdim; ``cupyflash.distributed.shard``
    cuts them) on its CUDA device; ``group`` a ``torch.distributed`` process group (None: the
    default group), or a ``cupyflash.distributed.LocalRing`` member. ``out.backward(...)``
    gives the gradients of this rank's shards (the backward runs the ring again, so every rank
    must call it). Eager only: ``torch.compile`` breaks the graph here."""
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                   layout=layout, head_groups=head_groups)
    out, lse = _RingAttention.apply(q, k, v, group, options)
    return (out, lse) if return_lse else out


# --- Hugging Face transformers' attention interface -----------------------------------------

HF_NAME = "cupyfa"      # the default name: see register_hf_attention for the names refused

# Arguments of transformers' attention functions that change the result and that these
# kernels do not take: refused where given (not None).
_HF_REFUSED = {"cu_seq_lens_q": "packed (varlen) sequences", "cu_seq_lens_k": "packed "
               "(varlen) sequences", "position_bias": "an additive position bias",
               "s_aux": "attention sinks", "cache": "a paged KV cache"}


def _hf_mask_function_registered(module):
    """Whether transformers builds masks for ``module``'s attention implementation. For a
    name without a mask function of its own it builds none, padding included, so a None
    mask would not mean 'no padding'."""
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if name is None:         # a module used on its own: its caller builds the mask
        return True
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    # transformers itself reads the class mapping, which Dynamo traces on Python 3.10 too.
    return name in getattr(ALL_MASK_ATTENTION_FUNCTIONS, "_global_mapping",
                           ALL_MASK_ATTENTION_FUNCTIONS)


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
    """An attention function for Hugging Face transformers' ``AttentionInterface``:
    ``flash_attention`` in place of the model's own (register it with
    ``register_hf_attention``).

    Parameters
    ----------
    module : torch.nn.Module
        The model's attention layer. ``module.is_causal`` (True where absent) chooses causal
        attention, unless transformers passes ``is_causal=`` itself (as SDPA's path does).
    query : torch.Tensor, (batch, nheads, seqlen_q, headdim)
    key, value : torch.Tensor, (batch, nheads_k, seqlen_k, headdim)
        transformers' layout; read in place (no transpose copy). ``nheads_k`` may divide
        ``nheads`` (GQA/MQA): the kernels share each KV head among its query heads (no
        ``repeat_kv``).
    attention_mask : None
        Only None: a mask tensor (padding, a sliding window that binds, a 4D mask the caller
        made) is refused with ValueError, since the kernels take no dense mask. transformers
        passes None where SDPA could use ``is_causal`` alone: no padding, or padding only in
        unfilled static-cache slots. As there, a causal ``seqlen_q > 1`` with
        ``seqlen_k > seqlen_q`` and no mask is aligned top-left (the keys past ``seqlen_q``
        are such slots), and ``seqlen_q == 1`` (decoding) sees every key.
    scaling : float, optional
        The softmax scale (``headdim ** -0.5`` if None).
    dropout : float
        Attention dropout; above 0 the seed is drawn from PyTorch's default CPU generator
        (``torch.manual_seed`` repeats it) in eager mode; refused under ``torch.compile``,
        where drawing it would break the graph.
    **kwargs
        ``softcap`` and ``sliding_window`` (a key ``j`` is seen from query ``i`` when
        ``i - sliding_window < j``) are applied; ``is_causal`` as above;
        ``cu_seq_lens_q/k``, ``position_bias``, ``s_aux`` and a paged ``cache`` are refused
        where not None; others (``position_ids``, ``output_attentions``, ...) are ignored.

    Returns
    -------
    (out, None) : out a torch.Tensor (batch, seqlen_q, nheads, headdim), query's dtype, as
        transformers expects; no attention weights.
    """
    for name, what in _HF_REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"cupyflash.torch.hf_attention: {name} is given, but the kernels "
                             f"take no {what}; use another attention implementation")
    if attention_mask is not None:
        raise ValueError(
            f"cupyflash.torch.hf_attention takes no attention_mask, got a "
            f"{tuple(attention_mask.shape)} {type(attention_mask).__name__}: padding, a "
            f"binding sliding window or a custom mask cannot be passed to the kernels. Run "
            f"unpadded batches (no attention_mask, or one without padding outside "
            f"torch.compile; transformers 4 passes a mask whenever it is compiled), or another "
            f"attention implementation")
    if not _hf_mask_function_registered(module):
        raise ValueError(
            f"cupyflash.torch.hf_attention: transformers builds no mask for attention "
            f"implementation {module.config._attn_implementation!r}, so padding would be "
            f"ignored silently; register it with cupyflash.torch.register_hf_attention (or "
            f"register transformers.masking_utils.sdpa_mask under the same name in "
            f"AttentionMaskInterface)")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    sq, sk = query.shape[2], key.shape[2]
    # As SDPA's path: one query row (decoding) sees every key.
    # bool(): under dynamic shapes sq > 1 is symbolic; the kernels take a Python bool.
    causal = bool(is_causal and sq > 1)
    if causal and sk != sq:
        if sk < sq:
            raise ValueError(f"cupyflash.torch.hf_attention: causal attention without a mask "
                             f"and with fewer keys ({sk}) than queries ({sq}) is not supported")
        # transformers leaves the mask out here only when the keys past seqlen_q are empty
        # static-cache slots (SDPA's is_causal aligns top-left); dropping them gives the
        # square causal case, which the kernels' bottom-right alignment computes alike.
        key, value = key[:, :, :sq], value[:, :, :sq]
    window = kwargs.get("sliding_window")
    window_size = (-1, -1) if window is None else (window - 1, 0 if causal else window - 1)
    softcap = kwargs.get("softcap")
    seed = None
    if dropout > 0:
        if torch.compiler.is_compiling():
            raise ValueError("cupyflash.torch.hf_attention: attention dropout under "
                             "torch.compile is not supported (its seed is drawn on the host); "
                             "set the model's attention_dropout to 0 or call model.eval()")
        seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    out = flash_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                          causal=causal, softmax_scale=scaling, window_size=window_size,
                          softcap=0.0 if softcap is None else softcap, dropout_p=dropout,
                          seed=seed)
    return out, None


def register_hf_attention(name=HF_NAME):
    """Register ``hf_attention`` with Hugging Face transformers (4.53 and later, which have
    ``transformers.masking_utils``; tested with 4.57 and 5.23) as attention implementation
    ``name``, and transformers' SDPA mask function under the same
    name, so that the model passes None where SDPA would use ``is_causal`` alone and a mask
    (refused by ``hf_attention``) where there is padding. Then pick it with
    ``attn_implementation=name`` (``from_pretrained``, a config) or
    ``model.set_attn_implementation(name)``. Returns ``name``.

    transformers takes a name containing "flash" for a flash-attn kernel it loads itself,
    and one of the form "org/repo" for a kernel from the Hub: both are refused here."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {type(name).__name__} {name!r}")
    if "flash" in name or "/" in name:
        raise ValueError(f"name must contain neither 'flash' nor '/', which transformers "
                         f"takes for a kernel of its own or of the Hub; got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(name, hf_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


# --- the routes of cupyflash.flash_attention* under tracing ----------------------------------

def traced_forward(q, k, v, *, return_lse, **options):
    """``cupyflash.flash_attention`` on tensors under ``torch.compile`` / ``torch.export``
    tracing: the forward operator on detached tensors, as the eager call (no autograd)."""
    args, _ = _op_args(**options)
    out, lse = torch.ops.cupyflash.flash_attention(q.detach(), k.detach(), v.detach(), *args)
    return (out, lse) if return_lse else out


def traced_backward(dout, q, k, v, out, lse, *, deterministic, **options):
    """``cupyflash.flash_attention_backward`` on tensors under tracing: the backward operator,
    which gives dq, dk and dv (not a score_mod's ``grad_arrays``: NotImplementedError)."""
    if getattr(options["score_mod"], "grad_arrays", ()):
        raise NotImplementedError("cupyflash.flash_attention_backward under torch.compile / "
                                  "torch.export does not return a score_mod's grad_arrays; "
                                  "call it outside the compiled region")
    deterministic = _validate.check_flag("deterministic", deterministic)
    args, _ = _op_args(**options)
    tensors = (t.detach() for t in (dout, q, k, v, out, lse))
    return torch.ops.cupyflash.flash_attention_backward(*tensors, *args, deterministic)
