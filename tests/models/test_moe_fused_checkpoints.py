"""MoE checkpoints in transformers' fused layout (save_pretrained(save_original_format=False): mlp.experts.gate_up_proj
and down_proj, Mixtral's router as mlp.gate) load into our per-expert Linears (loading/fan_out.py): logits equal
transformers' for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE; sharded, converted to bfloat16 without reading a fused
tensor whole, placed by a device_map with disk offload; quantized on load exactly as the Hub layout is; and a
checkpoint that does not fit its config is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures.checkpoints import hf_config, rewrite_config
from tests.models.parity import left_padded, load, max_logit_diff

MOE = dict(intermediate_size=32, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, mlp_only_layers=[1]),  # layer 1 dense
    "olmoe": dict(num_experts=4),
}


def _transformers_model(model_type: str, **overrides):
    """A tiny random transformers model (eval, float32) with its routers and norms perturbed, so that routing
    differs between tokens and a missing norm shows."""
    import transformers

    torch.manual_seed(0)
    config = hf_config(model_type, **{**MOE, **FAMILIES[model_type], **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return hf


def _save_fused(hf, folder, **kwargs):
    hf.save_pretrained(folder, save_original_format=False, **kwargs)
    if (folder / "model.safetensors.index.json").is_file():
        keys = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    else:
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            keys = list(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys  # the fused layout, not the Hub's
    return keys


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """model_type -> (folder of a fused checkpoint, the transformers model that wrote it)."""
    out = {}
    for model_type in FAMILIES:
        folder = tmp_path_factory.mktemp(f"{model_type}-fused")
        hf = _transformers_model(model_type)
        _save_fused(hf, folder)
        out[model_type] = folder, hf
    return out


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_fused_checkpoint_logits_match_transformers(fused, model_type):
    folder, hf = fused[model_type]
    ours, info = load(folder, dtype=torch.float32, output_loading_info=True)
    assert info.unexpected == [] and info.missing == []
    ids, mask = left_padded(seq=12, pad=3)
    assert max_logit_diff(ours, hf, ids, mask) < 1e-4
    # the pieces are transformers' rows: expert 2's up rows of layer 0
    layer = ours.model.layers[0]
    up = (layer.block_sparse_moe if model_type == "mixtral" else layer.mlp).experts[2].up_proj.weight
    fused_rows = hf.model.layers[0].mlp.experts.gate_up_proj[2]  # (2 * intermediate, hidden): gate rows, up rows
    assert torch.equal(up, fused_rows[fused_rows.shape[0] // 2 :].detach())


def test_sharded_bfloat16_and_disk_offload(tmp_path, monkeypatch):
    from gpuformers.loading.safetensors import SafetensorsFile

    hf = _transformers_model("mixtral")
    folder = tmp_path / "sharded"
    keys = _save_fused(hf, folder, max_shard_size="40KB")
    assert len(set(keys.values())) > 2  # fused tensors in different shards, each one whole in its shard
    ids, mask = left_padded(seq=12, pad=3)

    # bfloat16: each expert's rows converted on their way from the file; no fused tensor is ever read whole
    whole_reads = []
    read = SafetensorsFile.read
    monkeypatch.setattr(SafetensorsFile, "read", lambda self, name: whole_reads.append(name) or read(self, name))
    half = load(folder, dtype=torch.bfloat16)
    assert not [k for k in whole_reads if "experts" in k]
    w2 = half.model.layers[1].block_sparse_moe.experts[3].w2.weight
    assert w2.dtype == torch.bfloat16
    assert torch.equal(w2, hf.model.layers[1].mlp.experts.down_proj[3].detach().to(torch.bfloat16))
    monkeypatch.undo()

    plan = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
            "model.norm": "cpu", "lm_head": "cpu"}
    split = load(folder, dtype=torch.float32, device_map=plan, offload_folder=tmp_path / "offload")
    assert split.model.layers[1].block_sparse_moe.experts[3].w3.weight.is_meta
    assert (tmp_path / "offload" / "model.layers.1.block_sparse_moe.experts.3.w3.weight.safetensors").is_file()
    assert max_logit_diff(split, hf, ids, mask) < 1e-4


@pytest.fixture(scope="module")
def both_layouts(tmp_path_factory):
    """(Hub-layout folder, fused folder) of one Qwen3-MoE; every in_features a multiple of 64 (bitsandbytes' CPU
    kernel's block)."""
    hf = _transformers_model("qwen3_moe", moe_intermediate_size=64, intermediate_size=64)
    hub, fused = tmp_path_factory.mktemp("hub"), tmp_path_factory.mktemp("fused")
    hf.save_pretrained(hub)
    _save_fused(hf, fused)
    return hub, fused


@pytest.mark.parametrize("method", ["int8", "nf4"])
def test_quantized_load_of_the_fused_layout_equals_the_hub_layout(both_layouts, method):
    from gpuformers import BitsAndBytesConfig, WeightOnlyConfig

    if method == "nf4":
        pytest.importorskip("bitsandbytes")
    config = WeightOnlyConfig(bits=8) if method == "int8" else BitsAndBytesConfig(load_in_4bit=True)
    hub, fused = (load(folder, dtype=torch.float32, quantization_config=config) for folder in both_layouts)
    expert = fused.model.layers[0].mlp.experts[1].down_proj
    assert type(expert) is type(hub.model.layers[0].mlp.experts[1].down_proj) and type(expert) is not torch.nn.Linear
    ids, mask = left_padded(seq=8, pad=2)
    with torch.no_grad():
        assert torch.equal(fused(ids, attention_mask=mask).logits, hub(ids, attention_mask=mask).logits)


def test_a_fused_tensor_that_does_not_fit_the_config_is_refused(fused, tmp_path):
    import shutil

    from gpuformers.loading.fan_out import FanOut

    folder = tmp_path / "olmoe"
    shutil.copytree(fused["olmoe"][0], folder)
    rewrite_config(folder, intermediate_size=16)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.down_proj'.*\[4, 64, 32\], whose piece for "
                                         r"'model.layers.0.mlp.experts.0.down_proj.weight' is \[64, 32\].*\[64, 16\]"):
        load(folder, dtype=torch.float32)
    with pytest.raises(ValueError, match="one '#'"):
        FanOut("layers.*.experts.fused", ("layers.*.experts.#.a", "layers.*.b"))


