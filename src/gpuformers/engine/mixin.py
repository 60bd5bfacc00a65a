"""ContinuousBatchingMixin: `model.generate_batch` and `model.init_continuous_batching`, as transformers names them.

PreTrainedModel inherits it; the engine itself is imported only when one of these is called.

Offers: ContinuousBatchingMixin.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from gpuformers.layers.attention import AttentionInterface

# "paged|sdpa", "paged|eager" and "paged|flash_attention_4" register themselves when first asked for.
for _name in ("paged|sdpa", "paged|eager", "paged|flash_attention_4"):
    AttentionInterface.register_lazy(_name, "gpuformers.engine.paged_attention")


def _split_kwargs(kwargs: dict):
    """Route keyword arguments: ContinuousBatchingConfig fields to it, the rest to GenerationConfig."""
    from gpuformers.engine.config import ContinuousBatchingConfig

    names = {f.name for f in fields(ContinuousBatchingConfig)}
    engine = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    return engine, kwargs


class ContinuousBatchingMixin:
    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 adapters: dict[str, str] | None = None, **kwargs):
        """A ContinuousBatchingManager for this model (call start(), or use it in a `with` block).

        adapters: {name: LoRA adapter folder or Hub id} served side by side (requests pick one by adapter_name).
        kwargs: ContinuousBatchingConfig fields (block_size=, num_blocks=, max_batch_tokens=, ...) and
        GenerationConfig fields (max_new_tokens=, do_sample=, temperature=, ...)."""
        from gpuformers.engine.config import ContinuousBatchingConfig
        from gpuformers.engine.manager import ContinuousBatchingManager
        from gpuformers.generation.config import GenerationConfig

        engine, generation = _split_kwargs(dict(kwargs))
        if continuous_batching_config is None:
            continuous_batching_config = ContinuousBatchingConfig(**engine)
        elif engine:
            raise TypeError(f"pass {', '.join(sorted(engine))} inside continuous_batching_config, not both")
        if generation:
            generation_config = (generation_config or GenerationConfig()).copy()
            unknown = generation_config.update(**generation)
            if unknown:
                raise TypeError(f"unknown arguments: {', '.join(sorted(unknown))}")
        return ContinuousBatchingManager(self, generation_config, continuous_batching_config, adapters)

    @torch.inference_mode()
    def generate_batch(self, inputs: list[list[int]], generation_config=None, progress_bar: bool = True,
                       continuous_batching_config=None, adapters: dict[str, str] | None = None,
                       adapter_names: str | list[str | None] | None = None, **kwargs) -> dict:
        """Generate for every prompt (lists of token ids) with continuous batching; returns
        {request_id: GenerationOutput}, request ids "req_0", "req_1", ... in the order of `inputs`.

        adapters: {name: LoRA adapter folder} to serve; adapter_names: the adapter of every prompt (one name), or
        of each (a list, None for the base model); None: the base model for all."""
        # Per-request settings with no GenerationConfig field (the benchmark's ignore_eos, stop token ids).
        sampling = {k: kwargs.pop(k) for k in ("ignore_eos", "stop") if k in kwargs}
        if adapter_names is None or isinstance(adapter_names, str):
            adapter_names = [adapter_names] * len(inputs)
        elif len(adapter_names) != len(inputs):
            raise ValueError(f"adapter_names has {len(adapter_names)} entries for {len(inputs)} inputs; give one per "
                             f"input, or one name for all")
        manager = self.init_continuous_batching(generation_config, continuous_batching_config, adapters, **kwargs)
        try:
            ids = [manager.add_request(ids, adapter_name=name, **sampling) for ids, name in zip(inputs, adapter_names)]
            manager.run_until_done(progress_bar=progress_bar)
            return {request_id: manager.get_result(request_id, timeout=0) for request_id in ids}
        finally:
            manager.stop()  # the adapters' layers leave the model
