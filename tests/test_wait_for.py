"""The end-to-end tests' one polling helper (tests/e2e/engine.py: wait_for, await_for), on
probes that count their calls: what it returns, when it gives up, and what it says then."""
import itertools

import anyio
import pytest

from tests.e2e.engine import await_for, wait_for


def test_returns_the_first_truthy_value_and_stops_probing():
    calls = itertools.count(1)
    assert wait_for(lambda: (n := next(calls)) >= 3 and n, 5.0, interval=0) == 3
    assert next(calls) == 4                                  # probed exactly three times


def test_until_judges_the_value_it_returns():
    values = iter([0, 1, 2, 3])
    assert wait_for(lambda: next(values), 5.0, interval=0, until=lambda v: v >= 2) == 2


def test_a_timeout_names_the_condition():
    with pytest.raises(AssertionError, match=r"^the light turning green did not hold within "
                                             r"0\.05s$"):
        wait_for(lambda: False, 0.05, "the light turning green", interval=0.01)


def test_a_callable_what_makes_the_message_from_the_last_value():
    values = itertools.count()
    with pytest.raises(AssertionError) as err:
        wait_for(lambda: next(values), 0.05, lambda last: f"last read {last}", interval=0.01,
                 until=lambda v: v < 0)
    assert err.value.args[0].startswith("last read ") and int(err.value.args[0][10:]) >= 1


def test_or_last_returns_the_last_value_instead_of_raising():
    values = itertools.count()
    got = wait_for(lambda: next(values), 0.05, interval=0.01, until=lambda v: v < 0,
                   or_last=True)
    assert got >= 1


def test_the_probe_runs_once_even_with_no_time_left():
    assert wait_for(lambda: "at once", 0.0) == "at once"


def test_an_exception_in_the_probe_is_not_swallowed():
    def probe():
        raise RuntimeError("exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_for(probe, 5.0)


def test_await_for_takes_plain_and_coroutine_probes():
    async def main():
        values = iter([0, 0, 7])

        async def read():
            await anyio.sleep(0)
            return next(values)

        got = await await_for(read, 5.0, interval=0)
        plain = await await_for(lambda: "x", 5.0)
        with pytest.raises(AssertionError, match="never did not hold within 0.05s"):
            await await_for(lambda: None, 0.05, "never", interval=0.01)
        last = await await_for(lambda: 0, 0.05, interval=0.01, or_last=True)
        return got, plain, last

    assert anyio.run(main) == (7, "x", 0)
