"""cupyflash.torch under ``torch.compile`` and ``torch.export``: its custom operators.

Checked on CPU tensors (the NumPy path: tracing, the fake implementations, autograd and the
registry of Python objects are the same as on the GPU) and, with the ``gpu`` marker, on CUDA
tensors (the kernels, under inductor):

- a Llama-style block (RMSNorm, rotary embeddings, causal GQA attention, SwiGLU) compiles with
  ``fullgraph=True`` into one graph with no break (``torch._dynamo.explain``), and its output
  and gradients match the eager module's (inductor fuses the other operations, so to float32
  round-off);
- each keyword (causal, window, block_mask, a score_mod, a mask_mod, ALiBi with softcap and
  softmax_scale, dropout with a seed above 2**63; all with GQA and seqlen_q != seqlen_k, and
  a plain callable as score_mod, forward only) compiles with ``fullgraph=True``
  into one graph and gives the eager call's output and gradients: bit for bit on the CPU
  (``aot_eager`` runs the same NumPy computation) and for the GPU's out, the GPU's gradients
  up to the order of the kernels' atomic additions;
- another BlockMask object recompiles instead of reusing the first one's handle, and a deep
  copy of one is found like the original; seeds and offsets that change from call to call
  do not break the graph, and new sequence lengths under ``dynamic=True`` do not recompile;
- ``cupyflash.flash_attention`` / ``flash_attention_backward`` called on tensors while
  torch.compile traces them go to the operators (no graph break);
- ``torch.export`` (strict and not) records one ``cupyflash.flash_attention`` node, and the
  exported program gives the eager result;
- ``torch.library.opcheck`` passes for both operators;
- eager calls keep their objects (a plain callable's ScoreMod too) until the backward and
  leave nothing behind; a compiled backward still finds a mask the caller has dropped;
- ``import cupyflash`` and a NumPy call (which pass the tracing check) do not import PyTorch.

Skipped where PyTorch is absent (CI); the GPU tests also where CuPy or PyTorch sees no GPU.
"""
import copy
import gc
import subprocess
import sys
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyflash as cf  # noqa: E402
import cupyflash.torch as cft  # noqa: E402
from cupyflash import masks  # noqa: E402

B, SQ, SK, H, HK = 2, 97, 130, 4, 2
D_CPU, D_GPU = 16, 64
T5_W = 256                      # T5 bias offsets kv_idx - q_idx + T5_W: T5_W >= max(SQ, SK)
RESULTS = ("out", "dq", "dk", "dv")
# Compiled against eager Llama blocks: inductor's fused float32 arithmetic rounds otherwise.
BLOCK_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: Dynamo's cache is per code object, and the tests
    trace the same functions with other closures."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device (CPU-only build?)")
    return "cuda"


def _randn(shape, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype)


def _inputs(device, dtype, d, seed=0):
    """(q, k, v) leaves (GQA: H query heads, HK kv heads) and a dout."""
    shapes = ((B, SQ, H, d), (B, SK, HK, d), (B, SK, HK, d), (B, SQ, H, d))
    q, k, v, dout = (_randn(s, device, dtype, seed + i) for i, s in enumerate(shapes))
    return (q, k, v), dout


def _run(fn, qkv, dout):
    """out of ``fn(q, k, v)`` and the gradients of ``out.backward(dout)``, on fresh leaves."""
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv)
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _assert_one_graph(fn, *args):
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _assert_same(names, got, want):
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def _assert_near(names, got, want, rtol):
    """Each result within ``rtol`` of the largest magnitude of its eager counterpart."""
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = float((a.double() - b.double()).abs().max())
        top = float(b.double().abs().max())
        assert err <= rtol * top, f"{name}: max error {err:.3e} > {rtol:.0e} * {top:.3e}"


# ---------------------------------------------------------------------------------------------
# The keywords, as one case each (mods' arrays and the slopes on the inputs' device)

def _t5_score_mod(device):
    bias = _randn((H, 2 * T5_W), device, torch.float32, 50)
    return cf.ScoreMod(f"score + bias(h, kv_idx - q_idx + {T5_W})", grad="dscore",
                       python=lambda s, b, h, q_idx, kv_idx, bias:
                           s + bias[h, kv_idx - q_idx + T5_W],
                       python_grad=lambda s, ds, b, h, q_idx, kv_idx, bias: ds,
                       arrays={"bias": bias})


def _every_third_key_hidden():
    return cf.MaskMod("kv_idx % 3 != 1", python=lambda b, h, q_idx, kv_idx: kv_idx % 3 != 1)


