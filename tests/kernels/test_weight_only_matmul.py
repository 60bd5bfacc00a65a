"""The weight-only int8 / int4 matmul kernel against F.linear on the dequantized weight, on layers quantized by
WeightOnlyLinear itself: every storage layout, bias or not, 3-D inputs, edges of M, N and K, split-K, the backward,
torch.compile, clear errors, and when WeightOnlyLinear takes the kernel. GPU cases run bfloat16 / float16 at real
sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.kernels.cases import CUDA, DEVICES, assert_close

from gpuformers.kernels import weight_only_matmul as kernel_module  # noqa: E402
from gpuformers.kernels.weight_only_matmul import (  # noqa: E402
    MatmulConfig, choose_config, weight_only_matmul, weight_only_matmul_forward, weight_only_matmul_reference)
from gpuformers.quantization import weight_only  # noqa: E402
from gpuformers.quantization.weight_only import WeightOnlyLinear  # noqa: E402

needs_gpu = pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
LAYOUTS = [(8, None), (8, 32), (4, 32), (4, 64)]
LAYOUT_IDS = ["int8-channel", "int8-g32", "int4-g32", "int4-g64"]


def _layer(bits, group_size, in_features=128, out_features=48, bias=True, dtype=torch.float32, device="cpu",
           seed=0) -> WeightOnlyLinear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
        if bias:
            linear.bias.normal_(0, 0.1)
    return WeightOnlyLinear.from_linear(linear.to(device), bits, group_size, dtype=dtype)


def _args(layer):
    return layer.qweight, layer.scales, layer.zeros if layer.bits == 4 else None, layer.bits, layer.group_size


def _reference(layer, x):
    return F.linear(x, layer.dequantize(), layer.bias)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Let WeightOnlyLinear take the kernel on the CPU (interpreter) and count its calls."""
    monkeypatch.setattr(weight_only, "TRITON_ON_CPU", True)
    return _count_kernel_calls(monkeypatch)


def _count_kernel_calls(monkeypatch) -> list[int]:
    """The bits of each weight_only_matmul call WeightOnlyLinear makes from now on."""
    calls = []
    real = kernel_module.weight_only_matmul

    def counted(*args, **kwargs):
        calls.append(args[4])  # bits
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "weight_only_matmul", counted)
    return calls


# --- forward ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("bits, group_size", LAYOUTS, ids=LAYOUT_IDS)
def test_layer_forward_equals_dequantize_then_linear(bits, group_size, bias, device, kernel_calls):
    layer = _layer(bits, group_size, bias=bias, device=device)
    x = torch.randn(2, 5, 128, device=device)  # 3-D, M = 10 rows: not a multiple of the 16-row block
    with torch.no_grad():
        out = layer(x)
    assert kernel_calls == [bits]
    assert out.shape == (2, 5, 48) and out.dtype == torch.float32
    assert_close(out, _reference(layer, x), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits, group_size", LAYOUTS, ids=LAYOUT_IDS)
def test_split_k_and_tiles_over_every_edge(bits, group_size, device):
    # 17 rows and 48 outputs over 16 x 32 tiles (2 x 2 tiles, both cut), K = 128 in 4 steps of 32 over 2 programs
    layer = _layer(bits, group_size, device=device, seed=1)
    x = torch.randn(17, 128, device=device)
    config = MatmulConfig(block_m=16, block_n=32, block_k=32, split_k=2)
    out = weight_only_matmul_forward(x, *_args(layer), bias=layer.bias, config=config)
    assert_close(out, _reference(layer, x), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4])
