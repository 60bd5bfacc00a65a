"""Waiting for an engine's outputs (engine/outputs.py): results wait for their callers, and a caller never waits on
an engine loop that is not running (before start(), after stop()); request_id_iter takes a timeout."""

from __future__ import annotations

import threading
import time

import pytest

from gpuformers.engine.outputs import GenerationOutput, Outbox
from gpuformers.engine.sequence import RequestStatus
from tests.engine.test_engine import NEW_TOKENS, greedy_reference, make_prompts, tiny_model


def _output(request_id: str, tokens: list[int], final: bool) -> GenerationOutput:
    return GenerationOutput(request_id, generated_tokens=tokens,
                            status=RequestStatus.FINISHED if final else RequestStatus.DECODING)


def test_a_running_loops_outputs_reach_their_callers_and_are_then_forgotten():
    outbox = Outbox(running=lambda: True)
    plain = outbox.admit(None, False, lambda request_id: request_id)
    streamed = outbox.admit("mine", True, lambda request_id: request_id)
    assert (plain, streamed) == ("req_0", "mine")
    with pytest.raises(ValueError, match="'mine' is already in use"):
        outbox.admit("mine", False, lambda request_id: request_id)
    publisher = threading.Timer(0.2, lambda: [outbox.publish(_output("mine", [1], False), False),
                                              outbox.publish(_output("mine", [1, 2], True), True),
                                              outbox.publish(_output("req_0", [3], True), True)])
    publisher.start()
    assert [o.generated_tokens for o in outbox.iterate("mine")] == [[1], [1, 2]]
    assert outbox.take(timeout=5).generated_tokens == [3]
    assert outbox.finished == {} and outbox.streams == {} and outbox.live == set()
    assert outbox.num_finished == 2


def test_a_wait_with_no_loop_running_ends_at_once_and_a_stalled_one_times_out():
    running = [False]
    outbox = Outbox(running=lambda: running[0])
    outbox.admit("a", False, lambda request_id: request_id)
    outbox.admit("s", True, lambda request_id: request_id)
    start = time.monotonic()
    assert outbox.take("a") is None and outbox.take() is None and list(outbox.iterate("s")) == []
    assert time.monotonic() - start < 1.0
    assert outbox.live == {"a", "s"}  # still waiting for a loop to run them
    running[0] = True
    with pytest.raises(TimeoutError, match="'s' made no progress within 0.3 s"):
        list(outbox.iterate("s", timeout=0.3))
    with pytest.raises(TimeoutError, match="'a' did not finish within 0.3 s"):
        list(outbox.iterate("a", timeout=0.3))
    assert outbox.take("a", timeout=0.2) is None


def test_a_manager_answers_at_once_before_start_and_after_stop_and_serves_its_queue_once_started():
    model = tiny_model()
    prompts = make_prompts(4, seed=5)
    reference = greedy_reference(model, prompts)
    manager = model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64, max_batch_tokens=64)
    plain = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS)
    streamed = manager.add_request(prompts[1], max_new_tokens=NEW_TOKENS, streaming=True)
    start = time.monotonic()
    assert manager.get_result(plain) is None and list(manager.request_id_iter(streamed)) == []
    assert time.monotonic() - start < 1.0  # not started: nothing waited on a loop that is not there
    with manager:
        assert manager.get_result(plain, timeout=60).generated_tokens == reference[0]
        assert list(manager.request_id_iter(streamed, timeout=60))[-1].generated_tokens == reference[1]
        long = manager.add_request(prompts[2], max_new_tokens=200)
        waited = []
        waiter = threading.Thread(target=lambda: waited.append(manager.get_result(long)))
        waiter.start()
    waiter.join(timeout=10)  # stop() ended the loop: the caller waiting with no timeout got None, not a hang
    assert not waiter.is_alive() and (waited == [None] or waited[0].generated_tokens)
    late = manager.add_request(prompts[3], max_new_tokens=NEW_TOKENS)
    assert manager.get_result(late) is None
    with manager:  # a later start() serves what was queued meanwhile
        assert manager.get_result(late, timeout=60).generated_tokens == reference[3]


def test_on_output_gets_every_update_in_order_then_frees_the_id():
    outbox = Outbox(running=lambda: True)
    got = []
    outbox.admit("cb", False, lambda request_id: request_id, on_output=got.append)
    assert "cb" in outbox.live and "cb" not in outbox.streams
    outbox.publish(_output("cb", [1], False), False)
    outbox.publish(_output("cb", [1, 2], True), True)
    assert [o.generated_tokens for o in got] == [[1], [1, 2]]
    assert outbox.live == set() and outbox.listeners == {} and outbox.finished == {} and outbox.num_finished == 1
    outbox.admit("cb", False, lambda request_id: request_id, on_output=got.append)  # the id is free again


