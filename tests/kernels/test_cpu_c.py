"""kernels/cpu_c.py's greedy argmax: the index torch's argmax gives (the first on ties, the first NaN as the
maximum, infinities, strided rows), and greedy_tokens (generate() and the engine's greedy rows) going through it."""

from __future__ import annotations

import pytest
import torch

from gpuformers.generation.generate import greedy_tokens
from gpuformers.kernels import cpu_c

pytestmark = pytest.mark.skipif(cpu_c.compiler() is None, reason="needs a C compiler")


def test_first_argmax_is_torchs_argmax():
    torch.manual_seed(0)
    scores = torch.randn(37, 1000)
    scores[1, 5] = scores[1, 700] = 50.0  # a tie: the first
    scores[2, :] = 3.0  # all equal: index 0
    scores[3, 999] = float("inf")
    scores[4, :] = float("-inf")
    scores[5, 10] = scores[5, 20] = float("nan")  # NaN is the maximum, the first one
    scores[6, 0] = float("nan")
    scores[7, 999] = 100.0  # the last column
    scores[8, 3] = -0.0
    scores[8] = scores[8].clamp(max=-1.0)
    scores[8, 3], scores[8, 4] = -0.0, 0.0  # signed zeros compare equal: the first
    assert torch.equal(cpu_c.first_argmax(scores), scores.argmax(-1))
    wide = torch.randn(8, 32000 * 2)[:, ::2]  # rows not contiguous: declined, the caller's torch path runs
    assert cpu_c.first_argmax(wide) is None
    rows = torch.randn(16, 40000)[:, :32000]  # a row stride other than the width
    assert torch.equal(cpu_c.first_argmax(rows), rows.argmax(-1))
    assert cpu_c.first_argmax(scores.to(torch.bfloat16)) is None


def test_greedy_tokens_use_it_and_keep_argmax(monkeypatch):
    torch.manual_seed(1)
    scores = torch.randn(5, 300)
    calls = []
    original = cpu_c.first_argmax
    monkeypatch.setattr(cpu_c, "first_argmax", lambda s: calls.append(1) or original(s))
    assert torch.equal(greedy_tokens(scores), scores.argmax(-1)) and calls
    monkeypatch.setattr(cpu_c, "first_argmax", lambda s: None)  # no compiler: torch's max(-1)
    assert torch.equal(greedy_tokens(scores), scores.argmax(-1))
