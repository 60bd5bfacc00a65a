"""generate()'s flat decode step (models/decode_step.py): where it applies it gives the modules' numbers bit for bit,
and where it does not (a hooked layer, hidden states asked for, calls outside generate) the modules run."""

from __future__ import annotations

import pytest
import torch

import gpuformers.models.llama as llama
from gpuformers.models import decode_step
from gpuformers.models.auto import AutoConfig, AutoModelForCausalLM

TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0)
NEW_TOKENS = 6


def _model(model_type: str, dtype: str = "float32", **overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms away from 1, so that a norm weight applied twice or not at all shows
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture
def steps(monkeypatch):
    """The number of forwards the flat decode step ran."""
    ran = []
    call = decode_step.DecodeStep.__call__
    monkeypatch.setattr(decode_step.DecodeStep, "__call__", lambda self, *a: (ran.append(1), call(self, *a))[1])
    return ran


def _generate(model, ids, **kwargs):
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _modules_only(monkeypatch):
    monkeypatch.setattr(llama, "decode_step_for", lambda model: None)


def _ids(rows: int = 1, length: int = 7):
    return torch.randint(1, TINY["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen2", "mistral", "qwen3_moe", "smollm3", "gpt_oss", "glm",
                                        "ministral3", "ernie4_5"])
@pytest.mark.parametrize("rows", [1, 3])
def test_flat_step_gives_the_modules_numbers(model_type, rows, steps, monkeypatch):
    model = _model(model_type, **({"qkv_bias": True} if model_type == "qwen2" else {}))
    ids = _ids(rows)
    seq, logits = _generate(model, ids)
    assert len(steps) == NEW_TOKENS - 1  # every decode step after the prefill
    _modules_only(monkeypatch)
    want_seq, want = _generate(model, ids)
    assert torch.equal(seq, want_seq) and torch.equal(logits, want)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_bfloat16_takes_it_with_the_modules_numbers(model_type, steps, monkeypatch):
    model = _model(model_type, dtype="bfloat16")  # the norms upcast, no joint q/k norm, no CPU copies
    ids = _ids(2)
    seq, logits = _generate(model, ids)
    assert len(steps) == NEW_TOKENS - 1
    _modules_only(monkeypatch)
    want_seq, want = _generate(model, ids)
    assert torch.equal(seq, want_seq) and torch.equal(logits, want)


def test_sampling_and_the_static_cache_take_it_with_the_same_tokens(steps, monkeypatch):
    model = _model("qwen3")
    ids = _ids()
    torch.manual_seed(3)
    sampled = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20, eos_token_id=None)
    static_seq, static = _generate(model, ids, cache_implementation="static")
    assert len(steps) == 2 * (NEW_TOKENS - 1)
    _modules_only(monkeypatch)
    torch.manual_seed(3)
    assert torch.equal(sampled, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20,
                                               eos_token_id=None))
    want_seq, want = _generate(model, ids, cache_implementation="static")
    assert torch.equal(static_seq, want_seq) and torch.equal(static, want)


def test_without_cpu_copies_each_projection_is_its_own_call(steps, monkeypatch):
    model = _model("llama")
    ids = _ids()
    monkeypatch.setenv("GPUFORMERS_CPU_PACKED_ROWS", "none")  # no copies: q/k/v and gate/up are separate matmuls
    seq, logits = _generate(model, ids)
    assert len(steps) == NEW_TOKENS - 1
    _modules_only(monkeypatch)
    want_seq, want = _generate(model, ids)
    assert torch.equal(seq, want_seq) and torch.equal(logits, want)


@pytest.mark.parametrize("model_type, overrides", [("qwen3", {}), ("mistral", {"sliding_window": 5})])
def test_padding_and_a_sliding_window_take_it_with_the_modules_numbers(model_type, overrides, steps, monkeypatch):
    model = _model(model_type, **overrides)
    ids = _ids(2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: every step's attention gets a mask (and with the window, it slides)
    seq, logits = _generate(model, ids, attention_mask=mask)
    assert len(steps) == NEW_TOKENS - 1
    _modules_only(monkeypatch)
    want_seq, want = _generate(model, ids, attention_mask=mask)
    assert torch.equal(seq, want_seq) and torch.equal(logits, want)


def test_inside_a_generate_block_one_token_forwards_take_it_unless_hidden_states_are_asked(steps, monkeypatch):
    from gpuformers.generation.cache import DynamicCache
    from gpuformers.models.modeling import keep_plain_calls

    model = _model("llama")
    cache = DynamicCache()
    with torch.no_grad(), keep_plain_calls():  # what generate() runs its loop in
        model(_ids(), past_key_values=cache, use_cache=True)
        token = _ids(length=1)
        hidden = model(token, past_key_values=cache, use_cache=True, output_hidden_states=True).hidden_states
        assert steps == [] and len(hidden) == TINY["num_hidden_layers"] + 1
        cache.crop(7)
        flat = model(token, past_key_values=cache, use_cache=True).logits
        assert len(steps) == 1
        cache.crop(7)
        _modules_only(monkeypatch)
        want = model(token, past_key_values=cache, use_cache=True).logits
    assert torch.equal(flat, want)


def test_a_layer_hook_runs_and_the_next_call_asks_again(steps):
    model = _model("llama")
    ids = _ids()
    _generate(model, ids)
    assert len(steps) == NEW_TOKENS - 1
    seen = []
    handle = model.model.layers[1].register_forward_hook(lambda m, a, o: seen.append(1))
    try:
        _generate(model, ids)
    finally:
        handle.remove()
    assert len(steps) == NEW_TOKENS - 1 and len(seen) == NEW_TOKENS  # the modules ran: prefill and every step
    _generate(model, ids)
    assert len(steps) == 2 * (NEW_TOKENS - 1)  # hook gone: flat again


def test_a_forward_outside_generate_runs_the_modules(steps):
    from gpuformers.generation.cache import DynamicCache

    model = _model("llama")
    cache = DynamicCache()
    with torch.no_grad():
        model(_ids(), past_key_values=cache, use_cache=True)
        model(_ids(length=1), past_key_values=cache, use_cache=True)
    assert steps == []


def test_a_family_with_its_own_layer_forward_is_left_to_its_modules(steps):
    model = _model("olmo2")  # norms after attention and MLP: another layer forward
    _generate(model, _ids())
    assert steps == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_on_cuda_it_gives_the_modules_numbers(model_type, steps, monkeypatch):
    model = _model(model_type, dtype="bfloat16").to("cuda")  # the dynamic cache: eager steps, not CUDA graphs
    ids = _ids(2).to("cuda")
    seq, logits = _generate(model, ids)
    assert len(steps) == NEW_TOKENS - 1
    _modules_only(monkeypatch)
    want_seq, want = _generate(model, ids)
    assert torch.equal(seq, want_seq) and torch.equal(logits, want)
