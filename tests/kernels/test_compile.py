"""The Triton kernels as torch.library ops (kernels/ops.py) under torch.compile(fullgraph=True): each kernel
function gives the same outputs and gradients compiled as eager, every op passes torch.library.opcheck, and a tiny
model kernelized with Mode.TORCH_COMPILE compiles into one graph that holds the ops and matches the torch model.

Backend: AOTAutograd without code generation (what "aot_eager" does) plus a count of the gpuformers ops in the
forward and backward graphs it runs, so a test fails if the kernels silently stop being used. That exercises
everything Inductor relies on (fake tensors, functionalization, the traced backward) at a small cost; the ops are
custom_ops, which Inductor only calls as they are. One slow test runs Inductor itself (a C++ compile on the CPU).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.kernels.cases import CUDA, DEVICES, rand

from gpuformers.kernels import ops  # noqa: E402
from gpuformers.kernels.attention import flash_attention  # noqa: E402
from gpuformers.kernels.fused_linear_cross_entropy import cross_entropy, fused_linear_cross_entropy  # noqa: E402
from gpuformers.kernels.mapping import Mode, kernelize  # noqa: E402
from gpuformers.kernels.rms_norm import rms_norm  # noqa: E402
from gpuformers.kernels.rotary import apply_rotary, apply_rotary_inplace  # noqa: E402
from gpuformers.kernels.swiglu import silu, silu_and_mul  # noqa: E402

_CPU_ONLY = pytest.mark.skipif(CUDA, reason="CPU interpreter test; the GPU runs the per-kernel compile test")


class OpCounter:
    """A torch.compile backend: AOTAutograd running its graphs as they are, counting the gpuformers ops in them."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.forward, self.backward = Counter(), Counter()

        def counting(counts):
            def compiler(gm, example_inputs):
                counts.update(node.target.name() for node in gm.graph.nodes if node.op == "call_function"
                              and getattr(node.target, "namespace", None) == ops.NAMESPACE)
                return make_boxed_func(gm.forward)

            return compiler

        self._backend = aot_autograd(fw_compiler=counting(self.forward), bw_compiler=counting(self.backward))

    def __call__(self, gm, example_inputs):
        return self._backend(gm, example_inputs)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _cos_sin(batch, seq, head_dim, device="cpu"):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = (torch.arange(seq)[None].float() + torch.arange(batch)[:, None] * 3)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def _labels(n, vocab, device="cpu"):
    torch.manual_seed(5)
    labels = torch.randint(0, vocab, (n,))
    labels[::3] = -100
    return labels.to(device)


