"""CUDA graphs over the compiled engine decoder (engine/cuda_graphs.py, engine/compiled_step.py): with
ContinuousBatchingConfig(compile=True) each decode bucket's graph is captured over the compiled function, so a
replay reruns Inductor's kernels, under the same lazy capture and decision rules as over the eager decoder.

On the CPU the capture is the stand-in of test_cuda_graph_buffers.py (its replay reruns the forward over the static
buffers), with every call of the compiled function and of the eager decoder counted: each capture and each replay
goes through the compiled function and never through the eager stack, one compiled graph serves every bucket (no
recompilation as the bucket changes), and greedy tokens equal generate() under preemption; with the Triton decode
kernel (the interpreter) inside the paged-attention op, one graph per batch bucket. On a GPU (`gpu`-marked,
scripts/gpu_check.sh's `compiled` step) the real capture: float32 tokens equal generate(), bfloat16 at least 90% of
the sequences, the captured graphs recorded through the compiled function."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from gpuformers.engine.config import ContinuousBatchingConfig
from tests.engine.test_cuda_graph_buffers import ReplayedEagerly
from tests.engine.test_engine import greedy_reference, make_prompts, run_staggered, tiny_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


class Calls:
    """Counts the compiled function's calls and the eager decoder's forwards, per phase of the graphs (capture,
    replay); "other" for the runner's own steps (prefill chunks, steps that do not replay)."""

    def __init__(self, runner):
        self.phase = "other"
        self.counts = {}
        compiled_function = runner.compiled.function

        def compiled(*args, **kwargs):
            self._count("compiled")
            return compiled_function(*args, **kwargs)

        runner.compiled.function = compiled
        # The eager stack's calls, seen through a hook: the compiled function calls decoder.forward itself, which
        # runs no hooks (nor does Dynamo guard on them), so only a call of the module as the eager path makes counts.
        self.hook = runner.decoder.register_forward_pre_hook(lambda module, args: self._count("eager"))

    def _count(self, kind: str) -> None:
        key = (self.phase, kind)
        self.counts[key] = self.counts.get(key, 0) + 1

    def __getitem__(self, key) -> int:
        return self.counts.get(key, 0)


def watch(graphs, calls: Calls) -> list[int]:
    """Puts the phases around each capture and replay of `graphs` (the stand-in or the real ones); returns
    [captures, replays], counted in place as the run goes."""
    seen = [0, 0]
    real_capture, real_run = graphs._capture, graphs.run

    def capture(rows, length):
        calls.phase = "capture"
        try:
            graph = real_capture(rows, length)
        finally:
            calls.phase = "other"
        seen[0] += 1
        real_replay = graph.replay

        class Replay:
            def replay(self):
                calls.phase = "replay"
                try:
                    real_replay()
                finally:
                    calls.phase = "other"
                seen[1] += 1

        return Replay()

    def run(input_ids, position_ids, context, states=None):
        calls.phase = "probe" if graphs.per_context is None else "other"  # the first decode's probe runs the forward
        try:
            return real_run(input_ids, position_ids, context, states)
        finally:
            calls.phase = "other"

    graphs._capture, graphs.run = capture, run
    return seen


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@dataclass
class CountedRun:
    manager: object
    outputs: list
    calls: Calls
    captures: int
    replays: int
    compiled_graphs: int  # graphs Dynamo compiled over the run


