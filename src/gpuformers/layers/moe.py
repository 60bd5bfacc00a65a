"""The sparse mixture-of-experts block of Qwen3-MoE and Mixtral: a router picks top_k experts per token, each a
gated MLP.

    router:  probs = softmax(hidden @ gate.weight.T) in float32; top_k of them per token (renormalised to sum 1
             when norm_topk_prob), cast back to the model dtype (Mixtral: kept in float32)
    experts: out[t] = sum over the token's experts e of  weight[t, e] * down_e(silu(gate_e(x_t)) * up_e(x_t))

It stands where a decoder layer's `mlp` stands and takes the same (batch, seq, hidden) input. The experts are a
ModuleList of GatedMLP (checkpoint keys mlp.experts.{e}.{gate,up,down}_proj.weight, as on the Hub) and run one after
the other over the tokens routed to them, in expert order, summed with index_add_: transformers' "eager" experts,
the same numbers. With use_kernels=True (kernel layer "SparseMoeBlock") inference runs the experts as two grouped
Triton GEMMs instead (kernels/moe.py), which keep the expert weights stacked in one buffer that the expert
Parameters are slices of; training keeps this forward.

Under torch.compile without grad the loop, whose host wait a graph cannot hold, runs as one opaque op,
`gpuformers::experts_outside_graph` (the same run_experts called eagerly, its output shaped like its input), so the
rest of the layer compiles into one graph (the engine's compiled decoder on the CPU); the block still `syncs_host`,
so no CUDA graph holds it. generate()'s compiled step on the CPU gathers the experts inside the graph instead at
decode sizes (generation/compiled_step.py).

Training with output_router_logits=True adds the Switch-Transformer load-balancing loss over the sparse layers
(transformers' load_balancing_loss_func): the model sets each router's `recorded` to one shared list for that
forward, every router call appends its logits (both forwards above call the router), and `load_balancing_loss`
turns them into the aux loss. With `recorded` left at None (inference, the engine) nothing is kept.

Offers: TopKRouter, SparseMoeBlock, load_balancing_loss, host_syncing_modules, register_outside_graph.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.layers.mlp import GatedMLP


class TopKRouter(nn.Module):
    """Router logits -> (top_k weights, top_k expert ids) per token. Not an nn.Linear, so that quantization and
    LoRA's "all-linear" leave it alone, as they leave transformers' router."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        # The top-k weights in the model dtype (Qwen3-MoE), or kept in float32 (Mixtral: its experts' outputs are
        # multiplied by them in float32 and rounded once), as each family's transformers router returns them.
        self.float32_weights = False
        self.recorded: list[torch.Tensor] | None = None  # a list while the model records router logits

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, hidden) -> router logits (tokens, experts), weights (tokens, top_k), expert ids (tokens, top_k)."""
        logits = F.linear(hidden_states, self.weight)
        if self.recorded is not None:
            self.recorded.append(logits)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights if self.float32_weights else weights.to(logits.dtype), experts

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


def host_syncing_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose forward waits on the host (class attribute `syncs_host`, as SparseMoeBlock's torch
    forward reads which experts got tokens; forward not replaced on the instance by a kernel, syncs_host not set
    False on the instance, as generation/compiled_step.py's lifted_host_waits does): neither a CUDA graph
    (engine/cuda_graphs.py) nor a compiled decode step (supports_compiled_decode) can hold them."""
    return [name for name, module in model.named_modules()
            if module.__dict__.get("syncs_host", getattr(type(module), "syncs_host", False))
            and "forward" not in module.__dict__]


