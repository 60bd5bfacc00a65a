"""Streamers: text out of generate() while it runs.

generate() calls `streamer.put(prompt_ids)` once, then `put(new_token)` after every step, then `end()`. A streamer
turns those tokens into text and hands it on whole words at a time, never half a UTF-8 character:

- tokens are decoded together (decoding one token alone loses the spaces and bytes it shares with its neighbours),
- only the text up to the last whitespace is released, so a word that the next token may still extend waits,
  and so does a character whose bytes are split across tokens (it decodes as U+FFFD until its last byte comes),
- a newline, or a CJK character (these scripts do not put spaces between words), releases everything,
- end() releases the rest.

Offers: BaseStreamer, TextStreamer (prints to stdout), TextIteratorStreamer (iterate the text in another thread),
StreamerTimeout.
"""

from __future__ import annotations

import queue
from typing import Any

import torch

_INCOMPLETE = "\ufffd"  # what a decoder emits for bytes that do not (yet) form a character


class StreamerTimeout(queue.Empty, TimeoutError):
    """No text arrived within the streamer's timeout. Subclasses both queue.Empty (what transformers raises) and
    TimeoutError, so either `except` clause catches it."""


class BaseStreamer:
    """What generate() needs from a streamer."""

    def put(self, value: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement put(token_ids)")

    def end(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement end()")


class TextStreamer(BaseStreamer):
    """Print generated text to stdout as it comes, whole words at a time.

    tokenizer: anything with `decode(ids, **decode_kwargs)`. skip_prompt: leave out the prompt (the first put).
    decode_kwargs: passed to `tokenizer.decode`, e.g. `skip_special_tokens=True`.
    """

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, **decode_kwargs: Any):
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.token_cache: list[int] = []  # tokens whose text is not entirely released, plus one token of context
        self.print_len = 0  # characters of decode(token_cache) already released
        self.next_tokens_are_prompt = True

    def put(self, value: torch.Tensor) -> None:
        """Take the prompt (first call) or new tokens: a (1, n) or (n,) tensor, or a list of ids."""
        if isinstance(value, torch.Tensor):
            if value.dim() > 1:
                if value.shape[0] > 1:
                    raise ValueError(
                        f"{type(self).__name__} streams one sequence, got a batch of {value.shape[0]}; "
                        f"generate one prompt at a time with a streamer"
                    )
                value = value[0]
            ids = value.tolist()
        else:
            ids = list(value)
        if isinstance(ids, int):
            ids = [ids]
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.next_tokens_are_prompt = False
        self.token_cache.extend(ids)
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        pending = text[self.print_len:]
        if text.endswith("\n") or (text and _is_cjk(text[-1])):
            release = pending
        else:
            # up to and including the last whitespace; the word after it may still grow
            cut = max(pending.rfind(" "), pending.rfind("\n"), pending.rfind("\t"))
            release = pending[: cut + 1]
        # a character still waiting for its last bytes decodes as U+FFFD at the very end; hold it back
        release = release.rstrip(_INCOMPLETE)
        self.print_len += len(release)
        if self.print_len == len(text) and release:
            # Everything is out: restart the cache from the last token, kept as context so that the next token
            # decodes with the right leading space. Keeps each decode short instead of growing with the text.
            self.token_cache = self.token_cache[-1:]
            self.print_len = len(self.tokenizer.decode(self.token_cache, **self.decode_kwargs))
        if release:
            self.on_finalized_text(release)

    def end(self) -> None:
        """Release whatever is left and close the stream."""
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs) if self.token_cache else ""
        rest = text[self.print_len:]
        self.token_cache = []
        self.print_len = 0
        self.next_tokens_are_prompt = True
        self.on_finalized_text(rest, stream_end=True)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """Where released text goes; subclasses override it. Here: stdout, with a newline at the end."""
        print(text, flush=True, end="\n" if stream_end else "")


class TextIteratorStreamer(TextStreamer):
    """Queue the released text so that another thread can iterate it while generate() runs:

        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        Thread(target=model.generate, kwargs=dict(**inputs, streamer=streamer, max_new_tokens=50)).start()
        for text in streamer:
            print(text, end="")

    timeout: seconds to wait for the next piece before raising StreamerTimeout (None waits forever; set one so a
    generate() that failed in its thread does not leave the loop hanging).
    """

    _END = object()

    def __init__(self, tokenizer: Any, skip_prompt: bool = False, timeout: float | None = None,
                 **decode_kwargs: Any):
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.text_queue: queue.Queue = queue.Queue()
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.text_queue.put(text)
        if stream_end:
            self.text_queue.put(self._END)

    def __iter__(self) -> "TextIteratorStreamer":
        return self

    def __next__(self) -> str:
        try:
            value = self.text_queue.get(timeout=self.timeout)
        except queue.Empty:
            raise StreamerTimeout(
                f"no text from generate() within timeout={self.timeout} s; generation may have failed in its thread, "
                f"or raise the timeout for a slow model"
            ) from None
        if value is self._END:
            raise StopIteration
        return value


def _is_cjk(char: str) -> bool:
    """CJK ideographs (Chinese characters, also used in Japanese and Korean), written without spaces between words."""
    cp = ord(char)
    return (
        0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF
        or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2CEAF or 0x2F800 <= cp <= 0x2FA1F
    )
