"""cupyflash in a model nobody here wrote: Hugging Face transformers' Llama, its attention
replaced through ``AttentionInterface`` by ``cupyflash.torch.hf_attention``.

A tiny randomly initialised Llama (2 layers, hidden 128, 4 query heads sharing 2 KV heads,
sequences of 64) is run forward and backward with ``attn_implementation="cupyfa"`` and with
the model's own ``"sdpa"``, from the same weights and tokens:
- float32 on the CPU (cupyflash's NumPy path): the loss to 1e-5 of SDPA's; the gradients of
  every parameter by FlashAttention's rule (DESIGN.md) against the float64 SDPA model, with
  the float32 SDPA model as the baseline (most of either error comes from the rest of the
  model, which both share).
- bfloat16 on CUDA (marker ``gpu``): the loss to 1e-3 of SDPA's, the gradients by the same
  rule (3x the error of the bf16 SDPA model against the float64 one).
Also: ``torch.compile(fullgraph=True)`` of the model's loss traces with no graph break
(transformers 5), generation with a KV cache (one query row per step) gives SDPA's tokens,
dropout repeats under ``torch.manual_seed``, and what the kernels cannot express (padding, a
name transformers takes for a kernel of its own, a name without a mask function) is refused.

Skipped where PyTorch or transformers (4.53 or later: ``transformers.masking_utils``) is absent.
"""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.masking_utils")   # AttentionMaskInterface: 4.53 and later

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import cupyflash.torch as cft  # noqa: E402

try:
    from gpu_checks import BWD_FACTOR, seed_of  # noqa: E402
    from reference import assert_rule  # noqa: E402
except ImportError:
    from tests.gpu_checks import BWD_FACTOR, seed_of  # noqa: E402
    from tests.reference import assert_rule  # noqa: E402

NAME = cft.register_hf_attention()
VOCAB, BATCH, SEQ = 256, 2, 64
# Ten times Llama's 0.02: at 0.02 the scores of a random model are ~0 and attention is nearly
# uniform, so an error in which keys a query sees would hardly move the loss.
INIT_STD = 0.2
LOSS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


def _llama(attn_implementation, dtype, device, seed, attention_dropout=0.0):
    """The tiny Llama of this file: the same weights for the same seed, whatever the
    implementation (initialised in float32 on the CPU, then cast and moved)."""
    torch.manual_seed(seed)
    # A config per model: it carries the implementation, and models built from one share it.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2 * SEQ, initializer_range=INIT_STD,
                         attention_dropout=attention_dropout,
                         attn_implementation=attn_implementation)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def _tokens(seed, device):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).to(device)


def _loss_and_grads(model, ids):
    """The language-model loss on ``ids`` and every parameter's gradient (float64, host)."""
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.double().cpu().numpy() for name, p in model.named_parameters()}
    return loss.double().item(), grads


def _check_against_sdpa(dtype, device, seed):
    ids = _tokens(seed, device)
    ours_loss, ours = _loss_and_grads(_llama(NAME, dtype, device, seed), ids)
    sdpa_loss, sdpa = _loss_and_grads(_llama("sdpa", dtype, device, seed), ids)
    _, exact = _loss_and_grads(_llama("sdpa", torch.float64, device, seed), ids)
    assert abs(ours_loss - sdpa_loss) <= LOSS_RTOL[dtype] * abs(sdpa_loss), \
        f"loss {ours_loss:.7f}, SDPA's {sdpa_loss:.7f}"
    assert ours.keys() == exact.keys()
    for name in exact:
        assert_rule(name, ours[name], exact[name], sdpa[name], BWD_FACTOR)


def test_llama_float32_on_cpu_matches_sdpa(request):
    _check_against_sdpa(torch.float32, "cpu", seed_of(request))


@pytest.mark.gpu
def test_llama_bf16_on_cuda_matches_sdpa(request):
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device (CPU-only build?)")
    _check_against_sdpa(torch.bfloat16, "cuda", seed_of(request))


def test_compiled_llama_has_no_graph_break(request):
    # transformers 4.57 materialises the causal mask while Dynamo traces (it never skips it
    # then), and hf_attention refuses masks; 5.23 passes None as in eager mode. The GPU
    # image's transformers 5 (older) passed a mask too.
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if version < (5, 23):
        pytest.skip(f"transformers {transformers.__version__} passes a mask under torch.compile")
    seed = seed_of(request)
    ids = _tokens(seed, "cpu")
    model = _llama(NAME, torch.float32, "cpu", seed)
    # aot_eager: Dynamo and AOTAutograd trace forward and backward (the custom operators'
    # fake implementations included) with no C++ compiler needed on the CPU.
    compiled = torch.compile(lambda ids: model(ids, labels=ids).loss, backend="aot_eager",
                             fullgraph=True)
    loss = compiled(ids)
    loss.backward()
    eager = model(ids, labels=ids).loss.item()
    assert abs(loss.item() - eager) <= LOSS_RTOL[torch.float32] * abs(eager)
    assert all(p.grad is not None for p in model.parameters())


def test_generation_with_a_kv_cache_gives_sdpa_tokens(request):
    # The prompt is one causal square; each further step is one query row seeing every
    # cached key (no mask from transformers, non-causal as in SDPA's path).
    seed = seed_of(request)
    prompt = _tokens(seed, "cpu")[:, :16]
    runs = [_llama(impl, torch.float32, "cpu", seed).generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                do_sample=False, pad_token_id=0)
            for impl in (NAME, "sdpa")]
    assert torch.equal(runs[0], runs[1])


def test_dropout_repeats_under_manual_seed(request):
    seed = seed_of(request)
    ids = _tokens(seed, "cpu")
    model = _llama(NAME, torch.float32, "cpu", seed, attention_dropout=0.5).train()
    losses = []
    for _ in range(2):
        torch.manual_seed(seed)
        losses.append(model(ids, labels=ids).loss.item())
    assert losses[0] == losses[1]
    model.eval()                              # transformers passes dropout=0 in eval mode
    assert model(ids, labels=ids).loss.item() != losses[0]


def test_padding_mask_is_refused(request):
    seed = seed_of(request)
    ids = _tokens(seed, "cpu")
    padding = torch.ones_like(ids)
    padding[0, :4] = 0                        # left padding of the first sequence
    model = _llama(NAME, torch.float32, "cpu", seed)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        model(ids, attention_mask=padding)
    # A mask without padding is dropped by transformers (eagerly): accepted.
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(logits, model(ids).logits)


def test_names_transformers_takes_for_kernels_are_refused():
    for name in ("cupyflash", "kernels-community/cupy"):
        with pytest.raises(ValueError, match="neither 'flash' nor '/'"):
            cft.register_hf_attention(name)


def test_name_without_a_mask_function_is_refused(request):
    # Registered as an attention function only, the name gets no mask from transformers,
    # padding included: hf_attention could not tell padding from none.
    from transformers import AttentionInterface
    AttentionInterface.register("cupyfa_without_masks", cft.hf_attention)
    seed = seed_of(request)
    model = _llama("cupyfa_without_masks", torch.float32, "cpu", seed)
    with pytest.raises(ValueError, match="builds no mask"):
        model(_tokens(seed, "cpu"))

