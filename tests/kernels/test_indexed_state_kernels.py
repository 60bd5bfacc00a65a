"""The Mamba2 decode kernels that step rows of a pool of states in place (the engine's state slots): the indexed
state step (kernels/ssd.py) and the indexed conv update (kernels/causal_conv1d.py) against their torch references
(layers/ssd.ssm_state_step_indexed, layers/mamba2.causal_conv1d_indexed: gather, the one-token step, scatter).
Rows in any order with rows of the pool left alone, n_groups > 1, sizes no power of 2, a state pool strided like a
layer's view of the engine's (layers, rows, ...) tensor, padding rows that share one scratch row; float32 under the
interpreter and float16 / bfloat16 on a GPU; the launchers' refusals; and the kernel functions handing back to torch
what they do not cover."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import CASES, assert_close

from gpuformers.kernels.causal_conv1d import causal_conv1d_indexed_forward, causal_conv1d_indexed_triton  # noqa: E402
from gpuformers.kernels.ssd import ssm_state_step_indexed_forward, ssm_state_step_indexed_triton  # noqa: E402
from gpuformers.layers.mamba2 import causal_conv1d_indexed  # noqa: E402
from gpuformers.layers.ssd import ssm_state_step_indexed  # noqa: E402

KERNEL_CASES = [c for c in CASES if c.id != "cpu-float16"]
ROWS = [5, 0, 3]  # three sequences' rows of a pool of 7, out of order; rows 1, 2, 4 and 6 must not move


def _pool(*shape, device, dtype, seed):
    """Layer 1 of a (2 layers, 7 rows, ...) pool, as PagedStateCache takes a layer's view of the engine's tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 7, *shape, generator=g).to(device=device, dtype=dtype)[1]


