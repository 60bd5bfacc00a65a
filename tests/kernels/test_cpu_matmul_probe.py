"""Which form a CPU float32 matmul takes (kernels/cpu_matmul_probe.py): the row counts PACKED serves, measured or
set by GPUFORMERS_CPU_PACKED_ROWS, and the per-shape measurement at one row, each measured once when first needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuformers.kernels import cpu_matmul_probe as probe
from gpuformers.kernels.cpu_matmul_probe import COLUMNS, PACKED, ROWS, packed_faster, prepack_available


def test_row_counts_follow_the_environment_variable(monkeypatch):
    for value, packed_rows in [("all", {1, 3, 4, 7, 192, 193, 300, 5000}), ("none", set()),
                               ("4-192,300-", {4, 7, 192, 300, 5000}), ("7", {7})]:
        monkeypatch.setenv(probe.ENV, value)
        assert {r for r in (1, 3, 4, 7, 192, 193, 300, 5000) if packed_faster(r)} == packed_rows, value
    monkeypatch.setenv(probe.ENV, "4..192")
    with pytest.raises(ValueError, match="GPUFORMERS_CPU_PACKED_ROWS='4..192'"):
        packed_faster(8)


@pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN")
def test_row_counts_follow_this_machines_measurement(monkeypatch):
    from tests.engine.test_engine import tiny_model

    from gpuformers.kernels import cpu_linear

    monkeypatch.delenv(probe.ENV, raising=False)
    measured = probe.calibration()  # the real one: every probe timed both ways
    assert sorted(measured) == list(probe._PROBES)
    assert all(plain > 0 and packed > 0 for plain, packed in measured.values())
    # Each row count takes the decision of the largest probe at or below it, measured when first needed.
    fake = {1: (1.0, 2.0), 2: (1.0, 2.0), 4: (2.0, 1.0), 16: (2.0, 1.0), 64: (2.0, 1.0), 256: (1.0, 1.5)}
    asked = []
    monkeypatch.setattr(probe, "_probe", lambda rows, threads: asked.append(rows) or fake[rows])
    probe.decide.cache_clear()
    try:
        assert packed_faster(1) is False and asked == [1]  # one probe measured, not all six
        probe.measure_up_to(20)  # an engine of max_batch_tokens=20 at start: the probes it can meet
        assert sorted(set(asked)) == [1, 2, 4, 16]
        assert [r for r in (1, 3, 4, 100, 255, 256, 4096) if packed_faster(r)] == [4, 100, 255]
        assert probe.packs_some_rows()
        monkeypatch.setattr(probe, "_probe", lambda rows, threads: (1.0, 2.0))
        probe.decide.cache_clear()
        assert not probe.packs_some_rows()
        assert cpu_linear.packed_for(tiny_model(), rows=4) is None  # never faster here: generate() keeps F.linear
    finally:
        probe.decide.cache_clear()


def test_one_row_form_is_the_fastest_measured_for_the_shape(monkeypatch):
    monkeypatch.delenv(probe.ENV, raising=False)
    times = probe.one_row_times(64, 200)  # the real measurement of an odd shape
    assert set(times) == ({ROWS, COLUMNS, PACKED} if prepack_available() else {ROWS, COLUMNS})
    assert all(ms > 0 for ms in times.values())
    assert probe.one_row_form(64, 200) == min(times, key=times.get)
    measured = []
    monkeypatch.setattr(probe, "_one_row_times", lambda i, o, threads: measured.append((i, o)) or {ROWS: 2.0,
                                                                                                   COLUMNS: 1.0})
    assert probe.one_row_form(32, 48) == COLUMNS and measured == [(32, 48)]
    # GPUFORMERS_CPU_PACKED_ROWS decides instead: PACKED where it says 1 row, else the weight as it is.
    monkeypatch.setenv(probe.ENV, "1-4")
    assert probe.one_row_form(32, 48) == (PACKED if prepack_available() else ROWS)
    monkeypatch.setenv(probe.ENV, "2-")
    assert probe.one_row_form(32, 48) == ROWS and measured == [(32, 48)]  # and nothing more is measured


def test_the_forms_compute_the_same_numbers():
    """What the measurement compares must be the same product: F.linear on the weight, on a transposed copy's .t()
    and on oneDNN's copy (the forms kernels/cpu_linear.py keeps)."""
    weight, x = torch.randn(200, 64), torch.randn(3, 1, 64)
    want = F.linear(x, weight)
    assert (F.linear(x, weight.t().contiguous().t()) - want).abs().max() < 1e-5
    if prepack_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, probe.PACK_HINT_ROWS)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        assert (got - want).abs().max() < 1e-5
