"""QLoRA: LoRA adapters over quantized linear layers (bitsandbytes 4-bit / 8-bit, WeightOnlyLinear) against peft on
transformers' bitsandbytes load of the same checkpoint: the same logits, loss and LoRA gradients (nf4, float32 and
bfloat16 compute), prepare_model_for_kbit_training as peft's, the Trainer moving only the adapters, adapter files
that load on either side, merging by re-quantizing, unload, and the errors users meet.

The checkpoint's layer sizes are multiples of 64 (bitsandbytes' block) so that its CPU kernels run as on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpuformers import AutoModelForCausalLM, BitsAndBytesConfig, WeightOnlyConfig
from gpuformers.lora import (
    LoraConfig,
    LoraLinear,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    prepare_model_for_kbit_training,
    set_peft_model_state_dict,
)
from tests.fixtures.checkpoints import make_checkpoint

ATOL = 1e-5
NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
# init_lora_weights=False: B random too, so that every adapter changes the outputs
LORA = dict(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
IDS = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny llama with biases (the bnb layers keep them in full precision) and 64-multiple layer sizes."""
    folder = tmp_path_factory.mktemp("qlora-llama")
    make_checkpoint(folder, "llama", hidden_size=128, intermediate_size=256, head_dim=32, attention_bias=True)
    return folder


@pytest.fixture
def bnb():
    return pytest.importorskip("bitsandbytes")


def _ours(folder, settings=NF4, dtype=torch.float32, device="cpu", **compute):
    config = BitsAndBytesConfig(**settings, **compute) if "load_in_4bit" in settings or "load_in_8bit" in settings \
        else WeightOnlyConfig(**settings)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=dtype, device_map=device,
                                                progress=False)


def _theirs(folder, settings=NF4, dtype=torch.float32, device="cpu", **compute):
    import transformers

    config = transformers.BitsAndBytesConfig(**settings, **compute)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=dtype,
                                                             device_map=device)


def _pair(folder, dtype=torch.float32, prepare=False, device="cpu", **compute):
    """(ours, peft's) over 4-bit bases, peft's random adapter copied into ours through peft's saved keys."""
    peft = pytest.importorskip("peft")
    hf = _theirs(folder, dtype=dtype, device=device, **compute)
    gf = _ours(folder, dtype=dtype, device=device, **compute)
    if prepare:
        hf, gf = peft.prepare_model_for_kbit_training(hf), prepare_model_for_kbit_training(gf)
    theirs = peft.get_peft_model(hf, peft.LoraConfig(**LORA))
    ours = get_peft_model(gf, LoraConfig(**LORA))
    set_peft_model_state_dict(ours, peft.get_peft_model_state_dict(theirs))
    return ours, theirs


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _lora_grads(model) -> dict[str, torch.Tensor]:
    # peft's parameter names carry the adapter name (lora_A.default.weight); its saved keys and ours do not
    return {n.replace(".default.", "."): p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype, prepare", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["float32", "bfloat16", "bfloat16-prepared"])
def test_logits_loss_and_lora_grads_match_peft(bnb, folder, dtype, prepare):
    ours, theirs = _pair(folder, dtype, prepare, bnb_4bit_compute_dtype=dtype)
    q_proj = ours.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, LoraLinear) and type(q_proj.base_layer).__name__ == "BnbLinear4bit"
    assert q_proj.lora_A.weight.dtype == torch.float32  # peft's: float32 adapters over a bf16 compute dtype too
    assert ours.peft_config["default"].target_modules == sorted(theirs.peft_config["default"].target_modules)
    assert ours.get_nb_trainable_parameters() == theirs.get_nb_trainable_parameters()  # 4-bit values, not bytes

    # Training mode first: an eval-mode forward may repack the 4-bit weights for bitsandbytes' AVX512-BF16 CPU
    # kernel, which rounds them a little differently (see test_training_after_evaluation_...).
    ours.train(), theirs.train()
    got, want = ours(input_ids=IDS, labels=IDS), theirs(input_ids=IDS, labels=IDS)
    base = _ours(folder, dtype=dtype, bnb_4bit_compute_dtype=dtype).train()(input_ids=IDS).logits
    assert (got.logits - base).abs().max() > 1e-2  # the adapters are in the forward
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.loss, want.loss, atol=ATOL, rtol=0)
    got.loss.backward(), want.loss.backward()
    ours_grads, peft_grads = _lora_grads(ours), _lora_grads(theirs)
    assert ours_grads.keys() == peft_grads.keys() and len(ours_grads) == 2 * 14
    for name, grad in ours_grads.items():
        assert grad is not None and grad.abs().max() > 0, name
        torch.testing.assert_close(grad, peft_grads[name], atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_logits_loss_and_lora_grads_match_peft(bnb, folder):
    ours, theirs = _pair(folder, torch.bfloat16, prepare=True, device="cuda", bnb_4bit_compute_dtype=torch.bfloat16)
    assert ours.get_base_model().model.layers[0].self_attn.q_proj.lora_A.weight.device.type == "cuda"
    ids = IDS.cuda()
    ours.train(), theirs.train()
    got, want = ours(input_ids=ids, labels=ids), theirs(input_ids=ids, labels=ids)
    # the same kernels on the same weights; bfloat16 tolerances in case the GPU picks other reduction orders
    torch.testing.assert_close(got.logits, want.logits)
    got.loss.backward(), want.loss.backward()
    ours_grads, peft_grads = _lora_grads(ours), _lora_grads(theirs)
    assert ours_grads.keys() == peft_grads.keys()
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, peft_grads[name], atol=1e-4, rtol=1e-2)


