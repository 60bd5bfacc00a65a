"""Token embeddings (models/embeddings.py): resize_token_embeddings against transformers' on the same tiny
checkpoints, the embedding accessors, and enable_input_require_grads under reentrant gradient checkpointing.

resize_token_embeddings draws its random rows as transformers does, so under the same seed both resized models are
compared whole: new rows, logits over old and new tokens, the saved checkpoint, generate.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gpuformers import AutoModelForCausalLM
from gpuformers.layers.blocks import checkpoint_decoder_layers
from tests.fixtures.checkpoints import make_checkpoint

VOCAB = 128  # tests/fixtures/checkpoints.py's TINY
PAD = 120  # a padding row that shrinking to 100 tokens cuts off


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """tied / untied tiny llama checkpoints, each with a padding token (an nn.Embedding padding_idx)."""
    out = {}
    for tied in (True, False):
        folder = tmp_path_factory.mktemp("tied" if tied else "untied")
        make_checkpoint(folder, "llama", tie_word_embeddings=tied, pad_token_id=PAD)
        out[tied] = folder
    return out


def ours(folder, dtype="float32", **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, progress=False, **kwargs)


def theirs(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def resized_pair(folder, new_num_tokens, seed=0, **kwargs):
    """(ours, transformers') models loaded from `folder` and resized alike under the same seed."""
    hf = theirs(folder)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.resize_token_embeddings(new_num_tokens, **kwargs)
    model = ours(folder)
    torch.manual_seed(seed)
    model.resize_token_embeddings(new_num_tokens, **kwargs)
    return model, hf


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# --- parity with transformers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tied,mean_resizing,new_num_tokens", [
    (True, False, 150), (False, False, 150), (True, True, 150), (False, True, 150),  # grow
    (True, True, 100), (False, False, 100),  # shrink (cuts the padding row)
])
def test_resize_equals_transformers(folders, tied, mean_resizing, new_num_tokens):
    model, hf = resized_pair(folders[tied], new_num_tokens, mean_resizing=mean_resizing)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert emb.weight.shape == hf.get_input_embeddings().weight.shape == (new_num_tokens, 64)
    assert emb.num_embeddings == head.out_features == new_num_tokens
    assert model.config.vocab_size == hf.config.vocab_size == new_num_tokens
    assert emb.padding_idx == hf.get_input_embeddings().padding_idx == (PAD if new_num_tokens > PAD else None)
    # the same random draws: the added rows are transformers' own, bit for bit
    assert torch.equal(emb.weight, hf.get_input_embeddings().weight)
    assert torch.equal(head.weight, hf.get_output_embeddings().weight)
    assert (head.weight is emb.weight) == tied
    ids = torch.randint(0, new_num_tokens, (2, 9))
    ids[0, :3] = torch.arange(new_num_tokens - 3, new_num_tokens)  # the last (new or kept) tokens
    got, expected = logits(model, ids), logits(hf, ids)
    assert got.shape == expected.shape == (2, 9, new_num_tokens)
    assert (got - expected).abs().max() < 1e-4


def test_old_rows_kept_and_old_token_logits_unchanged(folders):
    model = ours(folders[False], dtype="bfloat16")
    before_emb = model.model.embed_tokens.weight.clone()
    before_head = model.lm_head.weight.clone()
    ids = torch.randint(0, VOCAB, (2, 8))
    before = logits(model, ids)
    emb_module, head_module = model.model.embed_tokens, model.lm_head
    model.resize_token_embeddings(200, mean_resizing=False)
    assert model.model.embed_tokens is emb_module and model.lm_head is head_module  # hooks stay on them
    for weight, old in ((emb_module.weight, before_emb), (head_module.weight, before_head)):
        assert weight.dtype == torch.bfloat16 and weight.device == old.device
        assert torch.equal(weight[:VOCAB], old)
    assert torch.equal(logits(model, ids)[..., :VOCAB], before)


