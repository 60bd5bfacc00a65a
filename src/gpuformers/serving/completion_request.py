"""CompletionRequest, the validated request every endpoint's body becomes, and the /v1/completions body.

The fields completions and chat share (sampling, logit adjustments, n, stop, stream) are read here once; chat and
the Responses API add theirs in chat_request.py and responses_request.py.

Offers: CompletionRequest, parse_completion, MAX_N, MAX_COMPLETION_LOGPROBS, SEED_MIN, SEED_MAX (and, to the other
request modules, parse_common (the fields every endpoint shares), sampling_fields, COMMON_FIELDS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpuformers.serving.api_error import APIError
from gpuformers.serving.request_fields import (bool_field, float_field, int_field, model_field, shown_value, stop_field,
                                              type_name)
from gpuformers.serving.structured_request import STRUCTURED_FIELDS, structured_output

MAX_N = 16  # choices per request: each is a full engine request
MAX_COMPLETION_LOGPROBS = 5  # legacy completions' logprobs, as OpenAI allows
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a torch generator's seed is an int64 (vLLM's bounds too)
MIN_REPETITION_PENALTY = 0.01  # far below any useful value; a tinier one divides logits into inf, then nan


@dataclass
class CompletionRequest:
    """A validated request. Exactly one of `prompts` (completions) and `messages` (chat, responses) is set."""

    model: str
    chat: bool
    responses: bool = False  # a Responses API request (chat=True too): answered as a Response object
    # completions: each prompt as sent, a text or token ids; several are a batch, n choices each
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict] | None = None
    tools: list[dict] | None = None  # chat: the function tools, as the client sent them (rendered by the template)
    # chat: "auto" (calls are parsed out of the answer), "none" (the text as it is), or a forced call held to the
    # model's call format: "required" (one or more) or "function" (one call of tool_name)
    tool_choice: str = "none"
    tool_name: str | None = None
    # chat: extra variables for the chat template (vLLM's extension), e.g. {"enable_thinking": False} for Qwen3
    chat_template_kwargs: dict = field(default_factory=dict)
    # the grammar's spec (structured_request.py): response_format / text.format, structured_outputs / guided_*
    structured_output: dict | None = None
    max_tokens: int | None = None
    # None: not sent; the server fills them in from the model's generation config, else OpenAI's defaults
    # (sampling_defaults.py)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    ignore_eos: bool = False
    # Logit adjustments (OpenAI's, then vLLM's extensions); None: not sent (the model's generation config decides)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    # The request fields a Response object repeats (instructions, max_output_tokens, metadata, ...); responses only
    response_fields: dict = field(default_factory=dict)

    @property
    def prompt_text(self) -> str | None:
        """The text of a completions request of one text prompt (None for token ids, a batch, or a chat)."""
        return self.prompts[0] if len(self.prompts) == 1 and isinstance(self.prompts[0], str) else None

    @property
    def prompt_ids(self) -> list[int] | None:
        """The token ids of a completions request of one token-id prompt (None otherwise)."""
        return self.prompts[0] if len(self.prompts) == 1 and isinstance(self.prompts[0], list) else None

    @property
    def num_choices(self) -> int:
        """Engine requests the request makes: n per prompt."""
        return self.n * max(1, len(self.prompts))

    @property
    def prompt_field(self) -> str:
        """The request field that holds the prompt, for error messages."""
        return "input" if self.responses else "messages" if self.chat else "prompt"

    @property
    def max_tokens_field(self) -> str:
        """The request field that bounds the answer's length, for error messages."""
        return "max_output_tokens" if self.responses else "max_tokens"


# Fields an OpenAI client may send that we accept and ignore (they do not change the tokens we produce; a non-empty
# suffix would, and is refused in parse_completion; a best_of other than n would, and is refused in parse_common).
_IGNORED = {"user", "parallel_tool_calls", "store", "metadata", "service_tier", "best_of", "suffix"}
_ADJUSTMENTS = {"frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty", "min_p", "min_tokens"}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
                 "stream_options", "logprobs", "ignore_eos"} | _ADJUSTMENTS
_COMPLETION_FIELDS = COMMON_FIELDS | STRUCTURED_FIELDS | {"prompt", "echo"}


