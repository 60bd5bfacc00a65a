"""gpt-oss against transformers on tiny random checkpoints: logits (eager and sdpa, left padding, sliding and full
layers, YaRN and default rope, GQA and MHA, tied and untied), greedy tokens (dynamic and static cache), loss, the aux
loss and gradients with output_router_logits, saving, the engine, an MXFP4 checkpoint packed by hand from known
values, use_kernels (which must leave the clamped-SwiGLU experts alone) and what is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # use_kernels on the CPU runs the Triton interpreter (read when triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.models.parity import assert_engine_matches_generate, load

# hidden and intermediate are multiples of 32, as MXFP4 blocks need
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, sliding_window=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CASES = {
    "gqa-yarn-window": {},  # transformers' default rope (YaRN, truncate=False); layer 0 slides over 4 tokens
    "mha-tied-top1-default-rope": dict(num_key_value_heads=4, tie_word_embeddings=True, num_experts_per_tok=1,
                                       rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "full-then-sliding-top3": dict(layer_types=["full_attention", "sliding_attention"], num_experts_per_tok=3,
                                   swiglu_limit=3.0),
}


def _perturb(hf) -> None:
    """Random init leaves biases, sinks and norms at 0 / 1 and the experts' outputs small: perturb them so that a
    missing bias, sink or norm shows, and scale the experts so that the SwiGLU clamp at swiglu_limit is reached."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "bias", "sinks")):
                p.add_(torch.randn_like(p) * 0.5)
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.mul_(20)


def _checkpoint(folder, **overrides):
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**{**TINY, **overrides}),
                                                       dtype=torch.float32).eval()
    _perturb(hf)
    hf.save_pretrained(folder)
    return hf


def _batch(seq=12):
    ids = torch.randint(3, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding in the second row
    return ids, mask


def _load(folder, **kwargs):
    return load(folder, dtype=torch.float32, **kwargs)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: (folder := tmp_path_factory.mktemp(name), _checkpoint(folder, **overrides))
            for name, overrides in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_tokens_match_transformers(checkpoints, case):
    from gpuformers.models.gpt_oss import GptOssForCausalLM

    folder, hf = checkpoints[case]
    ids, mask = _batch()
    for attn in ("eager", "sdpa"):  # transformers' gpt-oss has eager only: both of ours must equal it
        ours = _load(folder, attn_implementation=attn)
        assert type(ours) is GptOssForCausalLM
        with torch.no_grad():
            theirs, mine = hf(ids, attention_mask=mask, labels=ids), ours(ids, attention_mask=mask, labels=ids)
        torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    for cache in (None, "static"):
        greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                      cache_implementation=cache)
        assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy)), cache


def test_clamp_sinks_and_router_bias_change_the_logits(checkpoints):
    """The tiny checkpoints exercise what differs from llama: without the clamp, the sinks or the router bias the
    logits move (so the parity above checks each of them)."""
    folder, hf = checkpoints["gqa-yarn-window"]
    ours = _load(folder)
    ids, mask = _batch()
    with torch.no_grad():
        reference = ours(ids, attention_mask=mask).logits
        for experts in (layer.mlp.experts for layer in ours.model.layers):
            experts.limit = 1e9
        assert (ours(ids, attention_mask=mask).logits - reference).abs().max() > 1e-3
        ours = _load(folder)
        for layer in ours.model.layers:
            layer.self_attn.sinks.zero_()
        assert (ours(ids, attention_mask=mask).logits - reference).abs().max() > 1e-3
        ours = _load(folder)
        for layer in ours.model.layers:
            layer.mlp.router.bias.zero_()
        assert (ours(ids, attention_mask=mask).logits - reference).abs().max() > 1e-3


