"""Qwen2-MoE against transformers on tiny random checkpoints: logits (eager and sdpa, left padding), greedy tokens
(dynamic and static cache), loss and backward, router logits and the aux loss, the shared expert and its gate,
dense layers (decoder_sparse_step, mlp_only_layers), the family's sliding-window rule, qkv_bias, saving (the Hub's
key layout), the engine, use_kernels (the fused MoE kernel under the Triton interpreter, the shared expert still
added), tensor parallelism over two processes, and LoRA's targets."""

from __future__ import annotations

import os

import pytest
import torch

from tests.fixtures.checkpoints import make_checkpoint
from tests.models.parity import (assert_engine_matches_generate, assert_moe_loss_and_grads_match, count_fused_moe_calls,
                                 left_padded, load, run_two_processes)

if not torch.cuda.is_available():  # before the kernels are imported: the fused MoE kernel runs interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40,
           bos_token_id=1, eos_token_id=2, pad_token_id=0)

CASES = {
    "gqa": {},
    # layers 0 and 2 slide (transformers' rule: even layers below max_window_layers); layer 0 is dense by
    # decoder_sparse_step=2 and layer 2 by mlp_only_layers, so only layer 1 is sparse
    "window-tied-normtopk-dense": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
                                       max_window_layers=3, tie_word_embeddings=True, norm_topk_prob=True,
                                       decoder_sparse_step=2, mlp_only_layers=[2]),
    "mha-no-qkv-bias-top3-linear-rope": dict(num_key_value_heads=4, qkv_bias=False, num_experts_per_tok=3,
                                             rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 500.0}),
}


def _checkpoint(folder, **overrides):
    """transformers' Qwen2-MoE saved to `folder`, its routers and shared-expert gates perturbed so that routing
    differs between tokens and a missing gate shows."""
    hf = make_checkpoint(folder, "qwen2_moe", **{**MOE, **overrides})
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: (folder := tmp_path_factory.mktemp(f"qwen2_moe-{name}"), _checkpoint(folder, **overrides))
            for name, overrides in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_tokens_match_transformers(checkpoints, case):
    from gpuformers.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeSparseMoeBlock

    folder, hf = checkpoints[case]
    ids, mask = left_padded(seq=14, pad=3)  # longer than the window of the "window" case
    labels = ids.masked_fill(mask == 0, -100)
    for attn in ("eager", "sdpa"):  # sdpa last: the fixture's model stays as it came
        ours = load(folder, attn_implementation=attn)
        hf.set_attn_implementation(attn)
        assert type(ours) is Qwen2MoeForCausalLM
        with torch.no_grad():
            theirs, mine = hf(ids, attention_mask=mask, labels=labels), ours(ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    sparse = [isinstance(layer.mlp, Qwen2MoeSparseMoeBlock) for layer in ours.model.layers]
    assert sparse == [type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in hf.model.layers]
    for cache in (None, "static"):
        greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                      cache_implementation=cache)
        assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy)), cache


