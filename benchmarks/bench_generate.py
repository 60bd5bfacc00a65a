"""Benchmark: generate() decode speed, gpuformers (dynamic and static cache) vs transformers, same weights, same run.

The claims: on a tiny model, where per-token overhead (Python, mask and cache bookkeeping) dominates, our greedy
decode is at least 2x transformers' at batch 1; on the Qwen3-0.6B shape in float32, where reading the weights
dominates, we reach at least 90% of the memory-bandwidth bound.

Both libraries run the same weights (our model shares transformers' tensors), the same prompt and the same thread
count. Decode speed is measured as the difference of two generate() calls, N new tokens and 1 new token, so the
prefill cancels out: decode tokens/s = batch * (N - 1) / (t_N - t_1). Every configuration runs `--repeats` times,
interleaved with the others, and the best time counts (other processes on the machine only ever add time).
eos is off, so every call makes exactly N tokens.

The bound (--big): a decode step must read every weight once, so tokens/s <= copy bandwidth / weight bytes, with
the bandwidth measured here by copying a 1 GiB tensor (bytes read + bytes written, per second). The read
bandwidth (summing a 1 GiB tensor) is printed beside it: on some machines a pass that only reads cannot reach the
copy's rate, and that tighter bound says how close a decode step comes to the memory.

    python benchmarks/bench_generate.py                 # tiny Qwen3 shape (~10M parameters), batch 1 and 8
    python benchmarks/bench_generate.py --big           # also the Qwen3-0.6B shape in float32 (~2.4 GB)
    python benchmarks/bench_generate.py --compile --threads 1   # plus a compiled static-cache decode step
    python benchmarks/bench_generate.py --floor --threads 1     # plus the eager floor (see EagerFloor)
    python benchmarks/bench_generate.py --device cuda --dtype bfloat16 --big
"""

from __future__ import annotations

import argparse
import time

import torch

TINY = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, vocab_size=16384, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
)  # fmt: skip