def test_config_defaults_and_layer_types(checkpoints):
    from gpuformers.models.config import ModelConfig

    config = ModelConfig.from_file(checkpoints["gqa-yarn-window"][0] / "config.json")
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 4
    bare = ModelConfig.from_dict(dict(model_type="gpt_oss", num_hidden_layers=3))
    # transformers' GptOssConfig defaults where config.json is silent
    assert (bare.hidden_size, bare.head_dim, bare.num_key_value_heads, bare.sliding_window) == (2880, 64, 8, 128)
    assert bare.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert bare.qkv_bias and bare.o_bias and bare.rms_norm_eps == 1e-5
    assert bare.rope_parameters == {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
    assert (bare.num_local_experts, bare.num_experts_per_tok) == (128, 4)
    assert (bare.swiglu_alpha, bare.swiglu_limit) == (1.702, 7.0)
    with pytest.raises(ValueError, match="swiglu_limit is 0; it must be a positive number"):
        ModelConfig.from_dict(dict(model_type="gpt_oss", swiglu_limit=0))


def test_hub_config_is_read():
    """openai/gpt-oss-20b's config.json (transformers 4.55's spelling): rope_scaling and rope_theta, and the MXFP4
    quantization_config that makes the experts load from blocks and scales of the Hub's shapes."""
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.gpt_oss import GptOssForCausalLM

    hub = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_hidden_layers=2, num_local_experts=32,
               experts_per_token=4, initial_context_length=4096, rope_theta=150000, swiglu_limit=7.0,
               rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                             "original_max_position_embeddings": 4096, "truncate": False},
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                   "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    config = ModelConfig.from_dict(hub)
    assert config.rope_type == "yarn" and config.rope_theta == 150000 and not config.rope_parameters["truncate"]
    assert config.extra["quantization_config"]["quant_method"] == "mxfp4" and config.extra["mxfp4_experts"]
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in GptOssForCausalLM(config).state_dict().items()
                  if k.startswith("model.layers.0.mlp.experts.")}
    assert shapes == {
        "model.layers.0.mlp.experts.gate_up_proj_bias": ((32, 5760), torch.float32),
        "model.layers.0.mlp.experts.down_proj_bias": ((32, 2880), torch.float32),
        "model.layers.0.mlp.experts.gate_up_proj_blocks": ((32, 5760, 90, 16), torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_scales": ((32, 5760, 90), torch.uint8),
        "model.layers.0.mlp.experts.down_proj_blocks": ((32, 2880, 90, 16), torch.uint8),
        "model.layers.0.mlp.experts.down_proj_scales": ((32, 2880, 90), torch.uint8),
    }
    saved = config.to_dict()
    # a config whose experts are packed says so when saved; from_pretrained drops it once it dequantizes them
    assert saved["quantization_config"]["quant_method"] == "mxfp4"
    assert "mxfp4_experts" not in saved and saved["experts_per_token"] == 4


def test_aux_loss_router_logits_and_gradients_match_transformers(tmp_path):
    hf = _checkpoint(tmp_path, output_router_logits=True, router_aux_loss_coef=0.5)
    ours = _load(tmp_path)
    ids, mask = _batch()
    theirs, mine = hf(ids, attention_mask=mask, labels=ids), ours(ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(mine.aux_loss, theirs.aux_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    for ours_layer, hf_layer in zip(mine.router_logits, theirs.router_logits, strict=True):
        torch.testing.assert_close(ours_layer, hf_layer, atol=1e-5, rtol=0)
    mine.loss.backward(), theirs.loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_save_pretrained_loads_in_transformers(checkpoints, tmp_path):
    import transformers

    folder, hf = checkpoints["mha-tied-top1-default-rope"]
    _load(folder).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_experts" not in saved and "mlp_bias" not in saved
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reloaded.config.layer_types == hf.config.layer_types
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_engine_matches_generate(checkpoints, attn):
    # prompts past the window of 4, GQA decodes folded onto their kv heads by the paged backend
    model = _load(checkpoints["gqa-yarn-window"][0], attn_implementation=attn)
    assert_engine_matches_generate(model, prompts=[[5, 9, 23, 42, 17, 8], [7, 64, 100, 3, 8, 2, 77], [11]])


# --- MXFP4 (the Hub's layout) ---------------------------------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (experts, rows, cols) in 0..15 and exponents (experts, rows, cols / 32) -> (blocks, scales): two codes a
    byte, the even column in the low nibble; scales = exponent + 127."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks.reshape(*exponents.shape, 16), (exponents + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A checkpoint with the experts stored as the Hub stores them, built from known codes and exponents; returns
    (folder, transformers model holding the expected weights, {layer: {proj: expected (experts, in, out)}})."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("mxfp4")
    hf = _checkpoint(folder)
    state = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    expected = {}
    for i in range(TINY["num_hidden_layers"]):
        expected[i] = {}
        for proj in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{proj}"
            experts, fan_in, fan_out = state[key].shape
            codes = torch.randint(0, 16, (experts, fan_out, fan_in), generator=gen)
            exponents = torch.randint(-4, 1, (experts, fan_out, fan_in // 32), generator=gen)
            # the value of each code times its block's 2^exponent, transposed to the (experts, in, out) parameter
            weight = (E2M1[codes] * torch.exp2(exponents.float()).repeat_interleave(32, dim=-1)).transpose(1, 2)
            expected[i][proj] = weight
            blocks, scales = _pack_mxfp4(codes, exponents)
            del state[key]
            state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
            with torch.no_grad():
                hf.get_parameter(key).copy_(weight)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, hf, expected


def test_mxfp4_experts_dequantize_on_load(mxfp4_checkpoint, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from gpuformers.models.gpt_oss import dequantize_mxfp4

    folder, hf, expected = mxfp4_checkpoint
    ours = _load(folder)
    assert not ours.is_quantized and "mxfp4_experts" not in ours.config.extra
    for i, layer in enumerate(ours.model.layers):
        for proj, weight in expected[i].items():
            assert torch.equal(getattr(layer.mlp.experts, proj), weight), (i, proj)
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=0)
    # transformers' own dequantization of the same tensors agrees, in bfloat16 too
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    blocks, scales = (state[f"model.layers.0.mlp.experts.down_proj_{s}"] for s in ("blocks", "scales"))
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (experts, in, out)
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2), theirs)
    # loaded in bfloat16 the experts are bfloat16 (exact: E2M1 times a power of two fits)
    half = load(folder, dtype=torch.bfloat16)
    assert half.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(half.model.layers[1].mlp.experts.gate_up_proj, expected[1]["gate_up_proj"].bfloat16())
    # saved, it is an ordinary checkpoint: plain experts, no quantization_config
    ours.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    assert torch.equal(_load(tmp_path).model.layers[0].mlp.experts.down_proj, expected[0]["down_proj"])


def _expert_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if ".experts." in name)


def test_mxfp4_experts_kept_packed_match_transformers(mxfp4_checkpoint, tmp_path):
    """Mxfp4Config() keeps the experts as the checkpoint stores them (~4.25 bits a weight) and gives the logits and
    tokens of the dequantized model; saved, the checkpoint is MXFP4 again, and loads back (dequantized by default on
    the CPU) to the same weights."""
    from safetensors.torch import load_file

    from gpuformers.quantization.mxfp4 import Mxfp4Config

    folder, hf, expected = mxfp4_checkpoint
    packed = _load(folder, quantization_config=Mxfp4Config())
    plain = _load(folder, quantization_config=Mxfp4Config(dequantize=True))
    experts = packed.model.layers[0].mlp.experts
    assert experts.packed and not hasattr(experts, "gate_up_proj") and packed.is_quantized
    assert isinstance(packed.quantization_config, Mxfp4Config) and not plain.is_quantized
    assert _expert_bytes(packed) < _expert_bytes(plain) / 6  # uint8 codes and scales against float32 weights
    ids, mask = _batch()
    with torch.no_grad():
        logits = packed(ids, attention_mask=mask).logits
        torch.testing.assert_close(logits, hf(ids, attention_mask=mask).logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(logits, plain(ids, attention_mask=mask).logits, atol=1e-4, rtol=0)
    prompt = ids[:1]
    assert (packed.generate(prompt, max_new_tokens=8, do_sample=False).tolist()
            == hf.generate(prompt, max_new_tokens=8, do_sample=False).tolist())
    assert_engine_matches_generate(packed, prompts=[[5, 9, 23, 42, 17, 8], [11]])

    packed.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    saved, stored = load_file(tmp_path / "model.safetensors"), load_file(folder / "model.safetensors")
    for key in ("model.layers.1.mlp.experts.down_proj_blocks", "model.layers.1.mlp.experts.down_proj_scales"):
        assert torch.equal(saved[key], stored[key])
    reloaded = _load(tmp_path)
    assert not reloaded.is_quantized
    assert torch.equal(reloaded.model.layers[1].mlp.experts.down_proj, expected[1]["down_proj"])
    import transformers  # reads it as it reads the Hub's MXFP4 checkpoints

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids, attention_mask=mask).logits, logits, atol=1e-4, rtol=0)


def test_mxfp4_packed_model_dequantizes(mxfp4_checkpoint):
    """model.dequantize() turns packed experts into the parameters the checkpoint's values give, exactly."""
    from gpuformers.quantization.mxfp4 import Mxfp4Config

    folder, _, expected = mxfp4_checkpoint
    model = _load(folder, quantization_config=Mxfp4Config())
    ids, mask = _batch()
    with torch.no_grad():
        packed = model(ids, attention_mask=mask).logits
        model.dequantize()
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, packed, atol=1e-4, rtol=0)
    assert not model.is_quantized and "quantization_config" not in model.config.to_dict()
    for i, layer in enumerate(model.model.layers):
        assert not layer.mlp.experts.packed
        assert torch.equal(layer.mlp.experts.gate_up_proj, expected[i]["gate_up_proj"])


