"""ERNIE 4.5 dense against transformers on tiny random checkpoints: the checkpoint's modules (biases on every
projection with use_bias, tied embeddings by default), the interleaved rotary turned in float32 (bitwise, float32 and
bfloat16), config defaults, logits (eager and sdpa, left padding), greedy tokens (dynamic and static cache), loss and
backward, saving for transformers, the engine, tp_plan="auto" over two processes, and use_kernels (where Triton runs)
leaving the interleaved rotary out of the halves-rotating kernel."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.models.parity import (assert_engine_matches_generate, assert_greedy_matches, assert_loss_matches_and_trains,
                                 assert_tensor_parallel_matches, checkpoint_cases, left_padded, load, max_logit_diff)

if not torch.cuda.is_available():  # use_kernels on the CPU runs the Triton interpreter (read when triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

# ERNIE's defaults put pad at 0 and head_dim at 128: a tiny head_dim (16, 8 pairs) is given.
COMMON = dict(head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # ERNIE-4.5-0.3B: GQA, tied embeddings, no biases, rope_theta 500000 (the defaults)
    "gqa-tied": {},
    # multi-head, untied, use_bias (q/k/v/o and the MLP), linear rope scaling
    "mha-untied-bias": dict(num_key_value_heads=4, tie_word_embeddings=False, use_bias=True,
                            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    return checkpoint_cases(tmp_path_factory, "ernie4_5", CASES, **COMMON)


@pytest.mark.parametrize("case", list(CASES))
def test_modules_are_the_checkpoint_s(checkpoints, case):
    folder, hf = checkpoints[case]
    ours = load(folder)
    assert type(ours).__name__ == "Ernie4_5ForCausalLM"
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    layer = ours.model.layers[0]
    projections = [getattr(layer.self_attn, f"{n}_proj") for n in "qkvo"] + \
        [getattr(layer.mlp, f"{n}_proj") for n in ("gate", "up", "down")]
    assert {p.bias is not None for p in projections} == {hf.config.use_bias}
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hf.config.tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_turns_pairs_in_float32_like_transformers(checkpoints, dtype):
    from transformers.models.ernie4_5.modeling_ernie4_5 import apply_rotary_pos_emb as theirs

    folder, hf = checkpoints["gqa-tied"]
    ours = load(folder, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    # (batch, seq, heads, head_dim), as the attention hands them to position_qk
    q, k = torch.randn(2, 5, 4, 16, generator=gen).to(dtype), torch.randn(2, 5, 2, 16, generator=gen).to(dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]])
    with torch.no_grad():
        tables = ours.model.rotary_emb(q, positions)
        q_ref, k_ref = theirs(q.transpose(1, 2), k.transpose(1, 2), *hf.model.rotary_emb(q, positions))
    assert tables[0].dtype == tables[1].dtype == torch.float32
    attn = ours.model.layers[0].self_attn
    for grad in (False, True):  # in place without autograd, out of place with it
        with torch.set_grad_enabled(grad):
            q_ours, k_ours = attn.position_qk(q, k, tables)
        assert torch.equal(q_ours, q_ref) and torch.equal(k_ours, k_ref)
    if dtype == torch.bfloat16:  # tables rounded to the model's dtype (llama's way) would not give these numbers
        assert not torch.equal(attn.position_qk(q, k, tuple(t.to(dtype) for t in tables))[0], q_ref)


def test_config_defaults_match_transformers():
    # a config.json naming only the sizes: transformers' defaults (head_dim 128, 2 kv heads, tied, theta 500000)
    import transformers

    from gpuformers import AutoConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    ours, theirs = AutoConfig.for_model("ernie4_5", **sizes), transformers.AutoConfig.for_model("ernie4_5", **sizes)
    for field in ("head_dim", "num_key_value_heads", "use_bias", "rms_norm_eps", "max_position_embeddings",
                  "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.layer_types == ["full_attention"] * 2 and ours.sliding_window is None
    biased = AutoConfig.for_model("ernie4_5", use_bias=True, **sizes)
    assert biased.qkv_bias and biased.o_bias and biased.mlp_bias


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder, attn_implementation=attn), hf, *left_padded()) < 1e-4


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, case, cache):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf, cache)


def test_loss_matches_transformers_and_trains(checkpoints):
    folder, hf = checkpoints["mha-untied-bias"]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    layer = ours.model.layers[0]
    for param in (layer.self_attn.q_proj.weight, layer.self_attn.o_proj.bias, layer.mlp.down_proj.bias,
                  ours.lm_head.weight):
        assert param.grad.abs().sum() > 0


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_what_we_save(checkpoints, case, tmp_path):
    import transformers

    folder, hf = checkpoints[case]
    ours = load(folder)
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Ernie4_5ForCausalLM"] and saved["use_bias"] == hf.config.use_bias
    assert not {"attention_bias", "mlp_bias", "sliding_window", "layer_types"} & set(saved)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert max_logit_diff(ours, back, *left_padded()) < 1e-5


def test_engine_matches_generate(checkpoints):
    assert_engine_matches_generate(load(checkpoints["gqa-tied"][0]))


@pytest.mark.distributed
def test_two_processes_match_the_whole_model(checkpoints, tmp_path):
    # tp_plan="auto" (the llama plan) under torchrun, 2 processes on gloo, on the biased case: o_proj's and
    # down_proj's biases must be added once, after the sum. tests/tp_worker.py compares the split model's logits,
    # greedy tokens, saved checkpoint and engine with the whole model's.
    result = assert_tensor_parallel_matches(checkpoints["mha-untied-bias"][0], tmp_path)
    assert result["local_shapes"]["q_proj"] == [32, 64]


def test_use_kernels_leaves_the_interleaved_rotary_in_torch(checkpoints, monkeypatch):
    import gpuformers.kernels.rotary as rotary_kernels
    from gpuformers.kernels import mapping

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not mapping.kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({mapping.kernels_available(device)[1]})")
    rotated = []  # the rotary kernel turns halves: ERNIE's pairs must never reach it
    for name in ("apply_rotary_inplace", "apply_rotary"):
        original = getattr(rotary_kernels, name)
        monkeypatch.setattr(rotary_kernels, name, lambda *a, _f=original, **k: rotated.append(1) or _f(*a, **k))
    folder, hf = checkpoints["mha-untied-bias"]
    ours = load(folder, use_kernels=True, device_map=device)
    layer = ours.model.layers[0]
    assert layer.input_layernorm.forward.__func__ is mapping._rms_norm_forward
    assert layer.mlp.forward.__func__ is mapping._swiglu_mlp_forward  # the biased projections, called as modules
    ids, mask = left_padded()
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    assert not rotated
