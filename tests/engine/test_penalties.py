"""The engine's logit adjustments (SamplingParams repetition_penalty, frequency_penalty, presence_penalty,
logit_bias, min_new_tokens, min_p) on a tiny random model: greedy tokens equal to generate() with the same settings
(mixed in one batch, under preemption and chunked prefill, sync and async); the OpenAI penalties and logit_bias
equal to a step-by-step reference on the model's own logits; a step without them never reaches their code; and
the GenerationConfig fields the engine cannot follow are refused by name."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from gpuformers.engine import sampler
from gpuformers.engine.config import ContinuousBatchingConfig, sampling_params_from
from gpuformers.engine.sequence import RequestStatus, SamplingParams
from tests.engine.test_engine import make_prompts, tiny_model

NEW_TOKENS = 10
EOS = 24  # the token the tiny model produces most: min_new_tokens has an eos to hold back


def pressure_config(**overrides) -> ContinuousBatchingConfig:
    """12 blocks of 8 slots for 24 requests of up to 78 tokens, 24 tokens a step: preemption and chunked prefill."""
    return ContinuousBatchingConfig(**{**dict(block_size=8, num_blocks=12, max_batch_tokens=24,
                                              max_requests_per_batch=16), **overrides})


@pytest.fixture(scope="module")
def setup():
    return tiny_model(), make_prompts(24, seed=3)


def run_staggered(manager, prompts, settings: list[dict]) -> list:
    """Add four requests per step, each prompt with its own settings; every output once all have finished."""
    ids, pending = [], list(zip(prompts, settings))
    while True:
        for prompt, extra in pending[:4]:
            ids.append(manager.add_request(prompt, max_new_tokens=NEW_TOKENS, **extra))
        pending = pending[4:]
        if not manager.step() and not pending:
            break
    outputs = [manager.get_result(i, timeout=0) for i in ids]
    for output in outputs:
        assert output.status is RequestStatus.FINISHED, output.error
    return [output.generated_tokens for output in outputs]


def generate_reference(model, prompt, eos=EOS, **settings) -> list[int]:
    return model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=eos, **settings)[0, len(prompt):].tolist()


@torch.no_grad()
def openai_reference(model, prompt, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                     logit_bias=None) -> list[int]:
    """Greedy decoding written out on the full sequence's logits: logit_bias, then the repetition penalty over
    prompt and output, then OpenAI's penalties over the output (vLLM's order)."""
    output = []
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([prompt + output], device=model.device)).logits[0, -1].float()
        for token, bias in (logit_bias or {}).items():
            logits[token] += bias
        for token in set(prompt + output):
            value = logits[token]
            logits[token] = value * repetition_penalty if value < 0 else value / repetition_penalty
        for token, count in Counter(output).items():
            logits[token] -= frequency_penalty * count + presence_penalty
        output.append(int(logits.argmax()))
    return output


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_greedy_penalties_match_generate_under_preemption(setup, async_batching):
    """repetition_penalty and min_new_tokens (and min_length through the generation config) give generate()'s
    tokens, request by request, in a batch that mixes them with plain requests."""
    model, prompts = setup
    kinds = [{}, dict(repetition_penalty=1.5), dict(min_new_tokens=6), dict(repetition_penalty=0.7, min_new_tokens=4)]
    settings = [kinds[i % len(kinds)] for i in range(len(prompts))]
    reference = [generate_reference(model, p, **s) for p, s in zip(prompts, settings)]
    plain = [generate_reference(model, p) for p in prompts]
    for kind in kinds[1:]:  # each setting changes some request's tokens: the comparison can fail
        assert any(reference[i] != plain[i] for i, s in enumerate(settings) if s == kind), kind
    assert any(len(plain[i]) < 6 <= len(reference[i]) for i, s in enumerate(settings) if s == kinds[2])

    manager = model.init_continuous_batching(continuous_batching_config=pressure_config(
        use_async_batching=async_batching), eos_token_id=EOS)
    assert max(map(len, prompts)) > 2 * manager.config.max_batch_tokens  # long prompts are prefilled in chunks
    assert run_staggered(manager, prompts, settings) == reference
    assert manager.num_preemptions > 0
    # A generation config's own repetition_penalty and min_length apply to every request.
    results = model.generate_batch(prompts[:4], max_new_tokens=NEW_TOKENS, eos_token_id=EOS, repetition_penalty=1.5,
                                   min_length=30, progress_bar=False, block_size=8, num_blocks=64)
    expected = [generate_reference(model, p, repetition_penalty=1.5, min_length=30) for p in prompts[:4]]
    assert [r.generated_tokens for r in results.values()] == expected


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_openai_penalties_and_logit_bias_match_the_formula(setup, async_batching):
    model, prompts = setup
    prompts = prompts[:12]
    # The tiny model seldom repeats a token within ten, so the penalties that pull repeats in are what show:
    # frequency 0.8 with presence -1.5 favours a token seen once (+0.7) and not one seen twice (-0.1).
    kinds = [dict(frequency_penalty=-1.0), dict(presence_penalty=-1.5),
             dict(frequency_penalty=0.8, presence_penalty=-1.5), dict(logit_bias={5: 3.0, 110: -2.0, 17: 4.5}),
             dict(repetition_penalty=1.3, frequency_penalty=-0.6, presence_penalty=0.2, logit_bias={5: 3.0, 9: 2.5}),
             {}]
    settings = [kinds[i % len(kinds)] for i in range(len(prompts))]
    reference = [openai_reference(model, p, **s) for p, s in zip(prompts, settings)]
    plain = [openai_reference(model, p) for p in prompts]
    for kind in kinds[:-1]:
        assert any(reference[i] != plain[i] for i, s in enumerate(settings) if s == kind), kind
    manager = model.init_continuous_batching(continuous_batching_config=pressure_config(
        num_blocks=10, use_async_batching=async_batching), eos_token_id=None)
    assert run_staggered(manager, prompts, settings) == reference
    assert manager.num_preemptions > 0


def test_logit_bias_of_100_forces_a_token_and_minus_100_bans_one(setup):
    model, prompts = setup
    banned = generate_reference(model, prompts[0], eos=None)[0]
    results = model.generate_batch(prompts[:3], max_new_tokens=6, eos_token_id=None, progress_bar=False,
                                   block_size=8, num_blocks=64)
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64)
    forced = manager.add_request(prompts[1], max_new_tokens=6, logit_bias={77: 100})
    forced_sampled = manager.add_request(prompts[2], max_new_tokens=6, logit_bias={77: 100}, do_sample=True,
                                         temperature=1.5, top_k=0, seed=3)
    ban = manager.add_request(prompts[0], max_new_tokens=6, logit_bias={banned: -100})
    manager.run_until_done()
    assert manager.get_result(forced, timeout=0).generated_tokens == [77] * 6
    assert manager.get_result(forced_sampled, timeout=0).generated_tokens == [77] * 6
    assert banned not in manager.get_result(ban, timeout=0).generated_tokens
    assert 77 not in results["req_1"].generated_tokens  # the bias did it, not the model


def test_min_p_sampling_matches_generate(setup):
    """Seeded sampling with temperature and min_p gives generate()'s tokens under the same seed (on the CPU both
    draw from torch.multinomial on one generator)."""
    model, prompts = setup
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64)
    settings = dict(do_sample=True, temperature=1.5, top_k=0)
    ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS, min_p=0.3, seed=10 + i, **settings)
           for i, p in enumerate(prompts[:4])]
    without = [manager.add_request(p, max_new_tokens=NEW_TOKENS, seed=10 + i, **settings)
               for i, p in enumerate(prompts[:4])]
    manager.run_until_done()
    outputs = [manager.get_result(i, timeout=0).generated_tokens for i in ids]
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        torch.manual_seed(10 + i)
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_p=0.3, eos_token_id=None,
                                  **settings)[0, len(prompt):].tolist()
        assert tokens == expected
    assert outputs != [manager.get_result(i, timeout=0).generated_tokens for i in without]


def test_filter_order_matches_transformers_warpers():
    """top_k -> top_p -> min_p (transformers' order; top_p and min_p do not commute) keeps the tokens
    transformers' warpers keep."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=g) * 3
    for top_k, top_p, min_p in [(0, 0.8, 0.2), (20, 0.9, 0.05), (0, 1.0, 0.1), (10, 1.0, 0.0), (0, 0.5, 0.6)]:
        expected = logits
        for warper, on in [(TopKLogitsWarper(max(top_k, 1)), top_k), (TopPLogitsWarper(top_p), top_p < 1),
                           (MinPLogitsWarper(min_p), min_p)]:
            if on:
                expected = warper(None, expected)
        for row in range(logits.shape[0]):
            kept = sampler._filter_row(logits[row], top_k, top_p, min_p).isfinite()
            assert torch.equal(kept, expected[row].isfinite()), (top_k, top_p, min_p, row)


def test_unused_adjustments_cost_nothing(setup, monkeypatch):
    """A batch without penalties, bias or min_new_tokens never calls the adjusting code nor allocates token
    counts; a request with one does."""
    model, prompts = setup
    calls = []
    original = sampler._adjust_logits
    monkeypatch.setattr(sampler, "_adjust_logits", lambda *args: calls.append(args) or original(*args))
    manager = model.init_continuous_batching(eos_token_id=EOS, block_size=8, num_blocks=64)
    manager.add_request(prompts[0], max_new_tokens=6)
    manager.add_request(prompts[1], max_new_tokens=6, do_sample=True, seed=1, top_logprobs=2, stop=[3, [4, 5]])
    # Past min_new_tokens the mask has nothing left to do: the request stops adjusting.
    manager.add_request(prompts[2], max_new_tokens=6, min_new_tokens=2)
    manager.run_until_done()
    assert len(calls) == 2 and manager.runner.token_counts.output is None
    penalised = manager.add_request(prompts[3], max_new_tokens=6, presence_penalty=0.5)
    manager.run_until_done()
    steps = len(manager.get_result(penalised, timeout=0).generated_tokens)  # one step per token (eos may end it)
    assert len(calls) == 2 + steps and manager.runner.token_counts.output is not None


@pytest.mark.parametrize("repetition", [True, False])
def test_sparse_and_dense_penalties_agree(repetition):
    # The CPU touches only the tokens seen, the GPU whole rows: the same numbers, bit for bit (here both on the CPU).
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    logits[0, 7] = float("-inf")  # a banned token stays banned
    index = torch.tensor([1, 3, 4])
    output = torch.randint(0, 3, (3, 50), generator=g, dtype=torch.int32) * (torch.rand(3, 50, generator=g) < 0.2)
    in_prompt = (torch.rand(3, 50, generator=g) < 0.1) if repetition else None
    penalty = torch.tensor([[1.3], [1.0], [0.8]])
    frequency, presence = torch.tensor([[0.5], [0.0], [-0.4]]), torch.tensor([[0.2], [1.5], [0.0]])
    args = (logits, index, output, in_prompt, penalty, frequency, presence)
    dense, sparse = sampler._penalise_dense(*args), sampler._penalise_sparse(*args)
    assert torch.equal(dense, sparse)
    assert not torch.equal(dense, logits) and torch.equal(dense[[0, 2, 5]], logits[[0, 2, 5]])


def test_token_count_rows_are_reused_after_requests_finish(setup):
    model, prompts = setup
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64, max_requests_per_batch=4)
    ids = [manager.add_request(p, max_new_tokens=4, frequency_penalty=0.5) for p in prompts]
    manager.run_until_done()
    assert all(manager.get_result(i, timeout=0).status is RequestStatus.FINISHED for i in ids)
    assert manager.runner.token_counts.output.shape[0] == 8  # at most 4 live requests: never grown past 8 rows


