"""OpenAI's Responses API (/v1/responses) answered from a chat Job (chat_job.py): one choice, as a Response object or
as the typed events the openai client parses. The request itself is validated by protocol.parse_response into a chat
request. With a reasoning parser (reasoning.py) the answer's think block becomes a reasoning item,
{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": ...}]}, before the message that
holds the rest.

Offers: ResponseJob.
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from gpuformers.serving.chat_job import ChatJob
from gpuformers.serving.job import JSON, now


class ResponseJob(ChatJob):
    """A Responses API request: its one choice answered as a Response object, whole or as typed events in OpenAI's
    order, each with the next sequence_number (from 0):

        response.created, response.in_progress                      the Response, no output yet
        [with a reasoning parser, while the answer thinks: a reasoning item]
        response.output_item.added, response.content_part.added    a reasoning item and its reasoning_text part
        response.reasoning_text.delta ...                           the reasoning, piece by piece
        response.reasoning_text.done, response.content_part.done, response.output_item.done
        [the answer]
        response.output_item.added, response.content_part.added    an empty assistant message and text part
        response.output_text.delta ...                              the text, piece by piece
        response.output_text.done, response.content_part.done, response.output_item.done
        response.completed | response.incomplete | response.failed  the whole Response (incomplete: the answer
                                                                    reached max_output_tokens)

    Without a reasoning parser the message opens at once; with one it opens when the text after the think block
    starts (or at the end: an answer that only thought has no message).
    """

    def __init__(self, *args):
        super().__init__(*args)
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.reasoning_id = "rs_" + uuid.uuid4().hex
        self.sequence_number = 0
        self.seen = 0  # characters of the choice's text that went through the reasoning parser
        self.reasoning = ""  # the think block's text so far
        self.text = ""  # the answer's text so far (after the think block)
        self.parsed_all = False  # the reasoning parser has seen the whole answer
        self.open_item: str | None = None  # streaming: the output item being written, "reasoning" or "message"
        self.output_index = -1  # streaming: the open item's place in the output

    @property
    def status(self) -> str:
        choice = self.choices[0]
        if choice.error is not None:
            return "failed"
        if not choice.finished:
            return "in_progress"
        return "incomplete" if choice.finish_reason == "length" else "completed"

    @property
    def has_message(self) -> bool:
        """Whether the output holds a message so far (one that only thought has none)."""
        return self.reasoners is None or bool(self.text) or (self.choices[0].finished and not self.reasoning)

    def _catch_up(self) -> tuple[str, str]:
        """Pass the text the engine sent since the last call through the reasoning parser (finishing it once the
        answer is complete): the new (reasoning, text)."""
        choice = self.choices[0]
        new, self.seen = choice.text[self.seen:choice.sent], choice.sent
        if self.reasoners is None:
            reasoning, text = "", new
        else:
            reasoner = self.reasoners[0]
            reasoning, text = reasoner.feed(new)
            if choice.finished and not self.parsed_all:
                more_reasoning, more_text = reasoner.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
                self.parsed_all = True
        self.reasoning += reasoning
        self.text += text
        return reasoning, text

    def _usage(self) -> dict:
        output_tokens = self.choices[0].num_tokens_kept()
        reasoning_tokens = self._reasoning_tokens() if self.reasoners is not None else 0
        return {"input_tokens": len(self.prompt_ids), "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": len(self.prompt_ids) + output_tokens}

    @property
    def _done(self) -> bool:
        return self.status in ("completed", "incomplete")

    def _part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def _reasoning_part(self) -> dict:
        return {"type": "reasoning_text", "text": self.reasoning}

    def _message(self) -> dict:
        """The output message: in progress and empty until the choice finished."""
        done = self._done
        return {"type": "message", "id": self.message_id, "status": self.status if done else "in_progress",
                "role": "assistant", "content": [self._part()] if done else []}

    def _reasoning_item(self, done: bool) -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [self._reasoning_part()] if done else [], "status": "completed" if done else "in_progress"}

    def _body(self) -> dict:
        """The Response object as it stands (output and usage once the choice finished)."""
        self._catch_up()
        status, choice = self.status, self.choices[0]
        done = self._done
        output = []
        if done:
            output = ([self._reasoning_item(True)] if self.reasoning else []) + ([self._message()]
                                                                                 if self.has_message else [])
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": now() if done else None,
                "error": {"code": "server_error", "message": choice.error} if status == "failed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.parsed.model, "output": output,
                "temperature": self.parsed.temperature, "top_p": self.parsed.top_p, "tools": [],
                "text": {"format": {"type": "text"}}, "truncation": "disabled", "previous_response_id": None,
                "background": False, "usage": self._usage() if done else None, **self.parsed.response_fields}

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {JSON.encode(body)}\n\n"

    def stream_to(self, writer) -> None:
        """Every output through sse below (its typed events are not Job's chunks): no direct writer taken."""

    async def sse(self, request) -> AsyncIterator[str]:
        """The typed events of the class docstring. Cancelled (the client left) -> the engine request is too."""
        choice = self.choices[0]
        try:
            yield self._event("response.created", response=self._body())
            yield self._event("response.in_progress", response=self._body())
            if self.reasoners is None:
                for event in self._open("message"):
                    yield event
            while not choice.finished:
                await self._next(request)
                for event in self._deltas(*self._catch_up()):
                    yield event
            if choice.error is None:
                if self.open_item is None and self.has_message:  # an empty answer still has its message
                    for event in self._open("message"):
                        yield event
                for event in self._close():
                    yield event
            yield self._event(f"response.{self.status}", response=self._body())
        except ConnectionError:
            return
        finally:
            self.close()

    def _deltas(self, reasoning: str, text: str) -> list[str]:
        """The events of new reasoning and text: each opens its item first (the text closes the reasoning)."""
        events = []
        if reasoning:
            if self.open_item != "reasoning":
                events += self._open("reasoning")
            events.append(self._event("response.reasoning_text.delta", delta=reasoning, **self._where()))
        if text:
            if self.open_item != "message":
                events += self._close() + self._open("message")
            events.append(self._event("response.output_text.delta", delta=text, logprobs=[], **self._where()))
        return events

    def _where(self) -> dict:
        item_id = self.message_id if self.open_item == "message" else self.reasoning_id
        return {"item_id": item_id, "output_index": self.output_index, "content_index": 0}

    def _open(self, kind: str) -> list[str]:
        """The next output item, added empty: a "reasoning" item or the "message"."""
        self.open_item, self.output_index = kind, self.output_index + 1
        if kind == "reasoning":
            item, part = self._reasoning_item(False), {"type": "reasoning_text", "text": ""}
        else:
            item, part = self._message(), {"type": "output_text", "text": "", "annotations": []}
        return [self._event("response.output_item.added", output_index=self.output_index, item=item),
                self._event("response.content_part.added", part=part, **self._where())]

    def _close(self) -> list[str]:
        """The done events of the open item (none when none is open)."""
        where, kind, self.open_item = self._where(), self.open_item, None
        if kind == "reasoning":
            return [self._event("response.reasoning_text.done", text=self.reasoning, **where),
                    self._event("response.content_part.done", part=self._reasoning_part(), **where),
                    self._event("response.output_item.done", output_index=self.output_index,
                                item=self._reasoning_item(True))]
        if kind == "message":
            return [self._event("response.output_text.done", text=self.text, logprobs=[], **where),
                    self._event("response.content_part.done", part=self._part(), **where),
                    self._event("response.output_item.done", output_index=self.output_index, item=self._message())]
        return []
