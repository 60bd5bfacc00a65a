"""What the tests of the families with mamba layers (Mamba2, Nemotron-H, Granite 4, Falcon-H1) share: loss and
gradients against transformers', the recurrent cache's steps against one full forward, generate()'s tokens against
transformers' (greedy with and without chunked prefill, sampling, beam search), the bare model, a saved model read by
transformers, and LoRA against peft."""

from __future__ import annotations

import copy

import torch

from tests.models.parity import left_padded, max_logit_diff


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


def assert_bare_model_matches(folder, class_name: str) -> None:
    """AutoModel loads `folder` as the family's bare model (`class_name`), its last hidden states equal
    transformers' AutoModel's on a left-padded batch."""
    import transformers

    from gpuformers import AutoModel

    ids, mask = left_padded()
    ours = AutoModel.from_pretrained(folder, progress=False)
    theirs = transformers.AutoModel.from_pretrained(folder).eval()
    assert type(ours).__name__ == class_name
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).last_hidden_state - theirs(ids, attention_mask=mask).last_hidden_state
    assert diff[mask.bool()].abs().max() < 1e-4


def assert_saved_model_loads_in_transformers(model, hf, folder) -> dict:
    """model.save_pretrained(folder) loads in transformers with the logits of `hf` (the model that wrote the
    checkpoint `model` was loaded from), exactly; returns the config.json written, for the family's own checks."""
    import json

    import transformers

    model.save_pretrained(folder)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert max_logit_diff(reloaded, hf, *left_padded()) == 0.0
    return json.loads((folder / "config.json").read_text())


def assert_lora_matches_peft(checkpoint, target_modules: list[str], folder) -> None:
    """LoRA on `target_modules` of checkpoint (folder, transformers model): logits equal peft's with the same
    adapter weights (which change the logits), and our saved adapter, in `folder`, loads in peft with our logits."""
    import peft

    from tests.test_lora import _peft_pair

    hf = checkpoint[1]
    ours, theirs = _peft_pair(checkpoint, r=4, lora_alpha=8, target_modules=target_modules)
    assert max_logit_diff(ours, theirs, *left_padded()) < 1e-4
    assert max_logit_diff(ours, hf, *left_padded()) > 1e-2  # the adapters took part
    ours.save_pretrained(folder)
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), folder).eval()
    assert max_logit_diff(ours, reloaded, *left_padded()) < 1e-4


def assert_classifier_pools_the_last_state(folder) -> None:
    """AutoModelForSequenceClassification (which transformers does not have for the mamba families) scores the bare
    model's state at each row's last non-padding token (left padding with pad_token_id 0)."""
    from gpuformers import AutoModel, AutoModelForSequenceClassification

    ids = torch.tensor([[5, 9, 23, 42, 7, 8], [0, 0, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    classifier = AutoModelForSequenceClassification.from_pretrained(folder, progress=False, num_labels=3,
                                                                    pad_token_id=0)
    with torch.no_grad():
        states = AutoModel.from_pretrained(folder, progress=False)(ids, attention_mask=mask).last_hidden_state
        logits = classifier(ids, attention_mask=mask).logits
    assert logits.shape == (2, 3) and (logits - classifier.score(states[:, -1])).abs().max() < 1e-5
