"""Tests of gpuformers.training: arguments, the Trainer against transformers, checkpoints and resume, data, the CLI."""
