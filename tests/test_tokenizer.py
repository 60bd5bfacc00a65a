"""Tests for gpuformers.tokenizer: parity with transformers' tokenizer on the real Qwen3 files, and behaviour
(padding, truncation, tensors, special tokens, saving, chat templates, errors) on tiny tokenizers built here.

transformers is the oracle and is imported inside fixtures only (it costs seconds to import).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from gpuformers.tokenizer import BatchEncoding, PreTrainedTokenizerFast
from tests.assets import qwen3_tokenizer_dir

MULTILINGUAL = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。机器学习很有趣。",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧‍👦 ✨",
    "def square(x: int) -> int:\n    return x ** 2  # τετράγωνο\n\tprint(f'{x=}')",
    "Accents: café, naïve, Ñandú, Ærøskøbing, straße, Crème brûlée",
    "Mixed 日本語 and English, русский текст, 한국어 텍스트 <|im_start|> tags <think>",
    "   leading spaces, trailing spaces   \n\n\nnewlines",
]

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Réponds en français 🇫🇷"},
    {"role": "assistant", "content": "<think>\nThe user asks about France.\n</think>\n\nLa capitale est Paris."},
    {"role": "user", "content": "And of 日本?"},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather für a city, e.g. <Paris> & 'Lyon'",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def qwen3_pair():
    """(ours, transformers') tokenizers on the same Qwen3 folder."""
    folder = qwen3_tokenizer_dir()
    from transformers import AutoTokenizer

    return PreTrainedTokenizerFast.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def _tiny_backend() -> Tokenizer:
    """A word-level tokenizer trained on a few sentences, with BOS/EOS added by its post-processor."""
    corpus = ["the cat sat on the mat", "a dog ran in the park", "hello world", "the quick brown fox"] * 3
    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "<s>", "</s>"]))
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> $B </s>",
        special_tokens=[("<s>", backend.token_to_id("<s>")), ("</s>", backend.token_to_id("</s>"))],
    )
    backend.decoder = decoders.WordPiece()
    return backend


SIMPLE_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def tiny() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        _tiny_backend(),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="[UNK]",
        pad_token="[PAD]",
        chat_template=SIMPLE_TEMPLATE,
    )


# ---------------------------------------------------------------------- Qwen3 parity with transformers


def test_qwen3_encode_decode_matches_transformers(qwen3_pair):
    ours, ref = qwen3_pair
    for text in MULTILINGUAL:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.tokenize(text) == ref.tokenize(text)
        assert ours.decode(ids) == ref.decode(ids) == text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.batch_decode([ours.encode(t) for t in MULTILINGUAL]) == MULTILINGUAL
    # Batches with left padding, as generation uses them, tensors included.
    ours.padding_side = ref.padding_side = "left"
    try:
        a = ours(MULTILINGUAL, padding=True, return_tensors="pt")
        b = ref(MULTILINGUAL, padding=True, return_tensors="pt")
    finally:
        ours.padding_side = ref.padding_side = "right"
    assert set(a) == set(b) == {"input_ids", "attention_mask"}
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["attention_mask"], b["attention_mask"])
    assert a["attention_mask"][:, 0].tolist().count(0) > 0  # some rows really are left-padded


def test_qwen3_decode_never_splits_utf8(qwen3_pair):
    ours, _ = qwen3_pair
    text = "😀👍🏽你好🇫🇷é"
    ids = ours.encode(text)
    assert len(ids) > len(text) // 2  # multi-byte characters span several byte-level tokens
    for end in range(1, len(ids) + 1):
        partial = ours.decode(ids[:end])
        # A prefix cut inside a character may end in U+FFFD, but never yields a character that is not in the text.
        assert set(partial) <= set(text) | {"\ufffd"}, (end, partial)
    assert ours.decode(torch.tensor(ids)) == text


