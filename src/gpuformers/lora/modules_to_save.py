"""peft's modules_to_save: modules trained whole (a frozen original plus a trainable copy) beside the LoRA layers,
and which modules an adapter's modules_to_save entries select, tied embeddings included.

Offers: ModulesToSaveWrapper, in_modules_to_save, find_modules_to_save, check_tied_modules, peft_names.
"""

from __future__ import annotations

import copy
import re
import warnings

from torch import nn

from gpuformers.lora.config import EMBEDDING_LAYER_NAMES, LoraConfig


class ModulesToSaveWrapper(nn.Module):
    """peft's modules_to_save: the model's module, frozen, as `original_module`, and a trainable full copy of it as
    `modules_to_save`, which the forward uses (the original again inside disable_adapter()).

        x ──> modules_to_save (trainable copy) ──> y          original_module (frozen, unchanged)

    The copy is what is saved, under the module's own name (`base_model.model.lm_head.weight`), and what
    merge_and_unload() and unload() leave in the model. Attributes the wrapper lacks (`weight`, `num_embeddings`)
    are read from the module the forward uses. `tied_to` (ensure_weight_tying on a tied model): the copy uses that
    module's weight (the embedding's copy) instead of a weight of its own, so the two stay one tensor."""

    def __init__(self, original_module: nn.Module, tied_to: nn.Module | None = None):
        super().__init__()
        self.original_module = original_module
        # the memo hands the copy the tied weight itself instead of copying the original's (vocab, hidden) weight
        memo = {} if tied_to is None else {id(original_module.weight): tied_to.weight}
        self.modules_to_save = copy.deepcopy(original_module, memo)
        self.disabled = False

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("original_module", "modules_to_save", "disabled"):  # not set yet: __init__ is running
                raise
            return getattr(self.original_module if self.disabled else self.modules_to_save, name)

    def forward(self, *args, **kwargs):
        return (self.original_module if self.disabled else self.modules_to_save)(*args, **kwargs)


def peft_names(model: nn.Module, name: str) -> tuple[str, ...]:
    """The names a config's module names are matched against: the module's name in transformers' model (the one
    peft sees, so adapter configs written over transformers select the same modules), then ours. They differ for a
    family whose modules are named otherwise here (its `checkpoint_key`: GPT-NeoX's model.layers.0.self_attn.dense
    is gpt_neox.layers.0.attention.dense, lm_head is embed_out)."""
    rename = getattr(model, "checkpoint_key", None)
    if rename is None or not name:
        return (name,)
    hub = rename(f"{name}.weight").removesuffix(".weight")  # checkpoint_key renames parameter names
    return (name,) if hub == name else (hub, name)


def in_modules_to_save(name: str, config: LoraConfig) -> bool:
    """peft's rule (check_target_module_exists): no LoRA on a modules_to_save module or anything inside it. The
    entries are regular expressions there, as here."""
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in config.modules_to_save or [])


def find_modules_to_save(model: nn.Module, entries: list[str], lora_names: list[str], strict: bool,
                         optional: tuple[str, ...] = ()) -> list[str]:
    """The modules `entries` select, by peft's rule for modules_to_save (utils.other._set_trainable): a module
    whose full name ends with an entry, as text ("embed_tokens" selects model.embed_tokens). With `strict`, an entry
    that selects nothing is an error, unless it is one of `optional`."""
    names, matched = [], set()
    for key, module in model.named_modules(remove_duplicate=False):
        hits = {e for e in entries if key and any(n.endswith(e) for n in peft_names(model, key))}
        if not hits or key in names:
            continue
        matched |= hits
        inside = [n for n in names if key.startswith(n + ".")]
        if inside:
            raise NotImplementedError(f"modules_to_save selects {key} inside {inside[0]}, which it also selects; "
                                      f"nested modules_to_save are not supported: name only the outer module")
        if key in lora_names:
            raise ValueError(f"{key} is both a LoRA target and in modules_to_save={entries!r}; a module is either "
                             f"trained fully (modules_to_save) or with LoRA (target_modules): drop it from one")
        if isinstance(module, (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)):
            raise TypeError(f"modules_to_save cannot be applied to {key} ({type(module).__name__}), a container "
                            f"with no forward; name the modules inside it")
        names.append(key)
    unmatched = [e for e in entries if e not in matched and e not in optional]
    if strict and unmatched:
        raise ValueError(f"modules_to_save entry {', '.join(map(repr, unmatched))} matches no module of "
                         f"{type(model).__name__} (e.g. \"lm_head\", \"embed_tokens\"); check the name")
    return names


