"""`gpuformers serve --task embed`: POST /v1/embeddings returns transformers.AutoModel's hidden states pooled at
each input's last real token over left-padded batches and L2-normalised (Qwen3-Embedding's recipe), or as the
checkpoint's sentence-transformers modules.json says (mean pooling, no Normalize); dimensions, base64, token id
inputs, the 400s naming the field, --api-key and the openai client's embeddings.create.

Two servers on the tiny Qwen3 checkpoint of conftest.py, started at once: `last` (its tokenizer pads on the left,
as Qwen3-Embedding's does; --max-model-len 64) and `mean` (modules.json with mean pooling, right padding,
--api-key)."""

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


def _embedding_folder(checkpoint, folder, padding_side: str):
    """The checkpoint's files linked into `folder`, its tokenizer padding on `padding_side`."""
    for file in checkpoint.iterdir():
        if file.suffix in (".json", ".safetensors", ".jinja") and file.name != "tokenizer_config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": padding_side}))
    return folder


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory):
    last = _embedding_folder(checkpoint, tmp_path_factory.mktemp("embed-last"), "left")
    mean = _embedding_folder(checkpoint, tmp_path_factory.mktemp("embed-mean"), "right")
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
    last = ServerProcess(folders["last"], "--task", "embed", "--max-model-len", str(MAX_MODEL_LEN))
    mean = ServerProcess(folders["mean"], "--task", "embed", "--api-key", API_KEY)
    try:
        yield {"last": last.wait_ready(), "mean": mean.wait_ready()}
    finally:
        last.stop()
        mean.stop()


@pytest.fixture(scope="module")
def expected(folders):
    """transformers' vectors for TEXTS, not normalised: {"last": (4, 32) over one left-padded batch, "mean": (4, 32)
    over one right-padded batch}; and the token ids of TEXTS."""
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
        out["ids"] = [tokenizer.encode(text) for text in TEXTS]
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
    tokens = sum(map(len, expected["ids"]))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    reference = torch.nn.functional.normalize(expected["last"], dim=-1)
    torch.testing.assert_close(_vectors(response), reference, atol=1e-5, rtol=0)
    # one input alone (no padding) and token ids give the same vectors
    torch.testing.assert_close(_vectors(_post(servers["last"], {"input": TEXTS[1]})), reference[1:2], atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(_vectors(_post(servers["last"], {"input": expected["ids"]})), reference, atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(_vectors(_post(servers["last"], {"input": expected["ids"][0]})), reference[:1],
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
    assert reply.usage.prompt_tokens == sum(map(len, expected["ids"]))
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
    rows = expected["ids"] * 10  # 40 inputs: two batches of BATCH_SIZE 32
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