def test_k_that_is_not_a_multiple_of_the_k_step(bits, device):
    layer = _layer(bits, None, in_features=80, out_features=24, device=device)  # one group: K = 80, steps of 64
    x = torch.randn(3, 80, device=device)
    config = MatmulConfig(block_m=16, block_n=32, block_k=64)
    out = weight_only_matmul_forward(x, *_args(layer), bias=layer.bias, config=config)
    assert_close(out, _reference(layer, x), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_float16(device):
    layer = _layer(4, 32, dtype=torch.float16, device=device)
    x = torch.randn(3, 128, device=device, dtype=torch.float16)
    out = weight_only_matmul(x, *_args(layer), bias=layer.bias)
    assert out.dtype == torch.float16
    assert_close(out, F.linear(x.float(), layer.dequantize().float(), layer.bias.float()), torch.float16)


def test_reference_is_the_layers_dequantize_path():
    layer = _layer(4, 32)
    x = torch.randn(3, 128)
    assert torch.equal(weight_only_matmul_reference(x, *_args(layer), bias=layer.bias), _reference(layer, x))


# --- backward --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 64)], ids=["int8-channel", "int4-g64"])
def test_gradients_of_input_and_bias_equal_the_dequantized_reference(bits, group_size, device, kernel_calls):
    layer = _layer(bits, group_size, device=device)
    layer.bias.requires_grad_(True)
    x = torch.randn(2, 3, 128, device=device, requires_grad=True)
    probe = torch.randn(2, 3, 48, device=device)
    got = torch.autograd.grad((layer(x) * probe).sum(), (x, layer.bias))
    want = torch.autograd.grad((_reference(layer, x) * probe).sum(), (x, layer.bias))
    assert kernel_calls == [bits]
    for g, w in zip(got, want):
        assert_close(g, w, torch.float32)
    assert not layer.qweight.requires_grad and layer.qweight.grad is None


def test_only_the_input_needs_a_gradient_under_qlora():
    # QLoRA: the base layer's bias is frozen, the input (from the adapters below) is not.
    layer = _layer(8, 32)
    layer.bias.requires_grad_(False)
    x = torch.randn(4, 128, requires_grad=True)
    out = weight_only_matmul(x, *_args(layer), bias=layer.bias)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert_close(grad, layer.dequantize().sum(0).expand(4, -1), torch.float32)


# --- torch.compile ---------------------------------------------------------------------------------------------

def _counting_backend():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    forward, backward = Counter(), Counter()

    def counting(counts):
        def compiler(gm, example_inputs):
            counts.update(node.target.name() for node in gm.graph.nodes
                          if node.op == "call_function" and getattr(node.target, "namespace", None) == "gpuformers")
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=counting(forward), bw_compiler=counting(backward)), forward


