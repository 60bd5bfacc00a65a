"""The torch paged attention on the CPU: keys read in place (consecutive blocks, a view of the cache) and keys
gathered from scattered blocks give the same outputs as plain attention over each sequence's own keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpuformers.engine.paged_attention import PagedContext, _contiguous_slots, paged_attention, paged_context

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 4, 8


def _context(tables: list[list[int]], lens: list[int], queries: list[int], keys, values) -> PagedContext:
    """A step where sequence i has lens[i] cached tokens (queries[i] of them new), stored in blocks tables[i]."""
    num_blocks = 1 + max(b for t in tables for b in t)
    k_cache = torch.zeros(num_blocks * BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    slots = []
    for table, n, q, k, v in zip(tables, lens, queries, keys, values):
        seq_slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        k_cache[seq_slots], v_cache[seq_slots] = k, v
        slots.append(seq_slots[n - q:])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    starts = [0]
    for q in queries:
        starts.append(starts[-1] + q)
    return PagedContext(torch.cat(slots), block_tables, torch.tensor(lens), starts, list(lens),
                        num_decodes=sum(1 for q in queries if q == 1), block_size=BLOCK,
                        key_caches=[k_cache], value_caches=[v_cache])


def test_in_place_and_gathered_keys_match_plain_attention():
    torch.manual_seed(0)
    lens, queries = [5, 9, 7], [1, 1, 3]  # two decodes and a prefill chunk of 3 after 4 cached tokens
    keys = [torch.randn(n, KV_HEADS, DIM) for n in lens]
    values = [torch.randn(n, KV_HEADS, DIM) for n in lens]
    query = torch.randn(1, HEADS, sum(queries), DIM)
    consecutive = [[0, 1], [2, 3, 4], [5, 6]]
    scattered = [[6, 1], [3, 0, 5], [4, 2]]
    outputs = []
    for tables in (consecutive, scattered):
        ctx = _context(tables, lens, queries, keys, values)
        expect_view = tables is consecutive
        assert all((_contiguous_slots(ctx, i, n) is not None) == expect_view for i, n in enumerate(lens))
        with paged_context(ctx):
            out, _ = paged_attention(torch.nn.Module().eval(), query, ctx.key_caches[0], ctx.value_caches[0], None, scaling=DIM**-0.5)
        outputs.append(out[0])
    start = 0
    for n, q, k, v in zip(lens, queries, keys, values):
        # plain causal attention of the q new tokens over the sequence's own n keys, kv heads repeated
        qs = query[0, :, start:start + q]
        k_rep = k.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        v_rep = v.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        mask = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
        expected = F.scaled_dot_product_attention(qs, k_rep, v_rep, attn_mask=mask, scale=DIM**-0.5).transpose(0, 1)
        for out in outputs:
            torch.testing.assert_close(out[start:start + q], expected, atol=1e-5, rtol=1e-5)
        start += q
