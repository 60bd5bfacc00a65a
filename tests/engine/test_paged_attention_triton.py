"""The Triton paged decode kernel against its torch reference (on the CPU under TRITON_INTERPRET=1, set by
tests/engine/conftest.py when there is no GPU), and against the engine's torch paged attention."""

from __future__ import annotations

import pytest
import torch

from gpuformers.kernels.checks import triton_runs_on

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_runs_on(DEVICE)[0], reason=triton_runs_on(DEVICE)[1] or "no triton")


def random_case(num_seqs=5, heads=4, kv_heads=2, head_dim=32, block_size=8, num_blocks=40, seed=0,
                dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    slots = num_blocks * block_size
    query = torch.randn(num_seqs, heads, head_dim, generator=g)
    key_cache = torch.randn(slots, kv_heads, head_dim, generator=g)
    value_cache = torch.randn(slots, kv_heads, head_dim, generator=g)
    lengths = torch.randint(1, 6 * block_size, (num_seqs,), generator=g)
    max_blocks = int((lengths.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
    to = dict(device=DEVICE)
    return (query.to(dtype=dtype, **to), key_cache.to(dtype=dtype, **to), value_cache.to(dtype=dtype, **to),
            tables.to(**to), lengths.to(**to), block_size)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding_window"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 32), (6, 2, 24), (2, 2, 16)])
def test_kernel_matches_reference(window, heads, kv_heads, head_dim):
    from gpuformers.engine.paged_attention_triton import paged_decode_attention, paged_decode_reference

    case = random_case(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    scale = head_dim ** -0.5
    out = paged_decode_attention(*case, scale=scale, sliding_window=window)
    expected = paged_decode_reference(*case, scale=scale, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_launcher_names_bad_shapes():
    from gpuformers.engine.paged_attention_triton import paged_decode_attention

    query, k, v, tables, lengths, bs = random_case()
    with pytest.raises(ValueError, match="heads must be a multiple of kv_heads"):
        paged_decode_attention(query[:, :3], k, v, tables, lengths, bs, scale=1.0)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(query, k, v, tables[:2], lengths, bs, scale=1.0)
    with pytest.raises(ValueError, match="block_size=12 must be a power of two"):
        paged_decode_attention(query, k, v, tables, lengths, 12, scale=1.0)


def test_an_empty_context_gives_zeros_as_the_reference():
    from gpuformers.engine.paged_attention_triton import paged_decode_attention, paged_decode_reference

    query, k, v, tables, lengths, bs = random_case(num_seqs=3)
    lengths[1] = 0
    out = paged_decode_attention(query, k, v, tables, lengths, bs, scale=0.5)
    torch.testing.assert_close(out, paged_decode_reference(query, k, v, tables, lengths, bs, scale=0.5),
                               atol=2e-5, rtol=2e-5)
    assert not out[1].any()