def _case(name, device):
    """(function, inputs, the op its forward must run, the ops its backward must run) at tiny float32 sizes."""
    def leaf(*shape, seed):
        return rand(*shape, device=device, grad=True, seed=seed)

    if name in ("rms_norm", "add_rms_norm"):
        x, w = leaf(2, 5, 24, seed=0), (1 + 0.1 * rand(24, device=device, seed=1)).requires_grad_(True)
        if name == "rms_norm":
            return (lambda x, w: rms_norm(x, w, 1e-6)), (x, w), "rms_norm", ["rms_norm_backward"]
        r = leaf(2, 5, 24, seed=2)
        return (lambda x, r, w: rms_norm(x, w, 1e-5, residual=r)), (x, r, w), "add_rms_norm", ["rms_norm_backward"]
    if name == "silu_and_mul":
        return silu_and_mul, (leaf(2, 5, 40, seed=0), leaf(2, 5, 40, seed=1)), name, ["silu_and_mul_backward"]
    if name == "silu":
        return silu, (leaf(3, 40, seed=0),), "silu", ["silu_and_mul_backward"]
    if name == "rotary":
        # q as the model makes it: a transposed view of (batch, seq, heads, head_dim)
        q = rand(2, 5, 3, 16, device=device, seed=0).transpose(1, 2).requires_grad_(True)
        cos, sin = _cos_sin(2, 5, 16, device)
        return (lambda q, k: apply_rotary(q, k, cos, sin)), (q, leaf(2, 1, 5, 16, seed=1)), "rotary", ["rotary"]
    if name == "flash_attention_packed":  # two sequences of 3 and 5 tokens, packed
        q, k, v = leaf(8, 4, 16, seed=0), leaf(8, 2, 16, seed=1), leaf(8, 2, 16, seed=2)
        cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
        fn = lambda q, k, v: flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,  # noqa: E731
                                             max_seqlen_q=5, max_seqlen_k=5)
        return fn, (q, k, v), "flash_attention", ["flash_attention_backward"]
    if name.startswith("flash_attention"):
        q, k, v = leaf(2, 4, 5, 16, seed=0), leaf(2, 2, 7, 16, seed=1), leaf(2, 2, 7, 16, seed=2)
        if name == "flash_attention_mask":
            mask = torch.ones(2, 1, 5, 7, dtype=torch.bool, device=device).tril(2)
            mask[1, :, :, :2] = False  # left padding of the second row
            fn = lambda q, k, v: flash_attention(q, k, v, causal=False, mask=mask)  # noqa: E731
        else:
            fn = lambda q, k, v: flash_attention(q, k, v, sliding_window=4)  # noqa: E731
        return fn, (q, k, v), "flash_attention", ["flash_attention_backward"]
    labels = _labels(9, 37, device)
    if name == "cross_entropy":
        return (lambda logits: cross_entropy(logits, labels)), (leaf(9, 37, seed=0),), name, []
    if name == "fused_linear_cross_entropy":
        fn = lambda h, w: fused_linear_cross_entropy(h, w, labels, chunk_size=4)  # noqa: E731  (3 chunks)
        return fn, (leaf(9, 16, seed=0), leaf(37, 16, seed=1)), name, []
    raise KeyError(name)


CASE_NAMES = ["rms_norm", "add_rms_norm", "silu_and_mul", "silu", "rotary", "flash_attention",
              "flash_attention_mask", "flash_attention_packed", "cross_entropy", "fused_linear_cross_entropy"]


