"""`gpuformers serve --task embed`: POST /v1/embeddings returns transformers.AutoModel's hidden states pooled at
each input's last real token over left-padded batches and L2-normalised (Qwen3-Embedding's recipe), or as the
checkpoint's sentence-transformers modules.json says (mean pooling, no Normalize); dimensions, base64, token id
inputs, the 400s naming the field, --api-key and the openai client's embeddings.create; the input length limit
(sentence_bert_config.json's max_seq_length, --max-model-len), truncate_prompt_tokens cutting texts as
sentence-transformers does, and dimensions allowed for Matryoshka models only, as vLLM allows it.

Two servers on the tiny Qwen3 checkpoint of conftest.py, started at once: `last` (its tokenizer pads on the left
and closes every input with <|endoftext|>, as Qwen3-Embedding's does; --max-model-len 64; --hf-overrides
is_matryoshka) and `mean` (modules.json with mean pooling, right padding, --api-key; config.json's
matryoshka_dimensions [4, 8]; sentence_bert_config.json's max_seq_length 48)."""

from __future__ import annotations

import base64
import json
import re

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.serving.conftest import API_KEY, MODEL_NAME, ServerProcess

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "Embeddings map text to vectors, one per input.",
         "a b c"]
MAX_MODEL_LEN = 64
MAX_SEQ_LENGTH = 48  # the mean folder's sentence_bert_config.json
MATRYOSHKA_DIMENSIONS = [4, 8]  # the mean folder's config.json
# Qwen3-Embedding's tokenizer.json post-processor: every input ends with <|endoftext|>, the token last pooling reads
EOS_TEMPLATE = {"type": "TemplateProcessing",
                "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>",
                                                                                    "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>",
                                                                                  "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": "<|endoftext|>",
                                                                                  "type_id": 1}}],
                "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [151643],
                                                     "tokens": ["<|endoftext|>"]}}}


