"""GGUF files of the families beyond llama / qwen2 / qwen3 (qwen3moe, phi3, gemma2, gemma3) against transformers.

Each file is written with gguf.GGUFWriter from a tiny random transformers model, laid out as llama.cpp's converter
lays it out (gguf's own tensor-name map, Gemma's norms stored as 1 + w, Qwen3-MoE's experts stacked per layer,
Phi-3's fused qkv and gate/up), then loaded by gpuformers and by transformers' `from_pretrained(gguf_file=...)`:
config fields, tensors, logits, greedy tokens and tokenizers must agree. Tiny sizes are chosen where transformers'
GGUF loader falls back on its config defaults (Qwen3-MoE's moe_intermediate_size 768, Gemma's
query_pre_attn_scalar 256), so that both loaders build the same model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gpuformers.loading.gguf import read_gguf  # noqa: E402
from tests.test_gguf import TEXTS, _byte_level_vocab, _sentencepiece_vocab  # noqa: E402

Q = gguf.GGMLQuantizationType
CHAT_TEMPLATE = "{% for m in messages %}<start>{{ m.role }}\n{{ m.content }}<end>\n{% endfor %}"
# Stacked experts: transformers' (experts, 2 * ff, hidden) gate_up_proj is llama.cpp's gate then up tensors.
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


# ----- tiny transformers models, one per family -----


def _hf_config(family: str, vocab_size: int, long_context: bool = False):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3moe":
        return transformers.Qwen3MoeConfig(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=32, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False,
                                           rope_theta=1_000_000.0)
    if family == "phi3" and long_context:  # Phi-3.5 / Phi-4-mini: longrope, 3/4 of each head rotated (12 of 16 dims)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0 + i for i in range(6)]}
        return transformers.Phi3Config(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False, partial_rotary_factor=0.75,
                                       original_max_position_embeddings=64, rope_parameters=rope)
    if family == "phi3":
        return transformers.Phi3Config(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False, rope_theta=10000.0)
    if family == "gemma2":
        return transformers.Gemma2Config(**common, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=256, query_pre_attn_scalar=256, sliding_window=4,
                                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0)
    # Gemma 3: five sliding layers, then a global one; a window of 4 makes the layer types show in the logits.
    # Gemma 3 4B and up stretch the global layers' rope 8 times (linear); the sliding ones keep 10k.
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return transformers.Gemma3TextConfig(**common, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=256, query_pre_attn_scalar=256, sliding_window=4,
                                         **({"rope_parameters": rope} if long_context else
                                            {"rope_theta": 1_000_000.0}))


def _tiny_model(family: str, vocab_size: int, long_context: bool = False):
    """A random transformers model of the family, its norms away from their starting values."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(family, vocab_size, long_context), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.1)
            if name.endswith("norm.weight") and not family.startswith("gemma"):
                param += 1.0  # llama-style norms multiply by the weight; Gemma's by 1 + weight
    return model


def _per_expert(state_dict: dict, experts: int) -> dict:
    """transformers' stacked experts (gate_up_proj, down_proj) -> one gate/up/down weight per expert, as ours."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)  # (experts, ff, hidden) each
            stacked = {"gate_proj": gate, "up_proj": up}
        elif name.endswith("mlp.experts.down_proj"):
            stacked = {"down_proj": tensor}
        else:
            out[name] = tensor
            continue
        prefix = name.rsplit(".", 1)[0]
        for proj, weights in stacked.items():
            for e in range(experts):
                out[f"{prefix}.{e}.{proj}.weight"] = weights[e]
    return out


# ----- writing the GGUF file as llama.cpp's converter does -----


def _gguf_tensors(family: str, model) -> dict[str, np.ndarray]:
    """llama.cpp name -> array in torch order, named by gguf's own HF -> GGUF map."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == family)
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)
    state = _per_expert(model.state_dict(), getattr(model.config, "num_experts", 0))
    tensors, stacks = {}, {}
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if family.startswith("gemma") and hf_name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's Gemma converter stores the factor the norm multiplies by
        parts = hf_name.split(".")
        if "experts" in parts:  # model.layers.L.mlp.experts.E.proj.weight -> blk.L.ffn_*_exps (stacked by E)
            stacks.setdefault(f"blk.{parts[2]}.{_EXPERT_GGUF[parts[6]]}.weight", []).append(array)
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_name = name_map.get_name(stem)
        assert gguf_name is not None, hf_name
        tensors[f"{gguf_name}.{suffix}"] = array
    return tensors | {name: np.stack(arrays) for name, arrays in stacks.items()}


