"""Phi-3 / Phi-3.5 / Phi-4-mini against transformers on tiny random checkpoints: logits (fused qkv and gate_up,
partial rotary, longrope short and long, sliding window, tied embeddings), greedy tokens with dynamic and static
caches, generation past longrope's original_max_position_embeddings (cache recomputed as transformers does; not for
Llama), loss and backward, saving both ways, the engine, use_kernels, and what is refused (tp_plan="auto", assisted
generation across that length)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.fixtures.checkpoints import make_checkpoint, rewrite_config

if not torch.cuda.is_available():  # use_kernels on the CPU runs the Triton interpreter (read when triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

ATOL = 1e-4
IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # Phi3Config's defaults (32000) lie outside a tiny vocab


def _longrope(pairs: int, original: int, partial: float = 1.0) -> dict:
    return {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                                "short_factor": [1.0 + i / 16 for i in range(pairs)],
                                "long_factor": [1.0 + i / 4 for i in range(pairs)]},
            "original_max_position_embeddings": original}


CASES = {
    # Phi-3-mini-4k: multi-head attention, untied, full rotary
    "mha": {"num_key_value_heads": 4},
    # Phi-3-mini-4k's sliding window, with GQA and tied embeddings
    "window-tied": {"sliding_window": 6, "tie_word_embeddings": True},
    # Phi-4-mini: tied, GQA, 3/4 of each head rotated (16 -> 12 dims, 6 factors), longrope past original (12)
    "phi4-mini": {"tie_word_embeddings": True, "max_position_embeddings": 64, **_longrope(6, 12, partial=0.75)},
    # Phi-3.5-mini: longrope, full rotary, sequences within original_max_position_embeddings (short factors)
    "phi3.5-short": {"max_position_embeddings": 128, **_longrope(8, 40)},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    out = {}
    for name, overrides in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, make_checkpoint(folder, "phi3", **IDS, **overrides))
    return out


def _load(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, progress=False, **kwargs)


def _batch(seq=20, pad=5):
    ids = torch.randint(3, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0  # left padding in the second row
    return ids, mask


def _max_diff(a, b, mask):
    return (a - b)[mask.bool()].abs().max().item()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    ours = _load(folder, attn_implementation=attn)
    assert hasattr(ours.model.layers[0].self_attn, "qkv_proj") and hasattr(ours.model.layers[0].mlp, "gate_up_proj")
    ids, mask = _batch()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # generate()'s padding-aware positions
    with torch.no_grad():
        assert _max_diff(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits, mask) < ATOL
        got = ours(ids, attention_mask=mask, position_ids=positions).logits
        assert _max_diff(got, hf(ids, attention_mask=mask, position_ids=positions).logits, mask) < ATOL


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generate_matches_transformers(checkpoints, case, cache):
    folder, hf = checkpoints[case]
    ours = _load(folder)
    ids, mask = _batch(seq=14, pad=3)  # phi4-mini: past original_max_position_embeddings from the prompt on
    greedy = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0,
                  cache_implementation=cache)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy))


def test_loss_and_backward_match_transformers(checkpoints):
    folder, hf = checkpoints["phi4-mini"]
    ours = _load(folder)
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    theirs, mine = hf(ids, attention_mask=mask, labels=labels), ours(ids, attention_mask=mask, labels=labels)
    assert abs(mine.loss.item() - theirs.loss.item()) < 1e-5
    hf.zero_grad()
    theirs.loss.backward(), mine.loss.backward()
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        mine_grad = ours.get_submodule(f"model.layers.0.{name}").weight.grad
        torch.testing.assert_close(mine_grad, hf.get_submodule(f"model.layers.0.{name}").weight.grad,
                                   atol=1e-5, rtol=1e-4)
    hf.zero_grad()


def test_resid_dropout_in_training_only(checkpoints, tmp_path):
    import shutil

    folder, hf = checkpoints["mha"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    rewrite_config(tmp_path, resid_pdrop=0.5)
    ours = _load(tmp_path)
    ids, mask = _batch()
    with torch.no_grad():
        assert _max_diff(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits, mask) < ATOL
        ours.train()
        first, second = ours(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert (first - second).abs().max() > 1e-2  # a fresh dropout mask each forward


@pytest.mark.parametrize("case", ["phi4-mini", "window-tied"])
def test_transformers_loads_what_we_save(checkpoints, tmp_path, case):
    import transformers

    folder, hf = checkpoints[case]
    ours = _load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "phi3" and saved["architectures"] == ["Phi3ForCausalLM"]
    if case == "phi4-mini":  # as Phi-4-mini's own config.json spells them (and transformers 4.x reads them)
        assert saved["partial_rotary_factor"] == 0.75 and saved["original_max_position_embeddings"] == 12
        assert sorted(saved["rope_scaling"]) == ["long_factor", "short_factor", "type"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    rope = {k: v for k, v in reloaded.config.rope_parameters.items() if k != "type"}  # rope_scaling's old key
    assert rope == hf.config.rope_parameters
    assert reloaded.config.sliding_window == hf.config.sliding_window
    ids, mask = _batch()
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
        assert _max_diff(reloaded(ids, attention_mask=mask).logits, expected, mask) < ATOL
        assert _max_diff(_load(tmp_path)(ids, attention_mask=mask).logits, expected, mask) < ATOL


@pytest.mark.parametrize("case", ["window-tied", "phi4-mini"])
def test_engine_matches_generate(checkpoints, case):
    folder, _ = checkpoints[case]
    model = _load(folder)
    # phi4-mini: every prompt already past original_max_position_embeddings (12), so one rope serves the batch
    prompts = ([[5, 9, 23, 42, 7, 64, 100, 3, 8, 2, 77, 11, 12, 13], [7, 64, 100, 3, 8, 2, 77, 5, 9, 23, 42, 50, 51]]
               if case == "phi4-mini" else [[5, 9, 23, 42], [7, 64, 100, 3, 8, 2, 77, 5, 9], [11]])
    expected = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(p):]
                .tolist() for p in prompts]
    outputs = model.generate_batch(prompts, max_new_tokens=8, eos_token_id=None, progress_bar=False, block_size=8,
                                   num_blocks=16)
    assert [r.generated_tokens for r in outputs.values()] == expected


def test_use_kernels_keeps_the_fused_mlp_and_matches(checkpoints, monkeypatch):
    """The SwiGLU kernel reads gate_proj/up_proj: the fused MLP keeps its torch forward; the norms and the rotary
    kernel (on the rotated part of each head) run and give the same logits."""
    import gpuformers.kernels.rotary as rotary
    from gpuformers.kernels import mapping

    calls = []
    original = rotary.apply_rotary_inplace
    monkeypatch.setattr(rotary, "apply_rotary_inplace", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    folder, _ = checkpoints["phi4-mini"]
    ref, fast = _load(folder), _load(folder, use_kernels=True)
    layer = fast.model.layers[0]
    assert "forward" not in vars(layer.mlp)
    assert layer.input_layernorm.forward.__func__ is mapping._rms_norm_forward
    ids, mask = _batch()
    with torch.no_grad():
        assert _max_diff(fast(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits, mask) < ATOL
    assert calls == [(2, 4, 20, 12)] * 2  # every layer, on q's 12 rotated dims of 16


def test_tensor_parallel_auto_is_refused(checkpoints):
    from gpuformers.tensor_parallel import _resolve_plan

    model = _load(checkpoints["mha"][0])
    with pytest.raises(NotImplementedError, match='tp_plan="auto" for Phi3ForCausalLM is not supported'):
        _resolve_plan(model, "auto")


def test_lora_needs_targets_and_takes_the_fused_layers(checkpoints):
    from gpuformers import LoraConfig, get_peft_model

    folder, _ = checkpoints["mha"]
    with pytest.raises(ValueError, match="no default targets for model_type 'phi3'.*qkv_proj"):
        get_peft_model(_load(folder), LoraConfig(r=2))  # peft has no phi3 default either
    lora = get_peft_model(_load(folder), LoraConfig(r=2, target_modules=["qkv_proj", "gate_up_proj"]))
    names = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert any("qkv_proj.lora_A" in n for n in names) and any("gate_up_proj.lora_B" in n for n in names)


def test_config_spellings():
    from gpuformers.models.config import ModelConfig

    base = dict(model_type="phi3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4)
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    # "su" (Phi-3-mini-128k's old name) is longrope; the top-level original length wins over rope_scaling's
    old = ModelConfig.from_dict({**base, "original_max_position_embeddings": 32, "max_position_embeddings": 128,
                                 "rope_scaling": {"type": "su", "original_max_position_embeddings": 99, **factors}})
    assert old.rope_type == "longrope" and old.rope_parameters["original_max_position_embeddings"] == 32
    default = ModelConfig.from_dict({**base, "rope_scaling": {"type": "longrope", **factors}})
    assert default.rope_parameters["original_max_position_embeddings"] == 4096  # Phi3Config's default
    with pytest.raises(ValueError, match="phi3 rope_type 'linear' is not supported"):
        ModelConfig.from_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="long_factor must have rotary_dim/2 = 6 entries, got 8"):
        ModelConfig.from_dict({**base, "partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope", **factors}})


# --- longrope crossing original_max_position_embeddings during generate() ---------------------------------------
# transformers' Phi3ForCausalLM.prepare_inputs_for_generation drops the cache once the padded sequence reaches
# original_max_position_embeddings + 1 tokens and recomputes it all with the long factors; generate() asks
# cache_must_be_rebuilt and does the same. phi4-mini: original 12, so with an 8-token prompt the forward that takes
# the 5th new token (13 tokens) recomputes, and the 6th score on is computed with the long factors.

CROSSING = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                output_scores=True)


def _assert_same_generation(mine, theirs):
    assert torch.equal(mine.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(mine.scores, theirs.scores, strict=True)):
        assert (a - b).abs().max() < 1e-5, f"scores differ at new token {step}"


@pytest.mark.parametrize("search", [dict(), dict(num_beams=3, num_return_sequences=2)], ids=["greedy", "beam"])
@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_past_original_length_matches_transformers(checkpoints, cache, search):
    folder, hf = checkpoints["phi4-mini"]
    ours = _load(folder)
    ids, mask = _batch(seq=8, pad=3)  # the crossing is decided by the padded length, as in transformers
    kwargs = dict(attention_mask=mask, cache_implementation=cache, **search, **CROSSING)
    with torch.no_grad():
        mine, theirs = ours.generate(ids, **kwargs), hf.generate(ids, **kwargs)
    _assert_same_generation(mine, theirs)
    if cache is None and not search:  # the prompt does cross: keeping the short-factor keys changes the scores
        ours.cache_must_be_rebuilt = lambda past_length, length: False
        kept = ours.generate(ids, **kwargs).scores
        assert all(torch.equal(a, b) for a, b in zip(kept[:5], mine.scores[:5]))
        assert (kept[5] - mine.scores[5]).abs().max() > 1e-4


def test_continuing_a_short_cache_past_original_length_matches_transformers(checkpoints):
    """A cache passed in that stops below original_max_position_embeddings, with a prompt that goes past it: the
    cached tokens are recomputed as well."""
    folder, hf = checkpoints["phi4-mini"]
    ours = _load(folder)
    ids = _batch(seq=8)[0][:1]
    kwargs = dict(CROSSING, max_new_tokens=3)
    with torch.no_grad():
        mine, theirs = ours.generate(ids, **kwargs), hf.generate(ids, **kwargs)
        assert mine.past_key_values.get_seq_length() == 10  # 8 + 3 - 1: below 12
        longer = torch.cat([mine.sequences, torch.tensor([[5, 6, 7, 8]])], dim=1)  # 15 tokens
        _assert_same_generation(ours.generate(longer, past_key_values=mine.past_key_values, **kwargs),
                                hf.generate(longer, cache=theirs.past_key_values, **kwargs))


def test_cache_rebuild_is_asked_only_of_longrope(checkpoints):
    phi4 = _load(checkpoints["phi4-mini"][0])
    assert [phi4.cache_must_be_rebuilt(n - 1, n) for n in (12, 13, 14)] == [False, True, False]
    assert phi4.cache_must_be_rebuilt(0, 20) and not phi4.cache_must_be_rebuilt(13, 20)
    assert not _load(checkpoints["mha"][0]).cache_must_be_rebuilt(4095, 4096 + 1)  # default rope: same keys


def test_assisted_generation_refuses_to_cross_original_length(checkpoints):
    folder, _ = checkpoints["phi4-mini"]
    ours = _load(folder)
    ids = _batch(seq=8)[0][:1]
    greedy = dict(do_sample=False, eos_token_id=None, prompt_lookup_num_tokens=2)
    with pytest.raises(NotImplementedError, match="assisted generation cannot take model Phi3ForCausalLM from 8 to "
                                                  "18 tokens: on the way its cache must be recomputed"):
        ours.generate(ids, max_new_tokens=10, **greedy)
    assert torch.equal(ours.generate(ids, max_new_tokens=4, **greedy),  # ends at 12 tokens: nothing to rebuild
                       ours.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None))


def test_llama_longrope_keeps_its_cache_as_transformers(tmp_path):
    """transformers recomputes for Phi-3 only: a Llama config with longrope keeps its short-factor keys there,
    and here."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 12,
            "short_factor": [1.0 + i / 16 for i in range(8)], "long_factor": [1.0 + i / 4 for i in range(8)]}
    hf = make_checkpoint(tmp_path, "llama", **IDS, max_position_embeddings=64, rope_parameters=rope)
    ours = _load(tmp_path)
    assert not ours.cache_must_be_rebuilt(12, 13)
    ids, mask = _batch(seq=8, pad=3)
    with torch.no_grad():
        _assert_same_generation(ours.generate(ids, attention_mask=mask, **CROSSING),
                                hf.generate(ids, attention_mask=mask, **CROSSING))
