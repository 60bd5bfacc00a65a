"""from_pretrained(quantization_config=...): the configs, which layers get quantized, pre-quantized checkpoints
saved and loaded back, GGUF, the engine and the Trainer on a quantized model."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gpuformers.quantization.config import (
    BitsAndBytesConfig,
    WeightOnlyConfig,
    quantization_config_from,
)
from tests.fixtures.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    # Bigger than the default tiny shape so that int4 groups of 32 fit the layers.
    hf = make_checkpoint(folder, "qwen3", hidden_size=128, intermediate_size=256, head_dim=32,
                         tie_word_embeddings=False)
    return folder, hf


def _load(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, progress=False, **kwargs)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.tensor([[1, 5, 9, 23, 42, 7, 64, 100]])


# --- configs ------------------------------------------------------------------------------------------------


def test_bnb_config_checks_its_fields():
    with pytest.raises(ValueError, match="choose one"):
        BitsAndBytesConfig(load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ValueError, match="load_in_4bit=True or load_in_8bit=True"):
        BitsAndBytesConfig()
    with pytest.raises(ValueError, match="bnb_4bit_quant_type='int4'"):
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="int4")
    with pytest.raises(ValueError, match="not a torch dtype"):
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype="float33")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bfloat16")
    assert config.bnb_4bit_compute_dtype is torch.bfloat16 and config.bits == 4
    assert config.skip_modules == ["lm_head"]
    # transformers' defaults: float32 compute and uint8 storage when not given
    assert BitsAndBytesConfig(load_in_8bit=True).bnb_4bit_compute_dtype is torch.float32


def test_bnb_config_reads_transformers_dict():
    import transformers

    theirs = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    ours = quantization_config_from(theirs)  # the object, as users pass it
    assert isinstance(ours, BitsAndBytesConfig)
    assert (ours.load_in_4bit, ours.bnb_4bit_quant_type, ours.bnb_4bit_use_double_quant) == (True, "nf4", True)
    assert ours.bnb_4bit_compute_dtype is torch.bfloat16
    # and what config.json holds: our to_dict is read back the same by transformers and by us
    again = transformers.BitsAndBytesConfig.from_dict(json.loads(json.dumps(ours.to_dict())))
    assert again.load_in_4bit and again.bnb_4bit_quant_type == "nf4" and again.bnb_4bit_use_double_quant
    assert quantization_config_from(json.loads(json.dumps(ours.to_dict()))) == ours


def test_weight_only_config_defaults_and_errors():
    assert WeightOnlyConfig().group_size is None and WeightOnlyConfig(bits=4).group_size is None
    with pytest.raises(ValueError, match="bits=3"):
        WeightOnlyConfig(bits=3)
    with pytest.raises(ValueError, match="group_size=0"):
        WeightOnlyConfig(group_size=0)
    with pytest.raises(NotImplementedError, match="'hqq' is not supported"):
        quantization_config_from({"quant_method": "hqq", "nbits": 4})
    with pytest.raises(TypeError, match="quantization_config must be"):
        quantization_config_from("int8")


# --- weight-only through from_pretrained ------------------------------------------------------------------------


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 32)])
def test_weight_only_load_quantizes_every_linear_but_the_head(checkpoint, bits, group_size):
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    folder, hf = checkpoint
    model = _load(folder, quantization_config=WeightOnlyConfig(bits=bits, group_size=group_size))
    layers = dict(model.named_modules())
    quantized = [n for n, m in layers.items() if isinstance(m, WeightOnlyLinear)]
    assert len(quantized) == 7 * hf.config.num_hidden_layers  # q k v o gate up down in every layer
    assert type(model.lm_head) is nn.Linear and model.is_quantized
    assert not any(t.is_meta for t in model.state_dict().values())
    # Close to the float model, and exactly the float model run on the dequantized weights.
    ref = _logits(hf, IDS)
    ours = _logits(model, IDS)
    scale = ref.abs().max()
    assert (ours - ref).abs().max() < (0.02 if bits == 8 else 0.2) * scale
    float_model = _load(folder)
    with torch.no_grad():
        for name in quantized:
            float_model.get_submodule(name).weight.copy_(layers[name].dequantize())
    torch.testing.assert_close(ours, _logits(float_model, IDS), rtol=1e-5, atol=1e-5)


def test_weight_only_save_and_load_back(checkpoint, tmp_path):
    folder, _ = checkpoint
    model = _load(folder, quantization_config=WeightOnlyConfig(bits=4, group_size=32))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "weight_only" and saved["bits"] == 4 and saved["group_size"] == 32
    size = lambda f: sum(p.stat().st_size for p in f.glob("*.safetensors"))  # noqa: E731
    assert size(tmp_path) < 0.5 * size(folder)
    # config.json says it is quantized: loading needs no quantization_config, and another one is ignored
    again = _load(tmp_path, quantization_config=WeightOnlyConfig(bits=8))
    assert again.quantization_config == model.quantization_config
    torch.testing.assert_close(_logits(again, IDS), _logits(model, IDS), rtol=0, atol=0)


def test_tied_head_cannot_be_quantized_alone(tmp_path):
    make_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tied embeddings"):
        _load(tmp_path, quantization_config=WeightOnlyConfig(skip_modules=[]))
    with pytest.raises(ValueError, match="quantized no layer"):
        _load(tmp_path, quantization_config=WeightOnlyConfig(skip_modules=["model", "lm_head"]))


def test_int4_groups_fit_each_layer_unless_given(tmp_path):
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    # hidden 96: groups of 32 for the 96-wide inputs, 128 for the 256-wide MLP input (down_proj)
    make_checkpoint(tmp_path, "llama", hidden_size=96, intermediate_size=256, num_attention_heads=3,
                    num_key_value_heads=1)
    model = _load(tmp_path, quantization_config=WeightOnlyConfig(bits=4))
    groups = {n.rsplit(".", 1)[-1]: m.group_size for n, m in model.named_modules() if isinstance(m, WeightOnlyLinear)}
    assert groups["q_proj"] == 32 and groups["down_proj"] == 128
    model.save_pretrained(tmp_path / "int4")  # the same layout again from config.json's group_size None
    torch.testing.assert_close(_logits(_load(tmp_path / "int4"), IDS), _logits(model, IDS), rtol=0, atol=0)
    with pytest.raises(ValueError, match="group_size=128 does not divide in_features=96"):
        _load(tmp_path, quantization_config=WeightOnlyConfig(bits=4, group_size=128))


def test_skip_modules_keep_layers_in_full_precision(checkpoint):
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    folder, _ = checkpoint
    model = _load(folder, quantization_config=WeightOnlyConfig(skip_modules=["lm_head", "mlp", "layers.0"]))
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, WeightOnlyLinear))}
    assert kinds["model.layers.1.self_attn.q_proj"] is WeightOnlyLinear
    assert kinds["model.layers.1.mlp.down_proj"] is nn.Linear
    assert kinds["model.layers.0.self_attn.q_proj"] is nn.Linear


def test_quantized_model_generates_and_engine_matches_generate(checkpoint):
    folder, _ = checkpoint
    model = _load(folder, quantization_config=WeightOnlyConfig(bits=8))
    prompts = [[1, 5, 9, 23], [7, 64, 100, 3, 8, 2], [11]]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(p):]
                .tolist() for p in prompts]
    outputs = model.generate_batch(prompts, max_new_tokens=6, eos_token_id=None, progress_bar=False,
                                   block_size=8, num_blocks=16)
    assert [r.generated_tokens for r in outputs.values()] == expected


def test_trainer_refuses_a_quantized_model(checkpoint):
    from gpuformers import Trainer, TrainingArguments

    folder, _ = checkpoint
    model = _load(folder, quantization_config=WeightOnlyConfig(bits=8))
    with pytest.raises(ValueError, match="attach LoRA adapters"):
        Trainer(model=model, args=TrainingArguments(output_dir="unused"))


# --- bitsandbytes through from_pretrained -----------------------------------------------------------------------


def test_bnb_4bit_load_matches_transformers(checkpoint):
    pytest.importorskip("bitsandbytes")
    import transformers

    folder, _ = checkpoint
    ours = _load(folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, device_map="cpu",
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    torch.testing.assert_close(_logits(ours, IDS), _logits(theirs, IDS), rtol=1e-5, atol=1e-5)


# --- the command line and GGUF --------------------------------------------------------------------------------


def test_cli_quantization_choices():
    from gpuformers.models.command_line import quantization_config_for

    assert quantization_config_for(None, "auto", "cpu") is None
    assert quantization_config_for("int8", "auto", "cpu") == WeightOnlyConfig(bits=8)
    assert quantization_config_for("int4", "auto", "cpu") == WeightOnlyConfig(bits=4)
    nf4 = quantization_config_for("bnb-4bit", "auto", "cuda")
    assert nf4.load_in_4bit and nf4.bnb_4bit_quant_type == "nf4" and nf4.bnb_4bit_compute_dtype is torch.bfloat16
    assert quantization_config_for("bnb-8bit", "float16", "cuda").load_in_8bit


def test_gguf_model_is_quantized_after_dequantizing(tmp_path):
    from gpuformers.quantization.weight_only import WeightOnlyLinear
    from tests.test_gguf import write_tiny_llama

    write_tiny_llama(tmp_path / "t.gguf")
    plain = _load(tmp_path, gguf_file="t.gguf")
    model = _load(tmp_path, gguf_file="t.gguf", quantization_config=WeightOnlyConfig(bits=8))
    assert isinstance(model.model.layers[0].mlp.down_proj, WeightOnlyLinear) and model.is_quantized
    ref = _logits(plain, IDS % 64)
    assert (_logits(model, IDS % 64) - ref).abs().max() < 0.02 * ref.abs().max()
