"""The validation of a POST /v1/embeddings body (OpenAI's shape) into an `EmbeddingRequest`.

    input   "text" | ["text", ...] | [token id, ...] | [[token id, ...], ...]     (at most MAX_INPUTS inputs)
    encoding_format   "float" (default) | "base64" (little-endian float32 bytes)
    dimensions        keep the first N values of each vector (Matryoshka; checked against the model by the server)
    truncate_prompt_tokens   vLLM's: cut each input to N tokens (-1: the server's maximum) instead of refusing a
                      longer one (checked against the maximum by the server)
    user              accepted and ignored

Each bad field is an APIError naming the field, its value and what is allowed.

Offers: MAX_INPUTS, ENCODING_FORMATS, EmbeddingRequest, parse_embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuformers.serving.api_error import APIError
from gpuformers.serving.request_fields import int_field, model_field, shown_value, type_name

MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows
ENCODING_FORMATS = ("float", "base64")
_FIELDS = {"model", "input", "encoding_format", "dimensions", "truncate_prompt_tokens"}


@dataclass
class EmbeddingRequest:
    """A validated request: `inputs` holds texts or token id lists (never both), in the request's order."""

    model: str
    inputs: list[str] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None  # -1 or >= 1

    @property
    def tokenized(self) -> bool:
        return isinstance(self.inputs[0], list)


def parse_embedding(body: Any) -> EmbeddingRequest:
    model = model_field(body, _FIELDS, ignored={"user"})
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise APIError(400, f"encoding_format {shown_value(encoding_format)} is not one of: "
                            f"{', '.join(ENCODING_FORMATS)}", "encoding_format")
    dimensions = int_field(body, "dimensions", low=1)
    truncate = int_field(body, "truncate_prompt_tokens", low=-1)
    if truncate == 0:  # vLLM answers an empty list; an input of no tokens has no vector
        raise APIError(400, "truncate_prompt_tokens=0 would leave no tokens to embed; give -1 (the server's maximum "
                            "input length) or a number of tokens >= 1", "truncate_prompt_tokens")
    return EmbeddingRequest(model, _inputs(body.get("input")), encoding_format, dimensions, truncate)


def _inputs(value: Any) -> list[str] | list[list[int]]:
    forms = "a string, a list of strings, a list of token ids or a list of token id lists"
    if value is None:
        raise APIError(400, f"input is required: {forms}", "input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise APIError(400, f"input must be {forms}, got {type_name(value)}", "input")
    if not value:
        raise APIError(400, "input is an empty list; give at least one string or token id list", "input")
    if all(_is_token_id(item) for item in value):  # one tokenized input
        value = [value]
    if len(value) > MAX_INPUTS:
        raise APIError(400, f"input has {len(value)} items; at most {MAX_INPUTS} are allowed per request", "input")
    if isinstance(value[0], str):
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise APIError(400, f"input[{index}] is {type_name(item)} {shown_value(item)} among strings: the "
                                    "inputs must all be strings or all be token id lists", "input")
            if not item:
                raise APIError(400, f"input[{index}] is an empty string; every input needs at least one token",
                               "input")
        return value
    for index, item in enumerate(value):
        if not isinstance(item, list) or not all(_is_token_id(token) for token in item):
            raise APIError(400, f"input[{index}] must be a list of token ids (integers >= 0) like the other inputs, "
                                f"got {type_name(item)} {str(item)[:100]}", "input")
        if not item:
            raise APIError(400, f"input[{index}] is an empty token list; every input needs at least one token",
                           "input")
    return value


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
