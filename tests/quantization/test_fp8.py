"""Fine-grained FP8 checkpoints (quant_method "fp8"): dequantized on load, against transformers and against the same
model run on hand-dequantized weights; partial blocks, modules_to_not_convert, malformed checkpoints, generate, save,
and the modes gpuformers refuses. Then FP8 weights kept for the Triton FP8 matmul (dequantize=False): the kernel
against its torch reference and a whole model, under the Triton interpreter on the CPU (TRITON_INTERPRET=1, set
per test) and on a GPU of compute capability >= 8.9 (tests marked gpu).

The checkpoints are made here by hand, as DeepSeek / Qwen3-FP8 store them: every Linear but the LM head (and the
modules left unconverted) as a float8_e4m3fn `weight` and a float32 `weight_scale_inv` per block.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest
import torch
from torch import nn

# The Triton interpreter has to be on before triton is first imported (its language library is decorated then), as
# in tests/kernels/conftest.py; if an earlier test module imported triton without it, the CPU kernel tests skip.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

from gpuformers.quantization.config import FineGrainedFP8Config
from tests.fixtures.checkpoints import make_checkpoint

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
IDS = torch.tensor([[1, 5, 9, 23, 42, 7, 64, 100]])
UNCONVERTED = "model.layers.1.mlp.down_proj"


def _quantize(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> float8 weight and float32 scales (ceil(out / bm), ceil(in / bn)), partial blocks too."""
    rows, cols = weight.shape
    bm, bn = block
    scales = torch.empty(math.ceil(rows / bm), math.ceil(cols / bn))
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].float()
            scales[i, j] = part.abs().amax().clamp(min=1e-12) / FP8_MAX
            quantized[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (part / scales[i, j]).clamp(-FP8_MAX, FP8_MAX)
    return quantized, scales


def _dequantize(quantized: torch.Tensor, scales: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The reference: every element times its block's scale, in float32, block by block."""
    out = torch.empty(quantized.shape)
    bm, bn = block
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
            out[rows, cols] = quantized[rows, cols].float() * scales[i, j]
    return out


def _write_fp8(source, hf_model, folder, block, skip=(UNCONVERTED,)):
    """Copy checkpoint `source` to `folder` in FP8; returns hf_model's state dict with the dequantized weights."""
    from safetensors.torch import save_file

    folder.mkdir()
    for path in source.iterdir():
        if path.suffix == ".json":
            shutil.copy(path, folder / path.name)
    tensors, reference = {}, {}
    for name, value in hf_model.state_dict().items():
        module = name.removesuffix(".weight")
        if (name.endswith(".weight") and isinstance(hf_model.get_submodule(module), nn.Linear)
                and module != "lm_head" and module not in skip):
            quantized, scales = _quantize(value, block)
            tensors[name], tensors[f"{module}.weight_scale_inv"] = quantized, scales
            reference[name] = _dequantize(quantized, scales, block)
        else:
            tensors[name] = reference[name] = value.clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": block, "modules_to_not_convert": list(skip)}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(source folder, transformers model, {block: (fp8 folder, the model's state dict dequantized by hand)})."""
    root = tmp_path_factory.mktemp("fp8")
    hf = make_checkpoint(root / "float", "qwen3", tie_word_embeddings=False)
    made = {}
    # [16, 16] divides every layer (64 / 32 / 96 rows and columns); [24, 40] leaves a partial block in each.
    for block in ([16, 16], [24, 40]):
        folder = root / f"fp8-{block[0]}x{block[1]}"
        made[tuple(block)] = folder, _write_fp8(root / "float", hf, folder, block)
    return root / "float", hf, made


def _load(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=kwargs.pop("dtype", torch.float32), progress=False,
                                                **kwargs)


def _reference_logits(hf, state):
    """transformers' model run on the hand-dequantized weights."""
    import copy

    model = copy.deepcopy(hf)
    model.load_state_dict(state)
    with torch.no_grad():
        return model, model(IDS).logits


# --- parity ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [(16, 16), (24, 40)])
def test_logits_equal_the_model_on_dequantized_weights(checkpoints, block):
    _, hf, made = checkpoints
    folder, state = made[block]
    model = _load(folder)
    _, expected = _reference_logits(hf, state)
    with torch.no_grad():
        logits = model(IDS).logits
    assert (logits - expected).abs().max().item() < 1e-5
    # A plain model: Linear layers, no scales, no quantization left behind
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear and model.quantization_config is None
    assert not any("scale_inv" in name for name in model.state_dict())
    # and the FP8 rounding is really there (the weights differ from the float checkpoint's)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.state_dict()[q_proj], hf.state_dict()[q_proj])


def test_logits_equal_transformers_loading_with_dequantize(checkpoints):
    """transformers loads the same folder on the CPU with FineGrainedFP8Config(dequantize=True). Only the [16, 16]
    checkpoint: transformers 5.24 derives the block size from the scale grid (out // ceil(out / bm)), which rejects
    or misreads partial blocks, so those are checked against the hand dequantization above."""
    import transformers

    folder, _ = checkpoints[2][(16, 16)]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
    ours = _load(folder, quantization_config=FineGrainedFP8Config(dequantize=True))
    with torch.no_grad():
        assert (ours(IDS).logits - theirs(IDS).logits).abs().max().item() < 1e-5
    # a transformers config object is accepted too
    again = _load(folder, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    assert torch.equal(again.model.layers[0].mlp.up_proj.weight, ours.model.layers[0].mlp.up_proj.weight)


def test_bfloat16_weights_are_the_float32_product_rounded_once(checkpoints):
    folder, state = checkpoints[2][(24, 40)]
    model = _load(folder, dtype=torch.bfloat16)
    for name, value in model.state_dict().items():
        if name.endswith("_proj.weight"):
            assert value.dtype is torch.bfloat16 and torch.equal(value, state[name].to(torch.bfloat16)), name


def test_modules_to_not_convert_are_read_unquantized(checkpoints):
    _, hf, made = checkpoints
    model = _load(made[(16, 16)][0])
    assert torch.equal(model.get_submodule(UNCONVERTED).weight, hf.get_submodule(UNCONVERTED).weight)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


def test_an_unlisted_layer_stored_unquantized_is_read_as_it_is(checkpoints, tmp_path):
    """Checkpoints do not always list every layer they left unquantized: a float weight without scales loads."""
    def list_nothing(config):
        config["quantization_config"]["modules_to_not_convert"] = []

    _, hf, made = checkpoints
    folder = _rewrite(made[(16, 16)][0], tmp_path / "unlisted", change_config=list_nothing)
    model = _load(folder)
    assert torch.equal(model.get_submodule(UNCONVERTED).weight, hf.get_submodule(UNCONVERTED).weight)


def test_generate_matches_the_model_on_dequantized_weights(checkpoints):
    _, hf, made = checkpoints
    folder, state = made[(24, 40)]
    reference, _ = _reference_logits(hf, state)
    model = _load(folder)
    ours = model.generate(IDS, max_new_tokens=6, do_sample=False)
    theirs = reference.generate(IDS, max_new_tokens=6, do_sample=False)
    assert ours.tolist() == theirs.tolist()


def test_saving_writes_an_unquantized_checkpoint(checkpoints, tmp_path):
    from gpuformers.loading.safetensors import SafetensorsFile

    folder, _ = checkpoints[2][(24, 40)]
    model = _load(folder)
    model.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    reader = SafetensorsFile(next((tmp_path / "saved").glob("*.safetensors")))
    try:
        assert not any(k.endswith("scale_inv") for k in reader.keys())
        assert {reader.info(k).dtype for k in reader.keys()} == {torch.float32}
    finally:
        reader.close()
    again = _load(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


# --- errors and refusals ---------------------------------------------------------------------------------------


def _rewrite(source, target, change_tensors=None, change_config=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    if change_tensors:
        change_tensors(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    if change_config:
        change_config(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_missing_scales_name_the_tensor(checkpoints, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    folder = _rewrite(checkpoints[2][(16, 16)][0], tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"lacks 1 tensor.*{name}"):
        _load(folder)


def test_a_wrong_block_size_names_the_tensor(checkpoints, tmp_path):
    def block_32(config):
        config["quantization_config"]["weight_block_size"] = [32, 32]

    folder = _rewrite(checkpoints[2][(16, 16)][0], tmp_path / "bad", change_config=block_32)
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \[\d+, \d+\].*weight_block_size=\[32, 32\]"):
        _load(folder)


def test_scales_for_an_unconverted_layer_are_an_error(checkpoints, tmp_path):
    def keep_up_proj(config):
        config["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.mlp.up_proj"]

    folder = _rewrite(checkpoints[2][(16, 16)][0], tmp_path / "bad", change_config=keep_up_proj)
    with pytest.raises(ValueError, match="FP8 scales for layers loaded unquantized: model.layers.0.mlp.up_proj"):
        _load(folder)


def test_keeping_fp8_weights_off_a_capable_gpu_is_refused(checkpoints, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(NotImplementedError, match=r"dequantize=False.*compute capability >= 8.9.*is on cpu"):
        _load(checkpoints[2][(16, 16)][0], quantization_config=FineGrainedFP8Config())


def test_quantizing_a_float_checkpoint_to_fp8_is_refused(checkpoints):
    with pytest.raises(NotImplementedError, match="already in FP8"):
        _load(checkpoints[0], quantization_config=FineGrainedFP8Config(dequantize=True))


def test_config_checks_and_reads_transformers_fields():
    from gpuformers.quantization.config import quantization_config_from

    with pytest.raises(ValueError, match="weight_block_size"):
        FineGrainedFP8Config(weight_block_size=[128])
    with pytest.raises(ValueError, match="activation_scheme"):
        FineGrainedFP8Config(activation_scheme="per-token")
    with pytest.raises(NotImplementedError, match="ue8m0"):
        FineGrainedFP8Config(scale_fmt="ue8m0")
    stored = quantization_config_from({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128], "ignored_layers": ["mlp.gate"]})
    assert isinstance(stored, FineGrainedFP8Config) and stored.skip_modules == ["lm_head", "mlp.gate"]


# --- FP8 weights kept: the Triton FP8 matmul ------------------------------------------------------------------


@pytest.fixture
def triton_here():
    """Where the kernel runs: the GPU, else the CPU under the interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("the FP8 kernel needs compute capability >= 8.9")
        return torch.device("cuda")
    if not INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this file on its own")
    return torch.device("cpu")


def _fp8_layer(out_features, in_features, block, seed=0):
    torch.manual_seed(seed)
    weight, scales = _quantize(torch.randn(out_features, in_features) * 0.05, block)
    return weight, scales


@pytest.mark.parametrize("block, split_k", [((16, 16), None), ((24, 32), None), ((24, 32), 1)])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fp8_matmul_equals_its_reference(triton_here, block, split_k, rows):
    from gpuformers.kernels.weight_only_matmul import MatmulConfig
    from gpuformers.quantization.fp8_matmul import fp8_matmul_forward, fp8_matmul_reference

    # 40 output rows: a partial tile of N and (for 24-row blocks) a partial block row; 48 input columns: with 32-column
    # blocks a partial block and a K step that does not divide K.
    weight, scales = _fp8_layer(40, 48, block)
    weight, scales = weight.to(triton_here), scales.to(triton_here)
    bias = torch.randn(40, device=triton_here)
    x = torch.randn(rows, 48, device=triton_here)
    config = None if split_k is None else MatmulConfig(16, 64, 16, split_k)
    got = fp8_matmul_forward(x, weight, scales, block, bias, config=config)
    expected = fp8_matmul_reference(x, weight, scales, block, bias)
    assert (got - expected).abs().max().item() < 1e-4


def test_fp8_matmul_gradients_reach_the_input_and_bias(triton_here):
    from gpuformers.quantization.fp8_matmul import fp8_matmul, fp8_matmul_reference

    weight, scales = (t.to(triton_here) for t in _fp8_layer(32, 48, (16, 16)))
    x = torch.randn(3, 48, device=triton_here, requires_grad=True)
    bias = torch.randn(32, device=triton_here, requires_grad=True)
    fp8_matmul(x, weight, scales, (16, 16), bias).square().sum().backward()
    grads = x.grad.clone(), bias.grad.clone()
    x.grad = bias.grad = None
    fp8_matmul_reference(x, weight, scales, (16, 16), bias).square().sum().backward()
    assert torch.allclose(grads[0], x.grad, atol=1e-4) and torch.allclose(grads[1], bias.grad, atol=1e-4)


def test_fp8_matmul_checks_its_inputs(triton_here):
    from gpuformers.quantization.fp8_matmul import fp8_matmul_forward

    weight, scales = (t.to(triton_here) for t in _fp8_layer(32, 48, (16, 16)))
    x = torch.randn(2, 48, device=triton_here)
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(2, 3\), expected \(1, 2\)"):
        fp8_matmul_forward(x, weight, scales, (32, 32))
    with pytest.raises(ValueError, match="weight has dtype float32"):
        fp8_matmul_forward(x, weight.float(), scales, (16, 16))


def test_a_model_kept_in_fp8_equals_the_dequantized_one(checkpoints, triton_here, tmp_path):
    from gpuformers.quantization.fp8 import FP8Linear

    _, hf, made = checkpoints
    folder, state = made[(16, 16)]
    model = _load(folder, quantization_config=FineGrainedFP8Config(dequantize=False), device_map=triton_here)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, FP8Linear) and q_proj.weight.dtype is torch.float8_e4m3fn
    assert q_proj._use_kernel(torch.zeros(1, 64, device=triton_here))  # the kernel, not dequantize-per-call
    assert type(model.get_submodule(UNCONVERTED)) is nn.Linear
    assert model.quantization_config.dequantize is False
    _, expected = _reference_logits(hf, state)
    with torch.no_grad():
        logits = model(IDS.to(triton_here)).logits.cpu()
    assert (logits - expected).abs().max().item() < 1e-4
    # It saves back as the FP8 checkpoint it came from
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "fp8" and saved["weight_block_size"] == [16, 16]
    again = _load(tmp_path / "saved", quantization_config=FineGrainedFP8Config(dequantize=False),
                  device_map=triton_here)
    with torch.no_grad():
        assert torch.equal(again(IDS.to(triton_here)).logits.cpu(), logits)


@pytest.mark.gpu
def test_fp8_matmul_bfloat16_on_the_gpu(triton_here):
    from gpuformers.quantization.fp8_matmul import fp8_matmul_forward, fp8_matmul_reference

    if triton_here.type != "cuda":
        pytest.skip("needs CUDA")
    weight, scales = (t.cuda() for t in _fp8_layer(1000, 576, (128, 128)))  # partial blocks in both dimensions
    for rows in (1, 16, 300):
        x = torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16)
        got = fp8_matmul_forward(x, weight, scales, (128, 128)).float()
        expected = fp8_matmul_reference(x, weight, scales, (128, 128)).float()
        assert ((got - expected).norm() / expected.norm()).item() < 1e-2, rows
