"""Task heads on a family's decoder: the bare model (AutoModel) and sequence classification
(AutoModelForSequenceClassification), for every family in registry.MODEL_TYPES.

Each is the family's causal LM class subclassed with only its head changed (STYLE 5), built once per family, so what
a family adds at the model level (Gemma 2's eager attention for its soft-cap, gpt-oss's sink checks and MXFP4
unpacking, the MoE fan-out rules, no_split_modules) holds for its heads as well:

    Qwen3ForCausalLM                 model (the decoder stack) + lm_head -> logits (batch, seq, vocab)
    Qwen3Model                       the stack's modules as its own      -> last_hidden_state (batch, seq, hidden)
    Qwen3ForSequenceClassification   model + score                       -> logits (batch, num_labels)

Names and checkpoint keys are transformers': a bare model holds embed_tokens, layers, norm (keys without "model."),
a classifier holds model.* and score.weight (no bias). The classifier pools each row at its last token that is not
pad_token_id (the rightmost one, so left and right padding both work; GenericForSequenceClassification's rule) and
its loss follows config.problem_type, inferred on the first labelled forward as transformers infers it:

    num_labels == 1                     regression                   MSE
    integer labels (batch,)             single_label_classification  cross-entropy (ignore_index -100)
    otherwise (float (batch, labels))   multi_label_classification   BCE with logits

The labels live in config.json as transformers writes them (id2label, label2id, problem_type; num_labels is
len(id2label), 2 when absent), in ModelConfig.extra; `configure_labels` applies from_pretrained's keywords.

Loading (models/auto.py): a checkpoint's keys carry the "model." prefix (a causal LM's, a classifier's) or not (a
bare model's), whatever the class loading it, as transformers allows through base_model_prefix. `checkpoint_view`
gives the loader a module whose names are the checkpoint's: the model itself, the model inside a "model" container,
or a classifier's stack with its score beside it. A classifier may lack score.weight (from a causal LM or bare
checkpoint): it is then drawn from N(0, initializer_range), as transformers initialises it; lm_head.weight is
left unused.

Offers: BaseModelOutputWithPast, SequenceClassifierOutputWithPast, TaskModel, BaseModelHead,
SequenceClassificationHead, causal_lm_class, base_model_class, sequence_classification_class, checkpoint_view;
and, through the module's __getattr__, each family's classes by name (Qwen3Model, Qwen3ForSequenceClassification,
...). The labels, the pooling and the loss are classification.py's.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpuformers.generation.cache import Cache
from gpuformers.loading.fan_out import FanOut
from gpuformers.models.classification import configure_labels, last_token_index, sequence_classification_loss
from gpuformers.models.config import ModelConfig
from gpuformers.outputs import ModelOutput
from gpuformers.models.registry import MODEL_TYPES

logger = logging.getLogger(__name__)

_PREFIX = "model."
# transformers names the text-only Gemma 3 heads Gemma3Text*, its Gemma3* ones being the multimodal model's; GPT-2's
# causal LM is GPT2LMHeadModel, its heads GPT2Model and GPT2ForSequenceClassification.
_STEMS = {"Gemma3ForCausalLM": "Gemma3Text", "GPT2LMHeadModel": "GPT2"}


@dataclass
class BaseModelOutputWithPast(ModelOutput):
    last_hidden_state: torch.Tensor | None = None  # (batch, seq, hidden), after the final norm
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None  # embeddings, then each layer's output (the last normed)


@dataclass
class SequenceClassifierOutputWithPast(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (batch, num_labels), at each row's last non-padding token
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


# --- classes ------------------------------------------------------------------------------------------------


def causal_lm_class(model_type: str) -> type:
    """The family's causal LM class (registry.MODEL_TYPES), whatever architecture config.json names."""
    module, name = MODEL_TYPES[model_type][0].split(":")
    return getattr(importlib.import_module(module), name)


def _stem(causal_lm_name: str) -> str:
    """Qwen3ForCausalLM -> Qwen3: what transformers puts before Model and ForSequenceClassification."""
    return _STEMS.get(causal_lm_name, causal_lm_name.removesuffix("ForCausalLM"))


@functools.cache
def base_model_class(family: type) -> type:
    """Qwen3ForCausalLM -> Qwen3Model: the family with its stack's modules as the model's own (whose fan-out rules
    then name them without "model.")."""
    rules = tuple(_strip_rule(rule) for rule in family.checkpoint_fan_out)
    return _subclass(f"{_stem(family.__name__)}Model", BaseModelHead, family, checkpoint_fan_out=rules)


