"""`pipeline("text-generation", model=...)`: prompts or chats in, generated text out, as transformers' pipeline.

    generator = pipeline("text-generation", model="Qwen/Qwen3-0.6B")
    generator("The capital of France is", max_new_tokens=20)
        -> [{"generated_text": "The capital of France is Paris, ..."}]
    generator([{"role": "user", "content": "Hi!"}])
        -> [{"generated_text": [{"role": "user", ...}, {"role": "assistant", "content": "Hello! ..."}]}]

A chat (a list of {"role", "content"} messages) goes through the tokenizer's chat template; its reply comes back as
the conversation with the assistant message appended (or only the reply text with return_full_text=False). A list
of prompts or chats gives a list of results, one list of `num_return_sequences` records per input.

Device: `device=` wins; otherwise a model loaded here goes to cuda:0 when a GPU is visible, else the CPU. A model
object passed in stays on its device map if it has one (as a model loaded by from_pretrained does) and otherwise
moves to that default device. `device` together with `device_map` is an error.

Generation defaults (transformers' for this task): max_new_tokens=256, do_sample=True, temperature=0.7, each used only
where neither the call nor the model's generation_config sets it (temperature only when sampling).

Offers: pipeline, TextGenerationPipeline, SUPPORTED_TASKS.
"""

from __future__ import annotations

import os
from typing import Any

import torch

SUPPORTED_TASKS = ("text-generation",)
_DEFAULTS = {"max_new_tokens": 256, "do_sample": True, "temperature": 0.7}
_SAMPLING_DEFAULTS = ("temperature",)


def pipeline(task: str, model=None, tokenizer=None, dtype=None, device=None, device_map=None, torch_dtype=None,
             **kwargs) -> "TextGenerationPipeline":
    """Build a text-generation pipeline from a model id / folder or a loaded model. Extra kwargs are generation
    settings (max_new_tokens=, do_sample=, ...) applied to every call; `batch_size=` groups prompts per generate."""
    if task not in SUPPORTED_TASKS:
        raise ValueError(f"task {task!r} is not supported; supported tasks: {', '.join(SUPPORTED_TASKS)}")
    if model is None:
        raise ValueError('pipeline() needs model=: a Hub id, a checkpoint folder or a loaded model, e.g. '
                         'pipeline("text-generation", model="Qwen/Qwen3-0.6B")')
    if device is not None and device_map is not None:
        raise ValueError(
            f"pass either device={device!r} or device_map={device_map!r}, not both: device puts the whole model on "
            f"one device, device_map lets the loader place it"
        )
    dtype = dtype if dtype is not None else torch_dtype
    from gpuformers.device import parse_dtype, resolve_device
    from gpuformers.models.auto import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model, (str, os.PathLike)):
        name = str(model)
        placement = device_map if device_map is not None else _default_device() if device is None else device
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype if dtype is not None else "auto",
                                                     device_map=placement)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(name)
    else:
        if not hasattr(model, "generate"):
            raise TypeError(f"model must be a Hub id, a folder or a gpuformers model, got {type(model).__name__}")
        if device_map is not None:
            raise ValueError("device_map only applies when the pipeline loads the model; pass device= to move a "
                             "loaded model, or load it with from_pretrained(..., device_map=...)")
        if dtype is not None and dtype != "auto":
            model.to(parse_dtype(dtype))
        if device is not None:
            model.to(resolve_device(device))
        elif getattr(model, "hf_device_map", None) is None:
            model.to(_default_device())
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    if tokenizer is None:
        source = getattr(model, "name_or_path", "")
        if not source:
            raise ValueError("pass tokenizer=: the model was not loaded from a folder, so there is no tokenizer to "
                             "load with it")
        tokenizer = AutoTokenizer.from_pretrained(source)
    return TextGenerationPipeline(model, tokenizer, **kwargs)


def _default_device() -> torch.device:
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def _is_chat(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(m, dict) and "role" in m for m in value)


