"""pipeline("text-generation"): strings and chats in, transformers' output format out, the same tokens as
model.generate, loading from a folder, and the device rules.

Uses the real Qwen3 tokenizer (fetched by scripts/fetch_test_assets.sh; skipped when absent) with a tiny random
Qwen3 model whose vocabulary covers it.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from gpuformers.pipeline import pipeline
from tests.assets import qwen3_tokenizer_dir
from tests.fixtures.checkpoints import hf_config

SHAPE = dict(vocab_size=151936, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A folder with a tiny random Qwen3 checkpoint (saved by transformers) and the Qwen3 tokenizer files."""
    import transformers

    tokenizer_dir = qwen3_tokenizer_dir()
    folder = tmp_path_factory.mktemp("qwen3-pipeline")
    torch.manual_seed(0)
    config = hf_config("qwen3", eos_token_id=151645, pad_token_id=151643, **SHAPE)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def generator(checkpoint):
    return pipeline("text-generation", model=str(checkpoint), do_sample=False)


def test_string_prompt_gives_prompt_plus_generated_text(generator):
    prompt = "The capital of France is"
    out = generator(prompt, max_new_tokens=8)
    assert isinstance(out, list) and len(out) == 1 and set(out[0]) == {"generated_text"}
    ids = torch.tensor([generator.tokenizer(prompt)["input_ids"]])
    tokens = generator.model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    new_text = generator.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
    assert out[0]["generated_text"] == prompt + new_text
    assert generator(prompt, max_new_tokens=8, return_full_text=False) == [{"generated_text": new_text}]


def test_chat_appends_the_assistant_reply(generator):
    out = generator(CHAT, max_new_tokens=6)
    messages = out[0]["generated_text"]
    assert messages[:2] == CHAT and messages[2]["role"] == "assistant" and len(messages) == 3
    ids = generator.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    ids = torch.tensor([ids])
    tokens = generator.model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert messages[2]["content"] == generator.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
    # a chat that ends with an assistant message is continued, not answered
    prefill = CHAT + [{"role": "assistant", "content": "It is"}]
    continued = generator(prefill, max_new_tokens=3)[0]["generated_text"]
    assert len(continued) == 3 and continued[2]["content"].startswith("It is")


def test_lists_give_one_result_list_per_input_and_batching_keeps_them_apart(generator):
    inputs = ["Hello", CHAT, "A much longer prompt about the weather in Paris"]
    one_by_one = generator(inputs, max_new_tokens=4)
    assert len(one_by_one) == 3 and all(len(r) == 1 for r in one_by_one)
    assert one_by_one[0][0]["generated_text"].startswith("Hello")
    assert one_by_one[1][0]["generated_text"][:2] == CHAT
    batched = generator(inputs, max_new_tokens=4, batch_size=3)  # left-padded into one generate call
    assert [r[0]["generated_text"] for r in batched] == [r[0]["generated_text"] for r in one_by_one]
    torch.manual_seed(0)
    sampled = generator("Hello", max_new_tokens=4, do_sample=True, num_return_sequences=3)
    assert len(sampled) == 3 and all(r["generated_text"].startswith("Hello") for r in sampled)


def test_model_object_and_defaults(checkpoint):
    from gpuformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    generator = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(checkpoint))
    assert generator.device == torch.device("cpu")  # no GPU here
    kwargs = generator._generation_kwargs({})
    assert kwargs["max_new_tokens"] == 256 and kwargs["do_sample"] is True and kwargs["temperature"] == 0.7
    greedy = generator._generation_kwargs({"do_sample": False, "max_length": 30})
    assert "temperature" not in greedy and "max_new_tokens" not in greedy
    # a model object without a tokenizer finds it in the folder it came from
    assert pipeline("text-generation", model=model).tokenizer is not None


def test_argument_errors(checkpoint):
    with pytest.raises(ValueError, match="either device='cpu' or device_map='cpu'"):
        pipeline("text-generation", model=str(checkpoint), device="cpu", device_map="cpu")
    with pytest.raises(ValueError, match="task 'summarization' is not supported"):
        pipeline("summarization", model=str(checkpoint))
    generator = pipeline("text-generation", model=str(checkpoint), device="cpu")
    with pytest.raises(TypeError, match="strings or chats"):
        generator([42])