@functools.cache
def sequence_classification_class(family: type) -> type:
    """Qwen3ForCausalLM -> Qwen3ForSequenceClassification: the family with `score` in place of lm_head."""
    return _subclass(f"{_stem(family.__name__)}ForSequenceClassification", SequenceClassificationHead, family)


def _subclass(name: str, head: type, family: type, **attributes) -> type:
    # __module__ is this one: pickle finds the class again through the module __getattr__ below.
    return type(name, (head, family), {"__module__": __name__, "__qualname__": name, "family": family,
                                       **attributes})


def __getattr__(name: str) -> type:
    """Qwen3Model, Qwen3ForSequenceClassification, ... for every family, built when first asked for."""
    for model_type, (target, _) in MODEL_TYPES.items():
        stem = _stem(target.split(":")[1])
        if name in (f"{stem}Model", f"{stem}ForSequenceClassification"):
            family = causal_lm_class(model_type)
            return (base_model_class if name == f"{stem}Model" else sequence_classification_class)(family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TaskModel:
    """What the heads share: no LM head (nothing tied), the class name in a saved config.json, and the loader's
    hooks (configure, allowed_missing, init_missing)."""

    family: type  # the family's causal LM class, set on each built class
    # regexes of parameters a checkpoint may lack: initialised by init_missing after the load
    allowed_missing: tuple[str, ...] = ()

    @classmethod
    def configure(cls, config: ModelConfig, **settings) -> ModelConfig:
        """The config this head is built from, with from_pretrained's head settings (none for the bare model)."""
        if settings:
            raise TypeError(f"{cls.__name__}.from_pretrained() got unexpected arguments: {', '.join(sorted(settings))}")
        return config

    @property
    def tied_weights(self) -> dict[str, str]:
        return {}

    def get_output_embeddings(self) -> None:
        return None  # no LM head (transformers' answer for these classes)

    def init_missing(self, names: list[str]) -> None:
        """Initialise the parameters `names` (allowed_missing ones the checkpoint lacked) as transformers does."""

    def unquantize_head(self) -> None:
        """Put back in full precision the head a quantization method swapped (on the meta device, before loading),
        as transformers keeps a classifier's head."""

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """As PreTrainedModel's, with this class in config.json's architectures (transformers' AutoModel reads the
        model_type; the name tells a reader what was saved)."""
        saved = self.config.architectures
        self.config.architectures = [type(self).__name__]
        try:
            super().save_pretrained(save_directory, *args, **kwargs)
        finally:  # the config may be shared with a causal LM, whose class it must keep naming
            self.config.architectures = saved


class BaseModelHead(TaskModel):
    """The bare decoder (transformers' Qwen3Model, ...): input_ids -> last_hidden_state, no head.

    The family's stack is built as the causal LM builds it, and its modules become this model's (embed_tokens,
    layers, norm, rotary_emb: transformers' names and keys): the two share one module table, so a module replaced
    on either (set_input_embeddings, an adapter) is the other's too. The stack itself is not a submodule (its
    modules would be counted twice); its forward runs them."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)  # the family's causal LM: model (the stack) + lm_head
        stack = self._modules.pop("model")
        del self.lm_head  # built on the meta device by from_pretrained: it never held memory
        if self._modules:
            raise TypeError(f"{type(self).__name__}: {self.family.__name__} has modules besides model and "
                            f"lm_head ({', '.join(self._modules)}), which a bare model would drop")
        self._modules = stack._modules
        self.__dict__["_stack"] = stack  # not through nn.Module.__setattr__, which would register it

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool = False,
        cache_position: torch.LongTensor | None = None,
    ) -> BaseModelOutputWithPast:
        """input_ids (batch, seq) -> BaseModelOutputWithPast(last_hidden_state (batch, seq, hidden), cache)."""
        cache = self._forward_cache(use_cache, past_key_values)
        hidden_states, all_hidden = self._stack(input_ids, attention_mask, position_ids, cache, inputs_embeds,
                                                output_hidden_states, cache_position)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=cache,
                                       hidden_states=tuple(all_hidden) if output_hidden_states else None)


class SequenceClassificationHead(TaskModel):
    """The decoder + score (hidden -> num_labels, no bias), read at each row's last non-padding token
    (transformers' GenericForSequenceClassification: Qwen3ForSequenceClassification, ...)."""

    allowed_missing = (r"^score\.weight$",)

    def __init__(self, config: ModelConfig):
        super().__init__(config)  # the family's causal LM: model (the stack) + lm_head
        del self.lm_head  # built on the meta device by from_pretrained: it never held memory
        self.num_labels = config.num_labels
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)

    @classmethod
    def configure(cls, config: ModelConfig, **settings) -> ModelConfig:
        return configure_labels(config, **settings)

    def unquantize_head(self) -> None:
        if type(self.score) is not nn.Linear:
            self.score = nn.Linear(self.config.hidden_size, self.num_labels, bias=False, device="meta")

    def init_missing(self, names: list[str]) -> None:
        if "score.weight" in names:
            with torch.no_grad():
                self.score.weight.normal_(0.0, self.config.initializer_range)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool = False,
    ) -> SequenceClassifierOutputWithPast:
        """input_ids (batch, seq) -> SequenceClassifierOutputWithPast(loss, logits (batch, num_labels), cache).

        labels: (batch,) class ids, (batch,) or (batch, num_labels) floats for regression, (batch, num_labels)
        0/1 floats for multi-label classification (module doc)."""
        cache = self._forward_cache(use_cache, past_key_values)
        hidden_states, all_hidden = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds,
                                               output_hidden_states, None)
        batch = hidden_states.shape[0]
        last = last_token_index(input_ids, self.config.pad_token_id, batch, hidden_states.device)
        # the rows' pooled states, then the head: the same numbers as the head over every token, then the rows
        logits = self.score(hidden_states[torch.arange(batch, device=hidden_states.device), last])
        loss = None
        if labels is not None:
            loss = sequence_classification_loss(logits, labels, self.config)
        return SequenceClassifierOutputWithPast(loss=loss, logits=logits, past_key_values=cache,
                                                hidden_states=tuple(all_hidden) if output_hidden_states else None)


