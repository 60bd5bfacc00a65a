"""Benchmark: each Triton kernel against torch eager and torch.compile at model-sized shapes.

The claims (issue 5): each memory-bound kernel (RMSNorm, residual-add + RMSNorm, SwiGLU, rotary) reaches 70% or
more of the card's measured copy bandwidth; the attention forward reaches 50% or more of the measured bfloat16
matmul rate at 4k+ tokens; the fused linear + cross-entropy peaks at a quarter or less of the unfused memory; a
Qwen3-0.6B-shaped model gives the same logits with use_kernels=True. The MoE block (Qwen3-30B-A3B shape: hidden 2048,
expert intermediate 768, 128 experts, top 8, at 1, 64 and 1024 tokens) is timed as the fused grouped-GEMM kernel
against the torch expert loop in the same run, with the ratio (no target is claimed for it yet). The Mamba2 mixer's
kernels (Mamba2-2.7B mixer: 80 heads of 64, state 128, chunks of 256, conv of 4) are timed the same way against their
torch functions: the conv and the chunked scan over a 4096-token prompt, the conv update and the state step for 64
decoding sequences.

Shapes: Qwen3-0.6B (hidden 1024, intermediate 3072, 16 heads / 8 kv heads of 128) and Qwen3-8B (hidden 4096,
intermediate 12288, 32 / 8 heads of 128), 1 to 16k tokens, vocab 151936. The peak rates are measured in the same
run (a 1 GiB device-to-device copy; an 8192^3 bfloat16 matmul), so the percentages need no datasheet.

    python benchmarks/bench_kernels.py --quick --out results.json     # GPU, a few minutes (scripts/gpu_check.sh)
    python benchmarks/bench_kernels.py                                # GPU, every shape
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --smoke     # CPU: tiny shapes, checks the script runs
                                                                      # (interpreter timings mean nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MODELS = {
    "qwen3-0.6b": dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, vocab=151936),
    "qwen3-8b": dict(hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936),
}
SMOKE_MODEL = dict(hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16, vocab=300)


def timed(fn, device) -> float:
    """Milliseconds per call (median of many on the GPU; best of 3 on the CPU)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def copy_bandwidth(device) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written)."""
    n = (1 << 30) // 2 if device.type == "cuda" else 1 << 22
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def matmul_rate(device, dtype) -> float:
    """TFLOP/s of a large square matmul."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = timed(lambda: a @ b, device)
    return 2 * n**3 / ms / 1e9


class Table:
    def __init__(self, bandwidth, flops):
        self.rows, self.bandwidth, self.flops = [], bandwidth, flops

    def add(self, kernel, shape, impl, fn, device, gbytes=None, tflop=None):
        try:
            ms = timed(fn, device)
        except Exception as err:  # one broken row must not hide the rest of the table
            self.rows.append(dict(kernel=kernel, shape=shape, impl=impl, error=f"{type(err).__name__}: {err}"[:300]))
            print(f"{kernel:<24} {shape:<28} {impl:<10} ERROR {self.rows[-1]['error']}", flush=True)
            return
        row = dict(kernel=kernel, shape=shape, impl=impl, ms=round(ms, 4))
        if gbytes is not None:
            row["GB/s"] = round(gbytes / ms * 1e3, 1)
            row["% copy bw"] = round(100 * row["GB/s"] / self.bandwidth, 1) if self.bandwidth else None
        if tflop is not None:
            row["TFLOP/s"] = round(tflop / ms * 1e3, 2)
            row["% matmul"] = round(100 * row["TFLOP/s"] / self.flops, 1) if self.flops else None
        self.rows.append(row)
        rate = f"{row.get('GB/s', row.get('TFLOP/s'))} {'GB/s' if gbytes is not None else 'TFLOP/s'}"
        pct = row.get("% copy bw", row.get("% matmul"))
        print(f"{kernel:<24} {shape:<28} {impl:<10} {ms:9.4f} ms  {rate:>16}  {pct}%", flush=True)


def compiled(fn, enabled):
    return torch.compile(fn, dynamic=True) if enabled else None


