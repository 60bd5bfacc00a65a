"""The continuous batching engine: paged KV cache, prefix sharing, chunked prefill, preemption.

Start from `model.generate_batch(...)` or `model.init_continuous_batching(...)` (engine/mixin.py); the parts are
config.py (settings), sequence.py (request state), block_manager.py, scheduler.py, model_runner.py, sampler.py,
paged_attention.py, cuda_graphs.py and manager.py (the engine loop).
"""
