"""The checks of one request field, shared by every endpoint's validation: integers, numbers and booleans in
range, stop strings, the model name and the set of known fields, and "text only" output formats.

Each failure is an APIError naming the field, its value and what is allowed.

Offers: MAX_STOP, MAX_SHOWN, shown_value, type_name, int_field, float_field, bool_field, stop_field, known_fields,
model_field (for serving's request modules).
"""

from __future__ import annotations

import math
from typing import Any

from gpuformers.serving.api_error import APIError

MAX_STOP = 4  # stop strings, as OpenAI allows
# The most characters of a client's value an error message repeats: a body may hold megabytes in one string
MAX_SHOWN = 100


def shown_value(value: Any) -> str:
    """repr(value), cut to MAX_SHOWN characters with its full length said (an error repeats what the client sent,
    and its fix stays readable after it)."""
    text = repr(value)
    if len(text) <= MAX_SHOWN:
        return text
    return f"{text[:MAX_SHOWN]}... ({len(value) if isinstance(value, str) else len(text)} characters)"


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def int_field(body: dict, name: str, low: int | None = None, high: int | None = None, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer, got {type_name(value)} {shown_value(value)}", name)
    if low is not None and value < low or high is not None and value > high:
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise APIError(400, f"{name}={value} must be {bounds}", name)
    return value


def float_field(body: dict, name: str, low: float, high: float, default: float | None,
           low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(400, f"{name} must be a finite number, got {type_name(value)} {shown_value(value)}", name)
    if value > high or value < low or (low_open and value == low):
        raise APIError(400, f"{name}={value} must be in {'(' if low_open else '['}{low}, {high}]", name)
    return float(value)


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be true or false, got {type_name(value)} {shown_value(value)}", name)
    return value


def stop_field(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, f"stop must be a string or a list of strings, got {shown_value(value)}", "stop")
    if len(stops) > MAX_STOP:
        raise APIError(400, f"stop has {len(stops)} sequences; at most {MAX_STOP} are allowed", "stop")
    if any(s == "" for s in stops):
        raise APIError(400, "stop sequences must not be empty strings", "stop")
    return stops


def known_fields(body: Any, allowed: set[str], ignored: set[str] = frozenset()) -> None:
    """A 400 unless `body` is a JSON object whose fields are all `allowed` or `ignored`."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type_name(body)}")
    unknown = sorted(set(body) - allowed - ignored)
    if unknown:
        shown = ", ".join(name if len(name) <= MAX_SHOWN else shown_value(name) for name in unknown[:10])
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise APIError(400, f"unknown field(s): {shown}{more}; known: {', '.join(sorted(allowed))}",
                       unknown[0][:MAX_SHOWN])


def model_field(body: Any, allowed: set[str], ignored: set[str]) -> str:
    """The model name of a JSON object body whose fields are all `allowed` or `ignored`."""
    known_fields(body, allowed, ignored)
    model = body.get("model")
    if model is None:
        raise APIError(400, "model is required: give the name /v1/models lists", "model")
    if not isinstance(model, str) or not model:
        raise APIError(400, f"model must be a non-empty string, got {type_name(model)} {shown_value(model)}", "model")
    return model
