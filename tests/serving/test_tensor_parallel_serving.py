"""`gpuformers serve --tensor-parallel-size 2` on the CPU: the command starts itself as 2 torchrun processes (gloo),
each holding half of every split layer; process 0 serves HTTP while the engines step in lockstep. Concurrent
requests get the whole model's greedy tokens, and SIGTERM ends every process cleanly."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.serving.conftest import MODEL_NAME, ServerProcess, greedy_reference

PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,", "Paris is"]


@pytest.mark.distributed
def test_a_model_split_over_two_processes_serves_the_whole_models_tokens(checkpoint, reference):
    _, tokenizer = reference
    server = ServerProcess(checkpoint, "--tensor-parallel-size", "2", "--num-blocks", "64")
    try:
        server.wait_ready(timeout=120)
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)

        def complete(prompt: str) -> str:
            out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0)
            return out.choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: the engines batch them, in lockstep
            texts = list(pool.map(complete, PROMPTS))
        for prompt, text in zip(PROMPTS, texts):
            expected = greedy_reference(reference, tokenizer.encode(prompt), 10)
            assert text == tokenizer.decode(expected, skip_special_tokens=True)
        stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=6, temperature=0.8, seed=3, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        server.process.terminate()  # to the torchrun agent, which passes it on
        try:
            code = server.process.wait(60)
        except subprocess.TimeoutExpired:
            server.process.kill()
            raise
        log = server.output()
        server.log.close()
    assert code == 0, log
    assert "Traceback" not in log, log
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", f"--port {server.port}"], capture_output=True, text=True).stdout.split()
    assert not left, f"processes still running after the server ended: {left}"
