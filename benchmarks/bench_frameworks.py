"""The framework targets of issue 18: torch.compile, CUDA graphs and jax.jit, measured on a GPU.

    python benchmarks/bench_frameworks.py --out DIR [--parts compile graphs jit]
                                          [--repeats 10] [--graph-calls 100] [--seed 0]

Three parts, each skipped with the reason where its framework or a GPU is missing:

- ``compile``: a Llama-style block in PyTorch (RMSNorm, q/k/v projections, causal GQA
  attention through ``cupyflash.torch.flash_attention``, output projection, RMSNorm, SwiGLU
  MLP, residuals; bf16, batch 4 x seqlen 2048, hidden 2048, 16 query heads sharing 4 KV heads
  of dim 128, MLP 5632). One training step (forward and backward of a scalar loss, no
  optimizer) eagerly and under ``torch.compile(block, fullgraph=True)``; the graph breaks of
  ``torch._dynamo.explain(block)(x)``; the same for a function that only calls
  ``flash_attention`` (forward and backward), the same kernels alone. Targets: no graph
  break, compiled step <= 1.03 x eager step (both the block and the attention alone).
- ``graphs``: ``torch.cuda.graph`` capture of ``--graph-calls`` consecutive forward calls on
  static inputs, at decode-like shapes where launch overhead matters (bf16, batch 1, 16
  heads, head dim 64: seqlen 256 causal, and one query row over 1024 keys). Warm-up on a side
  stream, capture, then fresh inputs and a replay checked against an eager call (equal, the
  forward is deterministic). Per call: (a) eager wall time, (b) replay wall time, (c) kernel
  time inside a replay (``torch.profiler``, every CUDA kernel event of the replays). Target:
  launch overhead (b) - (c) < 5 us. Also a whole training step of a small block captured as
  in PyTorch's whole-network example (``loss.backward()`` inside the capture, grads set to
  None before it): the replay's loss and gradients against an eager step's.
- ``jit``: JAX, ``jax.jit(jax.value_and_grad(loss))`` with ``loss = sum(out * w)`` of
  ``cupyflash.jax.flash_attention(q, k, v, causal=True)`` (bf16, batch 4, seqlen 2048, 16
  heads, head dim 128) against the same step made of eager kernel calls
  (``cupyflash.flash_attention(..., return_lse=True)`` and
  ``cupyflash.flash_attention_backward`` on the JAX arrays, and the elementwise ops of the
  loss); loss and gradients compared. Target: jit step <= 1.05 x eager step.

Times are wall times (``time.perf_counter``) of a loop of calls ended by a device
synchronization, divided by the calls; the best of ``--repeats`` (median also stored), after
warm-up, on inputs drawn at random (several sets in turn where a step is timed). Writes
DIR/bench_frameworks.json (GPU, date, commit from $GIT_COMMIT, versions with NVRTC's, every
number measured, the shapes, the targets and whether each is met) and prints a table last.
"""
import argparse
import datetime
import functools
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

# Before JAX is imported: by default it takes 75% of GPU memory at its first use, which would
# starve CuPy's and PyTorch's pools in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cupyflash import bench  # noqa: E402
from cupyflash._gpu import gpu_or_reason  # noqa: E402
from cupyflash.bench.reports import git_commit, versions  # noqa: E402

PARTS = ("compile", "graphs", "jit")
COMPILE_TARGET = 1.03        # compiled step time / eager step time
LAUNCH_TARGET_US = 5.0       # replay wall time per call - kernel time per call
JIT_TARGET = 1.05            # jitted step time / eager-kernels step time
# Gradients of two runs of the same kernels: dq is summed with atomics in no fixed order, which
# moves a bf16 result by an ulp (2**-8 of it) or so; max |a - b| over max |b|.
GRAD_RTOL = 1e-2
LOSS_RTOL = 1e-3             # float32 sums of the same products, in another order
SETS = 3                     # input sets the timed steps take in turn
WARMUP = 3                   # untimed steps before timing (the first compiles)
PROFILED_REPLAYS = 3
DEVICE = "cuda"             # PyTorch's device of every part (its current GPU)

BLOCK = dict(batch=4, seqlen=2048, dim=2048, heads=16, kv_heads=4, mlp_hidden=5632)
TRAIN_BLOCK = dict(batch=2, seqlen=256, dim=512, heads=8, kv_heads=2, mlp_hidden=1024)
GRAPH_SHAPES = (dict(batch=1, seqlen_q=256, seqlen_k=256, heads=16, headdim=64, causal=True),
                dict(batch=1, seqlen_q=1, seqlen_k=1024, heads=16, headdim=64, causal=False))
