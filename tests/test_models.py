"""Parity with transformers: the same checkpoint gives the same logits and the same greedy tokens.

Every family (llama, mistral, qwen2, qwen3), every rope type, GQA and MHA, tied and untied embeddings, biases,
sliding windows, single-file and sharded checkpoints; float32, max abs logit difference < 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.generation.cache import DynamicCache
from tests.fixtures.checkpoints import make_checkpoint, rewrite_config
from tests.models.parity import assert_loss_and_gradients_match

ATOL = 1e-4

CASES = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-head-dim": ("llama", {"head_dim": 32}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}),
    "llama-dynamic": ("llama", {"max_position_embeddings": 16,
                                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 16}}),
    "llama-llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16}}),
    "llama-longrope": ("llama", {"max_position_embeddings": 64,
                                 "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 12,
                                                     "long_factor": [1.0 + i / 4 for i in range(8)],
                                                     "short_factor": [1.0 + i / 16 for i in range(8)]}}),
    "mistral-window": ("mistral", {"sliding_window": 6}),
    "qwen2": ("qwen2", {}),
    "qwen2-window-tied": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
                                    "tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 24}),
    "qwen3-bias-mha": ("qwen3", {"attention_bias": True, "num_key_value_heads": 4, "head_dim": 16}),
}


def _inputs(batch=2, seq=20, vocab=128, pad=5):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0  # left padding in the second row
    ids[1, :pad] = 0
    return ids, mask


def _position_ids(mask):
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case name -> (folder, transformers model); built once per module, sharded for every other case."""
    out = {}
    for i, (name, (model_type, overrides)) in enumerate(CASES.items()):
        folder = tmp_path_factory.mktemp(name)
        shard = "40KB" if i % 2 else None
        out[name] = (folder, make_checkpoint(folder, model_type, max_shard_size=shard, **overrides))
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logits_match_transformers(checkpoints, case, attn):
    folder, hf = checkpoints[case]
    ours = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn, progress=False)
    ids, mask = _inputs()
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
        # generate() passes padding-aware positions: check that path as well.
        pos = _position_ids(mask)
        expected_pos = hf(ids, attention_mask=mask, position_ids=pos).logits
        got_pos = ours(ids, attention_mask=mask, position_ids=pos).logits
    valid = mask.bool()
    assert (got - expected)[valid].abs().max().item() < ATOL
    assert (got_pos - expected_pos)[valid].abs().max().item() < ATOL


def _greedy(model, ids, mask, steps, banned):
    """Greedy decoding through our KV cache, one token at a time."""
    cache = DynamicCache()
    pos = _position_ids(mask)
    out = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens = []
    for _ in range(steps):
        logits = out.logits[:, -1].clone()
        logits[:, banned] = float("-inf")
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(nxt)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        pos = pos[:, -1:] + 1
        out = model(nxt, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    return torch.cat(tokens, dim=1)


@pytest.mark.parametrize("case", ["llama-gqa", "mistral-window", "qwen2-window-tied", "qwen3", "llama-dynamic"])
def test_greedy_tokens_match_transformers(checkpoints, case):
    folder, hf = checkpoints[case]
    ours = AutoModelForCausalLM.from_pretrained(folder, progress=False)
    ids, mask = _inputs(seq=12, pad=3)
    eos = hf.config.eos_token_id
    with torch.no_grad():
        # min_new_tokens keeps transformers from stopping at eos; ours bans eos the same way.
        expected = hf.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                               pad_token_id=0)[:, ids.shape[1]:]
        got = _greedy(ours, ids, mask, 32, banned=[eos] if eos is not None else [])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("case", ["qwen3", "mistral-window"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_loss_and_gradients_match_transformers(checkpoints, case, attn):
    """With left padding the loss reads a pad position (the last pad predicts the first real token), whose query
    has no key to attend to: eager must pass gradients through that row as transformers' additive mask does."""
    folder, hf = checkpoints[case]
    ours = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn, progress=False)
    assert_loss_and_gradients_match(ours, hf, attn, *_inputs())


@pytest.mark.parametrize("case", ["llama-gqa", "llama-mha-tied"])
def test_memory_footprint_matches_transformers(checkpoints, case):
    folder, hf = checkpoints[case]
    ours = AutoModelForCausalLM.from_pretrained(folder, progress=False)
    assert ours.get_memory_footprint(return_buffers=False) == hf.get_memory_footprint(return_buffers=False)
    buffers = sum(b.numel() * b.element_size() for b in ours.buffers())
    assert ours.get_memory_footprint() == ours.get_memory_footprint(return_buffers=False) + buffers
    half = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, progress=False)
    assert half.get_memory_footprint(return_buffers=False) * 2 == ours.get_memory_footprint(return_buffers=False)