def bench_memory_bound(table, models, token_counts, device, dtype, compile_refs):
    from gpuformers.kernels.rms_norm import rms_norm, rms_norm_reference
    from gpuformers.kernels.rotary import apply_rotary_inplace
    from gpuformers.kernels.swiglu import silu_and_mul, swiglu_reference
    from gpuformers.layers.rotary import apply_rotary_pos_emb

    rotary_reference = apply_rotary_pos_emb.torch_function  # the torch computation the kernel replaces

    size = torch.finfo(dtype).bits // 8
    rms_c, swi_c, rot_c = (compiled(f, compile_refs) for f in (rms_norm_reference, swiglu_reference, rotary_reference))
    for model, m in models.items():
        for tokens in token_counts:
            shape = f"{model} x{tokens}"
            x = torch.randn(tokens, m["hidden"], device=device, dtype=dtype)
            res = torch.randn_like(x)
            w = torch.ones(m["hidden"], device=device, dtype=dtype)
            gb = 2 * x.numel() * size / 1e9
            table.add("rms_norm", shape, "triton", lambda: rms_norm(x, w, 1e-6), device, gbytes=gb)
            table.add("rms_norm", shape, "torch", lambda: rms_norm_reference(x, w, 1e-6), device, gbytes=gb)
            if rms_c:
                table.add("rms_norm", shape, "compile", lambda: rms_c(x, w, 1e-6), device, gbytes=gb)
            table.add("add_rms_norm", shape, "triton", lambda: rms_norm(x, w, 1e-6, residual=res), device,
                      gbytes=2 * gb)
            table.add("add_rms_norm", shape, "torch", lambda: rms_norm_reference(x, w, 1e-6, residual=res), device,
                      gbytes=2 * gb)
            if rms_c:
                table.add("add_rms_norm", shape, "compile", lambda: rms_c(x, w, 1e-6, residual=res), device,
                          gbytes=2 * gb)
            # backward: reads dy and x, writes dx
            xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            dy = torch.randn_like(x)
            table.add("rms_norm fwd+bwd", shape, "triton",
                      lambda: torch.autograd.grad(rms_norm(xg, wg, 1e-6), (xg, wg), dy), device, gbytes=2.5 * gb)
            table.add("rms_norm fwd+bwd", shape, "torch",
                      lambda: torch.autograd.grad(rms_norm_reference(xg, wg, 1e-6), (xg, wg), dy), device,
                      gbytes=2.5 * gb)

            gate = torch.randn(tokens, m["intermediate"], device=device, dtype=dtype)
            up = torch.randn_like(gate)
            gb = 3 * gate.numel() * size / 1e9
            table.add("swiglu", shape, "triton", lambda: silu_and_mul(gate, up), device, gbytes=gb)
            table.add("swiglu", shape, "torch", lambda: swiglu_reference(gate, up), device, gbytes=gb)
            if swi_c:
                table.add("swiglu", shape, "compile", lambda: swi_c(gate, up), device, gbytes=gb)
            gg, ug = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
            dy = torch.randn_like(gate)
            table.add("swiglu fwd+bwd", shape, "triton",
                      lambda: torch.autograd.grad(silu_and_mul(gg, ug), (gg, ug), dy), device, gbytes=gb * 8 / 3)
            table.add("swiglu fwd+bwd", shape, "torch",
                      lambda: torch.autograd.grad(swiglu_reference(gg, ug), (gg, ug), dy), device, gbytes=gb * 8 / 3)

            q = torch.randn(1, tokens, m["heads"], m["head_dim"], device=device, dtype=dtype).transpose(1, 2)
            k = torch.randn(1, tokens, m["kv_heads"], m["head_dim"], device=device, dtype=dtype).transpose(1, 2)
            cos = torch.randn(1, tokens, m["head_dim"], device=device, dtype=dtype)
            sin = torch.randn_like(cos)
            gb = 2 * (q.numel() + k.numel()) * size / 1e9
            table.add("rotary (in place)", shape, "triton", lambda: apply_rotary_inplace(q, k, cos, sin), device,
                      gbytes=gb)
            table.add("rotary (in place)", shape, "torch", lambda: rotary_reference(q, k, cos, sin), device, gbytes=gb)
            if rot_c:
                table.add("rotary (in place)", shape, "compile", lambda: rot_c(q, k, cos, sin), device, gbytes=gb)


