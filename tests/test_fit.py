"""`gpuformers fit` (fit.py): its weights and KV-cache numbers against what our loader and cache really allocate,
and its choice of device_map / quantization on simulated GPUs, for Qwen3-0.6B- and Qwen3-8B-shaped configs."""

from __future__ import annotations

import json

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.fit import fit_report, kv_bytes_per_token, parse_devices, weight_bytes
from gpuformers.generation.cache import DynamicCache
from gpuformers.models.config import ModelConfig
from gpuformers.models.modeling import skip_init
from gpuformers.models.registry import model_class_for

GiB = 2**30
QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True, torch_dtype="bfloat16",
                  rms_norm_eps=1e-6, rope_theta=1e6)
QWEN3_8B = dict(QWEN3_0_6B, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)


def write_zero_checkpoint(folder, config: dict) -> None:
    """config.json + model.safetensors of zeros in bfloat16 (values do not matter for sizes; zeros stay finite)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    with torch.device("meta"), skip_init():
        model = model_class_for(ModelConfig.from_dict(config))(ModelConfig.from_dict(config))
    state = {name: torch.zeros(p.shape, dtype=torch.bfloat16) for name, p in model.named_parameters()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def loaded_bytes(model) -> int:
    """Bytes of the distinct tensors the loader materialised (tied ones once), persistent buffers included."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    persistent = {id(t) for _, t in model.state_dict(keep_vars=True).items()}
    return sum(t.numel() * t.element_size() for key, t in tensors.items() if key in persistent)


def measured_kv_per_token(model, tokens: int = 8) -> int:
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.zeros(1, tokens, dtype=torch.long), past_key_values=cache, use_cache=True)
    stored = sum(t.numel() * t.element_size() for t in cache.key_cache + cache.value_cache)
    return stored // tokens


def check_against_loader(tmp_path, config: dict, tokens: int = 8):
    write_zero_checkpoint(tmp_path / "ckpt", config)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype="bfloat16", progress=False)
    report = fit_report(ModelConfig.from_dict(config), {"cpu": 64 * GiB}, dtype=torch.bfloat16)
    assert abs(report.weights_bytes - loaded_bytes(model)) <= 0.05 * loaded_bytes(model)
    measured = measured_kv_per_token(model, tokens)
    assert abs(report.kv_bytes_per_token - measured) <= 0.05 * measured
    return report, model


def test_weights_and_kv_match_the_loader_on_a_small_0_6b_variant(tmp_path):
    # The 0.6B layer shapes with 2 layers and a small vocabulary: fast; the full shape is the slow test below.
    report, model = check_against_loader(tmp_path, dict(QWEN3_0_6B, num_hidden_layers=2, vocab_size=2048))
    assert report.kv_bytes_per_token == 2 * 2 * 8 * 128 * 2  # layers x (k, v) x kv_heads x head_dim x bf16


@pytest.mark.slow
def test_weights_and_kv_match_the_loader_on_the_full_0_6b_shape(tmp_path):
    report, _ = check_against_loader(tmp_path, QWEN3_0_6B, tokens=4)
    assert 1.0 * GiB < report.weights_bytes < 1.25 * GiB  # 596 M parameters in bfloat16
    assert report.kv_bytes_per_token == 28 * 2 * 8 * 128 * 2


@pytest.mark.slow
def test_8b_layer_shapes_match_the_loader(tmp_path):
    # One 8B-shaped decoder layer (small vocabulary): the per-layer weights and KV the loader and cache allocate,
    # scaled to 36 layers, are what fit says for the full 8B config.
    report, model = check_against_loader(tmp_path, dict(QWEN3_8B, num_hidden_layers=1, vocab_size=256), tokens=4)
    full = fit_report(ModelConfig.from_dict(QWEN3_8B), {"cpu": 64 * GiB}, dtype=torch.bfloat16)
    layer = loaded_bytes(model) - 2 * 256 * 4096 * 2 - 4096 * 2  # less the embeddings, lm_head and final norm
    expected = 36 * layer + 2 * 151936 * 4096 * 2 + 4096 * 2
    assert abs(full.weights_bytes - expected) <= 0.05 * expected
    assert abs(full.kv_bytes_per_token - 36 * measured_kv_per_token(model, 4)) <= 0.05 * full.kv_bytes_per_token


