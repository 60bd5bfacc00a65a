"""ServerState: what the route handlers of `gpuformers serve` share, one object on `app.state.serving` (each
handler reads it from `request.app.state.serving`): the model's facts, the engine, the metrics, the parsers chosen
for the model, and the structured-output compiler.

Offers: ServerState (and its adapter_of: which LoRA adapter a request's model names, or a 404).
"""

from __future__ import annotations

import threading

from gpuformers.serving.api_error import APIError
from gpuformers.serving.job import Engine, now
from gpuformers.serving.metrics import Metrics
from gpuformers.serving.prompt_chars import PromptChars
from gpuformers.serving.reasoning import detect_reasoning_parser, get_reasoning_parser
from gpuformers.serving.request_fields import shown_value
from gpuformers.serving.sampling_defaults import SamplingDefaults
from gpuformers.serving.token_texts import TokenTexts
from gpuformers.serving.tool_calls import detect_tool_call_parser, get_tool_call_parser, template_renders_tools


class ServerState:
    """What the route handlers share: the model's facts, the engine, the metrics."""

    def __init__(self, manager, tokenizer, model_name: str, max_model_len: int, api_key: str | None,
                 max_pending: int, tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.engine = Engine(manager, max_pending)
        self.manager = manager
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # each token's text alone, for logprobs: decoded once per id
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.prompt_chars = PromptChars(tokenizer, max_model_len)  # a prompt longer than this cannot fit
        # What an omitted temperature, top_p, top_k, max_tokens means: the model's generation_config.json, else OpenAI
        self.sampling_defaults = SamplingDefaults.from_generation_config(manager.generation_config)
        self.api_key = api_key
        self.metrics = Metrics()
        self.created = now()
        self.vocab_size = manager.model.config.vocab_size
        self.eos_ids = set(manager.generation_config.eos_token_ids or ())
        blocks = manager.block_manager
        self.cache_tokens = blocks.num_blocks * blocks.block_size
        self.shutting_down = False
        # Tool calls: the parser named on the command line, else the one whose format the chat template shows
        template = getattr(tokenizer, "chat_template", None)
        name = tool_call_parser or detect_tool_call_parser(template)
        self.tool_call_parser = get_tool_call_parser(name) if name else None
        self.template_renders_tools = bool(template) and template_renders_tools(tokenizer)
        # Reasoning: the parser named on the command line ("none": off), else the one the chat template implies
        if reasoning_parser is None:
            reasoning_parser = detect_reasoning_parser(tokenizer)
        self.reasoning_parser = (get_reasoning_parser(reasoning_parser)
                                 if reasoning_parser not in (None, "none") else None)
        self._grammars = None  # a StructuredOutputCompiler, made by the first structured-output request
        self._grammars_lock = threading.Lock()

    def adapter_of(self, model: str) -> str | None:
        """None for the served model, the LoRA adapter's name for one of its adapters (vLLM lists them as models of
        their own); any other name is a 404 that names what is served."""
        if model == self.model_name:
            return None
        if model not in self.manager.adapters:
            served = ", ".join(map(repr, [self.model_name, *self.manager.adapters]))
            raise APIError(404, f"model {shown_value(model)} does not exist here; this server serves {served}",
                           "model", code="model_not_found")
        return model

    def compile_grammar(self, spec: dict, param: str):
        """The engine Grammar of a parsed response_format (compiled once per schema; runs off the event loop)."""
        from gpuformers.engine.structured import StructuredOutputCompiler
        from gpuformers.tensor_parallel import is_tensor_parallel

        if is_tensor_parallel(self.manager.model):
            raise APIError(400, f"{param}: structured outputs are not supported on a tensor-parallel server (a "
                                f"grammar matcher would be needed in every process); serve without "
                                f"--tensor-parallel-size for them", param)
        try:
            with self._grammars_lock:  # building the compiler reads the whole vocabulary: once
                if self._grammars is None:
                    self._grammars = StructuredOutputCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_ids))
                    # a model without eos ids ends a grammar at its tokenizer's eos: a "stop" too (in place: the
                    # jobs share this set)
                    self.eos_ids.update(self._grammars.stop_token_ids)
            grammar = self._grammars.compile(spec)
        except (ImportError, ValueError) as error:  # xgrammar missing; a schema it cannot compile
            raise APIError(400, str(error), param) from None
        _check_first_token(grammar, param)
        return grammar


def _check_first_token(grammar, param: str) -> None:
    """A 400 for a grammar that allows no first token, so matches no text at all (`root ::= root "a"`, the regex
    `[^\\s\\S]`): the engine would sample from a row of -inf logits, whose nan fails every request in the step."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, grammar.vocab_size)  # (1, ceil(vocab / 32)) int32
    grammar.matcher().fill_next_token_bitmask(bitmask, 0)
    if not bitmask.any():
        raise APIError(400, f"{param}: the {grammar.name} matches no text (it allows no first token: a rule with no "
                            f"way to end, or an empty character class); fix the grammar", param)
