"""Training data: rows -> token ids with labels -> padded batches.

- `DataCollatorForCausalLM` pads a list of {"input_ids", optional "labels"} rows to the longest (right side),
  with attention_mask 0 and label -100 on the padding; labels default to the input ids.
  `DataCollatorForLanguageModeling(tokenizer, mlm=False)` is transformers' collator under its name, with its rules.
- `tokenize_text(tokenizer, text)` and `tokenize_chat(tokenizer, messages)`: one row each. A chat is rendered
  with the tokenizer's chat template and only the assistant turns are trained on: every other token gets -100.
- `load_jsonl(path)` reads `{"text": ...}` or `{"messages": [...]}` rows; `tokenize_rows` turns them into rows.

Finding the assistant turns. A template with `{% generation %}` blocks marks them itself. Others (Qwen3, Llama 3)
do not, so we locate each assistant turn i in the rendered chat: it starts where the chat up to turn i, rendered
with add_generation_prompt=True, ends (the assistant header is prompt, not target), and it ends after its content
and the end-of-turn text the template writes after a reply ("<|im_end|>", found by rendering a probe chat): the
model must learn to stop. Templates that rewrite earlier turns (Qwen3 drops old reasoning) still work because
only the header position and the content are matched.

Offers: DataCollatorForCausalLM, DataCollatorForLanguageModeling, tokenize_text, tokenize_chat, assistant_spans, end_of_turn, load_jsonl,
tokenize_rows, token_ids_as_list (a row's input_ids or labels, a list or a tensor, as a list of ints).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

import torch

from gpuformers.labels import IGNORE_INDEX


class DataCollatorForCausalLM:
    """Rows {"input_ids": [...], "labels": [...] (optional)} -> a batch of (batch, longest) tensors.

    pad_to_multiple_of rounds the length up (tensor cores like multiples of 8); padding_side "right" (training).
    """

    def __init__(self, tokenizer=None, pad_token_id: int | None = None, pad_to_multiple_of: int | None = None,
                 padding_side: str = "right", max_length: int | None = None):
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = 0 if pad_token_id is None else pad_token_id  # masked out: any id works
        if padding_side not in ("left", "right"):
            raise ValueError(f'padding_side "{padding_side}" is not one of: left, right')
        self.pad_to_multiple_of, self.padding_side, self.max_length = pad_to_multiple_of, padding_side, max_length

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        if "input_ids" not in rows[0]:
            raise ValueError(f"rows need token ids under 'input_ids' but have {sorted(rows[0])}; tokenize them first "
                             "(gpuformers.training.data.tokenize_rows for {'text'} / {'messages'} rows)")
        ids = [token_ids_as_list(row["input_ids"], "input_ids") for row in rows]
        labels = [token_ids_as_list(row["labels"], "labels") if row.get("labels") is not None else list(i)
                  for row, i in zip(rows, ids)]
        if self.max_length is not None:
            ids, labels = [i[: self.max_length] for i in ids], [l[: self.max_length] for l in labels]
        for i, l in zip(ids, labels):
            if len(i) != len(l):
                raise ValueError(f"a row has {len(i)} input_ids but {len(l)} labels; they must be the same length")
        longest = max(len(i) for i in ids)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {"input_ids": torch.full((len(ids), longest), self.pad_token_id, dtype=torch.long),
                 "attention_mask": torch.zeros(len(ids), longest, dtype=torch.long),
                 "labels": torch.full((len(ids), longest), IGNORE_INDEX, dtype=torch.long)}
        for row, (i, l) in enumerate(zip(ids, labels)):
            cols = slice(0, len(i)) if self.padding_side == "right" else slice(longest - len(i), longest)
            batch["input_ids"][row, cols] = torch.tensor(i, dtype=torch.long)
            batch["labels"][row, cols] = torch.tensor(l, dtype=torch.long)
            batch["attention_mask"][row, cols] = 1
        return batch


class DataCollatorForLanguageModeling(DataCollatorForCausalLM):
    """transformers' collator under its name, for causal LMs (`mlm=False`): rows {"input_ids": [...]} padded to
    the longest on the tokenizer's padding side, labels = input_ids with every pad-token id set to -100.

    As in transformers, any label a row brings is ignored, and a real token whose id is the pad token's is masked
    too: with `pad_token = eos_token` the model is never trained to stop. Use DataCollatorForCausalLM (labels
    from the rows, only the padding masked) when that matters.
    """

    def __init__(self, tokenizer, mlm: bool = True, mlm_probability: float | None = 0.15,
                 pad_to_multiple_of: int | None = None, return_tensors: str = "pt", seed: int | None = None):
        if mlm:
            raise NotImplementedError("DataCollatorForLanguageModeling(mlm=True): masked language modelling is for "
                                      "encoder models and gpuformers trains causal LMs; pass mlm=False")
        if return_tensors != "pt":
            raise ValueError(f'return_tensors="{return_tensors}" is not supported: gpuformers returns torch tensors '
                             '("pt")')
        if tokenizer is None or tokenizer.pad_token_id is None:
            raise ValueError("DataCollatorForLanguageModeling needs a tokenizer with a pad token to pad the rows; "
                             "set one, e.g. tokenizer.pad_token = tokenizer.eos_token")
        super().__init__(pad_token_id=tokenizer.pad_token_id, pad_to_multiple_of=pad_to_multiple_of,
                         padding_side=getattr(tokenizer, "padding_side", "right"))
        self.tokenizer, self.mlm = tokenizer, mlm

    def __call__(self, rows: Sequence[dict[str, Any]] | Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        rows = [row if isinstance(row, dict) else {"input_ids": row} for row in rows]
        batch = super().__call__([{"input_ids": row["input_ids"]} for row in rows] if rows else rows)
        batch["labels"] = batch["input_ids"].masked_fill(batch["input_ids"] == self.pad_token_id, IGNORE_INDEX)
        return batch


def token_ids_as_list(value: Any, name: str) -> list[int]:
    if torch.is_tensor(value):
        return value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of token ids or a tensor, got {type(value).__name__}")
    return list(value)


# ------------------------------------------------------------------------------------------------- text rows


def tokenize_text(tokenizer, text: str, max_length: int | None = None, add_eos: bool = True) -> dict[str, list[int]]:
    """Plain text -> {"input_ids", "labels"}: every token is trained on; EOS appended so the model learns to stop."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if add_eos and tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = ids + [tokenizer.eos_token_id]
    ids = ids[:max_length] if max_length else ids
    return {"input_ids": ids, "labels": list(ids)}