def test_resize_keeps_requires_grad_and_a_tied_head_shares_the_new_parameter(folders):
    model = ours(folders[True])
    model.get_input_embeddings().requires_grad_(False)
    old = model.get_input_embeddings().weight
    model.resize_token_embeddings(130)
    new = model.get_input_embeddings().weight
    assert new is not old and isinstance(new, nn.Parameter) and not new.requires_grad
    assert model.lm_head.weight is new
    assert dict(model.named_parameters(remove_duplicate=False))["lm_head.weight"] is new


def test_mean_resizing_puts_added_rows_at_the_old_mean(folders):
    model = ours(folders[False])
    old_mean = model.model.embed_tokens.weight.mean(0)
    old_head_mean = model.lm_head.weight.mean(0)
    model.resize_token_embeddings(VOCAB + 40)
    added = model.model.embed_tokens.weight[VOCAB:]
    assert (added - old_mean).abs().max() < 1e-4
    assert (model.lm_head.weight[VOCAB:] - old_head_mean).abs().max() < 1e-4
    assert not torch.equal(added[0], added[1])  # sampled (covariance 1e-9 times the old rows'), not copied

    plain = ours(folders[False])
    plain.resize_token_embeddings(VOCAB + 40, mean_resizing=False)
    std = plain.model.embed_tokens.weight[VOCAB:].std().item()
    assert abs(std - plain.config.initializer_range) < 0.1 * plain.config.initializer_range


def test_pad_to_multiple_of_rounds_up_like_transformers(folders):
    for new_num_tokens, multiple, expected in ((130, 64, 192), (None, 48, 144), (128, 64, 128), (129, 1, 129)):
        model, hf = resized_pair(folders[False], new_num_tokens, pad_to_multiple_of=multiple)
        assert model.config.vocab_size == hf.config.vocab_size == expected
        assert model.lm_head.weight.shape[0] == hf.lm_head.weight.shape[0] == expected


@pytest.mark.parametrize("kwargs,named", [
    (dict(new_num_tokens=130, pad_to_multiple_of=0), "pad_to_multiple_of=0"),
    (dict(new_num_tokens=130, pad_to_multiple_of=-8), "pad_to_multiple_of=-8"),
    (dict(new_num_tokens=130, pad_to_multiple_of=2.5), "pad_to_multiple_of=2.5"),
    (dict(new_num_tokens=130, pad_to_multiple_of="64"), "pad_to_multiple_of='64'"),
    (dict(new_num_tokens=0), "new_num_tokens=0"),
    (dict(new_num_tokens=140.0), "new_num_tokens=140.0"),
])
def test_bad_sizes_are_refused_naming_the_value(folders, kwargs, named):
    model = ours(folders[True])
    with pytest.raises(ValueError, match="must be a positive int") as info:
        model.resize_token_embeddings(**kwargs)
    assert named in str(info.value)
    assert model.config.vocab_size == VOCAB and model.lm_head.weight.shape[0] == VOCAB


def test_no_size_returns_the_embedding_unchanged(folders):
    model = ours(folders[False])
    emb, weight, head_weight = model.model.embed_tokens, model.model.embed_tokens.weight, model.lm_head.weight
    assert model.resize_token_embeddings() is emb
    assert model.model.embed_tokens.weight is weight and model.lm_head.weight is head_weight
    assert model.config.vocab_size == VOCAB


# --- the resized model in use -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_saved_resized_model_loads_in_transformers(folders, tied, tmp_path):
    import transformers

    model, _ = resized_pair(folders[tied], 150)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 150, (2, 7))
    expected = logits(model, ids)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reloaded.config.vocab_size == 150 and reloaded.config.tie_word_embeddings == tied
    assert (logits(reloaded, ids) - expected).abs().max() < 1e-4
    assert torch.equal(logits(ours(tmp_path), ids), expected)


def test_generate_after_resize_equals_transformers(folders):
    model, hf = resized_pair(folders[False], 160, mean_resizing=False)
    prompt = torch.tensor([[5, 150, 17, 159, 42]])  # new tokens in the prompt
    got = model.generate(prompt, max_new_tokens=6, do_sample=False)
    expected = hf.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)


