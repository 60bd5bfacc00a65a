"""Ministral (sliding and full attention layers mixed by layer_types) and Ministral 3 (queries scaled by position,
yarn rope) against transformers on tiny random checkpoints: logits (eager and sdpa, left padding, padding-aware
positions), greedy generate (dynamic and static cache) with prompts longer than the window and than Ministral 3's
temperature period, loss and backward, saving for transformers, the engine, the config defaults and refusals,
use_kernels (where Triton runs) and tp_plan="auto" over two processes.

Windows of 4 tokens and original_max_position_embeddings of 4 make both differences show within these prompts:
test_differences_change_the_logits checks that a model without one of them would fail the parity tests."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.checkpoints import rewrite_config
from tests.models.parity import (assert_greedy_matches, assert_loss_matches_and_trains, checkpoint_cases, left_padded,
                                 load, run_two_processes)

ATOL = 1e-4
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]
YARN = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 4,
        "max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.5}
CASES = {
    # Ministral: GQA, a window of 4 on layers 0 and 2, layer 1 global
    "ministral-mixed": dict(model_type="ministral", head_dim=16, num_hidden_layers=3, sliding_window=4,
                            layer_types=MIXED),
    # Ministral: MHA, tied, no layer_types (every layer slides, Mistral's rule; transformers' forward needs a
    # window), linear rope
    "ministral-tied": dict(model_type="ministral", head_dim=16, num_key_value_heads=4, tie_word_embeddings=True,
                           sliding_window=6, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 5000.0}),
    # Ministral 3: GQA, Mistral's yarn rope; the query temperature steps up every 4 positions
    "ministral3-yarn": dict(model_type="ministral3", head_dim=16, rope_parameters=YARN, initializer_range=0.2),
    # Ministral 3: MHA, tied, a window of 4 on every layer, default rope with the temperature's two values
    "ministral3-sliding": dict(model_type="ministral3", head_dim=16, num_key_value_heads=4, tie_word_embeddings=True,
                               sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                                  "llama_4_scaling_beta": 0.3,
                                                                  "original_max_position_embeddings": 3}),
}
CLASSES = {"ministral": "MinistralForCausalLM", "ministral3": "Ministral3ForCausalLM"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    out = {}
    for name, overrides in CASES.items():
        overrides = dict(overrides)
        out.update(checkpoint_cases(tmp_path_factory, overrides.pop("model_type"), {name: overrides}, pad_token_id=0))
    return out


def _diff(ours, hf, ids, mask, **kwargs) -> float:
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask, **kwargs).logits - hf(ids, attention_mask=mask, **kwargs).logits
    return diff[mask.bool()].abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    ours = load(folder, attn_implementation=attn)
    assert type(ours).__name__ == CLASSES[CASES[case]["model_type"]]
    ids, mask = left_padded()  # 16 tokens: four windows, four temperature periods
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding-aware, as generate() passes them
    assert _diff(ours, hf, ids, mask) < ATOL
    assert _diff(ours, hf, ids, mask, position_ids=positions) < ATOL


def test_differences_change_the_logits(checkpoints, tmp_path):
    """Without the query temperature (beta 0), or with every Ministral layer global, the logits move by far more than
    the tolerance: the parity tests above would catch a model that left either out."""
    import shutil

    ids, mask = left_padded()
    changes = {"ministral3-yarn": dict(rope_parameters={**YARN, "llama_4_scaling_beta": 0.0}),
               "ministral-mixed": dict(layer_types=["full_attention"] * 3)}
    for case, change in changes.items():
        folder, hf = checkpoints[case]
        shutil.copytree(folder, tmp_path / case)
        rewrite_config(tmp_path / case, **change)
        assert _diff(load(tmp_path / case), hf, ids, mask) > 10 * ATOL, case


def test_layers_read_their_attention_kind(checkpoints):
    mixed = load(checkpoints["ministral-mixed"][0])
    assert mixed.config.layer_types == MIXED
    assert [layer.self_attn.sliding_window for layer in mixed.model.layers] == [4, None, 4]
    sliding3 = load(checkpoints["ministral3-sliding"][0])
    assert [layer.self_attn.sliding_window for layer in sliding3.model.layers] == [4, 4]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_tokens_match_transformers(checkpoints, case, cache):
    # a 10-token left-padded prompt and 10 new tokens: past the window and several temperature periods
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf, cache)


@pytest.mark.parametrize("case", ["ministral-mixed", "ministral3-yarn"])
def test_loss_matches_transformers_and_trains(checkpoints, case):
    folder, hf = checkpoints[case]
    ours = load(folder)
    assert_loss_matches_and_trains(ours, hf)
    assert ours.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert ours.model.embed_tokens.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_what_we_save(checkpoints, tmp_path, case):
    import transformers

    folder, hf = checkpoints[case]
    load(folder).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == [CLASSES[CASES[case]["model_type"]]]
    assert "attention_bias" not in saved and ("layer_types" in saved) == (CASES[case]["model_type"] == "ministral")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    for field in ("layer_types", "sliding_window", "head_dim", "tie_word_embeddings"):
        assert getattr(back.config, field, None) == getattr(hf.config, field, None), field
    for key in ("rope_type", "rope_theta", "factor", "llama_4_scaling_beta", "original_max_position_embeddings"):
        assert back.config.rope_parameters.get(key) == hf.config.rope_parameters.get(key), key
    ids, mask = left_padded()
    assert _diff(back, hf, ids, mask) < 1e-5


@pytest.mark.parametrize("case", ["ministral-mixed", "ministral3-yarn", "ministral3-sliding"])
def test_engine_matches_generate(checkpoints, case):
    # prompts longer than the window and the temperature period, pages of 4 tokens
    prompts = [[5, 9, 23, 42, 17, 6], [7, 64, 100, 3, 8, 2, 77, 12, 90], [11]]
    model = load(checkpoints[case][0])
    outputs = model.generate_batch(prompts, max_new_tokens=8, eos_token_id=None, progress_bar=False, block_size=4,
                                   num_blocks=32)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(p):]
                .tolist() for p in prompts]
    assert [r.generated_tokens for r in outputs.values()] == expected


def test_configs_read_as_transformers_reads_them(tmp_path):
    import transformers

    from gpuformers.models.config import ModelConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    # Ministral 3 without rope_parameters or head_dim: Mistral's yarn rope (over a top-level rope_theta) and 128
    ours = ModelConfig.from_dict({"model_type": "ministral3", "rope_theta": 5.0, **sizes})
    theirs = transformers.Ministral3Config(rope_theta=5.0, **sizes)
    assert ours.head_dim == theirs.head_dim == 128 and ours.sliding_window is None
    for key, value in theirs.rope_parameters.items():
        if key != "type":
            assert ours.rope_parameters[key] == value, key
    assert (ours.rms_norm_eps, ours.pad_token_id, ours.max_position_embeddings) == (1e-5, 11, 262144)
    # Ministral 3 ignores layer_types (Mistral's attention), Ministral reads them; without, Mistral's rule
    mixed = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], **sizes)
    assert ModelConfig.from_dict({"model_type": "ministral3", **mixed}).layer_types == ["sliding_attention"] * 2
    assert ModelConfig.from_dict({"model_type": "ministral", **mixed}).layer_types == mixed["layer_types"]
    default = ModelConfig.from_dict({"model_type": "ministral", **sizes})
    assert default.sliding_window == 4096 and default.layer_types == ["sliding_attention"] * 2
    # transformers builds Ministral without biases whatever attention_bias says
    assert not ModelConfig.from_dict({"model_type": "ministral", "attention_bias": True, **sizes}).qkv_bias
    # AutoConfig's rule: a Mistral config with layer_types is a Ministral one (every layer would slide as Mistral)
    as_mistral = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **mixed}
    (tmp_path / "config.json").write_text(json.dumps(as_mistral))
    ours = ModelConfig.from_dict(as_mistral)
    assert ours.model_type == transformers.AutoConfig.from_pretrained(tmp_path).model_type == "ministral"
    assert ours.architecture == "MinistralForCausalLM"
    assert ours.layer_types == mixed["layer_types"]
    assert ModelConfig.from_dict({"model_type": "mistral", **sizes, "sliding_window": 4}).model_type == "mistral"


def test_unusable_configs_are_refused():
    from gpuformers.models.config import ModelConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    with pytest.raises(ValueError, match="lacks llama_4_scaling_beta"):
        ModelConfig.from_dict({"model_type": "ministral3", "rope_parameters": {"rope_type": "yarn", "factor": 2.0},
                               **sizes})
    with pytest.raises(ValueError, match="lacks original_max_position_embeddings"):
        ModelConfig.from_dict({"model_type": "ministral3", "rope_parameters": {"llama_4_scaling_beta": 0.1}, **sizes})
    with pytest.raises(ValueError, match="sliding_window is null"):
        ModelConfig.from_dict({"model_type": "ministral", "sliding_window": None,
                               "layer_types": ["sliding_attention", "full_attention"], **sizes})


def test_every_kernel_applies(checkpoints, monkeypatch):
    """use_kernels' kernels compute llama's layers, which Ministral's are: all of them swap in (the norms, the SwiGLU
    MLP, the fused add + norm, rotary), and training may fuse the LM head with the loss."""
    from gpuformers.kernels.mapping import Mode, kernelize, unkernelize

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels "available" on the CPU; none runs in this test
    for case in ("ministral-mixed", "ministral3-yarn"):
        model = load(checkpoints[case][0])
        kernelize(model, mode=Mode.TRAINING)
        try:
            swapped = {name for name, module in model.named_modules() if "forward" in module.__dict__}
            layers = len(model.model.layers)
            assert len(swapped) == 3 * layers + 1, case  # two norms and the MLP per layer, the final norm
            assert {"rotary_pos_emb", "AddRMSNorm"} <= set(model._kernel_state.functions), case
            assert model.logits_are_head_output, case
        finally:
            unkernelize(model)


def test_use_kernels_keeps_the_logits(checkpoints):
    """Ministral 3's temperature is applied after the rotary kernel (in place in inference): the logits still equal
    transformers'. Runs where Triton does (a GPU, or TRITON_INTERPRET=1 set for the session)."""
    from gpuformers.kernels.mapping import kernels_available

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not kernels_available(device)[0]:
        pytest.skip(f"Triton kernels do not run here ({kernels_available(device)[1]})")
    folder, hf = checkpoints["ministral3-yarn"]
    ours = load(folder, use_kernels=True, device_map=device)
    ids, mask = left_padded(seq=8, pad=2)
    with torch.no_grad():
        diff = ours(ids.to(device), attention_mask=mask.to(device)).logits.cpu() - hf(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < ATOL


_TP_WORKER = '''
import sys
import json
import torch
from gpuformers import AutoModelForCausalLM
from gpuformers.distributed import exit_process

*folders, out = sys.argv[1:]
torch.set_num_threads(1)
ids = torch.tensor([[1, 5, 9, 23, 42, 7, 64, 100, 3, 8]])
prompts = [[5, 9, 23, 42, 17, 6], [11]]
greedy = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
result = {}
for folder in folders:
    whole = AutoModelForCausalLM.from_pretrained(folder, progress=False)
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", progress=False)
    with torch.no_grad():
        logits_diff = float((model(ids).logits - whole(ids).logits).abs().max())
    outputs = model.generate_batch(prompts, max_new_tokens=6, eos_token_id=None, progress_bar=False, block_size=4,
                                   num_blocks=16)
    expected = [whole.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(p):]
                .tolist() for p in prompts]
    q_proj = model.model.layers[0].self_attn.q_proj
    result[folder] = {"logits_diff": logits_diff,
                      "tokens_equal": torch.equal(model.generate(ids, **greedy), whole.generate(ids, **greedy)),
                      "engine_equal": [r.generated_tokens for r in outputs.values()] == expected,
                      "q_rows": getattr(q_proj.weight, "_local_tensor", q_proj.weight).shape[0]}
if torch.distributed.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
exit_process()
'''


@pytest.mark.distributed
def test_tensor_parallel_over_two_processes_matches_the_whole_model(checkpoints, tmp_path):
    folders = [str(checkpoints[case][0]) for case in ("ministral-mixed", "ministral3-yarn")]
    result = run_two_processes(_TP_WORKER, *folders, tmp_path=tmp_path)
    for folder in folders:
        assert result[folder]["logits_diff"] < 1e-5 and result[folder]["q_rows"] == 32, folder
        assert result[folder]["tokens_equal"] and result[folder]["engine_equal"], folder