def run_compiled(model, prompts, graphs_class=None, **config) -> CountedRun:
    """Staggered requests through a compiled engine, the decoder's calls counted per phase of the graphs.
    graphs_class: the CPU stand-in, put in by hand (None: the config's own graphs)."""
    torch._dynamo.reset()
    before = unique_graphs()  # dynamo's counters outlive reset(): counted from here
    try:
        manager = model.init_continuous_batching(
            continuous_batching_config=ContinuousBatchingConfig(compile=True, **config), eos_token_id=None)
        runner = manager.runner
        assert runner.compiled is not None
        if graphs_class is not None:
            assert manager.config.use_cuda_graph is False  # the CPU default
            runner.graphs = graphs_class(runner, manager.config.max_requests_per_batch)
        calls = Calls(runner)
        seen = watch(runner.graphs, calls)
        try:
            outputs = run_staggered(manager, prompts)
        finally:
            calls.hook.remove()
        return CountedRun(manager, outputs, calls, *seen, unique_graphs() - before)
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_decode_graphs_are_captured_over_the_compiled_decoder():
    model = tiny_model()
    prompts = make_prompts(24, seed=3)
    reference = greedy_reference(model, prompts)
    run = run_compiled(model, prompts, ReplayedEagerly, block_size=8, num_blocks=12, max_batch_tokens=24,
                       max_requests_per_batch=16)
    manager, calls, graphs = run.manager, run.calls, run.manager.runner.graphs
    for i, (output, expected) in enumerate(zip(run.outputs, reference)):
        assert output.generated_tokens == expected, f"request {i} (prompt length {len(prompts[i])})"
    assert manager.num_preemptions > 0
    assert not graphs.failed and run.captures and run.replays > run.captures, (run.captures, run.replays)
    assert len({rows for rows, _ in graphs.graphs}) > 1, "decodes met one batch bucket only"
    # Every capture (the stand-in runs the forward once, as the real capture's warm-up and recording do: twice) and
    # every replay ran the compiled function, never the eager stack; so did the first decode's probe.
    assert calls["capture", "compiled"] == run.captures and calls["replay", "compiled"] == run.replays
    assert calls["probe", "compiled"] == 1
    assert not any(calls[phase, "eager"] for phase in ("capture", "replay", "probe"))
    assert calls["other", "compiled"] > 0  # the prefill steps: compiled as before
    # The buckets (1 row padded to 2, 2, 4, 8, 16) and the prefill steps share one graph: nothing recompiled.
    assert run.compiled_graphs == 1
    assert manager.block_manager.num_free_blocks == manager.block_manager.num_blocks


@pytest.mark.slow
def test_the_triton_decode_kernel_runs_inside_the_compiled_graphs(monkeypatch):
    """The path a GPU takes with "paged|sdpa": inside the compiled graph the paged-attention op runs the Triton
    decode kernel (here under the interpreter) over the graph's static block table and context lengths, so one
    graph per batch bucket at the longest context serves every length; tokens equal generate()."""
    pytest.importorskip("triton")
    from gpuformers.engine import paged_attention
    from gpuformers.kernels.checks import triton_runs_on

    if not triton_runs_on("cpu")[0]:
        pytest.skip(triton_runs_on("cpu")[1])
    monkeypatch.setattr(paged_attention, "_triton_kernels_available", lambda query: True)
    model = tiny_model()
    prompts = make_prompts(6, seed=5)  # few: the interpreter runs each kernel program in Python
    reference = greedy_reference(model, prompts)
    run = run_compiled(model, prompts, ReplayedEagerly, block_size=16, num_blocks=24, max_batch_tokens=64)
    graphs = run.manager.runner.graphs
    assert [o.generated_tokens for o in run.outputs] == reference
    assert graphs.per_context is False and run.captures and run.replays > run.captures
    assert {length for _, length in graphs.graphs} == {graphs.context_buckets[-1]}
    assert run.calls["capture", "compiled"] == run.captures and run.calls["replay", "compiled"] == run.replays
    assert not any(run.calls[phase, "eager"] for phase in ("capture", "replay", "probe"))
    assert run.compiled_graphs == 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_cuda_graphs_on_gpu(dtype):
    """The real capture over the compiled decoder (Inductor's Triton kernels and the paged ops' Triton kernels over
    the static context): greedy tokens equal generate() in float32, at least 90% of the sequences in bfloat16
    (a fused graph rounds differently from the eager ops); every graph was recorded through the compiled function,
    and nothing recompiled inside a capture (a compile there would fail it, and decode would go eager)."""
    model = tiny_model().to("cuda", dtype)
    prompts = make_prompts(40, seed=4)
    reference = greedy_reference(model, prompts)
    run = run_compiled(model, prompts, block_size=16, num_blocks=24, max_batch_tokens=64, use_cuda_graph=True)
    calls, graphs = run.calls, run.manager.runner.graphs
    assert [o.error for o in run.outputs] == [None] * len(prompts)
    same = sum(o.generated_tokens == r for o, r in zip(run.outputs, reference))
    assert same == len(prompts) if dtype == torch.float32 else same >= 0.9 * len(prompts), same
    assert not graphs.failed, "a capture over the compiled decoder failed (logged): decode went eager"
    assert run.captures and run.replays >= run.captures and any(rows > 1 for rows, _ in graphs.graphs)
    # The real capture runs the forward twice (warm-up on a side stream, then the recording)
    assert calls["capture", "compiled"] == 2 * run.captures and not calls["capture", "eager"]
    assert calls["replay", "compiled"] == 0  # a replay launches the recorded kernels: no Python runs
    assert run.compiled_graphs == 1
