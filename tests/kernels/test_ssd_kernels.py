"""The Mamba2 kernels (kernels/ssd.py, kernels/causal_conv1d.py) against their torch references (layers/ssd.py,
layers/mamba2.causal_conv1d): the chunked scan (ragged last chunk, chunks of one, a chunk longer than the prompt,
n_groups > 1, an initial state, dt bias + softplus + time_step_limit), the decode step, the conv (prefill with and
without a state, the one-token update, strided inputs), float32 under the interpreter and float16 / bfloat16 on a GPU;
the launchers' refusals; and tiny Mamba2 / Nemotron-H / Granite 4 / Falcon-H1 models with use_kernels=True, whose
logits and greedy tokens equal the torch model's, the inference kernels handing autograd back to torch (train() mode
and the kernels' backward: test_ssd_backward.py)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import CASES, CUDA, DEVICES, assert_close

from gpuformers.kernels.causal_conv1d import causal_conv1d_forward, causal_conv1d_triton  # noqa: E402
from gpuformers.kernels.ssd import ssd_chunk_scan_forward, ssd_chunk_scan_triton, ssm_state_step_forward  # noqa: E402
from gpuformers.layers.mamba2 import causal_conv1d  # noqa: E402
from gpuformers.layers.ssd import ssd_chunk_scan, ssm_state_step  # noqa: E402

# float32 under the interpreter; every dtype on a GPU (the interpreter gets bfloat16 wrong; float16 there is slow
# for what it adds: the same code with other loads)
KERNEL_CASES = [c for c in CASES if c.id != "cpu-float16"]


def _close(actual, expected, dtype):
    """float32: elementwise at the kernel tolerance. Half inputs: both sides compute in float32 from the same rounded
    inputs, the kernels' matmuls in TF32, so the error is relative to the largest output."""
    if dtype == torch.float32:
        assert_close(actual, expected, dtype)
    else:
        assert (actual.float() - expected.float()).abs().max() <= 5e-3 * expected.float().abs().max()


def _inputs(device, dtype, batch, seq, heads, head_dim, groups, state, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x, dt = rnd(batch, seq, heads, head_dim), rnd(batch, seq, heads)
    B, C = rnd(batch, seq, groups, state), rnd(batch, seq, groups, state)
    A = -torch.rand(heads, generator=g).to(device) * 2 - 0.1  # float32, as the layer computes it from A_log
    D, dt_bias = rnd(heads), rnd(heads)
    return x, dt, A, B, C, D, dt_bias


SCAN_CASES = {  # seq, chunk_size, heads, head_dim, groups, state, initial state, time_step_limit
    "ragged-groups-initial": (11, 4, 4, 16, 2, 16, True, (0.0, float("inf"))),
    "chunks-of-one-limit": (5, 1, 4, 16, 4, 16, False, (0.0, 0.05)),
    "chunk-past-the-prompt": (7, 40, 2, 20, 1, 24, True, (0.01, 3.0)),  # sizes no power of 2
    "many-chunks": (70, 16, 2, 16, 2, 16, False, (0.0, float("inf"))),  # tiles of 64 rows cross a chunk's blocks
}


@pytest.mark.parametrize("device,dtype", KERNEL_CASES)
@pytest.mark.parametrize("case", list(SCAN_CASES))
def test_chunk_scan_equals_the_torch_scan(device, dtype, case):
    seq, chunk, heads, head_dim, groups, state, initial, limit = SCAN_CASES[case]
    x, dt, A, B, C, D, dt_bias = _inputs(device, dtype, 2, seq, heads, head_dim, groups, state)
    start = torch.randn(2, heads, head_dim, state, device=device) if initial else None
    y, final = ssd_chunk_scan_forward(x, dt, A, B, C, D, dt_bias, chunk, limit, start)
    y_ref, final_ref = ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, chunk, limit, start)
    assert y.dtype == final.dtype == torch.float32
    _close(y, y_ref, dtype)
    _close(final, final_ref, dtype)


def test_chunk_scan_reads_channel_major_inputs():
    """x, B, C strided along their last dimension, as views of the torch conv's (batch, channels, seq) output are
    (a KernelConfig that keeps the conv in torch gives the scan those)."""
    x, dt, A, B, C, D, dt_bias = _inputs("cpu", torch.float32, 2, 9, 4, 16, 2, 16, seed=3)
    x_t, B_t, C_t = (t.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) for t in (x, B, C))
    assert x_t.stride(-1) == 9 and torch.equal(x_t, x)
    y, final = ssd_chunk_scan_forward(x_t, dt, A, B_t, C_t, D, dt_bias, 4, (0.0, float("inf")))
    y_ref, final_ref = ssd_chunk_scan(x, dt, A, B, C, D, dt_bias, 4, (0.0, float("inf")))
    assert_close(y, y_ref, torch.float32)
    assert_close(final, final_ref, torch.float32)


