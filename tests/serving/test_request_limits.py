"""Request limits of `gpuformers serve` and what a request that leaves out temperature gets, on the apps in-process
(the scripted engine and real Qwen3 tokenizer of test_tool_calls.py, and a real engine on a tiny random model):
an empty API key is refused before the server starts; the 404 of an unknown model repeats a bounded part of its
name; a prompt of more characters than can fit the context is a 400 before any tokenizing (chat, completions,
responses, embeddings), while the densest prompt that fits still passes; an omitted temperature, top_p, top_k,
max_tokens comes from the model's generation_config.json (do_sample false: greedy), else OpenAI's defaults, and
a value the request sends wins."""

from __future__ import annotations

import copy
import json

import pytest

from gpuformers.serving.prompt_chars import NORMALIZER_FACTOR, PromptChars
from gpuformers.serving.request_fields import MAX_SHOWN
from tests.serving.test_tool_calls import ScriptedManager, qwen3_tokenizer  # noqa: F401 (a fixture)

USER = [{"role": "user", "content": "What is the capital of France?"}]


class RecordingManager(ScriptedManager):
    """The scripted engine, keeping each request's sampling settings; `generation_config` as the model's."""

    def __init__(self, tokenizer, answers, generation_config=None):
        super().__init__(tokenizer, answers)
        self.adapters: dict = {}  # LoRA adapters: none
        self.sampling: list[dict] = []
        if generation_config is not None:
            self.generation_config = generation_config

    def add_request(self, prompt_ids, request_id, on_output=None, **sampling):
        self.sampling.append(sampling)
        return super().add_request(prompt_ids, request_id, on_output=on_output, **sampling)


class CountingTokenizer:
    """A tokenizer whose tokenizing calls are counted (everything else is the wrapped tokenizer's)."""

    def __init__(self, tokenizer):
        self._tokenizer, self.calls = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self._tokenizer.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)


def http_for(manager, tokenizer, **app_options):
    from fastapi.testclient import TestClient

    from gpuformers.serving.server import build_app

    return TestClient(build_app(manager, tokenizer, "m", **app_options), base_url="http://testserver")


# ------------------------------------------------------------------------------------------------------ API key

def test_an_empty_api_key_is_refused_before_the_model_loads(monkeypatch, capsys):
    from gpuformers.cli import main

    monkeypatch.delenv("GPUFORMERS_DEBUG", raising=False)
    monkeypatch.delenv("GPUFORMERS_API_KEY", raising=False)
    # a model that does not exist: the refusal must come before anything tries to load it
    assert main(["serve", "/no/such/model", "--api-key", ""]) == 2
    assert "the API key (--api-key, or $GPUFORMERS_API_KEY) is ''" in capsys.readouterr().err
    monkeypatch.setenv("GPUFORMERS_API_KEY", "")
    assert main(["serve", "/no/such/model"]) == 2
    assert "an empty key would let in 'Authorization: Bearer '" in capsys.readouterr().err
    monkeypatch.setenv("GPUFORMERS_API_KEY", " secret ")
    assert main(["serve", "/no/such/model"]) == 2
    assert "has spaces around it" in capsys.readouterr().err


def test_the_apps_refuse_an_empty_api_key_and_an_empty_token(qwen3_tokenizer):  # noqa: F811
    from gpuformers.serving.embedding_app import build_embedding_app

    with pytest.raises(ValueError, match="an empty key would let in"):
        http_for(ScriptedManager(qwen3_tokenizer, ["Paris"]), qwen3_tokenizer, api_key="")
    with pytest.raises(ValueError, match="an empty key would let in"):
        build_embedding_app(None, "m", api_key="  ")
    http = http_for(RecordingManager(qwen3_tokenizer, ["Paris"]), qwen3_tokenizer, api_key="secret")
    for header in ("Bearer ", "Bearer", "bearer  "):
        assert http.get("/v1/models", headers={"Authorization": header}).status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200


# ------------------------------------------------------------------------------------------ echoed model name

def test_an_unknown_models_404_repeats_a_bounded_part_of_its_name(qwen3_tokenizer):  # noqa: F811
    http = http_for(RecordingManager(qwen3_tokenizer, ["Paris"]), qwen3_tokenizer)
    name = "x" * 1_000_000
    response = http.post("/v1/chat/completions", json={"model": name, "messages": USER})
    error = response.json()["error"]
    assert response.status_code == 404 and error["code"] == "model_not_found"
    assert len(error["message"]) < 2 * MAX_SHOWN + 200 and "(1000000 characters)" in error["message"]
    assert error["message"].endswith("this server serves 'm'")  # the part that tells the fix is kept


