"""`gpuformers serve` as a real process, driven by the official openai client (and raw httpx for bad input).

Greedy answers must equal model.generate; streaming must end in [DONE]; a disconnect must cancel its request and
free its KV blocks; bad input must get OpenAI error objects, never a 500; --api-key and --max-pending must answer
401 and 429."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from tests.serving.conftest import API_KEY, MODEL_NAME, ServerProcess, greedy_reference


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, timeout=60,
                         **kwargs)


def wait_idle(server, timeout: float = 10.0) -> dict:
    """Poll /metrics until no request is in flight and every KV block is free; returns the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if metrics["gpuformers_requests_in_flight"] == 0 and metrics["gpuformers_kv_blocks_used"] == 0:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is not idle after {timeout} s: {metrics}")
        time.sleep(0.05)


def chat_ids(reference, messages) -> list[int]:
    _, tokenizer = reference
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def decode(reference, ids) -> str:
    return reference[1].decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- the basics


def test_models_lists_the_served_name(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_health_and_metrics_are_plain(server):
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.base}/metrics").text
    for name in ("gpuformers_requests_total", "gpuformers_kv_blocks_total 160", "gpuformers_num_requests_running",
                 "gpuformers_time_to_first_token_seconds_bucket", "gpuformers_inter_token_latency_seconds_count"):
        assert name in text


@pytest.mark.parametrize("as_ids", [False, True])
def test_greedy_completion_equals_generate(server, reference, as_ids):
    _, tokenizer = reference
    text = "The quick brown fox"
    ids = tokenizer.encode(text)
    expected = greedy_reference(reference, ids, 12)
    out = client(server).completions.create(model=MODEL_NAME, prompt=ids if as_ids else text, max_tokens=12,
                                            temperature=0)
    assert out.choices[0].text == decode(reference, expected)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == len(expected)
    assert out.usage.total_tokens == len(ids) + len(expected)
    assert out.choices[0].finish_reason == ("length" if len(expected) == 12 else "stop")


def test_greedy_chat_equals_generate(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = chat_ids(reference, messages)
    expected = greedy_reference(reference, ids, 10)
    out = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == decode(reference, expected)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(expected)


def test_streaming_chat_matches_the_whole_answer_and_ends_in_done(server, reference):
    messages = [{"role": "user", "content": "Count to three."}]
    expected = decode(reference, greedy_reference(reference, chat_ids(reference, messages), 9))
    stream = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=9,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 9
    assert all(c.usage is None for c in chunks[:-1])
    # The raw wire format: server-sent events ending in `data: [DONE]`.
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": True}
    raw = httpx.post(f"{server.url}/completions", json=body, timeout=30)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_n_and_seed_reproducibility(server):
    c = client(server)
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2)
    first = c.completions.create(seed=123, **kwargs)
    again = c.completions.create(seed=123, **kwargs)
    other = c.completions.create(seed=7, **kwargs)
    assert [ch.index for ch in first.choices] == [0, 1]
    assert [ch.text for ch in first.choices] == [ch.text for ch in again.choices]
    assert first.choices[0].text != first.choices[1].text  # each choice has its own seed
    assert [ch.text for ch in first.choices] != [ch.text for ch in other.choices]
    assert 2 <= first.usage.completion_tokens <= 16 and first.usage.prompt_tokens == 4