def test_qwen3_special_tokens_match_transformers(qwen3_pair):
    ours, ref = qwen3_pair
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.all_special_tokens == ref.all_special_tokens
    assert ours.all_special_ids == ref.all_special_ids
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (
        ref.eos_token_id,
        ref.pad_token_id,
        ref.bos_token_id,
    )
    assert (len(ours), ours.vocab_size) == (len(ref), ref.vocab_size)
    assert ours.model_max_length == ref.model_max_length == 131072
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == ref.convert_ids_to_tokens(
        ids, skip_special_tokens=True
    )
    assert ours.convert_tokens_to_ids(["<|im_end|>", "hi"]) == ref.convert_tokens_to_ids(["<|im_end|>", "hi"])


@pytest.mark.parametrize(
    "template_kwargs",
    [{}, {"tools": [WEATHER_TOOL]}, {"enable_thinking": False}],
    ids=["plain", "tools", "no-thinking"],
)
def test_qwen3_chat_template_matches_transformers(qwen3_pair, template_kwargs):
    ours, ref = qwen3_pair
    text = ours.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False, **template_kwargs)
    assert text == ref.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False, **template_kwargs)
    assert text.endswith(
        "<|im_start|>assistant\n"
        + ("<think>\n\n</think>\n\n" if template_kwargs.get("enable_thinking") is False else "")
    )
    ids = ours.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False, **template_kwargs)
    assert ids == ref.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, return_dict=False, **template_kwargs
    )
    encoded = ours.apply_chat_template(CONVERSATION, add_generation_prompt=True, **template_kwargs)
    assert isinstance(encoded, BatchEncoding) and encoded.input_ids == ids and encoded.attention_mask == [1] * len(ids)


def test_qwen3_tool_calls_batch_and_continuation_match_transformers(qwen3_pair):
    ours, ref = qwen3_pair
    tool_chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
            ],
        },
        {"role": "tool", "content": '{"temp": 21, "sky": "☀️"}'},
        {"role": "assistant", "content": "It is 21°C.", "reasoning_content": "Read the tool output."},
        {"role": "user", "content": "Thanks", "name": None},  # None-valued keys are dropped, as in transformers
    ]
    # "reasoning" is an alias that transformers copies to reasoning_content, which the Qwen3 template reads.
    continued = [*CONVERSATION, {"role": "assistant", "content": "Tokyo is the", "reasoning": "Japan's capital."}]
    for chat, kwargs in (
        (tool_chat, {"tools": [WEATHER_TOOL], "add_generation_prompt": True}),
        (continued, {"continue_final_message": True}),
    ):
        a = ours.apply_chat_template(chat, tokenize=False, **kwargs)
        assert a == ref.apply_chat_template(chat, tokenize=False, **kwargs)
    assert a.endswith("<think>\nJapan's capital.\n</think>\n\nTokyo is the")  # the continued message stays open
    batch = [CONVERSATION, CONVERSATION[:2]]
    ours.padding_side = ref.padding_side = "left"
    try:
        a = ours.apply_chat_template(batch, add_generation_prompt=True, padding=True, return_tensors="pt")
        b = ref.apply_chat_template(batch, add_generation_prompt=True, padding=True, return_tensors="pt")
    finally:
        ours.padding_side = ref.padding_side = "right"
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["attention_mask"], b["attention_mask"])
    assert a["input_ids"].shape[0] == 2 and a["attention_mask"][1, 0] == 0


def test_qwen3_save_round_trip_loads_in_transformers(qwen3_pair, tmp_path):
    ours, ref = qwen3_pair
    ours.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text(encoding="utf-8") == ref.chat_template
    from transformers import AutoTokenizer

    reloaded_ref = AutoTokenizer.from_pretrained(tmp_path)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    text = MULTILINGUAL[6]
    assert reloaded_ref.encode(text) == reloaded.encode(text) == ref.encode(text)
    assert reloaded_ref.all_special_tokens == reloaded.all_special_tokens == ref.all_special_tokens
    assert reloaded.apply_chat_template(CONVERSATION, tokenize=False) == ref.apply_chat_template(
        CONVERSATION, tokenize=False
    )


