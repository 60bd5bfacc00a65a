"""Qwen3-MoE = Qwen3 with a sparse mixture-of-experts block (layers/moe.py) in place of the MLP of most layers.

A layer is sparse when num_experts > 0, (layer_idx + 1) % decoder_sparse_step == 0 and it is not in mlp_only_layers
(transformers' rule); the others keep a dense GatedMLP of intermediate_size. The MoE fields come from config.json
(Qwen3MoeConfig's fields, with transformers' defaults).

With output_router_logits=True (config.json or a forward argument) the forward also returns `router_logits` (one
(batch * seq, experts) tensor per sparse layer, recorded by the routers during that forward only) and `aux_loss`,
the Switch-Transformer load-balancing loss over them (padding excluded via attention_mask), and a labelled forward's
loss is LM loss + router_aux_loss_coef * aux_loss, as in transformers; the chunked LM-head loss of the Trainer
included. Forwards without it (inference, generate's cached steps, the engine) record nothing.

Checkpoints: the experts load from the Hub's per-expert keys (mlp.experts.{e}.{gate,up,down}_proj.weight) or from
transformers' fused ones (mlp.experts.gate_up_proj, mlp.experts.down_proj: what its save_pretrained writes with
save_original_format=False, offloaded or with an adapter), cut into our per-expert Linears as they stream in
(`checkpoint_fan_out`, loading/fan_out.py); Qwen2-MoE, OLMoE and Mixtral inherit this.

Offers: Qwen3MoeConfig, Qwen3MoeDecoderLayer, Qwen3MoeForCausalLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gpuformers.generation.cache import Cache
from gpuformers.layers.moe import SparseMoeBlock, TopKRouter, load_balancing_loss
from gpuformers.loading.fan_out import fused_experts
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaDecoderLayer
from gpuformers.outputs import MoeCausalLMOutput
from gpuformers.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM


@dataclass
class Qwen3MoeConfig(ModelConfig):
    """Qwen3's config (q/k norm, its sliding-window rule) with the MoE fields; head_dim defaults to hidden_size /
    heads."""

    family_defaults = {"qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4}}

    num_experts: int = 128  # 0: every layer dense
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768  # each expert's; intermediate_size is the dense layers'
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum 1
    decoder_sparse_step: int = 1  # every n-th layer is sparse
    mlp_only_layers: list[int] = field(default_factory=list)  # layer indices kept dense
    output_router_logits: bool = False  # the forward's default: router logits and the aux loss
    router_aux_loss_coef: float = 0.001

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        if "num_local_experts" in data:  # transformers 5 writes num_experts under this name
            data.setdefault("num_experts", data["num_local_experts"])
        return super()._prepare_dict(data)


def is_sparse_layer(config: ModelConfig, layer_idx: int) -> bool:
    """transformers' rule (module doc), over a Qwen3-MoE or Qwen2-MoE config."""
    return (layer_idx not in config.mlp_only_layers and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if is_sparse_layer(config, layer_idx):
            self.mlp = SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                      config.num_experts_per_tok, config.norm_topk_prob)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    config_class = Qwen3MoeConfig
    decoder_layer_class = Qwen3MoeDecoderLayer
    checkpoint_fan_out = fused_experts()  # transformers' fused experts -> mlp.experts.{e}.*_proj (module doc)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        output_hidden_states: bool = False,
        cache_position: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> MoeCausalLMOutput:
        """LlamaForCausalLM.forward, and with output_router_logits the routers' logits and load-balancing loss:
        MoeCausalLMOutput(loss = LM loss + router_aux_loss_coef * aux_loss, aux_loss, logits, ..., router_logits).

        output_router_logits=None takes the config's value, except on a forward given a KV cache (generate's
        prefill and decode steps), which records nothing unless asked. The LM loss alone is divided by
        num_items_in_batch, as in transformers."""
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits and past_key_values is None
        args = (input_ids, attention_mask, position_ids, past_key_values, use_cache, labels, inputs_embeds,
                logits_to_keep, num_items_in_batch, output_hidden_states, cache_position)
        if not output_router_logits:
            out = super().forward(*args, **kwargs)
            return MoeCausalLMOutput(loss=out.loss, logits=out.logits, past_key_values=out.past_key_values,
                                     hidden_states=out.hidden_states)
        routers = [module for module in self.modules() if isinstance(module, TopKRouter)]
        router_logits: list[torch.Tensor] = []  # one (batch * seq, experts) per sparse layer, in layer order
        for router in routers:
            router.recorded = router_logits
        try:
            out = super().forward(*args, **kwargs)
        finally:  # also after an error: the next forward (generate, the engine) must not record
            for router in routers:
                router.recorded = None
        seq = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        routed_mask = attention_mask[:, -seq:] if attention_mask is not None else None  # the new tokens' columns
        # num_experts, num_experts_per_tok, router_aux_loss_coef: every MoE family's config has them (Mixtral's and
        # gpt-oss's num_experts reads their num_local_experts)
        config = self.config
        aux_loss = load_balancing_loss(router_logits, config.num_experts, config.num_experts_per_tok, routed_mask)
        loss = out.loss
        if loss is not None:
            loss = loss + config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutput(loss=loss, aux_loss=aux_loss, logits=out.logits, past_key_values=out.past_key_values,
                                 hidden_states=out.hidden_states, router_logits=tuple(router_logits))
