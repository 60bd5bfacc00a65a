"""/tokenize and /detokenize (vLLM's shapes) on the real Qwen3 tokenizer: a text's ids are the tokenizer's, a chat's
ids are exactly the prompt /v1/chat/completions hands the engine for the same messages, ids decode back, and bad
requests are 4xx naming the field. Also: best_of other than n is refused by name instead of silently ignored."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from tests.serving.test_tool_calls import ScriptedManager, qwen3_tokenizer  # noqa: E402,F401

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture()
def served(qwen3_tokenizer):
    """(http client, manager) for an in-process app over a scripted engine, with an API key."""
    from fastapi.testclient import TestClient

    from gpuformers.serving.server import build_app

    manager = ScriptedManager(qwen3_tokenizer, ["It is sunny."])
    manager.adapters = ["an-adapter"]  # a LoRA adapter is a model of its own name, with the same tokenizer
    app = build_app(manager, qwen3_tokenizer, "m", max_model_len=4096, api_key="k")
    return TestClient(app, headers={"Authorization": "Bearer k"}), manager


def test_text_ids_are_the_tokenizers(served, qwen3_tokenizer):
    client, _ = served
    text = "Hello, world! Ünïcödé and    spaces."
    answer = client.post("/tokenize", json={"model": "m", "prompt": text, "return_token_strs": True}).json()
    ids = qwen3_tokenizer.encode(text, add_special_tokens=True)
    assert answer["tokens"] == ids and answer["count"] == len(ids) and answer["max_model_len"] == 4096
    assert "".join(answer["token_strs"]) == text  # each id's own text, in order, spells the prompt
    plain = client.post("/tokenize", json={"prompt": text}).json()  # model may be left out, as in vLLM
    assert plain["tokens"] == ids and plain["token_strs"] is None
    assert client.post("/tokenize", json={"model": "an-adapter", "prompt": text}).json()["tokens"] == ids


def test_chat_ids_are_what_the_chat_endpoint_sends_the_engine(served, qwen3_tokenizer):
    client, manager = served
    counted = client.post("/tokenize", json={"model": "m", "messages": MESSAGES}).json()
    reply = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 8})
    assert reply.status_code == 200, reply.text
    assert qwen3_tokenizer.decode(counted["tokens"]) == manager.prompts[0]
    assert reply.json()["usage"]["prompt_tokens"] == counted["count"]
    expected = qwen3_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert counted["tokens"] == list(expected)


def test_chat_without_generation_prompt_and_continuing_the_last_message(served, qwen3_tokenizer):
    client, _ = served
    no_prompt = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == list(qwen3_tokenizer.apply_chat_template(MESSAGES, return_dict=False))
    partial = MESSAGES + [{"role": "assistant", "content": "It is"}]
    continued = client.post("/tokenize", json={"messages": partial, "add_generation_prompt": False,
                                               "continue_final_message": True}).json()
    assert qwen3_tokenizer.decode(continued["tokens"]).endswith("It is")
    both = client.post("/tokenize", json={"messages": partial, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_detokenize_reads_ids_back(served, qwen3_tokenizer):
    client, _ = served
    ids = qwen3_tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    assert client.post("/detokenize", json={"model": "m", "tokens": ids}).json() == {
        "prompt": "The capital of France is Paris."}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "colour": 1}, 400, "colour"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
])
def test_bad_requests_are_4xx_naming_the_field(served, path, body, status, param):
    client, _ = served
    reply = client.post(path, json=body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_the_api_key_guards_them(served):
    client, _ = served
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert client.post(path, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401


@pytest.mark.parametrize("path, fields", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_best_of_other_than_n_is_refused_by_name(served, path, fields):
    client, manager = served
    refused = client.post(path, json={"model": "m", "max_tokens": 4, "best_of": 3, **fields})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"
    assert "best_of=3" in refused.json()["error"]["message"] and not manager.prompts
    same = client.post(path, json={"model": "m", "max_tokens": 4, "best_of": 2, "n": 2, **fields})
    assert same.status_code == 200 and len(same.json()["choices"]) == 2
