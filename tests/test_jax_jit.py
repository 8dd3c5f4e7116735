"""``cupyflash.jax.flash_attention`` under ``jax.jit``, ``jax.grad`` and ``jax.vmap``.

Traced calls go through XLA custom calls (``jax.experimental.buffer_callback``) that run the
same code as eager calls on XLA's buffers: the NumPy path on the CPU platform, the kernels on
XLA's stream on the GPU. So on the CPU, jitted results equal eager ones exactly; on the GPU the
forward does too (same kernels, same inputs), and gradients are compared with the tolerance
rule of DESIGN.md (dq is summed with atomics, in no fixed order). The eager route itself is
checked against references in test_interop.py.

Skips where JAX is not importable; GPU tests (marker ``gpu``) also skip where JAX has no GPU.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import cupyflash as cf  # noqa: E402
import cupyflash.jax as cfj  # noqa: E402
from cupyflash import masks  # noqa: E402

try:
    from gpu_checks import BWD_FACTOR, FWD_FACTOR, fp32_rtol, seed_of  # noqa: E402
    from reference import (assert_rule, attention_naive,  # noqa: E402
                           attention_naive_backward, attention_ref, attention_ref_backward)
except ImportError:
    from tests.gpu_checks import BWD_FACTOR, FWD_FACTOR, fp32_rtol, seed_of  # noqa: E402
    from tests.reference import (assert_rule, attention_naive,  # noqa: E402
                                 attention_naive_backward, attention_ref,
                                 attention_ref_backward)

CPU = jax.devices("cpu")[0]
HALF = ("float16", "bfloat16")


def _gpu():
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    if not devices:
        pytest.skip("JAX has no GPU backend here")
    return devices[0]


def _arrays(device, dtype, *shapes, seed):
    rng = np.random.default_rng(seed)
    return [jax.device_put(jnp.asarray(rng.standard_normal(s), dtype), device) for s in shapes]


def _np64(x):
    return np.asarray(x).astype(np.float64)


def _loss_of(w, **options):
    """A loss of q, k, v through our attention: the sum of out weighted by ``w``."""
    def loss(q, k, v):
        out = cfj.flash_attention(q, k, v, **options)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))
    return loss


def _assert_equal(got, expected):
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


# --- CPU platform: the NumPy path inside XLA's custom calls ---------------------------------

SHAPE_Q, SHAPE_KV = (2, 17, 4, 16), (2, 23, 2, 16)      # GQA, seqlen_q != seqlen_k


def _slopes():
    return jax.device_put(jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32), CPU)


def _score_mod():
    return cf.ScoreMod("score * 0.5f", grad="return dscore * 0.5f;",
                       python=lambda s, b, h, q_idx, kv_idx: s * 0.5,
                       python_grad=lambda s, ds, b, h, q_idx, kv_idx: ds * 0.5)


def _mask_mod():
    return cf.MaskMod("(q_idx + kv_idx) % 3 != 1",
                      python=lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 3 != 1)


# Each keyword of the call, with values that change the result.
OPTIONS = {
    "plain": lambda: {},
    "causal": lambda: {"causal": True},
    "scale": lambda: {"softmax_scale": 0.3},
    "window": lambda: {"window_size": (5, 2)},
    "causal_window": lambda: {"causal": True, "window_size": (4, -1)},
    "softcap": lambda: {"softcap": 2.0},
    "alibi": lambda: {"alibi_slopes": _slopes()},
    "dropout": lambda: {"dropout_p": 0.25, "seed": 1234, "offset": 7},
    "block_mask": lambda: {"block_mask": masks.sliding_window(17, 23, 6, block_size=64),
                           "causal": True},
    "score_mod": lambda: {"score_mod": _score_mod()},
    "mask_mod": lambda: {"mask_mod": _mask_mod()},
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_jit_forward_equals_eager_on_cpu(case, dtype):
    options = OPTIONS[case]()
    q, k, v = _arrays(CPU, dtype, SHAPE_Q, SHAPE_KV, SHAPE_KV, seed=1)
    eager = cfj.flash_attention(q, k, v, **options)
    jitted = jax.jit(lambda q, k, v: cfj.flash_attention(q, k, v, **options))(q, k, v)
    _assert_equal([jitted], [eager])
    assert jitted.devices() == {CPU}


@pytest.mark.parametrize("case", sorted(OPTIONS))
def test_jit_grad_equals_eager_grad_on_cpu(case):
    options = OPTIONS[case]()
    q, k, v, w = _arrays(CPU, "float32", SHAPE_Q, SHAPE_KV, SHAPE_KV, SHAPE_Q, seed=2)
    grad = jax.grad(_loss_of(w, **options), argnums=(0, 1, 2))
    _assert_equal(jax.jit(grad)(q, k, v), grad(q, k, v))


def test_jit_matches_the_float64_reference_on_cpu():
    q, k, v, w = _arrays(CPU, "float32", SHAPE_Q, SHAPE_KV, SHAPE_KV, SHAPE_Q, seed=3)
    out, grads = jax.jit(jax.value_and_grad(
        lambda q, k, v: (cfj.flash_attention(q, k, v, causal=True) * w).sum(),
        argnums=(0, 1, 2)))(q, k, v)
    args = [_np64(x) for x in (q, k, v)]
    scale = SHAPE_Q[-1] ** -0.5
    ref_out, _ = attention_ref(*args, scale, True)
    np.testing.assert_allclose(float(out), float((ref_out * _np64(w)).sum()), rtol=1e-5)
    refs = attention_ref_backward(_np64(w), *args, scale, True)
    for g, r in zip(grads, refs):
        np.testing.assert_allclose(_np64(g), r, rtol=0, atol=1e-5 * np.abs(r).max())


def test_vmap_over_an_extra_batch_axis_matches_a_loop():
    """q, k and v mapped, or only q (k and v shared): both equal a Python loop, forward and
    gradients, eager and jitted."""
    n = 3
    qs, ks, vs = _arrays(CPU, "float32", (n, *SHAPE_Q), (n, *SHAPE_KV), (n, *SHAPE_KV), seed=4)
    w = _arrays(CPU, "float32", SHAPE_Q, seed=5)[0]
    attend = lambda q, k, v: cfj.flash_attention(q, k, v, causal=True)  # noqa: E731
    loop = jnp.stack([attend(qs[i], ks[i], vs[i]) for i in range(n)])
    _assert_equal([jax.vmap(attend)(qs, ks, vs)], [loop])
    _assert_equal([jax.jit(jax.vmap(attend))(qs, ks, vs)], [loop])
    shared = jnp.stack([attend(qs[i], ks[0], vs[0]) for i in range(n)])
    _assert_equal([jax.jit(jax.vmap(attend, in_axes=(0, None, None)))(qs, ks[0], vs[0])],
                  [shared])

    grad = jax.grad(_loss_of(w, causal=True), argnums=(0, 1, 2))
    per_entry = [grad(qs[i], ks[i], vs[i]) for i in range(n)]
    _assert_equal(jax.jit(jax.vmap(grad))(qs, ks, vs),
                  [jnp.stack([g[j] for g in per_entry]) for j in range(3)])


def test_vmap_over_a_non_leading_axis_and_nested_vmaps_match_a_loop():
    qs, ks, vs = _arrays(CPU, "float32", (2, 3, *SHAPE_Q), (2, 3, *SHAPE_KV), (2, 3, *SHAPE_KV),
                         seed=6)
    attend = lambda q, k, v: cfj.flash_attention(q, k, v, window_size=(3, 3))  # noqa: E731
    loop = jnp.stack([jnp.stack([attend(qs[i, j], ks[i, j], vs[i, j]) for j in range(3)])
                      for i in range(2)])
    _assert_equal([jax.jit(jax.vmap(jax.vmap(attend)))(qs, ks, vs)], [loop])
    moved = [jnp.moveaxis(x, 0, 2) for x in (qs[:, 0], ks[:, 0], vs[:, 0])]
    _assert_equal([jax.vmap(attend, in_axes=2)(*moved)], [loop[:, 0]])


@pytest.mark.parametrize("shape", [(4,), (2, 4)], ids=["per_head", "per_batch_and_head"])
def test_vmap_with_alibi_slopes_matches_a_loop(shape):
    """Slopes mapped with q, (nheads,) or (batch, nheads): the callback spreads them over
    the folded batch."""
    n = 3
    qs = _arrays(CPU, "float32", (n, *SHAPE_Q), seed=7)[0]
    k, v = _arrays(CPU, "float32", SHAPE_KV, SHAPE_KV, seed=8)
    slopes = jnp.abs(_arrays(CPU, "float32", (n, *shape), seed=9)[0])
    attend = lambda q, s: cfj.flash_attention(q, k, v, alibi_slopes=s)  # noqa: E731
    loop = jnp.stack([attend(qs[i], slopes[i]) for i in range(n)])
    _assert_equal([jax.jit(jax.vmap(attend))(qs, slopes)], [loop])


def test_jitted_training_step_equals_eager():
    """A tiny attention model (projections, our attention, a residual MLP head): the jitted
    step (loss, gradients of every parameter, SGD update) equals the eager step."""
    batch, seqlen, dim, heads, heads_k, headdim = 2, 19, 32, 4, 2, 8
    keys = iter(jax.random.split(jax.random.key(0), 8))
    params = {name: jax.device_put(jax.random.normal(next(keys), shape) * 0.2, CPU)
              for name, shape in (("wq", (dim, heads * headdim)),
                                  ("wk", (dim, heads_k * headdim)),
                                  ("wv", (dim, heads_k * headdim)),
                                  ("wo", (heads * headdim, dim)), ("head", (dim, 1)))}
    x = jax.device_put(jax.random.normal(next(keys), (batch, seqlen, dim)), CPU)
    y = jax.device_put(jax.random.normal(next(keys), (batch, 1)), CPU)

    def loss(params, x, y):
        q = (x @ params["wq"]).reshape(batch, seqlen, heads, headdim)
        k = (x @ params["wk"]).reshape(batch, seqlen, heads_k, headdim)
        v = (x @ params["wv"]).reshape(batch, seqlen, heads_k, headdim)
        h = cfj.flash_attention(q, k, v, causal=True).reshape(batch, seqlen, heads * headdim)
        h = x + h @ params["wo"]
        return jnp.mean((h.mean(axis=1) @ params["head"] - y) ** 2)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, grads, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    eager = step(params, x, y)
    jitted = jax.jit(step)(params, x, y)
    # XLA may fuse and reorder the float32 ops around the attention under jit.
    for got, expected in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5,
                                   atol=1e-6 * float(np.abs(np.asarray(expected)).max()))
    assert float(jitted[0]) > 0


def test_scan_over_layers_and_checkpoint_equal_eager():
    """Attention inside ``lax.scan`` (a stack of layers) and ``jax.checkpoint``: traced
    without jit too; gradients equal an eager Python loop."""
    q, w = _arrays(CPU, "float32", SHAPE_Q, SHAPE_Q, seed=10)
    scales = jnp.asarray([1.0, 0.5, 2.0], jnp.float32)

    def layer(x, s):
        return cfj.flash_attention(x * s, x, x, causal=True), None

    def scanned(q):
        return (jax.lax.scan(jax.checkpoint(layer), q, scales)[0] * w).sum()

    def looped(q):
        for s in scales:
            q, _ = layer(q, s)
        return (q * w).sum()

    np.testing.assert_allclose(np.asarray(jax.grad(scanned)(q)),
                               np.asarray(jax.grad(looped)(q)), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(scanned))(q)),
                                  np.asarray(jax.grad(scanned)(q)))


def test_traced_slopes_get_no_gradient_and_work_under_jit():
    q, k, v = _arrays(CPU, "float32", SHAPE_Q, SHAPE_KV, SHAPE_KV, seed=11)
    loss = lambda q, s: cfj.flash_attention(q, k, v, alibi_slopes=s).sum()  # noqa: E731
    # Eager grad makes its cotangent on the default device, a GPU where there is one.
    with jax.default_device(CPU):
        dq, ds = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, _slopes())
        _assert_equal([dq], [jax.grad(loss)(q, _slopes())])
    assert not np.asarray(ds).any()


# --- errors under tracing --------------------------------------------------------------------

def _raises_like_eager(exc, fn, *args):
    """``fn`` raises ``exc`` eagerly and under jit, with the same message (at trace time)."""
    with pytest.raises(exc) as eager:
        fn(*args)
    with pytest.raises(exc) as traced:
        jax.jit(fn)(*args)
    assert str(traced.value) == str(eager.value)
    return str(eager.value)


def test_bad_shapes_dtypes_and_options_fail_at_trace_time_with_the_eager_message():
    q, k, v = _arrays(CPU, "float32", SHAPE_Q, SHAPE_KV, SHAPE_KV, seed=12)
    k8 = k[..., :8]
    message = _raises_like_eager(ValueError, lambda q, k, v: cfj.flash_attention(q, k, v),
                                 q, k8, v)
    assert "k's shape" in message
    _raises_like_eager(TypeError, lambda q, k, v: cfj.flash_attention(q, k, v),
                       q, k.astype(jnp.float16), v)
    _raises_like_eager(ValueError, lambda q: cfj.flash_attention(q, k, v, dropout_p=0.5), q)
    _raises_like_eager(ValueError,
                       lambda q: cfj.flash_attention(q, k, v, window_size=(-2, 0)), q)
    _raises_like_eager(ValueError, lambda q: cfj.flash_attention(q, k, v, softmax_scale=-1.0),
                       q)
    _raises_like_eager(ValueError, lambda q, s: cfj.flash_attention(q, k, v, alibi_slopes=s),
                       q, _slopes()[:3])


def test_a_traced_dropout_seed_is_a_type_error():
    q, k, v = _arrays(CPU, "float32", SHAPE_Q, SHAPE_KV, SHAPE_KV, seed=13)
    with pytest.raises(TypeError, match="seed must be an integer"):
        jax.jit(lambda q, seed: cfj.flash_attention(q, k, v, dropout_p=0.1, seed=seed))(q, 3)


def test_a_block_mask_of_other_seqlens_fails_at_trace_time():
    q, k, v = _arrays(CPU, "float32", SHAPE_Q, SHAPE_KV, SHAPE_KV, seed=14)
    mask = masks.causal(32, 32, block_size=64)
    _raises_like_eager(ValueError, lambda q: cfj.flash_attention(q, k, v, block_mask=mask), q)


def test_errors_found_where_the_call_runs_carry_the_message():
    """A ScoreMod with a CUDA rule only, on the CPU platform: known only inside XLA's
    callback, which JAX reports with the ValueError's message."""
    q, k, v = _arrays(CPU, "float32", SHAPE_Q, SHAPE_KV, SHAPE_KV, seed=14)
    gpu_only = cf.ScoreMod("score * 0.5f")
    with pytest.raises(Exception, match="score_mod has no python rule"):
        jax.jit(lambda q: cfj.flash_attention(q, k, v, score_mod=gpu_only))(q).block_until_ready()


