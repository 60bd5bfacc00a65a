"""Shared fixtures for the training tests: one tiny Qwen3-shaped checkpoint written by transformers."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer Qwen3 checkpoint (vocab 128, hidden 64, untied embeddings)."""
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    make_checkpoint(folder, "qwen3", tie_word_embeddings=False)
    return folder