def write_family_gguf(path, family: str, qtype=Q.F32, long_context: bool = False):
    """Write a tiny `family` GGUF (with `long_context`: Phi-3.5's longrope and partial rotary, Gemma 3 4B's linear
    rope scaling); returns the transformers model its weights come from."""
    byte_level = family == "qwen3moe"
    if byte_level:
        tokens, token_types, merges = _byte_level_vocab()
    else:
        tokens, token_types, scores = _sentencepiece_vocab()
    if family.startswith("gemma"):
        # llama.cpp stores Gemma's runs of spaces ("\u2581\u2581" pieces) as spaces, and Gemma's scores do not
        # follow the merge order
        tokens, token_types = tokens + ["  ", "   "], token_types + [1, 1]
        scores = [0.0] * len(tokens)
    model = _tiny_model(family, len(tokens), long_context)
    config = model.config

    writer = gguf.GGUFWriter(str(path), family)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters.get("rope_theta")
                              or config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_vocab_size(len(tokens))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if family != "phi3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family == "phi3":
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_sliding_window(2047)  # as Phi-3-mini's; the prompts below are shorter
        if rope["rope_type"] == "longrope":  # llama.cpp keeps longrope's factors as tensors
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if family == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
    if family == "gemma3" and long_context:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])
    if family == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)

    writer.add_tokenizer_model("gpt2" if byte_level else "llama")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if byte_level:
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(merges)
        writer.add_add_bos_token(False)
    else:
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)

    for name, array in _gguf_tensors(family, model).items():
        if array.ndim == 1 or qtype == Q.F32:  # 1-D tensors stay F32, as in llama.cpp
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


# ----- model parity -----

FAMILIES = {"qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gemma3": "Gemma3ForCausalLM"}
CONFIG_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                 "rope_theta")
FAMILY_FIELDS = {
    "qwen3moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"),
    "phi3": (),
    "gemma2": ("sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
               "final_logit_softcapping", "hidden_activation"),
    "gemma3": ("sliding_window", "layer_types", "query_pre_attn_scalar", "hidden_activation"),
}


def _field(config, key):
    if key == "rope_theta":
        rope = config.rope_parameters
        return (rope.get("full_attention") or rope)["rope_theta"]
    value = getattr(config, key, None)
    if key == "head_dim" and value is None:  # transformers' Phi3Config has none: hidden_size / heads
        return config.hidden_size // config.num_attention_heads
    return config.extra[key] if value is None and key in getattr(config, "extra", {}) else value