def test_forward_mode_is_a_clear_error():
    q, k, v = _arrays(CPU, "float32", SHAPE_Q, SHAPE_KV, SHAPE_KV, seed=15)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda q: cfj.flash_attention(q, k, v), (q,), (q,))


def test_higher_order_gradients_are_a_clear_error():
    q, k, v = _arrays(CPU, "float32", SHAPE_Q, SHAPE_KV, SHAPE_KV, seed=16)
    inner = jax.grad(lambda q: cfj.flash_attention(q, k, v).sum())
    with pytest.raises(NotImplementedError, match="no higher-order gradients"):
        jax.grad(lambda q: inner(q).sum())(q)
    with pytest.raises(NotImplementedError, match="no higher-order gradients"):
        jax.jit(jax.hessian(lambda q: cfj.flash_attention(q, k, v).sum()))(q)


def test_the_array_api_under_jit_is_still_a_type_error():
    """``cupyflash.flash_attention`` itself takes concrete arrays only; the JAX adapter is
    the traced route."""
    q = jax.device_put(jnp.ones((1, 8, 2, 16), jnp.float32), CPU)
    with pytest.raises(TypeError, match="^q is a JAX tracer"):
        jax.jit(cf.flash_attention)(q, q, q)


# --- GPU: the kernels on XLA's stream --------------------------------------------------------