def _outputs_and_grads(fn, inputs):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(7)
    total = sum((o.float() * torch.randn(o.shape).to(o.device)).sum() for o in outs)
    return outs, torch.autograd.grad(total, inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_kernel_compiles_into_its_op_with_the_same_outputs_and_gradients(name, device):
    fn, inputs, forward_op, backward_ops = _case(name, device)
    counter = OpCounter()
    got, got_grads = _outputs_and_grads(torch.compile(fn, backend=counter, fullgraph=True), inputs)
    want, want_grads = _outputs_and_grads(fn, inputs)
    assert counter.forward == Counter({f"gpuformers::{forward_op}": len(got) if name == "rotary" else 1})
    assert counter.backward == Counter({f"gpuformers::{op}": len(got) if name == "rotary" else 1
                                        for op in backward_ops})
    for g, w in zip(got + got_grads, want + want_grads):
        assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@_CPU_ONLY
def test_inference_rotary_compiles_out_of_place():
    q, k = rand(1, 2, 5, 16, seed=0), rand(1, 1, 5, 16, seed=1)
    cos, sin = _cos_sin(1, 5, 16)
    counter = OpCounter()
    with torch.no_grad():
        got = torch.compile(apply_rotary_inplace, backend=counter, fullgraph=True)(q, k, cos, sin)
        want = apply_rotary_inplace(q.clone(), k.clone(), cos, sin)
    assert counter.forward == Counter({"gpuformers::rotary": 2})
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@_CPU_ONLY
def test_packed_attention_under_compile_needs_max_seqlen():
    q, k = rand(8, 2, 16), rand(8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    fn = torch.compile(lambda q, k: flash_attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu), backend="eager",
                       fullgraph=True)
    with pytest.raises(Exception, match="pass max_seqlen_q and max_seqlen_k"):
        fn(q, k)


def _opcheck_args(name):
    x, w = rand(2, 3, 8, seed=0), rand(8, seed=1)
    gate, up = rand(2, 12, seed=2), rand(2, 12, seed=3)
    cos, sin = _cos_sin(1, 3, 8)
    q, k = rand(1, 2, 3, 8, seed=4), rand(1, 1, 3, 8, seed=5)
    labels = _labels(4, 11)
    inv_count = (1 / (labels != -100).sum().float()).reshape(1)
    if name == "rms_norm":
        return x.requires_grad_(True), w.requires_grad_(True), 1e-6
    if name == "add_rms_norm":
        return x.requires_grad_(True), rand(2, 3, 8, grad=True, seed=6), w.requires_grad_(True), 1e-6
    if name == "rms_norm_backward":
        rstd = torch.rsqrt(x.pow(2).mean(-1) + 1e-6).reshape(-1)
        return rand(2, 3, 8, seed=7), x, w, rstd, rand(2, 3, 8, seed=8)
    if name in ("silu_and_mul", "silu"):
        return (gate.requires_grad_(True), up.requires_grad_(True)) if name == "silu_and_mul" else (gate,)
    if name == "silu_and_mul_backward":
        return rand(2, 12, seed=7), gate, up
    if name == "rotary":
        return q.requires_grad_(True), cos, sin, 1, False
    if name == "flash_attention":
        return q.requires_grad_(True), k.requires_grad_(True), rand(1, 1, 3, 8, grad=True, seed=6), True, 0.3, 0, \
            None, None, None, 0, 0
    if name == "flash_attention_backward":
        v = rand(1, 1, 3, 8, seed=6)
        out, lse = ops.flash_attention(q, k, v, True, 0.3, 0, None, None, None, 0, 0)
        return rand(*out.shape, seed=7), q, k, v, out, lse, True, 0.3, 0, None, None, None, 0, 0
    if name == "cross_entropy":
        return rand(4, 11, grad=True, seed=7), labels, inv_count, -100, True
    if name == "fused_linear_cross_entropy":
        return rand(4, 8, grad=True, seed=7), rand(11, 8, grad=True, seed=8), labels, inv_count, -100, 3, True, True
    heads = (-rand(2, seed=9).abs(), rand(2, seed=10), rand(2, seed=11))  # A, D, dt_bias
    # the scan: 5 steps in chunks of 2, 2 heads of 16 in 1 group, state 16, an initial state
    scan = (rand(1, 5, 2, 16, seed=7), rand(1, 5, 2, seed=8), heads[0], rand(1, 5, 1, 16, seed=12),
            rand(1, 5, 1, 16, seed=13), *heads[1:], 2, 0.0, float("inf"), rand(1, 2, 16, 16, seed=14))
    if name == "ssd_chunk_scan":  # differentiable in every tensor
        return tuple(t.requires_grad_() if isinstance(t, torch.Tensor) else t for t in scan)
    if name == "ssd_chunk_scan_backward":  # dy, d final state, the inputs, the final state
        return rand(1, 5, 2, 16, seed=15), rand(1, 2, 16, 16, seed=16), *scan, rand(1, 2, 16, 16, seed=17)
    if name == "ssm_state_step":  # decode only: no gradient
        return (rand(1, 2, 16, 16, seed=14), rand(1, 2, 16, seed=7), rand(1, 2, seed=8), heads[0],
                rand(1, 1, 16, seed=12), rand(1, 1, 16, seed=13), *heads[1:])
    if name == "ssm_state_step_indexed":  # rows 2 and 0 of a pool of 3, stepped in place
        return (rand(3, 2, 16, 16, seed=14), torch.tensor([2, 0]), rand(2, 2, 16, seed=7), rand(2, 2, seed=8),
                heads[0], rand(2, 1, 16, seed=12), rand(2, 1, 16, seed=13), *heads[1:])
    if name == "causal_conv1d_indexed":
        return rand(2, 1, 16, seed=7), rand(3, 16, 3, seed=8), torch.tensor([2, 0]), rand(16, 1, 4, seed=9), None
    conv = rand(2, 3, 16, seed=7), rand(2, 16, 3, seed=8), rand(16, 1, 4, seed=9), rand(16, seed=10)
    if name == "causal_conv1d":
        return tuple(t.requires_grad_() for t in conv)
    if name == "causal_conv1d_backward":  # d out, d new state, the inputs
        return rand(2, 3, 16, seed=11), rand(2, 16, 3, seed=12), *conv
    raise KeyError(name)


@_CPU_ONLY
@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_opcheck(name):
    torch.library.opcheck(getattr(ops, name), _opcheck_args(name))


# --- a tiny model ------------------------------------------------------------------------------------------------

TINY = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def _models(attn_implementation):
    from gpuformers.models.auto import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", **TINY)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype="float32")
    with torch.no_grad():  # norms start at 1: perturb them so a kernel that ignored the weight would show
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    fast = AutoModelForCausalLM.from_config(config, dtype="float32", attn_implementation=attn_implementation)
    fast.load_state_dict(ref.state_dict())
    return ref, fast


@_CPU_ONLY
def test_model_kernelized_for_compile_trains_in_one_graph_with_the_ops():
    ref, fast = _models("triton")
    kernelize(fast, mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
    ref.train(), fast.train()  # train() re-kernelizes, keeping TORCH_COMPILE
    assert fast._kernel_state.mode == Mode.TRAINING | Mode.TORCH_COMPILE
    assert fast.model.norm._kernel_mode == Mode.TRAINING | Mode.TORCH_COMPILE
    torch.manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    labels = ids.clone()
    labels[:, :2] = -100
    counter = OpCounter()
    out = torch.compile(fast, backend=counter, fullgraph=True)(ids, labels=labels)
    out.loss.backward()
    want = ref(ids, labels=labels)
    want.loss.backward()
    assert out.logits is None  # the fused LM head + loss: no full logits
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-5)
    ref_grads = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    layers = TINY["num_hidden_layers"]
    norms = 3 * layers + 1  # input, q and k norms per layer, and the final norm
    assert counter.forward == Counter({
        "gpuformers::rms_norm": norms, "gpuformers::add_rms_norm": layers, "gpuformers::silu_and_mul": layers,
        "gpuformers::rotary": 2 * layers, "gpuformers::flash_attention": layers,
        "gpuformers::fused_linear_cross_entropy": 1,
    })
    assert counter.backward == Counter({
        "gpuformers::rms_norm_backward": norms + layers, "gpuformers::silu_and_mul_backward": layers,
        "gpuformers::rotary": 2 * layers, "gpuformers::flash_attention_backward": layers,
    })


@_CPU_ONLY
def test_compiled_inference_and_per_layer_compile_keep_the_ops():
    ref, fast = _models("sdpa")
    kernelize(fast, mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        want = ref(ids).logits
        whole = OpCounter()
        got = torch.compile(fast, backend=whole, fullgraph=True)(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # One decoder layer compiled while the model runs eagerly (how training stacks compile block by block):
        # the layer reads the kernel choice the model's eager hooks pushed.
        layer = OpCounter()
        fast.model.layers[0] = torch.compile(fast.model.layers[0], backend=layer, fullgraph=True)
        torch.testing.assert_close(fast(ids).logits, want, rtol=1e-4, atol=1e-4)
    layers = TINY["num_hidden_layers"]
    assert whole.forward == Counter({"gpuformers::rms_norm": 3 * layers + 1, "gpuformers::add_rms_norm": layers,
                                     "gpuformers::silu_and_mul": layers, "gpuformers::rotary": 2 * layers})
    assert layer.forward == Counter({"gpuformers::rms_norm": 3, "gpuformers::add_rms_norm": 1,
                                     "gpuformers::silu_and_mul": 1, "gpuformers::rotary": 2})


@_CPU_ONLY
@pytest.mark.slow  # Inductor's C++ compile of two graphs: about 10 s on 2 cores
def test_inductor_calls_the_ops():
    x, w = rand(3, 40, grad=True, seed=0), rand(40, grad=True, seed=1)
    up = rand(3, 40, grad=True, seed=2)

    def fn(x, w, up):
        return silu_and_mul(rms_norm(x, w), up) * 2

    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    (got, got_grads), code = run_and_get_code(_outputs_and_grads, compiled, (x, w, up))
    assert "torch.ops.gpuformers.rms_norm.default" in code[0] and "gpuformers.silu_and_mul.default" in code[0]
    want, want_grads = _outputs_and_grads(fn, (x, w, up))
    for g, v in zip(got + got_grads, want + want_grads):
        torch.testing.assert_close(g, v, rtol=1e-5, atol=1e-6)
