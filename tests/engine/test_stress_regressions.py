"""Regressions found by a randomized stress campaign of the engine (requests arriving between steps, preemption,
chunked prefill, prefix sharing, cancels, streaming, per-request sampling settings): a bad request is refused
when it is added, with a message naming the value, and never fails the other requests of its step; request ids
stay unique while their outputs wait; the context limit and default length follow generate(); a request that would
run past GPT-2's learned positions is refused."""

from __future__ import annotations

import pytest
import torch

from gpuformers.engine.sequence import RequestStatus
from tests.engine.test_engine import tiny_model

EOS = 24


@pytest.fixture(scope="module")
def model():
    return tiny_model()  # vocab 128, max_position_embeddings 256


def manager_for(model, **settings):
    return model.init_continuous_batching(eos_token_id=EOS, block_size=8, num_blocks=64, prepack_weights=False,
                                          **settings)


def test_a_prompt_token_outside_the_vocabulary_is_refused_and_fails_no_other_request(model):
    """A token id past the embedding table used to reach the step, whose IndexError failed every request in it."""
    manager = manager_for(model)
    good = manager.add_request([1, 2, 3], max_new_tokens=4)
    for bad in ([1, 500, 3], [1, -1, 3]):
        with pytest.raises(ValueError, match=rf"prompt token {bad[1]} at position 1 is not a token id .*\[0, 128\)"):
            manager.add_request(bad, max_new_tokens=4)
    manager.run_until_done()
    output = manager.get_result(good, timeout=0)
    assert output.status is RequestStatus.FINISHED and len(output.generated_tokens) >= 1


@pytest.mark.parametrize("settings, message", [
    (dict(do_sample=True, temperature=float("nan")), "temperature=nan must be a number >= 0"),
    (dict(do_sample=True, top_k=2.5), "top_k=2.5 must be an int >= 0"),
    (dict(do_sample=True, seed=1.5), "seed=1.5 must be an int"),
    (dict(stop="ab"), "stop='ab' must be a list of token ids"),
    (dict(stop=[[]]), r"stop entry \[\] must be a token id or a non-empty list"),
], ids=["nan_temperature", "float_top_k", "float_seed", "text_stop", "empty_stop"])
def test_invalid_sampling_settings_are_refused_at_add_naming_the_value(model, settings, message):
    """Such values used to pass SamplingParams and break the step (every request in it failed: multinomial on NaN,
    topk with a float k, manual_seed with a float), or failed with int()'s message."""
    manager = manager_for(model)
    good = manager.add_request([1, 2, 3], max_new_tokens=3)
    with pytest.raises(ValueError, match=message):
        manager.add_request([4, 5, 6], max_new_tokens=3, **settings)
    manager.run_until_done()
    assert manager.get_result(good, timeout=0).status is RequestStatus.FINISHED


def test_request_ids_stay_unique_while_their_outputs_wait(model):
    """A second request under a waiting id overwrote the first one's output (lost); an automatic id could be one a
    caller had given ("req_0")."""
    manager = manager_for(model)
    mine = manager.add_request([1, 2, 3], request_id="req_0", max_new_tokens=3)
    auto = manager.add_request([4, 5, 6, 7], max_new_tokens=5)
    assert auto != mine
    with pytest.raises(ValueError, match="request_id 'req_0' is already in use"):
        manager.add_request([8, 9], request_id="req_0", max_new_tokens=2)
    manager.run_until_done()
    assert manager.get_result(mine, timeout=0).prompt_ids == [1, 2, 3]
    assert manager.get_result(auto, timeout=0).prompt_ids == [4, 5, 6, 7]
    # Once its output is taken, an id may be used again.
    again = manager.add_request([8, 9], request_id="req_0", max_new_tokens=2, streaming=True)
    manager.run_until_done()
    assert list(manager.request_id_iter(again))[-1].prompt_ids == [8, 9]
    assert manager.add_request([8, 9], request_id="req_0", max_new_tokens=2) == "req_0"


def test_context_limit_and_default_length_follow_generate(model):
    """A prompt past max_position_embeddings ran (generate() refuses it), and without max_new_tokens the default 20
    new tokens were not capped at max_position_embeddings as generate() caps them."""
    manager = manager_for(model)
    with pytest.raises(ValueError, match="the prompt has 300 tokens but the model handles at most "
                                         "max_position_embeddings=256"):
        manager.add_request([5] * 300, max_new_tokens=2)
    prompt = [(7 * i) % 128 for i in range(250)]
    rid = manager.add_request(prompt, ignore_eos=True)  # the default length: 20 new tokens, capped at 256 in all
    manager.run_until_done()
    expected = model.generate(torch.tensor([prompt]), do_sample=False, eos_token_id=None)[0, 250:].tolist()
    assert len(expected) == 6
    assert manager.get_result(rid, timeout=0).generated_tokens == expected
    with pytest.raises(ValueError, match="max_length=256 leaves no room for new tokens after a prompt of 256"):
        manager.add_request([5] * 256)