JAX_SHAPE = dict(batch=4, seqlen=2048, heads=16, headdim=128, causal=True)

log = functools.partial(print, flush=True)


class Skipped(Exception):
    """A part that cannot run here; the message says why."""


# --- what each part needs ------------------------------------------------------------------

def cupy_gpu():
    cp, why = gpu_or_reason()
    if cp is None:
        raise Skipped(f"no GPU: {why}")
    return cp


def torch_on_gpu():
    """(torch, cupyflash.torch), or Skipped with the reason."""
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        raise Skipped(f"PyTorch is not importable ({bench.error_text(e)})") from None
    if not torch.cuda.is_available():
        build = "CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise Skipped(f"no GPU: PyTorch {torch.__version__} ({build}) sees no CUDA device")
    cupy_gpu()
    try:
        import cupyflash.torch as cft
    except ImportError as e:
        raise Skipped(bench.error_text(e)) from None
    return torch, cft


def jax_on_gpu():
    """(jax, jax.numpy, cupyflash.jax, cupy, JAX's first GPU), or Skipped with the reason."""
    try:
        import jax
        import jax.numpy as jnp
    except Exception as e:  # ImportError, or a broken install
        raise Skipped(f"JAX is not importable ({bench.error_text(e)})") from None
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        raise Skipped(f"no GPU: JAX {jax.__version__} has no GPU backend here")
    cp = cupy_gpu()
    import cupyflash.jax as cfj
    return jax, jnp, cfj, cp, gpus[0]


# --- timing and numbers ----------------------------------------------------------------------

def timed(steps, calls, repeats, sync):
    """Wall seconds per call of each of ``steps`` (name -> ``step(i)``): ``calls`` calls in a
    row, then ``sync(last result)``, once per repeat. The steps take turns within a repeat, so
    that a drifting clock or a neighbour on the GPU weighs on all alike."""
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            sync(None)
            t0 = time.perf_counter()
            result = None
            for i in range(calls):
                result = step(i)
            sync(result)
            times[name].append((time.perf_counter() - t0) / calls)
    return times


def summary(seconds, scale):
    """Best and median of per-call times, in seconds x ``scale`` (1e3: ms, 1e6: us)."""
    return dict(best=min(seconds) * scale, median=statistics.median(seconds) * scale,
                repeats=len(seconds))


def release_memory():
    """Cached device memory given back between parts (nothing to do without a GPU)."""
    if gpu_or_reason()[0] is not None:
        bench.release_memory()


def finite(x):
    """A float for the JSON, or its text where it is NaN or infinite."""
    x = float(x)
    return x if math.isfinite(x) else str(x)


def relative_error(a, b):
    """max |a - b| / max |b| of two arrays that have ``abs`` and ``max`` (float32 already)."""
    err, top = float(abs(a - b).max()), float(abs(b).max())
    return err / top if top > 0 else err


def target(what, value, limit, met, detail=""):
    return dict(what=what, value=value, target=limit, met=met, detail=detail)


# --- part 1: torch.compile ---------------------------------------------------------------------

