"""ChatJob: a /v1/chat/completions request's Job (job.py), holding only what chat answers differently from
completions: each choice is an assistant message (a `delta` when streamed, opened by a role chunk), logprobs are the
chat shape ({"content": [{"token", "logprob", "bytes", "top_logprobs"}]}), and the text goes through the model's
parsers: with a reasoning parser (reasoning.py) the think block becomes reasoning_content, and with tools and
tool_choice "auto" the calls come out of the rest (tool_calls.py), finishing the choice with "tool_calls".

    choice text -> [reasoning parser: reasoning_content | rest] -> [tool-call parser: tool_calls | content]

Offers: ChatJob.
"""

from __future__ import annotations

from gpuformers.serving.job import ChoiceText, Job, finite_logprob
from gpuformers.serving.protocol import CompletionRequest


class ChatJob(Job):
    """A chat request's n choices as assistant messages, whole or streamed."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state, parsed: CompletionRequest, prompts: list[list[int]], max_tokens: list[int], loop):
        # The answer goes through the model's reasoning parser, if it has one: one parser per choice; a parser
        # that reads special-token markers (harmony) gets the text decoded with them kept
        reasoning_parser = state.reasoning_parser
        self.reasoners = [reasoning_parser() for _ in range(parsed.n)] if reasoning_parser is not None else None
        self.keep_special_tokens = reasoning_parser is not None and reasoning_parser.keeps_special_tokens
        super().__init__(state, parsed, prompts, max_tokens, loop)
        # With tools and tool_choice other than "none", each choice's text goes through the model's tool-call
        # parser (the server checked that it has one); a stream feeds one parser per choice
        self.tool_parser = state.tool_call_parser if parsed.tools and parsed.tool_choice != "none" else None
        self.stream_parsers = ([self.tool_parser() for _ in range(parsed.n)] if self.tool_parser is not None
                               else None)

    def _usage(self) -> dict:
        usage = super()._usage()
        if self.reasoners is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self._reasoning_tokens()}
        return usage

    def _reasoning_tokens(self) -> int:
        """The generated tokens of the choices' think blocks, tags included (once their parsers finished)."""
        count = 0
        for choice, reasoner in zip(self.choices, self.reasoners):
            if reasoner.reasoning_end is not None:
                count += min(choice.detokenizer.num_tokens_for(reasoner.reasoning_end), choice.num_tokens_kept())
        return count

    def _logprobs_object(self, ids: list[int], values: list[float | None],
                         tops: list[list[tuple[int, float]] | None], offset: int) -> dict:
        texts = self.state.token_texts
        strings = [texts[t] for t in ids]
        # per token, its top_logprobs alternatives as (text, logprob); empty lists when none were asked for
        top_texts = [[(texts[t], finite_logprob(lp)) for t, lp in top] for top in tops]
        top_texts += [[] for _ in range(len(strings) - len(top_texts))]
        return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                             "top_logprobs": [{"token": ts, "logprob": tl, "bytes": list(ts.encode("utf-8"))}
                                              for ts, tl in top]}
                            for s, lp, top in zip(strings, values, top_texts)]}

    def _choice_body(self, index: int, choice: ChoiceText) -> dict:
        message, finish_reason = {"role": "assistant", "content": choice.text}, choice.finish_reason
        if self.reasoners is not None:
            message["reasoning_content"], message["content"] = self.reasoners[index].split(choice.text)
        if self.tool_parser is not None:
            content, calls = self.tool_parser.parse(message["content"] or "")
            message["content"] = content or None
            if calls:
                message["tool_calls"] = [call.to_dict() for call in calls]
                finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": self._logprobs(choice),
                "finish_reason": finish_reason}

    def _chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
               role: bool = False, tool_call: dict | None = None, reasoning: str | None = None) -> str:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        if tool_call is not None:
            delta = {"tool_calls": [tool_call]}
        if reasoning is not None:
            delta = {"reasoning_content": reasoning}
        return self._chunk_of({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    def _opening(self) -> str:
        """A role chunk per choice."""
        return "".join(self._chunk(index, None, None, role=True) for index in range(self.parsed.n))

    def _add_deltas(self, events: list[str], index: int, choice: ChoiceText, text: str, reported: list[int],
                    end: int) -> None:
        """With a reasoning parser: first {"reasoning_content": ...} deltas while the answer is inside its think
        block; then the text deltas; with tools: a delta per complete tool call,
        {"tool_calls": [{index, id, type, function: {name, arguments}}]}."""
        if self.reasoners is not None:  # the think block's text goes out as reasoning; a possible tag waits
            reasoning, text = self.reasoners[index].feed(text)
            if choice.finished:
                more_reasoning, more_text = self.reasoners[index].finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                events.append(self._chunk(index, None, None, reasoning=reasoning,
                                          logprobs=self._logprobs(choice, reported[index], end)))
                reported[index] = max(reported[index], end)
        parsers = self.stream_parsers
        calls = []
        if parsers is not None:  # the calls come out of the text; text that may open a call waits
            text, calls = parsers[index].feed(text)
            if choice.finished:
                rest, more = parsers[index].finish()
                text, calls = text + rest, calls + more
        if text:
            self._add_text(events, index, choice, text, reported, end)
        first = len(parsers[index].calls) - len(calls) if calls else 0  # the first new call's index
        for position, call in enumerate(calls, first):
            events.append(self._chunk(index, None, None, logprobs=self._logprobs(choice, reported[index], end),
                                      tool_call={"index": position, **call.to_dict()}))
            reported[index] = max(reported[index], end)

    def _finish_reason(self, index: int, choice: ChoiceText) -> str | None:
        called = self.stream_parsers is not None and self.stream_parsers[index].calls
        return "tool_calls" if called else choice.finish_reason
