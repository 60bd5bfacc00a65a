"""Activation checkpointing on the model, as transformers' activation_checkpointing_enable (and its older name
gradient_checkpointing_enable): the same loss and gradients as without it, the same layers as transformers picks
for every_n_layers, offloading, and turning it off again."""

from __future__ import annotations

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from tests.fixtures.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    return folder, make_checkpoint(folder, "qwen3", num_hidden_layers=4)


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("settings", [{}, {"every_n_layers": 2}, {"offload": True},
                                      {"activation_checkpointing_kwargs": {"use_reentrant": True}}])
def test_same_loss_and_gradients_as_without(checkpoint, settings):
    folder, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(folder, progress=False).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    expected_loss, expected = _loss_and_grads(model, ids)
    model.activation_checkpointing_enable(**settings)
    assert model.is_activation_checkpointing and model.is_gradient_checkpointing
    loss, grads = _loss_and_grads(model, ids)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_every_n_layers_picks_transformers_layers(checkpoint):
    folder, hf = checkpoint
    hf.train()
    hf.activation_checkpointing_enable(every_n_layers=3)
    model = AutoModelForCausalLM.from_pretrained(folder, progress=False).train()
    model.activation_checkpointing_enable(every_n_layers=3)
    assert [getattr(layer, "_checkpointed", False) for layer in model.model.layers] == [
        layer.gradient_checkpointing for layer in hf.model.layers] == [True, False, False, True]
    with pytest.raises(ValueError, match="every_n_layers=0 must be an int >= 1"):
        model.activation_checkpointing_enable(every_n_layers=0)


def test_frozen_embeddings_still_get_layer_gradients_with_reentrant_checkpointing(checkpoint):
    # The LoRA situation: the embeddings are frozen, so without enable_input_require_grads a reentrant checkpoint
    # would see no input needing grad and the layers inside it would get none.
    folder, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(folder, progress=False).train()
    model.get_input_embeddings().weight.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].mlp.down_proj.weight.grad is not None


def test_disable_restores_the_plain_layers(checkpoint):
    folder, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(folder, progress=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    expected = model.generate(ids, max_new_tokens=5, do_sample=False)
    model.gradient_checkpointing_enable()
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    assert all("forward" not in vars(layer) for layer in model.model.layers)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), expected)