def test_training_after_evaluation_gives_every_adapter_its_gradient(bnb, folder):
    """On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight at an eval-mode forward for a kernel without
    backward, and keeps it for training: the adapters below such a layer would get no gradient (and a layer with a
    bias fails). Ours read the weight back first: the gradients are those of a model never evaluated."""
    fresh, evaluated = (get_peft_model(_ours(folder), LoraConfig(**LORA)) for _ in range(2))
    set_peft_model_state_dict(evaluated, get_peft_model_state_dict(fresh))
    _logits(evaluated.eval())  # the eval forward that repacks (where the CPU has the instructions)
    for model in (fresh, evaluated):
        model.train()(input_ids=IDS, labels=IDS).loss.backward()
    want = _lora_grads(fresh)
    for name, grad in _lora_grads(evaluated).items():
        assert grad is not None and grad.abs().max() > 0, name
        torch.testing.assert_close(grad, want[name], atol=1e-3, rtol=5e-2)


def test_train_on_what_generate_wrote(bnb, folder):
    """The loop of RL fine-tuning: generate (in inference mode, repacking the 4-bit weights), then train the
    adapters on the generated ids; every adapter gets a gradient."""
    model = get_peft_model(_ours(folder), LoraConfig(**LORA))
    out = model.generate(IDS, max_new_tokens=6, eos_token_id=None)
    model.train()(input_ids=out, labels=out).loss.backward()
    for name, grad in _lora_grads(model).items():
        assert grad is not None and grad.abs().max() > 0, name


def test_prepare_model_for_kbit_training_does_what_peft_does(bnb, folder):
    peft = pytest.importorskip("peft")
    hf = peft.prepare_model_for_kbit_training(_theirs(folder, dtype=torch.bfloat16,
                                                      bnb_4bit_compute_dtype=torch.bfloat16))
    gf = prepare_model_for_kbit_training(_ours(folder, dtype=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16))
    state = lambda m: {n: (p.dtype, p.requires_grad) for n, p in m.named_parameters()}  # noqa: E731
    assert state(gf) == state(hf)
    assert state(gf)["model.norm.weight"] == (torch.float32, False)  # upcast, frozen
    assert state(gf)["model.layers.0.self_attn.q_proj.weight"] == (torch.uint8, False)  # 4-bit storage kept
    assert all(getattr(layer, "_checkpointed", False) for layer in gf.model.layers)
    assert gf.get_input_embeddings()(IDS).requires_grad  # what reentrant checkpointing needs to reach the adapters

    # reentrant checkpointing: the adapters inside every checkpointed layer get their gradients
    reentrant = prepare_model_for_kbit_training(_ours(folder), gradient_checkpointing_kwargs={"use_reentrant": True})
    model = get_peft_model(reentrant, LoraConfig(**LORA)).train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert all(g is not None and g.abs().max() > 0 for g in _lora_grads(model).values())

    # A weight-only model stays in its dtype (peft leaves its non-bitsandbytes methods so): its layers compute there.
    wo = prepare_model_for_kbit_training(_ours(folder, dict(bits=8), dtype=torch.bfloat16),
                                         gradient_checkpointing_kwargs={"use_reentrant": False})
    assert {p.dtype for p in wo.parameters()} == {torch.bfloat16}
    assert not wo.get_input_embeddings()(IDS).requires_grad  # use_reentrant=False needs no input grads


