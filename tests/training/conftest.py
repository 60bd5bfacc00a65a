"""Shared fixtures for the training tests: one tiny Qwen3-shaped checkpoint written by transformers, and a process
group of this process alone."""

from __future__ import annotations

import pytest

from tests.fixtures.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer Qwen3 checkpoint (vocab 128, hidden 64, untied embeddings)."""
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    make_checkpoint(folder, "qwen3", tie_word_embeddings=False)
    return folder


@pytest.fixture
def one_process_group():
    """A gloo group of this process alone, for the checks of wrapping and process-group code that need no second
    process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
