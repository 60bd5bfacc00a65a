"""Every verb that loads a model takes the same backend and kernel flags (models/command_line.py's
add_kernel_arguments), and they become the from_pretrained keywords (kernel_options)."""

from __future__ import annotations

import argparse

import pytest

from gpuformers import cli
from gpuformers.models.command_line import kernel_options

REQUIRED = {"generate": ["a prompt"], "chat": [], "serve": [], "train": ["--model", "m", "--data", "d.jsonl"]}


@pytest.mark.parametrize("verb", sorted(REQUIRED))
def test_each_verb_takes_the_kernel_flags(verb):
    parser = argparse.ArgumentParser()
    cli._load(cli.VERBS[verb].arguments)(parser)
    args = parser.parse_args(REQUIRED[verb] + ["--attn-implementation", "flash_attention_4", "--use-kernels",
                                               "--kernel-config", '{"SwiGLUMLP": "torch"}'])
    options = kernel_options(args)
    assert options["attn_implementation"] == "flash_attention_4" and options["use_kernels"] is True
    assert options["kernel_config"].kernel_for("SwiGLUMLP", "cuda") is None  # "torch": the layer's own forward
    assert kernel_options(parser.parse_args(REQUIRED[verb])) == {}


@pytest.mark.parametrize("verb", sorted(REQUIRED))
def test_the_trust_error_names_the_flag(verb):
    from gpuformers.kernels.hub_kernels import load_kernel_module, parse_kernel

    with pytest.raises(ValueError) as error:  # refused before the kernels package is asked (no network, no cache)
        load_kernel_module(parse_kernel("someone/flash-attn", need_name=False))
    shown = cli.for_cli(str(error.value), cli.VERBS[verb].flags)
    assert "'someone/flash-attn' is outside 'kernels-community'" in shown and "--allow-all-kernels" in shown
