"""Mamba2 against transformers' Mamba2ForCausalLM on tiny random checkpoints with n_groups > 1 and chunk sizes that do
not divide the prompts: module names, logits and loss (float32 < 1e-4), gradients, the recurrent cache (prefill then
decode, a prefill continued from a state, chunked prefill), greedy, sampling and beam search tokens, the bare model,
saving for transformers, LoRA on in_proj / out_proj against peft, the Trainer's loss, the config checks, the engine's
tokens against generate(), and the refusals (assisted decoding, static cache, cropping a state)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.parity import checkpoint_cases, left_padded, load, max_logit_diff
from tests.models.recurrent import (assert_generation_continues_from_its_cache, assert_greedy_matches,
                                    assert_loss_and_gradients_match, assert_sampling_and_beams_match,
                                    cached_pieces_minus_full)

SHAPES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, expand=2)
CASES = {
    # 2 groups of 4 heads; chunks of 5 over prompts of 16, 10, 7 tokens
    "groups": dict(n_groups=2, chunk_size=5),
    # 4 groups, chunks of 3, biases but none on the conv, a conv of 3, a tied head, and a time_step_limit that
    # clamps some steps of the scan
    "tied-limit": dict(n_groups=4, chunk_size=3, use_bias=True, use_conv_bias=False, conv_kernel=3,
                       tie_word_embeddings=True, time_step_limit=(0.0, 0.05)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (folder, transformers model)."""
    return checkpoint_cases(tmp_path_factory, "mamba2", CASES, **SHAPES)


def test_modules_and_keys_are_transformers(checkpoints):
    folder, hf = checkpoints["groups"]
    ours = load(folder)
    assert type(ours).__name__ == "Mamba2ForCausalLM"
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert ours.no_split_modules == ("Mamba2Block",)
    assert ours.config.num_attention_heads is None and ours.config.intermediate_size == 128


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(checkpoints, case):
    folder, hf = checkpoints[case]
    assert max_logit_diff(load(folder), hf, *left_padded()) < 1e-4


def test_loss_and_gradients_match_transformers(checkpoints):
    folder, hf = checkpoints["groups"]
    assert_loss_and_gradients_match(load(folder), hf)


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_equals_the_full_forward(checkpoints, case):
    """7 prompt tokens (no multiple of the chunk), a 4-token chunk continued from the cached state, then one token at
    a time: every position's logits equal one forward over the whole sequence. The decode steps only with the default
    time_step_limit: transformers' decode step does not clamp dt (its scan does), and we match its tokens (below)."""
    cache, diff = cached_pieces_minus_full(load(checkpoints[case][0]), prompt=7, chunk=4, total=16)
    assert cache.get_seq_length() == 16
    compared = 16 if CASES[case].get("time_step_limit") is None else 11
    assert diff[:, :compared].abs().max() < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers(checkpoints, case):
    folder, hf = checkpoints[case]
    assert_greedy_matches(load(folder), hf)


def test_sampling_and_beam_search_match_transformers(checkpoints):
    folder, hf = checkpoints["groups"]
    assert_sampling_and_beams_match(load(folder), hf)


def test_generate_continues_from_a_returned_cache(checkpoints):
    assert_generation_continues_from_its_cache(load(checkpoints["groups"][0]))


def test_bare_model_matches_transformers(checkpoints):
    import transformers

    from gpuformers import AutoModel

    folder, _ = checkpoints["groups"]
    ids, mask = left_padded()
    ours = AutoModel.from_pretrained(folder, progress=False)
    theirs = transformers.AutoModel.from_pretrained(folder).eval()
    assert type(ours).__name__ == "Mamba2Model"
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).last_hidden_state - theirs(ids, attention_mask=mask).last_hidden_state
    assert diff[mask.bool()].abs().max() < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_loads_what_we_save(checkpoints, case, tmp_path):
    import transformers

    folder, hf = checkpoints[case]
    load(folder).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Mamba2ForCausalLM"] and saved["n_groups"] == CASES[case]["n_groups"]
    assert not {"num_attention_heads", "intermediate_size", "rope_theta", "layer_types"} & set(saved)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert list(reloaded.config.time_step_limit) == list(hf.config.time_step_limit)
    assert max_logit_diff(reloaded, hf, *left_padded()) == 0.0


def test_lora_on_in_proj_matches_peft(checkpoints):
    """peft refuses out_proj (and conv1d) on Mamba models, which transformers' fused kernel reads directly: in_proj."""
    from tests.test_lora import _peft_pair

    hf = checkpoints["groups"][1]
    ours, theirs = _peft_pair(checkpoints["groups"], r=4, lora_alpha=8, target_modules=["in_proj"])
    assert max_logit_diff(ours, theirs, *left_padded()) < 1e-4
    assert max_logit_diff(ours, hf, *left_padded()) > 1e-2  # the adapters took part


def test_trainer_loss_matches_transformers(checkpoints, tmp_path):
    """One Trainer step at learning rate 0: the logged training loss is transformers' loss on the same batch."""
    from gpuformers.training import Trainer
    from tests.training.helpers import make_rows, tiny_args

    folder, hf = checkpoints["groups"]
    rows = make_rows(count=4, seed=3)
    trainer = Trainer(load(folder), tiny_args(tmp_path, max_steps=1, learning_rate=0.0, lr_scheduler_type="constant"),
                      train_dataset=rows)
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (longest - len(r["input_ids"])) for r in rows])
    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (longest - len(r["input_ids"])) for r in rows])
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.item()
    assert len(logged) == 1 and abs(logged[0] - expected) < 1e-4