class SparseMoeBlock(nn.Module):
    kernel_layer_name = "SparseMoeBlock"
    # An expert: a module (hidden_size, intermediate_size) whose forward is the gated MLP and whose projections
    # read as gate_proj / up_proj / down_proj (the fused kernel stacks them by these names); a family whose
    # checkpoint names them otherwise sets its own (Mixtral's w1 / w3 / w2).
    expert_class = GatedMLP
    syncs_host = True  # forward reads the routed experts on the host: no CUDA graph (engine/cuda_graphs.py)

    # The number gpuformers::experts_outside_graph finds the block by (None: not registered, e.g. a subclass that
    # skips this __init__; its loop then breaks a compiled graph).
    outside_graph_key: int | None = None

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = nn.ModuleList(self.expert_class(hidden_size, intermediate_size) for _ in range(num_experts))
        register_outside_graph(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        if state.get("outside_graph_key") is not None:  # a copy (deepcopy, pickle) is a block of its own
            self.outside_graph_key = None
            register_outside_graph(self)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, experts = self.gate(x)
        return self.run_experts(x, weights, experts).view(shape)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (tokens, width) through each token's experts (tokens, top_k: ids, weights), summed -> (tokens, width)."""
        if torch.compiler.is_compiling() and not torch.is_grad_enabled() and self.outside_graph_key is not None:
            # A graph cannot hold the host wait below: under torch.compile this same loop runs as one opaque op
            # (its output shaped like x), so the rest of the layer stays in the graph. Inference only: the op has
            # no backward, so a compiled training step keeps the loop (a graph break per block).
            return torch.ops.gpuformers.experts_outside_graph(x, weights, experts, self.outside_graph_key)
        out = torch.zeros_like(x)
        # Which experts got tokens (a host sync, as in transformers): only those run, in expert order.
        for expert in torch.unique(experts).tolist():
            token, slot = torch.where(experts == expert)
            y = self.experts[expert](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


# Registered blocks by key; they go with their model.
_BLOCKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register_outside_graph(block: SparseMoeBlock) -> int:
    """The block's key for gpuformers::experts_outside_graph, given on first call."""
    if block.__dict__.get("outside_graph_key") is None:
        block.outside_graph_key = next(_KEYS)
        _BLOCKS[block.outside_graph_key] = block
    return block.outside_graph_key


# Defined with torch.library.Library rather than the custom_op decorator, whose Python wrapping costs ~20 us per call
# (engine/paged_attention.py measured it): a compiled step calls the op once per MoE layer.
_LIBRARY = torch.library.Library("gpuformers", "FRAGMENT")
_LIBRARY.define("experts_outside_graph(Tensor x, Tensor weights, Tensor experts, int key) -> Tensor")


def _experts_outside_graph(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, key: int) -> torch.Tensor:
    """The registered block's run_experts, eagerly: x (tokens, width) -> (tokens, width)."""
    block = _BLOCKS[key]
    return type(block).run_experts(block, x, weights, experts)


# CompositeExplicitAutograd: one kernel for every device; inference only (run_experts uses the op without grad)
_LIBRARY.impl("experts_outside_graph", _experts_outside_graph, "CompositeExplicitAutograd")


@torch.library.register_fake("gpuformers::experts_outside_graph", lib=_LIBRARY)
def _(x, weights, experts, key):
    return torch.empty_like(x)


def load_balancing_loss(router_logits: list[torch.Tensor] | tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss (its eqs. 4-6) over all sparse layers, as transformers'
    load_balancing_loss_func computes it:

        loss = num_experts * sum_e  f_e * P_e
        f_e  = top-k assignments to expert e / tokens     (summed over the k slots: sum_e f_e = top_k)
        P_e  = mean router probability of expert e

    both over the tokens of every layer together. router_logits: one (tokens, experts) tensor per sparse layer,
    tokens = batch * seq in row-major order; attention_mask (batch, seq): 0 marks padding, left out of both means.
    Softmax and top-k run in float32 (the router's own choice of experts); transformers runs the softmax in the
    logits' dtype, the same numbers in float32. Only P_e carries a gradient (to the router weights)."""
    if not router_logits:  # no sparse layer
        return torch.zeros((), dtype=torch.float32)
    device = router_logits[0].device  # layers may sit on several devices (device_map): gather on the first
    tokens = router_logits[0].shape[0]
    if attention_mask is None:
        token_weight = torch.ones(tokens, dtype=torch.float32, device=device)
    else:
        token_weight = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)  # (tokens,)
        if token_weight.shape[0] != tokens:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} covers {token_weight.shape[0]} tokens "
                             f"but the router saw {tokens}: pass a (batch, seq) mask of the routed tokens")
    slot_weight = token_weight.repeat_interleave(top_k)  # (tokens * top_k,): each token's k assignments
    assignments = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    for logits in router_logits:  # one layer at a time: memory O(tokens * experts), whatever the depth
        probs = F.softmax(logits.to(device), dim=-1, dtype=torch.float32)  # (tokens, experts)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (tokens, top_k)
        assignments = assignments.scatter_add(0, chosen.reshape(-1), slot_weight)
        prob_sum = prob_sum + (probs * token_weight[:, None]).sum(dim=0)
    rows = token_weight.sum() * len(router_logits)
    return num_experts * torch.sum((assignments / rows) * (prob_sum / rows))