def test_mxfp4_packed_experts_train_around_them(mxfp4_checkpoint):
    """Packed experts take no gradient, but the input's gradient flows through them (dequantized for the call): the
    attention layers before them train as in the dequantized model."""
    from gpuformers.quantization.mxfp4 import Mxfp4Config

    folder, _, _ = mxfp4_checkpoint
    grads = []
    for config in (Mxfp4Config(), Mxfp4Config(dequantize=True)):
        model = _load(folder, quantization_config=config)
        ids, mask = _batch()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_mxfp4_experts_run_the_triton_kernel(mxfp4_checkpoint, monkeypatch):
    """With the kernel allowed on the CPU (the interpreter), packed experts run it and give the torch path's logits."""
    pytest.importorskip("triton")
    from gpuformers.kernels import mxfp4_matmul
    from gpuformers.kernels.checks import interpreter_on
    from gpuformers.quantization import mxfp4
    from gpuformers.quantization.mxfp4 import Mxfp4Config

    if not interpreter_on():
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    folder, _, _ = mxfp4_checkpoint
    model = _load(folder, quantization_config=Mxfp4Config())
    ids, mask = _batch(seq=5)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        calls = []
        forward = mxfp4_matmul.mxfp4_matmul_forward
        monkeypatch.setattr(mxfp4_matmul, "mxfp4_matmul_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
        monkeypatch.setattr(mxfp4, "TRITON_ON_CPU", True)
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, atol=1e-4, rtol=0)
    assert calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_mxfp4_experts_stay_packed_by_default(mxfp4_checkpoint):
    """On a CUDA GPU with triton an MXFP4 checkpoint keeps its experts packed with no argument, runs the Triton
    kernel, and gives the dequantized model's logits in bfloat16."""
    from gpuformers.quantization.mxfp4 import Mxfp4Config

    folder, _, _ = mxfp4_checkpoint
    packed = load(folder, dtype=torch.bfloat16, device_map="cuda")
    plain = load(folder, dtype=torch.bfloat16, device_map="cuda", quantization_config=Mxfp4Config(dequantize=True))
    assert packed.model.layers[0].mlp.experts.packed and isinstance(packed.quantization_config, Mxfp4Config)
    ids, mask = (t.cuda() for t in _batch())
    with torch.no_grad():
        expected = plain(ids, attention_mask=mask).logits.float()
        torch.testing.assert_close(packed(ids, attention_mask=mask).logits.float(), expected, rtol=0,
                                   atol=3e-2 * expected.abs().max().item())