def test_trainer_moves_only_the_adapters_and_keeps_the_quantized_base(bnb, folder, tmp_path):
    from gpuformers import Trainer
    from tests.training.helpers import make_rows, tiny_args

    base = prepare_model_for_kbit_training(_ours(folder, dtype=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16))
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    frozen = {k: v.clone() for k, v in base.state_dict().items() if "lora_" not in k}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=tiny_args(tmp_path, max_steps=8, learning_rate=2e-2),
                      train_dataset=make_rows(4))  # one batch, seen 8 times
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 8 and sum(losses[-2:]) < 0.9 * sum(losses[:2])
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in changed)
    after = {k: v for k, v in base.state_dict().items() if "lora_" not in k}
    assert after.keys() == frozen.keys()
    for key, value in frozen.items():  # the 4-bit bytes and their statistics, bit for bit
        assert torch.equal(after[key], value), key


def test_adapter_files_load_on_either_side(bnb, folder, tmp_path):
    peft = pytest.importorskip("peft")
    ours, theirs = _pair(folder)
    ours.eval(), theirs.eval()
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")

    # ours -> peft on transformers' 4-bit model, peft's -> ours on our 4-bit model
    peft_loaded = peft.PeftModel.from_pretrained(_theirs(folder), tmp_path / "ours")
    ours_loaded = PeftModel.from_pretrained(_ours(folder), tmp_path / "theirs")
    torch.testing.assert_close(_logits(peft_loaded), _logits(theirs), atol=ATOL, rtol=0)
    torch.testing.assert_close(_logits(ours_loaded), _logits(ours), atol=ATOL, rtol=0)

    # the files are those of a float-base adapter: the same adapter on the unquantized model runs as on a float one
    float_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, progress=False),
                                            tmp_path / "ours")
    state = get_peft_model_state_dict(float_model)
    assert state.keys() == get_peft_model_state_dict(ours).keys()
    assert all(torch.equal(v, get_peft_model_state_dict(ours)[k]) for k, v in state.items())


@pytest.mark.parametrize("bits", [8, 4])
def test_weight_only_base_adds_the_lora_path_to_the_dequantized_layer(folder, bits):
    model = get_peft_model(_ours(folder, dict(bits=bits), dtype=torch.bfloat16), LoraConfig(**LORA))
    layer = model.get_base_model().model.layers[0].mlp.down_proj
    assert isinstance(layer, LoraLinear) and type(layer.base_layer).__name__ == "WeightOnlyLinear"
    assert layer.lora_A.weight.dtype == torch.float32  # float32 adapters over a bfloat16 compute dtype
    x = torch.randn(40, layer.in_features, dtype=torch.bfloat16)  # rows past the CPU kernel's range: dequantize
    base = layer.base_layer(x)  # the weight-only layer's own forward (its tests compare it with the dequantized one)
    torch.testing.assert_close(base, F.linear(x, layer.base_layer.dequantize(), layer.base_layer.bias),
                               atol=0.02 * float(base.abs().max()), rtol=0)
    update = layer.lora_B(layer.lora_A(x.float())) * layer.scaling
    torch.testing.assert_close(layer(x), base + update.to(torch.bfloat16), atol=0, rtol=0)

    # a training step moves the adapters and leaves the int weights as they are
    qweight = layer.base_layer.qweight.clone()
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert layer.lora_A.weight.grad.abs().max() > 0
    a_before = layer.lora_A.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(layer.lora_A.weight, a_before) and torch.equal(layer.base_layer.qweight, qweight)


