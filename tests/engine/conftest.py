"""Engine tests run torch on one CPU thread: on a machine whose cores are shared, a second OpenMP thread makes
small ops hundreds of times slower (and the timings of these tests erratic). Without a GPU, the Triton kernel
tests run under the interpreter (tests/conftest.py switches it on)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
