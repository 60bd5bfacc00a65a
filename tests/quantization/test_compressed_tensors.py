"""compressed-tensors checkpoints: tiny random llamas compressed with the compressed-tensors package's own API (as
llm-compressor does when it saves), loaded by gpuformers and compared with transformers' load of the same folder
with CompressedTensorsConfig(dequantize=True), which dequantizes the weights and leaves activations unquantized.

Needs `pip install compressed-tensors loguru` (pure Python); skipped without it.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from gpuformers import AutoModelForCausalLM
from gpuformers.quantization import CompressedTensorsConfig
from gpuformers.quantization.compressed_tensors import WeightScheme, dequantize_compressed, unpack_int32
from gpuformers.quantization.weight_only import WeightOnlyLinear
from tests.fixtures.checkpoints import make_checkpoint, rewrite_config

pytest.importorskip("compressed_tensors")

PROMPT = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 3]])


def _args(num_bits, strategy, kind="int", symmetric=True, **extra):
    return dict(num_bits=num_bits, type=kind, strategy=strategy, symmetric=symmetric, **extra)


# name -> (weights args or a preset name, model dtype, ignore list)
SCHEMES = {
    "w4a16": (_args(4, "group", group_size=32), torch.float32, ["lm_head"]),
    "w4a16_bf16": (_args(4, "group", group_size=32), torch.bfloat16, ["lm_head"]),
    "w8a16": (_args(8, "channel"), torch.float32, ["lm_head"]),
    "w4a16_asym": (_args(4, "group", symmetric=False, group_size=32), torch.float32, ["lm_head"]),
    "w8a8": ("W8A8", torch.float32, ["lm_head"]),
    "fp8_dynamic": ("FP8_DYNAMIC", torch.float32, ["lm_head"]),
    "fp8_block": (_args(8, "block", kind="float", block_structure=[48, 64]), torch.float32, ["lm_head"]),
    "w4a16_ignore_mlp": (_args(4, "group", group_size=32), torch.float32, ["lm_head", "re:.*mlp.down_proj$"]),
}


def _calibrate(module):
    """Min / max weight scales, as llm-compressor's default observer sets them before it compresses."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args, w = module.quantization_scheme.weights, module.weight.detach()
    if args.strategy == "tensor":
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == "channel":
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "group":
        groups = w.unflatten(-1, (-1, args.group_size))
        low, high = groups.amin(-1), groups.amax(-1)
    else:  # block
        rows, cols = args.block_structure
        blocks = [[w[i:i + rows, j:j + cols] for j in range(0, w.shape[1], cols)] for i in range(0, w.shape[0], rows)]
        low = torch.tensor([[b.amin() for b in row] for row in blocks], dtype=w.dtype)
        high = torch.tensor([[b.amax() for b in row] for row in blocks], dtype=w.dtype)
    scale, zero = calculate_qparams(low, high, args)
    module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape)
    if hasattr(module, "input_scale"):  # static activation scales (unused by a weight-dequantizing load)
        module.input_scale.data.fill_(0.05)


