"""The Triton paged prefill kernel (chunks of query tokens after their sequences' cached keys, read in place through
the block tables) against its torch reference, and against an independent dense causal attention (on the CPU under
TRITON_INTERPRET=1 when there is no GPU)."""

from __future__ import annotations

import pytest
import torch

from gpuformers.kernels.checks import triton_runs_on

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_runs_on(DEVICE)[0], reason=triton_runs_on(DEVICE)[1] or "no triton")


def prefill_case(chunks, cached, heads=4, kv_heads=2, head_dim=32, block_size=8, num_blocks=64, seed=0,
                 dtype=torch.float32):
    """Sequences with `cached[i]` keys already in the cache and a chunk of `chunks[i]` new query tokens (whose keys
    are in the cache too, as the engine writes them before attention), on scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    slots = num_blocks * block_size
    lengths = torch.tensor([c + n for c, n in zip(cached, chunks)])
    max_blocks = int((lengths.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[:len(chunks) * max_blocks].view(len(chunks), max_blocks)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu[-1]), heads, head_dim, generator=g)
    key_cache = torch.randn(slots, kv_heads, head_dim, generator=g)
    value_cache = torch.randn(slots, kv_heads, head_dim, generator=g)
    to = dict(device=DEVICE)
    return (query.to(dtype=dtype, **to), key_cache.to(dtype=dtype, **to), value_cache.to(dtype=dtype, **to),
            tables.to(**to), cu.to(**to), lengths.to(**to), block_size)


@pytest.mark.parametrize("window", [None, 7], ids=["full", "sliding_window"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 32), (6, 2, 24), (2, 2, 16)])
def test_kernel_matches_reference(window, heads, kv_heads, head_dim):
    from gpuformers.engine.paged_attention_triton import paged_prefill_attention, paged_prefill_reference

    # whole prompts, chunks after a cached prefix (chunked prefill or a prefix hit), a one-token chunk, and chunks
    # longer than a query tile (16 rows under the interpreter)
    chunks, cached = [5, 37, 1, 20, 16], [0, 0, 30, 11, 48]
    case = prefill_case(chunks, cached, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(*case, scale=scale, max_seqlen_q=max(chunks), sliding_window=window)
    expected = paged_prefill_reference(*case, scale=scale, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_reference_is_plain_causal_attention_over_the_gathered_keys():
    """The reference itself, against torch's SDPA on each sequence's keys gathered in order."""
    from gpuformers.engine.paged_attention_triton import paged_prefill_reference

    query, k, v, tables, cu, lengths, bs = prefill_case([6, 9], [10, 0], heads=2, kv_heads=2)
    out = paged_prefill_reference(query, k, v, tables, cu, lengths, bs, scale=0.25)
    for i, length in enumerate(lengths.tolist()):
        positions = torch.arange(length, device=DEVICE)
        slots = tables[i, positions // bs] * bs + positions % bs
        q = query[cu[i]:cu[i + 1]].transpose(0, 1)[None]  # (1, heads, chunk, dim)
        keys, values = k[slots].transpose(0, 1)[None], v[slots].transpose(0, 1)[None]
        chunk = q.shape[2]
        mask = positions[None, :] <= torch.arange(length - chunk, length, device=DEVICE)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.25)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_grid_sized_by_the_longest_chunk_leaves_short_ones_exact():
    from gpuformers.engine.paged_attention_triton import paged_prefill_attention, paged_prefill_reference

    case = prefill_case([40, 2, 3], [0, 5, 60], head_dim=16)
    out = paged_prefill_attention(*case, scale=0.3, max_seqlen_q=40)
    torch.testing.assert_close(out, paged_prefill_reference(*case, scale=0.3), atol=2e-5, rtol=2e-5)


def test_launcher_names_bad_inputs():
    from gpuformers.engine.paged_attention_triton import paged_prefill_attention

    query, k, v, tables, cu, lengths, bs = prefill_case([3, 4], [0, 2])
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        paged_prefill_attention(query[:, :3], k, v, tables, cu, lengths, bs, 1.0, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill_attention(query, k, v, tables, cu[:2], lengths, bs, 1.0, 4)
    with pytest.raises(ValueError, match="int32"):
        paged_prefill_attention(query, k, v, tables, cu.long(), lengths, bs, 1.0, 4)
    with pytest.raises(ValueError, match="block_size=12 must be a power of two"):
        paged_prefill_attention(query, k, v, tables, cu, lengths, 12, 1.0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_gpu(dtype):
    from gpuformers.engine.paged_attention_triton import paged_prefill_attention, paged_prefill_reference

    chunks, cached = [300, 17, 1, 129], [0, 700, 64, 5]
    case = prefill_case(chunks, cached, heads=16, kv_heads=8, head_dim=128, block_size=256, num_blocks=64,
                        dtype=dtype)
    out = paged_prefill_attention(*case, scale=128 ** -0.5, max_seqlen_q=max(chunks))
    expected = paged_prefill_reference(*case, scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_engine_with_the_triton_kernels_gives_generates_tokens(monkeypatch):
    """The engine with its prefill chunks (and, through a CUDA-graph stand-in, nothing else) sent to the Triton
    kernel, here under the interpreter: chunked prefill, a shared prefix and preemption, tokens equal to generate."""
    from gpuformers.engine import paged_attention, paged_attention_triton
    from tests.engine.test_engine import greedy_reference, tiny_model

    calls = []
    real = paged_attention_triton.paged_prefill_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "_triton_kernels_available", lambda query: True)
    monkeypatch.setattr(paged_attention_triton, "paged_prefill_attention", counting)
    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    head = torch.randint(0, 128, (20,), generator=g).tolist()
    prompts = [head + torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 11, 1, 25)] + [[7, 8]]
    reference = greedy_reference(model, prompts, new_tokens=16)
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=10, max_batch_tokens=24)
    ids = [manager.add_request(p, max_new_tokens=16) for p in prompts]
    manager.run_until_done()
    assert [manager.get_result(i, timeout=0).generated_tokens for i in ids] == reference
    assert calls, "no prefill went through the kernel"
    assert manager.prefix_hits > 0 and manager.num_preemptions > 0
