"""The grammar a chat answer is held to, put together from what the request asks and what the model writes around it:

    forced tool calls (tool_choice "required" or a named function)  -> the model's own call format (tool_calls.py)
    or a structured output (response_format, structured_outputs)     -> a schema, regex, choice or grammar
    then, for a thinking model, the think block before it            -> left free (reasoning.py decides its shape)

A thinking model keeps its reasoning under a structured output or a forced call: the grammar starts only where its
think block ends. Without such a model, a structured output is compiled as before (the spec as parsed); everything
else becomes one xgrammar structural tag ({"type": "structural_tag", "format": ...}, engine/structured.py).

Offers: needs_grammar (a cheap test, on the event loop), answer_grammar (the compiled Grammar: off the event loop),
answer_spec.
"""

from __future__ import annotations

from gpuformers.engine.structured import json_schema_ebnf
from gpuformers.serving.api_error import APIError
from gpuformers.serving.completion_request import CompletionRequest

_PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to hold "<think>" / "</think>" and what a template adds


_FORCED = ("required", "function")  # the tool_choice values that force a call


def needs_grammar(parsed: CompletionRequest) -> bool:
    """Whether the answer is held to a grammar: a structured output, or a forced tool call."""
    return parsed.structured_output is not None or parsed.tool_choice in _FORCED


def answer_grammar(state, parsed: CompletionRequest, prompt_ids: list[int]):
    """The engine Grammar of a request that needs_grammar (rendering the spec and compiling it take milliseconds to
    seconds: call it off the event loop)."""
    spec = answer_spec(state, parsed, prompt_ids)
    return state.compile_grammar(spec, spec["param"])


def answer_spec(state, parsed: CompletionRequest, prompt_ids: list[int]) -> dict:
    """The structured-output spec the engine compiles for this answer (which needs_grammar), with the request field
    it answers to as "param". `prompt_ids` show whether the chat template already opened or closed the think
    block."""
    forced = parsed.tool_choice in _FORCED
    param = ("tool_choice" if forced else parsed.structured_output.get("param")
             or ("text.format" if parsed.responses else "response_format"))
    reasoner = state.reasoning_parser if parsed.chat else None
    block = None
    if reasoner is not None:
        block = reasoner.block_ahead(state.tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:],
                                                            skip_special_tokens=False))
    if not forced and block is None:
        return {**parsed.structured_output, "param": param}  # no think block ahead: compiled the way it always was
    if forced:
        if parsed.structured_output is not None:
            raise APIError(400, "tool_choice that forces a call cannot be combined with a structured output (the "
                                "answer is the call); drop one of them", "tool_choice")
        parser = state.tool_call_parser  # routes_chat checked that the model has one
        try:
            answer = parser.forced_calls(parsed.tools, parsed.tool_name)
        except (ImportError, ValueError) as error:  # xgrammar missing; a parameters schema it cannot read
            raise APIError(400, f"tool_choice {parsed.tool_choice!r}: {error}", "tool_choice") from None
        if answer is None:
            raise APIError(400, f"tool_choice {parsed.tool_choice!r} is not supported with the {parser.name!r} "
                                f"tool-call format (no grammar for its calls yet); use tool_choice \"auto\"",
                           "tool_choice")
    else:
        answer = _format_of(parsed.structured_output, param)
    if block is not None:
        around = reasoner.grammar_around(answer, block)
        if around is None:
            raise APIError(400, f"{param}: constraining the answer of a model whose reasoning parser is "
                                f"{reasoner.name!r} is not supported (its answer format has no place for a grammar "
                                f"after the reasoning); leave {param} out", param)
        answer = around
    return {"type": "structural_tag", "format": answer, "param": param}


def _format_of(spec: dict, param: str) -> dict:
    """A parsed structured output (structured_request.py) as a structural tag format."""
    kind = spec["type"]
    if kind in ("json_object", "json_schema"):
        try:  # the same JSON rules as the plain spec (compact; a schema strict, json_object any object)
            ebnf = (json_schema_ebnf(spec["schema"]) if kind == "json_schema"
                    else json_schema_ebnf({"type": "object"}, strict=False))
        except (ImportError, ValueError) as error:
            raise APIError(400, f"{param}: {error}", param) from None
        return {"type": "grammar", "grammar": ebnf}
    if kind == "regex":
        return {"type": "regex", "pattern": spec["regex"]}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in spec["choices"]]}
    return {"type": "grammar", "grammar": spec["grammar"]}
