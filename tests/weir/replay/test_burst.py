"""The burst measure and the spliced timeline (weir/replay/burst.py)."""
from __future__ import annotations

import math

import pytest

from weir.replay.burst import burstiness, splice


def _rows(times_s: list[float]) -> list[dict]:
    return [{"timestamp": round(t * 1e3), "input_length": 10 + i, "output_length": 1,
             "hash_ids": [i]} for i, t in enumerate(times_s)]


def test_burstiness_finds_the_largest_jump_between_neighbouring_windows() -> None:
    # 10 s windows: 5, 5, 20, 5 arrivals
    times = [i * 2.0 for i in range(5)] + [10 + i * 2.0 for i in range(5)] + \
            [20 + i * 0.5 for i in range(20)] + [30 + i * 2.0 for i in range(5)]
    j = burstiness(times, 10.0)
    assert (j.before, j.after, j.at_s, j.ratio) == (5, 20, 20.0, 4.0)
    assert j.peak_over_mean == pytest.approx(20 / (35 / 4))


def test_a_window_too_quiet_to_count_is_not_an_infinite_burst() -> None:
    times = [0.0, 1.0, 25.0] + [30 + i * 0.1 for i in range(50)]
    j = burstiness(times, 10.0, min_before=5)
    assert j.before == 0 and j.after == 0 and math.isinf(j.ratio)
    assert burstiness(times, 10.0, min_before=1).ratio == 50.0


def test_splice_lays_copies_over_each_other_and_keeps_the_rows() -> None:
    rows = _rows([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5])
    out = splice(rows, [(2.0, 1), (2.0, 2), (2.0, 1)])
    # [0,2) once; [2,4) and [4,6) over each other at 2 s; [6,8) at 4 s
    assert [r["timestamp"] for r in out] == [500, 1500, 2500, 2500, 3500, 3500, 4500, 5500]
    assert sorted(r["input_length"] for r in out) == [r["input_length"] for r in rows]
    by_len = {r["input_length"]: r for r in out}
    assert by_len[14]["timestamp"] == 2500 and by_len[14]["hash_ids"] == [4]


def test_splice_refuses_more_than_the_source_holds() -> None:
    with pytest.raises(ValueError, match="need 16 s"):
        splice(_rows([0.5, 1.5, 9.5]), [(4.0, 4)])
    with pytest.raises(ValueError):
        splice(_rows([0.5]), [(0.0, 1)])