def test_weight_only_quantized_model_resizes_its_full_precision_head(folders):
    from gpuformers.quantization.config import WeightOnlyConfig

    model = ours(folders[False], quantization_config=WeightOnlyConfig(bits=8))
    ids = torch.randint(0, VOCAB, (1, 6))
    before = logits(model, ids)
    model.resize_token_embeddings(136)
    assert torch.equal(logits(model, ids)[..., :VOCAB], before)


def test_cpu_and_disk_device_map_resizes_like_the_unsplit_model(folders, tmp_path):
    plan = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk",
            "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    split = ours(folders[False], device_map=plan, offload_folder=tmp_path)
    torch.manual_seed(0)
    split.resize_token_embeddings(150)
    whole = ours(folders[False])
    torch.manual_seed(0)
    whole.resize_token_embeddings(150)
    ids = torch.randint(0, 150, (2, 7))
    assert (logits(split, ids) - logits(whole, ids)).abs().max() < 1e-5


# --- refusals -----------------------------------------------------------------------------------------------------


def test_quantized_head_is_refused(folders):
    from gpuformers.quantization.config import WeightOnlyConfig

    model = ours(folders[False], quantization_config=WeightOnlyConfig(bits=8, skip_modules=[]))
    with pytest.raises(TypeError, match=r"'lm_head' are a WeightOnlyLinear.*cannot be resized"):
        model.resize_token_embeddings(136)
    assert model.config.vocab_size == VOCAB and model.model.embed_tokens.weight.shape[0] == VOCAB


def test_head_offloaded_to_disk_is_refused(folders, tmp_path):
    model = ours(folders[False], device_map={"model": "cpu", "lm_head": "disk"}, offload_folder=tmp_path)
    with pytest.raises(RuntimeError, match="lm_head.weight is on the meta device"):
        model.resize_token_embeddings(136)
    assert model.config.vocab_size == VOCAB


def test_tensor_parallel_model_is_refused(folders):
    model = ours(folders[False])
    model.tp_plan = {"model.layers.*.self_attn.q_proj": "colwise"}  # what apply_tensor_parallel leaves (torchrun)
    with pytest.raises(RuntimeError, match="tensor-parallel"):
        model.resize_token_embeddings(136)


# --- accessors ----------------------------------------------------------------------------------------------------


def test_set_input_and_output_embeddings_replace_the_modules(folders):
    model = ours(folders[False])
    assert model.get_output_embeddings() is model.lm_head
    emb = nn.Embedding(VOCAB, 64)
    head = nn.Linear(64, VOCAB, bias=False)
    model.set_input_embeddings(emb)
    model.set_output_embeddings(head)
    assert model.get_input_embeddings() is emb and model.model.embed_tokens is emb
    assert model.get_output_embeddings() is head and model.lm_head is head
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        hidden = model.model(ids)[0]
    assert torch.equal(logits(model, ids), head(hidden))


# --- enable_input_require_grads -----------------------------------------------------------------------------------


def _layer_grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    return [p.grad for p in model.model.layers.parameters()]


def test_input_require_grads_lets_reentrant_checkpointing_train_after_frozen_embeddings(folders):
    ids = torch.randint(0, VOCAB, (2, 8))
    reference = ours(folders[False]).train()
    reference.get_input_embeddings().requires_grad_(False)
    expected = _layer_grads(reference, ids)

    model = ours(folders[False]).train()
    model.get_input_embeddings().requires_grad_(False)
    checkpoint_decoder_layers(model, "gradient_checkpointing", use_reentrant=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "None of the inputs have requires_grad=True"
        assert all(g is None for g in _layer_grads(model, ids))  # the problem the hook solves

    model.enable_input_require_grads()
    model.enable_input_require_grads()  # twice: still one hook
    assert len(model.get_input_embeddings()._forward_hooks) == 1
    got = _layer_grads(model, ids)
    assert all(g is not None for g in got)
    assert max((g - e).abs().max().item() for g, e in zip(got, expected)) < 1e-5
    assert model.get_input_embeddings().weight.grad is None  # still frozen

    model.disable_input_require_grads()
    assert not model.get_input_embeddings()._forward_hooks and not hasattr(model, "_require_grads_hook")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert all(g is None for g in _layer_grads(model, ids))
