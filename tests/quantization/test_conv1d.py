"""Quantizing Conv1D-style layers (GPT-2's c_attn, c_proj, c_fc: weights stored (in, out)): each becomes the
Linear's quantized layer, its weight transposed on load. Weight-only int8 / int4 against the float model run on the
dequantized weights and saved and loaded back; bitsandbytes nf4 / int8 and QLoRA against transformers' and peft's
own bitsandbytes GPT-2 (its integration transposes Conv1D weights the same way), the Hub file's key layout, the
engine, and a LoRA merge into a square Conv1D.

The checkpoint's layer sizes are multiples of 64 (bitsandbytes' block) so that its CPU kernels run as on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpuformers import AutoModelForCausalLM, BitsAndBytesConfig, WeightOnlyConfig

IDS = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny GPT-2 (untied head, perturbed biases): n_embd 64, so c_attn is (64, 192), attn.c_proj square."""
    import transformers

    folder = tmp_path_factory.mktemp("gpt2-quant")
    torch.manual_seed(0)
    # no dropout: the QLoRA test compares training-mode forwards
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


def _load(folder, config=None):
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.float32,
                                                progress=False)


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 32)])
def test_weight_only_conv1d_equals_the_float_model_on_the_dequantized_weights(folder, bits, group_size, tmp_path):
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    model = _load(folder, WeightOnlyConfig(bits=bits, group_size=group_size))
    names = [f"transformer.h.{i}.{name}" for i in range(2) for name in CONV1D]
    assert all(type(model.get_submodule(n)) is WeightOnlyLinear for n in names)
    assert type(model.lm_head) is nn.Linear
    c_attn = model.get_submodule("transformer.h.0.attn.c_attn")
    assert (c_attn.out_features, c_attn.in_features) == (192, 64)  # a Linear's (out, in): the weight transposed
    # Exactly the float model with each Conv1D weight set to the dequantized one, transposed back to (in, out)
    reference = _load(folder)
    with torch.no_grad():
        for name in names:
            reference.get_submodule(name).weight.copy_(model.get_submodule(name).dequantize().T)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-5, atol=1e-5)
    float_logits = _logits(_load(folder))  # and close to the float model: a wrong transpose is far off
    assert (_logits(model) - float_logits).abs().max() < (0.02 if bits == 8 else 0.2) * float_logits.abs().max()
    model.save_pretrained(tmp_path)  # pre-quantized: qweight stored (out, in), loaded back as it is
    torch.testing.assert_close(_logits(_load(tmp_path)), _logits(model), rtol=0, atol=0)


def test_hub_key_layout_quantizes_alike(folder, tmp_path):
    """openai-community/gpt2's file names the layers h.{i}... (no "transformer."): renamed on load, they reach the
    quantized layers as transformers' keys do."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    config = WeightOnlyConfig(bits=8)
    torch.testing.assert_close(_logits(_load(tmp_path, config)), _logits(_load(folder, config)), rtol=0, atol=0)


def test_quantized_gpt2_generates_and_the_engine_matches_generate(folder):
    from tests.models.parity import assert_engine_matches_generate

    assert_engine_matches_generate(_load(folder, WeightOnlyConfig(bits=8)))


@pytest.mark.parametrize("settings", [NF4, dict(load_in_8bit=True)], ids=["nf4", "int8"])
def test_bitsandbytes_conv1d_equals_transformers(folder, settings, tmp_path):
    pytest.importorskip("bitsandbytes")
    import transformers

    ours = _load(folder, BitsAndBytesConfig(**settings))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(**settings))
    assert type(ours.get_submodule("transformer.h.0.attn.c_attn")).__name__.startswith("BnbLinear")
    # The same stored tensors as transformers' (weights (out, in)), before a forward repacks any for the CPU
    theirs.save_pretrained(tmp_path)
    saved = _load(tmp_path)  # transformers' pre-quantized GPT-2 loads as it is
    expected, mine = theirs.state_dict(), ours.state_dict()
    quantized = [key for key in expected if ".h." in key and "ln_" not in key]
    for key in quantized:
        assert torch.equal(mine[key], expected[key]) and torch.equal(saved.state_dict()[key], expected[key]), key
    torch.testing.assert_close(_logits(ours), _logits(theirs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(saved), _logits(ours), rtol=0, atol=0)


def test_qlora_on_conv1d_matches_peft(folder):
    """peft's LoRA (all-linear: c_attn, c_proj, c_fc) over transformers' nf4 GPT-2 against ours: the same logits
    and LoRA gradients."""
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    import transformers

    from gpuformers.lora import LoraConfig, get_peft_model, set_peft_model_state_dict

    lora = dict(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(**NF4))
    theirs = peft.get_peft_model(hf, peft.LoraConfig(**lora))
    ours = get_peft_model(_load(folder, BitsAndBytesConfig(**NF4)), LoraConfig(**lora))
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    # Training mode: an eval-mode forward may repack the 4-bit weights for bitsandbytes' AVX512-BF16 CPU kernel
    ours.train(), theirs.train()
    got, want = ours(input_ids=IDS, labels=IDS), theirs(input_ids=IDS, labels=IDS)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
    got.loss.backward(), want.loss.backward()
    grads = [{n.replace(".default.", "."): p.grad for n, p in m.named_parameters() if p.requires_grad}
             for m in (ours, theirs)]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 2 * len(CONV1D)  # lora_A, lora_B per layer
    for name, grad in grads[0].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grad, grads[1][name], rtol=0, atol=1e-5)


def test_lora_merge_into_a_quantized_square_conv1d_keeps_the_outputs(folder):
    """Merging requantizes through load_from_checkpoint with an (out, in) weight: once loaded, a square Conv1D's
    layer (attn.c_proj, 64 x 64) must not take it for a checkpoint's (in, out) weight and transpose it."""
    from gpuformers.lora import LoraConfig, get_peft_model

    model = get_peft_model(_load(folder, WeightOnlyConfig(bits=8)),
                           LoraConfig(r=4, target_modules=["c_proj"], init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(0.1)
    adapted = _logits(model)
    merged = _logits(model.merge_and_unload())
    assert (merged - adapted).abs().max() < 0.02 * adapted.abs().max()  # requantizing rounds again
