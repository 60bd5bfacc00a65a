"""Run by tests/test_tensor_parallel.py under torchrun (2 processes, gloo): a model loaded with tp_plan="auto"
against the same checkpoint loaded whole in the same process; process 0 writes what it saw as JSON."""

from __future__ import annotations

import json
import sys

import torch

from gpuformers import AutoModelForCausalLM
from gpuformers.distributed import exit_process


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
    # Each linear layer's local weight shape by its own name (q_proj, c_fc, query_key_value, ...): layer 0's, then
    # the last layer's MLP, dense in every model here (in the MoE checkpoint, layer 0 is sparse and layer 1 dense).
    # 2-D weights: nn.Linear (out, in) and GPT-2's Conv1D (in, out); GPT-2's stack names its layers h
    decoder_layers = getattr(model.model, "layers", None) or model.model.h
    layers = [*decoder_layers[0].named_modules(), *decoder_layers[-1].mlp.named_modules()]
    result["local_shapes"] = {
        name.rpartition(".")[2]: list(getattr(module.weight, "_local_tensor", module.weight).shape)
        for name, module in layers
        if name and "experts" not in name and getattr(getattr(module, "weight", None), "ndim", 0) == 2}
    experts = getattr(decoder_layers[0].mlp, "experts", None)
    if experts is not None:  # split as plain tensors (local_colwise / local_rowwise)
        result["expert_shapes"] = [list(experts[0].gate_proj.weight.shape), list(experts[0].down_proj.weight.shape)]
        result["experts_plain"] = not hasattr(experts[0].gate_proj.weight, "_local_tensor")
    # The engine: every process adds the same requests; each caches only its kv heads
    prompts = [[5, 9, 23, 42], [7, 64, 100, 3, 8, 2, 77], [11], [3] * 20]
    outputs = model.generate_batch(prompts, max_new_tokens=6, eos_token_id=None, progress_bar=False, block_size=8,
                                   num_blocks=12)
    expected = [whole.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(p):]
                .tolist() for p in prompts]
    result["engine_equal"] = [r.generated_tokens for r in outputs.values()] == expected
    result["engine_kv_heads"] = model.init_continuous_batching(num_blocks=4).runner.key_caches[0].shape[1]
    blocks = model.init_continuous_batching().config.num_blocks  # sized from free memory: agreed by all processes
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, blocks)
    result["auto_blocks_agree"] = len(set(every)) == 1
    result["refused"] = _refusals(model, out)
    model.save_pretrained(out + ".model")  # every process gathers; process 0 writes
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        saved = AutoModelForCausalLM.from_pretrained(out + ".model", progress=False)
        with torch.no_grad():
            result["saved_logits_diff"] = float((saved(ids).logits - whole(ids).logits).abs().max())
        with open(out, "w") as f:
            json.dump(result, f)


def _refusals(model, out: str) -> list[str | None]:
    """The NotImplementedError messages of what a tensor-parallel model cannot do yet (None: it was not refused)."""
    from gpuformers.lora import LoraConfig, get_peft_model
    from gpuformers.training import Trainer, TrainingArguments

    attempts = [lambda: get_peft_model(model, LoraConfig(target_modules=["q_proj"])),
                lambda: Trainer(model, TrainingArguments(output_dir=out + ".train", fsdp="full_shard", use_cpu=True))]
    messages = []
    for attempt in attempts:
        try:
            attempt()
            messages.append(None)
        except NotImplementedError as error:
            messages.append(str(error))
    return messages


if __name__ == "__main__":
    main()
    exit_process()