def _module_names_tied_with_embedding(model: nn.Module) -> list[str]:
    """The modules whose weight is the input embeddings' (peft's _get_module_names_tied_with_embedding), from the
    model's tied_weights ({"lm_head.weight": "model.embed_tokens.weight"} when tie_word_embeddings is set)."""
    tied = getattr(model, "tied_weights", None) or {}
    getter = getattr(model, "get_input_embeddings", None)
    if not tied or not callable(getter):
        return []
    embedding = getter()
    embedding_names = {n for n, m in model.named_modules() if m is embedding}
    return sorted({target.rpartition(".")[0] for target, source in tied.items()
                   if source.rpartition(".")[0] in embedding_names})


def check_tied_modules(model: nn.Module, config: LoraConfig) -> tuple[list[str], list[str]]:
    """peft 0.21's handling of a tied embedding and LM head (BaseTuner._check_tied_modules,
    LoraModel._add_modules_to_save_to_tie and _add_targets_to_tie); returns (the modules to tie to the embedding's
    trainable copy, the modules to tie to the embedding's LoRA layer).

    Without ensure_weight_tying (peft's default), an embedding layer in modules_to_save or target_modules of a tied
    model gets a warning, and each modules_to_save entry its own copy (or each target its own LoRA): the trained
    embedding and head diverge. With it, the embedding is put in modules_to_save, or else in target_modules (its full
    name appended, as peft writes it in the config; a regular expression gets `|^<name>$`), the tied modules are
    taken out, and they use the embedding's copy (or its LoRA, embedding.py's TiedLoraLinear)."""
    to_save = config.modules_to_save or []
    embedding_to_save = any(m.split(".")[-1] in EMBEDDING_LAYER_NAMES for m in to_save)
    targets = config.target_modules
    if isinstance(targets, str):
        embedding_in_target = any(re.fullmatch(targets, m) for m in EMBEDDING_LAYER_NAMES)
    else:
        embedding_in_target = any(t.split(".")[-1] in EMBEDDING_LAYER_NAMES for t in targets or [])
    tied = _module_names_tied_with_embedding(model)
    if not config.ensure_weight_tying:
        if tied and (embedding_to_save or embedding_in_target):
            warnings.warn("the model ties its embeddings and LM head (tie_word_embeddings=True) and the adapter "
                          "trains a tied layer, without ensure_weight_tying=True: each gets its own trained copy, "
                          "so the two drift apart (merging or saving the model then unties them); set "
                          "ensure_weight_tying=True in LoraConfig to train one shared copy")
        return [], []
    if not tied:
        warnings.warn("ensure_weight_tying=True, but this model ties no module to its input embeddings: the "
                      "setting changes nothing")
        return [], []
    embedding = model.get_input_embeddings()
    embedding_name = next(n for n, m in model.named_modules() if m is embedding)
    if embedding_to_save:
        if embedding_name not in to_save:
            to_save.append(embedding_name)
        for key in tied:  # the tied modules come from the embedding's copy, not from an entry of their own
            for m in to_save:
                if re.match(rf"(^|.*\.){m}($|\..*)", key):
                    to_save.remove(m)
                    break
        config.modules_to_save = to_save
        return tied, []
    if embedding_in_target:
        if isinstance(targets, str):
            config.target_modules = rf"(?:{targets}|^{re.escape(embedding_name)}$)"
        else:
            targets = {*targets, embedding_name}
            for key in tied:  # peft removes the first entry that selects each tied module
                for t in sorted(targets):
                    if re.match(rf"(^|.*\.){t}($|\..*)", key):
                        targets.remove(t)
                        break
            config.target_modules = sorted(targets)
        return [], tied
    warnings.warn("ensure_weight_tying=True, but neither modules_to_save nor target_modules names a tied layer "
                  "(the embedding or the LM head): the setting changes nothing")
    return [], []
