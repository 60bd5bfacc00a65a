"""Chat templates on the tokenizer: choosing the template, then rendering and tokenizing a conversation.

Templates are rendered the way transformers renders them (sandboxed Jinja with trim_blocks and lstrip_blocks,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, `{% generation %}` blocks for
assistant masks; see gpuformers.chat_template), so a prompt is byte-for-byte the one the model was trained on.

Offers: ChatTemplateMixin (get_chat_template, apply_chat_template), and normalise_chat_template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuformers.chat_template import assistant_mask, render_chats
from gpuformers.tokenization.batch_encoding import BatchEncoding


class ChatTemplateMixin:
    """The chat-template part of PreTrainedTokenizerFast; reads `self.chat_template` and calls `self(...)`."""

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: `chat_template` (a template or the name of one), else the tokenizer's own."""
        if isinstance(self.chat_template, dict):
            named = self.chat_template
            if chat_template is not None:
                return named.get(chat_template, chat_template)
            if tools is not None and "tool_use" in named:
                return named["tool_use"]
            if "default" in named:
                return named["default"]
            raise ValueError(
                f"this tokenizer has several chat templates and none is called 'default'; pass "
                f"chat_template= one of: {', '.join(sorted(named))}"
            )
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer.chat_template is None). Pass chat_template= a Jinja "
                "template, or set tokenizer.chat_template, e.g. from the instruct version of the model."
            )
        return self.chat_template

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        padding: bool | str = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_dict: bool = True,
        chat_template: str | None = None,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs: dict | None = None,
        sanitize_control_tokens: bool = False,
        **template_kwargs,
    ) -> str | list[str] | list[int] | list[list[int]] | BatchEncoding:
        """Render a conversation (or a batch of them) with the chat template; tokenize it unless tokenize=False.

        As in transformers 5: with tokenize=True a BatchEncoding is returned unless return_dict=False (then the
        ids). Extra keyword arguments (e.g. enable_thinking=False) are template variables.
        """
        if sanitize_control_tokens:
            raise NotImplementedError(
                "sanitize_control_tokens=True (encoding control tokens found in user text as plain text) is not "
                "supported yet; strip such tokens from the messages before calling apply_chat_template"
            )
        if return_assistant_tokens_mask and not (tokenize and return_dict):
            raise ValueError("return_assistant_tokens_mask=True needs tokenize=True and return_dict=True")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be set: the first continues the last "
                "message, the second starts a new assistant message"
            )
        if continue_final_message and return_assistant_tokens_mask:
            raise ValueError("continue_final_message cannot be combined with return_assistant_tokens_mask")
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("the conversation is empty; give at least one message")
        batched = isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
        )
        conversations = list(conversation) if batched else [conversation]
        variables = {**self.special_tokens_map, **template_kwargs}
        rendered, spans = render_chats(
            template,
            conversations,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            track_generation=return_assistant_tokens_mask,
            **variables,
        )
        if not tokenize:
            return rendered if batched else rendered[0]
        out = self(
            rendered if batched else rendered[0],
            add_special_tokens=False,  # the template writes BOS and the rest itself
            padding=padding,
            truncation=truncation,
            max_length=max_length,
            return_tensors=return_tensors,
            **(tokenizer_kwargs or {}),
        )
        if not return_dict:
            return out["input_ids"]
        if return_assistant_tokens_mask:
            masks = [assistant_mask(encoding.offsets, row_spans) for encoding, row_spans in zip(out.encodings, spans)]
            out["assistant_masks"] = masks if batched or return_tensors else masks[0]
            if return_tensors:
                out.convert_to_tensors(return_tensors)
        return out


def normalise_chat_template(template: str | dict | list | None) -> str | dict | None:
    """A template, a {name: template} dict, or the [{"name", "template"}] list that configs store."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, Mapping):
        named = dict(template)
    elif isinstance(template, (list, tuple)):
        try:
            named = {entry["name"]: entry["template"] for entry in template}
        except (TypeError, KeyError) as err:
            raise ValueError("chat_template as a list must hold {'name': ..., 'template': ...} entries") from err
    else:
        raise TypeError(
            f"chat_template must be a string, a dict of named templates or a list, got {type(template).__name__}"
        )
    return named["default"] if list(named) == ["default"] else named
