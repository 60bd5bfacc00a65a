"""Fixtures for the serving tests: a tiny Qwen3 checkpoint with the real Qwen3 tokenizer, `gpuformers serve`
started on it as real processes on 127.0.0.1, and the same model loaded here as the greedy reference.

The checkpoint's lm_head is scaled up so that its logits are far apart: a random model's near-uniform logits would
let float rounding differences between the engine's paged attention and generate() flip a greedy argmax."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

MODEL_NAME = "tiny-qwen3"
API_KEY = "test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m gpuformers serve ...` in a child process; `url` is its /v1 base."""

    def __init__(self, folder: Path, *extra: str, model: str | None = None, gpus: str = ""):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        # GPUFORMERS_TEST_API_SERVER_COUNT=2: every generation server of the suite with its HTTP front end in API
        # server processes of its own (test_api_server_processes.py runs a share of the suite so in CI)
        count = os.environ.get("GPUFORMERS_TEST_API_SERVER_COUNT")
        if count and not {"--api-server-count", "--task", "--tensor-parallel-size",
                          "--allow-runtime-lora-updating"} & set(extra):
            extra = (*extra, "--api-server-count", count)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GPUFORMERS_DEBUG": "1"}
        env.pop("GPUFORMERS_API_KEY", None)
        # gpus "" hides the GPUs (a CPU server); None leaves CUDA_VISIBLE_DEVICES as it is.
        command = [sys.executable, "-m", "gpuformers", *(["--gpus", gpus] if gpus is not None else []), "serve",
                   model or str(folder), "--port", str(self.port),
                   "--served-model-name", MODEL_NAME, "--log-level", "warning", *extra]
        self.log = open(folder / f"server-{self.port}.log", "w+")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 90.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, name -> value."""
        text = httpx.get(f"{self.base}/metrics", timeout=5).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#") and "{" not in line}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="package")
def checkpoint(tmp_path_factory) -> Path:
    from safetensors.torch import load_file, save_file

    from gpuformers import AutoTokenizer
    from tests.assets import qwen3_tokenizer_dir
    from tests.fixtures.checkpoints import make_checkpoint

    tokenizer_dir = qwen3_tokenizer_dir()
    folder = tmp_path_factory.mktemp("serve-ckpt")
    make_checkpoint(folder, "qwen3", vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                    tie_word_embeddings=False)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 200.0  # logits far apart: see the module docstring
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.fixture(scope="package")
def servers(checkpoint):
    """(main, guarded): main has no key and room for the load test; guarded has --api-key and --max-pending 1.
    Both start at once: each spends seconds importing torch and loading."""
    main = ServerProcess(checkpoint, "--num-blocks", "160")
    guarded = ServerProcess(checkpoint, "--num-blocks", "32", "--api-key", API_KEY, "--max-pending", "1")
    try:
        yield main.wait_ready(), guarded.wait_ready()
    finally:
        main.stop()
        guarded.stop()


@pytest.fixture(scope="package")
def server(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="package")
def reference(checkpoint):
    """(model, tokenizer) loaded in this process, for greedy references."""
    import torch

    from gpuformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(checkpoint, progress=False), AutoTokenizer.from_pretrained(checkpoint)


def greedy_reference(reference, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """model.generate's greedy continuation, stopped at eos like the server."""
    import torch

    model, _ = reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()
