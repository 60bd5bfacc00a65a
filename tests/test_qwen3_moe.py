"""Qwen3-MoE against transformers on tiny random checkpoints: logits, loss, greedy tokens, saving both ways, the
engine, which layers quantization and LoRA touch, and training with output_router_logits=True (aux loss, router
logits and router gradients, the chunked loss, num_items_in_batch, the Trainer)."""

from __future__ import annotations

import pytest
import torch

from tests.models.parity import assert_engine_matches_generate

MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
           bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _checkpoint(folder, **overrides):
    """A transformers Qwen3-MoE saved to `folder` (routers scaled up so that routing differs between tokens)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**{**MOE, **overrides}),
                                                       dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    hf.save_pretrained(folder)
    return hf


def _load(folder, **kwargs):
    from gpuformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, progress=False, **kwargs)


def _batch():
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


@pytest.mark.parametrize("overrides", [
    dict(norm_topk_prob=True),
    dict(norm_topk_prob=False, mlp_only_layers=[1]),
    dict(decoder_sparse_step=2, num_experts_per_tok=1),
], ids=["normalised", "dense-layer-1", "every-second-layer"])
def test_logits_loss_and_tokens_match_transformers(tmp_path, overrides):
    from gpuformers.layers.moe import SparseMoeBlock

    hf = _checkpoint(tmp_path, **overrides)
    ours = _load(tmp_path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert sparse == [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    ids, mask = _batch()
    with torch.no_grad():
        theirs, mine = hf(ids, attention_mask=mask, labels=ids), ours(ids, attention_mask=mask, labels=ids)
    torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **greedy), hf.generate(ids, **greedy))


def test_saved_checkpoint_loads_in_transformers_and_trains(tmp_path):
    import transformers

    _checkpoint(tmp_path / "hf")
    ours = _load(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=0)
    ours.train()
    ours(ids, labels=ids).loss.backward()
    layer = ours.model.layers[0].mlp
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0
    assert any(e.down_proj.weight.grad is not None for e in layer.experts)


def test_engine_matches_generate(tmp_path):
    _checkpoint(tmp_path)
    model = _load(tmp_path)
    assert_engine_matches_generate(model)


def test_quantization_and_lora_leave_the_router_alone(tmp_path):
    from gpuformers import LoraConfig, WeightOnlyConfig, get_peft_model
    from gpuformers.layers.moe import TopKRouter
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    _checkpoint(tmp_path)
    model = _load(tmp_path, quantization_config=WeightOnlyConfig(bits=8))
    moe = model.model.layers[0].mlp
    assert isinstance(moe.gate, TopKRouter) and isinstance(moe.experts[3].up_proj, WeightOnlyLinear)
    lora = get_peft_model(_load(tmp_path), LoraConfig(r=2, target_modules="all-linear"))
    kinds = {name.rsplit(".", 1)[-1] for name in lora.peft_config["default"].target_modules}
    assert "gate" not in kinds and {"gate_proj", "up_proj", "down_proj", "q_proj"} <= kinds


def test_router_rejects_top_k_above_num_experts():
    from gpuformers.layers.moe import TopKRouter

    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be between 1 and num_experts=4"):
        TopKRouter(8, 4, 5, True)


# --- output_router_logits=True: the router's load-balancing loss ---------------------------------------------------


def _router_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")}


def _assert_same_router_outputs(mine, theirs):
    torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(mine.aux_loss, theirs.aux_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    assert len(mine.router_logits) == len(theirs.router_logits)
    for ours_layer, hf_layer in zip(mine.router_logits, theirs.router_logits):
        torch.testing.assert_close(ours_layer, hf_layer, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides", [
    dict(norm_topk_prob=True),
    dict(norm_topk_prob=False, mlp_only_layers=[1]),
    dict(decoder_sparse_step=2, num_experts_per_tok=1, norm_topk_prob=False),
], ids=["normalised", "unnormalised-dense-layer-1", "every-second-layer-top-1"])
def test_aux_loss_router_logits_and_router_gradients_match_transformers(tmp_path, overrides):
    hf = _checkpoint(tmp_path, output_router_logits=True, **overrides)
    ours = _load(tmp_path)
    ids, padded = _batch()
    for mask in (padded, None):  # padding tokens are left out of the aux loss
        theirs, mine = hf(ids, attention_mask=mask, labels=ids), ours(ids, attention_mask=mask, labels=ids)
        _assert_same_router_outputs(mine, theirs)
        assert mine.router_logits[0].shape == (ids.numel(), MOE["num_experts"])
        # the aux loss alone reaches the routers with transformers' gradients, and so does the total loss
        for loss in ("aux_loss", "loss"):
            hf.zero_grad(), ours.zero_grad()
            getattr(theirs, loss).backward(retain_graph=True), getattr(mine, loss).backward(retain_graph=True)
            hf_grads, our_grads = _router_grads(hf), _router_grads(ours)
            assert our_grads.keys() == hf_grads.keys() and len(our_grads) == len(mine.router_logits)
            for name in hf_grads:
                assert our_grads[name].abs().sum() > 0
                torch.testing.assert_close(our_grads[name], hf_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # the padded and unpadded aux losses differ: the mask is used
    assert not torch.equal(ours(ids, attention_mask=padded).aux_loss, ours(ids).aux_loss)


def test_flag_off_gives_the_old_loss_and_the_forward_argument_turns_it_on(tmp_path):
    from gpuformers.layers.loss import causal_lm_loss
    from gpuformers.layers.moe import TopKRouter

    hf = _checkpoint(tmp_path)  # output_router_logits=False in config.json
    ours = _load(tmp_path)
    ids, mask = _batch()
    with torch.no_grad():
        off = ours(ids, attention_mask=mask, labels=ids)
        assert off.aux_loss is None and off.router_logits is None
        assert torch.equal(off.loss, causal_lm_loss(off.logits, ids))
        torch.testing.assert_close(off.loss, hf(ids, attention_mask=mask, labels=ids).loss, atol=1e-5, rtol=0)
        on = ours(ids, attention_mask=mask, labels=ids, output_router_logits=True)
        _assert_same_router_outputs(on, hf(ids, attention_mask=mask, labels=ids, output_router_logits=True))
        assert torch.equal(on.loss, off.loss + ours.config.router_aux_loss_coef * on.aux_loss)
    assert all(router.recorded is None for router in ours.modules() if isinstance(router, TopKRouter))


def test_generate_and_engine_record_nothing_with_the_flag_on(tmp_path):
    from gpuformers.layers.moe import TopKRouter

    _checkpoint(tmp_path, output_router_logits=True)
    model = _load(tmp_path)
    appended = []
    for router in model.modules():
        if isinstance(router, TopKRouter):
            router.register_forward_hook(lambda module, args, out: appended.append(module.recorded))
    prompts = [[5, 9, 23, 42], [7, 64, 100, 3, 8, 2, 77]]
    expected = [model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, eos_token_id=None)[0, len(p):]
                .tolist() for p in prompts]
    outputs = model.generate_batch(prompts, max_new_tokens=4, eos_token_id=None, progress_bar=False, block_size=8,
                                   num_blocks=16)
    assert [r.generated_tokens for r in outputs.values()] == expected
    assert appended and all(recorded is None for recorded in appended)


def test_chunked_training_loss_with_num_items_in_batch_matches_transformers(tmp_path):
    from gpuformers.layers.loss import logits_not_needed

    hf = _checkpoint(tmp_path, output_router_logits=True, router_aux_loss_coef=0.5)
    ours = _load(tmp_path)
    hf.train(), ours.train()
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    with logits_not_needed():  # the Trainer's path: the LM head fused with the loss, no logits
        mine = ours(ids, attention_mask=mask, labels=labels, num_items_in_batch=40)
    theirs = hf(ids, attention_mask=mask, labels=labels, num_items_in_batch=40)
    assert mine.logits is None
    torch.testing.assert_close(mine.aux_loss, theirs.aux_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=0)
    mine.loss.backward(), theirs.loss.backward()
    hf_grads = _router_grads(hf)
    for name, grad in _router_grads(ours).items():
        torch.testing.assert_close(grad, hf_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_trainer_step_equals_transformers_trainer_and_the_loss_falls(tmp_path):
    import transformers

    from gpuformers.training import DataCollatorForCausalLM, Trainer
    from tests.training.helpers import GradientRecorder, make_rows, tiny_args

    _checkpoint(tmp_path / "model", output_router_logits=True, router_aux_loss_coef=0.5)
    rows, collator = make_rows(8), DataCollatorForCausalLM(pad_token_id=0)
    # two micro-batches per step: the Trainer passes num_items_in_batch
    common = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, learning_rate=1e-3,
                  optim="adamw_torch", seed=0, train_sampling_strategy="sequential", report_to="none",
                  save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=True)
    theirs_grads, ours_grads = GradientRecorder(), GradientRecorder()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    transformers.Trainer(hf, transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **common),
                         train_dataset=rows, data_collator=collator, callbacks=[theirs_grads]).train()
    Trainer(_load(tmp_path / "model"), tiny_args(tmp_path / "ours", **common), train_dataset=rows,
            data_collator=collator, callbacks=[ours_grads]).train()
    (theirs,), (mine,) = theirs_grads.steps, ours_grads.steps
    shared = mine.keys() & theirs.keys()  # all but the experts, which transformers stacks into one tensor
    assert {f"model.layers.{i}.mlp.gate.weight" for i in range(3)} <= shared and "lm_head.weight" in shared
    for name in shared:
        torch.testing.assert_close(mine[name], theirs[name], atol=1e-6, rtol=1e-5, msg=name)

    trainer = Trainer(_load(tmp_path / "model"), tiny_args(tmp_path / "fall", max_steps=12, learning_rate=1e-2,
                      lr_scheduler_type="constant"), train_dataset=rows, data_collator=collator)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 12 and sum(losses[-3:]) < 0.8 * sum(losses[:3])