@pytest.mark.parametrize("device", DEVICES)
def test_the_layer_compiles_into_the_op_with_the_same_outputs_and_gradients(device, monkeypatch):
    monkeypatch.setattr(weight_only, "TRITON_ON_CPU", True)
    torch._dynamo.reset()
    layer = _layer(4, 32, device=device)
    x = torch.randn(5, 128, device=device, requires_grad=True)
    backend, forward_ops = _counting_backend()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch._dynamo.reset()
    assert forward_ops == Counter({"gpuformers::weight_only_matmul": 1})
    assert_close(out, _reference(layer, x), torch.float32)
    assert_close(grad, layer.dequantize().sum(0).expand(5, -1), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_the_op_passes_opcheck(device):
    layer = _layer(4, 32, device=device)
    x = torch.randn(3, 128, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.gpuformers.weight_only_matmul,
                          (x, layer.qweight, layer.scales, layer.zeros, 4, 32, layer.bias))


# --- when WeightOnlyLinear takes the kernel --------------------------------------------------------------------

def test_the_cpu_keeps_its_paths_unless_switched_on(monkeypatch):
    # The kernel tests run with TRITON_INTERPRET=1; other CPU tests in the same process must not crawl through it.
    kernel_calls = _count_kernel_calls(monkeypatch)
    layer = _layer(8, None)
    x = torch.randn(2, 128)
    with torch.no_grad():
        layer(x)
        _layer(8, None, dtype=torch.bfloat16)(x.bfloat16())  # the bfloat16 CPU kernel's path
    assert weight_only.TRITON_ON_CPU is False and kernel_calls == []
    monkeypatch.setattr(weight_only, "TRITON_ON_CPU", True)
    with torch.no_grad():
        layer(x)
    assert kernel_calls == [8]


def test_layers_the_kernel_cannot_take_dequantize_as_before(kernel_calls, monkeypatch):
    group_24 = _layer(8, 24, in_features=48)  # 24 has no power-of-two factor >= 16 for the K step
    float64 = _layer(8, None, dtype=torch.float64)
    layer = _layer(4, 32)
    with torch.no_grad():
        x48 = torch.randn(2, 48)
        assert_close(group_24(x48), _reference(group_24, x48), torch.float32)
        float64(torch.randn(2, 128, dtype=torch.float64))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # F.linear's autocast rules, as before
            assert layer(torch.randn(2, 128)).dtype == torch.bfloat16
        assert kernel_calls == []
        monkeypatch.setenv("GPUFORMERS_DISABLE_KERNELS", "1")
        layer(torch.randn(2, 128))
    assert kernel_calls == []


# --- errors ----------------------------------------------------------------------------------------------------

def test_bad_inputs_are_named():
    layer = _layer(4, 32)
    qweight, scales, zeros, bits, group_size = _args(layer)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match=r"bits=3 is not supported"):
        weight_only_matmul(x, qweight, scales, zeros, 3, group_size)
    with pytest.raises(ValueError, match=r"qweight has dtype int8, which is not one of: uint8"):
        weight_only_matmul(x, qweight.to(torch.int8), scales, zeros, bits, group_size)
    with pytest.raises(ValueError, match=r"qweight has shape \(48, 64\), but x has 96 features"):
        weight_only_matmul(torch.randn(2, 96), qweight, scales, zeros, bits, group_size)
    with pytest.raises(ValueError, match=r"scales has shape \(48, 4\), expected \(48, 2\)"):
        weight_only_matmul(x, qweight, scales, zeros, bits, 64)
    with pytest.raises(ValueError, match=r"4-bit weights need zeros"):
        weight_only_matmul(x, qweight, scales, None, bits, group_size)
    with pytest.raises(ValueError, match=r"group_size=24 has no power-of-two factor >= 16"):
        weight_only_matmul(torch.randn(2, 96), _layer(8, 24, in_features=96).qweight, torch.ones(48, 4), None, 8, 24)
    with pytest.raises(ValueError, match=r"group_size=48 does not divide in_features=128"):
        weight_only_matmul(x, qweight, scales, zeros, bits, 48)
    with pytest.raises(ValueError, match=r"bias has 47 entries, expected out_features=48"):
        weight_only_matmul(x, qweight, scales, zeros, bits, group_size, bias=torch.zeros(47))
    with pytest.raises(ValueError, match=r"x must be contiguous in its last dimension"):
        weight_only_matmul(torch.randn(128, 2).t(), qweight, scales, zeros, bits, group_size)
    with pytest.raises(ValueError, match=r"block_n=24 must be a power of two >= 16"):
        MatmulConfig(block_m=16, block_n=24, block_k=16)


def test_config_splits_k_for_decode_only(monkeypatch):
    monkeypatch.setattr(kernel_module, "_multiprocessors", lambda device: 132)  # an H100 / H200
    cuda = torch.device("cuda", 0)
    decode = choose_config(1, 3072, 1024, None, cuda)  # 48 tiles: ~2 programs per SM wants a split of 5 -> 4
    assert (decode.block_m, decode.block_n, decode.block_k, decode.split_k) == (16, 64, 128, 4)
    assert choose_config(1, 12288, 4096, 128, cuda).split_k == 1  # 192 tiles fill the GPU already
    assert choose_config(16, 1024, 3072, 32, cuda).block_k == 32  # one scale per K step
    prefill = choose_config(256, 3072, 1024, 128, cuda)
    assert (prefill.block_m, prefill.block_n, prefill.split_k) == (128, 128, 1)
    assert choose_config(1, 64, 32, None, cuda).split_k == 1  # K has one step only


