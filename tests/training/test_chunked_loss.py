"""The chunked LM-head loss the Trainer's training step uses (layers/loss.py linear_causal_lm_loss): the same loss
and the same gradients as the logits + causal_lm_loss it replaces, and the model returns logits whenever they may
be read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuformers.layers.loss as loss_module
from gpuformers import AutoModelForCausalLM
from gpuformers.layers.loss import causal_lm_loss, linear_causal_lm_loss, logits_needed, logits_not_needed


def _inputs(batch=3, seq=11, hidden=16, vocab=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(batch, seq, hidden, generator=generator, requires_grad=True)
    weight = (torch.randn(vocab, hidden, generator=generator) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels[0, :4] = -100  # padding and prompt tokens are ignored
    labels[1, 7] = -100
    return hidden_states, weight, labels


def _loss_and_grads(fn, hidden_states, weight, labels, num_items, scale=1.0):
    hidden_states.grad = weight.grad = None
    loss = fn(hidden_states, weight, labels, num_items)
    (loss * scale).backward()
    return loss.detach(), hidden_states.grad.clone(), None if weight.grad is None else weight.grad.clone()


def _unfused(hidden_states, weight, labels, num_items):
    return causal_lm_loss(F.linear(hidden_states, weight), labels, num_items)


@pytest.mark.parametrize("chunk_tokens", [1024, 4])  # one chunk (the usual case), then ragged chunks of 4 tokens
@pytest.mark.parametrize("num_items", [None, 21, "tensor"])
@pytest.mark.parametrize("in_place", [True, False])  # False: the GPU's way (new buffers), run on the CPU
def test_chunked_loss_and_gradients_equal_the_unfused_loss(monkeypatch, chunk_tokens, num_items, in_place):
    monkeypatch.setattr(loss_module, "CHUNK_TOKENS", chunk_tokens)
    monkeypatch.setattr(loss_module, "_rows_in_place", lambda device: in_place)
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 1)
    hidden_states, weight, labels = _inputs()
    items = torch.tensor(21) if num_items == "tensor" else num_items
    expected = _loss_and_grads(_unfused, hidden_states, weight, labels, items)
    got = _loss_and_grads(linear_causal_lm_loss, hidden_states, weight, labels, items)
    for name, g, e in zip(("loss", "hidden grad", "weight grad"), got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-8, msg=name)
    if chunk_tokens == 1024:  # one chunk runs autograd's own ops: the gradients are bitwise equal
        assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


def test_chunked_loss_scales_its_gradients_by_the_incoming_gradient():
    hidden_states, weight, labels = _inputs(seed=1)
    expected = _loss_and_grads(_unfused, hidden_states, weight, labels, 17, scale=0.25)
    got = _loss_and_grads(linear_causal_lm_loss, hidden_states, weight, labels, 17, scale=0.25)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-8)


def test_chunked_loss_with_a_frozen_head_and_without_grad():
    hidden_states, weight, labels = _inputs(seed=2)
    weight.requires_grad_(False)  # e.g. LoRA: only the hidden states need a gradient
    expected = _loss_and_grads(_unfused, hidden_states, weight, labels, None)[:2]
    hidden_states.grad = None
    loss = linear_causal_lm_loss(hidden_states, weight, labels)
    loss.backward()
    assert weight.grad is None
    torch.testing.assert_close((loss.detach(), hidden_states.grad), expected, rtol=1e-6, atol=1e-8)
    with torch.no_grad():
        torch.testing.assert_close(linear_causal_lm_loss(hidden_states, weight, labels), expected[0], rtol=1e-6,
                                   atol=0)


def test_chunked_loss_in_bfloat16_and_under_autocast_follows_the_unfused_loss():
    hidden_states, weight, labels = _inputs(seed=3)
    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (hidden_states, weight))
    expected = _loss_and_grads(_unfused, h16, w16, labels, 30)
    got = _loss_and_grads(linear_causal_lm_loss, h16, w16, labels, 30)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-2, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: the logits are made and the unfused loss used
        expected = _loss_and_grads(_unfused, hidden_states, weight, labels, 30)
        got = _loss_and_grads(linear_causal_lm_loss, hidden_states, weight, labels, 30)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_backward_twice_through_the_chunked_loss_says_what_to_do():
    hidden_states, weight, labels = _inputs(seed=4)
    loss = linear_causal_lm_loss(hidden_states, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="logits_not_needed"):
        loss.backward()


@pytest.mark.parametrize("tie", [False, True])
def test_model_skips_the_logits_only_when_told_and_training(tmp_path, tie):
    from tests.fixtures.checkpoints import make_checkpoint

    make_checkpoint(tmp_path, "qwen3", tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, progress=False).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100
    grads = []
    for skip in (False, True):
        model.zero_grad(set_to_none=True)
        assert logits_needed()
        with logits_not_needed() if skip else torch.enable_grad():
            assert logits_needed() is not skip
            out = model(input_ids=ids, labels=labels, num_items_in_batch=13)
        assert (out.logits is None) is skip
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss, full), (chunked_loss, chunked) = grads
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-6, atol=0)
    assert full.keys() == chunked.keys()
    for name in full:
        assert torch.equal(chunked[name], full[name]), name
    model.eval()  # evaluation and generation always get logits
    with logits_not_needed(), torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    assert out.logits.shape == (2, 9, model.config.vocab_size)