def test_config_defaults_layer_types_and_biases(checkpoints):
    from gpuformers.models.config import ModelConfig

    window = load(checkpoints["window-tied-normtopk-dense"][0])
    config = window.config
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.sliding_window == 5 and config.mlp_only_layers == [2]
    assert window.model.layers[0].self_attn.q_proj.bias is not None and window.model.layers[0].self_attn.o_proj.bias is None
    no_bias = load(checkpoints["mha-no-qkv-bias-top3-linear-rope"][0]).model.layers[0].self_attn
    assert no_bias.q_proj.bias is None and no_bias.v_proj.bias is None
    bare = ModelConfig.from_dict(dict(model_type="qwen2_moe", vocab_size=128, hidden_size=64, intermediate_size=32,
                                      num_hidden_layers=4, num_attention_heads=16, sliding_window=0,
                                      mlp_only_layers=None))
    # Qwen2MoeConfig's defaults where config.json is silent; transformers' "sliding_window": 0 means no window
    assert (bare.num_key_value_heads, bare.max_position_embeddings, bare.sliding_window) == (16, 32768, None)
    assert bare.layer_types == ["full_attention"] * 4 and bare.qkv_bias and not bare.o_bias
    assert (bare.num_experts, bare.num_experts_per_tok, bare.moe_intermediate_size,
            bare.shared_expert_intermediate_size, bare.mlp_only_layers) == (60, 4, 1408, 5632, [])
    slide = ModelConfig.from_dict(dict(bare.to_dict(), use_sliding_window=True, sliding_window=7, max_window_layers=3,
                                       layer_types=None))
    assert slide.layer_types == ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def test_aux_loss_router_logits_and_gradients_match_transformers(tmp_path):
    hf = _checkpoint(tmp_path, output_router_logits=True, router_aux_loss_coef=0.5, decoder_sparse_step=2,
                     num_hidden_layers=3)
    # only layer 1 is sparse: one router
    assert_moe_loss_and_grads_match(load(tmp_path), hf, 1, (
        "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight",
        "model.layers.1.mlp.shared_expert.down_proj.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.bias"), expert_layer=1)