CASES = {
    "causal_gqa": lambda device: dict(causal=True),
    "window": lambda device: dict(window_size=(24, 8)),
    "block_mask": lambda device: dict(block_mask=masks.sliding_window(SQ, SK, 40, 64)),
    "score_mod": lambda device: dict(score_mod=_t5_score_mod(device), causal=True),
    "mask_mod": lambda device: dict(mask_mod=_every_third_key_hidden()),
    "alibi_softcap_scale": lambda device: dict(
        alibi_slopes=_randn((H,), device, torch.float32, 60).abs(), softcap=8.0,
        softmax_scale=0.2),
    "dropout": lambda device: dict(dropout_p=0.25, seed=2**64 - 3, offset=5),
}


def _compiled_and_eager(case, device, dtype, d, backend):
    keywords = CASES[case](device)

    def attend(q, k, v):
        return cft.flash_attention(q, k, v, **keywords)

    qkv, dout = _inputs(device, dtype, d)
    _assert_one_graph(attend, *qkv)
    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    return _run(compiled, qkv, dout), _run(attend, qkv, dout)


@pytest.mark.parametrize("case", sorted(CASES))
def test_keyword_compiles_to_one_graph_and_matches_eager_on_cpu(case):
    got, want = _compiled_and_eager(case, "cpu", torch.float32, D_CPU, "aot_eager")
    _assert_same(RESULTS, got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_keyword_compiles_to_one_graph_and_matches_eager_on_gpu(case):
    got, want = _compiled_and_eager(case, _cuda(), torch.bfloat16, D_GPU, "inductor")
    _assert_same(RESULTS[:1], got, want)
    # The same kernels on the same inputs: only the backward's atomic additions (dq's) may
    # come in another order, which moves a bfloat16 result by an ulp or so.
    for name, a, b in zip(RESULTS[1:], got[1:], want[1:]):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


def test_plain_callable_score_mod_compiles_on_cpu():
    def attend(q, k, v):
        return cft.flash_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: 0.5 * s)

    (q, k, v), _ = _inputs("cpu", torch.float32, D_CPU)
    _assert_one_graph(attend, q, k, v)
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    _assert_same(["out"], [compiled(q, k, v)], [attend(q, k, v)])


# ---------------------------------------------------------------------------------------------
# A Llama-style block

class LlamaBlock(torch.nn.Module):
    """Pre-norm decoder block: RMSNorm, rotary q/k, causal GQA attention, SwiGLU MLP."""

    def __init__(self, dim=64, heads=4, kv_heads=2, hidden=128):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm_attn = torch.nn.Parameter(torch.ones(dim))
        self.norm_mlp = torch.nn.Parameter(torch.ones(dim))
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.w_gate_up = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = torch.nn.Linear(hidden, dim, bias=False)

    @staticmethod
    def rms_norm(x, weight):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight

    @staticmethod
    def rotary(x):
        """Rotary embedding of (batch, seqlen, heads, head_dim), pairs (2i, 2i + 1)."""
        seqlen, d = x.shape[1], x.shape[-1]
        freq = 10000.0 ** (-torch.arange(0, d, 2, device=x.device, dtype=x.dtype) / d)
        angle = torch.arange(seqlen, device=x.device, dtype=x.dtype)[:, None] * freq
        cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
        even, odd = x[..., ::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.rms_norm(x, self.norm_attn)
        q = self.rotary(self.wq(h).view(b, s, self.heads, self.head_dim))
        k, v = self.wkv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        attn = cft.flash_attention(q, self.rotary(k), v, causal=True)
        x = x + self.wo(attn.reshape(b, s, -1))
        gate, up = self.w_gate_up(self.rms_norm(x, self.norm_mlp)).chunk(2, -1)
        return x + self.w_down(torch.nn.functional.silu(gate) * up)


def _check_llama_block(device):
    torch.manual_seed(0)
    block = LlamaBlock().to(device)
    x = _randn((2, 97, 64), device, torch.float32, 70)
    _assert_one_graph(block, x)
    compiled = torch.compile(block, fullgraph=True)
    results = []
    for model in (compiled, block):
        block.zero_grad()
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        out.square().mean().backward()
        results.append([out.detach(), leaf.grad] + [p.grad.clone() for p in block.parameters()])
    names = ["out", "dx"] + [n for n, _ in block.named_parameters()]
    _assert_near(names, *results, BLOCK_RTOL)


def test_llama_block_compiles_with_inductor_to_one_graph_on_cpu():
    _check_llama_block("cpu")


@pytest.mark.gpu
def test_llama_block_compiles_with_inductor_to_one_graph_on_gpu():
    _check_llama_block(_cuda())


# ---------------------------------------------------------------------------------------------
# Guards, changing scalars and shapes

def test_another_block_mask_object_recompiles():
    def attend(q, k, v, mask):
        return cft.flash_attention(q, k, v, block_mask=mask)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    (q, k, v), _ = _inputs("cpu", torch.float32, D_CPU)
    for mask in (masks.causal(SQ, SK, 64), masks.sliding_window(SQ, SK, 40, 64),
                 masks.causal(SQ, SK, 64)):
        _assert_same(["out"], [compiled(q, k, v, mask)], [attend(q, k, v, mask)])


def test_a_deep_copy_of_a_block_mask_is_found_as_its_own_object():
    def attend(q, k, v, mask):
        return cft.flash_attention(q, k, v, block_mask=mask)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    (q, k, v), _ = _inputs("cpu", torch.float32, D_CPU)
    mask = masks.sliding_window(SQ, SK, 40, 64)
    want = attend(q, k, v, mask)
    # As in a deep copy of a model, e.g. for an EMA of its weights.
    twin = copy.deepcopy(mask)
    _assert_same(["eager", "compiled"], [attend(q, k, v, twin), compiled(q, k, v, twin)],
                 [want, want])


def test_seeds_and_offsets_changing_from_call_to_call_keep_one_graph():
    def attend(q, k, v, seed, offset):
        return cft.flash_attention(q, k, v, dropout_p=0.3, seed=seed, offset=offset)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    (q, k, v), _ = _inputs("cpu", torch.float32, D_CPU)
    _assert_one_graph(attend, q, k, v, 1, 0)
    for seed, offset in ((1, 0), (2, 1), (3, 2), (2**64 - 1, 7)):
        _assert_same(["out"], [compiled(q, k, v, seed, offset)], [attend(q, k, v, seed, offset)])


def test_dynamic_seqlens_do_not_recompile():
    def attend(q, k, v):
        return cft.flash_attention(q, k, v, causal=True)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True, dynamic=True)
    for call, (seqlen_q, seqlen_k) in enumerate(((33, 47), (61, 20))):
        q = _randn((1, seqlen_q, H, D_CPU), "cpu", torch.float32, 80)
        k, v = (_randn((1, seqlen_k, HK, D_CPU), "cpu", torch.float32, s) for s in (81, 82))
        with torch._dynamo.config.patch(error_on_recompile=call > 0):
            _assert_same(["out"], [compiled(q, k, v)], [attend(q, k, v)])


