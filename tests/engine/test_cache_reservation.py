"""A server's KV cache takes its memory at start (ModelRunner.reserve_cache), not page by page under traffic: on the
CPU the cache starts unwritten, and without the reservation the server's RSS grew round after round of requests
until every page had been reached (issue 24; benchmarks/bench_main_job_memory.py measures a real server)."""

from pathlib import Path

import pytest
import torch

from tests.engine.test_engine import tiny_model

SMAPS = Path("/proc/self/smaps")


def _resident_bytes(tensors) -> int:
    """Resident bytes of the memory mappings that hold `tensors` (the OS may merge neighbouring mappings into one,
    so this counts whole mappings, each once)."""
    addresses, total, inside = [t.data_ptr() for t in tensors], 0, False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = any(start <= a < end for a in addresses)
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not SMAPS.exists(), reason="reads the process's memory map (Linux)")
def test_reserve_cache_takes_the_whole_cache_at_once_and_requests_still_run():
    model = tiny_model()
    manager = model.init_continuous_batching(num_blocks=4095, block_size=16, eos_token_id=None)
    caches = (*manager.runner.key_caches, *manager.runner.value_caches)
    size = caches[0].numel() * caches[0].element_size()
    # above glibc's largest mmap threshold (32 MiB): the tensors are mappings of their own, not heap
    total = sum(c.numel() * c.element_size() for c in caches)
    assert size >= 64 << 20 and total == len(caches) * size
    before = _resident_bytes(caches)
    assert before < total / 2  # unwritten: the OS maps the pages as sequences first reach them
    manager.runner.reserve_cache()
    assert _resident_bytes(caches) - before >= 0.95 * total
    request = manager.add_request([1, 2, 3, 4, 5], max_new_tokens=4)
    manager.run_until_done()
    assert len(manager.get_result(request, timeout=0).generated_tokens) == 4
    manager.stop()