def parse_common(body: Any, allowed: set[str], chat: bool) -> CompletionRequest:
    model = model_field(body, allowed, _IGNORED)
    max_tokens = int_field(body, "max_tokens", 1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = int_field(body, "max_completion_tokens", 1)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise APIError(400, f"stream_options must be an object with only include_usage, got "
                                f"{shown_value(stream_options)}", "stream_options")
        if not body.get("stream"):
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
        include_usage = bool_field(stream_options, "include_usage")
    n = int_field(body, "n", 1, MAX_N, 1)
    best_of = int_field(body, "best_of", 1)
    if best_of is not None and best_of != n:
        # best_of > n means n of best_of sampled candidates, chosen by their log-probability: silently answering the
        # first n would not be what was asked (vLLM's V1 engine refuses it too)
        raise APIError(400, f"best_of={best_of} is not supported: this server answers exactly n={n} choices and "
                            f"does not rank extra candidates; leave best_of out (or equal to n), or ask for "
                            f"n={best_of} choices with logprobs and rank them yourself", "best_of")
    return CompletionRequest(model=model, chat=chat, max_tokens=max_tokens, n=n,
                             stop=stop_field(body), stream=bool_field(body, "stream"), include_usage=include_usage,
                             **sampling_fields(body), **_adjustments(body, max_tokens))


def sampling_fields(body: dict) -> dict:
    """The sampling fields of every endpoint (top_k, seed and ignore_eos are extensions to OpenAI's)."""
    return dict(temperature=float_field(body, "temperature", 0.0, 2.0, None),
                top_p=float_field(body, "top_p", 0.0, 1.0, None, low_open=True),
                top_k=int_field(body, "top_k", -1, None, None) if body.get("top_k") != -1 else 0,
                seed=int_field(body, "seed", SEED_MIN, SEED_MAX, None), ignore_eos=bool_field(body, "ignore_eos"))


def _adjustments(body: dict, max_tokens: int | None) -> dict:
    """The logit adjustments of completions and chat: OpenAI's frequency_penalty, presence_penalty (in [-2, 2])
    and logit_bias ({"token id": bias in [-100, 100]}), and vLLM's repetition_penalty (in [0.01, 2]), min_p and
    min_tokens (at most max_tokens). Each is None when not sent."""
    min_tokens = int_field(body, "min_tokens", 0)
    repetition_penalty = float_field(body, "repetition_penalty", 0.0, 2.0, None, low_open=True)
    if repetition_penalty is not None and repetition_penalty < MIN_REPETITION_PENALTY:
        raise APIError(400, f"repetition_penalty={repetition_penalty} is below {MIN_REPETITION_PENALTY}: it would "
                            f"scale the logits of seen tokens past float range; use a value in "
                            f"[{MIN_REPETITION_PENALTY}, 2] (1.0 turns it off)", "repetition_penalty")
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise APIError(400, f"min_tokens={min_tokens} must be at most max_tokens ({max_tokens})", "min_tokens")
    return dict(frequency_penalty=float_field(body, "frequency_penalty", -2.0, 2.0, None),
                presence_penalty=float_field(body, "presence_penalty", -2.0, 2.0, None), logit_bias=_logit_bias(body),
                repetition_penalty=repetition_penalty,
                min_p=float_field(body, "min_p", 0.0, 1.0, None), min_tokens=min_tokens)


def _logit_bias(body: dict) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, f'logit_bias must be an object of {{"token id": bias}}, got {type_name(value)}',
                       "logit_bias")
    bias = {}
    for key, amount in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias key {key!r} must be a token id (a string of digits)"[:300], "logit_bias")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not -100 <= amount <= 100:
            raise APIError(400, f"logit_bias[{key!r}]={amount!r} must be a number in [-100, 100]"[:300],
                           "logit_bias")
        bias[int(key)] = float(amount)
    return bias


def _token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def parse_completion(body: Any) -> CompletionRequest:
    """A validated /v1/completions request; `prompt` is OpenAI's: a string, a list of token ids, or a batch (a list
    of strings, or of token id lists), each prompt answered by n choices numbered prompt x n + choice."""
    request = parse_common(body, _COMPLETION_FIELDS, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                  or all(_token_ids(p) for p in prompt)):
        prompts = list(prompt)
    else:
        raise APIError(400, f"prompt must be a non-empty string, a non-empty list of token ids, or a batch of them "
                            f"(a list of strings, or a list of token id lists), got {prompt!r}"[:300], "prompt")
    empty = next((i for i, p in enumerate(prompts) if p == ""), None)
    if empty is not None:
        where = "prompt" if len(prompts) == 1 else f"prompt[{empty}]"
        raise APIError(400, f"{where} is empty; give at least one character or token id", "prompt")
    request.prompts = prompts
    logprobs = int_field(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if logprobs is not None:
        request.logprobs, request.top_logprobs = True, logprobs
    request.echo = bool_field(body, "echo")
    if body.get("suffix"):  # ignored, the answer would silently not be the insertion the client asked for
        raise APIError(400, f"suffix {body['suffix']!r} is not supported: this server completes the prompt only (no "
                            "fill-in-the-middle); leave suffix out, or put the text in the prompt"[:300], "suffix")
    if request.echo and request.stream and request.logprobs:
        raise APIError(400, "echo=true with logprobs is not supported with stream=true (the prompt's logprobs come "
                            "only in a whole response); drop stream, echo or logprobs", "echo")
    request.structured_output = structured_output(body, request.min_tokens)  # vLLM's structured_outputs / guided_*
    return request