def compress_in_place(model: nn.Module, weights, ignore):
    """Quantize `model`'s Linear layers with compressed-tensors (a preset name such as "W4A16", or QuantizationArgs
    fields), calibrate them and compress their weights in place, as llm-compressor does before saving; returns the
    compressor (its update_config writes the checkpoint's quantization_config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, preset_name_to_scheme)

    scheme = (preset_name_to_scheme(weights, ["Linear"]) if isinstance(weights, str)
              else QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights)))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore),
                              show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _calibrate(module)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    return compressor


def write_compressed(folder: Path, weights, dtype, ignore) -> nn.Module:
    """A tiny llama compressed to disk by compressed-tensors: the transformers model it started from (unquantized)."""
    model = make_checkpoint(folder).to(dtype)
    original = copy.deepcopy(model)
    compressor = compress_in_place(model, weights, ignore)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    return original


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed_tensors")
    return {name: (root / name, write_compressed(root / name, *spec)) for name, spec in SCHEMES.items()}


def _transformers(folder, dtype=torch.float32, **config):
    import transformers

    config = transformers.CompressedTensorsConfig(dequantize=True, **config)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, quantization_config=config).eval()


def _ours(folder, dtype=torch.float32, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, progress=False, **kwargs)


def _kinds(model) -> set[str]:
    return {type(m).__name__ for name, m in model.named_modules() if name.endswith("_proj")}


# -----------------------------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("name, kinds", [
    ("w4a16", {"Linear"}),  # int4 in float32: dequantized (WeightOnlyLinear would round twice)
    ("w8a16", {"WeightOnlyLinear"}),  # int8 per channel, float32 scales: kept packed, exactly
    ("w4a16_asym", {"Linear"}),
    ("w8a8", {"Linear"}),
    ("fp8_dynamic", {"Linear"}),
    ("fp8_block", {"Linear"}),
])
def test_logits_equal_transformers_dequantized(checkpoints, name, kinds):
    folder, _ = checkpoints[name]
    ours, hf = _ours(folder), _transformers(folder)
    assert _kinds(ours) == kinds
    with torch.no_grad():
        difference = (ours(PROMPT).logits - hf(PROMPT).logits).abs().max().item()
    # Dequantized layers hold transformers' weights bit for bit; a packed int8 layer scales its output instead of
    # its weight (~2e-7 here).
    assert difference < 1e-4 if "WeightOnlyLinear" in kinds else difference == 0


@pytest.mark.parametrize("name, dtype", [
    ("w4a16_asym", torch.float32),
    ("w4a16_bf16", torch.float32),  # bfloat16 scales: the product is rounded to bfloat16 first, as transformers does
    ("fp8_dynamic", torch.bfloat16),
])
def test_dequantized_weights_are_transformers_bit_for_bit(checkpoints, name, dtype):
    folder, _ = checkpoints[name]
    ours, hf = _ours(folder, dtype), _transformers(folder, dtype)
    assert _kinds(ours) == {"Linear"}
    theirs = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name


def test_int4_in_bfloat16_stays_packed_with_transformers_weights(checkpoints):
    folder, _ = checkpoints["w4a16_bf16"]
    ours, hf = _ours(folder, torch.bfloat16), _transformers(folder, torch.bfloat16)
    assert _kinds(ours) == {"WeightOnlyLinear"}
    assert ours.quantization_config.bits == 4 and ours.quantization_config.group_size == 32
    for name, module in ours.named_modules():
        if isinstance(module, WeightOnlyLinear):
            assert torch.equal(module.dequantize(), hf.get_submodule(name).weight), name
    with torch.no_grad():
        difference = (ours(PROMPT).logits.float() - hf(PROMPT).logits.float()).abs().max().item()
    assert difference < 1e-2  # bfloat16 matmuls accumulated in another order (torch's int4 CPU kernel)


def test_greedy_tokens_equal_transformers(checkpoints):
    folder, _ = checkpoints["w4a16"]
    ours, hf = _ours(folder), _transformers(folder)
    expected = hf.generate(PROMPT, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(PROMPT, max_new_tokens=8, do_sample=False), expected)


def test_dequantize_true_gives_a_plain_model(checkpoints):
    import transformers

    folder, _ = checkpoints["w8a16"]
    theirs = transformers.CompressedTensorsConfig(run_compressed=False)
    for config in (CompressedTensorsConfig(dequantize=True), theirs):
        model = _ours(folder, quantization_config=config)
        assert _kinds(model) == {"Linear"} and model.quantization_config is None


def test_a_packed_model_saves_and_reloads(checkpoints, tmp_path):
    folder, _ = checkpoints["w8a16"]
    model = _ours(folder)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "weight_only"
    reloaded = _ours(tmp_path)
    assert _kinds(reloaded) == {"WeightOnlyLinear"}
    with torch.no_grad():
        assert torch.equal(reloaded(PROMPT).logits, model(PROMPT).logits)


# -----------------------------------------------------------------------------------------------------------------
# The ignore list and targets


def test_ignored_layers_load_in_full_precision(checkpoints):
    folder, original = checkpoints["w4a16_ignore_mlp"]
    model = _ours(folder)
    for name, module in model.named_modules():
        if name == "lm_head" or name.endswith("mlp.down_proj"):
            assert type(module) is nn.Linear
            assert torch.equal(module.weight, original.get_submodule(name).weight), name
        elif name.endswith("_proj"):  # quantized: near the original, not equal to it
            assert not torch.equal(module.weight, original.get_submodule(name).weight), name
            assert torch.allclose(module.weight, original.get_submodule(name).weight, atol=0.05), name


def test_scheme_matching_follows_compressed_tensors():
    weights = {"num_bits": 4, "strategy": "group", "group_size": 32}
    config = CompressedTensorsConfig(format="pack-quantized", ignore=["lm_head", "re:.*layers\\.1\\."], config_groups={
        "by_class": {"targets": ["Linear"], "weights": weights},
        "by_name": {"targets": ["re:.*down_proj$"], "weights": {**weights, "num_bits": 8}}})
    linear = nn.Linear(2, 2)
    assert config.scheme_for("model.layers.0.mlp.down_proj", linear).group == "by_name"  # a regex beats a class
    assert config.scheme_for("model.layers.0.mlp.up_proj", linear).group == "by_class"
    assert config.scheme_for("model.layers.1.mlp.up_proj", linear) is None
    assert config.scheme_for("lm_head", linear) is None


# -----------------------------------------------------------------------------------------------------------------
# Formats


@pytest.mark.parametrize("num_bits", [2, 4, 8])
def test_unpacking_inverts_compressed_tensors_packing(num_bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    low = -(1 << (num_bits - 1))
    values = torch.randint(low, -low, (6, 70), dtype=torch.int8)  # 70: a partly filled last word
    assert torch.equal(unpack_int32(pack_to_int32(values, num_bits), num_bits, 70), values.to(torch.int32))


def test_actorder_group_index_picks_each_columns_scale():
    scheme = WeightScheme("g", ("Linear",), "int-quantized", 8, "int", "group", group_size=2, g_idx=True)
    q = torch.randint(-128, 128, (3, 4), dtype=torch.int8)
    scales = torch.rand(3, 2) + 0.5
    g_idx = torch.tensor([1, 0, 1, 0])
    weight = dequantize_compressed({"weight": q, "weight_scale": scales, "weight_g_idx": g_idx}, scheme, (3, 4),
                                   torch.float32)
    assert torch.equal(weight, q.float() * scales[:, g_idx])


@pytest.mark.parametrize("change, message", [
    ({"format": "nvfp4-pack-quantized"}, "nvfp4-pack-quantized"),
    ({"format": "marlin-24"}, "marlin-24"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparse-24-bitmask"),
    ({"transform_config": {"config_groups": {"u": {}}}}, "transform"),
])
def test_unsupported_formats_are_refused_by_name(checkpoints, tmp_path, change, message):
    folder, _ = checkpoints["w4a16"]
    for path in folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"].pop("format")  # so that the config's format is the one read
    rewrite_config(tmp_path, quantization_config={**config, **change})
    with pytest.raises(NotImplementedError, match=message):
        _ours(tmp_path)


def test_three_bit_packing_is_refused():
    with pytest.raises(NotImplementedError, match="3-bit"):
        CompressedTensorsConfig(format="pack-quantized", config_groups={
            "g": {"targets": ["Linear"], "weights": {"num_bits": 3, "strategy": "channel"}}})


def test_a_missing_scale_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = checkpoints["w4a16"]
    for path in folder.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.o_proj.weight_scale"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight_scale"):
        _ours(tmp_path)


def test_a_dense_format_checkpoint_loads_as_it_is(tmp_path):
    original = make_checkpoint(tmp_path)
    rewrite_config(tmp_path, quantization_config={"quant_method": "compressed-tensors", "format": "dense",
                                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                                      "num_bits": 8, "strategy": "channel"}}}})
    model = _ours(tmp_path)
    assert _kinds(model) == {"Linear"} and model.quantization_config is None
    with torch.no_grad():
        assert torch.allclose(model(PROMPT).logits, original(PROMPT).logits, atol=1e-5)


def test_quantizing_a_float_checkpoint_is_refused(tmp_path):
    make_checkpoint(tmp_path)
    with pytest.raises(NotImplementedError, match="llm-compressor already quantized"):
        _ours(tmp_path, quantization_config=CompressedTensorsConfig(dequantize=True))


def test_grid_sizes_use_partial_blocks():
    scheme = WeightScheme("b", ("Linear",), "float-quantized", 8, "float", "block", block_structure=(48, 64))
    weight = torch.ones(64, 96, dtype=torch.float8_e4m3fn)
    scales = torch.arange(1, 1 + math.ceil(64 / 48) * math.ceil(96 / 64), dtype=torch.float32).reshape(2, 2)
    dense = dequantize_compressed({"weight": weight, "weight_scale": scales}, scheme, (64, 96), torch.float32)
    assert dense[47, 63] == 1 and dense[48, 63] == 3 and dense[47, 64] == 2 and dense[63, 95] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_packed_int4_on_the_gpu_equals_the_cpu(checkpoints):
    folder, _ = checkpoints["w4a16_bf16"]
    cpu, gpu = _ours(folder, torch.bfloat16), _ours(folder, torch.bfloat16, device_map="cuda")
    assert _kinds(gpu) == {"WeightOnlyLinear"}
    with torch.no_grad():
        expected = cpu(PROMPT).logits.float()
        difference = (gpu(PROMPT.cuda()).logits.float().cpu() - expected).abs().max().item()
    assert difference < 2e-2  # bfloat16, the Triton kernel against torch's CPU kernel
