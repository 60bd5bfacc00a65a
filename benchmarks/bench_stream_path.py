"""Benchmark: an API server's CPU per engine output of a streamed answer, against the answer's length, without
sockets or processes: what `gpuformers serve --api-server-count N` does in an API server for each token of each
stream, from the core's row to the chunk handed to the connection's writer.

How. N streamed /v1/completions jobs (job.Job, include_usage) wait in their SSE coroutines, each with a direct
writer that takes every chunk (SSEResponse's, minus the socket); each engine step, every request's row (one new
token of the real Qwen3 tokenizer's ids for English prose and code) goes through OutputAssembly.add and the job's
on_output, as EngineClient._deliver does: the chunk is made and written in the callback (Job.put_nowait), or, when
the coroutine is not waiting, through it. The process's CPU time over the steps divided by the outputs is the
figure; the socket's send, msgpack and ZMQ are not in it. A cost that grows with the answer's length (a copy of
the whole answer per token) shows as a larger figure at the longer lengths.

    python benchmarks/bench_stream_path.py                          # 256 streams, answers of 128, 1024, 4096
    python benchmarks/bench_stream_path.py --streams 64 --lengths 8192
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from types import SimpleNamespace

from bench_serving_host import TOKENIZER_DIR  # (this folder is on sys.path when a benchmark runs as a script)


class Manager:
    """The API server's EngineClient as a Job sees it: requests added with an on_output called in the loop."""

    outputs_in_loop = True

    def __init__(self):
        self.callbacks = {}

    def add_request(self, prompt_ids, request_id, streaming, on_output, **sampling):
        self.callbacks[request_id] = on_output

    def cancel_request(self, request_id):
        pass

    def is_running(self):
        return True


async def measure(tokenizer, ids: list[int], streams: int, length: int) -> float:
    """us of CPU per engine output over `length` - 1 steps of `streams` streams."""
    from gpuformers.engine.sequence import RequestStatus
    from gpuformers.serving.engine_wire import STATUSES, OutputAssembly
    from gpuformers.serving.job import Engine, Job
    from gpuformers.serving.metrics import Metrics
    from gpuformers.serving.protocol import parse_completion
    from gpuformers.serving.token_texts import TokenTexts

    manager = Manager()
    state = SimpleNamespace(tokenizer=tokenizer, eos_ids=set(), engine=Engine(manager, 1 << 20), metrics=Metrics(),
                            token_texts=TokenTexts(tokenizer), vocab_size=len(tokenizer), manager=manager)
    written = [0]

    def writer(data: bytes) -> bool:
        written[0] += 1
        return True

    async def not_disconnected():
        return False

    request = SimpleNamespace(scope={}, is_disconnected=not_disconnected)
    loop, tasks = asyncio.get_running_loop(), []
    for _ in range(streams):
        parsed = parse_completion({"model": "m", "prompt": [1, 2, 3], "max_tokens": length, "stream": True,
                                   "stream_options": {"include_usage": True}})
        job = Job(state, parsed, [[1, 2, 3]], [length], loop)
        job.start(lambda parsed, index, max_tokens: {})
        job.stream_to(writer)

        async def consume(job=job):
            async for _ in job.sse(request):
                pass

        tasks.append(asyncio.ensure_future(consume()))
    await asyncio.sleep(0.01)  # every coroutine waits for its first output
    assemblies = [OutputAssembly(request_id, [1, 2, 3]) for request_id in manager.callbacks]
    callbacks = list(manager.callbacks.values())
    decoding = STATUSES.index(RequestStatus.DECODING)
    cpu = time.process_time()
    for step in range(length - 1):  # (the last output ends the stream through the coroutine: not timed)
        token = ids[step % len(ids)]
        for assembly, on_output in zip(assemblies, callbacks):
            on_output(assembly.add([assembly.request_id, decoding, [token], [], None, [], None, None, 0.0, None]))
        await asyncio.sleep(0)  # the loop's other work between two core messages
    used = time.process_time() - cpu
    for task in tasks:
        task.cancel()
    assert written[0] > 0.9 * streams * (length - 1), written[0]  # nearly every output became a chunk
    return 1e6 * used / (streams * (length - 1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096], help="tokens per answer")
    args = parser.parse_args(argv)
    if not TOKENIZER_DIR.exists():
        sys.exit(f"the Qwen3 tokenizer is missing at {TOKENIZER_DIR}; fetch it with scripts/fetch_test_assets.sh")
    from gpuformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    text = "The quick brown fox jumps over the lazy dog, twice. " * 30 + "def f(x):\n    return x * 2\n" * 10
    ids = tokenizer.encode(text)
    print(f"an API server's CPU per engine output (us), {args.streams} streamed completions, no sockets")
    print("| answer tokens | us per output |")
    print("| --- | --- |")
    for length in args.lengths:
        print(f"| {length} | {asyncio.run(measure(tokenizer, ids, args.streams, length)):.2f} |", flush=True)


if __name__ == "__main__":
    main()