@pytest.mark.parametrize("case", ["llama-mha-tied", "qwen2", "qwen3"])
def test_transformers_loads_what_we_save(checkpoints, tmp_path, case):
    import transformers

    folder, hf = checkpoints[case]
    ours = AutoModelForCausalLM.from_pretrained(folder, progress=False)
    ours.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert (tmp_path / "generation_config.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours_again = AutoModelForCausalLM.from_pretrained(tmp_path, progress=False)
    ids, mask = _inputs()
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits
        assert (reloaded(ids, attention_mask=mask).logits - expected)[mask.bool()].abs().max() < ATOL
        assert (ours_again(ids, attention_mask=mask).logits - expected)[mask.bool()].abs().max() < ATOL
    if hf.config.tie_word_embeddings:
        assert ours_again.lm_head.weight is ours_again.model.embed_tokens.weight


def test_old_config_spelling(tmp_path):
    """rope_scaling + top-level rope_theta + torch_dtype, as transformers 4.x wrote them."""
    hf = make_checkpoint(tmp_path, "llama", rope_parameters={"rope_type": "linear", "factor": 3.0,
                                                              "rope_theta": 1234.0})
    config = rewrite_config(tmp_path, rope_parameters=None, rope_scaling={"type": "linear", "factor": 3.0},
                            rope_theta=1234.0, torch_dtype="float32", dtype=None)
    assert "rope_parameters" not in config
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, progress=False)
    assert ours.config.rope_parameters == {"rope_type": "linear", "factor": 3.0, "rope_theta": 1234.0}
    ids, mask = _inputs()
    with torch.no_grad():
        diff = (ours(ids, attention_mask=mask).logits - hf(ids, attention_mask=mask).logits)[mask.bool()]
    assert diff.abs().max() < ATOL


def test_bfloat16_load(checkpoints):
    folder, _ = checkpoints["qwen3"]
    for dtype in (torch.bfloat16, "bfloat16", "bf16"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, progress=False)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # frequencies stay exact
        assert model(torch.tensor([[5, 6, 7]])).logits.dtype == torch.bfloat16


def test_auto_dtype_follows_checkpoint(tmp_path):
    hf = make_checkpoint(tmp_path, "llama")
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, progress=False)
    assert model.dtype == torch.bfloat16
    rewrite_config(tmp_path, dtype=None, torch_dtype=None)  # no dtype in config: the first floating weight decides
    assert AutoModelForCausalLM.from_pretrained(tmp_path, progress=False).dtype == torch.bfloat16
    assert AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32", progress=False).dtype == torch.float32


