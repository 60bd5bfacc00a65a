"""DecodeStep: the llama-family decoder stack for one new token per row, as a flat list of the calls its modules
make, so that generate()'s decode steps skip the module walk.

At batch 1 on the CPU a decode step of a small model is mostly Python: each of the ~14 module calls per layer
asks which submodules to call (plain_calls), checks its fast path (the CPU norm, the joint q/k norm, the sibling
matmul) and builds the same small tensors again (q/k norm weights). Inside a generate() call none of that changes
(keep_plain_calls: hooks, kernels and forwards are taken as they were at the call's first step), so the step asks
once, at its first decode step, and keeps the answers as one tuple per layer:

    x -> [norm -> q/k/v (one matmul) -> q/k norm + rotary -> cache -> attention -> o -> + x
           -> norm -> gate/up (one matmul) -> silu * -> down -> +] x N -> norm

Every call is the one the modules make, with the same arguments in the same order, so the hidden states are the
same bits (the tests compare them with torch.equal). It applies only where that is so:
- every layer runs the llama decoder layer's and attention's forwards (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
  SmolLM3, gpt-oss, GLM, Ministral 3, ERNIE 4.5); the norms, the MLP or MoE block and position_qk may be the
  family's own;
- no layer, norm, attention or MLP is hooked or has its forward replaced (use_kernels, gradient checkpointing,
  device_map's hooks), and no use_kernels function is in force; a hooked projection or q/k norm is still called
  as a module, so its hook runs;
- autograd is off and each row has one new token. Padding and sliding windows are the masks attention gets, as
  from the modules; a static cache of fixed shape is the compiled path, not this one.
Anything else, and any call outside generate(), runs the modules as before. Measured: batch-1 decode of the tiny
Qwen3 shape 1.85x -> 2.12x transformers on development CPU C (BENCHMARKS.md).

Offers: DecodeStep, decode_step_for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.kernels.mapping import in_kernelized_forward
from gpuformers.kernels.cpu_linear import sibling_outputs
from gpuformers.layers.mlp import GatedMLP
from gpuformers.models.modeling import kept_answer, plain_calls


class _Layer:
    """One decoder layer's calls: what its modules' forwards would call, found once."""

    __slots__ = ("attn", "index", "head_dim", "scaling", "dropout", "window", "input_norm", "post_norm", "qkv",
                 "position_qk", "qk_norm", "qk_weight", "attention", "o_proj", "mlp", "gate_up", "down_proj")


def _siblings(module: nn.Module, names: tuple[str, ...]):
    """x -> the outputs of module's sibling linears `names` for x: one matmul when they share a copy
    (kernels/cpu_linear.py), else the calls the module would make."""
    calls = plain_calls(module, *names)
    shared = sibling_outputs(calls)
    if shared is not None:
        return shared
    return lambda x: tuple(call(x) for call in calls)


def _own_forwards(parent: nn.Module, *names: str) -> list | None:
    """plain_calls' answers for `names` when each is its module's class forward (no hook, no forward replaced on
    the instance by use_kernels, checkpointing or a wrapper), else None."""
    calls = plain_calls(parent, *names)
    for call, name in zip(calls, names):
        module = parent._modules[name]
        if getattr(call, "__self__", None) is not module or call.__func__ is not type(module).forward:
            return None
    return calls


def _layer(layer: nn.Module) -> _Layer | None:
    """The calls of one decoder layer, or None where the flat step would not make the same ones: the layer's and
    its attention's forward (and attend) must be the llama ones (the flat step is their body); the norms, the MLP
    (a MoE block, say) and the attention's position_qk may be any family's."""
    from gpuformers.models.llama import LlamaAttention, LlamaDecoderLayer
    from gpuformers.models.qwen3 import Qwen3Attention, joint_norm_applies

    names = ("input_layernorm", "self_attn", "mlp", "post_attention_layernorm")
    if type(layer).forward is not LlamaDecoderLayer.forward or any(name not in layer._modules for name in names):
        return None
    attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
    calls = _own_forwards(layer, *names)
    if type(attn).forward is not LlamaAttention.forward or type(attn).attend is not LlamaAttention.attend \
            or calls is None:
        return None
    step = _Layer()
    step.attn, step.index, step.head_dim = attn, attn.layer_idx, attn.head_dim
    step.scaling, step.dropout, step.window = attn.scaling, attn.attention_dropout, attn.sliding_window
    step.input_norm, step.post_norm = calls[0], calls[3]
    step.qkv = _siblings(attn, ("q_proj", "k_proj", "v_proj"))
    (step.o_proj,) = plain_calls(attn, "o_proj")
    step.attention = attn.attention_fn
    step.position_qk = attn.position_qk
    step.mlp, step.gate_up, step.down_proj = calls[2], None, None
    if type(mlp) is GatedMLP:  # GatedMLP.forward's calls, gate and up from one matmul
        step.gate_up = _siblings(mlp, ("gate_proj", "up_proj"))
        (step.down_proj,) = plain_calls(mlp, "down_proj")
    step.qk_norm = None  # (q_norm, k_norm) where Qwen3's joint q/k norm applies to float32 CPU inputs
    step.qk_weight = None  # their weight for every head, made at the first step (joint_norm_weight)
    if type(attn).position_qk is Qwen3Attention.position_qk:
        q_norm, k_norm = plain_calls(attn, "q_norm", "k_norm")
        if hasattr(q_norm, "__self__"):
            like = torch.empty(1, 1, 1, attn.head_dim, dtype=torch.float32, device=q_norm.__self__.weight.device)
            if joint_norm_applies(q_norm, k_norm, like, like):
                step.qk_norm = (q_norm.__self__, k_norm.__self__)
    return step


class DecodeStep:
    """The decoder stack of a LlamaModel for (batch, 1, hidden) inputs: the calls its modules make, found once. See
    the module docstring for when it applies."""

    def __init__(self, layers: list[_Layer], final_norm):
        self.layers = layers
        self.final_norm = final_norm

    def __call__(self, hidden_states: torch.Tensor, position_embeddings, masks: dict, cache) -> torch.Tensor:
        """(batch, 1, hidden) first-layer input -> (batch, 1, hidden) final hidden states (after the last norm),
        this token's keys and values stored in `cache` (None: attend to this token alone); `masks`: the attention
        mask of each sliding window (None: full attention), as LlamaModel built them."""
        from gpuformers.models.qwen3 import joint_norm_weight, norm_and_rotate_jointly

        x = hidden_states
        batch = x.shape[0]
        joint = x.is_cpu and x.dtype == torch.float32  # Qwen3Attention.position_qk's test, autograd being off
        for layer in self.layers:
            q, k, v = layer.qkv(layer.input_norm(x))
            q = q.view(batch, 1, -1, layer.head_dim)
            k = k.view(batch, 1, -1, layer.head_dim)
            v = v.view(batch, 1, -1, layer.head_dim).transpose(1, 2)
            if joint and layer.qk_norm is not None:
                heads = q.shape[2] + k.shape[2]  # this process's heads (tensor parallelism splits them)
                if layer.qk_weight is None or layer.qk_weight.shape[0] != heads:
                    layer.qk_weight = joint_norm_weight(*layer.qk_norm, q.shape[2], k.shape[2])
                q, k = norm_and_rotate_jointly(q, k, layer.qk_weight, layer.qk_norm[0].variance_epsilon,
                                               position_embeddings)
            else:
                q, k = layer.position_qk(q, k, position_embeddings)
            if cache is not None:
                k, v = cache.update(layer.index, k, v, None)
            out, _ = layer.attention(layer.attn, q, k, v, masks[layer.window], scaling=layer.scaling,
                                     dropout=layer.dropout, sliding_window=layer.window)
            x = x + layer.o_proj(out.reshape(batch, 1, -1))  # add_rms_norm's residual add
            normed = layer.post_norm(x)
            if layer.gate_up is None:
                x = x + layer.mlp(normed)
            else:
                gate, up = layer.gate_up(normed)
                x = x + layer.down_proj(F.silu(gate) * up)
        return self.final_norm(x)


def decode_step_for(model: nn.Module) -> DecodeStep | None:
    """The DecodeStep of a LlamaModel inside a generate() call (keep_plain_calls), made at its first decode step;
    None outside one, with use_kernels functions in force, with autograd on, or where a layer is not one it
    knows (the modules then run)."""
    if in_kernelized_forward() or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    return kept_answer((model, "decode step"), lambda: _build(model))


def _build(model: nn.Module) -> DecodeStep | None:
    final_norm = _own_forwards(model, "norm")
    if final_norm is None or _own_forwards(model.layers, *model.layers._modules) is None:
        return None  # (a hook or a replaced forward on a layer itself: _run_layers calls it through plain_calls)
    layers = [_layer(layer) for layer in model.layers]
    if not layers or any(layer is None for layer in layers):
        return None
    return DecodeStep(layers, final_norm[0])