def llama_block(torch, cft, dim, heads, kv_heads, mlp_hidden):
    """A pre-norm Llama-style decoder block: RMSNorm, q/k/v projections, causal GQA attention
    (ours), output projection, RMSNorm, SwiGLU MLP, a residual around each half."""
    head_dim = dim // heads

    def rms_norm(x, weight, eps=1e-6):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_attn = torch.nn.Parameter(torch.ones(dim))
            self.norm_mlp = torch.nn.Parameter(torch.ones(dim))
            self.wq = torch.nn.Linear(dim, heads * head_dim, bias=False)
            self.wkv = torch.nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
            self.wo = torch.nn.Linear(heads * head_dim, dim, bias=False)
            self.w_gate_up = torch.nn.Linear(dim, 2 * mlp_hidden, bias=False)
            self.w_down = torch.nn.Linear(mlp_hidden, dim, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            h = rms_norm(x, self.norm_attn)
            q = self.wq(h).view(b, s, heads, head_dim)
            # Views of one projection (last dimension contiguous): read in place.
            k, v = self.wkv(h).view(b, s, 2, kv_heads, head_dim).unbind(2)
            attn = cft.flash_attention(q, k, v, causal=True)
            x = x + self.wo(attn.reshape(b, s, heads * head_dim))
            gate, up = self.w_gate_up(rms_norm(x, self.norm_mlp)).chunk(2, dim=-1)
            return x + self.w_down(torch.nn.functional.silu(gate) * up)

    return Block()


def block_loss(model, x):
    return model(x).float().square().mean()


def graph_breaks(torch, fn, *args):
    """Graphs and graph breaks of ``fn(*args)`` under Dynamo; its caches are reset after."""
    explained = torch._dynamo.explain(fn)(*args)
    torch._dynamo.reset()
    return dict(graph_count=explained.graph_count,
                graph_break_count=explained.graph_break_count,
                break_reasons=[str(getattr(r, "reason", r))[:300]
                               for r in explained.break_reasons])


def eager_and_compiled(torch, steps, repeats):
    """Warm-up (the compiled step's first call, timed apart, compiles) and interleaved times
    of ``steps`` = {"eager": step, "compiled": step}, in ms per step."""
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    first = {}
    for name, step in steps.items():
        sync(None)
        t0 = time.perf_counter()
        step(0)
        sync(None)
        first[name] = time.perf_counter() - t0
        for i in range(1, WARMUP):
            step(i)
    times = timed(steps, 5, repeats, sync)
    found = {name: summary(t, 1e3) for name, t in times.items()}
    return dict(eager_ms=found["eager"], compiled_ms=found["compiled"],
                ratio=found["compiled"]["best"] / found["eager"]["best"],
                ratio_median=found["compiled"]["median"] / found["eager"]["median"],
                first_compiled_step_s=round(first["compiled"], 2),
                steps_per_repeat=5)


def part_compile(args):
    torch, cft = torch_on_gpu()
    torch.manual_seed(args.seed)
    c = BLOCK
    dtype, device = torch.bfloat16, DEVICE
    block = llama_block(torch, cft, c["dim"], c["heads"], c["kv_heads"], c["mlp_hidden"])
    block = block.to(device=device, dtype=dtype)
    xs = [torch.randn(c["batch"], c["seqlen"], c["dim"], device=device, dtype=dtype,
                      requires_grad=True) for _ in range(SETS)]
    result = dict(block=dict(c, head_dim=c["dim"] // c["heads"], dtype="bfloat16",
                             loss="mean(block(x).float()**2)", input_grad=True))

    breaks = graph_breaks(torch, block, xs[0])
    result["block_dynamo"] = breaks
    log(f"block under Dynamo: {breaks['graph_count']} graph(s), "
        f"{breaks['graph_break_count']} break(s)")
    compiled = torch.compile(block, fullgraph=True)

    def block_step(model):
        def step(i):
            x = xs[i % SETS]
            x.grad = None
            block.zero_grad(set_to_none=True)
            loss = block_loss(model, x)
            loss.backward()
            return loss
        return step

    steps = {"eager": block_step(block), "compiled": block_step(compiled)}
    found = eager_and_compiled(torch, steps, args.repeats)
    losses = [float(steps[name](0)) for name in ("eager", "compiled")]
    found["loss_rel_diff"] = abs(losses[1] - losses[0]) / abs(losses[0])
    result["block_step"] = found
    log(f"block step: eager {found['eager_ms']['best']:.3f} ms, compiled "
        f"{found['compiled_ms']['best']:.3f} ms, ratio {found['ratio']:.3f} (first compiled "
        f"step {found['first_compiled_step_s']} s)")
    del compiled, steps
    xs.clear()
    torch._dynamo.reset()
    release_memory()

    # The attention alone: the same kernels, with nothing around them for inductor to fuse.
    b, s, h, hk, d = c["batch"], c["seqlen"], c["heads"], c["kv_heads"], c["dim"] // c["heads"]
    sets = [tuple(torch.randn(shape, device=device, dtype=dtype, requires_grad=grad)
                  for shape, grad in (((b, s, h, d), True), ((b, s, hk, d), True),
                                      ((b, s, hk, d), True), ((b, s, h, d), False)))
            for _ in range(SETS)]

    def attend(q, k, v):
        return cft.flash_attention(q, k, v, causal=True)

    def attention_step(fn):
        def step(i):
            q, k, v, dout = sets[i % SETS]
            q.grad = k.grad = v.grad = None
            out = fn(q, k, v)
            out.backward(dout)
            return out
        return step

    breaks = graph_breaks(torch, attend, *sets[0][:3])
    result["attention_dynamo"] = breaks
    compiled = torch.compile(attend, fullgraph=True)
    steps = {"eager": attention_step(attend), "compiled": attention_step(compiled)}
    found = eager_and_compiled(torch, steps, args.repeats)
    outs = [steps[name](0).detach() for name in ("eager", "compiled")]
    found["out_max_abs_diff"] = finite((outs[1].float() - outs[0].float()).abs().max())
    result["attention_step"] = found
    result["attention"] = dict(batch=b, seqlen=s, heads=h, kv_heads=hk, headdim=d, causal=True,
                               dtype="bfloat16", step="out.backward(dout), q, k, v leaves")
    log(f"attention fwd+bwd: eager {found['eager_ms']['best']:.3f} ms, compiled "
        f"{found['compiled_ms']['best']:.3f} ms, ratio {found['ratio']:.3f}")
    del compiled, steps, outs
    sets.clear()
    torch._dynamo.reset()

    block_step_, attention_step_ = result["block_step"], result["attention_step"]
    nbreaks = result["block_dynamo"]["graph_break_count"] + breaks["graph_break_count"]
    result["targets"] = [
        target("graph breaks (torch._dynamo.explain: block, attention)", nbreaks, "== 0",
               nbreaks == 0, f"block {result['block_dynamo']['graph_count']} graph(s), "
                             f"attention {breaks['graph_count']}"),
        target("block train step, compiled / eager", block_step_["ratio"],
               f"<= {COMPILE_TARGET}", block_step_["ratio"] <= COMPILE_TARGET,
               f"{block_step_['compiled_ms']['best']:.3f} / "
               f"{block_step_['eager_ms']['best']:.3f} ms; loss rel diff "
               f"{block_step_['loss_rel_diff']:.1e}"),
        target("attention fwd+bwd, compiled / eager", attention_step_["ratio"],
               f"<= {COMPILE_TARGET}", attention_step_["ratio"] <= COMPILE_TARGET,
               f"{attention_step_['compiled_ms']['best']:.3f} / "
               f"{attention_step_['eager_ms']['best']:.3f} ms; out max diff "
               f"{attention_step_['out_max_abs_diff']}"),
    ]
    return result


# --- part 2: CUDA graphs -------------------------------------------------------------------

def warm_up_on_side_stream(torch, fn, n=WARMUP):
    """PyTorch's recipe before a capture: warm-up calls (our first compiles the kernels,
    which cannot happen inside a capture) on a side stream joined back after."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def kernels_in_replays(torch, graph, replays):
    """{kernel name: [count, device us]} of every CUDA event ``torch.profiler`` records in
    ``replays`` replays of ``graph``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    found = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            entry = found.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    return found


def replay_span_us(torch, graph):
    """CUDA-event time of one replay on the GPU (its kernels and the gaps between them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def graph_forward_case(torch, cft, shape, calls, repeats):
    b, sq, sk, h, d = (shape[n] for n in ("batch", "seqlen_q", "seqlen_k", "heads", "headdim"))
    q = torch.randn(b, sq, h, d, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))

    def attend():
        return cft.flash_attention(q, k, v, causal=shape["causal"])

    warm_up_on_side_stream(torch, attend)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [attend() for _ in range(calls)]
    # Fresh inputs after the capture, and outputs filled with NaN: the replay must read the
    # static inputs as they are now and write every output.
    for t in (q, k, v):
        t.normal_()
    for out in outs:
        out.fill_(float("nan"))
    graph.replay()
    expected = attend()
    torch.cuda.synchronize()
    diff = (torch.stack(outs).float() - expected.float()).abs().max()
    equal = all(torch.equal(out, expected) for out in outs)

    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    eager = summary(timed({"eager": lambda i: attend()}, calls, repeats, sync)["eager"], 1e6)
    graph.replay()
    replay = summary([t / calls for t in timed({"replay": lambda i: graph.replay()}, 1,
                                               repeats, sync)["replay"]], 1e6)
    span = min(replay_span_us(torch, graph) for _ in range(repeats)) / calls
    found = dict(shape, dtype="bfloat16", calls_per_graph=calls,
                 replay_equals_eager=equal, replay_max_abs_diff=finite(diff),
                 eager_us_per_call=eager, replay_us_per_call=replay,
                 replay_event_span_us_per_call=span)
    try:
        kernels_in_replays(torch, graph, 1)      # the first profile starts CUPTI: not counted
        kernels = kernels_in_replays(torch, graph, PROFILED_REPLAYS)
    except Exception as e:  # a profiler without CUPTI: the other numbers stand
        found["kernel_error"] = bench.error_text(e)
        kernels = {}
    per_call = calls * PROFILED_REPLAYS
    found["kernels"] = {name: dict(count_per_call=n / per_call, us_per_call=us / per_call)
                        for name, (n, us) in sorted(kernels.items())}
    if kernels:
        found["kernel_us_per_call"] = sum(us for _, us in kernels.values()) / per_call
        found["flash_kernel_us_per_call"] = sum(
            us for name, (_, us) in kernels.items() if "flash" in name.lower()) / per_call
        found["launch_overhead_us_per_call"] = replay["best"] - found["kernel_us_per_call"]
    elif "kernel_error" not in found:
        found["kernel_error"] = "the profiler recorded no CUDA kernel in the replays"
    return found


def graph_training_step(torch, cft, repeats):
    """PyTorch's whole-network capture: a small block's forward and ``loss.backward()`` in
    one graph; the replay's loss and gradients against an eager step on the same input."""
    c = TRAIN_BLOCK
    model = llama_block(torch, cft, c["dim"], c["heads"], c["kv_heads"], c["mlp_hidden"])
    model = model.to(device=DEVICE, dtype=torch.bfloat16)
    params = list(model.parameters())
    x = torch.randn(c["batch"], c["seqlen"], c["dim"], device=DEVICE, dtype=torch.bfloat16)

    def step():
        loss = block_loss(model, x)
        loss.backward()
        return loss

    def eager_step():
        model.zero_grad(set_to_none=True)
        return step()

    warm_up_on_side_stream(torch, eager_step)
    model.zero_grad(set_to_none=True)       # the capture allocates the grads it writes
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    static_grads = [p.grad for p in params]

    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_loss.detach().float().clone()] + [g.float().clone() for g in static_grads]
    loss = eager_step()
    torch.cuda.synchronize()
    eager = [loss.detach().float()] + [p.grad.float() for p in params]
    loss_rel = relative_error(replayed[0], eager[0])
    grads_rel = max(relative_error(a, b) for a, b in zip(replayed[1:], eager[1:]))

    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    times = timed({"eager": lambda i: eager_step(), "replay": lambda i: graph.replay()}, 5,
                  repeats, sync)
    return dict(c, head_dim=c["dim"] // c["heads"], dtype="bfloat16",
                loss_rel_diff=loss_rel, grads_max_rel_diff=grads_rel,
                eager_step_us=summary(times["eager"], 1e6),
                replay_step_us=summary(times["replay"], 1e6),
                match=loss_rel <= LOSS_RTOL and grads_rel <= GRAD_RTOL)