def test_shard_fn_slices_the_pieces(fused):
    """Tensor parallelism's shard_fn sees our names and each piece's shape: rows of one expert's w1 (read straight
    from the file at the piece's offset) and columns of its w2."""
    from torch import nn

    from gpuformers.loading.weights import CheckpointFiles, load_weights
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.modeling import skip_init
    from gpuformers.models.registry import model_class_for

    folder, hf = fused["mixtral"]
    config = ModelConfig.from_file(folder / "config.json")
    with torch.device("meta"), skip_init():
        model = model_class_for(config)(config)
        expert = model.model.layers[1].block_sparse_moe.experts[2]
        expert.w1.weight = nn.Parameter(torch.empty(16, 64))
        expert.w2.weight = nn.Parameter(torch.empty(64, 8))
    slices = {"model.layers.1.block_sparse_moe.experts.2.w1.weight": (slice(16, 32),),
              "model.layers.1.block_sparse_moe.experts.2.w2.weight": (slice(None), slice(8, 16))}
    seen = {}

    def shard_fn(name, shape):
        seen[name] = shape
        return slices.get(name)

    load_weights(model, CheckpointFiles.find(folder), dtype=torch.bfloat16, device="cpu", shard_fn=shard_fn,
                 progress=False)
    assert seen["model.layers.1.block_sparse_moe.experts.2.w1.weight"] == (32, 64)
    fused_layer = hf.model.layers[1].mlp.experts
    assert torch.equal(expert.w1.weight, fused_layer.gate_up_proj[2, 16:32].detach().to(torch.bfloat16))
    assert torch.equal(expert.w2.weight, fused_layer.down_proj[2, :, 8:16].detach().to(torch.bfloat16))
    assert torch.equal(model.model.layers[1].block_sparse_moe.experts[3].w3.weight,
                       fused_layer.gate_up_proj[3, 32:].detach().to(torch.bfloat16))
