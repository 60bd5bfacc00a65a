"""Reasoning out of a model's text: the parsers that split a thinking model's answer into its reasoning (the
`<think> ... </think>` block Qwen3 and DeepSeek-R1 write before answering) and its content, whole or while it
streams, keyed by the name `gpuformers serve --reasoning-parser NAME` takes (vLLM's names), and the choice of a
parser from a model's chat template.

    "<think>\\nThe user greets me.\\n</think>\\n\\nHello!"  ->  reasoning "The user greets me.", content "Hello!"

A parser is fed the answer's text piece by piece and gives back (reasoning, content) to send. Text that may still
turn into a tag is held back, so a client never sees half a "<think>" or "</think>"; whitespace touching the tags is
dropped. Feeding the text in one piece or in any split gives the same reasoning and content.

- qwen3: the answer has a think block only when it opens with "<think>" (Qwen3 with enable_thinking=False, whose
  template writes an empty block into the prompt, answers without one: all content).
- deepseek_r1: the chat template opened the block in the prompt (DeepSeek-R1, QwQ, Qwen3-Thinking-2507), so the
  answer starts inside it; a leading "<think>" is skipped. Without "</think>" all of it is reasoning.

An answer cut inside its think block (max_tokens) is all reasoning with either parser.

- gpt_oss: gpt-oss's harmony channels (analysis -> reasoning, final -> content), in harmony.py; it reads the
  answer decoded with its special tokens kept (`keeps_special_tokens`), which job.py honours.

Offers: ReasoningParser, Qwen3ReasoningParser, DeepSeekR1ReasoningParser, REASONING_PARSERS,
register_reasoning_parser, get_reasoning_parser, detect_reasoning_parser (and, from harmony.py, the gpt_oss parser).
"""

from __future__ import annotations

from gpuformers.serving.tool_calls import load_parser_modules