def test_8b_parameter_count_and_kv():
    config = ModelConfig.from_dict(QWEN3_8B)
    report = fit_report(config, {"cuda:0": 80 * GiB}, dtype=torch.bfloat16)
    hidden, inter, heads, kv, head_dim, vocab = 4096, 12288, 32, 8, 128, 151936
    layer = hidden * heads * head_dim * 2 + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden + 2 * head_dim
    assert report.parameters == 36 * layer + 2 * vocab * hidden + hidden  # untied embeddings: 8.19 B
    assert report.weights_bytes == 2 * report.parameters
    assert report.kv_bytes_per_token == kv_bytes_per_token(config, torch.bfloat16) == 36 * 2 * 8 * 128 * 2
    assert report.recommended.name == "1 GPU"


def test_8b_choices_on_simulated_gpus():
    config = ModelConfig.from_dict(QWEN3_8B)
    # 16 GiB is less than the 15.3 GiB of bfloat16 weights plus headroom: one GPU cannot, two can, int8 can.
    one = fit_report(config, parse_devices("0=16GiB,cpu=64GiB"), dtype=torch.bfloat16, context=4096)
    by_name = {o.name: o for o in one.options}
    assert not by_name["1 GPU"].fits
    assert one.recommended.quantization == "int8"
    two = fit_report(config, parse_devices("0=16GiB,1=16GiB,cpu=64GiB"), dtype=torch.bfloat16, context=4096)
    assert two.recommended.name == "2 GPUs" and two.recommended.device_map == '"auto"'
    # The numbers are consistent: what the largest batch needs fits in what the weights leave free.
    best = two.recommended
    room = sum(v * 0.95 for k, v in two.devices.items() if k != "cpu") - best.weights_bytes
    per_token = two.kv_bytes_per_token + two.activation_bytes_per_token
    assert best.max_batch * 4096 * per_token <= room < (best.max_batch + 1) * 4096 * per_token + config.vocab_size * 8
    # More batch -> shorter longest context; quantizing -> larger batches.
    wide = fit_report(config, parse_devices("0=16GiB,1=16GiB"), dtype=torch.bfloat16, batch=8)
    assert {o.name: o for o in wide.options}["2 GPUs"].max_context < best.max_context
    assert {o.name: o for o in two.options}["2 GPUs, nf4"].max_batch > best.max_batch