def test_a_tensor_of_several_prompts_is_refused(model):
    """input_ids of shape (2, n) were flattened into one prompt of 2n tokens."""
    manager = manager_for(model)
    with pytest.raises(ValueError, match=r"input_ids of shape \(2, 3\) hold 2 prompts"):
        manager.add_request(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=2)
    rid = manager.add_request(torch.tensor([[1, 2, 3]]), max_new_tokens=2)  # one row is one prompt
    manager.run_until_done()
    assert manager.get_result(rid, timeout=0).prompt_ids == [1, 2, 3]


def test_a_request_past_gpt2s_learned_positions_is_refused_and_fails_no_other_request():
    """GPT-2's position table has max_position_embeddings rows: a request decoding past them reached the step, whose
    IndexError failed every request in it."""
    from gpuformers.models.config import ModelConfig
    from gpuformers.models.registry import model_class_for

    config = ModelConfig.from_dict(dict(model_type="gpt2", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=32))
    torch.manual_seed(0)
    gpt2 = model_class_for(config)(config).eval()
    manager = gpt2.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=32, prepack_weights=False)
    good = manager.add_request([1, 2, 3], max_new_tokens=4)
    with pytest.raises(ValueError, match="needs 39 positions but GPT2LMHeadModel has learned positions for 32 .* "
                                         "give max_new_tokens <= 3"):
        manager.add_request(list(range(30)), max_new_tokens=10)
    edge = manager.add_request(list(range(30)), max_new_tokens=3)  # positions 0..31: the whole table
    manager.run_until_done()
    assert manager.get_result(good, timeout=0).status is RequestStatus.FINISHED
    assert len(manager.get_result(edge, timeout=0).generated_tokens) == 3


def test_sampled_logprobs_are_the_models_whatever_temperature_and_filters(model):
    """A sampled request's logprobs were those of its tempered, top-k / top-p filtered distribution: top_logprobs
    held -inf entries with arbitrary token ids (which a JSON response cannot carry), and the values changed with the
    temperature. They are the model's own, as for a greedy request (and as OpenAI's and vLLM's)."""
    manager = manager_for(model)
    prompt = [5, 17, 33, 2, 90]
    rid = manager.add_request(prompt, max_new_tokens=5, do_sample=True, temperature=0.6, top_k=2, top_p=0.9,
                              seed=3, top_logprobs=4, ignore_eos=True)
    manager.run_until_done()
    out = manager.get_result(rid, timeout=0)
    with torch.no_grad():
        log_probs = model(torch.tensor([prompt + out.generated_tokens])).logits[0, len(prompt) - 1:-1].float()
    log_probs = log_probs.log_softmax(-1)
    expected = log_probs.gather(1, torch.tensor(out.generated_tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)
    for step, top in enumerate(out.top_logprobs):
        values, ids = log_probs[step].topk(4)
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-4, rtol=1e-4)


def test_a_top_p_below_float32_precision_keeps_the_top_token():
    """top_p=1e-300 rounds to 0 in float32, and the "mass before it >= top_p" rule then dropped every token, the top
    one too: NaN probabilities failed the step. The top token always stays, so it is greedy."""
    from gpuformers.engine.sampler import _filter_row

    logits = torch.tensor([0.5, 3.0, -1.0, 2.0])
    kept = _filter_row(logits, top_k=0, top_p=1e-300, min_p=0.0)
    assert torch.isfinite(kept).tolist() == [False, True, False, False]


def test_a_broken_loop_fails_the_requests_it_never_took_and_refuses_new_ones(model, monkeypatch):
    """When the background loop died on an error, requests still in its inbox were never published (their callers
    waited forever) and later add_request calls queued to a dead loop."""
    manager = manager_for(model)

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(manager, "_drain_inbox", broken)
    queued = manager.add_request([1, 2, 3], max_new_tokens=4)
    manager.start()
    output = manager.get_result(queued, timeout=10)
    assert output is not None and output.status is RequestStatus.FAILED and "RuntimeError: boom" in output.error
    manager._thread.join(10)
    with pytest.raises(RuntimeError, match=r"the engine loop has stopped \(engine stopped: RuntimeError: boom\)"):
        manager.add_request([1, 2, 3], max_new_tokens=4)
    monkeypatch.undo()  # fixed: start() runs the loop again and it serves
    manager.start()
    again = manager.add_request([1, 2, 3], max_new_tokens=4)
    assert manager.get_result(again, timeout=30).status is RequestStatus.FINISHED
    manager.stop()