class TextGenerationPipeline:
    """Call it with a prompt, a chat, or a list of them; see the module docstring."""

    def __init__(self, model, tokenizer, batch_size: int = 1, **generate_kwargs):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.generate_kwargs = generate_kwargs

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def __call__(self, text_inputs, return_full_text: bool = True, prefix: str = "",
                 continue_final_message: bool | None = None, skip_special_tokens: bool = True,
                 clean_up_tokenization_spaces: bool | None = None, batch_size: int | None = None,
                 **generate_kwargs):
        single = isinstance(text_inputs, str) or _is_chat(text_inputs)
        items = [text_inputs] if single else list(text_inputs)
        for item in items:
            if not isinstance(item, str) and not _is_chat(item):
                raise TypeError(
                    f"pipeline inputs are strings or chats (lists of {{'role', 'content'}} dicts), got "
                    f"{type(item).__name__}: {str(item)[:80]}"
                )
        kwargs = self._generation_kwargs({**self.generate_kwargs, **generate_kwargs})
        size = batch_size or self.batch_size
        results = []
        for start in range(0, len(items), size):
            group = items[start:start + size]
            prompts = [self._encode(item, prefix, continue_final_message) for item in group]
            sequences, width = self._generate(prompts, kwargs)
            per_input = sequences.shape[0] // len(group)
            for i, item in enumerate(group):
                records = []
                for row in sequences[i * per_input:(i + 1) * per_input]:
                    text = self.tokenizer.decode(row[width:].tolist(), skip_special_tokens=skip_special_tokens,
                                                 clean_up_tokenization_spaces=clean_up_tokenization_spaces)
                    records.append({"generated_text": self._full_text(item, text, continue_final_message)
                                    if return_full_text else text})
                results.append(records)
        return results[0] if single else results

    # --- steps ----------------------------------------------------------------------------------------------

    def _generation_kwargs(self, kwargs: dict) -> dict:
        """The task's defaults for what neither the call nor the model's generation_config sets."""
        model_config = getattr(self.model, "generation_config", None)

        def is_set(name):
            return name in kwargs or (model_config is not None and model_config.is_set(name))

        out = dict(kwargs)
        if "max_length" not in kwargs and not is_set("max_new_tokens"):
            out["max_new_tokens"] = _DEFAULTS["max_new_tokens"]
        if not is_set("do_sample"):
            out["do_sample"] = _DEFAULTS["do_sample"]
        sampling = out.get("do_sample", model_config.do_sample if model_config is not None else False)
        for name in _SAMPLING_DEFAULTS:
            if sampling and not is_set(name):
                out[name] = _DEFAULTS[name]
        if "pad_token_id" not in out and getattr(self.tokenizer, "pad_token_id", None) is not None:
            out["pad_token_id"] = self.tokenizer.pad_token_id
        return out

    def _encode(self, item, prefix: str, continue_final_message: bool | None) -> list[int]:
        if isinstance(item, str):
            return list(self.tokenizer(prefix + item)["input_ids"])
        cont = continue_final_message if continue_final_message is not None else item[-1]["role"] == "assistant"
        ids = self.tokenizer.apply_chat_template(list(item), add_generation_prompt=not cont,
                                                 continue_final_message=cont, tokenize=True, return_dict=False)
        return list(ids)

    def _generate(self, prompts: list[list[int]], kwargs: dict) -> tuple[torch.Tensor, int]:
        """Left-pad the prompts into one batch and generate; returns (rows, width + new) ids and the width."""
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = kwargs.get("pad_token_id", 0) if kwargs.get("pad_token_id") is not None else 0
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if p:
                input_ids[i, width - len(p):] = torch.tensor(p)
                attention_mask[i, width - len(p):] = 1
        device = self.device
        out = self.model.generate(input_ids.to(device), attention_mask=attention_mask.to(device),
                                  tokenizer=self.tokenizer, **kwargs)
        sequences = out.sequences if hasattr(out, "sequences") else out  # return_dict_in_generate=True
        return sequences.cpu(), width

    @staticmethod
    def _full_text(item, text: str, continue_final_message: bool | None):
        if isinstance(item, str):
            return item + text
        cont = continue_final_message if continue_final_message is not None else item[-1]["role"] == "assistant"
        if cont:
            last = item[-1]
            return [*item[:-1], {**last, "content": last["content"] + text}]
        return [*item, {"role": "assistant", "content": text}]