def case_label(shape):
    return (f"sq={shape['seqlen_q']} sk={shape['seqlen_k']}"
            f"{' causal' if shape['causal'] else ''}")


def part_graphs(args):
    torch, cft = torch_on_gpu()
    torch.manual_seed(args.seed)
    result = dict(calls_per_graph=args.graph_calls, cases=[], targets=[])
    for shape in GRAPH_SHAPES:
        label = case_label(shape)
        try:
            found = graph_forward_case(torch, cft, shape, args.graph_calls, args.repeats)
        except Exception as e:
            found = dict(shape, error=bench.error_text(e), traceback=traceback.format_exc())
            log(f"forward graph {label}: {found['error']}")
            result["cases"].append(found)
            result["targets"].append(target(f"forward graph {label}", None, "", None,
                                            f"error: {found['error']}"))
            continue
        result["cases"].append(found)
        overhead = found.get("launch_overhead_us_per_call")
        names = ", ".join(name[:60] for name in found["kernels"]) or found.get("kernel_error")
        log(f"forward graph {label}: eager {found['eager_us_per_call']['best']:.2f} us/call, "
            f"replay {found['replay_us_per_call']['best']:.2f} us/call, kernels "
            f"{bench.fmt(found.get('kernel_us_per_call'), '.2f')} us/call [{names}]")
        result["targets"] += [
            target(f"replay == eager out, {label}", found["replay_max_abs_diff"], "== 0",
                   found["replay_equals_eager"], f"{args.graph_calls} calls per graph"),
            target(f"launch overhead us/call, {label}", overhead, f"< {LAUNCH_TARGET_US:g}",
                   None if overhead is None else overhead < LAUNCH_TARGET_US,
                   f"eager {found['eager_us_per_call']['best']:.2f}, replay "
                   f"{found['replay_us_per_call']['best']:.2f}, kernels "
                   f"{bench.fmt(found.get('kernel_us_per_call'), '.2f')} us/call"
                   + (f"; {found['kernel_error']}" if "kernel_error" in found else "")),
        ]
    try:
        found = graph_training_step(torch, cft, args.repeats)
    except Exception as e:
        found = dict(error=bench.error_text(e), traceback=traceback.format_exc())
        result["targets"].append(target("train step graph", None, "", None,
                                        f"error: {found['error']}"))
    else:
        result["targets"].append(target(
            "train step replay vs eager, grads rel diff", found["grads_max_rel_diff"],
            f"<= {GRAD_RTOL:g}", found["match"],
            f"loss rel diff {found['loss_rel_diff']:.1e}; eager "
            f"{found['eager_step_us']['best']:.1f} us, replay "
            f"{found['replay_step_us']['best']:.1f} us per step"))
    result["training_step"] = found
    if "error" in found:
        log(f"train step graph: {found['error']}")
    else:
        log(f"train step graph: loss rel diff {found['loss_rel_diff']:.1e}, grads max rel diff "
            f"{found['grads_max_rel_diff']:.1e}, eager {found['eager_step_us']['best']:.1f} us, "
            f"replay {found['replay_step_us']['best']:.1f} us per step")
    return result


