"""The structured-output fields of a request: OpenAI's response_format (chat) and text.format (Responses), and
vLLM's structured_outputs object and its older guided_* fields (chat and completions), each turned into the spec
engine/structured.py's StructuredOutputCompiler compiles:

    response_format {"type": "json_object"}                      -> {"type": "json_object"}
    response_format {"type": "json_schema", "json_schema": {...}} -> {"type": "json_schema", "name", "schema"}
    structured_outputs {"json": schema} / guided_json             -> {"type": "json_schema", ...}
    structured_outputs {"json_object": true}                      -> {"type": "json_object"}
    structured_outputs {"regex": "..."} / guided_regex            -> {"type": "regex", "regex"}
    structured_outputs {"choice": [...]} / guided_choice          -> {"type": "choice", "choices"}
    structured_outputs {"grammar": "root ::= ..."} / guided_grammar  -> {"type": "grammar", "grammar"} (EBNF)

A request holds one of them; min_tokens cannot go with one (the grammar decides where the answer ends). The vLLM
specs carry "param", the field they came from, for the errors of a grammar that does not compile.

Offers: response_format, structured_output, STRUCTURED_FIELDS.
"""

from __future__ import annotations

from typing import Any

from gpuformers.serving.api_error import APIError
from gpuformers.serving.request_fields import type_name

_FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_FIELDS = {"name": str, "description": str, "schema": dict, "strict": bool}


def response_format(spec: Any, param: str, flat: bool = False) -> dict | None:
    """Chat's response_format, or with `flat` the Responses API's text.format (its json_schema fields sit beside
    "type" instead of under "json_schema"): None for text, else the spec StructuredOutputCompiler.compile takes,
    {"type": "json_object"} or {"type": "json_schema", "name", "schema"}. A json_schema without a schema is any
    JSON object, and the schema is always enforced, strict or not (as vLLM does)."""
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in _FORMAT_TYPES:
        raise APIError(400, f"{param} must be an object whose type is one of: {', '.join(_FORMAT_TYPES)}; got "
                            f"{spec!r}"[:300], f"{param}.type" if isinstance(spec, dict) else param)
    if kind == "text":
        return None
    fields = {k: v for k, v in spec.items() if k != "type"}
    if kind == "json_object":
        if fields:
            raise APIError(400, f"{param} of type json_object takes no other fields, got {', '.join(sorted(fields))}",
                           param)
        return {"type": "json_object"}
    where = param if flat else f"{param}.json_schema"
    if not flat:
        if set(fields) != {"json_schema"} or not isinstance(fields["json_schema"], dict):
            raise APIError(400, f'{param} of type json_schema must be {{"type": "json_schema", "json_schema": {{"name":'
                                f' ..., "schema": {{...}}, "strict": true}}}}, got {spec!r}'[:300], where)
        fields = fields["json_schema"]
    unknown = sorted(set(fields) - set(_JSON_SCHEMA_FIELDS))
    if unknown:
        raise APIError(400, f"{where} has unknown field(s): {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(_JSON_SCHEMA_FIELDS))}", f"{where}.{unknown[0]}")
    for name, kind_of in _JSON_SCHEMA_FIELDS.items():
        value = fields.get(name)
        if value is not None and not isinstance(value, kind_of):
            what = {dict: "an object (the JSON schema)", bool: "true or false", str: "a string"}[kind_of]
            raise APIError(400, f"{where}.{name} must be {what}, got {type_name(value)} {value!r}"[:300],
                           f"{where}.{name}")
    if fields.get("schema") is None:
        return {"type": "json_object"}
    return {"type": "json_schema", "name": fields.get("name"), "schema": fields["schema"]}


# vLLM's structured_outputs keys -> the spec type they ask for; and its older top-level fields
_VLLM_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_FIELDS = {"structured_outputs", *_GUIDED}


def structured_output(body: dict, min_tokens: int | None, from_response_format: dict | None = None) -> dict | None:
    """The request's structured-output spec: response_format's (already parsed, chat), or vLLM's structured_outputs /
    guided_* fields; None without one. More than one of them, or one with min_tokens, is a 400."""
    asked = {k: body[k] for k in ("structured_outputs", *_GUIDED) if body.get(k) is not None}
    if from_response_format is not None:
        asked = {"response_format": True, **asked}
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)} each ask for a structured output; send one of them",
                       list(asked)[1])
    spec = from_response_format
    if "structured_outputs" in asked:
        spec = {**_vllm_spec(asked["structured_outputs"]), "param": "structured_outputs"}
    elif asked and spec is None:
        (field, value), = asked.items()
        spec = {**_spec(_GUIDED[field], value, field), "param": field}
    if spec is not None and min_tokens:
        raise APIError(400, f"min_tokens={min_tokens} cannot be combined with a structured output ({spec['type']}): "
                            f"the grammar decides where the answer ends", "min_tokens")
    return spec


def _vllm_spec(value: Any) -> dict | None:
    if not isinstance(value, dict):
        raise APIError(400, f"structured_outputs must be an object with one of {', '.join(_VLLM_KINDS)}, got "
                            f"{type_name(value)}", "structured_outputs")
    unknown = sorted(set(value) - set(_VLLM_KINDS))
    if unknown:
        raise APIError(400, f"structured_outputs has unknown or unsupported field(s) {', '.join(unknown)}; "
                            f"gpuformers takes one of: {', '.join(_VLLM_KINDS)}", f"structured_outputs.{unknown[0]}")
    kinds = [k for k, v in value.items() if v is not None and v is not False]
    if len(kinds) != 1:
        raise APIError(400, f"structured_outputs must set exactly one of {', '.join(_VLLM_KINDS)}, got "
                            f"{kinds or 'none'}", "structured_outputs")
    return _spec(kinds[0], value[kinds[0]], f"structured_outputs.{kinds[0]}")


def _spec(kind: str, value: Any, param: str) -> dict:
    """One vLLM structured-output field's value, checked -> the compiler's spec."""
    if kind == "json_object":
        if value is not True:
            raise APIError(400, f"{param} must be true, got {value!r}"[:300], param)
        return {"type": "json_object"}
    if kind == "json":
        if not isinstance(value, (dict, str)):
            raise APIError(400, f"{param} must be a JSON schema (an object, or its JSON text), got "
                                f"{type_name(value)}", param)
        return {"type": "json_schema", "name": None, "schema": value}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"{param} must be a non-empty list of non-empty strings, got {value!r}"[:300], param)
        return {"type": "choice", "choices": list(value)}
    if not isinstance(value, str) or not value:
        what = "a regular expression" if kind == "regex" else "an EBNF grammar"
        raise APIError(400, f"{param} must be a non-empty string ({what}), got {type_name(value)}", param)
    return {"type": kind, kind: value}