# ---------------------------------------------------------------------- Jinja features, against transformers


def test_template_helpers_match_transformers(tiny, tmp_path):
    template = (
        "  {% if messages %}\n    lstrip and trim blocks\n  {% endif %}\n"
        "{%- set ns = namespace(n=0) -%}"
        "{%- for m in messages -%}{%- if loop.index > 2 %}{% break %}{% endif -%}"
        "{%- set ns.n = ns.n + 1 -%}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=True) }}\n"
        "{%- endfor -%}"
        "{{ ns.n }} {{ dict(a=1) | tojson }} {{ bos_token }}{{ eos_token }} {{ custom }} {{ tools | tojson }}"
    )
    chat = [
        {"role": "user", "content": "é <b>&'\"</b> 😀"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "y"},
    ]
    rendered = tiny.apply_chat_template(chat, chat_template=template, tokenize=False, custom="kw", tools=[WEATHER_TOOL])
    assert '"é <b>&\'\\"</b> 😀"' in rendered  # plain JSON: no HTML escaping, no \\u escapes
    assert rendered.count("\n") > 2 and '2 {"a": 1} <s></s> kw' in rendered
    tiny.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tmp_path)
    assert rendered == ref.apply_chat_template(
        chat, chat_template=template, tokenize=False, custom="kw", tools=[WEATHER_TOOL]
    )


def test_template_raise_exception_strftime_and_sandbox(tiny):
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="only user and assistant"):
        tiny.apply_chat_template(
            [{"role": "system", "content": "x"}],
            chat_template="{% if messages[0].role == 'system' %}{{ raise_exception('only user and assistant') }}{% endif %}",
        )
    from datetime import datetime

    year = tiny.apply_chat_template(
        [{"role": "user", "content": "x"}], chat_template="{{ strftime_now('%Y') }}", tokenize=False
    )
    assert year == str(datetime.now().year)
    with pytest.raises(jinja2.exceptions.SecurityError):
        tiny.apply_chat_template(
            [{"role": "user", "content": "x"}], chat_template="{% set ns = namespace(_x=1) %}", tokenize=False
        )
    with pytest.raises(jinja2.exceptions.SecurityError, match="unsafe"):  # templates are untrusted code
        tiny.apply_chat_template(
            [{"role": "user", "content": "x"}], chat_template="{{ messages.__class__.__mro__ }}", tokenize=False
        )


def test_assistant_masks_match_transformers(tiny, tmp_path):
    # A user message ending in "." puts a token end exactly at the start of the next span: it must stay 0.
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} {{ eos_token }}"
        "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    chat = [
        {"role": "user", "content": "hello world."},
        {"role": "assistant", "content": "the cat sat"},
        {"role": "user", "content": "the dog."},
        {"role": "assistant", "content": "on the mat"},
    ]
    ours = tiny.apply_chat_template(chat, chat_template=template, return_assistant_tokens_mask=True)
    tokens = tiny.convert_ids_to_tokens(ours["input_ids"])
    assert [t for t, m in zip(tokens, ours["assistant_masks"]) if m] == [
        "the",
        "cat",
        "sat",
        "</s>",
        "on",
        "the",
        "mat",
        "</s>",
    ]
    tiny.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tmp_path)
    expected = ref.apply_chat_template(
        chat, chat_template=template, return_assistant_tokens_mask=True, return_dict=True
    )
    assert ours["assistant_masks"] == expected["assistant_masks"] and ours["input_ids"] == expected["input_ids"]


# ---------------------------------------------------------------------- tiny tokenizer behaviour