def _step_inputs(device, dtype, n, heads, head_dim, groups, state, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # x, dt, B, C as views of one wider projection, as the mixer's split of its conv output gives them
    wide = rnd(n, heads * head_dim + 2 * groups * state + heads + 3)
    x, B, C, dt = wide[:, :-3].split([heads * head_dim, groups * state, groups * state, heads], dim=-1)
    A = -torch.rand(heads, generator=g).to(device) * 2 - 0.1
    D, dt_bias = rnd(heads), rnd(heads)
    return (x.view(n, heads, head_dim), dt, A, B.view(n, groups, state), C.view(n, groups, state), D, dt_bias)


def _close(actual, expected, dtype):
    if dtype == torch.float32:
        assert_close(actual, expected, dtype)
    else:  # both sides in float32 from the same rounded inputs
        assert (actual.float() - expected.float()).abs().max() <= 5e-3 * expected.float().abs().max()


@pytest.mark.parametrize("device,dtype", KERNEL_CASES)
@pytest.mark.parametrize("heads,head_dim,groups,state", [(4, 20, 2, 24), (2, 16, 1, 16)], ids=["groups-odd", "one"])
def test_indexed_state_step_equals_the_torch_gather_step_scatter(device, dtype, heads, head_dim, groups, state):
    rows = torch.tensor(ROWS, device=device)
    inputs = _step_inputs(device, dtype, len(ROWS), heads, head_dim, groups, state, seed=1)
    pool = _pool(heads, head_dim, state, device=device, dtype=torch.float32, seed=2)
    expected_pool = pool.clone()
    y = ssm_state_step_indexed_forward(pool, rows, *inputs)
    y_ref = ssm_state_step_indexed.torch_function(expected_pool, rows, *inputs)
    assert y.dtype == torch.float32 and y.shape == (len(ROWS), heads, head_dim)
    _close(y, y_ref, dtype)
    _close(pool, expected_pool, dtype)
    untouched = [r for r in range(7) if r not in ROWS]
    assert torch.equal(pool[untouched], _pool(heads, head_dim, state, device=device, dtype=torch.float32,
                                              seed=2)[untouched])


@pytest.mark.parametrize("device,dtype", KERNEL_CASES)
@pytest.mark.parametrize("kernel,with_bias", [(4, True), (3, False), (2, True)], ids=["k4", "k3-no-bias", "k2"])
def test_indexed_conv_update_equals_the_torch_gather_conv_scatter(device, dtype, kernel, with_bias):
    g = torch.Generator().manual_seed(kernel)
    channels = 40
    rows = torch.tensor(ROWS, device=device)
    # x: a column slice of a wider projection (n, 1, 2 * channels), as the mixer's in_proj split gives it
    x = torch.randn(len(ROWS), 1, 2 * channels, generator=g).to(device=device, dtype=dtype)[..., :channels]
    weight = torch.randn(channels, 1, kernel, generator=g).to(device=device, dtype=dtype)
    bias = torch.randn(channels, generator=g).to(device=device, dtype=dtype) if with_bias else None
    pool = _pool(channels, kernel - 1, device=device, dtype=dtype, seed=3)
    expected_pool = pool.clone()
    out = causal_conv1d_indexed_forward(x, pool, rows, weight, bias)
    out_ref = causal_conv1d_indexed.torch_function(x, expected_pool, rows, weight, bias)
    assert out.shape == (len(ROWS), 1, channels) and out.dtype == dtype
    assert_close(out, out_ref, dtype, scale=1 if dtype == torch.float32 else 4)
    assert torch.equal(pool, expected_pool)  # copied inputs, no arithmetic; the other rows untouched


def test_padding_rows_share_one_scratch_row():
    """CUDA-graph padding rows all point at one scratch row: the real rows come out as without the padding, the
    scratch row holds one of the padding rows' updates."""
    rows = torch.tensor([2, 6, 6, 6])  # one sequence (row 2), three padding rows on scratch row 6
    inputs = _step_inputs("cpu", torch.float32, 4, 2, 16, 1, 16, seed=4)
    pool = _pool(2, 16, 16, device="cpu", dtype=torch.float32, seed=5)
    alone = pool.clone()
    y = ssm_state_step_indexed_forward(pool, rows, *inputs)
    y_alone = ssm_state_step_indexed.torch_function(alone, rows[:1], *(t[:1] if t.dim() > 1 else t for t in inputs))
    assert_close(y[:1], y_alone, torch.float32)
    assert_close(pool[:6], alone[:6], torch.float32)
    assert torch.isfinite(pool[6]).all()

    x = torch.randn(4, 1, 24)
    conv_pool, weight = torch.randn(7, 24, 3), torch.randn(24, 1, 4)
    conv_alone = conv_pool.clone()
    out = causal_conv1d_indexed_forward(x, conv_pool, rows, weight, None)
    out_alone = causal_conv1d_indexed.torch_function(x[:1], conv_alone, rows[:1], weight, None)
    assert_close(out[:1], out_alone, torch.float32)
    assert torch.equal(conv_pool[:6], conv_alone[:6])
    assert any(torch.equal(conv_pool[6, :, -1], x[i, 0]) for i in (1, 2, 3))


def test_indexed_launchers_name_what_is_wrong():
    inputs = _step_inputs("cpu", torch.float32, 3, 2, 16, 1, 16)
    pool = torch.zeros(7, 2, 16, 16)
    with pytest.raises(ValueError, match="rows has 2 entries, expected one per input row"):
        ssm_state_step_indexed_forward(pool, torch.tensor([0, 1]), *inputs)
    with pytest.raises(ValueError, match="rows must be a 1-d int32 or int64 tensor"):
        ssm_state_step_indexed_forward(pool, torch.tensor([0.0, 1.0, 2.0]), *inputs)
    with pytest.raises(ValueError, match="state pool must be float32"):
        ssm_state_step_indexed_forward(pool.half(), torch.tensor([0, 1, 2]), *inputs)
    with pytest.raises(ValueError, match="state has shape"):
        ssm_state_step_indexed_forward(torch.zeros(7, 2, 16, 8), torch.tensor([0, 1, 2]), *inputs)
    x, weight = torch.randn(3, 2, 8), torch.randn(8, 1, 4)
    with pytest.raises(ValueError, match="one token per row; x has 2"):
        causal_conv1d_indexed_forward(x, torch.zeros(7, 8, 3), torch.tensor([0, 1, 2]), weight, None)
    with pytest.raises(ValueError, match=r"conv_states has shape \(7, 8, 2\)"):
        causal_conv1d_indexed_forward(x[:, :1], torch.zeros(7, 8, 2), torch.tensor([0, 1, 2]), weight, None)


def test_the_mixer_steps_pooled_states_one_token_per_row_only():
    from tests.engine.test_hybrid_engine import tiny_hybrid

    mixer = tiny_hybrid("mamba2").model.layers[0].mixer
    conv, ssm = torch.zeros(4, mixer.conv_dim, 3), torch.zeros(4, mixer.num_heads, mixer.head_dim, mixer.state_size)
    xbc, dt = torch.randn(2, 3, mixer.conv_dim), torch.randn(2, 3, mixer.num_heads)
    with pytest.raises(ValueError, match="one token per row from pooled states; got 3 tokens per row"):
        mixer.mix(xbc, dt, conv, ssm, rows=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="got 1 tokens per row and no state"):
        mixer.mix(xbc[:, :1], dt[:, :1], None, None, rows=torch.tensor([0, 1]))


def test_indexed_conv_hands_longer_runs_and_autograd_back_to_torch():
    rows = torch.tensor([1, 0])
    weight = torch.randn(8, 1, 4)
    assert causal_conv1d_indexed_triton(torch.randn(2, 3, 8), torch.zeros(3, 8, 3), rows, weight,
                                        None) is NotImplemented
    assert causal_conv1d_indexed_triton(torch.randn(2, 1, 8), torch.zeros(3, 8, 3), rows,
                                        weight.requires_grad_(), None) is NotImplemented


def test_compiled_indexed_kernels_are_ops_that_step_the_pool_in_place():
    """Under torch.compile (fullgraph) the kernel functions are the ops gpuformers::ssm_state_step_indexed and
    gpuformers::causal_conv1d_indexed, and the compiled call steps the pool as the eager one does."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):  # the forward graph's code, where a mutating op shows as auto_functionalized(op)
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    rows = torch.tensor(ROWS)
    inputs = _step_inputs("cpu", torch.float32, len(ROWS), 2, 16, 1, 16, seed=6)
    x, weight = torch.randn(len(ROWS), 1, 24), torch.randn(24, 1, 4)
    pools = _pool(2, 16, 16, device="cpu", dtype=torch.float32, seed=7), torch.randn(7, 24, 3)
    eager = [p.clone() for p in pools]

    def both(ssm, conv):
        return (ssm_state_step_indexed_triton(ssm, rows, *inputs),
                causal_conv1d_indexed_triton(x, conv, rows, weight, None))

    with torch.no_grad():
        got = torch.compile(both, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(*pools)
        want = both(*eager)
    assert len(graphs) == 1
    assert "gpuformers.ssm_state_step_indexed" in graphs[0] and "gpuformers.causal_conv1d_indexed" in graphs[0]
    for g, w in zip((*got, *pools), (*want, *eager)):
        assert_close(g, w, torch.float32)
