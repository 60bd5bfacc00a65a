"""Benchmark: the engine's host work per decode step, the part of a step that is Python on the CPU whatever the
device: scheduling, building the step's inputs (tokens, positions, slots, block tables), launching the sampler,
reading the tokens back, and advancing, completing and publishing each request.

On a GPU this is what bounds throughput once the device's step is short: with async batching the host prepares step
N+1 while the device runs step N, so a step takes max(host, device). For Qwen3-0.6B in bfloat16 at 256 running
requests of ~600 tokens, an H200 reads the weights and the KV cache (~17.6 GB) in roughly 5 ms, so host work above
that leaves the GPU idle. The model here is a stand-in whose forward costs nothing (zeros for the hidden states, a
64-wide LM head), so the time measured is the engine's own; the attention and matmuls of a real model are not in it.

Reports milliseconds per step and per phase at each batch size, with the default GPU block size (256 tokens).

    python benchmarks/bench_engine_host.py                       # 64, 128, 256 running requests
    python benchmarks/bench_engine_host.py --rows 256 --block-size 16 --steps 100
    python benchmarks/bench_engine_host.py --rows 256 --core --generated 4000   # serve's engine core, long answers
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from gpuformers.engine import model_runner as runner_module

PHASES = {  # phase name -> (object attribute path on the manager, attribute name)
    "schedule": ("scheduler", "schedule"),
    "prepare inputs": ("runner", "prepare"),
    "carry placeholders": ("runner", "_carry_placeholders"),
    "advance": ("scheduler", "advance"),
    "collect": ("runner", "collect"),
    "complete": ("scheduler", "complete"),
    "publish": (None, "_publish_one"),
}


def stand_in_model(vocab: int):
    """A Qwen3 model of one tiny layer; the engine's runner gets a decoder that returns zeros (see below)."""
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.registry import model_class_for

    config = ModelConfig.from_dict(dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, vocab_size=vocab, head_dim=32,
        max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6))
    torch.manual_seed(0)
    return model_class_for(config)(config).eval()


class ZeroDecoder:
    """Hidden states of zeros for every input token: the step's model work reduced to one allocation."""

    def __init__(self, hidden_size: int):
        self.hidden_size = hidden_size

    def __call__(self, input_ids, position_ids, past_key_values):
        return torch.zeros(*input_ids.shape, self.hidden_size), None


def timed_phases(manager, totals: dict[str, float]) -> None:
    """Wrap each phase's method on the manager's objects so that its time adds to totals[phase]."""
    for phase, (owner, name) in PHASES.items():
        target = manager if owner is None else getattr(manager, owner)
        original = getattr(target, name)

        def wrapped(*args, _original=original, _phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_phase] += time.perf_counter() - start

        setattr(target, name, wrapped)
    original_sample = runner_module.sample_on_device

    def sample(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original_sample(*args, **kwargs)
        finally:
            totals["sample (launch)"] += time.perf_counter() - start

    runner_module.sample_on_device = sample
    runner = manager.runner
    for name in ("decoder", "compute_logits"):  # the stand-in model's work: not the engine's
        original = getattr(runner, name)

        def model_part(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals["model (stand-in)"] += time.perf_counter() - start

        setattr(runner, name, model_part)


def measure(rows: int, block_size: int, steps: int, prompt_range: tuple[int, int], vocab: int,
            streaming: bool, generated: int = 0, core: bool = False) -> dict[str, float]:
    """ms per step, in total and per phase, with `rows` requests decoding (each with `generated` tokens answered
    before the timed steps). `core`: each request's outputs go to a callback as the engine core's
    (serving/engine_core.py) do, and after each step their new tokens become the core's message rows (timed: the
    core does it in the engine's thread)."""
    import collections

    from gpuformers.serving.engine_wire import OutputDeltas
    model = stand_in_model(vocab)
    low, high = prompt_range
    max_len = high + generated + steps + 64
    blocks = rows * (-(-max_len // block_size) + 1)
    manager = model.init_continuous_batching(
        eos_token_id=None, block_size=block_size, num_blocks=blocks, max_batch_tokens=rows * high,
        max_requests_per_batch=rows, use_async_batching=True)
    manager.runner.decoder = ZeroDecoder(model.config.hidden_size)
    rng = random.Random(0)
    pending, deltas = collections.deque(), OutputDeltas()
    for _ in range(rows):
        callback = dict(on_output=pending.append, share_lists=True) if core else {}
        manager.add_request([rng.randrange(vocab) for _ in range(rng.randint(low, high))],
                            max_new_tokens=generated + steps + 32, ignore_eos=True, streaming=streaming, **callback)

    def core_rows():
        while pending:
            deltas.row(pending.popleft())

    def read_streams():  # the readers' work (a server's other thread): untimed
        for stream in manager.outbox.streams.values():
            while not stream.empty():
                stream.get_nowait()

    while any(seq.num_output_tokens == 0 for seq in manager.scheduler.running) or manager.scheduler.waiting:
        manager.step()  # prefill everything, untimed
        core_rows()
    for _ in range(3 + generated):
        manager.step()
        core_rows()
        read_streams()
    assert len(manager.scheduler.running) == rows, "every request should be decoding"
    totals = {phase: 0.0 for phase in [*PHASES, "sample (launch)", "model (stand-in)", "core rows"]}
    timed_phases(manager, totals)
    elapsed = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        manager.step()
        rows_start = time.perf_counter()
        core_rows()
        totals["core rows"] += time.perf_counter() - rows_start
        elapsed += time.perf_counter() - start
        read_streams()
    result = {"step": elapsed / steps * 1e3}
    result.update({phase: seconds / steps * 1e3 for phase, seconds in totals.items()})
    inside_launch = ("prepare inputs", "carry placeholders", "sample (launch)", "model (stand-in)")
    known = sum(seconds for phase, seconds in totals.items() if phase not in inside_launch)
    # the launch's other work (logits rows, the sampling list, context objects) and the loop's
    result["other"] = result["step"] - known / steps * 1e3 - sum(result[phase] for phase in inside_launch)
    result["host"] = result["step"] - result["model (stand-in)"]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256], help="running requests")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed")
    parser.add_argument("--min-prompt", type=int, default=100)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--streaming", action="store_true", help="requests stream (the server's case): each step "
                        "publishes every request's output so far")
    parser.add_argument("--core", action="store_true", help="requests stream to the engine core's callback "
                        "(gpuformers serve --api-server-count N > 1), whose rows for the API servers are made after "
                        "each step (timed as 'core rows')")
    parser.add_argument("--generated", type=int, default=0, help="tokens each request has answered before the "
                        "timed steps (long answers: a reasoning model's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    print(f"engine host work per decode step (ms), block_size {args.block_size}, prompts of "
          f"[{args.min_prompt}, {args.max_prompt}] tokens, {args.generated} answered before, async batching, "
          f"{'streaming, ' if args.streaming else ''}{'to the engine core, ' if args.core else ''}"
          f"a stand-in model with no compute")
    results = {rows: measure(rows, args.block_size, args.steps, (args.min_prompt, args.max_prompt), args.vocab,
                             args.streaming, args.generated, args.core) for rows in args.rows}
    names = list(next(iter(results.values())))
    print("| phase | " + " | ".join(f"{rows} rows" for rows in results) + " |")
    print("| --- |" + " --- |" * len(results))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{r[name]:.2f}" for r in results.values()) + " |")
    print("| host us per row | " + " | ".join(f"{r['host'] / rows * 1e3:.1f}" for rows, r in results.items()) + " |")


if __name__ == "__main__":
    main()