def test_padding_right_and_left_with_attention_masks(tiny):
    texts = ["the cat", "hello world the dog"]
    right = tiny(texts, padding=True)
    pad, bos, eos = tiny.pad_token_id, tiny.bos_token_id, tiny.eos_token_id
    the, cat = tiny.convert_tokens_to_ids(["the", "cat"])
    assert right["input_ids"][0] == [bos, the, cat, eos, pad, pad]
    assert right["attention_mask"] == [[1, 1, 1, 1, 0, 0], [1] * 6]
    left = tiny(texts, padding="longest", padding_side="left")
    assert left["input_ids"][0] == [pad, pad, bos, the, cat, eos]
    assert left["attention_mask"][0] == [0, 0, 1, 1, 1, 1]
    tiny.padding_side = "left"
    assert tiny(texts, padding=True)["input_ids"] == left["input_ids"]
    fixed = tiny(texts, padding="max_length", max_length=8)
    assert [len(row) for row in fixed["input_ids"]] == [8, 8] and fixed["attention_mask"][1][:2] == [0, 0]
    single = tiny("the cat")  # no padding asked: flat lists, no pad ids
    assert single["input_ids"] == [bos, the, cat, eos] and single.attention_mask == [1, 1, 1, 1]


def test_truncation_sides_and_max_length(tiny):
    text = "the quick brown fox sat on the mat"
    ids = tiny(text)["input_ids"]
    right = tiny(text, truncation=True, max_length=5)["input_ids"]
    assert right == ids[:4] + [tiny.eos_token_id]  # BOS/EOS kept, the text is cut
    assert tiny(text, max_length=5)["input_ids"] == right  # max_length alone truncates, as in transformers
    tiny.truncation_side = "left"
    left = tiny(text, truncation=True, max_length=5)["input_ids"]
    assert left == [tiny.bos_token_id] + ids[-4:]
    assert tiny(text, truncation=True)["input_ids"] == ids  # no max_length and no model_max_length: no cut
    tiny.model_max_length = 4
    assert len(tiny(text, truncation=True)["input_ids"]) == 4
    assert len(tiny(text, truncation=False, max_length=3)["input_ids"]) == len(ids)


def test_return_tensors_and_batch_encoding(tiny):
    batch = tiny(["the cat", "a dog ran"], padding=True, return_tensors="pt")
    assert isinstance(batch, BatchEncoding)
    assert batch.input_ids.dtype == torch.long and batch.input_ids.shape == batch.attention_mask.shape == (2, 5)
    assert batch.to("cpu") is batch and batch["input_ids"].device.type == "cpu"
    assert tiny("the cat", return_tensors="pt")["input_ids"].shape == (1, 4)
    assert tiny.encode("the cat", return_tensors="pt").shape == (1, 4)
    assert tiny(["the cat"], return_tensors="np")["input_ids"].shape == (1, 4)
    with pytest.raises(ValueError, match="padding=True"):
        tiny(["the cat", "a dog ran"], return_tensors="pt")
    with pytest.raises(AttributeError, match="input_ids"):
        _ = batch.labels
    assert batch.tokens(0)[:3] == ["<s>", "the", "cat"]


def test_special_tokens_skipped_on_decode(tiny):
    ids = tiny("the zebra cat", padding="max_length", max_length=7)["input_ids"]
    assert tiny.decode(ids) == "<s> the [UNK] cat </s> [PAD] [PAD]"
    assert tiny.decode(ids, skip_special_tokens=True) == "the cat"
    assert tiny.batch_decode(torch.tensor([ids, ids]), skip_special_tokens=True) == ["the cat", "the cat"]
    assert tiny.convert_ids_to_tokens(ids, skip_special_tokens=True) == ["the", "cat"]
    assert tiny.all_special_tokens == ["<s>", "</s>", "[UNK]", "[PAD]"]
    assert tiny.convert_tokens_to_ids("zebra") == tiny.unk_token_id == 0
    tiny.pad_token_id = tiny.eos_token_id  # the id setter names the token
    assert tiny.pad_token == "</s>"