@pytest.mark.parametrize("device,dtype", KERNEL_CASES)
def test_state_step_equals_the_torch_step(device, dtype):
    x, dt, A, B, C, D, dt_bias = _inputs(device, dtype, 3, 1, 4, 20, 2, 24, seed=1)
    state = torch.randn(3, 4, 20, 24, device=device)
    y, new = ssm_state_step_forward(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, dt_bias)
    y_ref, new_ref = ssm_state_step(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, dt_bias)
    _close(y, y_ref, dtype)
    _close(new, new_ref, dtype)
    assert not torch.equal(new, state)  # a new tensor: the old state is left as it was


@pytest.mark.parametrize("device,dtype", KERNEL_CASES)
@pytest.mark.parametrize("seq,kernel,with_state,with_bias", [(9, 4, True, True), (1, 4, True, False),
                                                              (3, 4, False, True), (70, 3, True, True),
                                                              (2, 5, True, True)],
                         ids=["prefill-from-state", "one-token-update", "prefill-from-zeros", "two-token-blocks",
                              "shorter-than-the-state"])
def test_causal_conv1d_equals_the_torch_conv(device, dtype, seq, kernel, with_state, with_bias):
    g = torch.Generator().manual_seed(seq)
    channels = 40
    # x is a column slice of a wider projection, as the mixer's in_proj split gives it; the state a strided view
    x = torch.randn(2, seq, 2 * channels, generator=g).to(device=device, dtype=dtype)[..., :channels]
    weight = torch.randn(channels, 1, kernel, generator=g).to(device=device, dtype=dtype)
    bias = torch.randn(channels, generator=g).to(device=device, dtype=dtype) if with_bias else None
    state = (torch.randn(2, channels, kernel + 1, generator=g).to(device=device, dtype=dtype)[..., 2:]
             if with_state else None)
    out, new_state = causal_conv1d_forward(x, state, weight, bias)
    out_ref, new_state_ref = causal_conv1d.torch_function(x, state, weight, bias)
    # half: the kernel and torch's conv round the same float32 sum to x's dtype, maybe one unit apart
    assert_close(out, out_ref, dtype, scale=1 if dtype == torch.float32 else 4)
    assert torch.equal(new_state, new_state_ref)  # copied inputs, no arithmetic


def test_launchers_name_what_is_wrong():
    x, dt, A, B, C, D, dt_bias = _inputs("cpu", torch.float32, 1, 4, 4, 16, 2, 16)
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of the groups of B and C \(3\)"):
        B3 = torch.randn(1, 4, 3, 16)
        ssd_chunk_scan_forward(x, dt, A, B3, B3, D, dt_bias, 2, (0.0, float("inf")))
    with pytest.raises(ValueError, match=r"dt has shape \(1, 4, 2\), expected \(batch, seq, heads\)"):
        ssd_chunk_scan_forward(x, dt[..., :2], A, B, C, D, dt_bias, 2, (0.0, float("inf")))
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        ssd_chunk_scan_forward(x, dt, A, B, C, D, dt_bias, 0, (0.0, float("inf")))
    with pytest.raises(ValueError, match=r"initial_state has shape \(1, 4, 16, 8\), expected"):
        ssd_chunk_scan_forward(x, dt, A, B, C, D, dt_bias, 2, (0.0, 1.0), torch.zeros(1, 4, 16, 8))
    with pytest.raises(ValueError, match=r"state has shape \(1, 4, 8, 16\), expected \(1, 4, 16, 16\)"):
        ssm_state_step_forward(torch.zeros(1, 4, 8, 16), x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, dt_bias)
    with pytest.raises(ValueError, match=r"conv_state has shape \(1, 16, 2\), expected \(batch, channels, kernel"):
        causal_conv1d_forward(torch.randn(1, 3, 16), torch.zeros(1, 16, 2), torch.randn(16, 1, 4), None)
    with pytest.raises(ValueError, match="weight has shape"):
        causal_conv1d_forward(torch.randn(1, 3, 16), None, torch.randn(16, 2, 4), None)


def test_inference_kernels_hand_autograd_back_to_torch():
    """At inference (Mode.INFERENCE) a call that autograd must differentiate returns NotImplemented, so
    use_kernel_function runs the torch function (train() mode maps the differentiable kernels instead)."""
    x, dt, A, B, C, D, dt_bias = _inputs("cpu", torch.float32, 1, 4, 4, 16, 2, 16)
    assert ssd_chunk_scan_triton(x, dt, A, B, C, D.requires_grad_(), dt_bias, 2, (0.0, 1.0)) is NotImplemented
    weight = torch.randn(16, 1, 4, requires_grad=True)
    assert causal_conv1d_triton(torch.randn(1, 3, 16), None, weight, None) is NotImplemented
    with torch.no_grad():
        assert causal_conv1d_triton(torch.randn(1, 3, 16), None, weight, None) is not NotImplemented


# --- models -------------------------------------------------------------------------------------------------

