"""OpenAI's Responses API (/v1/responses) answered from a Job: one choice, as a Response object or as the typed
events the openai client parses. The request itself is validated by protocol.parse_response into a chat request.

Offers: ResponseJob.
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator

from gpuformers.serving.job import Job, now


class ResponseJob(Job):
    """A Responses API request: its one choice answered as a Response object, whole or as typed events in OpenAI's
    order, each with the next sequence_number (from 0):

        response.created, response.in_progress                      the Response, no output yet
        response.output_item.added, response.content_part.added    an empty assistant message and text part
        response.output_text.delta ...                              the text, piece by piece
        response.output_text.done, response.content_part.done, response.output_item.done
        response.completed | response.incomplete | response.failed  the whole Response (incomplete: the answer
                                                                    reached max_output_tokens)
    """

    def __init__(self, *args):
        super().__init__(*args)
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.sequence_number = 0

    @property
    def status(self) -> str:
        choice = self.choices[0]
        if choice.error is not None:
            return "failed"
        if not choice.finished:
            return "in_progress"
        return "incomplete" if choice.finish_reason == "length" else "completed"

    def _usage(self) -> dict:
        output_tokens = self.choices[0].num_tokens_kept()
        return {"input_tokens": len(self.prompt_ids), "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(self.prompt_ids) + output_tokens}

    def _part(self) -> dict:
        return {"type": "output_text", "text": self.choices[0].text, "annotations": []}

    def _message(self) -> dict:
        """The output message: in progress and empty until the choice finished."""
        done = self.status in ("completed", "incomplete")
        return {"type": "message", "id": self.message_id, "status": self.status if done else "in_progress",
                "role": "assistant", "content": [self._part()] if done else []}

    def _body(self) -> dict:
        """The Response object as it stands (output and usage once the choice finished)."""
        status, choice = self.status, self.choices[0]
        done = status in ("completed", "incomplete")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": now() if done else None,
                "error": {"code": "server_error", "message": choice.error} if status == "failed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.state.model_name, "output": [self._message()] if done else [],
                "temperature": self.parsed.temperature, "top_p": self.parsed.top_p, "tools": [],
                "text": {"format": {"type": "text"}}, "truncation": "disabled", "previous_response_id": None,
                "background": False, "usage": self._usage() if done else None, **self.parsed.response_fields}

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def sse(self, request) -> AsyncIterator[str]:
        """The typed events of the class docstring. Cancelled (the client left) -> the engine request is too."""
        choice = self.choices[0]
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        try:
            yield self._event("response.created", response=self._body())
            yield self._event("response.in_progress", response=self._body())
            yield self._event("response.output_item.added", output_index=0, item=self._message())
            yield self._event("response.content_part.added", part=self._part(), **where)
            while not choice.finished:
                _, text = await self._next(request)
                if text:
                    yield self._event("response.output_text.delta", delta=text, logprobs=[], **where)
            if choice.error is None:
                yield self._event("response.output_text.done", text=choice.text, logprobs=[], **where)
                yield self._event("response.content_part.done", part=self._part(), **where)
                yield self._event("response.output_item.done", output_index=0, item=self._message())
            yield self._event(f"response.{self.status}", response=self._body())
        except ConnectionError:
            return
        finally:
            self.close()