def test_tokenizer_pickles_for_dataloader_workers(tiny):
    import copy
    import pickle

    clone = pickle.loads(pickle.dumps(tiny))
    assert clone(["the cat", "a dog"], padding=True) == tiny(["the cat", "a dog"], padding=True)
    copy.deepcopy(tiny).pad_token = "</s>"
    assert tiny.pad_token == "[PAD]"  # the copy is independent
    with pytest.raises(TypeError, match="batch_decode"):
        tiny.decode(torch.tensor([[4, 5]]))


def test_pad_for_data_collators(tiny):
    rows = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]
    out = tiny.pad(rows, return_tensors="pt", pad_to_multiple_of=4)
    assert out["input_ids"].tolist() == [[5, 6, 7, 1], [8, 1, 1, 1]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    left = tiny.pad({"input_ids": [[5, 6, 7], [8]]}, padding_side="left")
    assert left["input_ids"] == [[5, 6, 7], [1, 1, 8]] and left["attention_mask"][1] == [0, 0, 1]


def test_save_round_trip_and_transformers_loads_it(tiny, tmp_path):
    tiny.padding_side = "left"
    tiny.chat_template = {"default": SIMPLE_TEMPLATE, "tool_use": "TOOLS {{ tools | length }}"}
    files = tiny.save_pretrained(tmp_path)
    assert {Path(f).name for f in files} == {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "tool_use.jinja",
    }
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    texts = ["the cat sat", "a dog ran in the park", "zebra"]
    assert dict(reloaded(texts, padding=True)) == dict(tiny(texts, padding=True))
    assert reloaded.padding_side == "left" and reloaded.special_tokens_map == tiny.special_tokens_map
    assert reloaded.chat_template == tiny.chat_template
    chat = [{"role": "user", "content": "hello world"}]
    assert reloaded.apply_chat_template(chat, tools=[WEATHER_TOOL], tokenize=False) == "TOOLS 1"
    assert reloaded.apply_chat_template(chat, tokenize=False) == "<user>hello world</s>\n"
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tmp_path)
    got, want = ref(texts, padding=True), tiny(texts, padding=True)
    assert got["input_ids"] == want["input_ids"] and got["attention_mask"] == want["attention_mask"]
    assert ref.padding_side == "left" and ref.pad_token == "[PAD]" and ref.eos_token == "</s>"
    assert (
        ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        == tiny.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        == "<user>hello world</s>\n<assistant>"
    )


def test_loads_legacy_files_and_added_token_dicts(tmp_path):
    _tiny_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {
                    "__type": "AddedToken",
                    "content": "<s>",
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                },
                "model_max_length": 16,
                "image_token": "<image>",
                "errors": "replace",
            }
        )
    )
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "[PAD]"}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path, padding_side="left")
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.padding_side) == ("<s>", "</s>", "[PAD]", "left")
    assert tok.model_max_length == 16 and len(tok("the " * 30, truncation=True)["input_ids"]) == 16
    assert tok.image_token == "<image>" and tok.image_token_id == len(tok) - 1  # a model-specific token, added
    assert tok.encode("the <image> cat", add_special_tokens=False)[1] == tok.image_token_id
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"
    tok.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert saved["errors"] == "replace" and saved["image_token"] == "<image>"


# ---------------------------------------------------------------------- errors people will meet


def test_error_folder_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json.*tokenizer\.model.*Only fast tokenizers"):
        PreTrainedTokenizerFast.from_pretrained(tmp_path)


def test_error_malformed_tokenizer_config(tmp_path):
    _tiny_backend().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{\n  "eos_token": "</s>",\n  "pad_token": \n}')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json is not valid JSON .*line 4"):
        PreTrainedTokenizerFast.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('["not", "an", "object"]')
    with pytest.raises(ValueError, match="must hold a JSON object"):
        PreTrainedTokenizerFast.from_pretrained(tmp_path)