def build_models(shape: dict, device: str, dtype: torch.dtype):
    """A random transformers Qwen3 model and ours on the very same weight tensors."""
    import transformers

    from gpuformers.models.config import ModelConfig
    from gpuformers.models.registry import model_class_for

    hf_config = transformers.Qwen3Config(**shape, bos_token_id=1, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    config = ModelConfig.from_dict(hf_config.to_dict())
    with torch.device("meta"):
        ours = model_class_for(config)(config)
    ours.load_state_dict(hf.state_dict(), assign=True)  # shares the tensors: no second copy of the weights
    ours.tie_weights()
    ours.reset_buffers(device)
    ours.eval()
    return hf, ours


def copy_bandwidth(device: str) -> float:
    """Bytes per second moved by copying a 1 GiB tensor (read + write), best of 5."""
    n = (1 << 30) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * (1 << 30) / best


def read_bandwidth(device: str) -> float:
    """Bytes per second read by summing a 1 GiB tensor, best of 5: what a pass that only reads (a decode step's
    matrix-vector products) can reach, which on some machines is below the copy's read + write rate."""
    src = torch.ones((1 << 30) // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        src.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del src
    return (1 << 30) / best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class EagerFloor:
    """What eager PyTorch can do at best for one greedy sequence of a Qwen3 model: a decode step written as bare
    tensor calls (q/k/v and gate/up weights concatenated, one rotary for q and k, no modules, no hooks, no checks,
    a preallocated cache). It gives the same tokens as the model; its speed is the floor of every eager decode on
    this machine, against which the eager goal can be judged. Its matmuls and norms are the ones our generate()
    picks here at batch 1 (kernels/cpu_matmul_probe.py: each weight in the form measured fastest at one row),
    so the gap to it is overhead alone."""

    def __init__(self, model, max_length: int):
        cfg = model.config
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hidden, self.inter, self.eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                                attn.q_norm.weight, attn.k_norm.weight, attn.o_proj.weight,
                                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight))
        self.embed, self.norm, self.head = model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight
        from gpuformers.kernels.cpu_matmul_probe import COLUMNS, PACK_HINT_ROWS, PACKED, one_row_form

        def matmul(weight):  # (out, in) -> x -> x @ weight.T in the form our generate() takes at batch 1 here
            weight = weight.detach()
            form = one_row_form(weight.shape[1], weight.shape[0])
            if form == PACKED:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS)
                return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            if form == COLUMNS:
                weight = weight.t().contiguous().t()
            return lambda x: torch.nn.functional.linear(x, weight)

        self.layers = [(ln1, ln2, matmul(qkv), qn, kn, matmul(o), matmul(gu), matmul(down))
                       for ln1, ln2, qkv, qn, kn, o, gu, down in self.layers]
        self.head = matmul(self.head)
        self.inv_freq = model.model.rotary_emb.inv_freq
        shape = (1, self.kv_heads, max_length, self.head_dim)
        self.keys = [torch.zeros(shape) for _ in self.layers]
        self.values = [torch.zeros(shape) for _ in self.layers]

    @torch.inference_mode()
    def step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        F = torch.nn.functional
        h, kv, d, eps = self.heads, self.kv_heads, self.head_dim, self.eps

        def rms_norm(x, weight):  # layers/norm.py's float32 norm
            return F.rms_norm(x, weight.shape, weight, eps)

        x = self.embed[token].view(1, 1, self.hidden)
        freqs = pos * self.inv_freq
        cos, sin = torch.cat((freqs, freqs)).cos(), torch.cat((freqs, freqs)).sin()
        for i, (ln1, ln2, qkv_proj, qn, kn, o_proj, gate_up_proj, down_proj) in enumerate(self.layers):
            qkv = qkv_proj(rms_norm(x, ln1)).view(h + 2 * kv, d)
            qk = torch.cat((rms_norm(qkv[:h], qn), rms_norm(qkv[h:h + kv], kn)))
            qk = qk * cos + torch.cat((-qk[..., d // 2:], qk[..., :d // 2]), -1) * sin
            self.keys[i][0, :, pos], self.values[i][0, :, pos] = qk[h:], qkv[h + kv:]
            o = F.scaled_dot_product_attention(qk[:h].view(1, kv, h // kv, d), self.keys[i][:, :, :pos + 1],
                                               self.values[i][:, :, :pos + 1])
            x = x + o_proj(o.reshape(1, 1, h * d))
            gu = gate_up_proj(rms_norm(x, ln2))
            x = x + down_proj(F.silu(gu[..., :self.inter]) * gu[..., self.inter:])
        return self.head(rms_norm(x, self.norm)).argmax(-1).view(())

    def generate(self, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        tokens = prompt[0].tolist()
        for pos in range(len(tokens) - 1):  # prefill, one token at a time (cancels out of the decode speed)
            self.step(prompt[0, pos], pos)
        token = prompt[0, -1]
        for pos in range(len(tokens) - 1, len(tokens) - 1 + new_tokens):
            token = self.step(token, pos)
            tokens.append(int(token))
        return torch.tensor([tokens])


def run_case(generate, prompt, new_tokens: int, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = generate(prompt, new_tokens)
    _sync(device)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == prompt.shape[1] + new_tokens, "eos stopped a benchmark run early"
    return elapsed


def bench_shape(name: str, shape: dict, args, batches: list[int]) -> None:
    hf, ours = build_models(shape, args.device, getattr(torch, args.dtype))
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in ours.parameters()}.values())
    print(f"\n## {name}: {weight_bytes / 4 / 1e6:.1f}M parameters ({weight_bytes / 1e9:.2f} GB in {args.dtype}), "
          f"{torch.get_num_threads()} threads, device {args.device}, {args.new_tokens} new tokens")
    variants = {
        "transformers": lambda p, n: hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=n,
                                                 do_sample=False, eos_token_id=None, pad_token_id=0),
        "ours dynamic": lambda p, n: ours.generate(p, max_new_tokens=n, eos_token_id=None),
        "ours static": lambda p, n: ours.generate(p, max_new_tokens=n, eos_token_id=None,
                                                  cache_implementation="static"),
    }
    if args.compile:
        # Opt-in on the CPU (a compile_config given); on CUDA "ours static" is already compiled automatically.
        from gpuformers.generation.config import CompileConfig

        mode = "reduce-overhead" if args.device.startswith("cuda") else "default"
        variants["ours static+compiled"] = lambda p, n: ours.generate(
            p, max_new_tokens=n, eos_token_id=None, cache_implementation="static",
            compile_config=CompileConfig(mode=mode))
    floor = None
    if args.floor and args.device == "cpu" and hasattr(ours.model.layers[0].self_attn, "q_norm"):
        floor = EagerFloor(ours, args.prompt_length + args.new_tokens)
        variants["eager floor"] = lambda p, n: floor.generate(p, n) if p.shape[0] == 1 else None
    bound = None
    if args.big_bound:
        bandwidth = copy_bandwidth(args.device)
        bound = bandwidth / weight_bytes
        print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s -> bound {bound:.2f} tokens/s per sequence at batch 1")
        reading = read_bandwidth(args.device)
        read_bound = reading / weight_bytes
        print(f"(read bandwidth {reading / 1e9:.1f} GB/s -> {read_bound:.2f} tokens/s: the bound for a pass that "
              f"only reads)")
    for batch in batches:
        prompt = torch.randint(2, shape["vocab_size"], (batch, args.prompt_length), device=args.device)
        if floor is not None and batch == 1:  # the floor is a fair bound only if it computes the same thing
            same = ours.generate(prompt, max_new_tokens=8, eos_token_id=None)
            assert torch.equal(floor.generate(prompt, 8), same), "the eager floor lost parity with the model"
        cases = {k: g for k, g in variants.items() if k != "eager floor" or batch == 1}
        for key, generate in cases.items():  # warm up (first calls allocate, import and compile)
            start = time.perf_counter()
            run_case(generate, prompt, args.new_tokens if "compiled" in key else 4, args.device)
            if "compiled" in key:
                print(f"  {key}: first call (compiling) {time.perf_counter() - start:.1f} s")
        times = {key: {1: [], args.new_tokens: []} for key in cases}
        for _ in range(args.repeats):
            for key, generate in cases.items():
                for n in (1, args.new_tokens):
                    times[key][n].append(run_case(generate, prompt, n, args.device))
        speed = {}
        for key in cases:
            decode = min(times[key][args.new_tokens]) - min(times[key][1])
            speed[key] = batch * (args.new_tokens - 1) / decode
        base = speed["transformers"]
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.1f} tok/s ({v / base:.2f}x)" for k, v in speed.items()))
        if bound is not None and batch == 1:
            print("  of the bandwidth bound: " + ", ".join(f"{k} {v / bound:.0%}" for k, v in speed.items()))
            print("  of the read bound: " + ", ".join(f"{k} {v / read_bound:.0%}" for k, v in speed.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big", action="store_true", help="also run the Qwen3-0.6B shape (float32: ~2.4 GB)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both libraries")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per timed call (default: 64)")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per configuration (the best counts)")
    parser.add_argument("--compile", action="store_true",
                        help="add ours with a static cache and a torch.compile'd decode step (CPU: about a minute "
                             "to compile, reported separately)")
    parser.add_argument("--floor", action="store_true",
                        help="add the eager floor at batch 1 (CPU): a bare-tensor decode step with the same tokens, "
                             "the best any eager decode can do here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.big_bound = False
    bench_shape("tiny Qwen3 shape", TINY, args, batches=[1, 8])
    if args.big:
        args.big_bound = True
        args.new_tokens, args.repeats = min(args.new_tokens, 16), min(args.repeats, 2)
        bench_shape("Qwen3-0.6B shape", QWEN3_0_6B, args, batches=[1])


if __name__ == "__main__":
    main()
