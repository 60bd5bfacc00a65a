"""POST /v1/chat/completions: messages rendered by the model's chat template (with the tools it renders), answered
by a ChatJob (chat_job.py) through serve_job (serve_job.py). The handler reads the app's ServerState from
`request.app.state.serving`. /v1/responses (routes_responses.py) renders its prompt here too.

Offers: chat_completions (the handler), chat_prompt_ids, chat_prompts (the one prompt, as serve_job takes prompts),
add_routes.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from gpuformers.serving.api_error import APIError
from gpuformers.serving.chat_job import ChatJob
from gpuformers.serving.chat_request import parse_chat
from gpuformers.serving.completion_request import CompletionRequest
from gpuformers.serving.http import check_api_key, read_json
from gpuformers.serving.serve_job import serve_job
from gpuformers.serving.server_state import ServerState
from gpuformers.serving.tool_calls import TOOL_CALL_PARSERS

PATH = "/v1/chat/completions"


async def chat_completions(request: Request):
    state: ServerState = request.app.state.serving
    check_api_key(request, state.api_key)
    parsed = parse_chat(await read_json(request))
    return await serve_job(request, parsed, PATH, ChatJob, chat_prompts)


def chat_prompts(state: ServerState, parsed: CompletionRequest) -> list[list[int]]:
    return [chat_prompt_ids(state, parsed)]


def chat_prompt_ids(state: ServerState, parsed: CompletionRequest, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
    """The chat template's token ids for the messages (and tools); messages of more characters than can fit are
    refused before any rendering. /tokenize passes the template's two flags (a chat request always starts a new
    assistant message)."""
    state.prompt_chars.check(sum(len(m["content"]) for m in parsed.messages), parsed.prompt_field,
                             f"text of the {parsed.prompt_field}")
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"model {state.model_name!r} has no chat template; use /v1/completions")
    tools = _tools_of(state, parsed)
    try:
        ids = tokenizer.apply_chat_template(parsed.messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, return_dict=False,
                                            **parsed.chat_template_kwargs)
    except Exception as error:  # the template's own checks (role order, ...) raise template errors
        raise APIError(400, f"the chat template rejected these messages: {error}", parsed.prompt_field) from None
    return list(ids)


def _tools_of(state: ServerState, parsed: CompletionRequest) -> list[dict] | None:
    """The tools the template renders; with a tool_choice other than "none" the answer's calls must be parseable
    too (a forced call's grammar is answer_grammar.py's)."""
    if parsed.tools and parsed.tool_choice != "none":
        if state.tool_call_parser is None:
            raise APIError(400, f"model {state.model_name!r} has no tool-call parser (its chat template shows no "
                                f"known call format); restart the server with --tool-call-parser NAME (one of: "
                                f"{', '.join(sorted(TOOL_CALL_PARSERS))}), or send tool_choice \"none\"", "tools")
        if not state.template_renders_tools:
            raise APIError(400, f"the chat template of model {state.model_name!r} does not render tools, so the "
                                "model would never see them; serve a model whose chat template takes tools "
                                "(Qwen2.5, Qwen3, Hermes), or leave tools out", "tools")
    return parsed.tools


def add_routes(app: FastAPI) -> None:
    app.add_api_route(PATH, chat_completions, methods=["POST"])
