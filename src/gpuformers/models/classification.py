"""Sequence classification's labels, pooling and loss, as transformers reads and computes them: num_labels,
id2label / label2id and problem_type from config.json or from_pretrained's keywords, each row's last non-padding
token, and the loss problem_type names (inferred on the first labelled forward when unset):

    num_labels == 1                     regression                   MSE
    integer labels (batch,)             single_label_classification  cross-entropy (ignore_index -100)
    otherwise (float (batch, labels))   multi_label_classification   BCE with logits

heads.py's SequenceClassificationHead uses them.

Offers: PROBLEM_TYPES, configure_labels, last_token_index, sequence_classification_loss.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F

from gpuformers.models.config import ModelConfig

logger = logging.getLogger(__name__)

PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def configure_labels(config: ModelConfig, num_labels: int | None = None, id2label: dict | None = None,
                     label2id: dict | None = None, problem_type: str | None = None,
                     pad_token_id: int | None = None) -> ModelConfig:
    """The config with from_pretrained's label settings applied (a copy when any is given), checked, as
    transformers' config holds them: id2label with int keys (JSON's are strings), label2id its inverse unless given,
    num_labels only through them (a num_labels that differs from id2label's length gives LABEL_0, LABEL_1, ...)."""
    if any(v is not None for v in (num_labels, id2label, label2id, problem_type, pad_token_id)):
        config = copy.deepcopy(config)
    extra = config.extra
    if id2label is not None:
        if num_labels is not None and num_labels != len(id2label):
            raise ValueError(f"num_labels={num_labels} but id2label has {len(id2label)} labels; pass one of them")
        extra["id2label"] = dict(id2label)
        extra.pop("label2id", None)
    elif num_labels is not None:
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels={num_labels!r} must be an int >= 1 (1 for regression)")
        if len(extra.get("id2label") or {}) != num_labels:
            extra["id2label"] = {i: f"LABEL_{i}" for i in range(num_labels)}
            extra.pop("label2id", None)
    if extra.get("id2label") is not None:
        extra["id2label"] = {int(k): v for k, v in extra["id2label"].items()}
        if not extra["id2label"]:
            raise ValueError("id2label is empty: a classifier needs at least one label (num_labels >= 1)")
    if label2id is not None:
        extra["label2id"] = dict(label2id)
    elif extra.get("id2label") is not None and extra.get("label2id") is None:
        extra["label2id"] = {label: i for i, label in extra["id2label"].items()}
    if problem_type is not None:
        extra["problem_type"] = problem_type
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    kind = extra.get("problem_type")
    if kind is not None and kind not in PROBLEM_TYPES:
        raise ValueError(f"problem_type {kind!r} is not one of: {', '.join(PROBLEM_TYPES)}")
    if kind == "single_label_classification" and config.num_labels == 1:
        raise ValueError('problem_type="single_label_classification" needs num_labels >= 2: use num_labels=2 for '
                         'binary classification, or problem_type="regression" for one output')
    return config


def last_token_index(input_ids: torch.Tensor | None, pad_token_id: int | None, batch: int,
                     device: torch.device) -> torch.Tensor | int:
    """Each row's last token that is not pad_token_id (batch,), or -1 (the last position) without one: the
    rightmost non-pad token, so that left- and right-padded rows both work (transformers' rule)."""
    if pad_token_id is None:
        if batch != 1:
            raise ValueError(f"a batch of {batch} rows needs config.pad_token_id to find each row's last token, and "
                             f"it is None; pass pad_token_id=tokenizer.pad_token_id to from_pretrained (or set "
                             f"model.config.pad_token_id), or classify one row at a time")
        return -1
    if input_ids is None:
        logger.warning("sequence classification with inputs_embeds cannot see padding: each row is read at its last "
                       "position; pass input_ids to read each row at its last non-padding token")
        return -1
    non_pad = (input_ids != pad_token_id).to(device, torch.int32)
    positions = torch.arange(input_ids.shape[-1], device=device, dtype=torch.int32)
    return (positions * non_pad).argmax(-1)


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The pooled logits' (batch, num_labels) loss for config's problem_type, inferred and recorded in the config
    on first use when it is unset (module doc), as transformers does."""
    count = logits.shape[-1]
    extra = config.extra
    if extra.get("problem_type") is None:
        if count == 1:
            extra["problem_type"] = "regression"
        elif labels.dtype in (torch.long, torch.int):
            extra["problem_type"] = "single_label_classification"
        else:
            extra["problem_type"] = "multi_label_classification"
    kind = extra["problem_type"]
    labels = labels.to(logits.device)
    if kind == "regression":
        return F.mse_loss(logits.squeeze(), labels.squeeze()) if count == 1 else F.mse_loss(logits, labels)
    if kind == "single_label_classification":
        return F.cross_entropy(logits.view(-1, count), labels.view(-1), ignore_index=-100)
    if kind == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels)
    raise ValueError(f"problem_type {kind!r} is not one of: {', '.join(PROBLEM_TYPES)}")