def test_saved_checkpoint_has_the_hub_layout_and_loads_in_transformers(checkpoints, tmp_path):
    import json

    import transformers
    from safetensors import safe_open

    folder, hf = checkpoints["window-tied-normtopk-dense"]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f, safe_open(folder / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())  # transformers' own save
        assert {"model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight",
                "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate_proj.weight"} <= set(f.keys())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["shared_expert_intermediate_size"] == 40 and config["mlp_only_layers"] == [2]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert back.config.layer_types == hf.config.layer_types and back.config.sliding_window == 5
    ids = left_padded(seq=12)[0]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_engine_matches_generate(checkpoints):
    assert_engine_matches_generate(load(checkpoints["window-tied-normtopk-dense"][0]),
                                   prompts=[[5, 9, 23, 42], [7, 64, 100, 3, 8, 2, 77, 12, 9], [11]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter test; on a GPU tests/kernels runs the kernel")
def test_use_kernels_runs_the_fused_routed_experts_and_adds_the_shared_expert(checkpoints, monkeypatch):
    calls = count_fused_moe_calls(monkeypatch)
    folder, hf = checkpoints["gqa"]
    fast = load(folder, use_kernels=True)
    ids = left_padded(seq=12)[0]
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(calls) == 2  # both layers' routed experts went through the kernel


def test_tensor_parallel_plan_names_qwen2_moe_modules(checkpoints):
    from gpuformers.tensor_parallel import _resolve_plan

    plan = _resolve_plan(load(checkpoints["window-tied-normtopk-dense"][0]), "auto")
    assert plan["model.layers.1.mlp.experts.3.gate_proj"] == "local_colwise"
    assert plan["model.layers.1.mlp.experts.3.down_proj"] == "local_rowwise"
    assert plan["model.layers.1.mlp"] == "allreduce"
    assert plan["model.layers.1.mlp.shared_expert.up_proj"] == "colwise"
    assert plan["model.layers.1.mlp.shared_expert.down_proj"] == "rowwise"
    assert plan["model.layers.0.mlp.down_proj"] == "rowwise" and "model.layers.0.mlp" not in plan  # a dense layer
    assert "model.layers.1.mlp.shared_expert_gate" not in plan and "model.layers.1.mlp.gate" not in plan


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
moe = model.model.layers[0].mlp
greedy = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
with torch.no_grad():
    result = {"logits_diff": float((model(ids).logits - whole(ids).logits).abs().max()),
              "tokens_equal": torch.equal(model.generate(ids, **greedy), whole.generate(ids, **greedy)),
              "expert_gate": list(moe.experts[0].gate_proj.weight.shape),
              "shared_up": list(moe.shared_expert.up_proj.weight.to_local().shape)}
torch.distributed.barrier()
if torch.distributed.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
exit_process()
'''


@pytest.mark.distributed
def test_tensor_parallel_over_two_processes_matches_the_whole_model(checkpoints, tmp_path):
    result = run_two_processes(_TP_WORKER, str(checkpoints["gqa"][0]), tmp_path=tmp_path)
    assert result["logits_diff"] < 1e-5 and result["tokens_equal"]
    assert result["expert_gate"] == [MOE["moe_intermediate_size"] // 2, 64]
    assert result["shared_up"] == [MOE["shared_expert_intermediate_size"] // 2, 64]


def test_lora_targets(checkpoints):
    from gpuformers import LoraConfig, get_peft_model

    folder = checkpoints["gqa"][0]
    with pytest.raises(ValueError, match="no default targets for model_type 'qwen2_moe'"):  # as in peft's table
        get_peft_model(load(folder), LoraConfig(r=2))
    lora = get_peft_model(load(folder), LoraConfig(r=2, target_modules="all-linear"))
    kinds = {name.rsplit(".", 1)[-1] for name in lora.peft_config["default"].target_modules}
    assert "gate" not in kinds and {"shared_expert_gate", "gate_proj", "down_proj", "q_proj"} <= kinds


def test_gguf_file_matches_transformers_gguf_load(tmp_path):
    """A llama.cpp-style qwen2moe GGUF (stacked experts, the shared expert's gate as llama.cpp's 1-D {hidden}
    tensor) loads with transformers' config and weights, logits and greedy tokens. transformers' GGUF loader reads
    no expert sizes from the file: the tiny model keeps its defaults (1408, 5632) so that both build the same."""
    gguf = pytest.importorskip("gguf")
    import transformers

    from gpuformers import AutoModelForCausalLM
    from tests.test_gguf import _byte_level_vocab
    from tests.test_gguf_families import _gguf_tensors

    tokens, token_types, merges = _byte_level_vocab()
    config = transformers.Qwen2MoeConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in source.named_parameters():
            p.normal_(0.0, 0.1)
            if name.endswith("norm.weight"):
                p += 1.0
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen2moe")
    writer.add_block_count(2), writer.add_context_length(256), writer.add_embedding_length(64)
    writer.add_feed_forward_length(96), writer.add_head_count(4), writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6), writer.add_rope_freq_base(10000.0), writer.add_vocab_size(len(tokens))
    writer.add_expert_count(4), writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_tokenizer_model("gpt2"), writer.add_tokenizer_pre("qwen2"), writer.add_token_list(tokens)
    writer.add_token_types(token_types), writer.add_token_merges(merges), writer.add_add_bos_token(False)
    writer.add_bos_token_id(1), writer.add_eos_token_id(2), writer.add_pad_token_id(0)
    for name, array in _gguf_tensors("qwen2moe", source).items():
        writer.add_tensor(name, array.reshape(-1) if "ffn_gate_inp_shexp" in name else array)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()

    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype="float32", progress=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                               dtype=torch.float32).eval()
    assert type(ours).__name__ == "Qwen2MoeForCausalLM" and ours.config.qkv_bias
    read = ours.config
    assert (read.moe_intermediate_size, read.shared_expert_intermediate_size, read.norm_topk_prob) == (
        1408, 5632, False)
    gate = ours.model.layers[1].mlp.shared_expert_gate.weight
    assert torch.equal(gate, source.model.layers[1].mlp.shared_expert_gate.weight)
    ids = torch.tensor([[5, 17, 200, 42, 99, 7, 250, 3, 11, 64]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(ours(ids).logits, source(ids).logits, atol=1e-4, rtol=0)
        greedy = dict(max_new_tokens=8, do_sample=False)
        assert torch.equal(ours.generate(ids, **greedy), theirs.generate(ids, **greedy))
