"""JAX gradients for cupyflash: ``flash_attention`` with ``jax.custom_vjp``, eager mode only.

``import cupyflash.jax`` needs JAX; ``import cupyflash`` never imports this module.

What works: calling it on concrete JAX arrays and differentiating it with ``jax.grad``,
``jax.vjp`` and ``jax.value_and_grad`` outside ``jax.jit``. GPU arrays are read in place
through DLPack, the kernels run on the array's GPU, and the results come back as JAX arrays
sharing our memory. The forward keeps q, k, v, out and lse as residuals for the backward.

Not supported (each raises TypeError naming the argument): ``jax.jit``, ``vmap``, ``pmap``,
``shard_map``, ``lax.scan`` bodies, ``checkpoint``/``remat`` or anything else that hands the
function tracers instead of concrete arrays; the kernels are not registered with XLA. Also
not supported: forward-mode (``jax.jvp``, ``jax.jacfwd``), higher-order gradients, and
gradients with respect to ``softmax_scale``, ``softcap`` and ``alibi_slopes`` (constants of
the call). Dropout takes an explicit ``seed`` (not a JAX PRNG key): the backward regenerates
the forward's mask from it.

Streams: JAX has no user-visible stream. The kernels run on CuPy's current stream; JAX's
pending writes of the inputs are ordered before them, and JAX's later reads of the results
after them, by the ``stream`` argument of the DLPack exchange (no host synchronization).

CPU arrays (``jax.devices("cpu")``) run cupyflash's NumPy path and come back on the same CPU
device (a host copy is made there): useful for tests without a GPU, not for speed.
"""
try:
    import jax
except ImportError as e:           # pragma: no cover - depends on the environment
    raise ImportError("cupyflash.jax needs JAX (pip install jax); the rest of cupyflash "
                      "works without it") from e

from . import _validate, api

__all__ = ["flash_attention"]


def flash_attention(q, k, v, causal=False, softmax_scale=None, block_mask=None, *,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                    seed=None, offset=0, score_mod=None, mask_mod=None):
    """``cupyflash.flash_attention`` for JAX arrays, differentiable with ``jax.grad``.

    Parameters
    ----------
    q : jax.Array, (batch, seqlen_q, nheads, headdim)
    k, v : jax.Array, (batch, seqlen_k, nheads_k, headdim)
        float16, bfloat16, float32 (or float64 with ``jax_enable_x64``), on one GPU (or the
        CPU, where the NumPy path runs). Concrete arrays only: not under ``jax.jit``.
    causal, softmax_scale, block_mask, window_size, softcap, alibi_slopes, dropout_p, seed, offset, score_mod, mask_mod
        As in ``cupyflash.flash_attention``; fixed for the call (not differentiated).
        ``alibi_slopes`` a concrete float32 JAX array on q's device; ``seed`` a Python int,
        required with ``dropout_p > 0``. The arrays of a user mod are constants here: the
        gradients of its ``grad_arrays`` come from ``cupyflash.flash_attention_backward``.

    Returns
    -------
    out : jax.Array like q.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, cupyflash.jax as cfj
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 4, 64), jnp.bfloat16)
    >>> dq = jax.grad(lambda q: cfj.flash_attention(q, q, q).astype(jnp.float32).sum())(q)
    """
    causal = _validate.check_flag("causal", causal)
    return _differentiable(dict(causal=causal, softmax_scale=softmax_scale,
                                window_size=window_size, softcap=softcap,
                                alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
                                offset=offset, block_mask=block_mask, score_mod=score_mod,
                                mask_mod=mask_mod))(q, k, v)


def _differentiable(options):
    """A fresh custom_vjp function per call with the options closed over (so a BlockMask
    need not be hashable, as nondiff_argnums would require, and the slopes are constants)."""

    @jax.custom_vjp
    def attention(q, k, v):
        return api.flash_attention(q, k, v, **options)

    def forward(q, k, v):
        out, lse = api.flash_attention(q, k, v, return_lse=True, **options)
        return out, (q, k, v, out, lse)

    def backward(residuals, dout):
        q, k, v, out, lse = residuals
        # A score_mod's table gradients (a 4th result) are not inputs of this function.
        dq, dk, dv = api.flash_attention_backward(dout, q, k, v, out, lse, **options)[:3]
        return dq, dk, dv

    attention.defvjp(forward, backward)
    return attention