def bench_attention(table, models, seq_lens, device, dtype):
    from gpuformers.kernels.attention import flash_attention

    for model, m in models.items():
        for seq in seq_lens:
            shape = f"{model} seq{seq} causal"
            q = torch.randn(1, m["heads"], seq, m["head_dim"], device=device, dtype=dtype)
            k = torch.randn(1, m["kv_heads"], seq, m["head_dim"], device=device, dtype=dtype)
            v = torch.randn_like(k)
            visible = seq * (seq + 1) / 2  # causal (query, key) pairs
            tflop = 4 * m["heads"] * m["head_dim"] * visible / 1e12  # two matmuls, 2 flops per multiply-add
            table.add("attention fwd", shape, "triton", lambda: flash_attention(q, k, v, causal=True), device,
                      tflop=tflop)
            table.add("attention fwd", shape, "sdpa",
                      lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), device,
                      tflop=tflop)
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            dout = torch.randn_like(q)
            table.add("attention fwd+bwd", shape, "triton",
                      lambda: torch.autograd.grad(flash_attention(qg, kg, vg, causal=True), (qg, kg, vg), dout),
                      device, tflop=3.5 * tflop)  # backward = 2.5x the forward's matmul work
            table.add("attention fwd+bwd", shape, "sdpa",
                      lambda: torch.autograd.grad(F.scaled_dot_product_attention(qg, kg, vg, is_causal=True,
                                                                                 enable_gqa=True), (qg, kg, vg), dout),
                      device, tflop=3.5 * tflop)


def bench_fused_loss(table, models, tokens, device, dtype):
    from gpuformers.kernels.fused_linear_cross_entropy import (
        fused_linear_cross_entropy,
        fused_linear_cross_entropy_reference,
    )

    memory = []
    for model, m in models.items():
        shape = f"{model} x{tokens} vocab{m['vocab']}"
        h = torch.randn(tokens, m["hidden"], device=device, dtype=dtype, requires_grad=True)
        w = (torch.randn(m["vocab"], m["hidden"], device=device, dtype=dtype) * 0.02).requires_grad_(True)
        labels = torch.randint(0, m["vocab"], (tokens,), device=device)
        peaks = {}
        for impl, fn in (("triton", fused_linear_cross_entropy), ("torch", fused_linear_cross_entropy_reference)):
            def step(fn=fn):
                return torch.autograd.grad(fn(h, w, labels), (h, w))

            peaks[impl] = _peak_bytes(step, device)
            flops = 3 * 2 * tokens * m["hidden"] * m["vocab"] / 1e12  # logits + two gradient matmuls
            table.add("linear+CE fwd+bwd", shape, impl, step, device, tflop=flops)
        if peaks["torch"]:
            memory.append(dict(shape=shape, fused_peak_GB=round(peaks["triton"] / 1e9, 3),
                               unfused_peak_GB=round(peaks["torch"] / 1e9, 3),
                               ratio=round(peaks["triton"] / peaks["torch"], 3)))
            print(f"linear+CE peak memory {shape}: fused {memory[-1]['fused_peak_GB']} GB, unfused "
                  f"{memory[-1]['unfused_peak_GB']} GB, ratio {memory[-1]['ratio']}", flush=True)
    return memory


def _peak_bytes(fn, device) -> int:
    if device.type != "cuda":
        fn()
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


MOE_BLOCK = dict(hidden=2048, intermediate=768, experts=128, top_k=8)  # Qwen3-30B-A3B
SMOKE_MOE_BLOCK = dict(hidden=64, intermediate=32, experts=8, top_k=2)


def bench_moe(table, device, dtype, smoke: bool):
    """One SparseMoeBlock: the fused Triton experts (use_kernels=True at inference) against its torch expert loop."""
    from gpuformers.kernels.moe import sparse_moe_forward
    from gpuformers.layers.moe import SparseMoeBlock

    m = SMOKE_MOE_BLOCK if smoke else MOE_BLOCK
    torch.manual_seed(0)
    with torch.device(device):
        block = SparseMoeBlock(m["hidden"], m["intermediate"], m["experts"], m["top_k"], norm_topk_prob=True)
        torch.nn.init.normal_(block.gate.weight, std=0.02)
    block = block.to(dtype).eval()
    ratios = []
    for tokens in ((1, 17) if smoke else (1, 64, 1024)):
        shape = f"qwen3-30b-a3b x{tokens}" if not smoke else f"smoke x{tokens}"
        x = torch.randn(tokens, m["hidden"], device=device, dtype=dtype)
        tflop = 2 * 3 * tokens * m["top_k"] * m["hidden"] * m["intermediate"] / 1e12
        with torch.no_grad():
            got, want = sparse_moe_forward(block, x), block(x)  # the first kernel call stacks the experts
            error = float((got.float() - want.float()).abs().max())
            times = {}
            for impl, fn in (("triton", lambda: sparse_moe_forward(block, x)), ("torch", lambda: block(x))):
                table.add("moe block", shape, impl, fn, device, tflop=tflop)
                times[impl] = table.rows[-1].get("ms")
        ratio = round(times["torch"] / times["triton"], 2) if times["torch"] and times["triton"] else None
        ratios.append(dict(shape=shape, triton_ms=times["triton"], torch_ms=times["torch"], speedup=ratio,
                           max_abs_diff=error, output_scale=float(want.float().abs().max())))
        print(f"moe block {shape}: torch loop / triton = {ratio}, max |diff| {error:.3g}", flush=True)
    return ratios


