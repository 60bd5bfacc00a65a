"""use_kernels=True end to end: KernelConfig checks, kernelize per mode, train()/eval() re-applying kernels, the
switches that keep the torch layers, and a tiny model giving the same logits, loss and gradients with kernels."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.kernels.cases import CUDA

import gpuformers.kernels.mapping as mapping  # noqa: E402
from gpuformers.kernels.mapping import KernelConfig, Mode, kernelize, unkernelize  # noqa: E402
from gpuformers.models.auto import AutoConfig, AutoModelForCausalLM  # noqa: E402

pytestmark = pytest.mark.skipif(CUDA, reason="CPU interpreter tests; the GPU runs the model check in bench_kernels")

TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-kernels")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **TINY), dtype="float32")
    with torch.no_grad():  # norms start at 1: perturb them so a kernel that ignored the weight would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


def _load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, progress=False, **kwargs)


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 17))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    return ids, mask


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(mapping, "_WARNED", set())


def test_inference_logits_match_and_kernels_run(qwen3_dir, monkeypatch):
    import gpuformers.kernels.rotary as rotary

    calls = []
    original = rotary.apply_rotary_inplace
    monkeypatch.setattr(rotary, "apply_rotary_inplace", lambda *a, **k: calls.append(1) or original(*a, **k))
    ref, fast = _load(qwen3_dir), _load(qwen3_dir, use_kernels=True)
    norm = fast.model.layers[0].self_attn.q_norm
    assert norm.forward.__func__ is mapping._rms_norm_forward and norm._kernel_mode == Mode.INFERENCE
    assert fast.model.layers[0].mlp.forward.__func__ is mapping._swiglu_mlp_forward
    ids, mask = _batch()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = fast(ids, attention_mask=mask).logits
    assert len(calls) == TINY["num_hidden_layers"]  # the rotary kernel ran in every layer
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-4)


def test_fused_residual_add_rms_norm_runs_in_every_layer(qwen3_dir, monkeypatch):
    calls = []
    original = mapping._add_rms_norm
    monkeypatch.setattr(mapping, "_add_rms_norm", lambda *a, **k: calls.append(1) or original(*a, **k))
    ref, fast = _load(qwen3_dir), _load(qwen3_dir, use_kernels=True)
    assert fast._kernel_state.functions["AddRMSNorm"] is not None
    ids, mask = _batch()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = fast(ids, attention_mask=mask).logits
    assert len(calls) == TINY["num_hidden_layers"]  # the fused kernel ran once per decoder layer
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-4)


def test_triton_attention_backend_in_a_model(qwen3_dir):
    ref, fast = _load(qwen3_dir), _load(qwen3_dir, attn_implementation="triton", use_kernels=True)
    ids, mask = _batch()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = fast(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-4)


def test_training_loss_and_gradients_match(qwen3_dir, monkeypatch):
    import gpuformers.kernels.fused_linear_cross_entropy as loss_kernels

    calls = []
    original = loss_kernels.linear_causal_lm_loss_triton
    monkeypatch.setattr(loss_kernels, "linear_causal_lm_loss_triton",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    ref, fast = _load(qwen3_dir).train(), _load(qwen3_dir, attn_implementation="triton", use_kernels=True).train()
    assert fast.model.norm._kernel_mode == Mode.TRAINING
    ids, _ = _batch()
    labels = ids.clone()
    labels[:, :3] = -100
    losses, outputs = [], []
    for model in (ref, fast):
        out = model(ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss.detach())
        outputs.append(out)
    assert calls == [1]  # the LM head and the loss went through the fused Triton linear + cross-entropy
    assert outputs[0].logits is not None and outputs[1].logits is None  # the full logits never existed
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    ref_grads = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_fused_loss_only_in_training(qwen3_dir, monkeypatch):
    """In eval mode a kernelized model still returns logits with its loss (evaluation and metrics need them)."""
    import gpuformers.kernels.fused_linear_cross_entropy as loss_kernels

    calls = []
    original = loss_kernels.causal_lm_loss_triton
    monkeypatch.setattr(loss_kernels, "causal_lm_loss_triton", lambda *a, **k: calls.append(1) or original(*a, **k))
    ref, fast = _load(qwen3_dir), _load(qwen3_dir, use_kernels=True)
    ids, _ = _batch()
    with torch.no_grad():
        want, got = ref(ids, labels=ids), fast(ids, labels=ids)
    assert calls == [1] and got.logits is not None  # the Triton cross-entropy on the logits
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)


def test_train_and_eval_swap_the_kernels(qwen3_dir):
    import gpuformers.kernels.rotary as rotary

    model = _load(qwen3_dir, use_kernels=True)
    state = model._kernel_state
    assert state.functions["rotary_pos_emb"] is rotary.apply_rotary_inplace
    model.train()
    assert model.model.norm._kernel_mode == Mode.TRAINING
    assert state.functions["rotary_pos_emb"] is rotary.apply_rotary
    model.eval()
    assert model.model.norm._kernel_mode == Mode.INFERENCE
    assert state.functions["rotary_pos_emb"] is rotary.apply_rotary_inplace
    unkernelize(model.train())
    assert "forward" not in model.model.norm.__dict__ and not hasattr(model, "_kernel_state")


def test_kernel_config_chooses_per_layer(qwen3_dir):
    config = KernelConfig(kernel_mapping={"RMSNorm": {"cuda": "torch"}, "SwiGLUMLP": "triton"})
    model = _load(qwen3_dir, use_kernels=True, kernel_config=config)
    assert "forward" not in model.model.norm.__dict__  # RMSNorm kept torch
    assert model.model.layers[1].mlp.forward.__func__ is mapping._swiglu_mlp_forward


def test_kernel_config_errors_list_the_valid_choices():
    with pytest.raises(ValueError, match="layer 'LayerNorm', which has no built-in kernel \\(those that have: AddRMSNorm, ForCausalLMLoss, LinearForCausalLMLoss, RMSNorm, SiLU.*name a Hub kernel"):
        KernelConfig(kernel_mapping={"LayerNorm": "triton"})
    with pytest.raises(ValueError, match="device 'gpu', which is not one of: cuda, cpu, rocm"):
        KernelConfig(kernel_mapping={"RMSNorm": {"gpu": "triton"}})
    with pytest.raises(ValueError, match="is 'liger', which is not one of: triton, torch"):
        KernelConfig(kernel_mapping={"RMSNorm": {"cuda": "liger"}})
    with pytest.raises(ValueError, match="mode 'eval' is not one of: inference, training"):
        KernelConfig(kernel_mapping={"RMSNorm": {"cuda": {"eval": "triton"}}})
    # transformers' other device keys are accepted (and never apply on NVIDIA GPUs or the CPU)
    assert KernelConfig(kernel_mapping={"RMSNorm": {"rocm": "triton"}}).kernel_for("RMSNorm", "cuda") is not None


def test_bad_mode_and_lonely_kernel_config(qwen3_dir):
    model = _load(qwen3_dir)
    with pytest.raises(ValueError, match="exactly one of Mode.INFERENCE and Mode.TRAINING"):
        kernelize(model, mode=Mode.INFERENCE | Mode.TRAINING)
    with pytest.raises(ValueError, match="kernel_config is only used with use_kernels=True"):
        _load(qwen3_dir, kernel_config=KernelConfig())


def test_silu_modules_are_kernel_layers():
    layer = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.SiLU())
    kernelize(layer, mode=Mode.TRAINING)
    x = torch.randn(3, 4, requires_grad=True)
    assert layer[1].forward.__func__ is mapping._silu_forward
    out = layer(x)
    torch.testing.assert_close(out, torch.nn.functional.silu(layer[0](x)))


@pytest.mark.parametrize("switch", ["disable-env", "no-interpreter"])
def test_switches_keep_the_torch_layers_and_say_so_once(qwen3_dir, monkeypatch, caplog, fresh_warnings, switch):
    mode = Mode.INFERENCE
    if switch == "disable-env":
        monkeypatch.setenv(mapping.DISABLE_ENV, "1")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = _load(qwen3_dir)
    with caplog.at_level(logging.WARNING, logger="gpuformers.kernels.mapping"):
        kernelize(model, mode=mode)
        kernelize(model, mode=mode)
    assert "forward" not in model.model.norm.__dict__
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    expected = {"disable-env": mapping.DISABLE_ENV, "no-interpreter": "TRITON_INTERPRET=1 is not set"}[switch]
    assert expected in caplog.records[0].getMessage()


@pytest.mark.parametrize("mode", [Mode.INFERENCE, Mode.TRAINING], ids=["inference", "training"])
def test_torch_compile_mode_swaps_in_the_kernels_silently(qwen3_dir, caplog, fresh_warnings, mode):
    # The kernels are torch.library ops (tests/kernels/test_compile.py compiles models with them).
    model = _load(qwen3_dir)
    with caplog.at_level(logging.WARNING, logger="gpuformers.kernels.mapping"):
        kernelize(model, mode=mode | Mode.TORCH_COMPILE)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert model.model.norm.forward.__func__ is mapping._rms_norm_forward
    assert model.model.norm._kernel_mode == mode | Mode.TORCH_COMPILE
    assert set(model._kernel_state.functions) >= {"rotary_pos_emb", "AddRMSNorm", "ForCausalLMLoss"}


def test_flash_attention_2_on_cpu_fails_at_load(qwen3_dir):
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' needs an NVIDIA GPU"):
        _load(qwen3_dir, attn_implementation="flash_attention_2")


def test_greedy_generation_with_kernels_and_triton_attention(qwen3_dir):
    # Prefill then decode steps of one token against a growing KV cache (q_len 1, bottom-right causal).
    ref, fast = _load(qwen3_dir), _load(qwen3_dir, attn_implementation="triton", use_kernels=True)
    ids, mask = _batch()
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_rotary_kernel_runs_in_decode_steps_with_torch_norms(tmp_path, monkeypatch):
    # Qwen3's one-token fast path (q and k heads normalised and rotated together) must leave the rotary kernel in
    # charge when it is on
    import gpuformers.kernels.rotary as rotary

    tiny = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **tiny), dtype="float32").save_pretrained(tmp_path)
    calls = []
    original = rotary.apply_rotary_inplace
    monkeypatch.setattr(rotary, "apply_rotary_inplace", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, progress=False)
    fast = AutoModelForCausalLM.from_pretrained(tmp_path, progress=False, use_kernels=True,
                                                kernel_config=KernelConfig({"RMSNorm": "torch", "SwiGLUMLP": "torch"}))
    ids = torch.randint(0, 96, (1, 6))
    want = ref.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    got = fast.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert torch.equal(got, want)
    assert len(calls) == 4 * tiny["num_hidden_layers"]  # prefill + 3 decode steps, every layer


def test_a_function_kernel_that_declines_a_call_leaves_it_to_the_torch_function(monkeypatch):
    from gpuformers.kernels import mapping, rotary

    @mapping.use_kernel_function("rotary_pos_emb")
    def torch_rotary(q, k, cos, sin, unsqueeze_dim=1):
        return "torch"

    monkeypatch.setattr(mapping, "_ACTIVE_DEPTH", 1)
    monkeypatch.setattr(mapping, "_functions_in_force", lambda: {"rotary_pos_emb": rotary.apply_rotary})
    q = k = torch.randn(1, 2, 3, 8)
    learned = torch.randn(1, 3, 8, requires_grad=True)  # tables that take a gradient: the kernel declines them
    assert rotary.apply_rotary(q, k, learned, learned) is NotImplemented
    assert torch_rotary(q, k, learned, learned) == "torch"
    monkeypatch.setattr(mapping, "_functions_in_force", lambda: {"rotary_pos_emb": lambda *a, **k: "kernel"})
    assert torch_rotary(q, k, learned, learned) == "kernel"
