"""Assisted generation (assistant_model=, prompt_lookup_num_tokens=): greedy output equals plain greedy and
transformers' assisted generate token for token; sampling keeps the target's distribution; eos, lengths, streamers,
processors, scores and the errors users meet.

The checkpoints are tiny random ones written by transformers, with the lm_head scaled up so that logits are far
apart: float rounding between a multi-token verify forward and a one-token decode step cannot flip an argmax.
transformers is imported inside fixtures (it costs seconds).
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from gpuformers.generation.assisted import speculative_sampling
from gpuformers.generation.config import GenerationConfig
from gpuformers.generation.stopping import StoppingCriteria
from tests.fixtures.checkpoints import make_checkpoint
from tests.fixtures.streamers import RecordingStreamer

PROMPT_LENGTH = 12


def _load(folder):
    """(transformers model, our model) from one folder."""
    import transformers

    from gpuformers import AutoModelForCausalLM

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return hf, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, progress=False)


def _checkpoint(folder, seed: int, scale: float, **overrides):
    """Write a llama checkpoint with its lm_head scaled by `scale`; return (transformers model, our model)."""
    from safetensors.torch import load_file, save_file

    make_checkpoint(folder, "llama", seed=seed, tie_word_embeddings=False, **overrides)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * scale
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return _load(folder)


def _first_layer_only(source, folder):
    """Copy the checkpoint in `source` without its last layer: a smaller model that agrees with it often, not
    always (a random model of its own would never agree, and a draft would never be accepted)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    config = json.loads((source / "config.json").read_text())
    last = config["num_hidden_layers"] - 1
    weights = {k: v for k, v in load_file(source / "model.safetensors").items() if f".layers.{last}." not in k}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": last}))
    return _load(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"target": (hf, ours), "small": (hf, ours)}: a 2-layer target (vocab 128) and its first layer as assistant."""
    root = tmp_path_factory.mktemp("assisted")
    target = _checkpoint(root / "target", seed=0, scale=200.0)
    return {"target": target, "small": _first_layer_only(root / "target", root / "small")}


@pytest.fixture(scope="module")
def spread_models(tmp_path_factory):
    """A target and an assistant with 8 tokens and unscaled-up logits (spread distributions), no eos."""
    root = tmp_path_factory.mktemp("assisted-sampling")
    small = dict(vocab_size=8, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return (_checkpoint(root / "target", seed=2, scale=60.0, **small)[1],
            _checkpoint(root / "small", seed=3, scale=60.0, num_hidden_layers=1, **small)[1])


def _prompt(seed: int = 0, length: int = PROMPT_LENGTH) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


class _CountForwards:
    """Counts the forwards of a model (each generate() round is one)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.count += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# --- greedy: the same tokens as plain greedy and as transformers ---------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_assistant_equals_plain_greedy_and_transformers(models, seed):
    hf, ours = models["target"]
    hf_small, small = models["small"]
    ids = _prompt(seed)
    plain = ours.generate(ids, max_new_tokens=40, eos_token_id=None)
    streamer = RecordingStreamer()  # one put per round
    with _CountForwards(ours) as target_forwards:
        got = ours.generate(ids, max_new_tokens=40, eos_token_id=None, assistant_model=small, num_assistant_tokens=4,
                            streamer=streamer)
    assert torch.equal(got, plain)
    rounds = [len(call[0]) for call in streamer.calls[1:-1]]
    assert target_forwards.count == len(rounds) < 40
    assert max(rounds) > 1 and min(rounds) == 1  # drafts accepted in some rounds, rejected in others
    # transformers' assisted generate on the same checkpoints gives the same tokens
    expected = hf.generate(ids, max_new_tokens=40, eos_token_id=None, pad_token_id=0, do_sample=False,
                           assistant_model=hf_small)
    assert torch.equal(got, expected)


def test_assistant_equal_to_target_has_every_draft_accepted(models):
    _, ours = models["target"]
    ids = _prompt(2)
    plain = ours.generate(ids, max_new_tokens=40, eos_token_id=None)
    streamer = RecordingStreamer()  # one put per round
    got = ours.generate(ids, max_new_tokens=40, eos_token_id=None, assistant_model=ours, streamer=streamer,
                        num_assistant_tokens=8, assistant_confidence_threshold=None)
    assert torch.equal(got, plain)
    # each round: 8 accepted drafts + 1 token of the target's own; the last round drafts only what fits
    assert [len(call[0]) for call in streamer.calls[1:-1]] == [9, 9, 9, 9, 4]