# --- part 3: jax.jit -------------------------------------------------------------------------

def part_jit(args):
    jax, jnp, cfj, cp, gpu = jax_on_gpu()
    import cupyflash as cf
    c = JAX_SHAPE
    shape = (c["batch"], c["seqlen"], c["heads"], c["headdim"])
    f32 = jnp.float32
    keys = jax.random.split(jax.random.key(args.seed), 4 * SETS)
    sets = [tuple(jax.device_put(jax.random.normal(key, shape, jnp.bfloat16), gpu)
                  for key in keys[4 * i:4 * i + 4]) for i in range(SETS)]

    def loss(q, k, v, w):
        out = cfj.flash_attention(q, k, v, causal=c["causal"])
        return jnp.sum(out.astype(f32) * w.astype(f32))

    jitted = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    def eager(q, k, v, w):
        out, lse = cf.flash_attention(q, k, v, causal=c["causal"], return_lse=True)
        value = jnp.sum(out.astype(f32) * w.astype(f32))
        # The cotangent of out is w itself (bf16 -> float32 -> bf16 is exact).
        grads = cf.flash_attention_backward(w, q, k, v, out, lse, causal=c["causal"])
        return value, tuple(grads)

    def sync(result):
        if result is not None:
            jax.block_until_ready(result)
        # Eager results come from kernels on CuPy's stream: wait for every stream.
        cp.cuda.runtime.deviceSynchronize()

    steps = {"eager": lambda i: eager(*sets[i % SETS]), "jit": lambda i: jitted(*sets[i % SETS])}
    first = {}
    for name, step in steps.items():
        sync(None)
        t0 = time.perf_counter()
        sync(step(0))
        first[name] = time.perf_counter() - t0
        for i in range(1, WARMUP):
            sync(step(i))

    got, want = steps["jit"](0), steps["eager"](0)
    sync((got, want))
    loss_rel = abs(float(got[0]) - float(want[0])) / abs(float(want[0]))
    grads_rel = {name: relative_error(a.astype(f32), b.astype(f32))
                 for name, a, b in zip(("dq", "dk", "dv"), got[1], want[1])}
    del got, want

    times = timed(steps, 5, args.repeats, sync)
    found = {name: summary(t, 1e3) for name, t in times.items()}
    ratio = found["jit"]["best"] / found["eager"]["best"]
    agree = loss_rel <= LOSS_RTOL and max(grads_rel.values()) <= GRAD_RTOL
    log(f"jax step: eager kernels {found['eager']['best']:.3f} ms, jit "
        f"{found['jit']['best']:.3f} ms, ratio {ratio:.3f}; loss rel diff {loss_rel:.1e}, "
        f"grads {max(grads_rel.values()):.1e}")
    return dict(
        shape=dict(c, dtype="bfloat16", loss="sum(out.astype(float32) * w)"),
        device=str(gpu), eager_ms=found["eager"], jit_ms=found["jit"], ratio=ratio,
        ratio_median=found["jit"]["median"] / found["eager"]["median"], steps_per_repeat=5,
        first_jit_step_s=round(first["jit"], 2), loss_rel_diff=loss_rel,
        grads_max_rel_diff=grads_rel, agree=agree,
        targets=[
            target("train step, jit / eager kernels", ratio, f"<= {JIT_TARGET}",
                   ratio <= JIT_TARGET, f"{found['jit']['best']:.3f} / "
                                        f"{found['eager']['best']:.3f} ms"),
            target("jit vs eager, grads max rel diff", max(grads_rel.values()),
                   f"<= {GRAD_RTOL:g}", agree, f"loss rel diff {loss_rel:.1e}"),
        ])