# --- loading --------------------------------------------------------------------------------------------------


def checkpoint_view(model: nn.Module, checkpoint_keys: list[str]) -> tuple[nn.Module, dict | None]:
    """The module to load a checkpoint with `checkpoint_keys` into, whose parameter names are the checkpoint's, and
    how a device_map plan's names (the model's) read there: a function plan -> plan, or None for the model itself.

        model's names     checkpoint's      loaded into
        model.* (a head)  model.*           the model
        layers.* (bare)   layers.*          the model
        layers.* (bare)   model.*           a container holding the model as "model" (lm_head, score: unused)
        model.* (a head)  layers.*          the head's stack, its other modules (score) beside it
    """
    prefixed_model = "model" in model._modules
    prefixed_checkpoint = any(key.startswith(_PREFIX) for key in checkpoint_keys)
    if prefixed_model == prefixed_checkpoint:
        return model, None
    view = nn.Module()
    if prefixed_checkpoint:  # a bare model from a causal LM's or a classifier's checkpoint
        view.add_module("model", model)
        view.checkpoint_fan_out = model.family.checkpoint_fan_out
        return view, lambda plan: {(_PREFIX + name if name else "model"): where for name, where in plan.items()}
    stack = model._modules["model"]  # a head from a bare model's checkpoint
    for name, module in [*stack._modules.items(), *((n, m) for n, m in model._modules.items() if n != "model")]:
        view.add_module(name, module)
    view.checkpoint_fan_out = tuple(_strip_rule(rule) for rule in getattr(model, "checkpoint_fan_out", ()))
    return view, functools.partial(_strip_plan, stack_modules=tuple(stack._modules))


def _strip_plan(plan: dict, stack_modules: tuple[str, ...]) -> dict:
    out = {}
    for name, where in plan.items():
        if name == "model":  # the whole stack on one device: each of its modules there
            out.update(dict.fromkeys(stack_modules, where))
        else:
            out[name.removeprefix(_PREFIX)] = where
    return out


def _strip_rule(rule: FanOut) -> FanOut:
    """A fan-out rule over "model."-prefixed names -> the same rule over the stack's own names."""
    return FanOut(rule.source.removeprefix(_PREFIX), tuple(t.removeprefix(_PREFIX) for t in rule.targets))
