"""What the tests of the families with mamba layers (Mamba2, Nemotron-H) share: loss and gradients against
transformers', the recurrent cache's steps against one full forward, and generate()'s tokens against transformers'
(greedy with and without chunked prefill, sampling, beam search)."""

from __future__ import annotations

import copy

import torch

from tests.models.parity import left_padded


def assert_loss_and_gradients_match(ours, hf, checkpoint_name=lambda name: name) -> None:
    """Training-mode loss on a left-padded batch equals transformers' and so does every parameter's gradient;
    checkpoint_name maps transformers' parameter names to ours."""
    ours, hf = ours.train(), copy.deepcopy(hf).train()
    ids, mask = left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    expected = hf(ids, attention_mask=mask, labels=labels).loss
    got = ours(ids, attention_mask=mask, labels=labels).loss  # the chunked LM-head loss of training mode
    assert abs(got.item() - expected.item()) < 1e-5
    expected.backward(), got.backward()
    theirs = {checkpoint_name(name): p.grad for name, p in hf.named_parameters()}
    for name, param in ours.named_parameters():
        assert (param.grad - theirs[name]).abs().max() <= 1e-5 * theirs[name].abs().max() + 1e-7, name


def cached_pieces_minus_full(model, prompt: int, chunk: int, total: int):
    """(cache, difference): the logits of a prefill of `prompt` tokens, a `chunk`-token forward continued from the
    cache, then one token at a time up to `total`, minus one forward over all `total` tokens."""
    from gpuformers.generation.state_cache import RecurrentCache

    ids = torch.randint(3, 128, (2, total), generator=torch.Generator().manual_seed(4))
    cache = RecurrentCache()
    with torch.no_grad():
        full = model(ids).logits
        pieces = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits,
                  model(ids[:, prompt:prompt + chunk], past_key_values=cache, use_cache=True).logits]
        pieces += [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                   for t in range(prompt + chunk, total)]
    return cache, torch.cat(pieces, dim=1) - full


def assert_greedy_matches(ours, hf) -> None:
    """Greedy tokens on a left-padded batch equal transformers', with and without a chunked prefill (which carries
    the states from chunk to chunk)."""
    ids, mask = left_padded(seq=10, pad=3)
    greedy = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf.generate(ids, **greedy)
    assert torch.equal(ours.generate(ids, **greedy), expected)
    assert torch.equal(ours.generate(ids, prefill_chunk_size=4, **greedy), expected)


def assert_sampling_and_beams_match(ours, hf) -> None:
    """Sampled tokens under one seed and beam-search sequences (the states reordered with the beams) equal
    transformers'."""
    ids, mask = left_padded(seq=10, pad=3)
    common = dict(attention_mask=mask, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    sampled = []
    for model in (ours, hf):
        torch.manual_seed(11)
        sampled.append(model.generate(ids, do_sample=True, top_k=20, temperature=0.9, **common))
    assert torch.equal(*sampled)
    beams = dict(num_beams=3, num_return_sequences=2, do_sample=False, **common)
    assert torch.equal(ours.generate(ids, **beams), hf.generate(ids, **beams))


def assert_generation_continues_from_its_cache(model) -> None:
    """generate() given the cache an earlier call returned (a second turn: the earlier sequence and more tokens)
    gives the tokens of a call that recomputes everything: the cache holds every token but the last generated one."""
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(6))
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    first = model.generate(ids, max_new_tokens=5, return_dict_in_generate=True, **greedy)
    assert first.past_key_values.get_seq_length() == first.sequences.shape[1] - 1
    turn = torch.cat([first.sequences, torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(7))], 1)
    continued = model.generate(turn, past_key_values=first.past_key_values, max_new_tokens=6, **greedy)
    assert torch.equal(continued, model.generate(turn, max_new_tokens=6, **greedy))
