"""model.dequantize(): every quantized layer back to a float one, the model computing what it computed quantized
and saving as an unquantized checkpoint that transformers reads: weight-only int8 / int4, bitsandbytes nf4 / int8
(on the CPU), GPT-2's Conv1D layers (their (in, out) layout restored), QLoRA merged after dequantizing, gpt-oss's
packed MXFP4 experts (tests/models/test_gpt_oss.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from gpuformers import AutoModelForCausalLM, BitsAndBytesConfig, WeightOnlyConfig
from tests.fixtures.checkpoints import make_checkpoint

IDS = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dequantize-qwen3")
    make_checkpoint(folder, "qwen3", head_dim=16, hidden_size=64, intermediate_size=128)
    return folder


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("dequantize-gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def _load(folder, config=None, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.float32,
                                                progress=False, **kwargs).eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _quantized_layers(model) -> list[str]:
    return [name for name, m in model.named_modules() if "Linear" in type(m).__name__ and type(m) is not nn.Linear
            and "Lora" not in type(m).__name__]


CONFIGS = [
    pytest.param(WeightOnlyConfig(bits=8), id="int8"),
    pytest.param(WeightOnlyConfig(bits=4, group_size=32), id="int4"),
    pytest.param(dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"), id="nf4",
                 marks=pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")),
    pytest.param(dict(load_in_8bit=True), id="bnb-int8",
                 marks=pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_dequantized_model_computes_the_same_and_saves_unquantized(qwen3, config, tmp_path):
    import transformers

    bnb_kwargs = config if isinstance(config, dict) else None  # bitsandbytes: ours and transformers' from the same
    model = _load(qwen3, BitsAndBytesConfig(**bnb_kwargs) if bnb_kwargs else config)
    assert model.is_quantized and _quantized_layers(model)
    # (bitsandbytes' CPU backend re-lays out its 4-bit state on a first forward, and transformers' dequantize() then
    # reads it differently: both are dequantized before any forward here)
    quantized = _logits(model) if not bnb_kwargs else None
    assert model.dequantize() is model
    assert not model.is_quantized and _quantized_layers(model) == []
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    dequantized = _logits(model)
    if not bnb_kwargs:  # weight-only's forward is F.linear on the dequantized weight
        torch.testing.assert_close(dequantized, quantized, atol=1e-4, rtol=0)
    else:  # bitsandbytes computes otherwise (int8 activations, its 4-bit kernels): transformers' dequantize() is
        # the oracle, from its own loading of the same checkpoint with the same config
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            qwen3, dtype=torch.float32, quantization_config=transformers.BitsAndBytesConfig(**bnb_kwargs))
        with torch.no_grad():
            torch.testing.assert_close(dequantized, theirs.dequantize().eval()(input_ids=IDS).logits, atol=1e-4,
                                       rtol=0)
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in (tmp_path / "config.json").read_text()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=IDS).logits, dequantized, atol=1e-4, rtol=0)


def test_conv1d_layers_come_back_in_their_layout(gpt2, tmp_path):
    import transformers

    from gpuformers.models.gpt2 import GPT2Conv1D

    model = _load(gpt2, WeightOnlyConfig(bits=8))
    quantized = _logits(model)
    model.dequantize()
    c_attn = model.get_submodule("transformer.h.0.attn.c_attn") if hasattr(model, "transformer") else next(
        m for n, m in model.named_modules() if n.endswith("h.0.attn.c_attn"))
    assert type(c_attn) is GPT2Conv1D and tuple(c_attn.weight.shape) == (64, 192) and c_attn.packed_parts == 3
    torch.testing.assert_close(_logits(model), quantized, atol=1e-4, rtol=0)
    model.save_pretrained(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=IDS).logits, quantized, atol=1e-4, rtol=0)


def test_qlora_adapter_merges_after_dequantizing(qwen3):
    """The QLoRA path: an adapter over int4 layers, dequantized (the base layers stay frozen under the adapter),
    then merged into plain Linear layers: the same logits as the adapter over the quantized base."""
    from gpuformers.lora import LoraConfig, get_peft_model

    base = _load(qwen3, WeightOnlyConfig(bits=4, group_size=32))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False)).eval()
    with_adapter = _logits(model)
    model.base_model.model.dequantize()
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer) is nn.Linear and not q_proj.base_layer.weight.requires_grad
    torch.testing.assert_close(_logits(model), with_adapter, atol=1e-4, rtol=0)
    merged = model.merge_and_unload()
    assert type(merged.model.layers[0].self_attn.q_proj) is nn.Linear and not merged.is_quantized
    torch.testing.assert_close(_logits(merged), with_adapter, atol=1e-4, rtol=0)


def test_dtype_and_errors(qwen3):
    model = _load(qwen3, WeightOnlyConfig(bits=8))
    model.dequantize(torch.bfloat16)
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="is not quantized .* nothing to dequantize"):
        model.dequantize()