class ReasoningParser:
    """The base of the think-block parsers. One parser follows one answer: `feed(text)` for each new piece,
    `finish()` at its end; each returns (reasoning, content). `split(text)` does both for a whole answer.

    `reasoning_end` is the number of characters of the answer that the think block covers, tags included (None:
    the answer has no think block), for counting reasoning tokens."""

    name = ""
    start_tag = "<think>"
    end_tag = "</think>"
    starts_inside = False  # the template opened the block: the answer begins inside it
    # The parser reads markers that are special tokens (harmony's <|channel|>): job.py decodes the answer with
    # them kept instead of skipped
    keeps_special_tokens = False

    def __init__(self):
        self.buffer = ""  # text fed but not given out yet: a possible tag, whitespace that may touch a tag
        self.fed = 0  # characters fed so far
        # "opening": the answer's start, before it shows whether it opens a block; then "reasoning" or "content"
        self.state = "opening"
        self.started = False  # the current part has begun: its leading whitespace is no longer dropped
        self.reasoning_end: int | None = None

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer as (reasoning, content), as vLLM's message has them: reasoning None without a think block
        (or an empty one), content None when the think block took all of it."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content = self.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        if self.reasoning_end is None:
            return None, content
        return reasoning or None, content or None

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        self.fed += len(text)
        if self.state == "opening":
            stripped = self.buffer.lstrip()
            if self.start_tag.startswith(stripped):  # only whitespace or a part of "<think>" so far: wait
                return "", ""
            if stripped.startswith(self.start_tag):
                self._enter("reasoning", stripped[len(self.start_tag):])
            elif self.starts_inside:
                self._enter("reasoning", stripped)
            else:  # no think block: the answer as it is, leading whitespace too
                self.state, self.started = "content", True
        reasoning = ""
        if self.state == "reasoning":
            self._drop_leading_whitespace()
            end = self.buffer.find(self.end_tag)
            if end < 0:
                # Hold back the longest tail that could still become "</think>", and the whitespace before it
                keep = next((k for k in range(min(len(self.end_tag) - 1, len(self.buffer)), 0, -1)
                             if self.end_tag.startswith(self.buffer[-k:])), 0)
                reasoning = self.buffer[:len(self.buffer) - keep].rstrip()
                self.buffer = self.buffer[len(reasoning):]
                return reasoning, ""
            reasoning = self.buffer[:end].rstrip()
            self._enter("content", self.buffer[end + len(self.end_tag):])
            self.reasoning_end = self.fed - len(self.buffer)
        self._drop_leading_whitespace()
        content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the answer: the held-back text (an unclosed think block is all reasoning)."""
        rest, self.buffer = self.buffer, ""
        if self.state == "opening" and self.starts_inside:  # it ended while it might still have written "<think>"
            self.reasoning_end = self.fed
            return rest.strip(), ""
        if self.state == "reasoning":
            self.reasoning_end = self.fed
            return rest, ""
        return "", rest

    @classmethod
    def block_ahead(cls, prompt_tail: str) -> str | None:
        """How an answer to a prompt ending in `prompt_tail` begins: "inside" its think block (the chat template
        opened it), "maybe" with one (the model decides), or None: no block ahead (the template closed it, as
        Qwen3's does with enable_thinking=False)."""
        opened, closed = prompt_tail.rfind(cls.start_tag), prompt_tail.rfind(cls.end_tag)
        if closed >= 0 and closed > opened:
            return None
        return "inside" if cls.starts_inside or opened >= 0 else "maybe"

    @classmethod
    def grammar_around(cls, answer: dict, block: str) -> dict | None:
        """The structural-tag format (engine/structured.py) of a whole answer whose part after the think block is
        held to `answer`, the block itself left free text; `block` is block_ahead's answer. None: this format has
        no place for a grammar."""
        gap = {"type": "regex", "pattern": r"\s{0,8}"}  # "\n\n" after "</think>"; never an endless run
        if block == "inside":
            inside = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": cls.end_tag}
            return {"type": "sequence", "elements": [inside, gap, answer]}
        think = {"type": "tag", "begin": cls.start_tag, "content": {"type": "any_text"}, "end": cls.end_tag}
        return {"type": "sequence", "elements": [{"type": "optional", "content": think}, gap, answer]}

    def _enter(self, state: str, buffer: str) -> None:
        self.state, self.buffer, self.started = state, buffer, False
        if state == "reasoning":
            self.reasoning_end = self.fed  # an open block covers everything so far

    def _drop_leading_whitespace(self) -> None:
        if not self.started:
            self.buffer = self.buffer.lstrip()
            self.started = bool(self.buffer)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    REASONING_PARSERS[cls.name] = cls
    return cls


@register_reasoning_parser
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (hybrid thinking): the answer writes its own "<think>" when it thinks."""

    name = "qwen3"


@register_reasoning_parser
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and the templates that open the think block in the prompt: the answer starts inside it."""

    name = "deepseek_r1"
    starts_inside = True


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    load_parser_modules()
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not one of: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


def detect_reasoning_parser(tokenizer) -> str | None:
    """The parser a tokenizer's chat template implies: gpt_oss when it mentions "<|channel|>" (gpt-oss's harmony
    format); else none unless it mentions "<think>"; then deepseek_r1 when the generation prompt it renders leaves a
    think block open (the model starts inside it, as with DeepSeek-R1 and Qwen3-Thinking-2507), else qwen3 (the
    model opens the block itself, as hybrid Qwen3 does).
    A template that fails on the probe conversation gets qwen3, which leaves an answer without "<think>" as it is."""
    template = getattr(tokenizer, "chat_template", None)
    text = "\n".join(template.values()) if isinstance(template, dict) else template or ""
    if "<|channel|>" in text:
        return "gpt_oss"  # harmony.py's HarmonyReasoningParser
    if ReasoningParser.start_tag not in text:
        return None
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                               tokenize=False)
    except Exception:  # noqa: BLE001 - any template error: the cautious parser
        return Qwen3ReasoningParser.name
    opened = prompt.rfind(ReasoningParser.start_tag) > prompt.rfind(ReasoningParser.end_tag)
    return DeepSeekR1ReasoningParser.name if opened else Qwen3ReasoningParser.name