# --------------------------------------------------------------------------------------- the character bound

MAX_MODEL_LEN = 32


def tiny_model(head):
    """A random Qwen3 of the Qwen3 tokenizer's vocabulary, small enough to build in a blink (`head`: AutoModel or
    AutoModelForCausalLM); its logits are near uniform over 151k tokens."""
    import torch

    from gpuformers.models.config import ModelConfig

    config = ModelConfig.from_dict(dict(model_type="qwen3", vocab_size=151936, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=8, max_position_embeddings=256, tie_word_embeddings=True))
    torch.manual_seed(0)
    return head.from_config(config).eval()


@pytest.fixture(scope="module")
def bound(qwen3_tokenizer):  # noqa: F811
    """The character bound of a MAX_MODEL_LEN context (its vocabulary read once for the module)."""
    bound = PromptChars(qwen3_tokenizer, MAX_MODEL_LEN)
    assert bound.limit == MAX_MODEL_LEN * len(max(qwen3_tokenizer.get_vocab(), key=len)) * NORMALIZER_FACTOR
    return bound


def test_the_densest_prompt_that_fits_is_under_the_bound(qwen3_tokenizer, bound):  # noqa: F811
    """The text of one of the vocabulary's longest tokens, repeated: as many characters per token as a text can
    have; a context of as many tokens as it takes still has room for it under the bound."""
    for longest in sorted(qwen3_tokenizer.get_vocab(), key=len)[-3:]:
        text = qwen3_tokenizer.decode(qwen3_tokenizer.convert_tokens_to_ids([longest]) * MAX_MODEL_LEN)
        tokens = len(qwen3_tokenizer.encode(text))
        assert len(text) <= tokens * bound.longest_token * NORMALIZER_FACTOR  # the limit of a `tokens` context
    assert bound.fits(bound.limit) and not bound.fits(bound.limit + 1)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": text}]}, "messages"),
    ("/v1/completions", lambda text: {"prompt": text}, "prompt"),
    ("/v1/responses", lambda text: {"input": text, "instructions": "Be brief."}, "input"),
])
def test_a_prompt_longer_than_can_fit_is_refused_before_tokenizing(qwen3_tokenizer, bound, route, body,  # noqa: F811
                                                                  param):
    tokenizer = CountingTokenizer(qwen3_tokenizer)
    http = http_for(RecordingManager(qwen3_tokenizer, ["Paris"]), tokenizer, max_model_len=MAX_MODEL_LEN)
    limit = bound.limit
    calls = tokenizer.calls  # building the app renders the chat template once
    response = http.post(route, json={"model": "m", **body("a" * (limit + 1))})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == param
    assert f"more than any prompt that fits this model's context of {MAX_MODEL_LEN} tokens" in error["message"]
    assert tokenizer.calls == calls
    # a prompt under the bound is tokenized and answered
    assert http.post(route, json={"model": "m", **body("Hello")}).status_code == 200 and tokenizer.calls == calls + 1


