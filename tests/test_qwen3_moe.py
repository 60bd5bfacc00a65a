"""Qwen3-MoE against transformers on tiny random checkpoints: logits, loss, greedy tokens, saving both ways, the
engine, and which layers quantization and LoRA touch."""

from __future__ import annotations

import pytest
import torch

MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
           bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _checkpoint(folder, **overrides):
    """A transformers Qwen3-MoE saved to `folder` (routers scaled up so that routing differs between tokens)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**{**MOE, **overrides}),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    hf.save_pretrained(folder)
    return hf


def _load(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, progress=False, **kwargs)


def _batch():
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


@pytest.mark.parametrize("overrides", [
    dict(norm_topk_prob=True),
    dict(norm_topk_prob=False, mlp_only_layers=[1]),
    dict(decoder_sparse_step=2, num_experts_per_tok=1),
], ids=["normalised", "dense-layer-1", "every-second-layer"])
def test_logits_loss_and_tokens_match_transformers(tmp_path, overrides):
    from gpuformers.layers.moe import SparseMoeBlock

    hf = _checkpoint(tmp_path, **overrides)
    ours = _load(tmp_path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert sparse == [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    ids, mask = _batch()
    with torch.no_grad():
        theirs, mine = hf(ids, attention_mask=mask, labels=ids), ours(ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy))


def test_saved_checkpoint_loads_in_transformers_and_trains(tmp_path):
    import transformers

    _checkpoint(tmp_path / "hf")
    ours = _load(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=0)
    ours.train()
    ours(ids, labels=ids).loss.backward()
    layer = ours.model.layers[0].mlp
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0
    assert any(e.down_proj.weight.grad is not None for e in layer.experts)


def test_engine_matches_generate(tmp_path):
    _checkpoint(tmp_path)
    model = _load(tmp_path)
    prompts = [[5, 9, 23, 42], [7, 64, 100, 3, 8, 2, 77], [11]]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(p):]
                .tolist() for p in prompts]
    outputs = model.generate_batch(prompts, max_new_tokens=6, eos_token_id=None, progress_bar=False, block_size=8,
                                   num_blocks=16)
    assert [r.generated_tokens for r in outputs.values()] == expected


def test_quantization_and_lora_leave_the_router_alone(tmp_path):
    from gpuformers import LoraConfig, WeightOnlyConfig, get_peft_model
    from gpuformers.layers.moe import TopKRouter
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    _checkpoint(tmp_path)
    model = _load(tmp_path, quantization_config=WeightOnlyConfig(bits=8))
    moe = model.model.layers[0].mlp
    assert isinstance(moe.gate, TopKRouter) and isinstance(moe.experts[3].up_proj, WeightOnlyLinear)
    lora = get_peft_model(_load(tmp_path), LoraConfig(r=2, target_modules="all-linear"))
    kinds = {name.rsplit(".", 1)[-1] for name in lora.peft_config["default"].target_modules}
    assert "gate" not in kinds and {"gate_proj", "up_proj", "down_proj", "q_proj"} <= kinds


def test_unsupported_settings_say_so(tmp_path):
    _checkpoint(tmp_path / "aux", output_router_logits=True)
    model = _load(tmp_path / "aux")
    ids, _ = _batch()
    with torch.no_grad():
        model(ids)  # inference is fine
    with pytest.raises(NotImplementedError, match="output_router_logits=True"):
        model(ids, labels=ids)
    from gpuformers.layers.moe import TopKRouter

    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be between 1 and num_experts=4"):
        TopKRouter(8, 4, 5, True)
