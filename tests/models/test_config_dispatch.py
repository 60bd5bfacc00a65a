"""ModelConfig.from_dict returns the config class of the model_type (models/registry.py), imported only then."""

import json
import subprocess
import sys

import pytest

from gpuformers.models.config import ModelConfig
from gpuformers.models.registry import MODEL_TYPES, model_class_for

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
FAMILY_CLASSES = {"llama": "ModelConfig", "mistral": "ModelConfig", "qwen2": "ModelConfig", "qwen3": "ModelConfig",
                  "qwen3_moe": "Qwen3MoeConfig", "smollm3": "SmolLM3Config", "granite": "GraniteConfig",
                  "olmo2": "Olmo2Config", "mixtral": "MixtralConfig", "phi3": "Phi3Config", "gemma": "GemmaConfig",
                  "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "qwen2_moe": "Qwen2MoeConfig",
                  "gpt_oss": "GptOssConfig", "olmoe": "OlmoeConfig", "glm": "Glm4Config", "glm4": "Glm4Config",
                  "ministral": "MinistralConfig", "ministral3": "Ministral3Config",
                  "ernie4_5": "Ernie4_5Config", "seed_oss": "SeedOssConfig", "starcoder2": "Starcoder2Config",
                  "exaone4": "Exaone4Config", "gpt_neox": "GPTNeoXConfig",
                  "gpt2": "GPT2Config", "mamba2": "Mamba2Config", "nemotron_h": "NemotronHConfig",
                  "granitemoehybrid": "GraniteMoeHybridConfig", "falcon_h1": "FalconH1Config"}
# An attention-free family's sizes (Mamba2: num_heads * head_dim = expand * hidden_size)
_SIZES = {"mamba2": dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, n_groups=2),
          # Nemotron-H's layers are its blocks (transformers' default blocks include "moe", which is refused)
          "nemotron_h": {**SIZES, "hybrid_override_pattern": "M*-"}}


@pytest.mark.parametrize("model_type", sorted(FAMILY_CLASSES))
def test_each_model_type_reads_into_its_class_and_its_model_names_it(model_type, tmp_path):
    config = ModelConfig.from_dict({"model_type": model_type, **_SIZES.get(model_type, SIZES)})
    assert type(config).__name__ == FAMILY_CLASSES[model_type]
    assert model_class_for(config).config_class is type(config)
    # What save_pretrained writes reads back into the same class, through ModelConfig and the family's class alike.
    # (Compared after one round: Phi-3 writes partial_rotary_factor 1.0, which then sits in rope_parameters.)
    config.save_pretrained(tmp_path)
    again = ModelConfig.from_file(tmp_path / "config.json")
    assert type(again) is type(config)
    assert type(config).from_dict(again.to_dict()).to_dict() == again.to_dict()


def test_every_supported_model_type_has_a_row():
    assert set(FAMILY_CLASSES) == set(MODEL_TYPES)


def _modules_after(code: str) -> list[str]:
    code += ("\nimport json, sys; print(json.dumps(sorted(m for m in sys.modules"
             " if m.startswith('gpuformers.models.') or m == 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_config_module_is_light_and_a_family_is_imported_when_read():
    assert _modules_after("import gpuformers.models.config") == ["gpuformers.models.config",
                                                                 "gpuformers.models.config_checks",
                                                                 "gpuformers.models.registry"]
    sizes = json.dumps(SIZES)
    llama = _modules_after(f"from gpuformers.models.config import ModelConfig\n"
                           f"ModelConfig.from_dict(dict(model_type='llama', **{sizes}))")
    assert llama == ["gpuformers.models.config", "gpuformers.models.config_checks", "gpuformers.models.registry"]
    gemma = _modules_after(f"from gpuformers.models.config import ModelConfig\n"
                           f"ModelConfig.from_dict(dict(model_type='gemma2', **{sizes}))")
    assert "gpuformers.models.gemma" in gemma and "gpuformers.models.phi3" not in gemma


def test_unknown_model_type_lists_every_supported_type():
    with pytest.raises(ValueError, match="model_type 'bert' is not supported") as err:
        ModelConfig.from_dict({"model_type": "bert", **SIZES})
    assert str(err.value).endswith(", ".join(MODEL_TYPES))


def test_a_family_class_refuses_another_family_and_the_base_class_refuses_a_family():
    from gpuformers.models.gemma import Gemma2Config, GemmaConfig
    from gpuformers.models.phi3 import Phi3Config

    # A family's class reads its own model types (its subclasses' too); ModelConfig reads them all.
    assert type(GemmaConfig.from_dict({"model_type": "gemma2", **SIZES})) is Gemma2Config
    with pytest.raises(ValueError, match="Phi3Config.from_dict was given a 'llama' config.*ModelConfig.from_dict"):
        Phi3Config.from_dict({"model_type": "llama", **SIZES})
    # Built directly, ModelConfig would skip the family's defaults and checks.
    with pytest.raises(TypeError, match="a 'gemma2' config is a Gemma2Config, not a ModelConfig"):
        ModelConfig(model_type="gemma2", **SIZES)


def test_auto_config_and_gguf_style_dicts_dispatch(tmp_path):
    from gpuformers import AutoConfig
    from gpuformers.models.mixtral import MixtralConfig

    assert type(AutoConfig.for_model("mixtral", **SIZES)) is MixtralConfig
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", **SIZES}))
    assert type(AutoConfig.from_pretrained(tmp_path)) is MixtralConfig