def test_an_embedding_input_longer_than_can_fit_is_refused_or_cut_before_tokenizing(bound,
                                                                                    qwen3_tokenizer):  # noqa: F811
    from fastapi.testclient import TestClient

    from gpuformers.models.auto import AutoModel
    from gpuformers.serving.embedding_app import build_embedding_app
    from gpuformers.serving.embeddings import Embedder
    from gpuformers.serving.pooling import Pooling

    tokenizer = copy.copy(qwen3_tokenizer)  # its encode is wrapped below
    embedder = Embedder(tiny_model(AutoModel), tokenizer, Pooling(), MAX_MODEL_LEN)
    seen: list[int] = []
    tokenizer.encode = lambda text, **kwargs: seen.append(len(text)) or qwen3_tokenizer.encode(text, **kwargs)
    http = TestClient(build_embedding_app(embedder, "m"), base_url="http://testserver")
    limit = bound.limit
    long = "word " * (limit // 5 + 1)
    response = http.post("/v1/embeddings", json={"model": "m", "input": ["Hello", long]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert error["message"].startswith(f"the input[1] has {len(long)} characters") and seen == []
    # with truncate_prompt_tokens the input is embedded from its first tokens, read from a bounded prefix
    longer = long * 3
    cut = http.post("/v1/embeddings", json={"model": "m", "input": longer, "truncate_prompt_tokens": 8})
    whole = http.post("/v1/embeddings", json={"model": "m", "input": "word " * 8, "truncate_prompt_tokens": 8})
    assert cut.status_code == 200 and seen[0] == 2 * limit < len(longer)
    assert cut.json()["usage"] == whole.json()["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    assert cut.json()["data"][0]["embedding"] == pytest.approx(whole.json()["data"][0]["embedding"], abs=1e-6)
    unknown = http.post("/v1/embeddings", json={"model": "x" * 1_000_000, "input": "Hello"})
    assert unknown.status_code == 404 and len(unknown.json()["error"]["message"]) < 2 * MAX_SHOWN + 200


# ------------------------------------------------------------------------------------------ sampling defaults

def generation_config(folder, **fields):
    from gpuformers.generation.config import GenerationConfig

    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 151645, **fields}))
    return GenerationConfig.from_pretrained(folder)


@pytest.mark.parametrize("fields, expected", [
    ({}, {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}),  # OpenAI's
    ({"do_sample": False, "temperature": 0.6}, {"do_sample": False}),  # greedy, as the model's generate()
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20},
     {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}),  # Qwen3's generation_config.json
    ({"temperature": 0.7}, {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0}),
], ids=["none", "greedy", "qwen3", "temperature-only"])
def test_an_omitted_temperature_uses_the_models_generation_config(qwen3_tokenizer, tmp_path, fields,  # noqa: F811
                                                                 expected):
    manager = RecordingManager(qwen3_tokenizer, ["Paris"], generation_config(tmp_path, **fields))
    http = http_for(manager, qwen3_tokenizer)
    assert http.post("/v1/chat/completions", json={"model": "m", "messages": USER}).status_code == 200
    sent = {name: manager.sampling[0][name] for name in ("do_sample", "temperature", "top_p", "top_k")
            if name in manager.sampling[0]}
    assert sent == expected
    # a value the request sends wins, whatever the file says; -1 is vLLM's "top_k off"
    explicit = {"temperature": 1.0, "top_p": 0.5, "top_k": -1}
    assert http.post("/v1/chat/completions", json={"model": "m", "messages": USER, **explicit}).status_code == 200
    assert {name: manager.sampling[1][name] for name in ("do_sample", "temperature", "top_p", "top_k")} == \
        {"do_sample": True, "temperature": 1.0, "top_p": 0.5, "top_k": 0}


def test_the_response_object_and_max_tokens_follow_the_generation_config(qwen3_tokenizer, tmp_path):  # noqa: F811
    config = generation_config(tmp_path, do_sample=True, temperature=0.6, top_p=0.95, max_new_tokens=7)
    manager = RecordingManager(qwen3_tokenizer, ["Paris"], config)
    http = http_for(manager, qwen3_tokenizer)
    out = http.post("/v1/responses", json={"model": "m", "input": "Capital of France?"}).json()
    assert (out["temperature"], out["top_p"]) == (0.6, 0.95)  # what was used, not null
    assert manager.sampling[0]["max_new_tokens"] == 7  # max_new_tokens caps an omitted max_tokens, as in vLLM
    http.post("/v1/completions", json={"model": "m", "prompt": "Capital of France?"})
    assert manager.sampling[1]["max_new_tokens"] == 7  # under OpenAI's 16
    http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 20})
    assert manager.sampling[2]["max_new_tokens"] == 20  # a max_tokens the request sends wins


def test_a_greedy_generation_config_gives_greedy_answers_on_the_engine(tmp_path, qwen3_tokenizer):  # noqa: F811
    """A random model (logits near uniform over 151k tokens) whose generation_config.json says do_sample false: a
    request without temperature gets model.generate's greedy tokens, whatever its seed."""
    import torch
    from fastapi.testclient import TestClient

    from gpuformers import AutoModelForCausalLM
    from gpuformers.serving.server import build_app

    model = tiny_model(AutoModelForCausalLM)
    model.generation_config = generation_config(tmp_path, do_sample=False)  # as from_pretrained reads it
    prompt = [785, 6722, 315, 9625, 374]
    with torch.inference_mode():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    manager = model.init_continuous_batching(block_size=16, num_blocks=8)
    with TestClient(build_app(manager, qwen3_tokenizer, "m"), base_url="http://testserver") as http:
        answers = [http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 6, "seed": seed})
                   for seed in (1, 2)]
    expected = qwen3_tokenizer.decode([t for t in greedy if t != 151645], skip_special_tokens=True)
    assert [a.json()["choices"][0]["text"] for a in answers] == [expected, expected]
