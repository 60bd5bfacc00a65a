"""Token embeddings of a causal LM: resizing them (new tokens), and the accessors transformers offers around them.

resize_token_embeddings follows transformers' PreTrainedModel step for step, random draws included: the new
weights are built as transformers builds them (an nn.Embedding / nn.Linear of the new size, whose constructor
draws its own init, then the added rows drawn again), so under the same seed the added rows are transformers' own.

    embed_tokens (old, dim) --> new rows at the end (or rows cut from the end) --> embed_tokens (new, dim)
    lm_head      (old, dim) --> the same, drawn separately; a tied head keeps sharing the new embedding Parameter

The modules stay the same objects (their hooks -- device_map placement, a user's -- keep working); their weights
become new Parameters with the old requires_grad.

Offers: TokenEmbeddingsMixin.
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.distributions import constraints
from torch.distributions.multivariate_normal import MultivariateNormal

# transformers samples the added rows from N(mean, _COVARIANCE_SCALE * covariance) of the old rows: in effect
# the mean, with a spread far below the rows' own (https://nlp.stanford.edu/~johnhew/vocab-expansion.html).
_COVARIANCE_SCALE = 1e-9


class TokenEmbeddingsMixin:
    """transformers' token-embedding API for PreTrainedModel: get/set the input and output embeddings,
    resize_token_embeddings, and enable/disable_input_require_grads."""

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head (`lm_head`), or None for a model without one (transformers' default)."""
        return getattr(self, "lm_head", None)

    def set_input_embeddings(self, value: nn.Module) -> None:
        """Put `value` where get_input_embeddings() finds the embedding (a tied LM head is not re-tied, as in
        transformers: call tie_weights() for that)."""
        self._replace_submodule(self.get_input_embeddings(), value, "input")

    def set_output_embeddings(self, value: nn.Module) -> None:
        """Put `value` where get_output_embeddings() finds the LM head."""
        head = self.get_output_embeddings()
        if head is None:
            raise AttributeError(f"{type(self).__name__} has no output embeddings (get_output_embeddings() is None) "
                                 "to replace")
        self._replace_submodule(head, value, "output")

    def _replace_submodule(self, old: nn.Module, new: nn.Module, kind: str) -> None:
        name = self._submodule_name(old)
        if not name:
            raise AttributeError(f"the {kind} embeddings of {type(self).__name__} are not one of its submodules")
        parent, _, attr = name.rpartition(".")
        setattr(self.get_submodule(parent), attr, new)

    def _submodule_name(self, module: nn.Module) -> str | None:
        return next((name for name, m in self.named_modules() if m is module), None)

    # --- resizing -------------------------------------------------------------------------------------------

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """Give the input embeddings and the LM head `new_num_tokens` rows (rounded up to a multiple of
        `pad_to_multiple_of`; that alone pads the current size) and set config.vocab_size; returns the input
        embedding module. Rows of kept tokens are unchanged; added rows are, with mean_resizing, the old rows' mean
        (sampled with transformers' 1e-9-scaled covariance), else drawn from N(0, config.initializer_range).
        Shrinking drops rows from the end. Both None: nothing changes.

        Refused where the weights cannot be rewritten here: a tensor-parallel or FSDP2-sharded model, a quantized
        (or LoRA-wrapped) embedding or LM head, a weight offloaded to disk by device_map."""
        embeddings = self.get_input_embeddings()
        if new_num_tokens is None and pad_to_multiple_of is None:
            return embeddings
        head = self.get_output_embeddings()
        self._check_resizable(embeddings, head)
        old_num_tokens = embeddings.weight.shape[0]
        new_num_tokens = _target_num_tokens(old_num_tokens, new_num_tokens, pad_to_multiple_of)
        tied = head is not None and head.weight is embeddings.weight
        std = self.config.initializer_range
        with torch.no_grad():
            if new_num_tokens != old_num_tokens:
                _resize_embedding(embeddings, new_num_tokens, mean_resizing, std)
            if tied:
                head.weight = embeddings.weight
                head.out_features = new_num_tokens
            elif head is not None and head.weight.shape[0] != new_num_tokens:
                _resize_head(head, new_num_tokens, mean_resizing, std)
        self.config.vocab_size = new_num_tokens
        return embeddings

    def _check_resizable(self, embeddings: nn.Module, head: nn.Module | None) -> None:
        from gpuformers.tensor_parallel import is_tensor_parallel

        if is_tensor_parallel(self):
            raise RuntimeError("resize_token_embeddings on a tensor-parallel model: its weights are split over the "
                               "processes; resize the model before apply_tensor_parallel (or resize, "
                               "save_pretrained, and load the saved folder with tp_plan)")
        named = {"input embeddings": (embeddings, nn.Embedding)}
        if head is not None:
            named["output embeddings (LM head)"] = (head, nn.Linear)
        for kind, (module, plain) in named.items():
            name = self._submodule_name(module)
            weight = getattr(module, "weight", None)
            if _is_dtensor(weight):
                raise RuntimeError(f"resize_token_embeddings: {name}.weight is sharded over processes (a DTensor: "
                                   "FSDP2 or tensor parallelism); resize the model before sharding it")
            if type(module) is not plain or type(weight) is not nn.Parameter or not weight.is_floating_point():
                raise TypeError(
                    f"resize_token_embeddings: the {kind} {name!r} are a {type(module).__name__} (weight "
                    f"{type(weight).__name__}), not a plain {plain.__name__}: a quantized or LoRA-wrapped layer "
                    "cannot be resized; resize the full-precision model first, then quantize or add adapters "
                    "(quantized loading keeps lm_head in full precision by default)")
            if getattr(module, "bias", None) is not None:
                raise NotImplementedError(f"resize_token_embeddings: {name} has a bias, which no model here has and "
                                          "resizing does not handle")
            if weight.is_meta:
                raise RuntimeError(f"resize_token_embeddings: {name}.weight is on the meta device (offloaded to disk "
                                   "by device_map, or never loaded); load the model with that module on a CPU or GPU "
                                   "(device_map entry 'cpu' or a GPU index) to resize it")

    # --- gradients through frozen embeddings ------------------------------------------------------------------

    def enable_input_require_grads(self) -> None:
        """Make the input embeddings' output require grad (a forward hook), so that with frozen embeddings the
        gradient still reaches the trainable layers after them under reentrant gradient checkpointing (which
        only backpropagates through a checkpointed layer whose inputs require grad): what transformers and peft
        use for adapters. Calling it again keeps one hook."""
        self.disable_input_require_grads()
        hook = self.get_input_embeddings().register_forward_hook(_output_requires_grad)
        self._require_grads_hooks = [hook]
        self._require_grads_hook = hook  # transformers' older single-hook attribute, which peft reads

    def disable_input_require_grads(self) -> None:
        """Remove the hook of enable_input_require_grads (or of prepare_model_for_kbit_training)."""
        hooks = list(getattr(self, "_require_grads_hooks", []))
        single = self.__dict__.pop("_require_grads_hook", None)
        if single is not None and single not in hooks:
            hooks.append(single)
        for hook in hooks:
            hook.remove()
        self._require_grads_hooks = []