def test_switching_adapters_over_weight_only_layers_without_bias(folder):
    """A WeightOnlyLinear without bias (the folder's MLP) has no parameter at all, only buffers: switching back to a
    parked adapter found the base layer's device from its parameters, and failed (StopIteration)."""
    model = _ours(folder, dict(bits=8))
    model.add_adapter(LoraConfig(r=4, target_modules=["gate_proj"], init_lora_weights=False), "a")
    with_a = _logits(model)
    model.add_adapter(LoraConfig(r=4, target_modules=["gate_proj"], init_lora_weights=False), "b")
    model.set_adapter("a")
    layer = model.model.layers[0].mlp.gate_proj
    assert isinstance(layer, LoraLinear) and list(layer.base_layer.parameters()) == []
    assert layer.lora_A.weight.device == layer.base_layer.qweight.device
    torch.testing.assert_close(_logits(model), with_a, atol=0, rtol=0)


def test_merge_requantizes_like_peft(bnb, folder):
    """peft merges into a 4-bit layer by dequantizing, adding B @ A * scaling and quantizing again: the same here,
    to the bit, when merging before any forward."""
    ours, theirs = _pair(folder)
    merged, peft_merged = ours.merge_and_unload(), theirs.merge_and_unload()
    q_proj = merged.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "BnbLinear4bit" and q_proj.weight.dtype == torch.uint8
    theirs_state = peft_merged.state_dict()
    for key, value in merged.state_dict().items():
        assert torch.equal(value, theirs_state[key]), key
    torch.testing.assert_close(_logits(merged.eval()), _logits(peft_merged.eval()), atol=ATOL, rtol=0)


@pytest.mark.parametrize("settings", [NF4, dict(load_in_8bit=True), dict(bits=8), dict(bits=4)],
                         ids=["nf4", "int8", "weight-only-int8", "weight-only-int4"])
def test_merge_is_close_to_the_adapter_and_unmerge_restores(folder, settings):
    if "bits" not in settings:
        pytest.importorskip("bitsandbytes")
    model = get_peft_model(_ours(folder, settings), LoraConfig(**LORA)).eval()
    base, with_adapter = _logits(_ours(folder, settings)), _logits(model)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    dequantized = layer.base_layer.dequantize().float()
    model.merge_adapter()
    merged = _logits(model)  # the LoRA layers skip their path once merged: this is the re-quantized base alone
    # re-quantizing rounds again: the merged model is far closer to the adapter's outputs than the base is
    assert (merged - with_adapter).abs().max() < 0.5 * (base - with_adapter).abs().max()
    delta = layer.delta_weight()
    assert (layer.base_layer.dequantize().float() - dequantized - delta).abs().max() < 0.5 * delta.abs().max()
    model.unmerge_adapter()
    assert not layer.merged
    torch.testing.assert_close(layer.base_layer.dequantize().float(), dequantized,
                               atol=0.5 * delta.abs().max().item(), rtol=0)
    plain = model.merge_and_unload()
    assert not any(isinstance(m, LoraLinear) for m in plain.modules())


def test_unload_gives_back_the_quantized_base(bnb, folder):
    base = _ours(folder)
    want = _logits(base)
    layer_types = {n: type(m) for n, m in base.named_modules()}
    model = get_peft_model(base, LoraConfig(**LORA))
    assert (_logits(model) - want).abs().max() > 1e-2
    plain = model.unload()
    assert plain is base and {n: type(m) for n, m in plain.named_modules()} == layer_types
    torch.testing.assert_close(_logits(plain), want, atol=0, rtol=0)


def test_embedding_targets_adapt_and_unknown_quantized_subclasses_are_refused(bnb, folder):
    from gpuformers.lora.embedding import LoraEmbedding

    # the embeddings stay unquantized: peft's embedding LoRA applies to them as to any model's
    adapted = get_peft_model(_ours(folder), LoraConfig(target_modules=["embed_tokens", "q_proj"]))
    assert isinstance(adapted.base_model.model.model.embed_tokens, LoraEmbedding)
    model = _ours(folder)

    class Linear4bit(nn.Linear):  # someone else's quantized subclass: its forward and merge are unknown to us
        pass

    old = model.model.layers[1].self_attn.q_proj
    model.model.layers[1].self_attn.q_proj = Linear4bit(old.in_features, old.out_features)
    with pytest.raises(NotImplementedError, match=r"Linear4bit"):
        get_peft_model(model, LoraConfig(target_modules=["q_proj"]))
    assert not any(isinstance(m, LoraLinear) for m in model.modules())