def test_min_new_tokens_holds_back_stop_tokens(setup):
    """Before min_new_tokens, a one-token stop is masked and a longer stop sequence does not end the request."""
    model, prompts = setup
    plain = generate_reference(model, prompts[0], eos=None)
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64)
    single = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, stop=[plain[0]], min_new_tokens=3)
    longer = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, stop=[plain[:2]], min_new_tokens=4)
    early = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, stop=[plain[:2]])
    manager.run_until_done()
    assert manager.get_result(early, timeout=0).generated_tokens == plain[:2]
    assert manager.get_result(single, timeout=0).generated_tokens[0] != plain[0]
    tokens = manager.get_result(longer, timeout=0).generated_tokens
    assert tokens[:2] == plain[:2] and len(tokens) > 2


def test_generation_config_fields_the_engine_cannot_follow_are_refused(setup):
    from gpuformers.generation.config import GenerationConfig

    model, prompts = setup
    with pytest.raises(NotImplementedError, match="no_repeat_ngram_size=2"):
        model.generate_batch(prompts[:1], no_repeat_ngram_size=2, progress_bar=False)
    with pytest.raises(NotImplementedError, match=r"num_beams=4, bad_words_ids=\[\[3\]\]"):
        model.generate_batch(prompts[:1], num_beams=4, bad_words_ids=[[3]], progress_bar=False)
    with pytest.raises(NotImplementedError, match="typical_p=0.5"):
        model.generate_batch(prompts[:1], do_sample=True, typical_p=0.5, progress_bar=False)
    with pytest.raises(NotImplementedError, match=r"top_h=0.5, sequence_bias=.*exponential_decay_length_penalty"):
        model.generate_batch(prompts[:1], do_sample=True, top_h=0.5, sequence_bias=[[[3], 1.0]],
                             exponential_decay_length_penalty=(2, 1.5), progress_bar=False)
    cb = ContinuousBatchingConfig()
    # typical_p without sampling changes nothing (generate() skips it too); the honoured fields are mapped.
    params = sampling_params_from(GenerationConfig(typical_p=0.5, repetition_penalty=1.2, min_p=0.1, min_length=10,
                                                   eos_token_id=3), cb, prompt_length=4)
    assert (params.repetition_penalty, params.min_p, params.min_new_tokens) == (1.2, 0.1, 6)