def _numeric(value) -> bool:
    """A number, or a list or tuple of numbers (what pytest.approx accepts); bools are not."""
    if isinstance(value, (list, tuple)):
        return all(_numeric(item) for item in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(tmp_path, family, qtype):
    """Config, every tensor, logits and greedy tokens equal transformers' load of the same file; F32 tensors also
    equal the weights the file was written from."""
    from transformers import AutoModelForCausalLM as HFAutoModel

    from gpuformers import AutoModelForCausalLM

    source = write_family_gguf(tmp_path / "m.gguf", family, qtype)
    ckpt = read_gguf(tmp_path / "m.gguf")
    theirs = HFAutoModel.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype="float32", progress=False)
    assert type(ours).__name__ == type(theirs).__name__ == FAMILIES[family]
    for key in CONFIG_FIELDS + FAMILY_FIELDS[family]:
        # float32 metadata: transformers reads 1e-06 as 9.99999997e-07, we as the shortest decimal (docs/gguf.md).
        # Only numbers are compared approximately: pytest.approx refuses strings (layer_types) since pytest 9.
        value = _field(source.config, key)
        expected = pytest.approx(value, rel=1e-6) if _numeric(value) else value
        assert _field(ours.config, key) == expected and _field(theirs.config, key) == expected, key

    experts = getattr(source.config, "num_experts", 0)
    reference = _per_expert({k: v.detach() for k, v in theirs.state_dict().items()}, experts)
    original = _per_expert({k: v.detach() for k, v in source.state_dict().items()}, experts)
    names = set(ckpt.tensor_names()) | ({"lm_head.weight"} if ckpt.config["tie_word_embeddings"] else set())
    assert names == set(reference) == set(original)
    for name in ckpt.tensor_names():
        mine = ckpt.load_tensor(name)
        assert mine.shape == ckpt.tensor_shape(name) == reference[name].shape, name
        assert torch.equal(mine, reference[name]), f"{name} ({ckpt.quant_type(name)}) differs from transformers'"
        if qtype == Q.F32 or mine.ndim == 1:  # (1 + w) - 1 may round in the last bit for Gemma's norms
            torch.testing.assert_close(mine, original[name], rtol=0, atol=1e-6, msg=name)
        else:
            assert (mine - original[name]).abs().max() < 0.01, name

    ids = torch.tensor([[5, 17, 300, 42, 99, 7, 250, 3, 11, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        diff = (ours(ids).logits - theirs(ids).logits).abs().max().item()
        assert diff < 1e-4, f"{family}: max abs logit diff {diff}"
        out = ours.generate(ids[:1], max_new_tokens=8, do_sample=False)
        expected = theirs.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8 and out.tolist() == expected.tolist()


def test_phi3_longrope_and_partial_rotary(tmp_path):
    """Phi-3.5's rope as llama.cpp stores it (rope_factors_long/short tensors, rope.dimension_count 12 of 16 dims)
    becomes longrope with partial_rotary_factor 0.75: logits equal the transformers model the file was written from,
    past original_max_position_embeddings (long factors) and before it (short factors). transformers' GGUF loader
    drops both, so it is not the reference here."""
    from gpuformers import AutoModelForCausalLM

    source = write_family_gguf(tmp_path / "p.gguf", "phi3", long_context=True)
    ckpt = read_gguf(tmp_path / "p.gguf")
    assert "rope_factors_long.weight" not in " ".join(ckpt.tensor_names())
    assert ckpt.config["rope_scaling"] == {"rope_type": "longrope", "long_factor": [2.0 + i for i in range(6)],
                                           "short_factor": pytest.approx([1.0 + 0.1 * i for i in range(6)]),
                                           "original_max_position_embeddings": 64}
    assert ckpt.config["partial_rotary_factor"] == 0.75 and ckpt.config["head_dim"] == 16
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="p.gguf", dtype="float32", progress=False)
    for length in (80, 12):  # long factors first: the rotary cache must switch back for a short prompt
        ids = torch.arange(length).reshape(1, -1) % 300 + 3
        with torch.no_grad():
            diff = (ours(ids).logits - source(ids).logits).abs().max().item()
        assert diff < 1e-4, f"{length} tokens: max abs logit diff {diff}"


def test_gemma3_linear_rope_scaling(tmp_path):
    """Gemma 3 4B's gemma3.rope.scaling (linear, factor 8) stretches the global layers' rope only: logits equal the
    transformers model the file was written from (transformers' GGUF loader drops the scaling)."""
    from gpuformers import AutoModelForCausalLM

    source = write_family_gguf(tmp_path / "g.gguf", "gemma3", long_context=True)
    assert read_gguf(tmp_path / "g.gguf").config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="g.gguf", dtype="float32", progress=False)
    assert ours.config.layer_types.count("full_attention") == 1
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        diff = (ours(ids).logits - source(ids).logits).abs().max().item()
    assert diff < 1e-4, f"max abs logit diff {diff}"


# ----- tokenizers -----


@pytest.mark.parametrize("family", ["qwen3moe", "phi3", "gemma3"])
def test_family_tokenizer_matches_transformers(tmp_path, family):
    """Token ids, decoding, special tokens and the chat template equal transformers' for the family's vocabulary:
    Qwen's byte-level BPE, Phi-3's normalizer-prefixed SentencePiece, Gemma's (space runs, file-order merges)."""
    from transformers import AutoTokenizer as HFAutoTokenizer

    from gpuformers import AutoTokenizer

    write_family_gguf(tmp_path / "t.gguf", family)
    ours = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    theirs = HFAutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    texts = TEXTS + ["   three leading spaces", "in   between   words\n\n  x", " one leading</s> after <s>"]
    for text in texts:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    assert ours.chat_template == theirs.chat_template == CHAT_TEMPLATE
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
