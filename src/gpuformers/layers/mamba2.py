"""The Mamba2 mixer: the token-mixing layer of Mamba2 and of the hybrid families' mamba layers, in torch.

    hidden (batch, seq, hidden)
      -> in_proj -> z (gate, intermediate) | xBC (intermediate + 2 * groups * state) | dt (heads)
      -> xBC: causal depthwise conv1d over the sequence (its last conv_kernel - 1 inputs are the conv state), silu
      -> x (heads, head_dim), B, C (groups, state) -> SSD scan over the prompt, or one state step in decode
      -> gated RMSNorm: norm(y * silu(z)) per group of intermediate / groups channels
      -> out_proj -> (batch, seq, hidden)

The projections run over every token at once; the sequence mixing (conv and scan, `mix`) runs over rows that each
continue their own states. Which rows and which states is the cache's business (`cache.mix_states`): generate()'s
RecurrentCache (generation/state_cache.py) hands the batch's rows their cached states and keeps the new ones, so a
prompt (or a prefill chunk) runs the chunked scan from the cached state and a single token the state step; the
engine's cache (engine/state_slots.py) cuts its flattened step into the decodes (one batch of one-token rows) and
each prefill chunk, with each sequence's state slot. Without a cache both start from zeros. Padding (a 0 in the attention mask) is zeroed before in_proj and after the
conv, as transformers does, so left padding leaves the state untouched.

`kernel_layer_name` marks the mixer replaceable by a fused kernel (a Hub kernel through a KernelConfig); its parts
are marked one by one with use_kernel_function, and `use_kernels=True` puts our Triton kernels in their place at
inference: the causal conv (causal_conv1d below, kernels/causal_conv1d.py), the scan and the state step
(layers/ssd.py, kernels/ssd.py). A cache that keeps its states in a pool of rows (the engine's state slots) passes the
pool and the rows (`mix(..., rows=...)`): the one-token conv and the state step then update those rows in place
(causal_conv1d_indexed, ssm_state_step_indexed), whose kernels read and write the pool without a gather or scatter.

Offers: Mamba2Mixer, GatedRMSNorm, causal_conv1d, causal_conv1d_indexed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpuformers.kernels.mapping import use_kernel_function
from gpuformers.layers.ssd import ssd_chunk_scan, ssm_state_step, ssm_state_step_indexed


@use_kernel_function("causal_conv1d")  # use_kernels=True may route this to a Triton kernel
def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu of the causal depthwise conv over [conv state | inputs]: exactly seq outputs, each from its kernel last
    inputs. x (batch, seq, channels), conv_state (batch, channels, kernel - 1) or None (zeros), weight (channels, 1,
    kernel), bias (channels,) or None. Returns the outputs (batch, seq, channels) and the new conv state (batch,
    channels, kernel - 1): the last kernel - 1 inputs, in x's dtype."""
    x = x.transpose(1, 2)  # (batch, channels, seq)
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[0], x.shape[1], weight.shape[-1] - 1)
    window = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # (batch, channels, kernel - 1 + seq)
    out = F.silu(F.conv1d(window, weight, bias, groups=x.shape[1])).transpose(1, 2)
    return out, window[:, :, window.shape[-1] - conv_state.shape[-1]:]