def test_unhonoured_checkpoint_defaults_fail_at_start_and_serve_drops_them(setup, capsys):
    # A checkpoint whose generation_config.json sets a field the engine cannot follow: the manager refuses it when
    # it is made (not at every request), and `gpuformers serve` serves without it, saying so.
    from gpuformers.generation.config import GenerationConfig
    from gpuformers.serving.cli import _drop_unhonoured_defaults

    model, prompts = setup
    saved = model.generation_config
    try:
        model.generation_config = GenerationConfig(no_repeat_ngram_size=3, temperature=0.7, eos_token_id=EOS)
        with pytest.raises(NotImplementedError, match="no_repeat_ngram_size=3"):
            model.init_continuous_batching()
        _drop_unhonoured_defaults(model)
        assert "sets no_repeat_ngram_size, which" in capsys.readouterr().err
        assert (model.generation_config.no_repeat_ngram_size, model.generation_config.temperature) == (0, 0.7)
        assert len(model.generate_batch(prompts[:2], max_new_tokens=3, progress_bar=False)) == 2
    finally:
        model.generation_config = saved


@pytest.mark.parametrize("settings, message", [
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be a number > 0"),
    (dict(frequency_penalty=2.5), r"frequency_penalty=2.5 must be a number in \[-2, 2\]"),
    (dict(presence_penalty=float("nan")), r"presence_penalty=nan must be a number in \[-2, 2\]"),
    (dict(min_p=1.5), r"min_p=1.5 must be a number in \[0, 1\]"),
    (dict(min_new_tokens=-1), "min_new_tokens=-1 must be an int >= 0"),
    (dict(logit_bias={"5": 1.0}), "logit_bias key '5' must be a token id"),
    (dict(logit_bias={5: float("inf")}), r"logit_bias\[5\]=inf must be a finite number"),
])
def test_sampling_params_errors_name_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_adjustments_on_gpu_without_host_sync():
    """On CUDA (async batching and CUDA graphs on, their defaults there): the same tokens as generate() and the
    formula, and the adjustments never make the host wait for the device (greedy rows: torch.multinomial, which
    sampled rows use, is not this test's business)."""
    from gpuformers.engine.sequence import Sequence

    model, prompts = tiny_model().to("cuda"), make_prompts(24, seed=3)
    like_generate = [{}, dict(repetition_penalty=1.5, min_new_tokens=6)]
    formula = [dict(frequency_penalty=0.8, presence_penalty=-1.5), dict(logit_bias={5: 3.0}, repetition_penalty=0.7)]
    settings, reference = [], []
    for i, prompt in enumerate(prompts):
        if i % 2 == 0:
            settings.append(like_generate[i // 2 % 2])
            reference.append(generate_reference(model, prompt, **settings[-1]))
        else:
            settings.append({**formula[i // 2 % 2], "ignore_eos": True})  # the formula knows no eos
            reference.append(openai_reference(model, prompt, **formula[i // 2 % 2]))
    manager = model.init_continuous_batching(eos_token_id=EOS, block_size=16, num_blocks=24, max_batch_tokens=64)
    assert manager.config.use_async_batching and manager.config.use_cuda_graph
    assert run_staggered(manager, prompts, settings) == reference

    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.1, logit_bias={3: 2.0},
                            min_new_tokens=4, eos_token_ids=(2,))
    sequences = [Sequence(f"s{i}", list(range(i, i + 30)), params) for i in range(8)]
    counts = sampler.TokenCounts(torch.device("cuda"))
    logits = torch.randn(8, 128, device="cuda")
    sampler.sample_on_device(logits, sequences, counts)  # the first step allocates the tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            sampler.sample_on_device(logits, sequences, counts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(counts.output.sum()) == 4 * 8