def _check_against_reference(dtype, q, k, v, w, out, grads, causal):
    """out and the gradients of sum(out * w) against float64, with the tolerance rule."""
    q64, k64, v64, w64 = (_np64(x) for x in (q, k, v, w))
    scale = q.shape[-1] ** -0.5
    ref_out, _ = attention_ref(q64, k64, v64, scale, causal)
    refs = attention_ref_backward(w64, q64, k64, v64, scale, causal)
    sq, sk = q.shape[1], k.shape[1]
    if dtype in HALF:
        naive_out, _ = attention_naive(q64, k64, v64, scale, causal, dtype)
        naive = attention_naive_backward(w64, q64, k64, v64, scale, causal, dtype)
        assert_rule("out", _np64(out), ref_out, naive_out, FWD_FACTOR)
        magnitude = max(float(np.abs(r).max()) for r in refs)
        for name, g, r, n in zip(("dq", "dk", "dv"), grads, refs, naive):
            assert_rule(name, _np64(g), r, n, BWD_FACTOR, magnitude)
        return
    rtol = fp32_rtol(sq, sk)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *refs)):
        err = float(np.abs(_np64(got) - ref).max())
        assert err <= rtol * float(np.abs(ref).max()), f"{name}: max error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_jit_forward_equals_eager_and_grads_match_the_reference(dtype, causal, request):
    device = _gpu()
    q, k, v, w = _arrays(device, dtype, (2, 200, 8, 64), (2, 257, 2, 64), (2, 257, 2, 64),
                         (2, 200, 8, 64), seed=seed_of(request))
    attend = jax.jit(lambda q, k, v: cfj.flash_attention(q, k, v, causal=causal))
    out = attend(q, k, v)
    _assert_equal([out], [cfj.flash_attention(q, k, v, causal=causal)])
    assert out.devices() == {device}
    grads = jax.jit(jax.grad(_loss_of(w, causal=causal), argnums=(0, 1, 2)))(q, k, v)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape and g.devices() == {device}
    _check_against_reference(dtype, q, k, v, w, out, grads, causal)


