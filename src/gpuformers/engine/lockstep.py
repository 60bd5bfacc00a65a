"""Lockstep: the engines of a tensor-parallel model's processes stepping together, process 0 taking the requests.

Under tensor parallelism every process holds a slice of the model, so every engine step must run in all of them, on
the same batch. The scheduler is deterministic, so it is enough that every process's engine sees the same requests
and cancellations at the same step: at the start of each step the leader (process 0, which serves HTTP) hands what
arrived since its last step to the others in one broadcast, and every process applies it before scheduling.

    leader:     inbox ─> commands ─┬─> apply ─> schedule ─> launch / collect ─> publish (to HTTP handlers)
    followers:                     └─> apply ─> schedule ─> launch / collect              (outputs dropped)

Sampling must agree as well. The logits are the same in every process (the row-wise layers' all-reduce and the
whole LM head give each the full logits), so a request sampled with its own seeded generator draws the same tokens
everywhere; a sampled request that came without a seed gets one from the leader before it is handed over (drawing
from each process's global generator instead would let the processes' sequences drift apart).

The leader's engine loop ends by sending "stop", which ends the followers' loops.

The commands travel over gloo, between the processes' CPUs: the model's group on GPUs is NCCL's, whose object
broadcast copies the pickled commands to the GPU and reads their size back (.item()) on the stream of the step in
flight, so that each step would wait for the one before it (async batching would overlap nothing).

Offers: Lockstep, STOP.
"""

from __future__ import annotations

import random

import torch.distributed as dist

STOP = "stop"  # the command that ends the followers' loops


class Lockstep:
    """One process's side of the exchange, over `group` (the model's tensor-parallel group)."""

    def __init__(self, group=None):
        self.group = _host_group(group)
        self.is_leader = dist.get_rank(group) == 0
        self.stopped = False
        self._seeds = random.SystemRandom()

    def exchange(self, commands: list[tuple[str, object]]) -> list[tuple[str, object]]:
        """The leader's commands of this step, in every process (a follower passes [] and gets the leader's).
        Commands are ("add", Sequence), ("cancel", request_id) and (STOP, None)."""
        if self.is_leader:
            for kind, item in commands:
                if kind == "add" and not item.params.greedy and item.params.seed is None:
                    item.params.seed = self._seeds.getrandbits(63)
        box = [commands if self.is_leader else None]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        commands = box[0]
        self.stopped = self.stopped or any(kind == STOP for kind, _ in commands)
        return commands


def _host_group(group):
    """`group` when it runs on gloo, else its processes in a new gloo group (made by every process, as run_in_lockstep
    is called: new_group is collective)."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    return dist.new_group(ranks=dist.get_process_group_ranks(group or dist.group.WORLD), backend="gloo")
