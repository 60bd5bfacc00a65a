"""The engine's GPU-only decisions, shown on the CPU: the thread's current CUDA device during a step, the draw a GPU
uses for sampled rows, the KV cache sized from a GPU's free memory (a stand-in model that says it is on cuda:0),
a model spread over devices refused, and the lockstep commands kept off NCCL. The GPU runs are test_engine_gpu.py's."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from gpuformers.engine import config as config_module
from gpuformers.engine import lockstep, model_runner
from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.engine.model_runner import kv_bytes_per_block, step_workspace_bytes
from gpuformers.engine.sampler import _exponential_race, device_scope
from tests.engine.test_engine import NEW_TOKENS, greedy_reference, make_prompts, tiny_model


def test_device_scope_makes_the_models_gpu_current_and_does_nothing_elsewhere():
    scope = device_scope(torch.device("cuda", 1))  # (made, not entered: no GPU here)
    assert isinstance(scope, torch.cuda.device) and scope.idx == 1
    assert isinstance(device_scope(torch.device("cpu")), contextlib.nullcontext)


def test_every_launch_runs_in_the_models_device_scope_in_the_loop_thread(monkeypatch):
    """A thread starts on cuda:0: the engine loop's thread must make the model's GPU current for each step's Triton
    kernels, events and graph captures (a model on cuda:1 would have them run on cuda:0)."""
    model = tiny_model()
    prompts = make_prompts(3)
    entered = []

    def recording_scope(device):
        entered.append((device, threading.current_thread().name))
        return device_scope(device)

    monkeypatch.setattr(model_runner, "device_scope", recording_scope)
    with model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=16) as manager:
        ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS) for p in prompts]
        outputs = [manager.get_result(i, timeout=60) for i in ids]
    assert [o.generated_tokens for o in outputs] == greedy_reference(model, prompts)
    assert len(entered) >= NEW_TOKENS and set(entered) == {(model.device, "continuous-batching")}


def test_the_gpu_draw_is_the_one_multinomial_makes():
    """On a GPU a sampled row is drawn by the exponential race, not torch.multinomial (which read the probabilities
    back in older torch releases): from the same generator state it must pick the same tokens, so seeded requests
    keep their samples."""
    for seed in range(50):
        probs = (3 * torch.randn(500, generator=torch.Generator().manual_seed(1000 + seed))).softmax(-1)
        ours, torchs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        drawn = [int(_exponential_race(probs, ours)) for _ in range(4)]
        assert drawn == [int(torch.multinomial(probs, 1, generator=torchs)[0]) for _ in range(4)]


# --- the KV cache sized from free memory --------------------------------------------------------------------------


def on_cuda(model, dtype=torch.bfloat16):
    """What ContinuousBatchingConfig.resolve reads of a model, saying it sits on cuda:0."""
    return SimpleNamespace(device=torch.device("cuda", 0), config=model.config, dtype=dtype,
                           named_modules=model.named_modules, modules=model.modules)


def with_free_memory(monkeypatch, free: int) -> None:
    monkeypatch.setattr(config_module, "free_memory", lambda device, cap=True: free)


def test_a_gpu_cache_leaves_a_steps_workspace_and_the_scratch_block(monkeypatch):
    model = on_cuda(tiny_model())
    per_block = kv_bytes_per_block(model.config, 256, torch.bfloat16)
    workspace = step_workspace_bytes(model.config, 8192, 256, torch.bfloat16)
    assert workspace > 8192 * model.config.intermediate_size * 2 + 256 * model.config.vocab_size * 4

    with_free_memory(monkeypatch, 40 * workspace)  # max_memory_percent leaves more than the workspace free
    resolved = ContinuousBatchingConfig().resolve(model)
    assert resolved.block_size == 256 and resolved.max_batch_tokens == 8192
    assert resolved.num_blocks == int(40 * workspace * 0.9) // per_block - 1  # the runner adds the scratch block

    with_free_memory(monkeypatch, workspace + 10 * per_block + 7)  # the workspace is more than 10% of the free memory
    assert ContinuousBatchingConfig().resolve(model).num_blocks == 9

    with_free_memory(monkeypatch, workspace + per_block)  # one block and no scratch block
    with pytest.raises(ValueError, match=r"no KV cache block fits on cuda:0: .* stays free for a step's activations"):
        ContinuousBatchingConfig().resolve(model)


def test_a_cpu_cache_counts_the_scratch_block_and_says_when_nothing_fits(monkeypatch):
    model = tiny_model()
    per_block = kv_bytes_per_block(model.config, 64, model.dtype)
    with_free_memory(monkeypatch, 10 * per_block)
    manager = model.init_continuous_batching(max_memory_percent=1.0)
    assert manager.config.num_blocks == 9  # with the scratch block, the cache is the 10 blocks that fit
    with_free_memory(monkeypatch, per_block + per_block // 2)
    with pytest.raises(ValueError, match=r"no KV cache block fits on cpu: .* one block of 64 tokens takes"):
        model.init_continuous_batching()


def test_a_model_spread_over_devices_is_refused():
    model = tiny_model()
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "model.norm": 1, "lm_head": 1}
    with pytest.raises(NotImplementedError, match=r"spread over \['0', '1'\] by device_map"):
        model.init_continuous_batching(num_blocks=8)
    model.hf_device_map = {"": "cpu"}
    assert model.init_continuous_batching(num_blocks=8).config.num_blocks == 8


# --- lockstep -----------------------------------------------------------------------------------------------------


def test_lockstep_commands_go_over_gloo_beside_an_nccl_group(monkeypatch):
    """broadcast_object_list over NCCL round-trips through the GPU each step, waiting for the step in flight."""
    made = []
    nccl, gloo = object(), object()
    monkeypatch.setattr(lockstep.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(lockstep.dist, "get_backend", lambda group=None: "nccl" if group is nccl else "gloo")
    monkeypatch.setattr(lockstep.dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(lockstep.dist, "new_group", lambda **kwargs: made.append(kwargs) or gloo)
    assert lockstep.Lockstep(nccl).group is gloo
    assert made == [{"ranks": [0, 1], "backend": "gloo"}]
    own = object()
    assert lockstep.Lockstep(own).group is own and len(made) == 1  # a gloo group (the CPU) is used as it is