PART_FUNCTIONS = {"compile": part_compile, "graphs": part_graphs, "jit": part_jit}


# --- report --------------------------------------------------------------------------------

def run_part(name, args):
    t0 = time.perf_counter()
    try:
        result = PART_FUNCTIONS[name](args)
    except Skipped as e:
        result = dict(skipped=str(e))
        log(f"skipped: {e}")
    except Exception as e:
        result = dict(error=bench.error_text(e), traceback=traceback.format_exc())
        log(result["traceback"])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    release_memory()
    return result


def has_error(obj):
    if isinstance(obj, dict):
        return "error" in obj or any(has_error(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_error(v) for v in obj)
    return False


def metadata():
    """GPU, date, commit and versions (NVRTC's among them), as far as this machine has them."""
    gpu = None
    if gpu_or_reason()[0] is not None:
        gpu = bench.gpu_name()
    try:
        found = versions()
    except Exception:  # no CuPy: what Python and the frameworks say
        found = {"python": platform.python_version()}
    for name in ("torch", "jax", "jaxlib"):
        if name in sys.modules:
            found[name] = getattr(sys.modules[name], "__version__", "?")
    return dict(gpu=gpu,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                git_commit=git_commit(), versions=found)


def table(results):
    header = ["part", "measure", "value", "target", "met", "detail"]
    lines = []
    for part, result in results.items():
        if "skipped" in result or "error" in result:
            status = "skipped" if "skipped" in result else "error"
            lines.append([part, status, "-", "-", "-", result[status][:100]])
            continue
        for t in result["targets"]:
            value = t["value"]
            text = bench.fmt(value, ".4g") if not isinstance(value, (str, bool)) else str(value)
            met = "-" if t["met"] is None else ("yes" if t["met"] else "NO")
            lines.append([part, t["what"], text, t["target"], met, t["detail"][:100]])
    return bench.table_text(header, lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for bench_frameworks.json")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="compile: torch.compile of a Llama block; graphs: CUDA graph replay; "
                         "jit: jax.jit (default: all three)")
    ap.add_argument("--repeats", type=int, default=10,
                    help="timed repeats per measurement; the best is the result (default 10)")
    ap.add_argument("--graph-calls", type=int, default=100,
                    help="forward calls captured in one CUDA graph (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    results = {}
    for name in PARTS:
        if name in args.parts:
            log(f"=== {name} ===")
            results[name] = run_part(name, args)
    doc = dict(
        benchmark="frameworks (issue 18): torch.compile, CUDA graphs, jax.jit", **metadata(),
        config=dict(parts=args.parts, repeats=args.repeats, graph_calls=args.graph_calls,
                    seed=args.seed, input_sets=SETS, warmup=WARMUP,
                    profiled_replays=PROFILED_REPLAYS,
                    statistic="wall time (perf_counter) of a loop of calls ended by a device "
                              "synchronization, per call; best of the repeats (median too)",
                    targets=dict(compile_ratio=COMPILE_TARGET, launch_overhead_us=LAUNCH_TARGET_US,
                                 jit_ratio=JIT_TARGET, grad_rtol=GRAD_RTOL, loss_rtol=LOSS_RTOL),
                    env={n: os.environ.get(n) for n in ("CUPYFLASH_KERNELS",
                                                        "XLA_PYTHON_CLIENT_PREALLOCATE")}),
        parts=results)
    path = bench.write_json(Path(args.out) / "bench_frameworks.json", doc)
    log(f"\nwrote {path}")
    log("=== bench_frameworks table ===")
    log(table(results))
    return 1 if has_error(results) else 0


if __name__ == "__main__":
    sys.exit(main())
