"""The backward of the Mamba2 kernels (kernels/ssd_backward.py, kernels/causal_conv1d.py) against torch autograd
through their references (layers/ssd.ssd_chunk_scan, layers/mamba2.causal_conv1d): every input's gradient for the
chunked scan (n_groups > 1, chunk sizes that do not divide the prompt, row blocks inside a chunk, with and without an
initial state, time_step_limit clamping some steps) and for the conv (with and without a state and bias, the new
state's gradient included), float32 under the interpreter and float16 / bfloat16 on a GPU; and tiny Mamba2 and
Nemotron-H models with use_kernels=True trained one step in train() mode, eagerly and under torch.compile, whose loss
and every parameter gradient equal the torch model's, the kernels' backward having run."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import CASES, CUDA, DEVICES, assert_close
from tests.kernels.test_ssd_kernels import MODELS, _count_kernel_calls, _inputs

from gpuformers.kernels.causal_conv1d import CausalConv1d  # noqa: E402
from gpuformers.kernels.ssd_backward import SSDChunkScan  # noqa: E402
from gpuformers.layers.mamba2 import causal_conv1d  # noqa: E402
from gpuformers.layers.ssd import softplus_dt, ssd_chunk_scan  # noqa: E402

KERNEL_CASES = [c for c in CASES if c.id != "cpu-float16"]  # (as test_ssd_kernels: float16 adds little on the CPU)


def _close(actual, expected, dtype):
    """float32: elementwise at the kernel tolerance (1e-4). Half inputs: relative to the largest gradient (both
    sides compute in float32 from the same rounded inputs; the kernels' matmuls in TF32)."""
    if dtype == torch.float32:
        assert_close(actual, expected, dtype)
    else:
        assert (actual.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()


def _gradients(fn, inputs, dy, dfinal):
    y, final = fn(*inputs)
    return (y, final), torch.autograd.grad((y * dy).sum() + (final * dfinal).sum(),
                                           [t for t in inputs if isinstance(t, torch.Tensor)])


SCAN_CASES = {  # seq, chunk_size, heads, head_dim, groups, state, initial state, time_step_limit
    "ragged-groups-initial-clamped": (11, 4, 4, 16, 2, 16, True, (0.0, 0.9)),
    "ragged-groups-clamped-below": (13, 5, 4, 16, 2, 16, False, (0.4, float("inf"))),
    "chunk-past-the-prompt": (7, 40, 2, 20, 1, 24, True, (0.0, float("inf"))),  # sizes no power of 2
    "row-blocks-inside-a-chunk": (70, 48, 2, 16, 2, 16, True, (0.0, 2.0)),  # blocks of 32 rows, 2 chunks
    "dx-and-db-apart": (6, 4, 2, 80, 1, 130, True, (0.0, float("inf"))),  # (head_dim, state) tiles of (128, 256)
}


@pytest.mark.parametrize("device,dtype", KERNEL_CASES)
@pytest.mark.parametrize("case", list(SCAN_CASES))
def test_chunk_scan_gradients_equal_torch_autograd(device, dtype, case):
    seq, chunk, heads, head_dim, groups, state, initial, limit = SCAN_CASES[case]
    x, dt, A, B, C, D, dt_bias = _inputs(device, dtype, 2, seq, heads, head_dim, groups, state, seed=5)
    start = torch.randn(2, heads, head_dim, state, device=device) if initial else None
    inputs = [t.requires_grad_() if t is not None else None for t in (x, dt, A, B, C, D, dt_bias)]
    inputs += [chunk, limit, start.requires_grad_() if initial else None]
    g = torch.Generator().manual_seed(6)
    dy = torch.randn(2, seq, heads, head_dim, generator=g).to(device)
    dfinal = torch.randn(2, heads, head_dim, state, generator=g).to(device)

    (y, final), got = _gradients(SSDChunkScan.apply, inputs, dy, dfinal)
    (y_ref, final_ref), want = _gradients(ssd_chunk_scan.torch_function, inputs, dy, dfinal)
    _close(y, y_ref, dtype)
    _close(final, final_ref, dtype)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias"] + (["initial_state"] if initial else [])
    assert len(got) == len(names)
    for name, a, b, t in zip(names, got, want, [*inputs[:7], start]):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        _close(a, b, dtype)
    soft = softplus_dt(dt, dt_bias)
    clamped = (soft < limit[0]) | (soft > limit[1])
    if limit != (0.0, float("inf")) and case != "row-blocks-inside-a-chunk":  # the clamp's zero gradient tested
        assert clamped.any() and not clamped.all()


@pytest.mark.parametrize("device,dtype", KERNEL_CASES)
@pytest.mark.parametrize("seq,kernel,with_state,with_bias", [(9, 4, True, True), (3, 4, False, True),
                                                              (70, 3, True, False), (2, 5, True, True)],
                         ids=["prefill-from-state", "prefill-from-zeros", "two-token-blocks", "shorter-than-the-state"])
def test_causal_conv1d_gradients_equal_torch_autograd(device, dtype, seq, kernel, with_state, with_bias):
    g = torch.Generator().manual_seed(seq)
    channels = 40

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # x a column slice of a wider projection (the mixer's in_proj split), the state a strided view
    x = rnd(2, seq, 2 * channels)[..., :channels].requires_grad_()
    weight = rnd(channels, 1, kernel).requires_grad_()
    bias = rnd(channels).requires_grad_() if with_bias else None
    state = rnd(2, channels, kernel + 1)[..., 2:].requires_grad_() if with_state else None
    inputs = [t for t in (x, state, weight, bias) if t is not None]
    dout, dnew = rnd(2, seq, channels), rnd(2, channels, kernel - 1)

    def grads(fn):
        out, new_state = fn(x, state, weight, bias)
        return torch.autograd.grad((out.float() * dout.float()).sum() + (new_state.float() * dnew.float()).sum(),
                                   inputs)

    for a, b, t in zip(grads(CausalConv1d.apply), grads(causal_conv1d.torch_function), inputs):
        assert a.dtype == t.dtype and a.shape == t.shape
        _close(a, b, dtype)


# --- models -------------------------------------------------------------------------------------------------

def _train_step(model, compiled=None):
    from tests.models.parity import left_padded

    ids, mask = left_padded(seq=10, pad=3)
    labels = ids.masked_fill(mask == 0, -100)
    loss = (model if compiled is None else compiled)(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def _assert_same_training(plain, fused, compiled=None):
    loss, grads = _train_step(plain.train())
    fused_loss, fused_grads = _train_step(fused.train(), compiled)
    assert abs(loss - fused_loss) < 1e-4
    for name, want in grads.items():
        got = fused_grads[name]
        assert got is not None and (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item()), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["mamba2", "nemotron_h"])
def test_training_with_kernels_gives_the_torch_loss_and_gradients(device, model_type, tmp_path, monkeypatch):
    """train() with use_kernels=True runs the conv and scan kernels with their backward (each mamba layer once):
    the loss and every parameter's gradient equal the torch model's. The decode step keeps torch in train(), and
    eval() maps the inference kernels again."""
    from tests.fixtures.checkpoints import make_checkpoint
    from tests.models.parity import load

    make_checkpoint(tmp_path, model_type, **MODELS[model_type])
    plain, fused = load(tmp_path, device_map=device), load(tmp_path, device_map=device, use_kernels=True)
    import gpuformers.kernels.causal_conv1d as conv
    import gpuformers.kernels.ssd_backward as ssd

    calls = _count_kernel_calls(monkeypatch, ((conv, "causal_conv1d_backward", "conv"),
                                              (ssd, "ssd_chunk_scan_backward", "scan")))
    _assert_same_training(plain, fused)
    layers = sum(1 for m in fused.modules() if type(m).__name__ == "Mamba2Mixer")
    assert layers and calls == {"conv": layers, "scan": layers}
    names = {layer: fn.__name__ for layer, fn in fused._kernel_state.functions.items()}
    assert (names["causal_conv1d"], names["ssd_chunk_scan"], names["ssm_state_step"]) == (
        "causal_conv1d_train", "ssd_chunk_scan_train", "_torch_function")
    fused.eval()
    names = {layer: fn.__name__ for layer, fn in fused._kernel_state.functions.items()}
    assert (names["causal_conv1d"], names["ssd_chunk_scan"], names["ssm_state_step"]) == (
        "causal_conv1d_triton", "ssd_chunk_scan_triton", "ssm_state_step_triton")


def test_compiled_training_keeps_the_ops_and_their_backward(tmp_path):
    """A Mamba2 kernelized with Mode.TRAINING | Mode.TORCH_COMPILE compiles (fullgraph) into forward and backward
    graphs that call the conv and scan ops and their backward ops, with the torch model's loss and gradients."""
    from gpuformers.kernels import Mode, kernelize
    from tests.fixtures.checkpoints import make_checkpoint
    from tests.kernels.test_compile import OpCounter
    from tests.models.parity import load

    torch._dynamo.reset()
    make_checkpoint(tmp_path, "mamba2", **MODELS["mamba2"])
    plain, fused = load(tmp_path), kernelize(load(tmp_path), mode=Mode.TRAINING | Mode.TORCH_COMPILE)
    counter = OpCounter()
    _assert_same_training(plain, fused, torch.compile(fused.train(), backend=counter, fullgraph=True))
    assert counter.forward["gpuformers::causal_conv1d"] == counter.forward["gpuformers::ssd_chunk_scan"] == 2
    assert counter.backward["gpuformers::causal_conv1d_backward"] == 2
    assert counter.backward["gpuformers::ssd_chunk_scan_backward"] == 2
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("model_type", ["mamba2", "nemotron_h"])
def test_bfloat16_training_with_kernels_stays_within_torch_rounding(model_type, tmp_path):
    """In bfloat16 the kernels' gradients move from the float32 model's no more than torch's bfloat16 layers' do,
    give or take a little."""
    from tests.fixtures.checkpoints import make_checkpoint
    from tests.models.parity import load

    make_checkpoint(tmp_path, model_type, **MODELS[model_type])
    grads = []
    for kwargs in (dict(), dict(dtype=torch.bfloat16), dict(dtype=torch.bfloat16, use_kernels=True)):
        model = load(tmp_path, device_map="cuda", **kwargs).train()
        ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()
        model(ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    exact, plain, fused = grads
    assert (fused - exact).abs().max() <= 2 * (plain - exact).abs().max() + 1e-2 * exact.abs().max()