# ---------------------------------------------------------------------------------------------
# cupyflash.flash_attention* on tensors under torch.compile

def _numpy_style_step(q, k, v, dout):
    out, lse = cf.flash_attention(q, k, v, causal=True, return_lse=True)
    grads = cf.flash_attention_backward(dout, q, k, v, out, lse, causal=True,
                                        deterministic=True)
    return (out, lse, *grads)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cupyflash_functions_on_tensors_go_to_the_operators_under_compile(device):
    if device == "cuda":
        _cuda()
    dtype, d = (torch.float32, D_CPU) if device == "cpu" else (torch.bfloat16, D_GPU)
    (q, k, v), dout = _inputs(device, dtype, d)
    q.requires_grad_()          # and still no autograd: these functions detach, as eagerly
    _assert_one_graph(_numpy_style_step, q, k, v, dout)
    compiled = torch.compile(_numpy_style_step, fullgraph=True,
                             backend="aot_eager" if device == "cpu" else "inductor")
    got = compiled(q, k, v, dout)
    assert not any(r.requires_grad for r in got)
    _assert_same(("out", "lse", "dq", "dk", "dv"), got, _numpy_style_step(q, k, v, dout))


def test_traced_backward_refuses_a_score_mods_grad_arrays():
    bias = np.zeros((H, 2 * T5_W))
    mod = cf.ScoreMod(python=lambda s, b, h, q_idx, kv_idx, bias: s,
                      python_grad=lambda s, ds, b, h, q_idx, kv_idx, bias, d_bias: ds,
                      arrays={"bias": bias}, grad_arrays=("bias",))

    def step(q, k, v):
        out, lse = cf.flash_attention(q, k, v, score_mod=mod, return_lse=True)
        return cf.flash_attention_backward(out, q, k, v, out, lse, score_mod=mod)

    (q, k, v), _ = _inputs("cpu", torch.float32, D_CPU)
    assert len(step(q, k, v)) == 4
    with pytest.raises(NotImplementedError, match="grad_arrays"):
        torch.compile(step, backend="aot_eager")(q, k, v)


# ---------------------------------------------------------------------------------------------
# torch.export