def test_mxfp4_refusals(mxfp4_checkpoint):
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.gpt_oss import dequantize_mxfp4

    folder, _, _ = mxfp4_checkpoint
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("model.layers.*.mlp.experts")
    with pytest.raises(NotImplementedError, match="experts are partly unquantized"):
        ModelConfig.from_dict(config)
    with pytest.raises(ValueError, match=r"blocks \[2, 15\] and scales \[2\] do not match"):
        dequantize_mxfp4(torch.zeros(2, 15, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8), torch.float32)


def test_mxfp4_config_on_other_checkpoints(checkpoints, mxfp4_checkpoint, caplog):
    from gpuformers.quantization.config import WeightOnlyConfig
    from gpuformers.quantization.mxfp4 import Mxfp4Config

    with pytest.raises(NotImplementedError, match="quantizing a model to MXFP4 while loading is not supported"):
        _load(checkpoints["gqa-yarn-window"][0], quantization_config=Mxfp4Config())
    # another method on an MXFP4 checkpoint: the checkpoint's wins, as in transformers, and the model is as without
    model = _load(mxfp4_checkpoint[0], quantization_config=WeightOnlyConfig(bits=8))
    assert "WeightOnlyConfig passed to from_pretrained is ignored" in caplog.text
    assert not model.is_quantized and not model.model.layers[0].mlp.experts.packed


# --- kernels and refusals ---------------------------------------------------------------------------------------

def test_use_kernels_leaves_the_experts_alone_and_matches(checkpoints):
    """The SwiGLU and fused-MoE kernels compute silu(gate) * up: gpt-oss's router and experts keep their forward;
    the norms (llama's) take the RMSNorm kernel and the logits stay transformers'."""
    from gpuformers.kernels import mapping

    folder, hf = checkpoints["gqa-yarn-window"]
    fast = _load(folder, use_kernels=True)
    layer = fast.model.layers[0]
    assert layer.input_layernorm.forward.__func__ is mapping._rms_norm_forward
    assert not [name for name, m in layer.mlp.named_modules() if "forward" in vars(m)]
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["flash_attention_2", "flex_attention", "triton"])
def test_backends_that_drop_the_sinks_are_refused(checkpoints, name):
    model = _load(checkpoints["gqa-yarn-window"][0])
    with pytest.raises(NotImplementedError, match=f"attn_implementation='{name}' does not apply gpt-oss's attention "
                                                  f"sinks"):
        model.set_attn_implementation(name)


def test_tensor_parallel_auto_is_refused(checkpoints):
    from gpuformers.tensor_parallel import _resolve_plan

    model = _load(checkpoints["gqa-yarn-window"][0])
    with pytest.raises(NotImplementedError, match='tp_plan="auto" for GptOssForCausalLM is not supported'):
        _resolve_plan(model, "auto")