def test_a_failing_on_output_gets_nothing_more_and_does_not_leak(caplog):
    outbox = Outbox(running=lambda: True)
    calls = []

    def broken(output):
        calls.append(output)
        raise RuntimeError("event loop is closed")

    outbox.admit("x", False, lambda request_id: request_id, on_output=broken)
    outbox.publish(_output("x", [1], False), False)  # raises inside: logged, not raised to the engine
    outbox.publish(_output("x", [1, 2], False), False)
    outbox.publish(_output("x", [1, 2, 3], True), True)
    assert len(calls) == 1 and "on_output of request 'x' failed" in caplog.text
    assert outbox.live == set() and outbox.listeners == {} and outbox.finished == {}


def test_engine_hands_each_streamed_update_to_on_output_in_its_thread():
    model = tiny_model()
    prompts = make_prompts(6)
    reference = greedy_reference(model, prompts)
    seen: dict[str, list] = {}
    threads = set()

    def record(output):
        threads.add(threading.current_thread().name)
        seen.setdefault(output.request_id, []).append(output)

    with model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64) as manager:
        ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS, on_output=record) for p in prompts]
        ids.append(manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, on_output=record))
        manager.cancel_request(ids[-1])
        deadline = time.monotonic() + 30
        while len([i for i in ids if seen.get(i) and seen[i][-1].is_finished()]) < len(ids):
            assert time.monotonic() < deadline, "not every request reached its final output"
            time.sleep(0.01)
        engine_thread = manager._thread.name
    for request_id, tokens in zip(ids, reference):
        updates = seen[request_id]
        assert [len(o.generated_tokens) for o in updates] == list(range(1, NEW_TOKENS + 1))  # one per token
        assert updates[-1].generated_tokens == tokens and updates[-1].status is RequestStatus.FINISHED
    assert seen[ids[-1]][-1].status is RequestStatus.FAILED  # cancelled: its final output says so
    assert threads == {engine_thread}
    assert manager.outbox.live == set() and manager.outbox.listeners == {} and manager.outbox.finished == {}


def test_a_caller_that_changes_an_outputs_prompt_changes_nothing_the_engine_reads():
    """Streamed outputs carry the prompt without a copy per output (one per request: a copy per output and step cost
    milliseconds per step at 256 streams of long prompts, benchmarks/bench_engine_host.py --streaming); the engine
    keeps its own list, so a caller emptying an output's prompt_ids still gets the same tokens, and so does the next
    request of that prompt (the prefix cache reads the engine's list)."""
    model = tiny_model()
    prompts = make_prompts(2)
    reference = greedy_reference(model, prompts)
    prompts_seen: dict[str, list] = {}
    finals: dict[str, list] = {}

    def record(output):
        prompts_seen.setdefault(output.request_id, list(output.prompt_ids))
        output.prompt_ids.clear()
        if output.is_finished():
            finals[output.request_id] = output.generated_tokens

    with model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64) as manager:
        ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS, on_output=record) for p in prompts]
        deadline = time.monotonic() + 60
        while len(finals) < len(ids):
            assert time.monotonic() < deadline, "not every request finished"
            time.sleep(0.01)
        again = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS)
        second = manager.get_result(again, timeout=60)
    assert [finals[i] for i in ids] == reference and second.generated_tokens == reference[0]
    assert [prompts_seen[i] for i in ids] == [list(p) for p in prompts]


def test_outputs_that_share_the_requests_lists_carry_every_token_to_a_reader_in_the_engines_thread():
    """share_lists (the engine core's callback): no copy of the answer per output and step; a reader that takes
    each output's new tokens before the next step (after_step, as the core does) gets every token once, in order;
    the default still gives each output a snapshot of its own."""
    model = tiny_model()
    prompts = make_prompts(3)
    reference = greedy_reference(model, prompts)
    pending, taken, shared_outputs = [], {}, {}

    def take_new_tokens():  # the core's OutputDeltas, in the engine's thread after each step
        while pending:
            output = pending.pop(0)
            tokens = taken.setdefault(output.request_id, [])
            tokens += output.generated_tokens[len(tokens):]

    with model.init_continuous_batching(eos_token_id=None, block_size=8, num_blocks=64) as manager:
        manager.after_step = take_new_tokens
        ids = [manager.add_request(p, max_new_tokens=NEW_TOKENS, on_output=lambda o: (
            pending.append(o), shared_outputs.setdefault(o.request_id, []).append(o)), share_lists=True)
               for p in prompts]
        snapshots = []
        copied = manager.add_request(prompts[0], max_new_tokens=NEW_TOKENS, on_output=snapshots.append)
        deadline = time.monotonic() + 60
        while not (snapshots and snapshots[-1].is_finished()) or any(
                len(taken.get(i, [])) < NEW_TOKENS for i in ids):
            assert time.monotonic() < deadline, "not every request finished"
            time.sleep(0.01)
        with pytest.raises(ValueError, match="share_lists=True is for an on_output callback"):
            manager.add_request(prompts[0], max_new_tokens=2, share_lists=True)
    assert [taken[i] for i in ids] == reference
    # the shared outputs are the request's own lists: the first one has grown to the whole answer
    assert all(shared_outputs[i][0].generated_tokens == reference[k] for k, i in enumerate(ids))
    assert [len(o.generated_tokens) for o in snapshots] == list(range(1, NEW_TOKENS + 1)) and copied