def test_prompt_lookup_equals_plain_greedy_and_accepts_candidates(models):
    hf, ours = models["target"]
    # a repeating prompt, and one whose greedy continuation falls into short cycles (as random models' do), which
    # the lookup then finds in the generated text
    ids = _prompt(2, length=6).repeat(1, 3)
    plain = ours.generate(ids, max_new_tokens=48, eos_token_id=None)
    with _CountForwards(ours) as forwards:
        got = ours.generate(ids, max_new_tokens=48, eos_token_id=None, prompt_lookup_num_tokens=10,
                            max_matching_ngram_size=2)
    assert torch.equal(got, plain)
    assert forwards.count < 40, f"{forwards.count} target forwards for 48 tokens: few candidates accepted"
    expected = hf.generate(ids, max_new_tokens=48, eos_token_id=None, pad_token_id=0, do_sample=False,
                           prompt_lookup_num_tokens=10, max_matching_ngram_size=2)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 33])
def test_max_new_tokens_is_exact(models, max_new_tokens):
    _, ours = models["target"]
    _, small = models["small"]
    ids = _prompt(4)
    plain = ours.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=None)
    for kwargs in (dict(assistant_model=ours, num_assistant_tokens=5, assistant_confidence_threshold=None),
                   dict(assistant_model=small), dict(prompt_lookup_num_tokens=4)):
        got = ours.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=None, **kwargs)
        assert got.shape == (1, PROMPT_LENGTH + max_new_tokens)
        assert torch.equal(got, plain)


def test_eos_inside_an_accepted_run_stops_there(models):
    _, ours = models["target"]
    ids = _prompt(5)
    new = ours.generate(ids, max_new_tokens=30, eos_token_id=None)[0, PROMPT_LENGTH:].tolist()
    # the first token whose first appearance is at least 6 tokens in: the eos of this test
    at = next(i for i, t in enumerate(new) if i >= 6 and t not in new[:i])
    plain = ours.generate(ids, max_new_tokens=30, eos_token_id=new[at])
    assert plain.shape[1] == PROMPT_LENGTH + at + 1
    # a fully accepted draft that ends with eos, plus the target's token after it: the run is cut after eos
    got = ours.generate(ids, max_new_tokens=30, eos_token_id=new[at], assistant_model=ours,
                        num_assistant_tokens=20, assistant_confidence_threshold=None)
    assert torch.equal(got, plain)
    assert torch.equal(ours.generate(ids, max_new_tokens=30, eos_token_id=new[at], prompt_lookup_num_tokens=5), plain)


def test_user_stopping_criteria_processors_and_scores(models):
    _, ours = models["target"]
    _, small = models["small"]
    ids = _prompt(6)
    new = ours.generate(ids, max_new_tokens=20, eos_token_id=None, repetition_penalty=1.3)[0, PROMPT_LENGTH:]
    stop_token = int(new[9])

    class StopAt(StoppingCriteria):
        def __call__(self, input_ids, scores=None, **kwargs):
            return input_ids[:, -1] == stop_token

    kwargs = dict(max_new_tokens=20, eos_token_id=None, repetition_penalty=1.3, stopping_criteria=[StopAt()],
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = ours.generate(ids, **kwargs)
    got = ours.generate(ids, assistant_model=small, num_assistant_tokens=6, **kwargs)
    assert torch.equal(got.sequences, plain.sequences)
    assert got.sequences.shape[1] <= PROMPT_LENGTH + 10
    assert len(got.scores) == len(got.logits) == got.sequences.shape[1] - PROMPT_LENGTH
    for mine, theirs in zip(got.scores + got.logits, plain.scores + plain.logits):
        assert mine.shape == theirs.shape == (1, 128)
        torch.testing.assert_close(mine, theirs, atol=1e-3, rtol=1e-4)
    # the target's cache holds every token but the newest, as after plain generate
    assert got.past_key_values.get_seq_length() == got.sequences.shape[1] - 1


def test_streamer_gets_prompt_then_the_accepted_tokens(models):
    _, ours = models["target"]
    ids = _prompt(7)
    streamer = RecordingStreamer()
    got = ours.generate(ids, max_new_tokens=25, eos_token_id=None, streamer=streamer, assistant_model=ours,
                        num_assistant_tokens=4, assistant_confidence_threshold=None)
    assert streamer.calls[0] == ids.tolist()
    assert streamer.calls[-1] == "end"
    streamed = [t for call in streamer.calls[1:-1] for t in call[0]]
    assert streamed == got[0, PROMPT_LENGTH:].tolist()
    assert len(streamer.calls) - 2 < 25  # several tokens per put


def test_left_padded_single_prompt(models):
    _, ours = models["target"]
    _, small = models["small"]
    ids = _prompt(8)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    plain = ours.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None, assistant_model=small)
    assert torch.equal(got, plain)


