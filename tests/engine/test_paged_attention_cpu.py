"""The CPU decode kernel of paged attention (engine/paged_attention_cpu.py): every decode's output equals torch's
SDPA over that sequence's own keys (scattered blocks, grouped-query heads, sliding windows, contexts of one token and
of whole blocks); the engine's greedy tokens are generate()'s with the kernel and without it (the SDPA loop it
replaces, which a machine without a C compiler keeps); it is built once and then loaded from its cache."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from gpuformers.engine import paged_attention as paged_attention_module, paged_attention_cpu
from gpuformers.engine.config import ContinuousBatchingConfig
from gpuformers.kernels import cpu_c
from tests.engine.test_engine import assert_matches_under_preemption, qwen3, run_staggered  # noqa: F401 (qwen3: the fixture)

pytestmark = pytest.mark.skipif(cpu_c.compiler() is None, reason="needs a C compiler")


def _reference(query, k_cache, v_cache, tables, lens, block_size, scale, window):
    """Each row's SDPA over its own keys (the last `window` of them when given), kv heads shared by query heads."""
    outs = []
    for i, (table, n) in enumerate(zip(tables, lens)):
        positions = torch.arange(n)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        if window:
            slots = slots[-window:]
        k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)  # (kv_heads, n, head_dim)
        q = query[i][:, None]  # (heads, 1, head_dim)
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [
    (4, 2, 8, 4, None),  # the engine tests' tiny shape
    (12, 4, 64, 64, None),  # the 100m benchmark's shape, the CPU's default block size
    (8, 1, 32, 16, 5),  # multi-query, a sliding window shorter than a block
    (6, 6, 128, 8, 20),  # no grouping, a window over several blocks
])
def test_kernel_matches_sdpa_per_sequence(heads, kv_heads, head_dim, block_size, window):
    rng = random.Random(heads * 31 + block_size)
    torch.manual_seed(block_size)
    # contexts of one token, exactly a block, a block and one, and longer ones over scattered blocks
    lens = [1, block_size, block_size + 1, 3 * block_size - 1] + [rng.randint(1, 5 * block_size) for _ in range(6)]
    blocks = [-(-n // block_size) for n in lens]
    ids = list(range(1, sum(blocks) + 3))
    rng.shuffle(ids)
    tables, width = [], max(blocks)
    for b in blocks:
        tables.append(ids[:b])
        ids = ids[b:]
    num_slots = (sum(blocks) + 3) * block_size
    k_cache, v_cache = torch.randn(num_slots, kv_heads, head_dim), torch.randn(num_slots, kv_heads, head_dim)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query = torch.randn(len(lens), heads, head_dim)
    scale = head_dim ** -0.5
    assert paged_attention_cpu.available(query, k_cache, block_size)
    out = torch.full_like(query, float("nan"))
    paged_attention_cpu.paged_decode_attention(query, k_cache, v_cache, block_tables, torch.tensor(lens), block_size,
                                               scale, out, window)
    expected = _reference(query, k_cache, v_cache, tables, lens, block_size, scale, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kernel_declines_what_it_cannot_take():
    cache = torch.zeros(64, 2, 8)
    assert not paged_attention_cpu.available(torch.zeros(3, 4, 8, dtype=torch.bfloat16), cache, 4)
    assert not paged_attention_cpu.available(torch.zeros(3, 4, 8), cache.to(torch.float64), 4)
    assert not paged_attention_cpu.available(torch.zeros(3, 4, 8), cache.transpose(0, 1).contiguous().transpose(0, 1), 4)
    assert not paged_attention_cpu.available(torch.zeros(3, 512, 8), torch.zeros(64, 2, 8), 64)  # 512 heads
    assert not paged_attention_cpu.available(torch.zeros(3, 128, 8), torch.zeros(64, 2, 8), 256)  # 128 x 256 scores
    with pytest.raises(ValueError, match="512 query heads over 2 kv heads"):
        paged_attention_cpu.paged_decode_attention(torch.zeros(1, 512, 8), cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                                   torch.ones(1, dtype=torch.long), 4, 1.0, torch.zeros(1, 512, 8))


def test_built_once_then_loaded_and_absent_without_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    paged_attention_cpu._library.cache_clear()
    try:
        assert paged_attention_cpu._library() is not None
        built = list((tmp_path / "gpuformers" / "cpu_kernels").glob("paged_decode_*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        paged_attention_cpu._library.cache_clear()
        assert paged_attention_cpu._library() is not None
        assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
        paged_attention_cpu._library.cache_clear()
        monkeypatch.setattr(cpu_c, "compiler", lambda: None)
        assert paged_attention_cpu._library() is None
        assert not paged_attention_cpu.available(torch.zeros(1, 4, 8), torch.zeros(8, 2, 8), 4)
        paged_attention_cpu._library.cache_clear()
        monkeypatch.undo()
        monkeypatch.setenv(cpu_c.DISABLE, "0")  # the switch that turns every C kernel off
        assert paged_attention_cpu._library() is None
    finally:
        paged_attention_cpu._library.cache_clear()


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa-loop"])
def test_engine_tokens_equal_generate_with_and_without_the_kernel(qwen3, kernel, monkeypatch):
    model, prompts, reference = qwen3
    if not kernel:  # the path of a machine without a C compiler
        monkeypatch.setattr(paged_attention_cpu, "available", lambda *args: False)
        monkeypatch.setattr(paged_attention_cpu, "write_kv", lambda *args: False)
    else:  # every decode goes to the kernel: the SDPA loop never runs
        monkeypatch.setattr(paged_attention_module, "_cpu_decodes",
                            lambda *args: pytest.fail("the SDPA loop ran where the kernel serves"))
    calls, writes = [], []
    original, original_write = paged_attention_cpu.paged_decode_attention, paged_attention_cpu.write_kv
    monkeypatch.setattr(paged_attention_cpu, "paged_decode_attention",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    monkeypatch.setattr(paged_attention_cpu, "write_kv", lambda *args: writes.append(original_write(*args)) or writes[-1])
    # 12 blocks of 8 for 64 requests of up to 77 tokens: preemption, chunked prefills, shared prefixes
    config = ContinuousBatchingConfig(block_size=8, num_blocks=12, max_batch_tokens=24, max_requests_per_batch=16)
    manager = model.init_continuous_batching(continuous_batching_config=config, eos_token_id=None)
    outputs = run_staggered(manager, prompts)
    assert_matches_under_preemption(manager, outputs, prompts, reference, sharing=True)
    assert bool(calls) == kernel
    assert all(writes) == kernel and writes  # the eager layers' keys and values rows are contiguous: the C copy


def test_kv_write_puts_each_row_in_its_slot_and_checks_the_slots():
    torch.manual_seed(0)
    key_cache, value_cache = torch.zeros(40, 2, 8), torch.zeros(40, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([7, 0, 39, 12, 13])
    assert paged_attention_cpu.write_kv(key, value, key_cache, value_cache, slots)
    expected_k, expected_v = torch.zeros(40, 2, 8), torch.zeros(40, 2, 8)
    expected_k.index_copy_(0, slots, key)
    expected_v.index_copy_(0, slots, value)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    with pytest.raises(IndexError, match="outside the cache's 40 slots"):
        paged_attention_cpu.write_kv(key, value, key_cache, value_cache, torch.tensor([1, 2, 3, 40, 4]))
    assert torch.equal(key_cache, expected_k)  # nothing written
    # a view into a fused projection's output (each token's row contiguous, rows apart): written
    fused = torch.randn(5, 3, 2, 8)
    assert paged_attention_cpu.write_kv(fused[:, 1], fused[:, 2], key_cache, value_cache, slots)
    assert torch.equal(key_cache[slots], fused[:, 1]) and torch.equal(value_cache[slots], fused[:, 2])
    # declined (the caller's index_copy_ runs): a transposed key, another dtype
    assert not paged_attention_cpu.write_kv(key.transpose(1, 2).contiguous().transpose(1, 2), value, key_cache,
                                            value_cache, slots)
    assert not paged_attention_cpu.write_kv(key.double(), value.double(), key_cache.double(), value_cache.double(),
                                            slots)
