"""bitsandbytes layers (quantization/bnb.py, bnb_layers.py) against transformers' own bitsandbytes load of the same
checkpoint: quantize-on-load and pre-quantized checkpoints give the same logits and tokens, the storage is 4-bit /
int8, and a saved layer loads back.

The layers are swapped in here by hand (every nn.Linear but lm_head, as transformers does), so that these tests
hold the layer to transformers without depending on from_pretrained's wiring (test_from_pretrained.py tests that).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gpuformers.quantization.config import BitsAndBytesConfig
from tests.fixtures.checkpoints import make_checkpoint

IDS = torch.tensor([[1, 5, 9, 23, 42, 7, 64, 100]])
CONFIGS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "nf4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(autouse=True)
def _bitsandbytes():
    pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny llama with biases (they stay in full precision). intermediate_size=128 keeps every in_features a
    multiple of bitsandbytes' block of 64, which its AVX512-BF16 CPU kernel needs (see test_odd_shapes...)."""
    folder = tmp_path_factory.mktemp("llama")
    make_checkpoint(folder, "llama", intermediate_size=128, attention_bias=True, mlp_bias=True)
    return folder


def _hf_bnb(folder, settings: dict, dtype=torch.float32, device="cpu"):
    import transformers

    config = transformers.BitsAndBytesConfig(**settings)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=dtype,
                                                             device_map=device).eval()


def _ours(folder, settings: dict, dtype=torch.float32, device="cpu"):
    """Our model built on the meta device, every nn.Linear but lm_head swapped for bnb_linear, then loaded."""
    from gpuformers.loading.weights import CheckpointFiles, load_weights
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.modeling import skip_init
    from gpuformers.models.registry import model_class_for
    from gpuformers.quantization.bnb import bnb_linear

    config = ModelConfig.from_file(Path(folder) / "config.json")
    with torch.device("meta"), skip_init():
        model = model_class_for(config)(config)
    quantization = BitsAndBytesConfig(**settings)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and name != "lm_head":
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, bnb_linear(module, quantization, dtype))
    device = torch.device(device)
    load_weights(model, CheckpointFiles.find(folder), dtype=dtype, device=device, tied=model.tied_weights,
                 progress=False)
    model.tie_weights()
    model.reset_buffers(device)
    model.set_attn_implementation("sdpa")
    return model.eval()


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


# --- parity with transformers -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_greedy_tokens_equal_transformers(checkpoint, name):
    hf, ours = _hf_bnb(checkpoint, CONFIGS[name]), _ours(checkpoint, CONFIGS[name])
    # Same bitsandbytes kernels on the same quantized weights: equal up to float32 summation order.
    assert (_logits(ours) - _logits(hf)).abs().max().item() < 1e-5
    with torch.no_grad():
        expected = hf.generate(IDS, max_new_tokens=8, do_sample=False)
        tokens = ours.generate(IDS, max_new_tokens=8, do_sample=False)
    assert tokens.tolist() == expected.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["nf4-double-quant", "int8"])
def test_quantized_on_the_gpu_equals_transformers(checkpoint, name):
    settings = dict(CONFIGS[name], bnb_4bit_compute_dtype=torch.bfloat16)
    hf = _hf_bnb(checkpoint, settings, torch.bfloat16, "cuda")
    ours = _ours(checkpoint, settings, torch.bfloat16, "cuda")
    assert ours.model.layers[0].self_attn.q_proj.weight.device.type == "cuda"
    ids = IDS.cuda()
    # The same kernels on the same weights; bfloat16 tolerances in case the GPU picks other reduction orders.
    torch.testing.assert_close(_logits(ours, ids), _logits(hf, ids))
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=8, do_sample=False)
        assert ours.generate(ids, max_new_tokens=8, do_sample=False).tolist() == expected.tolist()


def test_bfloat16_model_with_bfloat16_compute_equals_transformers(checkpoint):
    settings = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    hf, ours = _hf_bnb(checkpoint, settings, torch.bfloat16), _ours(checkpoint, settings, torch.bfloat16)
    logits = _logits(ours)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, _logits(hf))


def test_odd_shapes_keep_the_portable_kernel():
    # in_features=96 is not a multiple of bitsandbytes' block of 64. On CPUs with AVX512-BF16, bitsandbytes'
    # Linear4bit repacks its weight for a CPU kernel in the first no-grad forward, and crashes on such a shape
    # (transformers' layer does, e.g. on a model with intermediate_size=96); ours keeps the portable kernel.
    torch.manual_seed(0)
    layer = _layer_from(nn.Linear(96, 64), CONFIGS["nf4"])
    x = torch.randn(3, 96)
    with torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out, nn.functional.linear(x, layer.dequantize(), layer.bias), rtol=1e-5, atol=1e-5)


