"""Run by tests/test_tensor_parallel.py under torchrun (2 processes, gloo): a model loaded with tp_plan="auto"
against the same checkpoint loaded whole in the same process; process 0 writes what it saw as JSON."""

from __future__ import annotations

import json
import sys

import torch

from gpuformers import AutoModelForCausalLM


def main() -> None:
    folder, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    ids = torch.tensor([[1, 5, 9, 23, 42, 7, 64, 100]])
    batch = torch.tensor([[0, 0, 0, 3, 17, 9], [4, 8, 15, 16, 23, 42]])
    mask = (batch != 0).long()
    whole = AutoModelForCausalLM.from_pretrained(folder, progress=False)
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", progress=False)
    dev = model.device  # cuda:LOCAL_RANK on a GPU machine; the whole model stays on the CPU
    result = {"device": str(dev), "world_size": torch.distributed.get_world_size()}
    with torch.no_grad():
        result["logits_diff"] = float((model(ids.to(dev)).logits.cpu() - whole(ids).logits).abs().max())
        result["logits_scale"] = float(whole(ids).logits.abs().max())
    greedy = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    result["tokens_equal"] = torch.equal(model.generate(ids.to(dev), **greedy).cpu(), whole.generate(ids, **greedy))
    result["batch_tokens_equal"] = torch.equal(
        model.generate(batch.to(dev), attention_mask=mask.to(dev), pad_token_id=0, **greedy).cpu(),
        whole.generate(batch, attention_mask=mask, pad_token_id=0, **greedy))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    result["local_shapes"] = {name: list(getattr(layer.weight, "_local_tensor", layer.weight).shape) for name, layer in
                              [("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("o_proj", attn.o_proj),
                               ("gate_proj", mlp.gate_proj), ("down_proj", mlp.down_proj)]}
    result["refused"] = []
    try:
        model.generate_batch([[1, 2, 3]], max_new_tokens=2)
    except NotImplementedError as error:
        result["refused"].append(str(error))
    model.save_pretrained(out + ".model")  # every process gathers; process 0 writes
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        saved = AutoModelForCausalLM.from_pretrained(out + ".model", progress=False)
        with torch.no_grad():
            result["saved_logits_diff"] = float((saved(ids).logits - whole(ids).logits).abs().max())
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
