"""Mixtral against transformers on tiny random checkpoints: logits (eager and sdpa, left padding), greedy tokens
(dynamic and static cache), loss and backward, the aux loss with output_router_logits, router jitter in training,
saving both ways (the block_sparse_moe.experts.{e}.w1/w2/w3 layout), the engine, use_kernels (the fused MoE kernel,
under the Triton interpreter on the CPU), and the tensor-parallel plan's module names."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the kernels are imported: the fused MoE kernel runs interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.models.parity import (  # noqa: E402
    assert_engine_matches_generate, assert_expert_grads_match, count_fused_moe_calls, run_two_processes)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

CASES = {
    "gqa": {},
    "window-tied-top1": dict(sliding_window=5, tie_word_embeddings=True, num_experts_per_tok=1),
    "mha-head-dim-top3-linear-rope": dict(num_key_value_heads=4, head_dim=32, num_experts_per_tok=3,
                                          rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
}


def _checkpoint(folder, **overrides):
    """A transformers Mixtral saved to `folder` (routers and norms perturbed, so that routing differs between tokens
    and a missing norm shows)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**{**TINY, **overrides}),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(folder)
    return hf


def _load(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, progress=False, **kwargs)


def _batch(seq=12):
    ids = torch.randint(3, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding in the second row
    return ids, mask


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: (folder := tmp_path_factory.mktemp(name), _checkpoint(folder, **overrides))
            for name, overrides in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_tokens_match_transformers(checkpoints, case):
    from gpuformers.models.mixtral import MixtralForCausalLM, MixtralSparseMoeBlock

    folder, hf = checkpoints[case]
    ids, mask = _batch(seq=14)  # longer than the window of "window-tied-top1"
    for attn in ("eager", "sdpa"):  # sdpa last: the fixture's model stays as it came
        ours = _load(folder, attn_implementation=attn)
        hf.set_attn_implementation(attn)
        assert type(ours) is MixtralForCausalLM
        assert all(isinstance(layer.block_sparse_moe, MixtralSparseMoeBlock) for layer in ours.model.layers)
        with torch.no_grad():
            theirs, mine = hf(ids, attention_mask=mask, labels=ids), ours(ids, attention_mask=mask, labels=ids)
        torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    for cache in (None, "static"):
        greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                      cache_implementation=cache)
        assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy)), cache


def test_config_defaults_and_sliding_window(checkpoints):
    from gpuformers.models.config import ModelConfig

    window = ModelConfig.from_file(checkpoints["window-tied-top1"][0] / "config.json")
    assert window.layer_types == ["sliding_attention"] * 2 and window.sliding_window == 5
    bare = ModelConfig.from_dict(dict(model_type="mixtral", vocab_size=128, hidden_size=64, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=16))
    # MixtralConfig's defaults where config.json is silent
    assert (bare.rope_theta, bare.rms_norm_eps, bare.num_key_value_heads, bare.sliding_window) == (1e6, 1e-5, 8, None)
    assert (bare.num_local_experts, bare.num_experts_per_tok) == (8, 2)
    assert bare.layer_types == ["full_attention"] * 2


