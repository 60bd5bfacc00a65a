"""Multi-LoRA serving (engine/lora.py) on a tiny random model: a batch mixing requests without an adapter and with
two adapters of different ranks and targets gives each request the greedy tokens of generate() on a fresh model
with that adapter loaded in place (model.load_adapter); the prefix cache never shares blocks across adapters;
preemption; the model is left as it was; and what multi-LoRA serving does not do is refused by name."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.engine.lora import MultiLoraLinear
from gpuformers.engine.sequence import RequestStatus

NEW_TOKENS = 8


def tiny_model():
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.registry import model_class_for

    config = ModelConfig.from_dict(dict(
        model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    torch.manual_seed(0)
    return model_class_for(config)(config).eval()


def save_adapter(folder, seed: int, **config) -> str:
    """A LoRA adapter with random A and B (init_lora_weights=False: it changes the tokens), saved as peft does."""
    from gpuformers.lora import LoraConfig, get_peft_model

    model = tiny_model()
    torch.manual_seed(seed)
    get_peft_model(model, LoraConfig(init_lora_weights=False, **config)).save_pretrained(folder)
    return str(folder)


def greedy(model, prompts) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(adapter folders {name: folder}, prompts, greedy references {adapter name or None: tokens per prompt})."""
    root = tmp_path_factory.mktemp("adapters")
    folders = {
        "a": save_adapter(root / "a", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "b": save_adapter(root / "b", seed=2, r=8, lora_alpha=4, target_modules="all-linear", use_rslora=True),
    }
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (int(torch.randint(2, 30, (), generator=g)),), generator=g).tolist()
               for _ in range(12)]
    references = {None: greedy(tiny_model(), prompts)}
    for name, folder in folders.items():
        model = tiny_model()
        model.load_adapter(folder)
        references[name] = greedy(model, prompts)
    for name in folders:  # each adapter changes the tokens, or the tests below could not tell them apart
        assert sum(r != base for r, base in zip(references[name], references[None])) >= len(prompts) // 2
    return folders, prompts, references


def test_mixed_batch_matches_generate_with_each_adapter(setup):
    folders, prompts, references = setup
    model = tiny_model()
    # neighbours with the same adapter (one run), and adapters with rows in several runs
    names = [None, "a", "a", "b", "b", None, "a", "b", "b", "a", None, None]
    results = model.generate_batch(prompts, adapters=folders, adapter_names=names, max_new_tokens=NEW_TOKENS,
                                   eos_token_id=None, progress_bar=False, block_size=8, num_blocks=64,
                                   max_batch_tokens=24)  # chunked prefills beside decodes
    for i, (output, name) in enumerate(zip(results.values(), names)):
        assert output.status is RequestStatus.FINISHED, output.error
        assert output.generated_tokens == references[name][i], f"request {i}, adapter {name}"
    # generate_batch's manager is gone: no wrapper left in the model
    assert not any(isinstance(m, MultiLoraLinear) for m in model.modules())


def test_per_layer_ranks_and_scales_match_generate(setup, tmp_path):
    """rank_pattern / alpha_pattern give some layers their own r and lora_alpha (and layers_to_transform /
    exclude_modules pick the layers): each layer's update must use its own scale."""
    folders, prompts, _ = setup
    folder = save_adapter(tmp_path / "c", seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                          rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 32, "layers.1.self_attn.q_proj": 1},
                          exclude_modules=["layers.0.self_attn.q_proj"])
    reference = tiny_model()
    reference.load_adapter(folder)
    want = greedy(reference, prompts[:4])
    assert want != greedy(tiny_model(), prompts[:4])
    names = ["c", "a", "c", None]
    results = tiny_model().generate_batch(prompts[:4], adapters={**folders, "c": folder}, adapter_names=names,
                                          max_new_tokens=NEW_TOKENS, eos_token_id=None, progress_bar=False)
    got = [output.generated_tokens for output in results.values()]
    assert [got[0], got[2]] == [want[0], want[2]]


