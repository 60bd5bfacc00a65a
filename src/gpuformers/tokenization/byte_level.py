"""GPT-2's byte-level alphabet: the characters byte-level BPE vocabularies spell bytes with.

Shared by the stop-string matcher (generation/stopping.py) and the GGUF tokenizer builder
(loading/gguf_tokenizer.py), so both read token strings the way `tokenizers` writes them.

Offers: byte_level_alphabet.
"""

from __future__ import annotations

import functools


@functools.cache
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the other 68 move to U+0100 upward,
    so every byte string is spelled with visible characters (space -> "Ġ", newline -> "Ċ")."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(0x100 + shifted)
            shifted += 1
    return table
