"""Cross-entropy and fused linear + cross-entropy kernels against torch's unfused loss, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.cases import CASES, assert_close, rand

from gpuformers.kernels.fused_linear_cross_entropy import (  # noqa: E402
    causal_lm_loss_triton,
    cross_entropy,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_reference,
)
from gpuformers.layers.loss import causal_lm_loss  # noqa: E402


def _labels(n, vocab, device, ignore_every=4):
    torch.manual_seed(5)
    labels = torch.randint(0, vocab, (n,), device=device)
    labels[::ignore_every] = -100
    return labels


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("vocab", [37, 1100], ids=["tiny-vocab", "vocab-over-one-block"])
def test_cross_entropy(device, dtype, vocab):
    logits = rand(17, vocab, device=device, dtype=dtype, grad=True, seed=0)
    labels = _labels(17, vocab, device)
    loss = cross_entropy(logits, labels)
    ref = F.cross_entropy(logits.float(), labels)
    assert loss.dtype == torch.float32
    assert_close(loss, ref, dtype)
    assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0], dtype)


@pytest.mark.parametrize("device,dtype", CASES[:2])
def test_causal_lm_loss_kernel_matches_layer(device, dtype):
    logits = rand(2, 9, 50, device=device, dtype=dtype, grad=True, seed=0)
    labels = torch.randint(0, 50, (2, 9), device=device)
    labels[0, :3] = -100
    for num_items in (None, 11):
        got = causal_lm_loss_triton(logits, labels, num_items)
        want = causal_lm_loss(logits, labels, num_items)
        assert_close(got, want, dtype)
        assert_close(torch.autograd.grad(got, logits)[0], torch.autograd.grad(want, logits)[0], dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("chunk_size", [None, 5, 100])
def test_fused_linear_cross_entropy(device, dtype, chunk_size):
    tokens, hidden, vocab = 17, 24, 75
    h = rand(tokens, hidden, device=device, dtype=dtype, grad=True, seed=0)
    w = (0.2 * rand(vocab, hidden, device=device, dtype=dtype, seed=1)).requires_grad_(True)
    labels = _labels(tokens, vocab, device)
    loss = fused_linear_cross_entropy(h, w, labels, chunk_size=chunk_size)
    ref = fused_linear_cross_entropy_reference(h, w, labels)
    assert_close(loss, ref, dtype)
    got = torch.autograd.grad(loss * 3, (h, w))  # a non-unit upstream gradient must scale both
    want = torch.autograd.grad(ref * 3, (h, w))
    for g, r in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, r, dtype, scale=5 if dtype != torch.float32 else 1)


@pytest.mark.parametrize("device,dtype", CASES[:1])
def test_fused_loss_with_num_items_in_batch(device, dtype):
    h = rand(8, 16, device=device, grad=True, seed=0)
    w = rand(30, 16, device=device, grad=True, seed=1)
    labels = _labels(8, 30, device, ignore_every=3)
    loss = fused_linear_cross_entropy(h, w, labels, num_items_in_batch=20, chunk_size=3)
    ref = fused_linear_cross_entropy_reference(h, w, labels, num_items_in_batch=20)
    assert_close(loss, ref, dtype)
    assert_close(torch.autograd.grad(loss, h)[0], torch.autograd.grad(ref, h)[0], dtype)


def test_bad_labels_are_named():
    with pytest.raises(ValueError, match="labels must be 4 int64 class indices"):
        cross_entropy(torch.randn(4, 10), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"hidden has size 8 but weight \(vocab, hidden\) is \(10, 9\)"):
        fused_linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 9), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("label", [10, -1, -99], ids=["vocab", "negative", "not-ignore-index"])
def test_labels_outside_the_vocabulary_are_refused(label):
    """The kernels read the target's logit at the label: one outside [0, vocab) (and not ignore_index) would read
    another row's memory and give a wrong loss, where torch's cross_entropy fails."""
    labels = torch.tensor([1, -100, label, 3])
    with pytest.raises(RuntimeError, match=r"labels must be class indices in \[0, 10\) or ignore_index \(-100\)"):
        cross_entropy(torch.randn(4, 10), labels)
    with pytest.raises(RuntimeError, match=r"labels must be class indices in \[0, 10\)"):
        fused_linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), labels)
    cross_entropy(torch.randn(4, 10), torch.tensor([1, -100, 9, 0]))  # the edges pass