def test_stop_string_cuts_the_text(server, reference):
    c = client(server)
    full = c.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=16, temperature=0).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = full[:full.find(stop)]
    out = c.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    stream = c.completions.create(model=MODEL_NAME, prompt="Hello world", max_tokens=16, temperature=0,
                                  stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == cut
    wait_idle(server)


def test_logprobs_match_the_model(server, reference):
    import torch

    model, tokenizer = reference
    messages = [{"role": "user", "content": "Say something."}]
    ids = chat_ids(reference, messages)
    out = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True)
    content = out.choices[0].logprobs.content
    generated = greedy_reference(reference, ids, 6)
    assert len(content) == len(generated) == out.usage.completion_tokens
    with torch.inference_mode():
        logits = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1:-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(generated)[:, None])[:, 0]
    assert [item.token for item in content] == [tokenizer.decode([t]) for t in generated]
    torch.testing.assert_close(torch.tensor([item.logprob for item in content]), expected, atol=2e-3, rtol=1e-3)
    completion = client(server).completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0,
                                                   logprobs=0)
    assert completion.choices[0].logprobs.token_logprobs == pytest.approx([i.logprob for i in content], abs=1e-4)
    # Streamed: each chunk carries the logprobs of its own tokens; together they are the whole answer's.
    stream = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                                    temperature=0, logprobs=True, stream=True)
    streamed = [item for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]


def test_top_logprobs_are_the_model_top_tokens(server, reference):
    import torch

    model, tokenizer = reference
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = chat_ids(reference, messages)
    out = client(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    generated = greedy_reference(reference, ids, 5)
    with torch.inference_mode():
        log_probs = model(torch.tensor([ids + generated])).logits[0, len(ids) - 1:-1].float().log_softmax(-1)
    for step, item in enumerate(content):
        values, top_ids = log_probs[step].topk(3)
        assert [alt.token for alt in item.top_logprobs] == [tokenizer.decode([t]) for t in top_ids.tolist()]
        torch.testing.assert_close(torch.tensor([alt.logprob for alt in item.top_logprobs]), values,
                                   atol=2e-3, rtol=1e-3)
        assert item.top_logprobs[0].token == item.token  # greedy picks the most likely token
    completion = client(server).completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0,
                                                   logprobs=2)
    tops = completion.choices[0].logprobs.top_logprobs
    assert len(tops) == 5 and all(len(alternatives) <= 2 for alternatives in tops)
    assert completion.choices[0].logprobs.tokens[0] in tops[0]


def test_a_batch_of_prompts_answers_each_as_alone(server, reference):
    """OpenAI's list of prompts: n choices per prompt, numbered prompt x n + choice, each the greedy answer that
    prompt gets alone (texts and token ids alike), with echo per prompt, streamed the same, usage summed."""
    _, tokenizer = reference
    texts = ["The quick brown fox", "Once upon a time there", "Paris is"]
    ids = [tokenizer.encode(t) for t in texts]
    expected = [decode(reference, greedy_reference(reference, i, 6)) for i in ids]
    c = client(server)
    out = c.completions.create(model=MODEL_NAME, prompt=texts, max_tokens=6, temperature=0, n=2, echo=True)
    assert [ch.index for ch in out.choices] == list(range(6))
    assert [ch.text for ch in out.choices] == [t + e for t, e in zip(texts, expected) for _ in range(2)]
    assert out.usage.prompt_tokens == sum(map(len, ids))
    as_ids = c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert [ch.text for ch in as_ids.choices] == expected
    stream = c.completions.create(model=MODEL_NAME, prompt=texts, max_tokens=6, temperature=0, stream=True)
    streamed = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected


def test_echo_prepends_the_prompt(server):
    out = client(server).completions.create(model=MODEL_NAME, prompt="Echo me", max_tokens=3, temperature=0, echo=True)
    plain = client(server).completions.create(model=MODEL_NAME, prompt="Echo me", max_tokens=3, temperature=0)
    assert out.choices[0].text == "Echo me" + plain.choices[0].text
    stream = client(server).completions.create(model=MODEL_NAME, prompt="Echo me", max_tokens=3, temperature=0,
                                               echo=True, stream=True)
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert chunks[0] == "Echo me" and "".join(chunks) == out.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(server, reference):
    """echo + logprobs: OpenAI's completions shape over prompt + completion tokens, the prompt's values from the
    model's own distribution (the first token has none: null), shared by the n choices."""
    import torch

    model, tokenizer = reference
    text = "The quick brown fox jumps"
    ids = tokenizer.encode(text)
    generated = greedy_reference(reference, ids, 4)
    out = client(server).completions.create(model=MODEL_NAME, prompt=text, max_tokens=4, temperature=0, echo=True,
                                            logprobs=2, n=2)
    all_ids = ids + generated
    with torch.inference_mode():
        log_probs = model(torch.tensor([all_ids])).logits[0, :-1].float().log_softmax(-1)
    expected = log_probs.gather(1, torch.tensor(all_ids[1:])[:, None])[:, 0]
    for choice in out.choices:
        assert choice.text == text + decode(reference, generated)
        lp = choice.logprobs
        assert lp.tokens == [tokenizer.decode([t]) for t in all_ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), expected, atol=2e-3, rtol=1e-3)
        assert len(lp.top_logprobs) == len(all_ids)
        for position, (token, alternatives) in enumerate(zip(lp.tokens[1:], lp.top_logprobs[1:])):
            values, top_ids = log_probs[position].topk(2)
            best = [tokenizer.decode([t]) for t in top_ids.tolist()]
            assert set(best) <= set(alternatives) and token in alternatives and len(alternatives) <= 3
            torch.testing.assert_close(torch.tensor([alternatives[b] for b in best]), values, atol=2e-3, rtol=1e-3)
            assert alternatives[token] == pytest.approx(lp.token_logprobs[position + 1], abs=1e-6)
        assert lp.text_offset[0] == 0 and lp.text_offset[len(ids)] == len(text)
        assert lp.text_offset == sorted(lp.text_offset)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 2 * len(generated)
    # logprobs=0: the chosen tokens' values only; token ids as the prompt work the same way.
    zero = client(server).completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0, echo=True,
                                             logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs is None
    assert zero.choices[0].logprobs.token_logprobs[0] is None
    assert zero.choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(
        out.choices[0].logprobs.token_logprobs[1:len(ids)], abs=1e-5)


# ---------------------------------------------------------------------------------------------- limits