class Attention(torch.nn.Module):
    """Projections and block-sparse GQA attention, through cupyflash.torch or, with
    ``numpy_style``, through cupyflash.flash_attention (no autograd: an inference module)."""

    def __init__(self, numpy_style, dim=64, heads=4, kv_heads=2, seqlen=97):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wqkv = torch.nn.Linear(dim, dim + 2 * kv_heads * self.head_dim)
        self.mask = masks.causal(seqlen, seqlen, 64)
        self.attention = cf.flash_attention if numpy_style else cft.flash_attention

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).view(b, s, -1, self.head_dim).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=2)
        return self.attention(q, k, v, block_mask=self.mask).reshape(b, s, -1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("numpy_style", [False, True], ids=["cupyflash.torch", "cupyflash"])
@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_records_one_operator_node(device, numpy_style, strict):
    if device == "cuda":
        _cuda()
    torch.manual_seed(1)
    module = Attention(numpy_style).to(device)
    x = _randn((2, 97, 64), device, torch.float32, 90)
    program = torch.export.export(module, (x,), strict=strict)
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.cupyflash.flash_attention.default) == 1
    with torch.no_grad():
        _assert_same(["out"], [program.module()(x)], [module(x)])


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck

OPCHECK_CASES = {
    "plain": dict(),
    "causal_gqa_scale": dict(causal=True, softmax_scale=0.3),
    "window_softcap": dict(window_size=(24, 8), softcap=8.0),
    "block_mask": dict(block_mask=masks.sliding_window(SQ, SK, 40, 64)),
    "score_mod": dict(score_mod=_t5_score_mod("cpu")),
    "dropout": dict(dropout_p=0.25, seed=2**64 - 3, offset=5),
}


@pytest.mark.parametrize("case", sorted(OPCHECK_CASES))
def test_opcheck_passes_for_both_operators(case):
    (q, k, v), dout = _inputs("cpu", torch.float32, D_CPU)
    options = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, dropout_p=0.0, seed=None, offset=0, block_mask=None,
                   score_mod=None, mask_mod=None)
    options.update(OPCHECK_CASES[case])
    # ``objects`` keeps the objects of the handles alive while the operators run.
    args, objects = cft._op_args(**options)
    forward = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *args)
    torch.library.opcheck(torch.ops.cupyflash.flash_attention.default, forward)
    with torch.no_grad():
        out, lse = torch.ops.cupyflash.flash_attention(q, k, v, *args)
    backward = (dout, q.detach(), k.detach(), v.detach(), out, lse, *args, False)
    torch.library.opcheck(torch.ops.cupyflash.flash_attention_backward.default, backward)


# ---------------------------------------------------------------------------------------------
# The registry of Python objects

def test_eager_calls_leave_no_object_behind():
    (q, k, v), dout = _inputs("cpu", torch.float32, D_CPU)
    q.requires_grad_()
    gc.collect()
    live, pinned = len(cf.mods.live), dict(cft._pinned)
    score_mod = _t5_score_mod("cpu")
    score_mod_freed = weakref.ref(score_mod)
    # A plain callable becomes a MaskMod for the call.
    out = cft.flash_attention(q, k, v, score_mod=score_mod,
                              mask_mod=lambda b, h, q_idx, kv_idx: kv_idx % 3 != 1)
    del score_mod
    gc.collect()
    assert len(cf.mods.live) == live + 2            # held by out's autograd context
    out.backward(dout)
    del out
    gc.collect()
    assert score_mod_freed() is None
    assert len(cf.mods.live) == live and cft._pinned == pinned


def test_backward_keeps_the_objects_of_its_forward():
    qkv, dout = _inputs("cpu", torch.float32, D_CPU)
    mask = masks.causal(SQ, SK, 64)
    want = _run(lambda q, k, v: cft.flash_attention(q, k, v, block_mask=mask), qkv, dout)
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv)
    # The only reference to this mask is the call's own.
    out = cft.flash_attention(q, k, v, block_mask=masks.causal(SQ, SK, 64))
    gc.collect()
    out.backward(dout)
    _assert_same(RESULTS, (out.detach(), q.grad, k.grad, v.grad), want)


def test_compiled_backward_outlives_the_forwards_mask():
    def attend(q, k, v, mask):
        return cft.flash_attention(q, k, v, block_mask=mask)

    qkv, dout = _inputs("cpu", torch.float32, D_CPU)
    want = _run(lambda q, k, v: attend(q, k, v, masks.causal(SQ, SK, 64)), qkv, dout)
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv)
    mask = masks.causal(SQ, SK, 64)
    out = compiled(q, k, v, mask)
    # Kept for the compiled graphs, which hold its handle, once the caller has dropped it.
    assert cft._pinned[id(mask)] is mask
    del mask
    gc.collect()
    out.backward(dout)
    _assert_same(RESULTS, (out.detach(), q.grad, k.grad, v.grad), want)


# ---------------------------------------------------------------------------------------------
# No PyTorch where it is not asked for

def test_cupyflash_and_a_numpy_call_do_not_import_torch():
    code = ("import sys, numpy as np, cupyflash as cf\n"
            "q = np.random.default_rng(0).standard_normal((1, 9, 2, 8))\n"
            "cf.flash_attention(q, q, q, causal=True)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
