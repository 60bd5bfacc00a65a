"""The continuous batching manager's LoRA adapter commands (multi-LoRA serving): load and delete adapters while the
engine runs, each change applied between two steps, and CUDA graphs turned off while adapters are loaded.

The adapters themselves, and the layers that apply them, are lora.py's (AdapterBank, MultiLoraLinear); this mixin
is what ContinuousBatchingManager (manager.py) offers users on top.

Offers: AdapterServingMixin, cuda_graphs_with_adapters.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os

logger = logging.getLogger("gpuformers.engine.manager")


def cuda_graphs_with_adapters() -> NotImplementedError:
    return NotImplementedError(
        "use_cuda_graph=True with LoRA adapters is not supported: which rows use which adapter is decided on the "
        "host each step, and a captured graph cannot follow it; leave use_cuda_graph None (automatic: off while "
        "adapters are loaded)")


class AdapterServingMixin:
    """load_adapter / delete_adapter / adapters for ContinuousBatchingManager, which provides adapter_bank,
    scheduler, runner, config, model, _inbox, _cuda_graph_asked, _cuda_graphs_decided and is_running()."""

    @property
    def adapters(self) -> list[str]:
        """The names of the loaded adapters, which requests pass as adapter_name."""
        return self.adapter_bank.names

    def load_adapter(self, peft_model_id: str | os.PathLike, adapter_name: str | None = None, **hub_kwargs) -> None:
        """Serve a LoRA adapter (a peft folder or Hub id; revision=, token=, ... for the Hub) beside the others
        under `adapter_name` (default: "default"). CUDA graphs left automatic are off while adapters are loaded."""
        adapter_name = adapter_name or "default"
        if self._cuda_graph_asked:
            raise cuda_graphs_with_adapters()
        adapter = self.adapter_bank.read(peft_model_id, adapter_name, **hub_kwargs)  # the slow part: here

        def add() -> None:
            self.adapter_bank.add(adapter)
            self._use_cuda_graphs(False)

        self._between_steps(add)

    def delete_adapter(self, adapter_name: str) -> None:
        """Stop serving an adapter; its layers' wrappers leave the model with the last adapter. Refused while a
        queued or running request uses it (cancel those, or wait for them)."""
        self.adapter_bank.check_name(adapter_name)

        def delete() -> None:
            users = [s.request_id for s in self.scheduler.waiting + self.scheduler.running
                     if s.adapter_name == adapter_name]
            if users:
                raise ValueError(f"adapter {adapter_name!r} is in use by {len(users)} request(s) "
                                 f"({', '.join(users[:4])}); cancel them or wait for them to finish before deleting it")
            self.adapter_bank.delete(adapter_name)
            if not self.adapter_bank.adapters:
                self._use_cuda_graphs(self._cuda_graphs_decided)

        self._between_steps(delete)

    def _between_steps(self, change):
        """Run `change` in the engine's thread between two steps (at once when no loop runs) and return what it
        returns: a step never sees the adapters change under it."""
        if not self.is_running():
            return change()
        done = concurrent.futures.Future()
        self._inbox.put(("call", (change, done)))
        while True:
            try:
                return done.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if not self.is_running() and done.cancel():  # the loop ended without taking it
                    return change()

    def _use_cuda_graphs(self, on: bool) -> None:
        self.config.use_cuda_graph = on
        if on == (self.runner.graphs is not None):
            return
        if not on:
            logger.info("continuous batching: CUDA graphs off while LoRA adapters are loaded")
            self.runner.graphs = None
            return
        from gpuformers.engine.cuda_graphs import DecodeGraphs

        self.runner.graphs = DecodeGraphs(self.runner, self.config.max_requests_per_batch)