def test_fit_cli_prints_json_and_text(tmp_path, capsys):
    from gpuformers.cli import main

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    assert main(["fit", str(tmp_path), "--max-memory", "0=8GiB,cpu=32GiB", "--context", "8192", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["name"] == "1 GPU" and data["dtype"] == "bfloat16"
    assert data["kv_bytes_per_token"] == 28 * 2 * 8 * 128 * 2
    assert main(["fit", str(tmp_path), "--max-memory", "cpu=32GiB"]) == 0
    text = capsys.readouterr().out
    assert "weights            1.11 GiB" in text and 'device_map="cpu"' in text
    with pytest.raises(ValueError, match='entry "0:8GiB" is not DEVICE=SIZE'):
        parse_devices("0:8GiB")


def test_weight_bytes_counts_tied_embeddings_once():
    config = ModelConfig.from_dict(dict(QWEN3_0_6B, num_hidden_layers=1))
    with torch.device("meta"), skip_init():
        model = model_class_for(config)(config)
    untied = dict(QWEN3_0_6B, num_hidden_layers=1, tie_word_embeddings=False)
    with torch.device("meta"), skip_init():
        other = model_class_for(ModelConfig.from_dict(untied))(ModelConfig.from_dict(untied))
    assert weight_bytes(other, torch.bfloat16) - weight_bytes(model, torch.bfloat16) == 151936 * 1024 * 2


def test_one_gpu_option_uses_the_gpu_with_room_not_cuda_0():
    # 8 GPUs, cuda:0 and cuda:1 busy with another job: before, "1 GPU" measured cuda:0 only and said no
    config = ModelConfig.from_dict(QWEN3_8B)
    devices = parse_devices("0=2GiB,1=3GiB," + ",".join(f"{i}=79GiB" for i in range(2, 8)) + ",cpu=64GiB")
    devices["cuda:5"] = 80 * GiB
    report = fit_report(config, devices, dtype=torch.bfloat16, context=4096)
    assert report.recommended.name == "1 GPU" and report.recommended.device_map == '"cuda:5"'


def _cache_holding(cache, repo: str, files: dict) -> None:
    """An HF cache (HF_HUB_CACHE) holding `files` of `repo` at main, laid out as `hf download` writes it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    (root / "snapshots" / commit).mkdir(parents=True)
    for name, text in files.items():
        (root / "snapshots" / commit / name).write_text(text)


def test_fit_offline_says_config_json_is_all_it_needs_and_how_to_get_it(tmp_path, monkeypatch, capsys):
    from gpuformers.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "cache"))
    assert main(["fit", "acme/tiny-qwen3"]) == 2
    error = capsys.readouterr().err
    assert "is not in the local HF cache" in error and "offline mode (HF_HUB_OFFLINE=1) forbids a download." in error
    assert "reads only the model's config.json" in error and "`hf download acme/tiny-qwen3 config.json`" in error
    assert "stops a download" not in error and "local_files_only" not in error  # a sentence, in the CLI's words
    # Doing what it says (config.json alone in the cache, no weights) is enough, still offline
    _cache_holding(tmp_path / "cache", "acme/tiny-qwen3", {"config.json": json.dumps(QWEN3_0_6B)})
    assert main(["fit", "acme/tiny-qwen3", "--max-memory", "cpu=32GiB"]) == 0
    assert "weights            1.11 GiB" in capsys.readouterr().out


def test_fit_reads_a_gguf_file_as_from_pretrained_loads_it(tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    from tests.test_gguf import write_tiny_llama

    from gpuformers.cli import main

    write_tiny_llama(tmp_path / "m.gguf", types=(gguf.GGMLQuantizationType.Q8_0,), tied=False)
    assert main(["fit", str(tmp_path / "m.gguf"), "--max-memory", "cpu=8GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", progress=False)
    assert data["dtype"] == "float32" == str(model.dtype).removeprefix("torch.")  # dequantized as loaded
    assert data["weights_bytes"] == loaded_bytes(model) and data["gguf_file"] == "m.gguf"
    assert data["kv_bytes_per_token"] == measured_kv_per_token(model)
    # On two GPUs a GGUF file is offered one of them, never a map over both or an offload it cannot load
    assert main(["fit", str(tmp_path / "m.gguf"), "--max-memory", "0=1GiB,1=1GiB,cpu=8GiB", "--json"]) == 0
    options = json.loads(capsys.readouterr().out)["options"]
    assert [o["device_map"] for o in options if o["fits"]] == ['"cuda:0"'] * 3  # as it is, int8, nf4
    assert all("a GGUF file loads onto one device" in o["note"] for o in options if not o["fits"])
    assert main(["fit", str(tmp_path / "m.gguf"), "--max-memory", "0=1GiB,1=1GiB,cpu=8GiB"]) == 0
    text = capsys.readouterr().out
    assert "Use: from_pretrained(..., gguf_file='m.gguf', dtype='float32', device_map=\"cuda:0\")" in text
    assert f" or: gpuformers chat --model {tmp_path / 'm.gguf'} --device cuda:0 --dtype float32" in text


def test_fit_on_a_folder_holding_only_a_gguf_file_names_the_file(tmp_path, capsys):
    from gpuformers.cli import main

    (tmp_path / "model.Q8_0.gguf").write_bytes(b"GGUF")
    assert main(["fit", str(tmp_path)]) == 2
    assert f"pass the GGUF file itself, e.g. `gpuformers fit {tmp_path / 'model.Q8_0.gguf'}`" in capsys.readouterr().err


def test_a_gguf_file_is_quantized_after_loading_so_its_whole_weights_must_fit_first():
    config = ModelConfig.from_dict(QWEN3_0_6B)  # 1.11 GiB in bfloat16, about 0.75 GiB in int8
    gpu = {"cuda:0": int(1.6 * GiB)}  # 1.09 GiB usable
    safetensors = {o.name: o for o in fit_report(config, gpu, dtype=torch.bfloat16).options}
    assert not safetensors["1 GPU"].fits and safetensors["1 GPU, int8"].fits  # quantized tensor by tensor
    gguf = {o.name: o for o in fit_report(config, gpu, dtype=torch.bfloat16, gguf_file="q.gguf").options}
    assert not gguf["1 GPU"].fits and not gguf["1 GPU, int8"].fits
    assert "a GGUF file is quantized after loading: its 1.11 GiB must fit first" == gguf["1 GPU, int8"].note
    two = {o.name for o in fit_report(config, {**gpu, "cuda:1": gpu["cuda:0"]}, dtype=torch.bfloat16,
                                      gguf_file="q.gguf").options}
    assert two == {"1 GPU", "1 GPU, int8", "1 GPU, nf4", "GPUs + CPU offload"}  # no map over both GPUs
