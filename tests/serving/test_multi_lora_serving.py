"""`gpuformers serve --lora-modules NAME=FOLDER`: a request whose "model" is an adapter's name gets the greedy answer
of model.generate with that adapter loaded, the base model's name gets the base model's, /v1/models lists the
adapter with the base as its parent, and an unknown model is still a 404. With --allow-runtime-lora-updating,
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters while serving."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.serving.conftest import MODEL_NAME, ServerProcess, greedy_reference


@pytest.fixture(scope="module")
def adapter(checkpoint, tmp_path_factory):
    """(folder, reference model with the adapter loaded): random A and B on every linear layer but the head."""
    from gpuformers import AutoModelForCausalLM
    from gpuformers.lora import LoraConfig, get_peft_model

    folder = tmp_path_factory.mktemp("sql-lora")
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(folder)
    with_adapter = AutoModelForCausalLM.from_pretrained(checkpoint, progress=False)
    with_adapter.load_adapter(folder)
    return folder, with_adapter


@pytest.fixture(scope="module")
def lora_server(checkpoint, adapter):
    server = ServerProcess(checkpoint, "--num-blocks", "32", "--lora-modules", f"sql={adapter[0]}",
                           "--allow-runtime-lora-updating")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_models_lists_the_adapter_with_its_parent(lora_server):
    data = httpx.get(f"{lora_server.url}/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [(MODEL_NAME, None), ("sql", MODEL_NAME)]


def test_the_model_field_picks_the_adapter(lora_server, reference, adapter):
    tokenizer = reference[1]
    ids = tokenizer.encode("The quick brown fox")
    with torch.inference_mode():
        out = adapter[1].generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    expected = {"sql": out[0, len(ids):].tolist(), MODEL_NAME: greedy_reference(reference, ids, 10)}
    assert expected["sql"] != expected[MODEL_NAME]  # the adapter changes the answer
    client = openai.OpenAI(base_url=lora_server.url, api_key="unused", max_retries=0, timeout=60)
    for name in ("sql", MODEL_NAME, "sql"):
        reply = client.completions.create(model=name, prompt=ids, max_tokens=10, temperature=0)
        assert reply.model == name
        assert reply.choices[0].text == tokenizer.decode(expected[name], skip_special_tokens=True), name


def test_an_unknown_model_is_a_404_naming_the_served_ones(lora_server):
    response = httpx.post(f"{lora_server.url}/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and f"'{MODEL_NAME}', 'sql'" in error["message"]


def test_adapters_load_and_unload_while_serving(lora_server, adapter, reference, tmp_path):
    tokenizer = reference[1]
    ids = tokenizer.encode("The quick brown fox")
    client = openai.OpenAI(base_url=lora_server.url, api_key="unused", max_retries=0, timeout=60)
    expected = client.completions.create(model="sql", prompt=ids, max_tokens=10, temperature=0).choices[0].text
    post = lambda route, **body: httpx.post(f"{lora_server.url}/{route}", json=body, timeout=60)  # noqa: E731

    response = post("load_lora_adapter", lora_name="sql2", lora_path=str(adapter[0]))
    assert response.status_code == 200 and "'sql2' added" in response.text
    assert [m["id"] for m in httpx.get(f"{lora_server.url}/models").json()["data"]][-1] == "sql2"
    assert client.completions.create(model="sql2", prompt=ids, max_tokens=10, temperature=0).choices[0].text == \
        expected
    assert post("unload_lora_adapter", lora_name="sql2").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql2", prompt=ids, max_tokens=2)
    for route, body, status, param in [
            ("unload_lora_adapter", {"lora_name": "sql2"}, 404, "lora_name"),
            ("load_lora_adapter", {"lora_name": "sql"}, 400, "lora_path"),
            ("load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapter[0])}, 400, "lora_name"),
            ("load_lora_adapter", {"lora_name": MODEL_NAME, "lora_path": str(adapter[0])}, 400, "lora_name"),
            ("load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "lora_path")]:
        response = post(route, **body)
        assert response.status_code == status and response.json()["error"]["param"] == param, (body, response.text)


def test_runtime_updates_are_off_by_default(server):
    response = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert response.status_code == 404
