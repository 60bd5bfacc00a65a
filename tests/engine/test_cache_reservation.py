"""A server's KV cache takes its memory at start (ModelRunner.reserve_cache), not page by page under traffic: on the
CPU the cache starts unwritten, and without the reservation the server's RSS grew round after round of requests
until every page had been reached (issue 24; benchmarks/bench_main_job_memory.py measures a real server)."""

import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.test_engine import tiny_model

PAGEMAP = Path("/proc/self/pagemap")


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the pages wholly inside `tensor`'s memory that are resident (bit 63 of each page's 8-byte entry
    in /proc/self/pagemap), whatever else lies beside it."""
    page = mmap.PAGESIZE
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    first, last = -(-start // page), end // page
    with PAGEMAP.open("rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((last - first) * 8), dtype=np.uint64)
    return float(((entries >> np.uint64(63)) & np.uint64(1)).mean())


def check_reservation():
    """The checks, run in a fresh process: in a long-lived test worker, malloc may hand the cache a freed (and so
    already resident) stretch of its heap, which no new server process has."""
    model = tiny_model()
    manager = model.init_continuous_batching(num_blocks=4095, block_size=16, eos_token_id=None)
    caches = (*manager.runner.key_caches, *manager.runner.value_caches)
    assert all(c.numel() * c.element_size() >= 64 << 20 for c in caches)
    assert all(_resident_fraction(c) < 0.5 for c in caches)  # unwritten: the OS maps pages as sequences reach them
    manager.runner.reserve_cache()
    assert all(_resident_fraction(c) == 1.0 for c in caches)
    request = manager.add_request([1, 2, 3, 4, 5], max_new_tokens=4)
    manager.run_until_done()
    assert len(manager.get_result(request, timeout=0).generated_tokens) == 4
    manager.stop()


@pytest.mark.skipif(not PAGEMAP.exists(), reason="reads the process's page map (Linux)")
def test_reserve_cache_takes_the_whole_cache_at_once_and_requests_still_run():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", "from tests.engine.test_cache_reservation import check_reservation;"
                           " check_reservation()"], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
