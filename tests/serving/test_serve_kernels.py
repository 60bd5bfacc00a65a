"""`gpuformers serve --use-kernels --attn-implementation triton` on a tiny Qwen3-MoE checkpoint: the verb's own flag
parsing and loading (serving/cli.py, models/command_line.py), run in-process with run_server replaced by a TestClient
on the same app, serves the same greedy tokens as the plain server and as generate(); the kernelized MoE blocks no
longer wait on the host, so on a GPU the engine keeps CUDA graphs on. The Triton kernels run under TRITON_INTERPRET=1
(tests/conftest.py) on the CPU."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("triton")

PROMPTS = ["The capital of France is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from gpuformers import AutoTokenizer
    from tests.assets import qwen3_tokenizer_dir
    from tests.fixtures.checkpoints import make_checkpoint

    tokenizer_dir = qwen3_tokenizer_dir()
    folder = tmp_path_factory.mktemp("serve-moe")
    make_checkpoint(folder, "qwen3_moe", vocab_size=151936, hidden_size=32, intermediate_size=64,
                    moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                    tie_word_embeddings=False)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 200.0  # logits far apart (tests/serving/conftest.py)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def _serve(monkeypatch, folder, *flags):
    """Run `gpuformers serve FOLDER FLAGS` up to the point where it would listen; return (greedy texts of PROMPTS,
    the engine's manager)."""
    from fastapi.testclient import TestClient

    from gpuformers.serving import cli, server

    captured = {}
    monkeypatch.setattr(server, "run_server", lambda manager, tokenizer, name, **kw: captured.update(
        manager=manager, tokenizer=tokenizer, name=name))
    parser = argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    args = parser.parse_args([str(folder), "--device", "cpu", "--dtype", "float32", "--num-blocks", "16",
                              "--served-model-name", "tiny-moe", *flags])
    assert cli.run_serve(args) == 0
    manager = captured["manager"]
    texts = []
    with TestClient(server.build_app(manager, captured["tokenizer"], "tiny-moe")) as http:
        for prompt in PROMPTS:
            reply = http.post("/v1/completions", json={"model": "tiny-moe", "prompt": prompt, "max_tokens": 6,
                                                       "temperature": 0})
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
    manager.stop()
    return texts, manager


def test_serve_with_kernels_serves_the_plain_servers_tokens_and_keeps_cuda_graphs(monkeypatch, moe_checkpoint):
    from gpuformers import AutoModelForCausalLM, AutoTokenizer
    from gpuformers.engine.cuda_graphs import decide_cuda_graph
    from gpuformers.kernels import moe
    from gpuformers.layers.moe import host_syncing_modules

    plain, plain_manager = _serve(monkeypatch, moe_checkpoint)
    calls = []
    real = moe.sparse_moe_forward
    monkeypatch.setattr(moe, "sparse_moe_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused, fused_manager = _serve(monkeypatch, moe_checkpoint, "--use-kernels", "--attn-implementation", "triton")

    # generate()'s greedy tokens, for both servers
    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(moe_checkpoint)
    reference = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        reference.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert plain == reference and fused == plain

    fused_model = fused_manager.model
    assert calls, "the fused MoE kernel never ran"  # (kernelize installed the counting stand-in above)
    assert "forward" in vars(fused_model.model.layers[0].mlp)
    assert host_syncing_modules(fused_model) == [] and host_syncing_modules(plain_manager.model) != []
    # on a GPU (cuda=True), the kernelized MoE model is captured in CUDA graphs, the plain one is not
    assert decide_cuda_graph(None, fused_model, cuda=True, tp_size=1) is True
    assert decide_cuda_graph(None, plain_manager.model, cuda=True, tp_size=1) is False


def test_bad_kernel_flags_fail_before_the_load(moe_checkpoint):
    from gpuformers.models.command_line import add_kernel_arguments, kernel_options

    parser = argparse.ArgumentParser()
    add_kernel_arguments(parser)
    with pytest.raises(ValueError, match="attn_implementation 'flash' is not known; available: eager"):
        kernel_options(parser.parse_args(["--attn-implementation", "flash"]))
    with pytest.raises(ValueError, match="--kernel-config is not JSON"):
        kernel_options(parser.parse_args(["--kernel-config", "{RMSNorm: triton}"]))
    with pytest.raises(ValueError, match="is 'liger', which is not one of: triton, torch"):
        kernel_options(parser.parse_args(["--kernel-config", '{"RMSNorm": "liger"}']))
    options = kernel_options(parser.parse_args(["--kernel-config", '{"kernel_mapping": {"RMSNorm": "/k:L"}, '
                                                '"use_local_kernel": true}', "--attn-implementation", "org/repo",
                                                "--allow-all-kernels"]))
    assert options["use_kernels"] and options["kernel_config"].use_local_kernel  # --kernel-config implies it
    assert (options["attn_implementation"], options["allow_all_kernels"]) == ("org/repo", True)
    assert kernel_options(parser.parse_args([])) == {}
