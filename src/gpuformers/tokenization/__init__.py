"""The tokenizer package: `PreTrainedTokenizerFast` split by job, one mixin per module.

`gpuformers.tokenizer` is the import path users and the rest of gpuformers use; it re-exports the public names
from here. Layout:

    tokenizer_fast.py   PreTrainedTokenizerFast: the constructor that reads tokenizer_config.json keys
    vocabulary.py       special tokens, added tokens, token <-> id conversion
    encoding.py         __call__ / encode / pad / decode: padding, truncation, tensors
    chat.py             apply_chat_template (rendering itself is gpuformers.chat_template)
    pretrained.py       from_pretrained / save_pretrained: tokenizer.json, tokenizer_config.json, templates
    batch_encoding.py   BatchEncoding, what a tokenizer call returns
    byte_level.py       byte_level_alphabet, GPT-2's byte-to-character table

Offers: nothing itself; import from gpuformers.tokenizer.
"""