@pytest.mark.gpu
def test_gpu_jit_keywords_equal_eager():
    """Window, softcap, ALiBi, dropout, a BlockMask and CUDA mods under jit: the forward
    equals the eager call bit for bit (float32, dq not by atomics' order: compared loosely)."""
    device = _gpu()
    q, k, v, w = _arrays(device, "float32", (2, 300, 4, 64), (2, 333, 2, 64),
                         (2, 333, 2, 64), (2, 300, 4, 64), seed=20)
    slopes = jax.device_put(jnp.linspace(0.1, 0.8, 4, dtype=jnp.float32), device)
    for options in ({"window_size": (64, 16)}, {"softcap": 3.0}, {"alibi_slopes": slopes},
                    {"dropout_p": 0.2, "seed": 99}, {"score_mod": _score_mod()},
                    {"mask_mod": _mask_mod()},
                    {"block_mask": masks.sliding_window(300, 333, 100), "causal": True}):
        eager = cfj.flash_attention(q, k, v, **options)
        jitted = jax.jit(lambda q, k, v: cfj.flash_attention(q, k, v, **options))(q, k, v)
        _assert_equal([jitted], [eager])
        grad = jax.grad(_loss_of(w, **options), argnums=(0, 1, 2))
        for got, expected in zip(jax.jit(grad)(q, k, v), grad(q, k, v)):
            expected = np.asarray(expected)
            np.testing.assert_allclose(np.asarray(got), expected, rtol=0,
                                       atol=1e-5 * float(np.abs(expected).max()))