# --- storage and dequantize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nf4", "nf4-double-quant"])
def test_4bit_layers_store_two_weights_per_byte(checkpoint, name):
    from gpuformers.quantization.bnb_layers import BnbLinear4bit

    ours = _ours(checkpoint, CONFIGS[name])
    layers = {n: m for n, m in ours.named_modules() if isinstance(m, BnbLinear4bit)}
    assert len(layers) == 2 * 7  # q k v o gate up down, per layer
    assert type(ours.lm_head) is nn.Linear
    for layer in layers.values():
        assert layer.weight.dtype == torch.uint8
        assert layer.weight.numel() == layer.in_features * layer.out_features // 2
        assert layer.bias.dtype == torch.float32
    layer = layers["model.layers.0.self_attn.q_proj"]
    assert "quant_type=nf4" in repr(layer) and f"double_quant={name.endswith('quant')}" in repr(layer)


def test_int8_layers_store_int8_rows_and_a_scale_per_row(checkpoint):
    from gpuformers.quantization.bnb_layers import BnbLinear8bitLt

    ours = _ours(checkpoint, CONFIGS["int8"])
    layer = ours.model.layers[0].mlp.down_proj
    assert isinstance(layer, BnbLinear8bitLt)
    assert layer.weight.dtype == torch.int8 and tuple(layer.weight.shape) == (64, 128)
    assert tuple(layer.weight.SCB.shape) == (64,)
    assert "threshold=6.0" in repr(layer)


@pytest.mark.parametrize("name", ["nf4", "fp4", "nf4-double-quant", "int8"])
def test_dequantize_is_the_weight_the_forward_uses(name):
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    layer = _layer_from(linear, CONFIGS[name])
    weight = layer.dequantize()
    assert weight.shape == (64, 128) and weight.dtype == torch.float32
    # About 4 / 8 bits of the largest weight in each block (or row): far from exact, but close.
    error = (weight - linear.weight).abs().max().item()
    assert 1e-5 < error < (0.03 if name != "int8" else 0.003)
    x = torch.randn(3, 128)
    if name != "int8":  # LLM.int8() also quantizes the activations, so its forward is only near x @ W.T
        with torch.enable_grad():  # inputs that need grad keep bitsandbytes' portable kernel
            out = layer(x.requires_grad_(True)).detach()
        torch.testing.assert_close(out, nn.functional.linear(x.detach(), weight, layer.bias), rtol=1e-5, atol=1e-5)
    # After a no-grad forward (which may repack the weight for the CPU kernel), dequantize still reads it.
    with torch.no_grad():
        layer(x.detach())
    assert (layer.dequantize() - weight).abs().max().item() < 0.01


def _repack_for_the_cpu_kernel(layer):
    """What bitsandbytes' Linear4bit does at a no-grad eval forward on CPUs with AVX512-BF16 (done by hand here, so
    that the test runs on any CPU)."""
    functional = pytest.importorskip("bitsandbytes.functional")
    if not hasattr(functional, "_convert_weight_packed_for_cpu"):
        pytest.skip("this bitsandbytes does not repack 4-bit weights for its CPU kernel")
    layer.weight.data, layer.weight.quant_state = functional._convert_weight_packed_for_cpu(
        layer.weight.data, layer.weight.quant_state)
    assert layer.weight.quant_state.packing_format_for_cpu