@use_kernel_function("causal_conv1d_indexed")  # use_kernels=True may route this to a Triton kernel
def causal_conv1d_indexed(x: torch.Tensor, conv_states: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """causal_conv1d for n rows whose conv states are rows `rows` of a pool, updated in place: x (n, seq, channels),
    conv_states (pool rows, channels, kernel - 1), rows (n,) int. Returns the outputs (n, seq, channels)."""
    out, new = causal_conv1d(x, conv_states.index_select(0, rows), weight, bias)
    conv_states.index_copy_(0, rows, new.to(conv_states.dtype))
    return out


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of `group_size` channels, in float32, cast back to y's dtype before the
    weight (transformers' MambaRMSNormGated)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        gated = hidden_states.float() * F.silu(gate.float())  # (..., channels)
        groups = gated.unflatten(-1, (-1, self.group_size))  # (..., groups, group_size)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * normed.flatten(-2).to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, group_size={self.group_size}, eps={self.variance_epsilon}"


class Mamba2Mixer(nn.Module):
    """Module doc. Parameter names are transformers' (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).

    Sizes come from the family's config: hidden_size, num_heads (SSM heads), head_dim, state_size, n_groups,
    expand (intermediate = expand * hidden = heads * head_dim), conv_kernel, chunk_size, time_step_limit,
    use_bias, use_conv_bias, layer_norm_epsilon; a hybrid family passes its own spellings as keywords."""

    kernel_layer_name = "Mamba2Mixer"

    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, head_dim: int, state_size: int,
                 n_groups: int, conv_kernel: int, chunk_size: int, time_step_limit: tuple[float, float],
                 use_bias: bool, use_conv_bias: bool, norm_eps: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.intermediate_size = num_heads * head_dim
        self.chunk_size = chunk_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size  # x, B, C go through the conv
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=use_bias)
        # No padding: the layer puts the conv state (or zeros) in front of the inputs itself.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))  # A = -exp(A_log): each head's (negative) decay rate
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // n_groups, eps=norm_eps)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state in this layer: the conv state (conv_dim, conv_kernel - 1) in `dtype`, the
        model's, and the SSM state (heads, head_dim, state_size) in float32."""
        conv = self.conv_dim * (self.conv1d.kernel_size[0] - 1) * dtype.itemsize
        return conv + self.num_heads * self.head_dim * self.state_size * torch.float32.itemsize

    def project_in(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> in_proj's output (batch, seq, intermediate + conv_dim + heads): gate | x, B, C | dt.
        A family that scales the projection's input or its parts (Falcon-H1's multipliers) overrides this."""
        return self.in_proj(hidden_states)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """hidden_states (batch, seq, hidden); attention_mask (batch, seq) over these tokens, or None; cache: a
        RecurrentCache or None."""
        batch, seq, _ = hidden_states.shape
        dtype = hidden_states.dtype
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask[:, :, None].to(dtype)
        gate, xbc, dt = self.project_in(hidden_states).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        if cache is None:  # from zeros, states dropped
            y = self.mix(xbc, dt, None, None, attention_mask)[0]
        else:  # the cache hands each run of tokens its states and keeps the new ones (module doc)
            y = cache.mix_states(self.layer_idx, self.mix, xbc, dt, attention_mask)
        y = self.norm(y.reshape(batch, seq, self.intermediate_size), gate)
        return self.out_proj(y.to(dtype))

    def mix(self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor | None,
            ssm_state: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
            rows: torch.Tensor | None = None):
        """The sequence mixing over rows that each continue their own states: the causal conv and the SSD scan (or
        the one-token state step when seq is 1 and a state is given). xbc (rows, seq, conv_dim) and dt (rows, seq,
        heads) from in_proj; conv_state (rows, conv_dim, conv_kernel - 1) and ssm_state (rows, heads, head_dim,
        state_size) or None (zeros); attention_mask (rows, seq) or None. Returns y (rows, seq, heads, head_dim)
        float32 and the new conv and SSM states.

        rows (n,) int: the states are pools (pool rows, ...) and the n rows of xbc continue rows `rows` of them, one
        token each, updated in place (module doc); the pools are returned."""
        if rows is not None and (xbc.shape[1] != 1 or conv_state is None or ssm_state is None):
            raise ValueError(f"mix(rows=...) steps one token per row from pooled states; got {xbc.shape[1]} tokens "
                             f"per row{' and no state' if conv_state is None or ssm_state is None else ''}")
        n, seq, _ = xbc.shape
        # causal conv over [conv state | new inputs], (rows, seq, conv_dim), and the conv state after them
        if rows is None:
            xbc, conv_state = causal_conv1d(xbc, conv_state, self.conv1d.weight, self.conv1d.bias)
        else:
            xbc = causal_conv1d_indexed(xbc, conv_state, rows, self.conv1d.weight, self.conv1d.bias)
        if attention_mask is not None:
            xbc = xbc * attention_mask[:, :, None].to(xbc.dtype)
        x, B, C = xbc.split([self.intermediate_size, self.n_groups * self.state_size,
                             self.n_groups * self.state_size], dim=-1)

        A = -torch.exp(self.A_log.float())  # (heads,)
        if seq == 1 and ssm_state is not None:  # decode: one step of the recurrence
            step = (x.view(n, self.num_heads, self.head_dim), dt[:, 0], A, B.view(n, self.n_groups, self.state_size),
                    C.view(n, self.n_groups, self.state_size), self.D, self.dt_bias)
            if rows is None:
                y, ssm_state = ssm_state_step(ssm_state, *step)
            else:
                y = ssm_state_step_indexed(ssm_state, rows, *step)
        else:  # a prompt or prefill chunk, from the given state if any
            y, ssm_state = ssd_chunk_scan(x.view(n, seq, self.num_heads, self.head_dim), dt, A,
                                          B.view(n, seq, self.n_groups, self.state_size),
                                          C.view(n, seq, self.n_groups, self.state_size), self.D, self.dt_bias,
                                          self.chunk_size, self.time_step_limit, ssm_state)
        return y, conv_state, ssm_state