def test_error_padding_without_pad_token():
    tok = PreTrainedTokenizerFast(_tiny_backend(), eos_token="</s>")
    with pytest.raises(ValueError, match=r"tokenizer\.pad_token = tokenizer\.eos_token"):
        tok(["the cat", "a dog ran"], padding=True)
    tok.pad_token = tok.eos_token
    assert tok(["the cat", "a dog ran"], padding=True)["input_ids"][0][-1] == tok.eos_token_id


def test_error_messages_name_the_bad_value(tiny):
    with pytest.raises(ValueError, match=r'padding_side "middle" is not one of: left, right'):
        PreTrainedTokenizerFast(_tiny_backend(), padding_side="middle")
    with pytest.raises(ValueError, match="padding 'shortest' is not one of"):
        tiny("the cat", padding="shortest")
    with pytest.raises(TypeError, match="got an item of type int"):
        tiny(["the cat", 3])
    tiny.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tiny.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError, match="JSON-schema dicts"):
        tiny.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="x", tools=[print])


# ---------------------------------------------------------------------- token / word / character maps


def test_alignment_maps_match_transformers(qwen3_pair):
    ours, theirs = qwen3_pair
    cases = [
        dict(text=["Hello world, this is Qwen.", "déjà vu — naïve café"]),
        dict(text=["Question: where?"], text_pair=["Context: over there, by the sea."]),
        dict(text=[["Split", "into", "words", "déjà"], ["one"]], is_split_into_words=True),
        dict(text=["a b c d e f g h i j k"], truncation=True, max_length=4),
    ]
    for kwargs in cases:
        mine, ref = ours(**kwargs, padding=True), theirs(**kwargs, padding=True)
        assert mine.is_fast and mine.n_sequences == ref.n_sequences
        for b in range(len(ref["input_ids"])):
            assert mine.tokens(b) == ref.tokens(b)
            assert mine.word_ids(b) == ref.word_ids(b) and mine.sequence_ids(b) == ref.sequence_ids(b)
            for t in range(len(ref["input_ids"][b])):
                assert mine.token_to_word(b, t) == ref.token_to_word(b, t)
                assert mine.token_to_sequence(b, t) == ref.token_to_sequence(b, t)
                assert mine.token_to_chars(b, t) == ref.token_to_chars(b, t)
            for seq in range(ref.n_sequences):
                for w in range(max((i for i in ref.word_ids(b) if i is not None), default=-1) + 1):
                    assert mine.word_to_tokens(b, w, seq) == ref.word_to_tokens(b, w, seq)
                    try:
                        expected = ref.word_to_chars(b, w, seq)
                    except TypeError:  # transformers fails on a word the other text has: we say None
                        expected = None
                    assert mine.word_to_chars(b, w, seq) == expected
                text = kwargs["text_pair" if seq else "text"][b]
                for c in range(len(text) if isinstance(text, str) else 0):
                    assert mine.char_to_token(b, c, seq) == ref.char_to_token(b, c, seq)
                    assert mine.char_to_word(b, c, seq) == ref.char_to_word(b, c, seq)
    single = ours("Hello world")  # one text: f(i) reads its item i; a negative token index counts from the end
    assert single.token_to_chars(0) == (0, 5) and single.token_to_chars(-1) == single.token_to_chars(1) == (5, 11)
    assert single.word_to_tokens(1) == (1, 2) and single.char_to_token(6) == 1 and single.char_to_word(7) == 1
    from gpuformers.tokenizer import CharSpan, TokenSpan

    assert isinstance(single.token_to_chars(0), CharSpan) and isinstance(single.word_to_tokens(0), TokenSpan)


def test_alignment_maps_without_encodings_say_why(tiny):
    padded = tiny.pad({"input_ids": [[1, 2], [3]]})
    for call in (lambda: padded.word_ids(), lambda: padded.char_to_token(0), lambda: padded.token_to_chars(0)):
        with pytest.raises(ValueError, match=r"needs the encodings of a tokenizer call"):
            call()
    assert not padded.is_fast and padded.n_sequences is None