def test_loads_by_hub_id_from_local_cache_offline(tmp_path, monkeypatch):
    """A checkpoint laid out as the HF cache stores it loads by its Hub id with HF_HUB_OFFLINE=1."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / commit
    hf = make_checkpoint(snapshot, "llama")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained("tiny-org/tiny-llama", cache_dir=tmp_path / "hub", progress=False)
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max() < ATOL
    with pytest.raises(FileNotFoundError, match="not in the local HF cache"):
        AutoModelForCausalLM.from_pretrained("tiny-org/absent", cache_dir=tmp_path / "hub", progress=False)


# --- bad input ---------------------------------------------------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path):
    make_checkpoint(tmp_path, "llama")
    return tmp_path


def test_missing_config(llama_dir):
    (llama_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        AutoModelForCausalLM.from_pretrained(llama_dir, progress=False)


def test_malformed_config(llama_dir):
    (llama_dir / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ValueError, match="not valid JSON"):
        AutoModelForCausalLM.from_pretrained(llama_dir, progress=False)


def test_unsupported_model_type(llama_dir):
    rewrite_config(llama_dir, model_type="bert")
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported; supported model types: llama, mistral"):
        AutoModelForCausalLM.from_pretrained(llama_dir, progress=False)


def test_unsupported_architecture(llama_dir):
    rewrite_config(llama_dir, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="architecture 'LlamaForSequenceClassification' is not supported.*"
                                         "LlamaForCausalLM"):
        AutoModelForCausalLM.from_pretrained(llama_dir, progress=False)


def test_missing_shard(tmp_path):
    make_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        AutoModelForCausalLM.from_pretrained(tmp_path, progress=False)


def test_truncated_safetensors(llama_dir):
    path = llama_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception, match="(?i)truncated|corrupt") as err:
        AutoModelForCausalLM.from_pretrained(llama_dir, progress=False)
    assert "model.safetensors" in str(err.value)


def test_corrupt_safetensors_header(llama_dir):
    path = llama_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"garbage!"  # the JSON header starts at byte 8
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="(?i)corrupt|truncated|header") as err:
        AutoModelForCausalLM.from_pretrained(llama_dir, progress=False)
    assert "model.safetensors" in str(err.value)


def test_wrong_tensor_shape(llama_dir):
    rewrite_config(llama_dir, intermediate_size=80)  # the weights were written for 96
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight.*shape \[\d+, \d+\].*shape \[\d+, \d+\]"):
        AutoModelForCausalLM.from_pretrained(llama_dir, progress=False)


def test_unknown_dtype(llama_dir):
    with pytest.raises(ValueError, match='dtype "bf17" is not one of: auto, float32, float16, bfloat16'):
        AutoModelForCausalLM.from_pretrained(llama_dir, dtype="bf17", progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_gpu_is_an_error(llama_dir):
    with pytest.raises(RuntimeError, match="(?i)no CUDA GPU"):
        AutoModelForCausalLM.from_pretrained(llama_dir, device_map="cuda", progress=False)


def test_unknown_options_say_so(llama_dir):
    with pytest.raises(TypeError, match="unexpected arguments: frobnicate"):
        AutoModelForCausalLM.from_pretrained(llama_dir, frobnicate=True, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_load_matches_cpu(checkpoints):
    folder, hf = checkpoints["qwen3"]
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda", dtype="float32", progress=False)
    assert model.device.type == "cuda"
    ids, mask = _inputs()
    with torch.no_grad():
        got = model(ids.cuda(), attention_mask=mask.cuda()).logits.cpu()
        expected = hf(ids, attention_mask=mask).logits
    assert (got - expected)[mask.bool()].abs().max() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sliding_window_without_a_mask(checkpoints):
    """A windowed model called without attention_mask builds its mask on the model's device."""
    folder, hf = checkpoints["mistral-window"]
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda", dtype="float32", progress=False)
    ids, _ = _inputs()
    with torch.no_grad():
        got = model(ids.cuda()).logits.cpu()
        expected = hf(ids).logits
    assert (got - expected).abs().max() < 1e-3


def test_padded_batch_compiles_in_one_graph(checkpoints):
    """A left-padded batch runs under torch.compile(fullgraph=True): the mask is built in the graph, no break."""
    ours = AutoModelForCausalLM.from_pretrained(checkpoints["llama-gqa"][0], progress=False)
    ids = torch.randint(0, 128, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    expected = ours(ids, attention_mask=mask, use_cache=False).logits
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    got = compiled(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-5)
