"""device_map planning (loading/device_map.py) and execution across devices with CPU and disk offload.

The planner is checked on injected sizes (hand-made trees and meta-device models with 1, 2 and 4 simulated GPUs),
against accelerate's infer_auto_device_map and transformers' balanced limits on the same modules and limits; the
execution is checked on the CPU: a model split over "cpu" and "disk" gives the logits of the unsplit model.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.loading.device_map import (
    ModuleNode,
    device_for,
    module_tree,
    parse_max_memory,
    plan_device_map,
    tied_groups,
)
from gpuformers.models.config import ModelConfig
from gpuformers.models.modeling import skip_init
from gpuformers.models.registry import model_class_for


def meta_model(tie: bool = True, layers: int = 4, model_type: str = "llama"):
    config = ModelConfig.from_dict(dict(model_type=model_type, vocab_size=1000, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tie))
    with torch.device("meta"), skip_init():
        return model_class_for(config)(config)


def leaf(name: str, size: int) -> ModuleNode:
    return ModuleNode(name, size, [ModuleNode(name + ".weight", size, is_module=False)])


def toy_tree(layer_size: int = 100, layers: int = 4, embed: int = 50, head: int = 50) -> ModuleNode:
    """model.embed_tokens, model.layers.{i} (no-split, two Linears each), model.norm, lm_head: sizes in bytes."""
    blocks = [ModuleNode(f"model.layers.{i}", layer_size,
                         [leaf(f"model.layers.{i}.a", layer_size // 2), leaf(f"model.layers.{i}.b", layer_size // 2)],
                         no_split=True) for i in range(layers)]
    stack = ModuleNode("model.layers", layer_size * layers, blocks)
    model = ModuleNode("model", embed + stack.size + 2, [leaf("model.embed_tokens", embed), stack,
                                                         leaf("model.norm", 2)])
    return ModuleNode("", model.size + head, [model, leaf("lm_head", head)])


# ------------------------------------------------------------------------------------------- hand-made sizes


def test_one_gpu_that_holds_everything_gets_everything():
    assert plan_device_map(toy_tree(), {0: 10_000, "cpu": 10_000}) == {"": 0}


def test_sequential_fills_gpus_in_order_then_cpu_then_disk():
    tree = toy_tree()  # 50 + 4 x 100 + 2 + 50 = 502 bytes; the largest whole unit is a layer (100)
    # GPU 0 keeps 100 free for an offloaded layer: 250 - 100 = 150 -> embed + layer 0; GPU 1 (not main): 2 layers.
    plan = plan_device_map(tree, {0: 250, 1: 200, "cpu": 250})
    assert plan == {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.layers.2": 1,
                    "model.layers.3": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    # Without the CPU, what is left goes to disk.
    plan = plan_device_map(tree, {0: 250, 1: 200})
    assert plan["model.layers.3"] == "disk" and plan["lm_head"] == "disk"


def test_decoder_layers_are_never_split():
    tree = toy_tree(layer_size=100)
    plan = plan_device_map(tree, {0: 100 + 50 + 90, "cpu": 10_000})  # 90 bytes left: half a layer would fit
    assert not any(key.endswith((".a", ".b")) for key in plan)
    assert device_for(plan, "model.layers.0") == "cpu"


def test_four_gpus_balanced_vs_sequential():
    tree = toy_tree(layers=8)
    limits = {i: 10_000 for i in range(4)}
    assert plan_device_map(tree, limits, strategy="sequential") == {"": 0}
    balanced = plan_device_map(tree, limits, strategy="balanced")
    assert set(balanced.values()) == {0, 1, 2, 3}
    layers = [device_for(balanced, f"model.layers.{i}") for i in range(8)]
    assert layers == sorted(layers) and max(layers.count(d) for d in set(layers)) <= 3  # in order, spread evenly
    # balanced_low_0 keeps GPU 0 free for generate()'s work when the other GPUs can hold the model
    assert 0 not in plan_device_map(tree, limits, strategy="balanced_low_0").values()


def test_tied_weights_stay_together():
    tree = toy_tree()
    tied = [["lm_head.weight", "model.embed_tokens.weight"]]
    tree.children[1].children[0].size = 0  # the head's weight is the embedding's: counted once, where it first is
    tree.children[1].size = 0
    for limits in ({0: 300, "cpu": 1000}, {0: 200, 1: 200, "cpu": 150}, {0: 160, 1: 160, 2: 160, 3: 160}):
        plan = plan_device_map(tree, limits, tied=tied)
        assert device_for(plan, "lm_head.weight") == device_for(plan, "model.embed_tokens.weight"), plan


def test_max_memory_forms_and_errors():
    assert parse_max_memory({"cpu": "1GiB", 1: "2GB", "cuda:0": 5, "disk": 10}) == {
        0: 5, 1: 2 * 10**9, "cpu": 2**30, "disk": 10}
    with pytest.raises(ValueError, match=r"max_memory\['cpu'\] = '12 bananas' is not a size"):
        parse_max_memory({"cpu": "12 bananas"})
    with pytest.raises(ValueError, match="max_memory key 'tpu' is not a device"):
        parse_max_memory({"tpu": 1})
    with pytest.raises(ValueError, match='strategy "greedy" is not one of'):
        plan_device_map(toy_tree(), {0: 1}, strategy="greedy")
    with pytest.raises(ValueError, match="no entry for 'lm_head.weight'"):
        device_for({"model": "cpu"}, "lm_head.weight")


# ------------------------------------------------------------------------------------- against the references


def _limit_cases(total: int):
    for gpus in (1, 2, 4):
        for fraction in (0.1, 0.25, 0.5, 1.5):
            for cpu in (None, 0.2, 3.0):
                limits = {i: int(total * fraction) for i in range(gpus)}
                if cpu is not None:
                    limits["cpu"] = int(total * cpu)
                yield limits


@pytest.fixture
def quiet_accelerate():
    # accelerate warns that simulated GPUs do not exist, and about buffers of offloaded layers
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("tie", [True, False])
def test_sequential_plans_equal_accelerate(tie, quiet_accelerate):
    from accelerate.utils import infer_auto_device_map

    model = meta_model(tie=tie, model_type="qwen3")
    tree = module_tree(model, torch.float16, model.no_split_modules)
    cases = 0
    for limits in _limit_cases(tree.size):
        ours = plan_device_map(tree, limits, tied=tied_groups(model))
        theirs = infer_auto_device_map(model, max_memory=dict(limits), dtype=torch.float16,
                                       no_split_module_classes=list(model.no_split_modules))
        assert ours == dict(theirs), limits
        cases += len(set(ours.values())) > 1
    assert cases >= 10  # most cases really split the model


@pytest.mark.parametrize("strategy", ["balanced", "balanced_low_0"])
def test_balanced_plans_equal_transformers(strategy, quiet_accelerate):
    from accelerate.utils import infer_auto_device_map
    from transformers.integrations.accelerate import get_balanced_memory

    model = meta_model(tie=True, layers=6)
    tree = module_tree(model, None, model.no_split_modules)
    for limits in _limit_cases(tree.size):
        ours = plan_device_map(tree, limits, strategy=strategy, tied=tied_groups(model))
        balanced = get_balanced_memory(model, dict(limits), set(model.no_split_modules), None,
                                       low_zero=strategy == "balanced_low_0")
        theirs = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=list(model.no_split_modules))
        assert ours == dict(theirs), limits


# ---------------------------------------------------------------------------------------- running split models


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from tests.fixtures.checkpoints import make_checkpoint

    folder = tmp_path_factory.mktemp("qwen3_tied")
    make_checkpoint(folder, "qwen3", tie_word_embeddings=True, num_hidden_layers=3)
    return folder


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_cpu_and_disk_split_gives_the_unsplit_logits(qwen3_dir, tmp_path):
    ids = torch.randint(0, 128, (2, 9))
    full = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype="float32", progress=False)
    plan = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
            "model.layers.1": "disk", "model.layers.2": "cpu", "model.norm": "disk", "lm_head": "cpu"}
    split = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype="float32", device_map=plan,
                                                 offload_folder=tmp_path / "offload", progress=False)
    assert split.hf_device_map == plan
    offloaded = split.model.layers[1].mlp.down_proj.weight
    assert offloaded.is_meta and (tmp_path / "offload" / "model.layers.1.mlp.down_proj.weight.safetensors").is_file()
    got = _logits(split, ids)
    assert got.device.type == "cpu"
    assert (got - _logits(full, ids)).abs().max() < 1e-5
    assert split.model.layers[1].mlp.down_proj.weight.is_meta  # streamed in for its forward only
    # generate() over the split model: same greedy tokens
    same = split.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(same, full.generate(ids, max_new_tokens=4, do_sample=False))


def test_auto_with_tight_max_memory_offloads_to_disk(qwen3_dir, tmp_path):
    ids = torch.randint(0, 128, (1, 6))
    full = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype="float32", progress=False)
    size = sum(p.numel() * 4 for p in full.parameters())
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype="float32", device_map="auto",
                                                 max_memory={"cpu": size // 2}, offload_folder=tmp_path / "off",
                                                 progress=False)
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    assert device_for(model.hf_device_map, "lm_head") == device_for(model.hf_device_map, "model.embed_tokens")
    assert (_logits(model, ids) - _logits(full, ids)).abs().max() < 1e-5


def test_disk_without_offload_folder_says_how_to_fix(qwen3_dir):
    with pytest.raises(ValueError, match="pass offload_folder="):
        AutoModelForCausalLM.from_pretrained(qwen3_dir, device_map={"model": "cpu", "lm_head": "disk"},
                                             progress=False)
    with pytest.raises(ValueError, match="no entry for 'model.embed_tokens.weight'"):
        AutoModelForCausalLM.from_pretrained(qwen3_dir, device_map={"lm_head": "cpu"}, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_and_cpu_split_gives_the_unsplit_logits(qwen3_dir):
    ids = torch.randint(0, 128, (2, 9))
    full = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype="float32", progress=False)
    whole = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype="float32", device_map="cuda", progress=False)
    size = sum(p.numel() * 4 for p in full.parameters())
    split = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype="float32", device_map="auto",
                                                 max_memory={0: size // 2, "cpu": 10 * size}, progress=False)
    assert set(split.hf_device_map.values()) == {0, "cpu"}, split.hf_device_map
    expected = _logits(full, ids)
    assert (_logits(whole, ids.cuda()).cpu() - expected).abs().max() < 1e-4
    got = _logits(split, ids.cuda())
    assert got.device.type == "cuda"
    assert (got.cpu() - expected).abs().max() < 1e-4
    with torch.no_grad():
        loss = split(ids.cuda(), labels=ids.cuda()).loss
        assert abs(float(loss) - float(full(ids, labels=ids).loss)) < 1e-4
    tokens = split.generate(ids.cuda(), max_new_tokens=4, do_sample=False).cpu()
    assert torch.equal(tokens, full.generate(ids, max_new_tokens=4, do_sample=False))


def test_loss_of_a_split_model_equals_the_unsplit_one(qwen3_dir, tmp_path):
    ids = torch.randint(0, 128, (2, 9))
    full = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype="float32", progress=False)
    split = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype="float32", progress=False, offload_folder=tmp_path,
                                                 device_map={"model": "cpu", "model.layers.2": "disk", "lm_head": "cpu"})
    with torch.no_grad():
        expected, got = full(ids, labels=ids).loss, split(ids, labels=ids).loss
    assert got.device.type == "cpu" and abs(float(got) - float(expected)) < 1e-5