# --- compiles for a GPU without one ----------------------------------------------------------------------------

_COMPILE_SCRIPT = textwrap.dedent('''
    import json, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gpuformers.kernels import weight_only_matmul as wom

    wom._multiprocessors = lambda device: 132  # an H100 / H200: decode configs split K
    fn, shared = wom._weight_only_matmul_kernel, {}
    # (bits, group size, MXFP4: E2M1 codes with uint8 E8M0 scales, kernels/mxfp4_matmul.py)
    for bits, group_size, mxfp4 in ((8, None, False), (8, 128, False), (4, 128, False), (4, 32, True)):
        for m, n, k in ((1, 3072, 1024), (48, 3072, 1024), (300, 4096, 12288)):
            config = wom.choose_config(m, n, k, group_size, torch.device("cuda", 0))
            constexprs = dict(BITS=bits, MXFP4=mxfp4, SCALE_OUTPUT=bits == 8 and not group_size, HAS_BIAS=True,
                              EVEN_K=False, SPLIT_K=config.split_k, PRECISION="tf32", BLOCK_M=config.block_m,
                              BLOCK_N=config.block_n, BLOCK_K=config.block_k)
            pointers = dict(X="*bf16", Q="*i8" if bits == 8 else "*u8", S="*u8" if mxfp4 else "*bf16", Z="*bf16",
                            B="*bf16", Y="*bf16" if config.split_k == 1 else "*fp32")
            signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
                         for name in fn.arg_names}
            src = ASTSource(fn, signature, {(fn.arg_names.index(key),): v for key, v in constexprs.items()})
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": config.num_warps, "num_stages": config.num_stages})
            shared[f"{'mxfp4' if mxfp4 else f'int{bits}'} g{group_size} M={m}"] = kernel.metadata.shared
    print(json.dumps(shared))
''')


@pytest.mark.slow  # 12 ptxas compiles: about 13 s on 2 cores
def test_compiles_for_sm90_at_the_chosen_configs():
    # The interpreter runs the kernel's Python, not Triton's compiler (see test_compile_for_gpu.py); this catches
    # type errors and shared-memory overflow before a GPU does. A subprocess: this session has TRITON_INTERPRET=1.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shared) == 12 and max(shared.values()) <= 227 * 1024, shared


# --- GPU: bfloat16 / float16 at real sizes ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("bits, group_size", [(8, None), (8, 128), (4, 32), (4, 128)],
                         ids=["int8-channel", "int8-g128", "int4-g32", "int4-g128"])
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 300])
@pytest.mark.gpu
@needs_gpu
def test_gpu_matches_dequantize_then_linear(rows, bits, group_size, dtype):
    layer = _layer(bits, group_size, in_features=1024, out_features=4096, dtype=dtype, device="cuda")
    x = torch.randn(rows, 1024, device="cuda", dtype=dtype)
    out = weight_only_matmul(x, *_args(layer), bias=layer.bias)
    ref = _reference(layer, x)
    # Both accumulate in float32 and round once; they differ by the output's own rounding.
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=1e-2 * ref.abs().max().item())


@pytest.mark.gpu
@needs_gpu
def test_gpu_layer_takes_the_kernel_forward_and_backward(kernel_calls):
    layer = _layer(4, 128, in_features=1024, out_features=4096, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(2, 9, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    assert kernel_calls == [4]
    ref = _reference(layer, x)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=1e-2 * ref.abs().max().item())
    (grad,) = torch.autograd.grad(out.float().sum(), x)
    (want,) = torch.autograd.grad(ref.float().sum(), x)
    torch.testing.assert_close(grad.float(), want.float(), rtol=0, atol=1e-2 * want.abs().max().item())
