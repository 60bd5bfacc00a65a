"""TokenTexts: the text of each token on its own, decoded once per token id for the life of the server.

Logprobs name every generated token and its top alternatives by their text (`tokenizer.decode([token_id])`, special
tokens kept, as OpenAI's and vLLM's do): at top_logprobs=5 that was six decodes per streamed token, the same few
thousand ids over and over. The texts are kept in a dict that grows to at most the vocabulary (a few MB for 150k
tokens); a token's text alone never changes, whatever comes around it.

Offers: TokenTexts.
"""

from __future__ import annotations


class TokenTexts(dict):
    """token id -> tokenizer.decode([token_id]); `texts[token_id]` decodes a token the first time only."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id])
        return text
