"""SamplingDefaults: what a request that leaves out temperature, top_p, top_k or max_tokens gets. The model's
generation_config.json gives them where it sets them, as vLLM's `--generation-config auto` (its default) does; else
OpenAI's defaults. A value the request sends always wins.

    left out      generation_config.json sets      the request gets
    temperature   do_sample: false                 0, greedy: what the model's own generate() does
                  temperature                      that temperature
                  neither                          1.0 (OpenAI's)
    top_p         top_p                            that value, else 1.0
    top_k         top_k                            that value, else 0 (off)
    max_tokens    max_new_tokens                   at most that many; else 16 (completions) or the rest of the
                                                   context (chat, responses)

repetition_penalty and min_p, when left out, are not sent to the engine, which reads the same generation config
(so they come from it too, as in vLLM). vLLM does not read do_sample; a file that sets it false asks for greedy
decoding in transformers and in `gpuformers generate`, so it does here too.

Offers: SamplingDefaults, OPENAI_TEMPERATURE, OPENAI_TOP_P.
"""

from __future__ import annotations

from dataclasses import dataclass

OPENAI_TEMPERATURE = 1.0
OPENAI_TOP_P = 1.0


@dataclass(frozen=True)
class SamplingDefaults:
    """The values an omitted field gets (`fill`); `from_file` lists the fields the generation config gave."""

    temperature: float = OPENAI_TEMPERATURE
    top_p: float = OPENAI_TOP_P
    top_k: int = 0
    max_tokens: int | None = None  # generation_config.json's max_new_tokens: the most an omitted max_tokens gets
    from_file: tuple[str, ...] = ()

    @classmethod
    def from_generation_config(cls, config) -> "SamplingDefaults":
        """The defaults of a model whose generation config is `config` (a GenerationConfig: it knows which fields
        its file set; anything else gives OpenAI's defaults)."""
        from gpuformers.generation.config import GenerationConfig

        if not isinstance(config, GenerationConfig):
            return cls()
        values: dict = {}
        if config.is_set("do_sample") and not config.do_sample:
            values["temperature"] = 0.0
        elif config.is_set("temperature"):
            values["temperature"] = float(config.temperature)
        if config.is_set("top_p"):
            values["top_p"] = float(config.top_p)
        if config.is_set("top_k"):
            values["top_k"] = int(config.top_k or 0)
        if config.is_set("max_new_tokens") and config.max_new_tokens:
            values["max_tokens"] = int(config.max_new_tokens)
        return cls(**values, from_file=tuple(values))

    def fill(self, request) -> None:
        """Give a CompletionRequest's omitted (None) sampling fields their defaults; max_tokens stays None (the
        server's length check caps its default with `max_tokens`)."""
        if request.temperature is None:
            request.temperature = self.temperature
        if request.top_p is None:
            request.top_p = self.top_p
        if request.top_k is None:
            request.top_k = self.top_k

    def describe(self) -> str:
        """One line for the server's start-up message."""
        if not self.from_file:
            return ("sampling defaults: OpenAI's (temperature 1.0, top_p 1.0): the model's generation_config.json "
                    "sets none")
        shown = ", ".join("greedy (do_sample false)" if name == "temperature" and self.temperature == 0.0
                          else f"{name} {getattr(self, name)}" for name in self.from_file)
        return f"sampling defaults from the model's generation_config.json: {shown}"