def test_the_engine_gives_generates_tokens(checkpoints):
    """generate_batch on the transformers-saved checkpoint: each request's greedy tokens equal generate()'s."""
    ours = load(checkpoints["groups"][0])
    prompts = [[5, 9, 23], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    outputs = ours.generate_batch(prompts, max_new_tokens=6, do_sample=False, eos_token_id=None, progress_bar=False)
    for prompt, output in zip(prompts, outputs.values()):
        expected = ours.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert output.generated_tokens == expected[0, len(prompt):].tolist()


def test_refusals_name_what_is_missing(checkpoints):
    from gpuformers.generation.state_cache import RecurrentCache

    ours = load(checkpoints["groups"][0])
    ids = torch.tensor([[5, 9, 23, 42, 7]])
    with pytest.raises(NotImplementedError, match="state rollback"):
        ours.generate(ids, prompt_lookup_num_tokens=2, max_new_tokens=3)
    with pytest.raises(NotImplementedError, match="state-space model"):
        ours.generate(ids, cache_implementation="static", max_new_tokens=3)
    cache = RecurrentCache()
    with torch.no_grad():
        ours(ids, past_key_values=cache, use_cache=True)
    cache.crop(5)  # nothing to forget
    with pytest.raises(NotImplementedError, match="cannot be cropped from 5 to 3"):
        cache.crop(3)
    cache.crop(0)
    assert cache.get_seq_length() == 0 and cache.ssm_state(0) is None


def test_config_reads_transformers_spellings_and_refuses_bad_values():
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.config_checks import ConfigFieldError

    base = dict(model_type="mamba2", hidden_size=64, num_heads=8, head_dim=16, n_groups=2)
    config = ModelConfig.from_dict({**base, "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert list(config.time_step_limit) == [0.0, float("inf")] and config.vocab_size == 32768  # transformers' default
    assert config.chunk_size == 256 and config.state_size == 128 and config.residual_in_fp32
    with pytest.raises(ConfigFieldError, match=r"time_step_limit is \[0.1, 0.01\]; it must be a list \[low, high\]"):
        ModelConfig.from_dict({**base, "time_step_limit": [0.1, 0.01]})
    with pytest.raises(ConfigFieldError, match="n_groups is 0; it must be a positive integer"):
        ModelConfig.from_dict({**base, "n_groups": 0})
    with pytest.raises(ValueError, match=r"num_heads \(8\) must be a multiple of n_groups \(3\)"):
        ModelConfig.from_dict({**base, "n_groups": 3})
    with pytest.raises(ValueError, match=r"hidden_size \* expand \(64 \* 2\) must equal num_heads \* head_dim"):
        ModelConfig.from_dict({**base, "head_dim": 8})


def test_old_embedding_name_and_the_classifier_load(checkpoints, tmp_path):
    """mamba_ssm's checkpoints name the embeddings backbone.embedding (transformers renames them on load, as we do);
    AutoModelForSequenceClassification (which transformers does not have for Mamba2) pools the bare model's last
    non-padding state through its score."""
    import shutil

    from safetensors.torch import load_file, save_file

    from gpuformers import AutoModel, AutoModelForSequenceClassification

    folder, hf = checkpoints["groups"]
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    tensors = load_file(folder / "model.safetensors")
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert max_logit_diff(load(tmp_path), hf, *left_padded()) < 1e-4

    ids = torch.tensor([[5, 9, 23, 42, 7, 8], [0, 0, 11, 12, 13, 14]])  # left padding with pad_token_id 0
    classifier = AutoModelForSequenceClassification.from_pretrained(folder, progress=False, num_labels=3,
                                                                    pad_token_id=0)
    states = AutoModel.from_pretrained(folder, progress=False)(ids, attention_mask=(ids != 0).long()).last_hidden_state
    with torch.no_grad():
        logits = classifier(ids, attention_mask=(ids != 0).long()).logits
        assert (logits - classifier.score(states[:, -1])).abs().max() < 1e-5


def test_fit_counts_the_state_the_cache_holds(checkpoints):
    """gpuformers fit: the recurrent state per sequence is what a RecurrentCache holds after a forward (conv states in
    the model dtype, SSM states in float32); no keys and values; no position limit on the context."""
    from gpuformers.fit import fit_report
    from gpuformers.generation.state_cache import RecurrentCache

    ours = load(checkpoints["tied-limit"][0])
    cache = RecurrentCache()
    with torch.no_grad():
        ours(torch.tensor([[5, 9, 23]]), past_key_values=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for i in range(SHAPES["num_hidden_layers"])
               for t in (cache.conv_state(i), cache.ssm_state(i)))
    report = fit_report(ours.config, {"cpu": 2**30}, dtype=torch.float32, context=4096, batch=2)
    assert report.state_bytes_per_sequence == held and report.kv_bytes_per_token == 0
    assert report.activation_bytes_per_token > 0
    cpu = report.options[0]
    assert cpu.fits and cpu.max_context > ours.config.max_position_embeddings  # which caps no Mamba2 context


def test_bfloat16_matches_transformers(checkpoints):
    """In bfloat16 (the residual in float32, the scan and the states in float32, the decode step's products in
    float32 where transformers rounds dt * B to bfloat16 first): logits within bfloat16 rounding, the same tokens."""
    import transformers

    folder, _ = checkpoints["groups"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ours = load(folder, dtype=torch.bfloat16)
    assert max_logit_diff(ours, hf, *left_padded()) < 2e-2
    assert_greedy_matches(ours, hf)
