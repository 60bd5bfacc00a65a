"""`gpuformers serve` on a tiny Nemotron-H checkpoint (mamba, attention and MLP blocks, saved by transformers, with
the real Qwen3 tokenizer): the verb's own loading, run in-process with run_server replaced by a TestClient on the same
app, serves generate()'s greedy tokens through the engine's state slots, for completions and streamed chat, and the
prefix cache's state snapshots serve a repeated system prompt; and `--compile` reaches the engine (refused by name for
a hybrid model)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

pytest.importorskip("fastapi")

PROMPTS = ["The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from gpuformers import AutoTokenizer
    from tests.assets import qwen3_tokenizer_dir
    from tests.fixtures.checkpoints import make_checkpoint

    folder = tmp_path_factory.mktemp("serve-hybrid")
    make_checkpoint(folder, "nemotron_h", vocab_size=151936, hidden_size=32, intermediate_size=48,
                    layers_block_type=["mamba", "attention", "mlp", "mamba"], num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=16,
                    ssm_state_size=8, n_groups=2, chunk_size=8, max_position_embeddings=512, pad_token_id=0,
                    tie_word_embeddings=False)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 200.0  # logits far apart (tests/serving/conftest.py)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(qwen3_tokenizer_dir()).save_pretrained(folder)
    return folder


def test_serve_gives_generates_tokens_through_the_state_slots(monkeypatch, hybrid_checkpoint):
    from fastapi.testclient import TestClient

    from gpuformers import AutoModelForCausalLM, AutoTokenizer
    from gpuformers.serving import cli, server

    captured = {}
    monkeypatch.setattr(server, "run_server", lambda manager, tokenizer, name, **kw: captured.update(
        manager=manager, tokenizer=tokenizer))
    parser = argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    args = parser.parse_args([str(hybrid_checkpoint), "--device", "cpu", "--dtype", "float32", "--num-blocks", "64",
                              "--served-model-name", "tiny-hybrid"])
    assert cli.run_serve(args) == 0
    manager = captured["manager"]
    assert manager.states is not None  # the engine keeps the mamba layers' states

    model = AutoModelForCausalLM.from_pretrained(hybrid_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(hybrid_checkpoint)

    def greedy(ids: list[int], n: int) -> str:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False)
        return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    system = {"role": "system", "content": "You are a terse assistant who answers in one short line. " * 6}
    with TestClient(server.build_app(manager, captured["tokenizer"], "tiny-hybrid")) as http:
        for prompt in PROMPTS:
            reply = http.post("/v1/completions", json={"model": "tiny-hybrid", "prompt": prompt, "max_tokens": 6,
                                                       "temperature": 0})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == greedy(tokenizer(prompt)["input_ids"], 6)
        for question in ("Hi", "What is 2 + 2?", "Name a colour", "Why?"):  # one system prompt, asked 4 times
            messages = [system, {"role": "user", "content": question}]
            with http.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny-hybrid", "messages": messages, "max_tokens": 5, "temperature": 0,
                    "stream": True}) as reply:
                assert reply.status_code == 200
                chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
            assert text == greedy(list(ids), 5)
    # the second chat computed the system prompt and kept its state; the third and fourth restored it
    assert manager.states.snapshots_taken >= 1 and manager.states.snapshot_hits >= 2
    manager.stop()


def test_serve_compile_flag_reaches_the_engine(monkeypatch, checkpoint, hybrid_checkpoint):
    """`serve --compile` compiles the engine's decoder (the first steps compile; none run here), `--no-compile` keeps
    it eager, and a hybrid model refuses --compile by name."""
    from gpuformers.serving import cli, server

    captured = {}
    monkeypatch.setattr(server, "run_server", lambda manager, tokenizer, name, **kw: captured.update(manager=manager))

    def serve(folder, *flags):
        parser = argparse.ArgumentParser()
        cli.add_serve_arguments(parser)
        args = parser.parse_args([str(folder), "--device", "cpu", "--dtype", "float32", "--num-blocks", "16", *flags])
        assert cli.run_serve(args) == 0
        return captured.pop("manager")

    compiled, eager = serve(checkpoint, "--compile"), serve(checkpoint, "--no-compile")
    compiled.stop(), eager.stop()
    assert compiled.runner.compiled is not None and eager.runner.compiled is None
    with pytest.raises(NotImplementedError, match="mamba"):
        serve(hybrid_checkpoint, "--compile")
