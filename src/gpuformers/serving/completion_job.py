"""CompletionJob: a /v1/completions request's Job (job.py), holding only what completions answer differently from
chat: each choice is a `text` (with echo, the prompt before it: as sent, or decoded from its token ids), and
logprobs are completions' shape (tokens, token_logprobs, top_logprobs as a dict per token, text_offset), the
echoed prompt's first when echo and logprobs are both asked for.

Offers: CompletionJob.
"""

from __future__ import annotations

from gpuformers.serving.job import ChoiceText, Job, finite_logprob
from gpuformers.serving.protocol import APIError


class CompletionJob(Job):
    """A completions request's n choices as texts, whole or streamed."""

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def _logprobs_object(self, ids: list[int], values: list[float | None],
                         tops: list[list[tuple[int, float]] | None], offset: int) -> dict:
        """Completions' logprobs object: tokens, token_logprobs, top_logprobs (a dict per token of up to
        logprobs + 1 entries: the most likely tokens and, as OpenAI does, always the chosen one; None for a
        token without logprobs, the first of an echoed prompt) and text_offset (from `offset`)."""
        texts = self.state.token_texts
        strings = [texts[t] for t in ids]
        offsets, position = [], offset
        for s in strings:
            offsets.append(position)
            position += len(s)
        top_dicts = None
        if self.parsed.top_logprobs:
            top_dicts = []
            for string, value, top in zip(strings, values, tops + [[]] * (len(strings) - len(tops))):
                if value is None:
                    top_dicts.append(None)
                    continue
                alternatives: dict[str, float] = {}
                for token_id, logprob in top:  # best first: a later token with the same text keeps the first
                    alternatives.setdefault(texts[token_id], finite_logprob(logprob))
                alternatives.setdefault(string, finite_logprob(value))
                top_dicts.append(alternatives)
        return {"tokens": strings, "token_logprobs": [finite_logprob(v) for v in values], "top_logprobs": top_dicts,
                "text_offset": offsets}

    def _echo_text(self, index: int) -> str:
        """The prompt of choice `index` as echo returns it: as the client sent it, or decoded from token ids."""
        prompt = self.prompt_of(index)
        sent = self.parsed.prompts[prompt]
        return sent if isinstance(sent, str) else self.state.tokenizer.decode(self.prompts[prompt])

    def _echoed_logprobs(self, index: int, completion: dict) -> dict:
        """The prompt's logprobs object (scored by the engine request of its first choice) followed by the
        completion's."""
        prompt_index = self.prompt_of(index)
        ids, first = self.prompts[prompt_index], self.choices[prompt_index * self.parsed.n]
        prompt = self._logprobs_object(ids, list(first.prompt_logprobs), list(first.prompt_top_logprobs), 0)
        if len(prompt["token_logprobs"]) != len(ids):
            raise APIError(500, f"the engine returned {len(prompt['token_logprobs'])} prompt logprobs for "
                                f"{len(ids)} prompt tokens", type="server_error")
        return {key: prompt[key] + completion[key] if prompt[key] is not None else None for key in prompt}

    def _choice_body(self, index: int, choice: ChoiceText) -> dict:
        prefix = self._echo_text(index) if self.parsed.echo else ""
        logprobs = self._logprobs(choice, offset=len(prefix))
        if self.parsed.echo and logprobs is not None:
            logprobs = self._echoed_logprobs(index, logprobs)
        return {"index": index, "text": prefix + choice.text, "logprobs": logprobs,
                "finish_reason": choice.finish_reason}

    def _chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None) -> str:
        return self._chunk_of({"index": index, "text": text or "", "logprobs": logprobs,
                               "finish_reason": finish_reason})

    def _opening(self) -> str:
        """With echo, the prompt is each choice's first text chunk."""
        if not self.parsed.echo:
            return ""
        return "".join(self._chunk(index, self._echo_text(index), None) for index in range(self.num_choices))