def _embedding_folder(checkpoint, folder, padding_side: str, **rewritten):
    """The checkpoint's files linked into `folder`, its tokenizer padding on `padding_side`; `rewritten` maps a
    JSON file's name to a function making its new content from the checkpoint's."""
    rewritten["tokenizer_config.json"] = lambda config: {**config, "padding_side": padding_side}
    for file in checkpoint.iterdir():
        if file.name in rewritten:
            (folder / file.name).write_text(json.dumps(rewritten[file.name](json.loads(file.read_text()))))
        elif file.suffix in (".json", ".safetensors", ".jinja"):
            (folder / file.name).symlink_to(file)
    return folder


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory):
    last = _embedding_folder(checkpoint, tmp_path_factory.mktemp("embed-last"), "left",
                             **{"tokenizer.json": lambda tokenizer: {**tokenizer, "post_processor": EOS_TEMPLATE}})
    mean = _embedding_folder(checkpoint, tmp_path_factory.mktemp("embed-mean"), "right",
                             **{"config.json": lambda config: {**config,
                                                               "matryoshka_dimensions": MATRYOSHKA_DIMENSIONS}})
    (mean / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ_LENGTH,
                                                                "do_lower_case": False}))
    (mean / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (mean / "1_Pooling").mkdir()
    (mean / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    return {"last": last, "mean": mean}


@pytest.fixture(scope="module")
def servers(folders):
    last = ServerProcess(folders["last"], "--task", "embed", "--max-model-len", str(MAX_MODEL_LEN),
                         "--hf-overrides", '{"is_matryoshka": true}')
    mean = ServerProcess(folders["mean"], "--task", "embed", "--api-key", API_KEY)
    try:
        yield {"last": last.wait_ready(), "mean": mean.wait_ready()}
    finally:
        last.stop()
        mean.stop()


@pytest.fixture(scope="module")
def expected(folders):
    """transformers' vectors for TEXTS, not normalised: {"last": (4, 32) over one left-padded batch, "mean": (4, 32)
    over one right-padded batch}; and the token ids of TEXTS by each folder's tokenizer ("last_ids" end with
    <|endoftext|>, "mean_ids" do not)."""
    import transformers

    out = {}
    for mode, folder in folders.items():
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        model = transformers.AutoModel.from_pretrained(folder).eval()
        batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
        assert tokenizer.padding_side == {"last": "left", "mean": "right"}[mode]
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state  # (4, seq, 32)
        mask = batch["attention_mask"][..., None].float()
        out[mode] = hidden[:, -1] if mode == "last" else (hidden * mask).sum(1) / mask.sum(1)
        out[f"{mode}_ids"] = [tokenizer.encode(text) for text in TEXTS]
    return out


def _post(server, body, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/embeddings", json={"model": MODEL_NAME, **body}, headers=headers, timeout=60)


def _vectors(response) -> torch.Tensor:
    assert response.status_code == 200, response.text
    body = response.json()
    assert [item["index"] for item in body["data"]] == list(range(len(body["data"])))
    return torch.tensor([item["embedding"] for item in body["data"]])


def test_last_token_pooling_equals_transformers(servers, expected):
    response = _post(servers["last"], {"input": TEXTS})
    body = response.json()
    assert body["object"] == "list" and body["model"] == MODEL_NAME
    assert body["data"][0]["object"] == "embedding"
    tokens = sum(map(len, expected["last_ids"]))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    reference = torch.nn.functional.normalize(expected["last"], dim=-1)
    torch.testing.assert_close(_vectors(response), reference, atol=1e-5, rtol=0)
    # one input alone (no padding) and token ids give the same vectors
    torch.testing.assert_close(_vectors(_post(servers["last"], {"input": TEXTS[1]})), reference[1:2], atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(_vectors(_post(servers["last"], {"input": expected["last_ids"]})), reference, atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(_vectors(_post(servers["last"], {"input": expected["last_ids"][0]})), reference[:1],
                               atol=1e-5, rtol=0)


def test_modules_json_mean_pooling_without_normalize_is_honoured(servers, expected):
    vectors = _vectors(_post(servers["mean"], {"input": TEXTS}, key=API_KEY))
    torch.testing.assert_close(vectors, expected["mean"], atol=1e-5, rtol=0)
    assert not torch.allclose(vectors.norm(dim=-1), torch.ones(len(TEXTS)))  # no Normalize module: raw means


def test_dimensions_keep_the_first_values_and_renormalise(servers, expected):
    vectors = _vectors(_post(servers["last"], {"input": TEXTS, "dimensions": 8}))
    assert vectors.shape == (len(TEXTS), 8)
    torch.testing.assert_close(vectors, torch.nn.functional.normalize(expected["last"][:, :8], dim=-1), atol=1e-5,
                               rtol=0)
    raw = _vectors(_post(servers["mean"], {"input": TEXTS, "dimensions": 8}, key=API_KEY))
    torch.testing.assert_close(raw, expected["mean"][:, :8], atol=1e-5, rtol=0)


def test_base64_is_little_endian_float32(servers):
    floats = _vectors(_post(servers["last"], {"input": TEXTS}))
    body = _post(servers["last"], {"input": TEXTS, "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in body["data"]]
    assert torch.equal(torch.from_numpy(np.stack(decoded)), floats)


@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", "empty list"),
    ({"input": ["fine", ""]}, "input", r"input\[1\] is an empty string"),
    ({"input": ["text", 5]}, "input", r"input\[1\] is int 5 among strings"),
    ({"input": [[1, 2], []]}, "input", r"input\[1\] is an empty token list"),
    ({"input": {"text": "x"}}, "input", "got dict"),
    ({"input": [[1, 2], [151936]]}, "input", r"input\[1\] has token id 151936, outside the vocabulary"),
    ({"input": ["short", "word " * 100]}, "input",
     rf"input\[1\] has 10\d tokens, more than this model's maximum context length of {MAX_MODEL_LEN} tokens"),
    ({"input": "x", "dimensions": 0}, "dimensions", "must be >= 1"),
    ({"input": "x", "dimensions": 33}, "dimensions", "exceeds the model's 32"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "not one of: float, base64"),
    ({"input": "x", "temperature": 1}, "temperature", "unknown field"),
])
def test_bad_requests_are_400s_naming_the_field(servers, body, param, words):
    response = _post(servers["last"], body)
    error = response.json()["error"]
    assert response.status_code == 400, response.text
    assert error["param"] == param and re.search(words, error["message"]), error


def test_routes_of_an_embedding_server(servers):
    server = servers["last"]
    assert _post(server, {"input": "x", "model": "other"}).status_code == 404
    for route in ("completions", "chat/completions", "responses"):
        response = httpx.post(f"{server.url}/{route}", json={"model": MODEL_NAME, "prompt": "x"}, timeout=10)
        assert response.status_code == 400 and "embedding model" in response.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(f"{server.url}/models").json()["data"]] == [MODEL_NAME]
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    assert server.metrics()["gpuformers_prompt_tokens_total"] > 0
    unauthorised = _post(servers["mean"], {"input": "x"})
    assert unauthorised.status_code == 401 and unauthorised.json()["error"]["code"] == "invalid_api_key"


def test_openai_client(servers, expected):
    client = openai.OpenAI(base_url=servers["mean"].url, api_key=API_KEY, max_retries=0, timeout=60)
    reply = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64 by default
    assert reply.usage.prompt_tokens == sum(map(len, expected["mean_ids"]))
    torch.testing.assert_close(torch.tensor([item.embedding for item in reply.data]), expected["mean"], atol=1e-5,
                               rtol=0)
    reply = client.embeddings.create(model=MODEL_NAME, input="Hello", dimensions=4, encoding_format="float")
    assert len(reply.data) == 1 and len(reply.data[0].embedding) == 4


def test_batches_split_by_count_and_tokens_keep_the_order(folders, expected, monkeypatch):
    from gpuformers import AutoModel, AutoTokenizer
    from gpuformers.serving import embeddings
    from gpuformers.serving.embeddings import Embedder
    from gpuformers.serving.pooling import Pooling

    folder = folders["last"]
    embedder = Embedder(AutoModel.from_pretrained(folder, progress=False), AutoTokenizer.from_pretrained(folder),
                        Pooling("last", True))
    reference = torch.nn.functional.normalize(expected["last"], dim=-1)
    rows = expected["last_ids"] * 10  # 40 inputs: two batches of BATCH_SIZE 32
    torch.testing.assert_close(embedder.embed(rows), reference.repeat(10, 1), atol=1e-5, rtol=0)
    monkeypatch.setattr(embeddings, "BATCH_TOKENS", 12)  # batches of one or two inputs, by their lengths
    torch.testing.assert_close(embedder.embed(rows), reference.repeat(10, 1), atol=1e-5, rtol=0)


def test_pooling_reads_each_rows_real_tokens():
    from gpuformers.serving.pooling import pool

    hidden = torch.arange(2 * 4 * 2, dtype=torch.float32).reshape(2, 4, 2)  # (batch, seq, hidden)
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert pool(hidden, left, "last").tolist() == [[6, 7], [14, 15]]
    assert pool(hidden, right, "last").tolist() == [[2, 3], [14, 15]]
    assert pool(hidden, left, "cls").tolist() == [[4, 5], [8, 9]]
    nan_pads = hidden.masked_fill(~right.bool()[..., None], float("nan"))  # padding never enters the mean
    assert pool(nan_pads, right, "mean").tolist() == [[1, 2], [11, 12]]


def test_sentence_transformers_files_choose_the_pooling(tmp_path):
    from gpuformers.serving.pooling import resolve_pooling

    assert (resolve_pooling(tmp_path).mode, resolve_pooling(tmp_path).normalize) == ("last", True)
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert (resolve_pooling(tmp_path).mode, resolve_pooling(tmp_path).normalize) == ("cls", True)
    overridden = resolve_pooling(tmp_path, "mean", False)
    assert (overridden.mode, overridden.normalize) == ("mean", False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens.*--pooling"):
        resolve_pooling(tmp_path)
    assert resolve_pooling(tmp_path, "last").mode == "last"
    (tmp_path / "modules.json").write_text(json.dumps([*modules, {"path": "3_Dense",
                                                                  "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="Dense"):
        resolve_pooling(tmp_path, "last")


def _sentence_transformers_vector(folder, text: str, max_seq_length: int) -> torch.Tensor:
    """sentence-transformers' embedding of `text` with this max_seq_length (its Transformer module tokenizes with
    truncation at max_seq_length, then last-token pooling and Normalize), computed with transformers."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer([text], padding=True, truncation="longest_first", max_length=max_seq_length,
                      return_tensors="pt")
    model = transformers.AutoModel.from_pretrained(folder).eval()
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state  # (1, seq, 32)
    return torch.nn.functional.normalize(hidden[:, -1], dim=-1), batch["input_ids"][0].tolist()


def test_too_long_inputs_are_refused_at_the_sentence_transformers_limit(servers, expected):
    """Without truncate_prompt_tokens an input over the limit is a 400 naming its length and the limit (vLLM's
    behaviour): --max-model-len for `last`, sentence_bert_config.json's max_seq_length for `mean`."""
    long = "word " * 100
    for name, limit, key in (("last", MAX_MODEL_LEN, None), ("mean", MAX_SEQ_LENGTH, API_KEY)):
        assert httpx.get(f"{servers[name].url}/models", headers={"Authorization": f"Bearer {API_KEY}"}
                         ).json()["data"][0]["max_model_len"] == limit
        response = _post(servers[name], {"input": ["short", long]}, key=key)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "input", error
        assert error["code"] == "context_length_exceeded"
        assert re.search(rf"input\[1\] has 10\d tokens, more than this model's maximum context length of {limit} "
                         r"tokens.*truncate_prompt_tokens", error["message"]), error
    exactly = _post(servers["mean"], {"input": [[1] * MAX_SEQ_LENGTH]}, key=API_KEY)  # the limit itself is fine
    assert exactly.status_code == 200, exactly.text
    assert _post(servers["mean"], {"input": [[1] * (MAX_SEQ_LENGTH + 1)]}, key=API_KEY).status_code == 400


def test_truncate_prompt_tokens_cuts_texts_as_sentence_transformers_does(servers, folders):
    """truncate_prompt_tokens=N (or -1: the limit) keeps a text's first tokens and still closes it with the
    tokenizer's <|endoftext|>, the token pooled: the vector is sentence-transformers' with max_seq_length=N."""
    long = "The quick brown fox jumps over the lazy dog. " * 12  # over 100 tokens
    for truncate, length in ((-1, MAX_MODEL_LEN), (10, 10)):
        reference, ids = _sentence_transformers_vector(folders["last"], long, length)
        assert len(ids) == length and ids[-1] == 151643  # <|endoftext|> kept last
        body = _post(servers["last"], {"input": long, "truncate_prompt_tokens": truncate}).json()
        assert body["usage"]["prompt_tokens"] == length
        torch.testing.assert_close(torch.tensor([body["data"][0]["embedding"]]), reference, atol=1e-5, rtol=0)
        # the same ids sent as token ids give the same vector
        torch.testing.assert_close(_vectors(_post(servers["last"], {"input": [ids]})), reference, atol=1e-5, rtol=0)
    # a short input is left as it is
    short = _vectors(_post(servers["last"], {"input": "Hello", "truncate_prompt_tokens": 10}))
    torch.testing.assert_close(short, _vectors(_post(servers["last"], {"input": "Hello"})), atol=0, rtol=0)


def test_truncate_prompt_tokens_cuts_token_ids_keeping_the_start(servers):
    ids = list(range(1000, 1000 + 50))
    cut = _vectors(_post(servers["mean"], {"input": [ids], "truncate_prompt_tokens": 20}, key=API_KEY))
    direct = _vectors(_post(servers["mean"], {"input": [ids[:20]]}, key=API_KEY))
    torch.testing.assert_close(cut, direct, atol=0, rtol=0)
    assert not torch.allclose(cut, _vectors(_post(servers["mean"], {"input": [ids[-20:]]}, key=API_KEY)))
    at_limit = _post(servers["mean"], {"input": [ids * 2], "truncate_prompt_tokens": -1}, key=API_KEY)
    assert at_limit.json()["usage"]["prompt_tokens"] == MAX_SEQ_LENGTH


@pytest.mark.parametrize("server, body, param, words", [
    ("last", {"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens",
     rf"truncate_prompt_tokens={MAX_MODEL_LEN + 1} is greater than this model's maximum input length of "
     rf"{MAX_MODEL_LEN} tokens"),
    ("last", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "would leave no tokens"),
    ("last", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "must be >= -1"),
    ("last", {"truncate_prompt_tokens": "8"}, "truncate_prompt_tokens", "must be an integer"),
    ("mean", {"dimensions": 5}, "dimensions", "dimensions=5 is not one of this model's matryoshka dimensions: 4, 8"),
    ("mean", {"dimensions": 32}, "dimensions", "not one of this model's matryoshka dimensions"),
])
def test_bad_limits_are_400s_naming_the_field(servers, server, body, param, words):
    response = _post(servers[server], {"input": "x", **body}, key=API_KEY if server == "mean" else None)
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error", response.text
    assert error["param"] == param and re.search(words, error["message"]), error


def test_dimensions_need_a_matryoshka_model(folders, expected):
    """A checkpoint whose config.json declares no Matryoshka support refuses dimensions (vLLM's rule); the same
    checkpoint with is_matryoshka set (--hf-overrides) accepts any size up to the hidden size."""
    from fastapi.testclient import TestClient

    from gpuformers.serving.embedding_app import build_embedding_app
    from gpuformers.serving.embeddings import load_embedder

    plain = TestClient(build_embedding_app(load_embedder(str(folders["last"]), device="cpu"), MODEL_NAME))
    response = plain.post("/v1/embeddings", json={"model": MODEL_NAME, "input": TEXTS, "dimensions": 8})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "dimensions", response.text
    assert "does not support matryoshka representation" in error["message"]
    assert """--hf-overrides '{"is_matryoshka": true}'""" in error["message"]
    assert plain.post("/v1/embeddings", json={"model": MODEL_NAME, "input": TEXTS}).status_code == 200

    embedder = load_embedder(str(folders["last"]), device="cpu", hf_overrides={"is_matryoshka": True})
    assert embedder.is_matryoshka and embedder.matryoshka_dimensions is None
    matryoshka = TestClient(build_embedding_app(embedder, MODEL_NAME))
    response = matryoshka.post("/v1/embeddings", json={"model": MODEL_NAME, "input": TEXTS, "dimensions": 5})
    torch.testing.assert_close(_vectors(response), torch.nn.functional.normalize(expected["last"][:, :5], dim=-1),
                               atol=1e-5, rtol=0)


def test_limits_read_at_startup(folders, tmp_path):
    from gpuformers import AutoModel, AutoTokenizer
    from gpuformers.serving.embeddings import Embedder, parse_hf_overrides
    from gpuformers.serving.pooling import Pooling, max_seq_length

    assert max_seq_length(folders["mean"]) == MAX_SEQ_LENGTH and max_seq_length(folders["last"]) is None
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": "long"}))
    with pytest.raises(ValueError, match="max_seq_length 'long'"):
        max_seq_length(tmp_path)
    model, tokenizer = AutoModel.from_pretrained(folders["last"], progress=False), AutoTokenizer.from_pretrained(
        folders["last"])
    context = model.config.max_position_embeddings  # 1024
    assert Embedder(model, tokenizer, Pooling()).max_model_len == context
    assert Embedder(model, tokenizer, Pooling(), max_seq_length=8192).max_model_len == context  # bounded
    assert Embedder(model, tokenizer, Pooling(), max_seq_length=48).max_model_len == 48
    assert Embedder(model, tokenizer, Pooling(), 100, max_seq_length=48).max_model_len == 100  # the flag wins
    with pytest.raises(ValueError, match=f"--max-model-len {context + 1} exceeds the model's context of {context}"):
        Embedder(model, tokenizer, Pooling(), context + 1)
    model.config.extra["matryoshka_dimensions"] = [8, 64]
    with pytest.raises(ValueError, match=r"matryoshka_dimensions \[8, 64\] must be a list of vector sizes from 1 "
                                          "to the hidden size 32"):
        Embedder(model, tokenizer, Pooling())
    assert parse_hf_overrides('{"is_matryoshka": true}') == {"is_matryoshka": True}
    for bad in ("{is_matryoshka: true}", "[1]"):
        with pytest.raises(ValueError, match="--hf-overrides"):
            parse_hf_overrides(bad)
