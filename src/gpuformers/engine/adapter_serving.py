"""The continuous batching manager's LoRA adapter commands (multi-LoRA serving): load and delete adapters while the
engine runs, each change applied between two steps, and CUDA graphs turned off while adapters are loaded.

The adapters themselves, and the layers that apply them, are lora.py's (AdapterBank, MultiLoraLinear); the
AdapterService here is what ContinuousBatchingManager (manager.py) owns and offers users on top, as
manager.load_adapter / delete_adapter / adapters. It is given, when the manager makes it, everything it touches:

    AdapterService(bank, scheduler, runner, config, cuda_graph_asked, between_steps)
        bank            the adapters (read in the caller's thread, added and deleted between steps)
        scheduler       its queued and running requests: an adapter in use is not deleted
        runner, config  the CUDA graphs: off while adapters are loaded, back as decided after the last one
        between_steps   the manager's way to run a change in its engine thread between two steps

Offers: AdapterService, cuda_graphs_with_adapters.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

logger = logging.getLogger("gpuformers.engine.manager")


def cuda_graphs_with_adapters() -> NotImplementedError:
    return NotImplementedError(
        "use_cuda_graph=True with LoRA adapters is not supported: which rows use which adapter is decided on the "
        "host each step, and a captured graph cannot follow it; leave use_cuda_graph None (automatic: off while "
        "adapters are loaded)")


class AdapterService:
    """Loads and deletes a manager's LoRA adapters, keeping its CUDA graphs off while any is loaded."""

    def __init__(self, bank, scheduler, runner, config, cuda_graph_asked: bool | None,
                 between_steps: Callable[[Callable[[], object]], object]):
        self.bank, self.scheduler, self.runner, self.config = bank, scheduler, runner, config
        self.cuda_graph_asked = cuda_graph_asked  # the user's use_cuda_graph; None: automatic
        # What the resolved config decided (automatic or asked), adapters aside: back on when the last adapter is
        # deleted. Read now, before any adapter turns config.use_cuda_graph off.
        self.cuda_graphs_decided = config.use_cuda_graph
        self.between_steps = between_steps

    @property
    def names(self) -> list[str]:
        return self.bank.names

    def load(self, peft_model_id: str | os.PathLike, adapter_name: str | None = None, **hub_kwargs) -> None:
        adapter_name = adapter_name or "default"
        if self.cuda_graph_asked:
            raise cuda_graphs_with_adapters()
        adapter = self.bank.read(peft_model_id, adapter_name, **hub_kwargs)  # the slow part: in the caller's thread

        def add() -> None:
            self.bank.add(adapter)
            self.use_cuda_graphs(False)

        self.between_steps(add)

    def delete(self, adapter_name: str) -> None:
        self.bank.check_name(adapter_name)

        def delete() -> None:
            users = [s.request_id for s in self.scheduler.waiting + self.scheduler.running
                     if s.adapter_name == adapter_name]
            if users:
                raise ValueError(f"adapter {adapter_name!r} is in use by {len(users)} request(s) "
                                 f"({', '.join(users[:4])}); cancel them or wait for them to finish before deleting it")
            self.bank.delete(adapter_name)
            if not self.bank.adapters:
                self.use_cuda_graphs(self.cuda_graphs_decided)

        self.between_steps(delete)

    def use_cuda_graphs(self, on: bool) -> None:
        """Capture decode steps in CUDA graphs (on) or run them eagerly (off), recording it in the config."""
        self.config.use_cuda_graph = on
        if on == (self.runner.graphs is not None):
            return
        if not on:
            logger.info("continuous batching: CUDA graphs off while LoRA adapters are loaded")
            self.runner.graphs = None
            return
        from gpuformers.engine.cuda_graphs import DecodeGraphs

        self.runner.graphs = DecodeGraphs(self.runner, self.config.max_requests_per_batch)
