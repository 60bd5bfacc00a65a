"""Qwen3-MoE = Qwen3 with a sparse mixture-of-experts block (layers/moe.py) in place of the MLP of most layers.

A layer is sparse when num_experts > 0, (layer_idx + 1) % decoder_sparse_step == 0 and it is not in mlp_only_layers
(transformers' rule); the others keep a dense GatedMLP of intermediate_size. The MoE fields come from config.json
(ModelConfig.extra, with transformers' defaults). The router's load-balancing loss (output_router_logits=True) is not
added to the training loss yet: a labelled forward with it set raises NotImplementedError.

Offers: Qwen3MoeDecoderLayer, Qwen3MoeForCausalLM.
"""

from __future__ import annotations

from gpuformers.layers.moe import SparseMoeBlock
from gpuformers.models.config import ModelConfig
from gpuformers.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
from gpuformers.models.llama import LlamaDecoderLayer


def is_sparse_layer(config: ModelConfig, layer_idx: int) -> bool:
    extra = config.extra
    return (layer_idx not in extra["mlp_only_layers"] and extra["num_experts"] > 0
            and (layer_idx + 1) % extra["decoder_sparse_step"] == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if is_sparse_layer(config, layer_idx):
            extra = config.extra
            self.mlp = SparseMoeBlock(config.hidden_size, extra["moe_intermediate_size"], extra["num_experts"],
                                      extra["num_experts_per_tok"], extra["norm_topk_prob"])


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    decoder_layer_class = Qwen3MoeDecoderLayer
    no_split_modules = ("Qwen3MoeDecoderLayer",)

    def forward(self, *args, labels=None, **kwargs):
        if labels is not None and self.config.extra.get("output_router_logits"):
            raise NotImplementedError("output_router_logits=True (the router's load-balancing loss in training) is "
                                      "not supported yet; set it to False in the config to train without it")
        return super().forward(*args, labels=labels, **kwargs)
