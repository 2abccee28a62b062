"""Tests for bubbleguard.ps.core.consistency: the gate and the lead reconstructed from records."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bubbleguard.ps.core.consistency import ClockTable, clock_leads, must_wait
from bubbleguard.ps.core.records import IterationRecord


def test_gate_per_level() -> None:
    assert not must_wait(5, 0, None)  # eventual
    assert must_wait(1, 0, 0) and not must_wait(0, 0, 0)  # strict: wait for everyone
    assert not must_wait(5, 3, 2) and must_wait(6, 3, 2)  # bounded by 2


def test_clock_table_keeps_the_maximum() -> None:
    table = ClockTable(3)
    table.advance(0, 4)
    table.advance(0, 2)  # a late report
    table.advance(1, 1)
    assert table.clocks() == [4, 1, 0] and table.min() == 0 and table.clock_of(0) == 4


def record(worker: int, clock: int, t_gate: float, t_end: float) -> IterationRecord:
    return IterationRecord(worker, 0, clock, clock, t_gate, t_gate, t_gate, t_end, t_end, 0.0, (0,), ("acked",))


def test_leads_from_timestamps() -> None:
    # Worker 0 runs three clocks while worker 1 finishes its first only at t=10.
    records = [
        record(0, 0, 0.0, 1.0),
        record(0, 1, 1.0, 2.0),
        record(0, 2, 2.0, 3.0),
        record(1, 0, 0.0, 10.0),
        record(0, 3, 11.0, 12.0),
    ]
    assert clock_leads(records, 2) == [0, 1, 2, 0, 2]


@given(st.integers(1, 4), st.integers(0, 3), st.lists(st.floats(0.1, 2.0), min_size=4, max_size=4), st.integers(1, 25))
def test_a_simulated_ssp_schedule_never_leads_by_more_than_the_bound(
    num_workers: int, bound: int, speeds: list[float], steps: int
) -> None:
    # Discrete simulation of the gate: a worker starts clock c once every worker finished c - bound.
    finished = [0] * num_workers
    busy_until = [0.0] * num_workers
    started = [False] * num_workers
    now, records = 0.0, []
    while min(finished) < steps:
        for w in range(num_workers):
            if started[w] and busy_until[w] <= now:
                finished[w] += 1
                started[w] = False
            if not started[w] and finished[w] < steps and finished[w] - min(finished) <= bound:
                started[w] = True
                busy_until[w] = now + speeds[w]
                records.append(record(w, finished[w], now, now + speeds[w]))
        now = min(t for t, s in zip(busy_until, started, strict=True) if s) if any(started) else now
    leads = clock_leads(records, num_workers)
    assert max(leads) <= bound