def test_api_key_is_required(servers):
    _, guarded = servers
    with pytest.raises(openai.AuthenticationError) as error:
        client(guarded, api_key="wrong").models.list()
    assert error.value.status_code == 401 and "Bearer" in error.value.body["message"]
    assert httpx.get(f"{guarded.url}/models").status_code == 401
    assert [m.id for m in client(guarded, api_key=API_KEY).models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{guarded.base}/health").status_code == 200  # health checks need no key


def test_full_server_answers_429_at_once(servers):
    _, guarded = servers
    c = client(guarded, api_key=API_KEY)
    stream = c.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=1500 // 2, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # the first request holds the only slot while it streams
    start = time.monotonic()
    with pytest.raises(openai.RateLimitError) as error:
        c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert time.monotonic() - start < 2.0
    assert "--max-pending" in error.value.body["message"]
    stream.close()
    wait_idle(guarded)
    assert c.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices[0].text is not None


def test_prompt_plus_max_tokens_over_the_context_is_a_400_naming_both(server):
    with pytest.raises(openai.BadRequestError) as error:
        client(server).completions.create(model=MODEL_NAME, prompt=[5] * 1000, max_tokens=100)
    message = error.value.body["message"]
    assert "1024" in message and "1000" in message and "100" in message
    assert error.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_and_frees_the_blocks(server, stream):
    before = server.metrics()
    before_closed = _requests_counted(server, "/v1/completions", 499)
    body = {"model": MODEL_NAME, "prompt": [7, 8, 9], "max_tokens": 1000, "temperature": 0, "stream": stream,
            "ignore_eos": True}
    if stream:
        with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            in_flight = server.metrics()
            assert in_flight["gpuformers_requests_in_flight"] == 1 and in_flight["gpuformers_kv_blocks_used"] > 0
    else:  # the client gives up waiting for the whole answer; the server notices within its 0.5 s poll
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/completions", json=body, timeout=0.3)
    metrics = wait_idle(server)
    if not stream:  # counted as a request its client closed (499), not as an answer given (200)
        deadline = time.monotonic() + 10
        while _requests_counted(server, "/v1/completions", 499) == before_closed:
            assert time.monotonic() < deadline, "the disconnected request was not counted with status 499"
            time.sleep(0.05)
    assert metrics["gpuformers_generation_tokens_total"] - before["gpuformers_generation_tokens_total"] < 1000
    time.sleep(0.3)
    # The engine stopped stepping: the request was cancelled, not left to run its 1000 tokens in the background.
    assert server.metrics()["gpuformers_engine_steps_total"] == metrics["gpuformers_engine_steps_total"]
    assert metrics["gpuformers_engine_steps_total"] - before["gpuformers_engine_steps_total"] < 900


def _requests_counted(server, endpoint: str, status: int) -> float:
    """gpuformers_requests_total for one endpoint and status, from /metrics (0 before the first)."""
    label = f'gpuformers_requests_total{{endpoint="{endpoint}",status="{status}"}}'
    for line in httpx.get(f"{server.base}/metrics", timeout=5).text.splitlines():
        if line.startswith(label):
            return float(line.split()[-1])
    return 0.0


# ---------------------------------------------------------------------------------------------- bad input

M = MODEL_NAME
USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (path, body (dict, or raw bytes), status, param or None)
    ("/completions", b"{not json", 400, None),
    ("/completions", b"\xff\xfe\x00bad utf-8", 400, None),
    ("/completions", b"", 400, None),
    ("/completions", b"[1, 2]", 400, None),
    ("/completions", {"prompt": "hi"}, 400, "model"),
    ("/completions", {"model": 3, "prompt": "hi"}, 400, "model"),
    ("/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/completions", {"model": M}, 400, "prompt"),
    ("/completions", {"model": M, "prompt": ""}, 400, "prompt"),
    ("/completions", {"model": M, "prompt": []}, 400, "prompt"),
    ("/completions", {"model": M, "prompt": [1, "a"]}, 400, "prompt"),
    ("/completions", {"model": M, "prompt": [1, 10**9]}, 400, "prompt"),
    ("/completions", {"model": M, "prompt": [-1]}, 400, "prompt"),
    ("/completions", {"model": M, "prompt": ["a", [1]]}, 400, "prompt"),  # a batch is all texts or all ids
    ("/completions", {"model": M, "prompt": ["a", ""]}, 400, "prompt"),
    ("/completions", {"model": M, "prompt": [[1], [10**9]]}, 400, "prompt"),
    ("/completions", {"model": M, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/completions", {"model": M, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/completions", {"model": M, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/completions", {"model": M, "prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/completions", {"model": M, "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/completions", {"model": M, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/completions", {"model": M, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/completions", {"model": M, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/completions", {"model": M, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/completions", {"model": M, "prompt": "hi", "n": 0}, 400, "n"),
    ("/completions", {"model": M, "prompt": "hi", "n": 10**6}, 400, "n"),
    ("/completions", {"model": M, "prompt": "hi", "stop": 5}, 400, "stop"),
    ("/completions", {"model": M, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/completions", {"model": M, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/completions", {"model": M, "prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/completions", {"model": M, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/completions", {"model": M, "prompt": "hi", "stream": True, "echo": True, "logprobs": 1}, 400, "echo"),
    ("/completions", {"model": M, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/completions", {"model": M, "prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/completions", {"model": M, "prompt": "hi", "logprobs": 100}, 400, "logprobs"),
    ("/completions", {"model": M, "prompt": "hi", "bogus_field": 1}, 400, "bogus_field"),
    ("/completions", {"model": M, "prompt": "x " * 3000}, 400, "prompt"),
    ("/chat/completions", {"model": M}, 400, "messages"),
    ("/chat/completions", {"model": M, "messages": []}, 400, "messages"),
    ("/chat/completions", {"model": M, "messages": "hi"}, 400, "messages"),
    ("/chat/completions", {"model": M, "messages": [1]}, 400, "messages[0]"),
    ("/chat/completions", {"model": M, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/chat/completions", {"model": M, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("/chat/completions", {"model": M, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("/chat/completions", {"model": M, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("/chat/completions", {"model": M, "messages": USER, "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ("/chat/completions", {"model": M, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/chat/completions", {"model": M, "messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/chat/completions", {"model": M, "messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("/chat/completions", {"model": M, "messages": USER, "max_completion_tokens": -3}, 400,
     "max_completion_tokens"),
    ("/nowhere", {"model": M}, 404, None),
]


def test_bad_input_table(server):
    assert len(BAD_REQUESTS) >= 30
    with httpx.Client(timeout=30) as http:
        for path, body, status, param in BAD_REQUESTS:
            if isinstance(body, bytes):
                response = http.post(server.url + path, content=body, headers={"content-type": "application/json"})
            else:
                response = http.post(server.url + path, json=body)
            where = f"{path} {body!r:.120}"
            assert response.status_code == status, f"{where}: {response.status_code} {response.text}"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, where
            assert isinstance(error["message"], str) and len(error["message"]) > 10, where
            if param is not None:
                assert error["param"] == param, f"{where}: {error}"
        assert http.get(f"{server.base}/v1/completions").status_code == 405
        assert http.get(f"{server.base}/health").json() == {"status": "ok"}
    ok = client(server).completions.create(model=MODEL_NAME, prompt="still fine", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")
    metrics = wait_idle(server)
    assert 'status="500"' not in httpx.get(f"{server.base}/metrics").text, metrics


# ---------------------------------------------------------------------------------------------- load


def test_concurrent_streams_with_disconnects(server, reference):
    """32 streaming clients at once, every fourth leaving after two chunks: the others get their greedy reference,
    and afterwards nothing is in flight and every KV block is free."""
    _, tokenizer = reference
    prompts = [f"Story number {i}:" for i in range(4)]
    lengths = [6, 9, 12, 15]
    expected = {(p, m): decode(reference, greedy_reference(reference, tokenizer.encode(p), m))
                for p in prompts for m in lengths}

    async def one(c: openai.AsyncOpenAI, i: int):
        prompt, max_tokens = prompts[i % 4], lengths[(i // 4) % 4]
        stream = await c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True)
        parts = []
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            if i % 4 == 3 and len(parts) == 2:
                await stream.close()
                return None
        return prompt, max_tokens, "".join(parts)

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    before = server.metrics()
    results = asyncio.run(run_all())
    completed = [r for r in results if r is not None]
    assert len(completed) == 24
    for prompt, max_tokens, text in completed:
        assert text == expected[(prompt, max_tokens)], (prompt, max_tokens)
    after = wait_idle(server)
    assert after["gpuformers_generation_tokens_total"] > before["gpuformers_generation_tokens_total"]


# ---------------------------------------------------------------------------------------------- shutdown


def test_sigterm_finishes_running_requests_and_exits_cleanly(checkpoint):
    server = ServerProcess(checkpoint, "--num-blocks", "16").wait_ready()
    try:
        body = {"model": MODEL_NAME, "prompt": [3, 4], "max_tokens": 40, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            server.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # the running request was allowed to finish
        assert server.process.wait(20) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server.base}/health", timeout=2)
    finally:
        server.stop()


def test_chat_cli_talks_to_the_server(server):
    """`gpuformers chat --url` streams replies from a running server and keeps the conversation."""
    import subprocess
    import sys

    script = "Hello there\nAnd again\n/exit\n"
    out = subprocess.run([sys.executable, "-m", "gpuformers", "chat", "--url", server.base, "--max-new-tokens", "8"],
                         input=script, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    replies = [line for line in out.stdout.splitlines() if line.startswith("> ")]
    assert len(replies) >= 2  # a prompt was shown again after each reply
    bad = subprocess.run([sys.executable, "-m", "gpuformers", "chat", "--url", "http://127.0.0.1:9"],
                         input="hi\n", capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot reach" in bad.stderr
