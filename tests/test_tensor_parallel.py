"""Tensor parallelism (tp_plan="auto") under torchrun on the CPU (gloo, 2 processes): the same logits and greedy
tokens as the model loaded whole, each process holding half of every split layer; and the errors a user can meet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuformers.tensor_parallel import _resolve_plan, apply_tensor_parallel, check_tp_size
from tests.fixtures.checkpoints import make_checkpoint

REPO = Path(__file__).resolve().parents[1]


def _torchrun_worker(folder: Path, out: Path, processes: int, cuda: bool = False) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU even where a GPU is visible
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={processes}", "-m", "tests.tp_worker", str(folder), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])  # qwen2: q/k/v biases, split with their layers
def test_two_processes_match_the_whole_model(model_type, tmp_path):
    config = make_checkpoint(tmp_path / "ckpt", model_type).config
    result = _torchrun_worker(tmp_path / "ckpt", tmp_path / "result.json", processes=2)
    assert result["logits_diff"] < 1e-5 * max(1.0, result["logits_scale"])
    assert result["tokens_equal"] and result["batch_tokens_equal"]
    # half of each split dimension per process: 2 of the 4 query heads, 1 of the 2 kv heads, 48 of 96 MLP units
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv, mlp = 2 * head_dim, 1 * head_dim, config.intermediate_size // 2
    assert result["local_shapes"] == {"q_proj": [q, hidden], "k_proj": [kv, hidden], "v_proj": [kv, hidden],
                                      "o_proj": [hidden, q], "gate_proj": [mlp, hidden], "up_proj": [mlp, hidden],
                                      "down_proj": [hidden, mlp]}
    assert result["saved_logits_diff"] == 0.0  # saved whole by process 0 from the gathered slices
    assert result["engine_equal"] and result["engine_kv_heads"] == config.num_key_value_heads // 2
    assert result["auto_blocks_agree"]
    lora, fsdp = result["refused"]
    assert "LoRA adapters on a tensor-parallel model" in lora
    assert "fsdp='full_shard' with a tensor-parallel model" in fsdp


@pytest.mark.distributed
def test_a_mixture_of_experts_model_splits_every_expert(tmp_path):
    # Qwen3-MoE with a sparse layer 0 and a dense layer 1: the experts split as plain tensors, one all-reduce per block
    make_checkpoint(tmp_path / "ckpt", "qwen3_moe", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                    head_dim=16, mlp_only_layers=[1])
    result = _torchrun_worker(tmp_path / "ckpt", tmp_path / "result.json", processes=2)
    assert result["logits_diff"] < 1e-5 * max(1.0, result["logits_scale"])
    assert result["tokens_equal"] and result["batch_tokens_equal"] and result["engine_equal"]
    assert result["expert_shapes"] == [[16, 64], [64, 16]] and result["experts_plain"]
    assert result["local_shapes"]["gate_proj"] == [48, 64]  # the dense layer: a DTensor slice, as before
    assert result["saved_logits_diff"] == 0.0  # the experts' slices were gathered into whole weights
    lora, fsdp = result["refused"]
    assert "LoRA adapters on a tensor-parallel model" in lora
    assert "training a tensor-parallel mixture-of-experts model" in fsdp


@pytest.mark.distributed
def test_one_process_under_torchrun_holds_the_whole_layers(tmp_path):
    # torchrun --nproc_per_node=1, as when trying a script: a group of one, every "slice" whole
    make_checkpoint(tmp_path / "ckpt", "llama")
    result = _torchrun_worker(tmp_path / "ckpt", tmp_path / "result.json", processes=1)
    assert result["world_size"] == 1 and result["logits_diff"] == 0.0 and result["tokens_equal"]
    assert result["local_shapes"]["q_proj"] == [64, 64] and result["engine_equal"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_path_loads_slices_onto_the_gpu(tmp_path):
    """One process (the GPU machine has one GPU): NCCL, the mesh on CUDA, the model moved there from the CPU."""
    make_checkpoint(tmp_path / "ckpt", "qwen3")
    result = _torchrun_worker(tmp_path / "ckpt", tmp_path / "result.json", processes=1, cuda=True)
    assert result["device"] == "cuda:0" and result["world_size"] == 1
    assert result["logits_diff"] < 1e-3 * max(1.0, result["logits_scale"])  # cuBLAS vs the CPU, float32
    assert result["tokens_equal"] and result["batch_tokens_equal"]


def test_heads_must_split_evenly():
    from gpuformers.models.config import ModelConfig

    config = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128,
                                    "num_hidden_layers": 1})
    check_tp_size(config, 2)
    with pytest.raises(ValueError, match="num_attention_heads=4, num_key_value_heads=2 to be divisible by 3"):
        check_tp_size(config, 3)


def test_plan_errors_name_the_pattern(tmp_path):
    from gpuformers import AutoModelForCausalLM

    make_checkpoint(tmp_path, "llama")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, progress=False)
    assert _resolve_plan(model, "auto")["model.layers.1.mlp.down_proj"] == "rowwise"
    with pytest.raises(ValueError, match="'diagonal' is not one of"):
        _resolve_plan(model, {"model.layers.*.mlp.up_proj": "diagonal"})
    with pytest.raises(ValueError, match="matches no module"):
        _resolve_plan(model, {"model.layers.*.attn.qkv": "colwise"})
    with pytest.raises(ValueError, match='pass "auto" or a dict'):
        _resolve_plan(model, "sequence")
    with pytest.raises(RuntimeError, match="start the script with torchrun"):
        apply_tensor_parallel(model)  # one process, no group
    # A family whose layers the llama plan does not fit says so instead of splitting them wrongly.
    unplanned = type("UnplannedForCausalLM", (type(model),), {"tp_plan_auto": None})
    model.__class__ = unplanned
    with pytest.raises(NotImplementedError, match='tp_plan="auto" for UnplannedForCausalLM is not supported'):
        _resolve_plan(model, "auto")


def test_from_pretrained_arguments_are_checked(tmp_path, monkeypatch):
    from gpuformers import AutoModelForCausalLM

    make_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="tp_size is only used with tp_plan"):
        AutoModelForCausalLM.from_pretrained(tmp_path, tp_size=2, progress=False)
    with pytest.raises(ValueError, match="tp_plan and device_map cannot be combined"):
        AutoModelForCausalLM.from_pretrained(tmp_path, tp_plan="auto", device_map="cpu", progress=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        AutoModelForCausalLM.from_pretrained(tmp_path, tp_plan="auto", dtype=torch.float32, progress=False)
