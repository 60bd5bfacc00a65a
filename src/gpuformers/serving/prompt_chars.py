"""PromptChars: the character bound a prompt is checked against before it is tokenized, so that a prompt that
cannot fit the context is refused at once instead of after seconds of tokenizer work (a 7 MB chat prompt cost
7.7 s of CPU before its context-length 400).

    limit = max_model_len x longest token (characters, over the whole vocabulary) x NORMALIZER_FACTOR

Why a prompt over the limit cannot fit: a token stands for at most as many characters of the text as its vocabulary
entry has (a byte-level entry has one character per byte, and a character is at least one byte; a special token
is matched as its own text), and a normalizer can compose at most NORMALIZER_FACTOR code points into one character
(NFC, NFKC: Unicode's longest canonical decomposition is 4) before the tokenizer sees the text. What the bound
does not foresee: text the tokenizer deletes (a BERT normalizer's control characters) or that the chat template
leaves out (earlier turns' think blocks); a prompt of that kind must then stay under the limit too.

Offers: NORMALIZER_FACTOR, PromptChars.
"""

from __future__ import annotations

from gpuformers.serving.api_error import APIError

NORMALIZER_FACTOR = 4


class PromptChars:
    """The character limit of one prompt for `tokenizer` and a context of `max_model_len` tokens. The longest token
    is found when the server is built, before it serves: reading a 150k vocabulary takes ~0.4 s in one call into the
    tokenizer that holds the GIL, which on the first long prompt froze every other stream for that long (even from a
    worker thread)."""

    def __init__(self, tokenizer, max_model_len: int):
        self.max_model_len = max_model_len
        # The characters of the vocabulary's longest entry (added and special tokens included).
        self.longest_token = max(map(len, tokenizer.get_vocab()), default=1)

    @property
    def limit(self) -> int:
        return self.max_model_len * self.longest_token * NORMALIZER_FACTOR

    def fits(self, chars: int) -> bool:
        return chars <= self.limit

    def check(self, chars: int, field: str, where: str | None = None) -> None:
        """A 400 (context_length_exceeded) naming `field` when `chars` characters cannot fit the context."""
        if self.fits(chars):
            return
        raise APIError(400, f"the {where or field} has {chars} characters, more than any prompt that fits this "
                            f"model's context of {self.max_model_len} tokens can have ({self.limit}: "
                            f"{self.max_model_len} tokens x {self.longest_token} characters in the longest token x "
                            f"{NORMALIZER_FACTOR}); shorten the {field}", field, code="context_length_exceeded")
