"""The server's logit adjustments without a server: completions and chat map frequency_penalty, presence_penalty,
logit_bias and vLLM's repetition_penalty, min_p, min_tokens; out-of-range values are OpenAI-shaped 400s naming the
field; a Job hands them to the engine under the engine's names, and the engine follows them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpuformers.serving.job import Job
from gpuformers.serving.protocol import APIError, parse_chat, parse_completion

FIELDS = {"frequency_penalty": 0.5, "presence_penalty": -1.25, "logit_bias": {"77": 100, "3": -2.5},
          "repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("parse, base", [(parse_completion, {"model": "m", "prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
def test_fields_are_mapped(parse, base):
    request = parse({**base, **FIELDS, "max_tokens": 8})
    assert (request.frequency_penalty, request.presence_penalty, request.repetition_penalty, request.min_p,
            request.min_tokens) == (0.5, -1.25, 1.1, 0.05, 4)
    assert request.logit_bias == {77: 100.0, 3: -2.5}
    unset = parse(base)  # not sent: None, so the model's generation config keeps its say
    assert [getattr(unset, name) for name in FIELDS] == [None] * len(FIELDS)


@pytest.mark.parametrize("fields, param, words", [
    ({"frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty=2.5 must be in [-2.0, 2.0]"),
    ({"presence_penalty": -3}, "presence_penalty", "presence_penalty=-3 must be in [-2.0, 2.0]"),
    ({"presence_penalty": "1"}, "presence_penalty", "must be a finite number, got str"),
    ({"logit_bias": {"50256": 101}}, "logit_bias", "logit_bias['50256']=101 must be a number in [-100, 100]"),
    ({"logit_bias": {"hello": 1}}, "logit_bias", "logit_bias key 'hello' must be a token id"),
    ({"logit_bias": [[5, 1]]}, "logit_bias", 'logit_bias must be an object of {"token id": bias}, got list'),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty=0 must be in (0.0, 2.0]"),
    ({"min_p": 1.5}, "min_p", "min_p=1.5 must be in [0.0, 1.0]"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens=-1 must be >= 0"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "min_tokens=9 must be at most max_tokens (8)"),
])
@pytest.mark.parametrize("parse, base", [(parse_completion, {"model": "m", "prompt": "hi"}), (parse_chat, CHAT)],
                         ids=["completions", "chat"])
def test_out_of_range_values_are_400s_naming_the_field(parse, base, fields, param, words):
    with pytest.raises(APIError) as error:
        parse({**base, **fields})
    assert error.value.status == 400 and error.value.param == param and words in error.value.message
    assert error.value.body()["error"]["type"] == "invalid_request_error"


class RecordingEngine:
    """The serving Engine's submit, straight into an engine that is stepped by the test."""

    def __init__(self, manager):
        self.manager, self.requests = manager, []

    def submit(self, prompt_ids, sampling, tag, queue, loop):
        self.requests.append(sampling)
        return self.manager.add_request(prompt_ids, **sampling)

    def release(self, count):
        pass


def make_job(engine, body, vocab_size=128):
    state = SimpleNamespace(engine=engine, tokenizer=None, eos_ids=set(), vocab_size=vocab_size)
    return Job(state, parse_completion(body), [[1, 2, 3, 4]], max_tokens=[5], loop=None)


def test_a_job_passes_the_fields_to_the_engine():
    from tests.engine.test_engine import tiny_model

    manager = tiny_model().init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=16)
    engine = RecordingEngine(manager)
    job = make_job(engine, {"model": "m", "prompt": [1, 2, 3, 4], "n": 2, **FIELDS})
    job.start(lambda parsed, index, max_tokens: {"max_new_tokens": max_tokens})
    assert engine.requests[1] == {"max_new_tokens": 5, "frequency_penalty": 0.5, "presence_penalty": -1.25,
                                  "logit_bias": {77: 100.0, 3: -2.5}, "repetition_penalty": 1.1, "min_p": 0.05,
                                  "min_new_tokens": 4}
    manager.run_until_done()
    assert [manager.get_result(i, timeout=0).generated_tokens for i in job.request_ids] == [[77] * 5] * 2
    with pytest.raises(APIError, match=r"logit_bias key 128 is outside the vocabulary \[0, 128\)") as error:
        make_job(engine, {"model": "m", "prompt": [1], "logit_bias": {"128": 1}}).start(lambda *args: {})
    assert error.value.param == "logit_bias" and len(engine.requests) == 2
