"""Fixtures shared by the executor's tests."""
from __future__ import annotations

import pytest

from kernels import tuning_guard


@pytest.fixture
def quiet_cores(monkeypatch):
    """The plan guard's load meter reads the cores as quiet: the real /proc/stat reader,
    with no other process's time counted. Under the suite's two xdist workers a real
    reading finds the other worker's load (33% of the cores seen), stores the first plan
    as provisional and rightly measures it again at the next start, which is not what a
    test of caching or cutting is about. tests/components/executor/test_plan_guard.py
    covers the load rule itself."""
    real_read = tuning_guard.read_sample

    def quiet() -> tuning_guard.LoadSample:
        got = real_read()
        return tuning_guard.LoadSample(got.wall_s, got.own_s, got.own_s)

    monkeypatch.setattr(tuning_guard, "read_sample", quiet)