def test_prefix_cache_is_per_adapter(setup):
    folders, prompts, references = setup
    prompt = prompts[0] + prompts[1] + prompts[2]  # several full blocks of 8
    model = tiny_model()
    reference = {}
    for name, folder in [(None, None), *folders.items()]:
        fresh = tiny_model()
        if folder:
            fresh.load_adapter(folder)
        reference[name] = greedy(fresh, [prompt])[0]
    manager = model.init_continuous_batching(adapters=folders, block_size=8, num_blocks=64, eos_token_id=None)

    def run(name):
        request_id = manager.add_request(prompt, max_new_tokens=NEW_TOKENS, adapter_name=name)
        manager.run_until_done()
        return manager.get_result(request_id, timeout=0).generated_tokens

    assert run("a") == reference["a"]
    assert run("b") == reference["b"] and run(None) == reference[None]
    assert manager.prefix_hits == 0  # the same prompt under another adapter (or none) computes its own blocks
    assert run("a") == reference["a"]
    hits = manager.prefix_hits
    assert hits >= len(prompt) // 8 - 1  # under the same adapter it shares them
    # A new adapter loaded under an old name never takes the old one's blocks.
    manager.delete_adapter("a")
    manager.load_adapter(folders["b"], "a")
    assert run("a") == reference["b"]
    assert manager.prefix_hits == hits
    manager.stop()


@pytest.mark.parametrize("use_async_batching", [False, True], ids=["sync", "async"])
def test_preemption_with_adapters(setup, use_async_batching):
    folders, prompts, references = setup
    model = tiny_model()
    # 10 blocks of 4 = 40 slots for 12 requests of up to 37 tokens: preemption is certain.
    config = ContinuousBatchingConfig(block_size=4, num_blocks=10, max_batch_tokens=16, max_requests_per_batch=8,
                                      use_async_batching=use_async_batching)
    manager = model.init_continuous_batching(continuous_batching_config=config, adapters=folders, eos_token_id=None)
    names = [("b", None, "a")[i % 3] for i in range(len(prompts))]
    ids, pending = [], list(zip(prompts, names))
    while pending or manager.step():  # requests arrive while others run
        for prompt, name in pending[:3]:
            ids.append(manager.add_request(prompt, max_new_tokens=NEW_TOKENS, adapter_name=name))
        pending = pending[3:]
    for i, (request_id, name) in enumerate(zip(ids, names)):
        output = manager.get_result(request_id, timeout=0)
        assert output.generated_tokens == references[name][i], f"request {i}, adapter {name}"
    assert manager.num_preemptions > 0
    manager.stop()


def test_model_is_unchanged_after_the_manager_stops(setup):
    folders, prompts, references = setup
    model = tiny_model()
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        before = model(ids).logits
    keys = list(model.state_dict())
    with model.init_continuous_batching(adapters=folders, block_size=8, num_blocks=32, eos_token_id=None) as manager:
        assert manager.adapters == ["a", "b"]
        assert "2 LoRA adapter(s)" in manager.memory_summary()
        q_proj = model.model.layers[0].self_attn.q_proj
        assert isinstance(q_proj, MultiLoraLinear) and list(q_proj.adapters) == ["a", "b"]
        with torch.inference_mode():  # outside an engine step a wrapper is its base layer
            assert torch.equal(model(ids).logits, before)
        request_id = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, adapter_name="b")
        assert manager.get_result(request_id, timeout=30).generated_tokens == references["b"][0]
        # while the loop runs, adapters change between two of its steps
        manager.delete_adapter("a")
        assert manager.adapters == ["b"] and "a" not in q_proj.adapters
        manager.load_adapter(folders["a"], "a")
        request_id = manager.add_request(prompts[2], max_new_tokens=NEW_TOKENS, adapter_name="a")
        assert manager.get_result(request_id, timeout=30).generated_tokens == references["a"][2]
    assert not any(isinstance(m, MultiLoraLinear) for m in model.modules())
    assert list(model.state_dict()) == keys
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)
    # Stepping again after stop() puts the wrappers back for the step.
    request_id = manager.add_request(prompts[1], max_new_tokens=NEW_TOKENS, adapter_name="a")
    manager.run_until_done()
    assert manager.get_result(request_id, timeout=0).generated_tokens == references["a"][1]
    manager.delete_adapter("a")
    manager.delete_adapter("b")  # the bank emptied: the model as it was
    assert not any(isinstance(m, MultiLoraLinear) for m in model.modules())


