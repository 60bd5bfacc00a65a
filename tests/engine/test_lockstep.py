"""Tensor-parallel engines in lockstep (engine/lockstep.py) under torchrun on the CPU (gloo, 2 processes): process 0
takes greedy, sampled and cancelled requests while process 1 follows; the tokens are the whole model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.checkpoints import make_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
def test_leader_and_follower_agree_on_every_request(tmp_path):
    make_checkpoint(tmp_path / "ckpt", "qwen3")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "tests.engine.lockstep_worker", str(tmp_path / "ckpt"), str(tmp_path / "out.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]  # the follower ended with the leader
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["greedy_equal"] == [True] * 4
    assert report["sampled_lengths"] == [8] * 4
    assert report["logprob_diff"] < 1e-4
    assert report["cancelled_status"] == "RequestStatus.FAILED"