# ------------------------------------------------------------------------------------------------- chat rows


_PROBE = "gpuformers-probe-reply"
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def end_of_turn(tokenizer, **template_kwargs) -> str:
    """The text the chat template writes right after an assistant message ("<|im_end|>", "<|eot_id|>", "</s>"),
    found by rendering a one-turn probe chat; the EOS token if the template will not render it."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        rendered = tokenizer.apply_chat_template(chat, tokenize=False, **template_kwargs)
    except Exception:  # templates that demand a system message or alternating roles of their own
        return tokenizer.eos_token or ""
    after = rendered[rendered.rindex(_PROBE) + len(_PROBE):] if _PROBE in rendered else ""
    return after.strip() or (tokenizer.eos_token or "")


def assistant_spans(tokenizer, messages: list[dict], rendered: str, **template_kwargs) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant turns in `rendered` (the whole chat, rendered)."""
    end_text = end_of_turn(tokenizer, **template_kwargs)
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True,
                                               **template_kwargs) if index else ""
        if not rendered.startswith(prompt):
            raise ValueError(
                f"cannot find assistant turn {index} in the rendered chat: the chat template renders the earlier "
                "turns differently once this turn is added, so the prompt is not a prefix of the chat. Add "
                "{% generation %} ... {% endgeneration %} around the assistant content in the template instead.")
        start = max(len(prompt), cursor)
        content = message.get("content") or ""
        content = content.split("</think>")[-1].strip() if isinstance(content, str) else ""
        at = rendered.find(content, start) if content else start
        if at < 0:
            raise ValueError(f"assistant turn {index} ({content[:40]!r}...) does not appear in the rendered chat; "
                             "the chat template rewrites it, so its tokens cannot be found for the loss mask")
        if index == 0:  # no prompt to render before it; a template's default system text must stay masked
            start = at
        end = at + len(content)
        gap = rendered[end:].lstrip(" \t")
        if end_text and gap.startswith(end_text):
            end = len(rendered) - len(gap) + len(end_text)
        spans.append((start, end))
        cursor = end
    return spans


def tokenize_chat(tokenizer, messages: list[dict], max_length: int | None = None,
                  **template_kwargs) -> dict[str, list[int]]:
    """A chat -> {"input_ids", "labels"} with labels -100 on everything but the assistant turns."""
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("this chat has no assistant message, so there is nothing to train on; each 'messages' row "
                         "needs at least one {'role': 'assistant', 'content': ...}")
    template = tokenizer.get_chat_template()
    if isinstance(template, str) and _GENERATION_TAG.search(template):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **template_kwargs)
        ids, mask = out["input_ids"], out["assistant_masks"]
    else:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
        spans = assistant_spans(tokenizer, messages, rendered, **template_kwargs)
        encoding = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoding["input_ids"]
        mask = [int(any(s < b and a < e for s, e in spans)) for a, b in encoding["offset_mapping"]]
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    if max_length:
        ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "labels": labels}


# ------------------------------------------------------------------------------------------------ JSONL files


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSONL file, each {"text": str} or {"messages": [{"role", "content"}, ...]}."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {number} is not JSON ({error.msg}); each line must be one object "
                                 'like {"text": ...} or {"messages": [...]}') from None
            if not isinstance(row, dict) or not ({"text", "messages"} & set(row)):
                raise ValueError(f'{path} line {number} has neither "text" nor "messages": {line.strip()[:80]}')
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def tokenize_rows(tokenizer, rows: list[dict], max_length: int | None = None,
                  **template_kwargs) -> list[dict[str, list[int]]]:
    """{"text"} rows are trained on whole; {"messages"} rows only on the assistant turns."""
    return [tokenize_chat(tokenizer, row["messages"], max_length, **template_kwargs) if "messages" in row
            else tokenize_text(tokenizer, row["text"], max_length) for row in rows]