def test_adapter_names_and_deletion_are_checked(setup):
    folders, prompts, _ = setup
    model = tiny_model()
    manager = model.init_continuous_batching(adapters={"a": folders["a"]}, block_size=8, num_blocks=32)
    with pytest.raises(ValueError, match=r"adapter 'c' is not loaded \(loaded: 'a'\)"):
        manager.add_request(prompts[0], adapter_name="c")
    with pytest.raises(ValueError, match="already loaded"):
        manager.load_adapter(folders["b"], "a")
    manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, adapter_name="a")
    manager.step()
    with pytest.raises(ValueError, match=r"adapter 'a' is in use by 1 request\(s\) \(req_0\)"):
        manager.delete_adapter("a")
    manager.run_until_done()
    manager.delete_adapter("a")
    assert manager.adapters == []
    # a request queued for an adapter that is deleted before it starts fails, naming it
    manager.load_adapter(folders["a"], "a")
    request_id = manager.add_request(prompts[0], adapter_name="a")
    manager.adapter_bank.delete("a")
    manager.run_until_done()
    assert "adapter 'a' was deleted" in manager.get_result(request_id, timeout=0).error
    with pytest.raises(ValueError, match="adapter_names has 1 entries for 2 inputs"):
        model.generate_batch(prompts[:2], adapters=folders, adapter_names=["a"], progress_bar=False)