def test_heuristic_schedule_grows_the_draft_and_persists(models):
    _, ours = models["target"]
    ids = _prompt(9)
    original = ours.generation_config.copy()
    try:
        ours.generation_config.num_assistant_tokens = 2
        ours.generation_config.num_assistant_tokens_schedule = "heuristic"
        plain = ours.generate(ids, max_new_tokens=30, eos_token_id=None)
        got = ours.generate(ids, max_new_tokens=30, eos_token_id=None, assistant_model=ours,
                            assistant_confidence_threshold=None)
        assert torch.equal(got, plain)
        # every draft accepted: 2 -> 4 -> 6 -> 8 (2 + 4 + 6 + 8 drafts and 4 own tokens make 24, then 6 of 10)
        assert ours.generation_config.num_assistant_tokens > 8
    finally:
        ours.generation_config = original


# --- sampling: the target's distribution ---------------------------------------------------------------------------


def test_speculative_sampling_keeps_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(2, 6, generator=g) * 2  # (k + 1, vocab) with k = 1
    draft = torch.randn(1, 6, generator=g) * 2
    p, q = target.softmax(-1)[0], draft.softmax(-1)[0]
    torch.manual_seed(0)
    n = 2000
    first = torch.zeros(6)
    for _ in range(n):
        candidate = torch.multinomial(q, 1)
        tokens, _ = speculative_sampling(candidate, draft, target)
        first[tokens[0]] += 1
    assert (p - q).abs().sum() / 2 > 0.2  # the draft alone would be far off
    assert (first / n - p).abs().sum() / 2 < 0.05


def test_sampling_with_an_assistant_keeps_the_first_token_distribution(spread_models):
    from scipy.stats import chisquare

    target, assistant = spread_models
    ids = torch.tensor([[1, 5, 2, 7, 3]])
    with torch.no_grad():
        p = target(ids).logits[0, -1].softmax(-1)
        q = assistant(ids).logits[0, -1].softmax(-1)
    assert (p - q).abs().sum() / 2 > 0.2  # accepting drafts unchecked would fail below
    n = 600
    counts = torch.zeros(8)
    for seed in range(n):
        torch.manual_seed(seed)
        out = target.generate(ids, max_new_tokens=3, do_sample=True, top_k=0, assistant_model=assistant,
                              num_assistant_tokens=2, assistant_confidence_threshold=None)
        counts[out[0, ids.shape[1]]] += 1
    expected = p * n
    keep = expected >= 5  # chi-square needs expected counts of at least ~5 per cell
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    assert chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue > 1e-4


@pytest.mark.parametrize("drafter", ["assistant", "prompt_lookup"])
def test_sampled_tokens_lie_in_top_k(models, drafter):
    _, ours = models["target"]
    _, small = models["small"]
    ids = _prompt(10, length=6).repeat(1, 2)
    kwargs = dict(assistant_model=small) if drafter == "assistant" else dict(prompt_lookup_num_tokens=4)
    for seed in range(3):
        torch.manual_seed(seed)
        out = ours.generate(ids, max_new_tokens=20, eos_token_id=None, do_sample=True, top_k=3, temperature=30.0,
                            **kwargs)
        with torch.no_grad():
            logits = ours(out).logits[0, ids.shape[1] - 1:-1]  # (20, vocab): the logits each new token came from
        top = logits.topk(3, dim=-1).indices
        assert (top == out[0, ids.shape[1]:, None]).any(dim=-1).all()


# --- configuration and errors --------------------------------------------------------------------------------------


def test_config_fields_have_transformers_defaults_and_are_checked():
    config = GenerationConfig()
    assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold,
            config.prompt_lookup_num_tokens, config.max_matching_ngram_size) == (20, "constant", 0.4, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # supported now: no "ignored" warning
        GenerationConfig(prompt_lookup_num_tokens=10)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule 'fast' is not one of"):
        GenerationConfig(num_assistant_tokens_schedule="fast")
    with pytest.raises(ValueError, match="num_assistant_tokens must be an integer >= 1"):
        GenerationConfig(num_assistant_tokens=0)


def test_errors_name_the_problem(models):
    _, ours = models["target"]
    _, small = models["small"]
    batch = torch.cat([_prompt(0), _prompt(1)])
    with pytest.raises(ValueError, match="batch size 1.*call generate\\(\\) once per prompt"):
        ours.generate(batch, max_new_tokens=4, assistant_model=small)
    with pytest.raises(ValueError, match="batch of 2"):
        ours.generate(batch, max_new_tokens=4, prompt_lookup_num_tokens=3)
    with pytest.raises(NotImplementedError, match="beam search \\(num_beams=2\\)"):
        ours.generate(_prompt(0), max_new_tokens=4, num_beams=2, assistant_model=small)
    with pytest.raises(ValueError, match="not both"):
        ours.generate(_prompt(0), max_new_tokens=4, assistant_model=small, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="needs the KV cache"):
        ours.generate(_prompt(0), max_new_tokens=4, assistant_model=small, use_cache=False)