def _output_requires_grad(module: nn.Module, inputs, output: torch.Tensor) -> None:
    output.requires_grad_(True)


def _is_dtensor(tensor) -> bool:
    if tensor is None or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _target_num_tokens(old_num_tokens: int, new_num_tokens, pad_to_multiple_of) -> int:
    """new_num_tokens (default: the current size) rounded up to a multiple of pad_to_multiple_of."""
    size = old_num_tokens if new_num_tokens is None else _positive_int(
        "new_num_tokens", new_num_tokens, "the new vocabulary size")
    if pad_to_multiple_of is None:
        return size
    multiple = _positive_int("pad_to_multiple_of", pad_to_multiple_of,
                             "e.g. 64, so that the vocabulary dimension suits tensor cores; or None")
    return -(-size // multiple) * multiple


def _positive_int(name: str, value, meaning: str) -> int:
    try:
        number = operator.index(value)  # int, numpy or 0-d torch integers; not floats
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int ({meaning})")
    return number


def _resize_embedding(embeddings: nn.Embedding, new_num_tokens: int, mean_resizing: bool, std: float) -> None:
    old = embeddings.weight
    # Built as transformers builds it: the constructor's N(0, 1) draw, then the added rows drawn again.
    new = nn.Embedding(new_num_tokens, old.shape[1], device=old.device, dtype=old.dtype).weight
    embeddings.weight = _fill_resized(new, old, mean_resizing, std)
    embeddings.num_embeddings = new_num_tokens
    if embeddings.padding_idx is not None and embeddings.padding_idx >= new_num_tokens:
        embeddings.padding_idx = None  # the padding row was cut off


def _resize_head(head: nn.Linear, new_num_tokens: int, mean_resizing: bool, std: float) -> None:
    old = head.weight
    # Built as transformers builds it: the constructor's kaiming draw, then the added rows drawn again.
    new = nn.Linear(old.shape[1], new_num_tokens, bias=False, device=old.device, dtype=old.dtype).weight
    head.weight = _fill_resized(new, old, mean_resizing, std)
    head.out_features = new_num_tokens


def _fill_resized(new: nn.Parameter, old: torch.Tensor, mean_resizing: bool, std: float) -> nn.Parameter:
    """`new` (new tokens, dim), as its module's constructor drew it, with the added rows drawn again
    (transformers' way) and the old rows copied in; it requires grad as `old` did."""
    old_num_tokens, new_num_tokens = old.shape[0], new.shape[0]
    if new_num_tokens > old_num_tokens:
        if mean_resizing:
            new[old_num_tokens:] = _rows_around_mean(old, new_num_tokens - old_num_tokens)
        else:
            nn.init.normal_(new, std=std)
    keep = min(old_num_tokens, new_num_tokens)
    new[:keep] = old[:keep]
    return new.requires_grad_(old.requires_grad)


def _rows_around_mean(weight: torch.Tensor, count: int) -> torch.Tensor:
    """`count` rows (count, dim) drawn from N(mean, 1e-9 * covariance) of `weight`'s rows, computed in float32;
    the mean repeated when that covariance is not positive definite (fewer rows than dim, or float32 underflow)."""
    rows = weight.float()
    mean = rows.mean(dim=0)
    centered = rows - mean
    covariance = _COVARIANCE_SCALE * (centered.T @ centered / rows.shape[0])  # (dim, dim)
    if constraints.positive_definite.check(covariance).all():
        sampled = MultivariateNormal(mean, covariance_matrix=covariance).sample((count,))
    else:
        sampled = mean[None].expand(count, -1)
    return sampled.to(weight.dtype)