@pytest.mark.parametrize("name", ["nf4", "nf4-double-quant"])
def test_moving_a_repacked_4bit_layer_hands_over_the_portable_layout(name):
    # Params4bit.to() moves a repacked weight as it is (only .cuda() reads it back): model.to("cuda") after a CPU
    # evaluation gave the GPU kernels the CPU kernel's layout. .to("cpu") takes the same path in bitsandbytes.
    torch.manual_seed(0)
    layer = _layer_from(nn.Linear(128, 64), CONFIGS[name])
    portable, weight = layer.weight.data.clone(), layer.dequantize()
    _repack_for_the_cpu_kernel(layer)
    layer.to("cpu")
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    assert torch.equal(layer.weight.data, portable) and layer.quant_state is layer.weight.quant_state
    # the repacking rounded absmax to bfloat16, as bitsandbytes' eval forward does
    torch.testing.assert_close(layer.dequantize(), weight, rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_4bit_layer_evaluated_on_the_cpu_then_moved_computes_on_the_gpu():
    torch.manual_seed(0)
    layer = _layer_from(nn.Linear(128, 64), CONFIGS["nf4"])
    x = torch.randn(3, 128)
    _repack_for_the_cpu_kernel(layer)
    expected = nn.functional.linear(x, layer.dequantize(), layer.bias)  # dequantize() reads the repacked weight
    layer.to("cuda")
    with torch.no_grad():
        out = layer(x.cuda()).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def _layer_from(linear: nn.Linear, settings: dict, dtype=torch.float32) -> nn.Module:
    from gpuformers.quantization.bnb import bnb_linear

    with torch.device("meta"):
        meta = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    layer = bnb_linear(meta, BitsAndBytesConfig(**settings), dtype)
    assert layer.weight.is_meta
    layer.load_from_checkpoint("weight", linear.weight.detach().clone())
    if linear.bias is not None:
        layer.load_from_checkpoint("bias", linear.bias.detach().clone())
    return layer.eval()


# --- pre-quantized checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nf4", "nf4-double-quant", "int8"])
def test_checkpoint_saved_by_transformers_loads_with_its_logits(checkpoint, tmp_path, name):
    hf = _hf_bnb(checkpoint, CONFIGS[name])
    hf.save_pretrained(tmp_path)
    ours = _ours(tmp_path, CONFIGS[name])
    # Our state_dict is transformers' format: same keys, same tensors, for every quantized layer.
    theirs = hf.state_dict()
    mine = ours.state_dict()
    quantized = [k for k in theirs if ".layers." in k]
    assert set(quantized) <= set(mine)
    for key in quantized:
        assert torch.equal(mine[key], theirs[key]), key
    assert torch.equal(_logits(ours), _logits(hf))


@pytest.mark.parametrize("name", ["nf4", "fp4", "nf4-double-quant", "int8"])
def test_our_state_dict_loads_back_into_a_fresh_layer(name):
    torch.manual_seed(0)
    layer = _layer_from(nn.Linear(128, 64), CONFIGS[name])
    x = torch.randn(3, 128)
    with torch.no_grad():
        layer(x)  # a no-grad forward first: on AVX512-BF16 CPUs it repacks the 4-bit weight for the CPU kernel
        expected = layer(x)
    state = layer.state_dict()
    with torch.no_grad():
        assert torch.equal(layer(x), expected), "saving must not change the layer"
    fresh = _empty_like(layer, CONFIGS[name])
    for key in reversed(list(state)):  # any order: the 4-bit pieces are gathered until the set is complete
        fresh.load_from_checkpoint(key, state[key].clone())
    assert not any(t.is_meta for t in fresh.parameters())
    with torch.no_grad():
        out = fresh(x)
    if name == "nf4-double-quant":
        # After the CPU repacking, bitsandbytes re-quantizes the (then bfloat16) absmax when saving: ~1e-3 off.
        torch.testing.assert_close(out, expected, rtol=0, atol=5e-3)
    else:
        assert torch.equal(out, expected)


def _empty_like(layer: nn.Module, settings: dict) -> nn.Module:
    from gpuformers.quantization.bnb import bnb_linear

    with torch.device("meta"):
        meta = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    return bnb_linear(meta, BitsAndBytesConfig(**settings), torch.float32).eval()


def test_incomplete_pre_quantized_weight_stays_missing():
    layer = _layer_from(nn.Linear(128, 64), CONFIGS["nf4"])
    state = layer.state_dict()
    fresh = _empty_like(layer, CONFIGS["nf4"])
    for key in state:
        if key != "weight.absmax":
            fresh.load_from_checkpoint(key, state[key])
    assert fresh.weight.is_meta  # what the loader reports as a missing key


# --- errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nf4", "int8"])
def test_unknown_key_and_bad_shapes_are_errors(name):
    fresh = _empty_like(_layer_from(nn.Linear(128, 64), CONFIGS[name]), CONFIGS[name])
    with pytest.raises(ValueError, match="'qweight'.*weight, bias"):
        fresh.load_from_checkpoint("qweight", torch.zeros(64, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"bias of shape \[32\]"):
        fresh.load_from_checkpoint("bias", torch.zeros(32))
    with pytest.raises(ValueError, match=r"weight of shape \[128, 64\]"):
        fresh.load_from_checkpoint("weight", torch.zeros(128, 64))


def test_pre_quantized_4bit_weight_of_the_wrong_size_is_an_error():
    small = _layer_from(nn.Linear(64, 64), CONFIGS["nf4"]).state_dict()
    fresh = _empty_like(_layer_from(nn.Linear(128, 64), CONFIGS["nf4"]), CONFIGS["nf4"])
    with pytest.raises(ValueError, match="holds 2048 bytes.*packs into 4096"):
        for key, value in small.items():
            fresh.load_from_checkpoint(key, value)


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    from gpuformers.quantization.bnb import bnb_linear

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with torch.device("meta"):
        linear = nn.Linear(64, 64)
    with pytest.raises(ImportError, match=r"pip install bitsandbytes \(or pip install gpuformers\[quant\]\)"):
        bnb_linear(linear, BitsAndBytesConfig(load_in_4bit=True), torch.float32)