MAMBA2_MIXER = dict(heads=80, head_dim=64, state=128, groups=1, chunk=256, conv_kernel=4)  # Mamba2-2.7B
SMOKE_MAMBA2_MIXER = dict(heads=4, head_dim=16, state=16, groups=2, chunk=8, conv_kernel=4)


def bench_ssd(table, device, dtype, smoke: bool):
    """The Mamba2 mixer's kernels (use_kernels=True at inference) against their torch functions, same run: the conv
    and the chunked scan over one prompt, the conv update and the state step for a batch of decoding sequences."""
    from gpuformers.kernels.causal_conv1d import causal_conv1d_forward
    from gpuformers.kernels.ssd import ssd_chunk_scan_forward, ssm_state_step_forward
    from gpuformers.layers.mamba2 import causal_conv1d
    from gpuformers.layers.ssd import ssd_chunk_scan, ssm_state_step

    m = SMOKE_MAMBA2_MIXER if smoke else MAMBA2_MIXER
    heads, p, n, g = m["heads"], m["head_dim"], m["state"], m["groups"]
    channels = heads * p + 2 * g * n
    torch.manual_seed(0)
    weight = torch.randn(channels, 1, m["conv_kernel"], device=device, dtype=dtype) * 0.5
    bias = torch.randn(channels, device=device, dtype=dtype)
    A = -torch.rand(heads, device=device) - 0.5  # float32, as the layer computes it
    D, dt_bias = torch.randn(heads, device=device), torch.randn(heads, device=device)
    name = "smoke" if smoke else "mamba2-2.7b"
    results = []

    def compare(kernel, shape, pair, gbytes=None, tflop=None):
        got, want = pair[0](), pair[1]()
        error = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
        times = {}
        for impl, fn in zip(("triton", "torch"), pair):
            table.add(kernel, shape, impl, fn, device, gbytes=gbytes, tflop=tflop)
            times[impl] = table.rows[-1].get("ms")
        ratio = round(times["torch"] / times["triton"], 2) if times["torch"] and times["triton"] else None
        results.append(dict(kernel=kernel, shape=shape, triton_ms=times["triton"], torch_ms=times["torch"],
                            speedup=ratio, max_abs_diff=error, output_scale=float(want[0].float().abs().max())))
        print(f"{kernel} {shape}: torch / triton = {ratio}, max |diff| {error:.3g}", flush=True)

    with torch.no_grad():
        for tokens in ((24,) if smoke else (4096,)):
            xbc = torch.randn(1, tokens, channels, device=device, dtype=dtype)
            shape = f"{name} x{tokens}"
            size = xbc.element_size()
            compare("mamba conv1d", shape, (lambda: causal_conv1d_forward(xbc, None, weight, bias),
                                            lambda: causal_conv1d.torch_function(xbc, None, weight, bias)),
                    gbytes=2 * xbc.numel() * size / 1e9)
            x = torch.randn(1, tokens, heads, p, device=device, dtype=dtype)
            dt = torch.randn(1, tokens, heads, device=device, dtype=dtype)
            B, C = (torch.randn(1, tokens, g, n, device=device, dtype=dtype) for _ in range(2))
            args = (x, dt, A, B, C, D, dt_bias, m["chunk"], (0.0, float("inf")))
            q = m["chunk"]
            tflop = 2 * tokens * heads * (q * (n + p) + 2 * p * n) / 1e12  # scores, outputs, states
            compare("ssd chunk scan", shape, (lambda: ssd_chunk_scan_forward(*args), lambda: ssd_chunk_scan(*args)),
                    tflop=tflop)
        for batch in ((3,) if smoke else (64,)):
            shape = f"{name} decode x{batch}"
            xbc = torch.randn(batch, 1, channels, device=device, dtype=dtype)
            state = torch.randn(batch, channels, m["conv_kernel"] - 1, device=device, dtype=dtype)
            compare("mamba conv1d update", shape, (lambda: causal_conv1d_forward(xbc, state, weight, bias),
                                                   lambda: causal_conv1d.torch_function(xbc, state, weight, bias)),
                    gbytes=2 * (xbc.numel() + state.numel()) * xbc.element_size() / 1e9)
            ssm = torch.randn(batch, heads, p, n, device=device)
            x = torch.randn(batch, heads, p, device=device, dtype=dtype)
            dt = torch.randn(batch, heads, device=device, dtype=dtype)
            B, C = (torch.randn(batch, g, n, device=device, dtype=dtype) for _ in range(2))
            args = (ssm, x, dt, A, B, C, D, dt_bias)
            compare("ssm state step", shape, (lambda: ssm_state_step_forward(*args), lambda: ssm_state_step(*args)),
                    gbytes=2 * ssm.numel() * 4 / 1e9)  # the float32 state read and written
    return results


