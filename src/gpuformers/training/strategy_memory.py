"""What a data-parallel strategy keeps per device when training with Adam in mixed precision, by the ZeRO paper's
count (Rajbhandari et al. 2020, section 3.1): for P parameters over N processes,

    weights 2P (bf16/fp16)  +  gradients 2P  +  optimizer 12P (float32 master weights 4P, Adam's two moments 8P)

    ddp             2P + 2P + 12P                whole on every device
    zero1           2P + 2P + 12P / N            optimizer state sharded
    zero2           2P + (2P + 12P) / N          + gradients sharded           (FSDP2 shard_grad_op keeps the
                                                                                parameters gathered per layer)
    zero3           (2P + 2P + 12P) / N          + parameters sharded          (FSDP2 full_shard)

Activations, the layer gathered at a time under ZeRO-3 / FSDP2, communication buckets and the CUDA context come on
top; offloading (DeepSpeed's offload_optimizer / offload_param, FSDP2's offload) moves the sharded parts to host
memory. `gpuformers fit MODEL --train-processes N` prints these next to the inference plan.

Offers: StrategyMemory, strategy_memory, format_strategy_memory, STRATEGY_NOTES.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuformers.sizes import format_size

# bytes per parameter: half-precision weights and gradients, Adam's float32 master copy and two moments
WEIGHT_BYTES, GRADIENT_BYTES, OPTIMIZER_BYTES = 2, 2, 12
STRATEGY_NOTES = {"ddp": "DDP (torchrun, accelerate launch)", "zero1": "DeepSpeed ZeRO-1",
                  "zero2": "DeepSpeed ZeRO-2; FSDP2 shard_grad_op", "zero3": "DeepSpeed ZeRO-3; FSDP2 full_shard"}


@dataclass(frozen=True)
class StrategyMemory:
    strategy: str  # ddp, zero1, zero2, zero3
    weights_bytes: int  # per device
    gradients_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes


def strategy_memory(parameters: int, processes: int) -> list[StrategyMemory]:
    """Per-device bytes of weights, gradients and optimizer state under each strategy (see the module docstring);
    `parameters` counts the trainable ones, `processes` the data-parallel ones."""
    if processes < 1:
        raise ValueError(f"processes={processes} must be >= 1 (the data-parallel processes, one per GPU)")
    weights, gradients, optimizer = (parameters * size for size in (WEIGHT_BYTES, GRADIENT_BYTES, OPTIMIZER_BYTES))
    n = processes
    return [StrategyMemory("ddp", weights, gradients, optimizer),
            StrategyMemory("zero1", weights, gradients, optimizer // n),
            StrategyMemory("zero2", weights, gradients // n, optimizer // n),
            StrategyMemory("zero3", weights // n, gradients // n, optimizer // n)]


def format_strategy_memory(parameters: int, processes: int) -> str:
    """The table `gpuformers fit --train-processes N` prints."""
    rows = [["strategy", "weights", "gradients", "optimizer", "per GPU", "as"]]
    for row in strategy_memory(parameters, processes):
        rows.append([row.strategy, format_size(row.weights_bytes), format_size(row.gradients_bytes),
                     format_size(row.optimizer_bytes), format_size(row.total_bytes), STRATEGY_NOTES[row.strategy]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"Training over {processes} data-parallel process(es), Adam in mixed precision (bf16 weights and "
             "gradients, float32 master weights and moments), per GPU before activations:"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)