@pytest.mark.gpu
def test_gpu_vmap_matches_a_loop():
    device = _gpu()
    qs, ks, vs = _arrays(device, "bfloat16", (3, 2, 128, 4, 64), (3, 2, 160, 2, 64),
                         (3, 2, 160, 2, 64), seed=21)
    attend = lambda q, k, v: cfj.flash_attention(q, k, v, causal=True)  # noqa: E731
    loop = jnp.stack([attend(qs[i], ks[i], vs[i]) for i in range(3)])
    _assert_equal([jax.jit(jax.vmap(attend))(qs, ks, vs)], [loop])


@pytest.mark.gpu
def test_gpu_kernels_are_ordered_on_xla_stream():
    """Inside one jitted function, q is the tail of a long matmul chain and the attention's
    output feeds another: our kernels must run after the first and before the second, on
    XLA's stream, for the result to equal the eager composition."""
    device = _gpu()
    k, v = _arrays(device, "float16", (1, 1024, 4, 64), (1, 1024, 4, 64), seed=22)
    n = 4096
    m = jax.device_put(jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / n ** 0.5,
                       device)
    x = _arrays(device, "float32", (1, 1024, 4, 64), seed=23)[0]

    def model(m, x):
        chain = m
        for _ in range(8):
            chain = jnp.tanh(chain @ m)
        q = (x + 0 * chain[0, 0]).astype(jnp.float16)
        return cfj.flash_attention(q, k, v, causal=True).astype(jnp.float32) * 2 + 1

    jitted = jax.jit(model)(m, x)
    out = cfj.flash_attention(x.astype(jnp.float16), k, v, causal=True)
    np.testing.assert_array_equal(np.asarray(jitted),
                                  np.asarray(out).astype(np.float32) * 2 + 1)