def bench_model(device, dtype, smoke: bool):
    """A Qwen3-0.6B-shaped random model: forward time and logits with and without use_kernels."""
    from gpuformers.kernels.mapping import Mode, kernelize, unkernelize
    from gpuformers.models.auto import AutoConfig, AutoModelForCausalLM

    shape = (dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=300) if smoke else
             dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", max_position_embeddings=40960, **shape))
    model = model.to(dtype).eval()
    tokens = 32 if smoke else 4096
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)
    results = {}
    with torch.no_grad():
        def run():
            return model(ids, use_cache=False).logits

        ref = run()
        results["torch sdpa ms"] = round(timed(run, device), 3)
        kernelize(model, mode=Mode.INFERENCE)
        got = run()
        results["use_kernels sdpa ms"] = round(timed(run, device), 3)
        model.set_attn_implementation("triton")
        got_triton = run()
        results["use_kernels triton-attention ms"] = round(timed(run, device), 3)
        unkernelize(model)
    results["max |logit diff| use_kernels"] = float((got.float() - ref.float()).abs().max())
    results["max |logit diff| use_kernels+triton"] = float((got_triton.float() - ref.float()).abs().max())
    results["logit scale (max |logit|)"] = float(ref.float().abs().max())
    print(f"model qwen3-0.6b-shaped x{tokens}: {results}", flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="example: python benchmarks/bench_kernels.py --quick --out r.json")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (fits in a few minutes on one GPU)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        parser.error("no CUDA GPU here: run on a GPU, or use --smoke with TRITON_INTERPRET=1 to check the script")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--smoke on the CPU needs TRITON_INTERPRET=1 in the environment")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()

    if args.smoke:
        models, tokens, seqs, loss_tokens = {"smoke": SMOKE_MODEL}, (1, 17), (32,), 17
    elif args.quick:
        models, tokens, seqs, loss_tokens = MODELS, (1, 4096, 16384), (4096, 16384), 4096
    else:
        models, tokens, seqs, loss_tokens = MODELS, (1, 1024, 4096, 16384), (1024, 4096, 8192, 16384), 8192
    compile_refs = not args.no_compile and not args.smoke

    info = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                dtype=str(dtype).replace("torch.", ""), torch=torch.__version__)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        parser.error("triton is not installed (pip install 'gpuformers[kernels]')")
    info["copy GB/s"] = round(copy_bandwidth(device), 3)
    info["matmul TFLOP/s"] = round(matmul_rate(device, dtype), 3)
    print(f"{info}", flush=True)

    table = Table(info["copy GB/s"], info["matmul TFLOP/s"])
    bench_memory_bound(table, models, tokens, device, dtype, compile_refs)
    bench_attention(table, models, seqs, device, dtype)
    memory = bench_fused_loss(table, {k: models[k] for k in list(models)[:2]}, loss_tokens, device, dtype)
    moe = bench_moe(table, device, dtype, args.smoke)
    model = bench_model(device, dtype, args.smoke)
    ssd = bench_ssd(table, device, dtype, args.smoke)  # last: the steps before it keep their place in the time box
    info["seconds"] = round(time.perf_counter() - start, 1)
    print(f"done in {info['seconds']} s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(info=info, rows=table.rows, fused_loss_memory=memory, moe=moe, ssd=ssd,
                                            model=model),
                                       indent=1))
    return 0 if all("error" not in r for r in table.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
