"""How this CPU runs a float32 linear layer fastest, measured once per process and thread count: the question
kernels/cpu_linear.py asks before it keeps a copy of a weight and at each call that could use one.

Three forms of the same weight compute the same numbers up to rounding (another summation order):

    ROWS     (out, in), as nn.Linear keeps it: F.linear, which calls MKL's sgemm (it copies the weight into its
             own panel layout at every call, and picks its kernels by CPU vendor: AVX2 code on AMD AVX-512 CPUs)
    COLUMNS  (in, out), a transposed copy: F.linear on its .t(); a matrix-vector product then reads the weight
             along its rows, which MKL does at the memory's speed where ROWS does not for short rows
    PACKED   oneDNN's blocked layout (torch.ops.mkldnn._reorder_linear_weight, the op torch.compile's CPU weight
             freezing uses), kernels picked from the CPU's instruction set

At two rows and more, the winner depends on the machine and the row count, little on the shape: `packed_faster`
compares PACKED with ROWS on 32 MB of (2048, 1024) weights at 1, 2, 4, 16, 64 and 256 rows; a row count takes
the probe at or below it, measured when first needed (~25 ms each). At one row (batch-1 decoding) it also
depends on the shape, so `one_row_form` measures all three forms per (in, out) shape (~50 ms each). A 2-core
AMD EPYC (Zen 1, no AVX-512), 1 thread, time over the fastest form's (python benchmarks/bench_cpu_linear.py):

    (out, in)      1 row: ROWS COLUMNS PACKED      4 rows: ROWS COLUMNS PACKED
    16384 x 256           1.92  1.00    1.33              2.21  1.80    1.00
     1536 x 256           1.73  1.00    1.33              1.62  1.12    1.00
      256 x 768           1.00  1.34    1.64              1.00  1.36    1.02
     4096 x 1024          1.25  1.00    1.72              2.20  1.25    1.00
     1024 x 3072          1.00  1.15    1.53              1.76  1.27    1.00

`GPUFORMERS_CPU_PACKED_ROWS` overrides the measurement: "all", "none", or row ranges such as "4-192,300-" say
where PACKED serves, and ROWS serves everywhere else (COLUMNS is then never chosen).

Offers: ROWS, COLUMNS, PACKED, ENV, packed_faster, packs_some_rows, one_row_form, one_row_times, measure_up_to,
calibration, prepack_available, current_rule.
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
import time

import torch
import torch.nn.functional as F

ROWS, COLUMNS, PACKED = "rows", "columns", "packed"
PACK_HINT_ROWS = 32  # the row count oneDNN is told to expect; the packed weight serves any count
_PROBES = (1, 2, 4, 16, 64, 256)  # row counts calibration() measures; each decides for the rows up to the next
_PROBE_BYTES = 32 << 20  # weights a probe cycles through: more than most caches hold, as a step's weights are
ENV = "GPUFORMERS_CPU_PACKED_ROWS"
_MEASURING = threading.Lock()


def prepack_available() -> bool:
    """Whether this torch build has oneDNN and its linear-weight reorder op (x86 builds do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def current_rule() -> tuple[str | None, int]:
    """(GPUFORMERS_CPU_PACKED_ROWS, torch's thread count): what a decision depends on besides the rows; read once
    per use of the copies, not per matmul."""
    return os.environ.get(ENV), torch.get_num_threads()


def _best_ms_taking_turns(calls: dict[str, object], warm_ups: dict[str, object] | None = None) -> dict[str, float]:
    """{name: ms}: the best of three timed runs of each call after a warm-up (`warm_ups[name]`, or the call itself),
    the calls taking turns so that a slow moment of the machine falls on all of them alike (other processes only
    ever add time; timed in blocks, one form after the other, the winner flipped between runs on a noisy VM)."""
    for name in calls:
        (warm_ups or calls)[name]()
    times = {name: float("inf") for name in calls}
    for _ in range(3):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name] = min(times[name], (time.perf_counter() - start) * 1e3)
    return times


@functools.cache
def _probe(rows: int, threads: int) -> tuple[float, float]:
    """(ms ROWS, ms PACKED) for `rows` rows over 32 MB of (2048, 1024) weights. `threads` only keys the cache:
    torch's current count is used."""
    weights = [torch.full((2048, 1024), 0.01) for _ in range(_PROBE_BYTES // (2048 * 1024 * 4))]
    x = torch.full((rows, 1024), 0.01)
    with torch.inference_mode():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS) for w in weights]
        pointwise = torch.ops.mkldnn._linear_pointwise
        times = _best_ms_taking_turns({ROWS: lambda: [F.linear(x, w) for w in weights],
                                       PACKED: lambda: [pointwise(x, p, None, "none", [], "") for p in packed]})
    return times[ROWS], times[PACKED]