MODELS = {
    "mamba2": dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=16,
                   expand=2, n_groups=2, chunk_size=5),
    "nemotron_h": dict(vocab_size=128, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       intermediate_size=48, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                       chunk_size=3, layers_block_type=["linear_attention", "full_attention", "mlp"]),
    "granitemoehybrid": dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                             shared_intermediate_size=24, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                             mamba_n_groups=2, mamba_chunk_size=5, position_embedding_type="rope",
                             layer_types=["linear_attention", "full_attention"]),
    "falcon_h1": dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                      mamba_n_groups=2, mamba_chunk_size=3, mamba_rms_norm=True,
                      ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9]),
}


def _count_kernel_calls(monkeypatch, targets=None) -> dict[str, int]:
    """Counts calls of the launchers, {key: calls}; targets: (module, function name, key) triples."""
    import gpuformers.kernels.causal_conv1d as conv
    import gpuformers.kernels.ssd as ssd

    targets = targets or ((conv, "causal_conv1d_forward", "conv"), (ssd, "ssd_chunk_scan_forward", "scan"),
                          (ssd, "ssm_state_step_forward", "step"))
    calls = {key: 0 for _, _, key in targets}
    for module, name, key in targets:
        original = getattr(module, name)

        def counted(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", list(MODELS))
def test_model_with_kernels_gives_the_torch_logits_and_tokens(device, model_type, tmp_path, monkeypatch):
    from tests.fixtures.checkpoints import make_checkpoint
    from tests.models.parity import left_padded, load

    make_checkpoint(tmp_path, model_type, **MODELS[model_type])
    plain, fused = load(tmp_path, device_map=device), load(tmp_path, device_map=device, use_kernels=True)
    calls = _count_kernel_calls(monkeypatch)
    ids, mask = (t.to(device) for t in left_padded(seq=12, pad=3))
    with torch.no_grad():
        diff = fused(ids, attention_mask=mask).logits - plain(ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-4
    assert calls["conv"] and calls["scan"] and not calls["step"]
    greedy = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(fused.generate(ids, **greedy), plain.generate(ids, **greedy))
    assert calls["step"]  # decode ran the state-step kernel


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("model_type", list(MODELS))
def test_bfloat16_model_with_kernels_stays_within_torch_rounding(model_type, tmp_path):
    """In bfloat16 the kernels (float32 inside, TF32 matmuls) move the logits from the float32 model's no more than
    torch's bfloat16 layers do, give or take a little."""
    from tests.fixtures.checkpoints import make_checkpoint
    from tests.models.parity import left_padded, load

    make_checkpoint(tmp_path, model_type, **MODELS[model_type])
    ids, mask = (t.cuda() for t in left_padded(seq=12, pad=3))
    logits = []
    for kwargs in (dict(), dict(dtype=torch.bfloat16), dict(dtype=torch.bfloat16, use_kernels=True)):
        with torch.no_grad():
            logits.append(load(tmp_path, device_map="cuda", **kwargs)(ids, attention_mask=mask).logits.float())
    exact, plain, fused = (t[mask.bool()] for t in logits)
    assert (fused - exact).abs().max() <= 2 * (plain - exact).abs().max() + 1e-2 * exact.abs().max()


def test_compiled_model_keeps_the_kernels_as_ops(tmp_path):
    """A Mamba2 kernelized with Mode.TORCH_COMPILE compiles into one graph (fullgraph) that calls the conv and scan
    ops, with the eager logits."""
    from gpuformers.kernels import Mode, kernelize
    from tests.fixtures.checkpoints import make_checkpoint
    from tests.kernels.test_compile import OpCounter
    from tests.models.parity import load

    torch._dynamo.reset()
    make_checkpoint(tmp_path, "mamba2", **MODELS["mamba2"])
    plain, fused = load(tmp_path), kernelize(load(tmp_path), mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    counter = OpCounter()
    with torch.no_grad():
        diff = torch.compile(fused, backend=counter, fullgraph=True)(ids).logits - plain(ids).logits
    assert diff.abs().max() < 1e-4
    assert counter.forward["gpuformers::causal_conv1d"] == counter.forward["gpuformers::ssd_chunk_scan"] == 2
    torch._dynamo.reset()


def test_kernel_config_keeps_one_function_in_torch(tmp_path, monkeypatch):
    """KernelConfig names the three functions like any layer: "torch" keeps that one, the others still run."""
    from gpuformers.kernels import KernelConfig
    from tests.fixtures.checkpoints import make_checkpoint
    from tests.models.parity import load

    make_checkpoint(tmp_path, "mamba2", **MODELS["mamba2"])
    model = load(tmp_path, use_kernels=True, kernel_config=KernelConfig({"causal_conv1d": "torch"}))
    calls = _count_kernel_calls(monkeypatch)
    with torch.no_grad():
        model(torch.tensor([[5, 9, 23, 42]]))
    assert calls == {"conv": 0, "scan": 2, "step": 0}  # two layers
    with pytest.raises(ValueError, match="kernel_mapping\\['ssd_chunk_scan'\\]\\['cuda'\\] is 'cuda'"):
        KernelConfig({"ssd_chunk_scan": "cuda"})