@pytest.mark.gpu
def test_gpu_jitted_training_step_equals_eager():
    """Loss and gradients of a jitted step equal the eager step (bf16 attention inside a
    float32 model), within the reordering XLA's fusions allow and the order of the atomics
    that sum dq."""
    device = _gpu()
    batch, seqlen, dim, heads, headdim = 2, 256, 256, 4, 64
    keys = iter(jax.random.split(jax.random.key(2), 8))
    params = {name: jax.device_put(jax.random.normal(next(keys), (dim, dim)) / dim ** 0.5,
                                   device) for name in ("wq", "wk", "wv", "wo")}
    x = jax.device_put(jax.random.normal(next(keys), (batch, seqlen, dim)), device)

    def loss(params, x):
        def heads_of(w):
            return (x @ w).astype(jnp.bfloat16).reshape(batch, seqlen, heads, headdim)
        h = cfj.flash_attention(heads_of(params["wq"]), heads_of(params["wk"]),
                                heads_of(params["wv"]), causal=True)
        h = h.astype(jnp.float32).reshape(batch, seqlen, dim) @ params["wo"]
        return jnp.mean(jnp.square(x + h))

    step = jax.value_and_grad(loss)
    # No TF32 in the float32 matmuls, whose algorithm XLA may pick differently under jit.
    with jax.default_matmul_precision("highest"):
        value, grads = step(params, x)
        jit_value, jit_grads = jax.jit(step)(params, x)
    np.testing.assert_allclose(float(jit_value), float(value), rtol=1e-4)
    for name in params:
        expected = np.asarray(grads[name])
        np.testing.assert_allclose(np.asarray(jit_grads[name]), expected, rtol=0,
                                   atol=2e-2 * float(np.abs(expected).max()))
