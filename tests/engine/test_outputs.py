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