@pytest.mark.parametrize("settings, refused", [
    (dict(target_modules=["q_proj"], use_dora=True), "use_dora=True"),
    (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["q_proj"], bias="lora_only"), "bias='lora_only'"),
    (dict(target_modules=["embed_tokens", "q_proj"]), "LoRA on an embedding"),
    (dict(target_modules=["lm_head"]), "LoRA on the embeddings or the LM head"),
], ids=["dora", "modules_to_save", "bias", "embedding", "lm_head"])
@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`")
def test_unsupported_adapters_are_refused_by_name(tmp_path, settings, refused):
    folder = save_adapter(tmp_path / "adapter", seed=3, r=4, lora_alpha=8, **settings)
    model = tiny_model()
    with pytest.raises(NotImplementedError, match=refused):
        model.init_continuous_batching(adapters={"x": folder}, block_size=8, num_blocks=8)
    assert not any(isinstance(m, MultiLoraLinear) for m in model.modules())  # nothing left behind


def test_prompt_logprobs_under_an_adapter(setup):
    folders, prompts, _ = setup
    prompt = prompts[0] + prompts[1]
    fresh = tiny_model()
    fresh.load_adapter(folders["b"])
    with torch.inference_mode():
        log_probs = torch.log_softmax(fresh(torch.tensor([prompt])).logits[0].float(), -1)
    expected = log_probs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    manager = tiny_model().init_continuous_batching(adapters=folders, block_size=8, num_blocks=32,
                                                    max_batch_tokens=16)  # the prompt in chunks
    request_id = manager.add_request(prompt, max_new_tokens=1, adapter_name="b", prompt_logprobs=0)
    manager.run_until_done()
    output = manager.get_result(request_id, timeout=0)
    assert output.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(output.prompt_logprobs[1:]), expected, atol=1e-4, rtol=0)


def test_refused_settings(setup, monkeypatch):
    folders, _, _ = setup
    with pytest.raises(NotImplementedError, match="use_cuda_graph=True with LoRA adapters"):
        tiny_model().init_continuous_batching(adapters=folders, use_cuda_graph=True)
    model = tiny_model()
    model.load_adapter(folders["a"])
    with pytest.raises(NotImplementedError, match="already holds a LoRA adapter in place"):
        model.init_continuous_batching(adapters={"b": folders["b"]}, block_size=8, num_blocks=8)
    monkeypatch.setattr("gpuformers.tensor_parallel.is_tensor_parallel", lambda model: True)
    with pytest.raises(NotImplementedError, match="multi-LoRA serving on a tensor-parallel model"):
        tiny_model().init_continuous_batching(adapters=folders, block_size=8, num_blocks=8)


def quantized(model):
    """The model with every linear layer of its decoder layers a WeightOnlyLinear (int8)."""
    from gpuformers.quantization.weight_only import WeightOnlyLinear

    for name, module in list(model.model.layers.named_modules()):
        if isinstance(module, torch.nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.model.layers.get_submodule(parent), child,
                    WeightOnlyLinear.from_linear(module, bits=8, group_size=None))
    return model


def test_adapters_over_quantized_layers(setup):
    folders, prompts, _ = setup
    reference = {None: greedy(quantized(tiny_model()), prompts[:6])}
    for name, folder in folders.items():
        model = quantized(tiny_model())
        model.load_adapter(folder)
        reference[name] = greedy(model, prompts[:6])
    names = [(None, "a", "b")[i % 3] for i in range(6)]
    results = quantized(tiny_model()).generate_batch(prompts[:6], adapters=folders, adapter_names=names,
                                                     max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                                     progress_bar=False, block_size=8, num_blocks=32)
    for i, (output, name) in enumerate(zip(results.values(), names)):
        assert output.generated_tokens == reference[name][i], f"request {i}, adapter {name}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_multi_lora_on_cuda_turns_cuda_graphs_off_and_back_on(setup):
    """On a GPU: the adapters' row indices go to the device, the tokens equal generate() with each adapter there, and
    CUDA graphs (on by default) are off while adapters are loaded and back after the last is deleted."""
    folders, prompts, _ = setup
    names = [None, "a", "b", "a", None, "b"]
    references = {}
    for name in set(names):
        model = tiny_model().cuda()
        if name is not None:
            model.load_adapter(folders[name])
        references[name] = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW_TOKENS,
                                           do_sample=False, eos_token_id=None)[0, len(p):].tolist()
                            for p in prompts[:6]]
    model = tiny_model().cuda()
    manager = model.init_continuous_batching(max_new_tokens=NEW_TOKENS, eos_token_id=None)
    assert manager.runner.graphs is not None  # automatic: on for a CUDA model
    for name, folder in folders.items():
        manager.load_adapter(folder, name)
    assert manager.runner.graphs is None
    ids = [manager.add_request(p, adapter_name=n) for p, n in zip(prompts[:6], names)]
    manager.run_until_done()
    for i, (request_id, name) in enumerate(zip(ids, names)):
        assert manager.get_result(request_id, timeout=0).generated_tokens == references[name][i], (i, name)
    for name in folders:
        manager.delete_adapter(name)
    assert manager.runner.graphs is not None


def test_cuda_graph_setting_follows_the_adapters_without_a_gpu(setup):
    """What the GPU test above checks of the CUDA graphs, on the CPU: the manager's AdapterService turns them off with
    the first adapter and back to what the config decided with the last one deleted (a CPU model decides "off", so
    "on" is what is decided here; DecodeGraphs captures lazily, so making one needs no GPU)."""
    from gpuformers.engine.cuda_graphs import DecodeGraphs

    folders, _, _ = setup
    manager = tiny_model().init_continuous_batching(block_size=8, num_blocks=32)
    assert manager.runner.graphs is None and not manager.config.use_cuda_graph  # decided on a CPU model: off
    manager.adapter_service.cuda_graphs_decided = True
    manager.adapter_service.use_cuda_graphs(True)
    manager.load_adapter(folders["a"], "a")
    assert manager.runner.graphs is None and manager.config.use_cuda_graph is False
    manager.load_adapter(folders["b"], "b")
    manager.delete_adapter("a")
    assert manager.runner.graphs is None  # "b" is still loaded
    manager.delete_adapter("b")
    assert isinstance(manager.runner.graphs, DecodeGraphs) and manager.config.use_cuda_graph is True
