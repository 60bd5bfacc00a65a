"""Run by tests/test_distributed.py under `torchrun --nproc_per_node=2` on the CPU (gloo): a tiny Qwen3 trained for
three AdamW steps with DDP or FSDP2 (two micro-batches per process, gradients exchanged once per step) must end with
the weights of the same model trained in one process on the whole batch. Process 0 writes the largest differences
to the JSON file named on the command line."""

from __future__ import annotations

import copy
import json
import sys

import torch

from gpuformers import distributed
from gpuformers.models.config import ModelConfig
from gpuformers.models.registry import model_class_for
from gpuformers.distributed import exit_process

CONFIG = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=97, hidden_size=32,
              intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=64, tie_word_embeddings=True)


def main(strategy: str, out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    assert distributed.init_distributed(device)
    world, rank = distributed.world_size(), distributed.rank()
    torch.manual_seed(0)
    config = ModelConfig.from_dict(CONFIG)
    model = model_class_for(config)(config).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, CONFIG["vocab_size"], (2 * world, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :3] = -100  # some positions without a target: the global token count matters
    items = int((labels[:, 1:] != -100).sum())

    wrapped = distributed.wrap_model(model, strategy, device)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(3):
        local = 0.0
        mine = [2 * rank, 2 * rank + 1]  # this process's two micro-batches of one row each
        for i, row in enumerate(mine):
            with distributed.gradient_sync(wrapped, enabled=i == len(mine) - 1):
                loss = wrapped(ids[row:row + 1], labels=labels[row:row + 1], num_items_in_batch=items).loss
                (loss * world).backward()  # the processes' gradients are averaged: undo that for a sum
            local += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(distributed.all_reduce_sum(local, device)))

        ref_loss = reference(ids, labels=labels, num_items_in_batch=items).loss
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad(set_to_none=True)
        ref_losses.append(float(ref_loss))

    # the optimizer state survives a round trip through its full (gathered) form
    full_optim = distributed.full_optimizer_state_dict(wrapped, optimizer)
    restored = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    distributed.load_full_optimizer_state_dict(wrapped, restored, _broadcast(full_optim))
    state = distributed.full_model_state_dict(wrapped)
    if rank == 0:
        ref_state = reference.state_dict()
        weight_diff = max(float((state[k].float() - v.float()).abs().max()) for k, v in ref_state.items())
        exp_avg = [s["exp_avg"] for s in restored.state_dict()["state"].values()]
        with open(out, "w") as f:
            json.dump(dict(losses=losses, ref_losses=ref_losses, weight_diff=weight_diff,
                           keys_equal=sorted(state) == sorted(ref_state), restored_states=len(exp_avg)), f)
    distributed.barrier()
    torch.distributed.destroy_process_group()


def _broadcast(obj):
    """Process 0's object on every process (here: the full optimizer state, which FSDP2 gives process 0 only)."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process()
