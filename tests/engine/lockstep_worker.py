"""Run by tests/engine/test_lockstep.py under torchrun (2 processes, gloo): a tensor-parallel model's engines in
lockstep, process 0 taking requests while process 1 follows; process 0 checks the results against the model loaded
whole and writes them as JSON. The processes' global random generators are seeded differently, as they may be in a
real run, so a sampled request stays consistent only if the leader hands out its seed."""

from __future__ import annotations

import json
import sys

import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.distributed import exit_process

PROMPTS = [[5, 9, 23, 42], [7, 64, 100, 3, 8, 2, 77], [11], [3] * 20]


def main() -> None:
    folder, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", progress=False)
    rank = torch.distributed.get_rank()
    torch.manual_seed(1000 + rank)
    manager = model.init_continuous_batching(num_blocks=24, block_size=8).run_in_lockstep()
    if rank != 0:
        manager.follow()
        return
    manager.start()
    greedy = [manager.add_request(p, max_new_tokens=6, do_sample=False, eos_token_ids=()) for p in PROMPTS]
    sampled = [manager.add_request(p, max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   return_logprobs=True, ignore_eos=True) for p in PROMPTS]
    cancelled = manager.add_request(PROMPTS[3], max_new_tokens=50, ignore_eos=True, streaming=True)
    manager.cancel_request(cancelled)
    results = {i: manager.get_result(i, timeout=120) for i in greedy + sampled}
    final = list(manager.request_id_iter(cancelled))[-1]
    manager.stop()  # the follower's loop ends with it
    whole = AutoModelForCausalLM.from_pretrained(folder, progress=False)
    report = {"cancelled_status": str(final.status), "greedy_equal": [], "logprob_diff": 0.0, "sampled_lengths": []}
    with torch.no_grad():
        for prompt, request in zip(PROMPTS, greedy):
            expected = whole.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None)
            report["greedy_equal"].append(results[request].generated_tokens == expected[0, len(prompt):].tolist())
        for prompt, request in zip(PROMPTS, sampled):
            # Every sampled token's logprob, as the engine reported it, against the whole model's logits over the
            # prompt and the tokens sampled: a follower that drew other tokens would have attended over another
            # sequence, and the leader's logits would no longer be the whole model's.
            tokens = results[request].generated_tokens
            logits = whole(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            got = torch.tensor(results[request].logprobs)
            report["logprob_diff"] = max(report["logprob_diff"], float((got - expected).abs().max()))
            report["sampled_lengths"].append(len(tokens))
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
    exit_process()
