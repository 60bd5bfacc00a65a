"""OpenAI's gpt-oss: the llama decoder with a mixture of experts in every layer, attention sinks and biases.

    attention: q/k/v/o with biases; per head a learned sink logit joins each query's row of scores before the
               softmax and is dropped after it (the row's weights then sum to less than 1):
                   weights = softmax([q k^T * scale + mask, sink_h])[..., :-1]
               sliding-window (sliding_window, 128) and full layers alternate (layer_types, sliding first);
               rope is YaRN (factor 32 over 4096 positions, truncate=False) by default
    mlp:       router: logits = x @ W^T + b; the top num_experts_per_tok logits, softmax over those alone (in
               the logits' dtype, as transformers)
               experts: fused tensors, x @ W (not W^T), gate and up interleaved in the columns of gate_up_proj:
                   gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]        (tokens, 2 * intermediate)
                   gate = min(gate_up[:, 0::2], limit); up = clamp(gate_up[:, 1::2], -limit, limit)
                   out  = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_proj[e] + down_proj_bias[e]
               alpha = swiglu_alpha (1.702), limit = swiglu_limit (7.0)
    norms:     RMSNorm, as llama's

Checkpoints: transformers' save_pretrained writes the experts as model.layers.{i}.mlp.experts.gate_up_proj
(experts, hidden, 2 * intermediate), gate_up_proj_bias, down_proj (experts, intermediate, hidden), down_proj_bias;
the router as mlp.router.weight / bias; the sinks as self_attn.sinks (heads,). The Hub's releases (openai/gpt-oss-*)
store the two expert matrices in MXFP4 instead (config.json quantization_config {"quant_method": "mxfp4"}):

    {proj}_blocks  uint8 (experts, rows, cols / 32, 16)   two E2M1 codes a byte, low nibble first
    {proj}_scales  uint8 (experts, rows, cols / 32)       E8M0: the block of 32 values is scaled by 2^(s - 127)

with (rows, cols) the transposed matrix: (2 * intermediate, hidden) for gate_up_proj, (hidden, intermediate) for
down_proj. Such a checkpoint loads into uint8 buffers under those names; then, as quantization/mxfp4.py's table says
(Mxfp4Config, and by default the device), they stay packed and each expert runs through mxfp4_linear, or they are
dequantized once (GptOssExperts.unpack) into the dtype the rest of the model loaded in, one expert at a time, and the
model is an ordinary one that saves unquantized, as transformers' Mxfp4Config(dequantize=True) does. A model keeping
them packed saves them packed. Only the experts may be packed (transformers' rule too): a quantization_config that
keeps experts unquantized is refused.

Backends: sinks need a place between the scores and the softmax, so "sdpa" hands every call to "eager" (as for
Gemma 2's soft-cap), the engine's paged backends compute them with eager (engine/paged_attention.py), and
flash_attention_2/3, flex_attention and triton, which would drop them, are refused by name. transformers computes the
sink softmax in the model dtype; eager here computes it in float32, so bfloat16 logits differ in rounding only.
use_kernels=True: RMSNorm, the fused residual add and rotary are llama's and take their kernels; the router and
experts carry no kernel_layer_name, so the SwiGLU and fused-MoE kernels (silu(gate) * up) never replace the clamped
variant. tp_plan="auto" is refused: no plan splits the fused experts or the per-head sinks yet.

Offers: GptOssConfig, GptOssRouter, GptOssExperts, GptOssMLP, GptOssAttention, GptOssDecoderLayer, GptOssForCausalLM
(and dequantize_mxfp4, quantization/mxfp4.py's).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.moe import TopKRouter
from gpuformers.models.config import ModelConfig
from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer
from gpuformers.models.qwen3_moe import Qwen3MoeForCausalLM
from gpuformers.kernels.packed_formats import dequantize_mxfp4
from gpuformers.quantization.mxfp4 import mxfp4_linear

# transformers' rope for gpt-oss when config.json names none (GptOssConfig.__post_init__)
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_ATTENTION_BACKENDS = ("eager", "sdpa", "paged|eager", "paged|sdpa")  # those that apply the sinks


@dataclass
class GptOssConfig(ModelConfig):
    """gpt-oss's defaults (transformers' GptOssConfig), its MoE and SwiGLU fields, sliding and full layers
    alternating, YaRN rope by default, and an MXFP4 quantization_config turned into `mxfp4_experts`."""

    family_defaults = {"gpt_oss": {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
                                   "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
                                   "head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131072,
                                   "rms_norm_eps": 1e-5, "attention_bias": True, "rope_theta": 150000.0}}
    absent_fields = ("use_sliding_window", "max_window_layers", "mlp_bias")

    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False

    @property
    def num_experts(self) -> int:
        """num_local_experts, under the name the MoE forward shared with Qwen3-MoE reads."""
        return self.num_local_experts

    @classmethod
    def _prepare_dict(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = super()._prepare_dict(data)
        if not data.get("rope_parameters") and not data.get("rope_scaling"):
            data["rope_parameters"] = dict(_DEFAULT_ROPE)
        data.pop("num_experts", None)  # not GptOssConfig's: num_local_experts counts the experts
        quantization = data.get("quantization_config")
        if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4":
            # The experts are built packed; quantization/config.py's pipeline then keeps or dequantizes them.
            kept = [name for name in quantization.get("modules_to_not_convert") or []
                    if fnmatch.fnmatch("model.layers.0.mlp.experts", name) or "experts" in name]
            if kept:
                raise NotImplementedError(f"an MXFP4 gpt-oss checkpoint whose experts are partly unquantized "
                                          f"(modules_to_not_convert {kept}) is not supported; every layer's experts "
                                          f"must be stored as *_blocks / *_scales")
            # Our own flag, not a config.json field: derived from quantization_config, dropped by to_dict and by
            # quantization/mxfp4.py when the experts are dequantized, so it stays a key of `extra`.
            data["mxfp4_experts"] = True
        return data

    def _fill_layer_types(self) -> None:
        if self.layer_types is None:  # sliding first, then every other layer
            self.layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                for i in range(self.num_hidden_layers)]

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("mxfp4_experts", None)  # our own `extra` entry, when present
        return out


class GptOssRouter(TopKRouter):
    """TopKRouter with a bias, and the softmax over the chosen logits only (module doc); records its logits for
    the aux loss as TopKRouter does."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__(hidden_size, num_experts, top_k, norm_topk_prob=True)
        self.bias = nn.Parameter(torch.zeros(num_experts))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, hidden) -> router logits (tokens, experts), weights (tokens, top_k), expert ids (tokens, top_k)."""
        logits = F.linear(hidden_states, self.weight, self.bias)
        if self.recorded is not None:
            self.recorded.append(logits)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return logits, F.softmax(top, dim=-1, dtype=top.dtype), experts


class GptOssExperts(nn.Module):
    """All experts of a layer as fused tensors (module doc). With packed=True (an MXFP4 checkpoint) the two matrices
    are uint8 {proj}_blocks / {proj}_scales buffers until `unpack` turns them into the parameters."""

    syncs_host = True  # forward reads the routed experts on the host: no CUDA graph (engine/cuda_graphs.py)

    def __init__(self, config: ModelConfig, packed: bool = False):
        super().__init__()
        experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * inter))
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))
        # name -> the (experts, in, out) parameter's shape; packed, it is stored transposed, 32 values a block
        self._shapes = {"gate_up_proj": (experts, hidden, 2 * inter), "down_proj": (experts, inter, hidden)}
        for name, (_, fan_in, fan_out) in self._shapes.items():
            if not packed:
                setattr(self, name, nn.Parameter(torch.zeros(experts, fan_in, fan_out)))
                continue
            if fan_in % 32:
                raise ValueError(f"an MXFP4 {name} needs its input size ({fan_in}) to be a multiple of 32")
            self.register_buffer(f"{name}_blocks", torch.zeros(experts, fan_out, fan_in // 32, 16, dtype=torch.uint8))
            self.register_buffer(f"{name}_scales", torch.zeros(experts, fan_out, fan_in // 32, dtype=torch.uint8))

    @property
    def packed(self) -> bool:
        return "gate_up_proj_blocks" in self._buffers

    def unpack(self) -> None:
        """Dequantize the MXFP4 buffers into gate_up_proj / down_proj in the biases' dtype, on the buffers' device,
        one expert at a time (float32 temporaries of one expert's matrix)."""
        dtype = self.gate_up_proj_bias.dtype
        for name, shape in self._shapes.items():
            blocks, scales = self._buffers.pop(f"{name}_blocks"), self._buffers.pop(f"{name}_scales")
            weight = torch.empty(shape, dtype=dtype, device=blocks.device)
            for e in range(shape[0]):  # (out, in / 32, 16) -> (out, in) -> (in, out)
                weight[e] = dequantize_mxfp4(blocks[e], scales[e], dtype).T
            setattr(self, name, nn.Parameter(weight))

    def clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(tokens, 2 * intermediate), gate and up interleaved -> (tokens, intermediate)."""
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (tokens, hidden), the router's expert ids and weights (tokens, top_k) -> (tokens, hidden)."""
        out = torch.zeros_like(x)
        # Which experts got tokens (a host sync, as in transformers): only those run, in expert order.
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            y = self.down(self.clamped_swiglu(self.gate_up(x[token], e)), e)
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def gate_up(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's x (tokens, hidden) @ gate_up_proj[e] + its bias -> (tokens, 2 * intermediate)."""
        if self.packed:
            return mxfp4_linear(x, self.gate_up_proj_blocks[e], self.gate_up_proj_scales[e], self.gate_up_proj_bias[e])
        return x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]

    def down(self, h: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's h (tokens, intermediate) @ down_proj[e] + its bias -> (tokens, hidden)."""
        if self.packed:
            return mxfp4_linear(h, self.down_proj_blocks[e], self.down_proj_scales[e], self.down_proj_bias[e])
        return h @ self.down_proj[e] + self.down_proj_bias[e]

    def extra_repr(self) -> str:
        experts, hidden, inter2 = self._shapes["gate_up_proj"]
        return (f"experts={experts}, hidden={hidden}, intermediate={inter2 // 2}, alpha={self.alpha}, "
                f"limit={self.limit}, packed={self.packed}")


class GptOssMLP(nn.Module):
    """The sparse block, under transformers' names: mlp.router, mlp.experts. No kernel_layer_name (module doc)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.router = GptOssRouter(config.hidden_size, config.num_local_experts, config.num_experts_per_tok)
        self.experts = GptOssExperts(config, packed=bool(config.extra.get("mxfp4_experts")))  # GptOssConfig's flag

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, experts = self.router(x)
        return self.experts(x, experts, weights).view(shape)


class GptOssAttention(LlamaAttention):
    """Llama's attention (biases from attention_bias) with per-head sinks passed to the backend as `sinks`."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.sinks = nn.Parameter(torch.zeros(config.num_attention_heads))

    # The backend is stored as given and read with this layer's sinks bound, so LlamaAttention.forward passes them
    # without knowing about them (as Gemma 2's soft-cap).
    @property
    def attention_fn(self):
        return functools.partial(self._backend, sinks=self.sinks)

    @attention_fn.setter
    def attention_fn(self, fn):
        self._backend = fn


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.mlp = GptOssMLP(config)


class GptOssForCausalLM(Qwen3MoeForCausalLM):
    """Qwen3-MoE's forward (router logits, aux loss with output_router_logits) over gpt-oss's layers."""

    config_class = GptOssConfig
    decoder_layer_class = GptOssDecoderLayer
    tp_plan_auto = None
    checkpoint_fan_out = ()  # its experts are fused in the checkpoint and in the model alike

    def set_attn_implementation(self, name: str) -> None:
        """As PreTrainedModel's, refusing the backends that would drop the attention sinks."""
        if name not in _ATTENTION_BACKENDS:
            raise NotImplementedError(f"attn_implementation={name!r} does not apply gpt-oss's attention sinks; use "
                                      f"one of: {', '.join(_ATTENTION_BACKENDS[:2])} (sdpa runs eager for this model)")
        super().set_attn_implementation(name)