def test_aux_loss_router_logits_and_gradients_match_transformers(tmp_path):
    hf = _checkpoint(tmp_path, output_router_logits=True, router_aux_loss_coef=0.5)
    ours = _load(tmp_path)
    ids, mask = _batch()
    theirs, mine = hf(ids, attention_mask=mask, labels=ids), ours(ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(mine.aux_loss, theirs.aux_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    assert len(mine.router_logits) == len(theirs.router_logits) == TINY["num_hidden_layers"]
    for ours_layer, hf_layer in zip(mine.router_logits, theirs.router_logits):
        torch.testing.assert_close(ours_layer, hf_layer, atol=1e-5, rtol=0)
    mine.loss.backward(), theirs.loss.backward()
    hf_params = dict(hf.named_parameters())
    for i, layer in enumerate(ours.model.layers):
        moe = layer.block_sparse_moe
        torch.testing.assert_close(moe.gate.weight.grad, hf_params[f"model.layers.{i}.mlp.gate.weight"].grad,
                                   atol=1e-6, rtol=1e-5)
        assert_expert_grads_match(moe.experts, hf_params[f"model.layers.{i}.mlp.experts.gate_up_proj"].grad,
                                  gate="w1", up="w3")


def test_router_jitter_noise_in_training_only(tmp_path):
    hf = _checkpoint(tmp_path, router_jitter_noise=0.2)
    ours = _load(tmp_path)
    ids, _ = _batch()
    with torch.no_grad():
        plain = ours(ids).logits  # eval: no noise
        torch.testing.assert_close(plain, hf(ids).logits, atol=1e-4, rtol=0)
        ours.train(), hf.train()
        torch.manual_seed(3)
        noisy = ours(ids).logits
        torch.manual_seed(3)  # the same draws, in the same order: the same noise as transformers
        torch.testing.assert_close(noisy, hf(ids).logits, atol=1e-4, rtol=0)
        assert (noisy - plain).abs().max() > 1e-3


def test_saved_checkpoint_has_the_hub_layout_and_loads_in_transformers(checkpoints, tmp_path):
    import json

    import transformers
    from safetensors import safe_open

    folder, hf = checkpoints["window-tied-top1"]
    ours = _load(folder)
    ours.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f, safe_open(folder / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())  # transformers' own save: block_sparse_moe.experts.{e}.w1/w2/w3
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in f.keys()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_local_experts"] == 4 and "num_experts" not in config and config["sliding_window"] == 5
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_engine_matches_generate(checkpoints):
    model = _load(checkpoints["window-tied-top1"][0])
    assert_engine_matches_generate(model, [[5, 9, 23, 42], [7, 64, 100, 3, 8, 2, 77, 12, 9], [11]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test; on a GPU tests/kernels runs the kernel")
def test_use_kernels_runs_the_fused_moe_kernel_with_the_same_logits(checkpoints, monkeypatch):
    calls = count_fused_moe_calls(monkeypatch)
    folder, hf = checkpoints["gqa"]
    fast = _load(folder, use_kernels=True)
    ids = _batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(calls) == TINY["num_hidden_layers"]  # the kernel found the experts under the names w1 / w3 / w2


def test_tensor_parallel_plan_names_mixtral_modules(checkpoints):
    from gpuformers.tensor_parallel import _resolve_plan

    plan = _resolve_plan(_load(checkpoints["gqa"][0]), "auto")
    assert plan["model.layers.1.block_sparse_moe.experts.3.w1"] == "local_colwise"
    assert plan["model.layers.1.block_sparse_moe.experts.3.w3"] == "local_colwise"
    assert plan["model.layers.1.block_sparse_moe.experts.3.w2"] == "local_rowwise"
    assert plan["model.layers.0.block_sparse_moe"] == "allreduce"
    assert plan["model.layers.0.self_attn.o_proj"] == "rowwise" and "model.layers.0.block_sparse_moe.gate" not in plan


_TP_WORKER = '''
import json, sys
import torch
from gpuformers import AutoModelForCausalLM
from gpuformers.distributed import exit_process

folder, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
ids = torch.tensor([[1, 5, 9, 23, 42, 7, 64, 100]])
whole = AutoModelForCausalLM.from_pretrained(folder, progress=False)
model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", progress=False)
expert = model.model.layers[0].block_sparse_moe.experts[0]
greedy = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
with torch.no_grad():
    result = {"logits_diff": float((model(ids).logits - whole(ids).logits).abs().max()),
              "tokens_equal": torch.equal(model.generate(ids, **greedy), whole.generate(ids, **greedy)),
              "w1": list(expert.w1.weight.shape), "w2": list(expert.w2.weight.shape)}
model.save_pretrained(out + ".model")  # every process gathers the slices; process 0 writes
torch.distributed.barrier()
if torch.distributed.get_rank() == 0:
    saved = AutoModelForCausalLM.from_pretrained(out + ".model", progress=False)
    with torch.no_grad():
        result["saved_logits_diff"] = float((saved(ids).logits - whole(ids).logits).abs().max())
    with open(out, "w") as f:
        json.dump(result, f)
exit_process()
'''


@pytest.mark.distributed
def test_tensor_parallel_over_two_processes_matches_the_whole_model(checkpoints, tmp_path):
    result = run_two_processes(_TP_WORKER, str(checkpoints["gqa"][0]), tmp_path=tmp_path)
    assert result["logits_diff"] < 1e-5 and result["tokens_equal"]
    assert result["w1"] == [TINY["intermediate_size"] // 2, 64] and result["w2"] == [64, TINY["intermediate_size"] // 2]
    assert result["saved_logits_diff"] == 0.0


def test_quantization_and_lora_reach_the_experts_but_not_the_router(checkpoints):
    from gpuformers import LoraConfig, WeightOnlyConfig, get_peft_model
    from gpuformers.layers.moe import TopKRouter
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    folder, hf = checkpoints["gqa"]
    model = _load(folder, quantization_config=WeightOnlyConfig(bits=8))
    moe = model.model.layers[0].block_sparse_moe
    assert isinstance(moe.gate, TopKRouter) and isinstance(moe.experts[3].w1, WeightOnlyLinear)
    assert moe.experts[3].gate_proj is moe.experts[3].w1  # the kernel's name follows the replaced Linear
    ids = _batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=0.05, rtol=0)
    lora = get_peft_model(_load(folder), LoraConfig(r=2, target_modules="all-linear"))
    kinds = {name.rsplit(".", 1)[-1] for name in lora.peft_config["default"].target_modules}
    assert "gate" not in kinds and {"w1", "w2", "w3", "q_proj"} <= kinds


def test_bfloat16_router_returns_transformers_weights_in_float32(checkpoints):
    import transformers

    folder = checkpoints["gqa"][0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    from gpuformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, progress=False)
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        theirs, mine = hf.model.layers[0].mlp.gate(x), ours.model.layers[0].block_sparse_moe.gate(x)
    # the weights stay float32, so the experts' bfloat16 outputs are scaled in float32 and rounded once
    assert mine[1].dtype == theirs[1].dtype == torch.float32
    for ours_out, hf_out in zip(mine, theirs):
        assert torch.equal(ours_out, hf_out)
