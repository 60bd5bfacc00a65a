"""The fused MoE kernel (kernels/moe.py) against the torch SparseMoeBlock: routing cases one by one, a tiny
Qwen3-MoE with use_kernels=True against the same model without, the expert weights stacked in one buffer
(saving, dtype changes, in-place updates, training afterwards), and real Qwen3-30B-A3B block sizes on the GPU."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.kernels.cases import CUDA, assert_close

import gpuformers.kernels.mapping as mapping  # noqa: E402
import gpuformers.kernels.moe as moe_kernels  # noqa: E402
from gpuformers.kernels.mapping import Mode, kernelize  # noqa: E402
from gpuformers.kernels.moe import (  # noqa: E402
    align_by_expert,
    fused_moe,
    fused_moe_reference,
    sparse_moe_forward,
    stacked_expert_weights,
    unstack_expert_weights,
)
from gpuformers.layers.moe import SparseMoeBlock  # noqa: E402

_CPU_ONLY = pytest.mark.skipif(CUDA, reason="CPU interpreter test; the GPU runs test_real_block_sizes_bf16")
HIDDEN, INTER = 32, 16


def _block(experts=8, top_k=2, norm=True, seed=0):
    torch.manual_seed(seed)
    block = SparseMoeBlock(HIDDEN, INTER, experts, top_k, norm)
    with torch.no_grad():
        block.gate.weight.normal_(0, 1)  # routing that differs between tokens
    return block.eval()


def _force_routing(block, favourites: dict[int, float]):
    """Router row e = score * (1, ..., 1) for the favoured experts, 0 for the others: every token with positive
    entries ranks the experts by score."""
    with torch.no_grad():
        block.gate.weight.zero_()
        for expert, score in favourites.items():
            block.gate.weight[expert] = score


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    original = moe_kernels.fused_moe_forward
    monkeypatch.setattr(moe_kernels, "fused_moe_forward", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    return calls


def _compare(block, x, kernel_calls):
    calls = len(kernel_calls)
    with torch.no_grad():
        want = block(x)
        got = sparse_moe_forward(block, x)
    assert len(kernel_calls) == calls + 1, "the fused kernel did not run"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return got


@_CPU_ONLY
@pytest.mark.parametrize("norm", [True, False], ids=["normalised", "unnormalised"])
def test_kernel_matches_torch_block(norm, kernel_calls):
    _compare(_block(norm=norm), torch.randn(7, HIDDEN), kernel_calls)


@_CPU_ONLY
@pytest.mark.parametrize("tokens,block_m", [(70, 32), (140, 64)])
def test_prefill_sized_row_blocks(tokens, block_m, kernel_calls):
    # about tokens * top_k / experts rows per expert: the launcher takes taller row blocks
    assert moe_kernels._block_m(tokens * 2, 4) == block_m
    _compare(_block(experts=4, seed=tokens), torch.randn(tokens, HIDDEN), kernel_calls)


@_CPU_ONLY
def test_three_dimensional_input(kernel_calls):
    got = _compare(_block(experts=4, seed=1), torch.randn(2, 3, HIDDEN), kernel_calls)
    assert got.shape == (2, 3, HIDDEN)


@_CPU_ONLY
def test_idle_expert_and_all_tokens_to_one_expert(kernel_calls):
    block = _block()
    x = torch.randn(7, HIDDEN).abs()
    _force_routing(block, {5: 1.0, 2: 0.5, 6: -1.0})  # every token: experts 5 and 2; six experts get nothing
    _compare(block, x, kernel_calls)
    one = _block(top_k=1, norm=False)
    _force_routing(one, {3: 1.0})
    # 17 tokens to expert 3: its run crosses a row block (16 rows at this size)
    _compare(one, torch.randn(17, HIDDEN).abs(), kernel_calls)


def test_align_by_expert_groups_and_pads_runs():
    ids = torch.tensor([[0, 2], [2, 5], [2, 0]])  # assignments 0..5 = (token, k) row-major
    sorted_ids, block_expert = align_by_expert(ids, num_experts=8, block_m=4)
    n = 6  # the padding sentinel
    assert sorted_ids.tolist()[:12] == [0, 5, n, n, 1, 2, 4, n, 3, n, n, n]
    assert (sorted_ids[12:] == n).all()
    assert block_expert.tolist()[:3] == [0, 2, 5] and (block_expert[3:] == -1).all()


@_CPU_ONLY
def test_fused_moe_on_stacked_tensors_and_its_errors():
    torch.manual_seed(3)
    x, w13, w2 = torch.randn(5, HIDDEN), torch.randn(4, 2 * INTER, HIDDEN) / 6, torch.randn(4, HIDDEN, INTER) / 4
    ids = torch.randint(0, 4, (5, 3))
    weights = torch.rand(5, 3)
    assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_reference(x, w13, w2, weights, ids), torch.float32)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, HIDDEN)
    with pytest.raises(ValueError, match=r"w13 \(4, 30, 32\) and w2 \(4, 32, 16\) must be"):
        fused_moe(x, torch.randn(4, 30, HIDDEN), w2, weights, ids)
    with pytest.raises(ValueError, match=r"topk_weights \(5, 2\) and topk_ids \(5, 3\) must both be"):
        fused_moe(x, w13, w2, weights[:, :2], ids)
    with pytest.raises(ValueError, match="these tensors must share one dtype"):
        fused_moe(x.half(), w13, w2, weights, ids)


@_CPU_ONLY
def test_compiled_block_records_the_op():
    from torch._dynamo.testing import EagerAndRecordGraphs

    block = _block()
    kernelize(block, mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
    x = torch.randn(2, 5, HIDDEN)
    backend = EagerAndRecordGraphs()
    with torch.no_grad():
        want = SparseMoeBlock.forward(block, x)
        got = torch.compile(block, backend=backend)(x)
        _, weights, ids = block.gate(x.reshape(-1, HIDDEN))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert any("gpuformers.fused_moe" in graph.code for graph in backend.graphs)
    w13, w2 = stacked_expert_weights(block)
    torch.library.opcheck(torch.ops.gpuformers.fused_moe.default, (x.reshape(-1, HIDDEN), w13, w2, weights, ids))


# --- the expert weights in one buffer -----------------------------------------------------------------------

def _storages(block):
    return {p.untyped_storage().data_ptr() for e in block.experts for p in e.parameters()}


@_CPU_ONLY
def test_stacking_keeps_parameters_and_numbers(kernel_calls):
    block = _block()
    before = {name: (p, p.detach().clone()) for name, p in block.named_parameters()}
    _compare(block, torch.randn(3, HIDDEN), kernel_calls)
    assert len(_storages(block)) == 1  # every expert weight is a slice of one buffer: no second copy
    for name, p in block.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
    w13, w2 = stacked_expert_weights(block)
    assert torch.equal(w13[4, INTER:], block.experts[4].up_proj.weight)
    assert torch.equal(w2[7], block.experts[7].down_proj.weight)
    # in-place changes (an optimizer step, load_state_dict) reach the kernel
    with torch.no_grad():
        block.experts[2].down_proj.weight.mul_(-3)
        block.experts[5].load_state_dict({k: v * 2 for k, v in block.experts[5].state_dict().items()})
    _compare(block, torch.randn(7, HIDDEN), kernel_calls)
    assert len(_storages(block)) == 1


@_CPU_ONLY
def test_dtype_change_and_replaced_weights_restack(kernel_calls):
    block = _block()
    _compare(block, torch.randn(5, HIDDEN), kernel_calls)
    block.half()  # every weight gets new storage: the next kernel forward stacks again
    assert len(_storages(block)) == 3 * 8
    x = torch.randn(5, HIDDEN).half()
    with torch.no_grad():
        got, want = sparse_moe_forward(block, x), block(x)
    assert got.dtype == torch.float16 and len(_storages(block)) == 1
    assert_close(got, want, torch.float16)
    block.float()
    state = {k: torch.randn_like(v) / 5 for k, v in block.state_dict().items()}
    block.load_state_dict(state, assign=True)  # new Parameter objects
    _compare(block, torch.randn(5, HIDDEN), kernel_calls)
    for name, p in block.named_parameters():
        assert torch.equal(p, state[name]), name


@_CPU_ONLY
def test_unstack_after_replacing_a_middle_expert(kernel_calls):
    block = _block()
    _compare(block, torch.randn(5, HIDDEN), kernel_calls)
    block.experts[4].gate_proj.weight = torch.nn.Parameter(torch.randn(INTER, HIDDEN))  # by hand: not seen
    unstack_expert_weights(block)  # the documented remedy
    assert len(_storages(block)) == 3 * 8
    _compare(block, torch.randn(5, HIDDEN), kernel_calls)
    assert len(_storages(block)) == 1


@_CPU_ONLY
def test_unstackable_experts_keep_the_torch_forward(kernel_calls, caplog, monkeypatch):
    monkeypatch.setattr(mapping, "_WARNED", set())
    class Wrapped(torch.nn.Module):  # as LoRA or quantization wrap a Linear: no .weight of its own
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, x):
            return self.base(x)

    block = _block()
    block.experts[3].up_proj = torch.nn.Linear(HIDDEN, INTER, bias=True)
    x = torch.randn(4, HIDDEN)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="gpuformers.kernels.mapping"):
        torch.testing.assert_close(sparse_moe_forward(block, x), block(x))
        block.experts[3].up_proj.bias = None
        block.experts[0].down_proj = Wrapped(block.experts[0].down_proj)  # the first expert, checked every call
        torch.testing.assert_close(sparse_moe_forward(block, x), block(x))
    assert not kernel_calls
    assert "experts.3.up_proj is a Linear, not an nn.Linear without bias" in caplog.text
    assert "experts.0.down_proj is a Wrapped, not an nn.Linear without bias" in caplog.text


@_CPU_ONLY
def test_gradients_take_the_torch_path(kernel_calls):
    block = _block()
    x = torch.randn(4, HIDDEN, requires_grad=True)
    out = sparse_moe_forward(block, x)  # grad enabled, weights require grad: the kernel has no backward
    assert not kernel_calls
    out.sum().backward()
    assert x.grad is not None and any(e.down_proj.weight.grad is not None for e in block.experts)


# --- a tiny Qwen3-MoE ---------------------------------------------------------------------------------------

TINY_MOE = dict(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=INTER,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64, mlp_only_layers=[],
                decoder_sparse_step=1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from gpuformers.models.auto import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("qwen3-moe-kernels")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **TINY_MOE), dtype="float32")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # routing that differs between tokens
    model.save_pretrained(folder)
    return folder


def _load(folder, **kwargs):
    from gpuformers.models.auto import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, progress=False, dtype="float32", **kwargs)


def _ids():
    return torch.randint(0, TINY_MOE["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))


@_CPU_ONLY
def test_kernelized_model_gives_the_same_logits_and_tokens(moe_dir, kernel_calls):
    ref, fast = _load(moe_dir), _load(moe_dir, use_kernels=True)
    blocks = [layer.mlp for layer in fast.model.layers]
    assert all(b.forward.__func__ is sparse_moe_forward and b._kernel_mode == Mode.INFERENCE for b in blocks)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)
    assert len(kernel_calls) == TINY_MOE["num_hidden_layers"]
    greedy = dict(max_new_tokens=3, do_sample=False, eos_token_id=None)
    assert torch.equal(fast.generate(ids, **greedy), ref.generate(ids, **greedy))
    assert len(kernel_calls) == 4 * TINY_MOE["num_hidden_layers"]  # prefill and two decode steps ran the kernel


@_CPU_ONLY
def test_save_after_stacking_and_training_afterwards(moe_dir, tmp_path, kernel_calls):
    ref, fast = _load(moe_dir), _load(moe_dir, use_kernels=True)
    ids = _ids()
    with torch.inference_mode():  # the first kernel forward stacks the experts, here under inference_mode
        fast(ids)
    assert len(_storages(fast.model.layers[0].mlp)) == 1
    fast.save_pretrained(tmp_path)
    back = _load(tmp_path)
    ref_state = ref.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name
    # training after that: the torch block (no backward in the kernel), on the same stacked Parameters
    fast.train()
    assert fast.model.layers[0].mlp.forward.__func__ is mapping._torch_forward
    ref.train()
    fast(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        if ref_params[name].grad is not None:
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():  # an optimizer-like step in place, then inference sees it
        for p in fast.parameters():
            p.sub_(p.grad if p.grad is not None else 0.0, alpha=0.1)
        for p in ref.parameters():
            p.sub_(p.grad if p.grad is not None else 0.0, alpha=0.1)
    fast.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_kernel_config_can_keep_the_torch_block(moe_dir):
    from gpuformers.kernels.mapping import KernelConfig

    if not mapping.kernels_available("cpu")[0]:
        pytest.skip("needs TRITON_INTERPRET=1")
    model = _load(moe_dir, use_kernels=True, kernel_config=KernelConfig(kernel_mapping={"SparseMoeBlock": "torch"}))
    assert "forward" not in model.model.layers[0].mlp.__dict__
    kernelize(model, mode=Mode.INFERENCE, kernel_config=KernelConfig())
    assert model.model.layers[0].mlp.forward.__func__ is sparse_moe_forward


_COMPILE_SCRIPT = textwrap.dedent('''
    import json, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gpuformers.kernels import moe

    def build(fn, pointers, constexprs):
        signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in fn.arg_names}
        src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constexprs.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
        return kernel.metadata.shared

    shared = {}
    for ptr, precision in (("*bf16", "tf32"), ("*fp32", "ieee")):
        for block_m, block_n in ((16, 32), (64, 64)):  # the decode and prefill tiles fused_moe_forward picks
            tiles = dict(PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64)
            ids = dict(SORTED_IDS="*i32", BLOCK_EXPERT="*i32")
            shared[f"gate_up {ptr} {block_m}"] = build(moe._gate_up_kernel, dict(X=ptr, W=ptr, ACT=ptr, **ids), tiles)
            shared[f"down {ptr} {block_m}"] = build(moe._down_kernel, dict(ACT=ptr, W=ptr, ROUTER_WEIGHTS=ptr, Y=ptr,
                                                                          **ids), tiles)
    print(json.dumps(shared))
''')


@pytest.mark.slow  # ptxas on 2 cores: a few seconds
def test_kernels_compile_for_sm90():
    """The interpreter runs the kernels' Python, not Triton's compiler: compile both for Hopper, no GPU needed
    (in a subprocess, since this session has TRITON_INTERPRET=1 set)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shared) == 8 and max(shared.values()) <= 227 * 1024  # sm_90's shared memory per block


# --- GPU: Qwen3-30B-A3B block sizes in bfloat16 -------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_30b_block():
    torch.manual_seed(0)
    with torch.device("cuda"):
        block = SparseMoeBlock(2048, 768, 128, 8, True)
        torch.nn.init.normal_(block.gate.weight, std=0.02)
    return block.to(torch.bfloat16).eval()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
def test_real_block_sizes_bf16(qwen3_30b_block, tokens, kernel_calls):
    block = qwen3_30b_block
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        want = block(x)
        got = sparse_moe_forward(block, x)
        w13, w2 = stacked_expert_weights(block)
        exact = fused_moe_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert kernel_calls and len(_storages(block)) == 1
    scale = exact.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)
    # the kernel is no further from the float32 result than the bfloat16 torch block is
    assert (got.float() - exact).abs().max() <= 2 * (want.float() - exact).abs().max() + 1e-3 * scale