def _measured(rows: int, threads: int) -> tuple[float, float]:
    """The probe at or below `rows` for `threads` threads, measured at its first use (a decode at batch 1 measures
    the 1-row probe and its prompt's, not the 256-row one)."""
    with _MEASURING:  # two threads starting at once would time each other
        return _probe(_PROBES[bisect.bisect_right(_PROBES, rows) - 1], threads)


def measure_up_to(rows: int) -> None:
    """Measure now the probes that row counts up to `rows` would need (an engine at start, so that its first steps
    do not pay for it)."""
    if prepack_available() and not os.environ.get(ENV):
        for probe in _PROBES[:bisect.bisect_right(_PROBES, max(rows, 1))]:
            _measured(probe, torch.get_num_threads())


def calibration() -> dict[int, tuple[float, float]]:
    """This machine's measurement at the current thread count: {rows: (ms ROWS, ms PACKED)} at each probe row
    count; each probe is measured once, at its first use."""
    if not prepack_available():
        return {}
    return {rows: _measured(rows, torch.get_num_threads()) for rows in _PROBES}


def _parse_rows(text: str) -> list[tuple[int, float]]:
    """"all" | "none" | "a-b,c-,d" -> [(low, high)] inclusive ranges; a ValueError naming the variable if malformed."""
    text = text.strip().lower()
    if text in ("all", "none"):
        return [(1, float("inf"))] if text == "all" else []
    ranges = []
    try:
        for part in text.split(","):
            low, dash, high = part.strip().partition("-")
            ranges.append((int(low), float(high) if high else float("inf")) if dash else (int(low), int(low)))
    except ValueError:
        raise ValueError(f"{ENV}={text!r} is not 'all', 'none' or row ranges such as '4-192,300-'") from None
    return ranges


def packed_faster(rows: int) -> bool:
    """Whether a matmul of `rows` rows takes a PACKED weight over ROWS: GPUFORMERS_CPU_PACKED_ROWS if set, else
    this machine's probe at or below `rows`."""
    return decide(rows, *current_rule())


@functools.lru_cache(maxsize=4096)  # asked once per linear call: a dict look-up after the first time
def decide(rows: int, override: str | None, threads: int) -> bool:
    """packed_faster with the rule given (current_rule(), read once per use)."""
    if rows < 1:
        return False
    if override:
        return any(low <= rows <= high for low, high in _parse_rows(override))
    if not prepack_available():
        return False
    plain, packed = _measured(rows, threads)
    return packed < plain


def packs_some_rows() -> bool:
    """Whether PACKED would serve any row count here: packed_faster at some probe (measured in order, so a machine
    where it wins at one row measures that probe alone), or at a large count."""
    return any(packed_faster(rows) for rows in (*_PROBES, 1 << 20))


@functools.cache
def _one_row_times(in_features: int, out_features: int, threads: int) -> dict[str, float]:
    """{form: ms} for one row through weights of this shape: `out` capped so that one weight takes at most 8 MB,
    cycled through 32 MB of them (64 at most); the best of three passes per form, the forms taking turns so that
    a slow moment of the machine falls on all of them (~50-100 ms in all). `threads` only keys the cache."""
    out = max(1, min(out_features, (8 << 20) // (4 * in_features)))
    count = min(64, max(1, _PROBE_BYTES // (4 * in_features * out)))  # (a bound on calls for tiny shapes)
    rows_form = [torch.full((out, in_features), 0.01) for _ in range(count)]
    columns = [w.view(in_features, out) for w in rows_form]  # the same memory: the values do not matter
    x = torch.full((1, in_features), 0.01)
    with torch.inference_mode():
        weights = {ROWS: rows_form, COLUMNS: [w.t() for w in columns]}  # what F.linear takes for each form
        if prepack_available():
            weights[PACKED] = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS) for w in rows_form]

        def run(form: str, which: list):
            if form == PACKED:
                return lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in which]
            return lambda: [F.linear(x, w) for w in which]

        # warm-up: one weight of each form (its first call sets it up), not a whole pass
        return _best_ms_taking_turns({form: run(form, ws) for form, ws in weights.items()},
                                     {form: run(form, ws[:1]) for form, ws in weights.items()})


def one_row_times(in_features: int, out_features: int) -> dict[str, float]:
    """This machine's {form: ms} for a matrix-vector product of an (out_features, in_features) weight at torch's
    current thread count, measured at the first question for the shape."""
    with _MEASURING:
        return _one_row_times(in_features, out_features, torch.get_num_threads())


def one_row_form(in_features: int, out_features: int) -> str:
    """The fastest form for one row through an (out_features, in_features) weight: measured (one_row_times), or
    under GPUFORMERS_CPU_PACKED_ROWS, PACKED if it says 1 and ROWS if not."""
    if os.environ.get(ENV):
        return PACKED if packed_faster(1) and prepack_available() else ROWS
    times = one_row_times(in_features, out_features)
    return min(times, key=times.get)
