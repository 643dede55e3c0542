"""A canary under load on a running engine (``[rollout] mode = "canary"``): a candidate
that admits everything (fcfs: it serves doomed requests, ones whose first-token deadline
no prefill can meet) is rolled back by the watchdog within its window, and the share of
output tokens that were good comes back; a candidate as good as the settled one is
promoted. Tenant "b" is the canary's at share 0.5, "a" is not. In both paths every
request ends exactly once and the pool is whole after the drain. Last, a bad candidate's
watch survives a kill -9 of the streamer mid-trial: the restarted streamer rolls it back,
and only the requests open at the kill are lost (they fail, as any streamer crash fails
them: tests/e2e/test_kill_matrix.py)."""
from __future__ import annotations

import os
import signal
import time

import anyio
import pytest

from components.streamer.live_config import WATCH_FILE, WatchJournal
from components.tenancy.canary import in_canary
from components.tenancy.watchdog import Ended
from tests.e2e.engine import Engine, await_for, wait_for
from tests.e2e.test_live_config import OPERATOR_KEY, _key
from weir.errors import RequestFailed, RequestRejected

CONFIG = """
[kv]
num_blocks = 256
[engine]
max_model_len = 512
[admission]
policy = "deadline"
tenants = [{ name = "a" }, { name = "b" }]
classes = [{ name = "interactive", ttft_slo_ms = 20000, late = "drop" }]
"""
WATCH = ('[rollout]\nmode = "canary"\nshare = 0.5\nwindow_s = 30.0\nmin_requests = 4\n'
         'max_miss_rate_increase = 0.25\nmax_wait_increase_s = 15.0\n')
BAD = '[admission]\npolicy = "fcfs"\n' + WATCH + 'promote_after_s = 600.0\n'
GOOD = '[admission]\nkv_safety = 0.15\n' + WATCH + 'promote_after_s = 4.0\n'
RESULTS: dict[str, str] = {}     # every request of the module's engine, by id
DOOMED_MS = 5             # a first-token deadline no prefill meets: the deadline policy
                          # refuses it at once, fcfs serves it late


@pytest.fixture(scope="module")
def eng(tmp_path_factory, model_path):
    e = Engine(tmp_path_factory.mktemp("rollout"), CONFIG + (
        f"[gateway]\nenabled = false\napi_keys = [{_key(OPERATOR_KEY, 'ops', 'operator')}]\n"))
    yield e
    e.stop()


def test_the_tenants_sides():
    assert in_canary("b", 0.5) and not in_canary("a", 0.5)


class Load:
    """Waves of requests from both tenants, each wave half doomed; one result a request."""

    def __init__(self, eng: Engine) -> None:
        self.eng, self.results, self.n = eng, RESULTS, len(RESULTS)

    async def one(self, client, tenant: str, doomed: bool) -> None:
        self.n += 1
        rid = f"{tenant}-{'doomed' if doomed else 'ok'}-{self.n}"
        outcome = await self.ask(client, rid, self.n, tenant, doomed)
        assert rid not in self.results                   # one answer per request
        self.results[rid] = outcome

    async def ask(self, client, rid: str, n: int, tenant: str, doomed: bool) -> str:
        """One request's end, as a result string."""
        try:
            done = await client.generate(f"Count to ten, number {n}:", request_id=rid,
                                         tenant=tenant, max_tokens=16, temperature=0,
                                         deadline_ms=DOOMED_MS if doomed else None,
                                         timeout=120)
            return f"finished:{done.finish_reason}"
        except RequestRejected as exc:
            return f"rejected:{exc}"

    async def waves(self, until, limit_s: float) -> None:
        """Waves until ``until()`` holds (checked between waves) or ``limit_s`` passed."""
        deadline = time.monotonic() + limit_s
        async with self.eng.async_client() as client:
            while time.monotonic() < deadline and not until():
                async with anyio.create_task_group() as tg:
                    for tenant in ("a", "b"):
                        for doomed in (False, True, False, True):
                            tg.start_soon(self.one, client, tenant, doomed)


def _tokens(eng: Engine) -> tuple[float, float]:
    """Output tokens of finished requests, (good, missed), from the streamer's counts."""
    s = eng.settled_stats("streamer")
    return s["goodput.tokens.interactive"], s["goodput.missed_tokens.interactive"]


def _history(eng: Engine):
    with eng.client(api_key=OPERATOR_KEY) as ops:
        return ops.config("history").history


def _good_share(before: tuple[float, float], after: tuple[float, float]) -> float:
    good, missed = after[0] - before[0], after[1] - before[1]
    return good / max(good + missed, 1.0)


def _drained(eng: Engine, load: Load) -> None:
    eng.wait_stat("admission", "outstanding", 0, timeout=10.0)
    eng.wait_kv_free(timeout=10.0)
    adm, streamer = eng.settled_stats("admission"), eng.settled_stats("streamer")
    assert (adm["reserved_kv_blocks"], adm["queued"]) == (0, 0)
    assert streamer["active_requests"] == 0 and streamer["requests.late_events"] == 0
    ended = sum(streamer.get(f"requests.{k}", 0) for k in
                ("finished", "rejected", "cancelled", "failed"))
    assert streamer["requests.failed"] == 0 and streamer["requests.cancelled"] == 0
    assert streamer["requests.submitted"] == ended == len(load.results) \
        + streamer["requests.retries"]


def test_a_candidate_that_admits_everything_is_rolled_back_and_goodput_recovers(eng):
    load = Load(eng)
    anyio.run(load.waves, lambda: len(load.results) >= 8, 60.0)         # the rates measured
    start = _tokens(eng)
    anyio.run(load.waves, lambda: len(load.results) >= 40, 60.0)        # the settled policy
    settled = _tokens(eng)
    assert _good_share(start, settled) > 0.9

    with eng.client(api_key=OPERATOR_KEY) as ops:
        trial = ops.config("apply", BAD, actor="test").current
    assert (trial.rollout, trial.changed) == (
        "canary", ("admission.policy", "rollout.max_miss_rate_increase",
                   "rollout.max_wait_increase_s", "rollout.min_requests", "rollout.mode",
                   "rollout.promote_after_s", "rollout.share"))
    eng.wait_stat("admission", "rollout.version", trial.version, timeout=5.0)

    def rolled_back():
        last = _history(eng)[-1]
        return last if last.applied_by == "watchdog" else None

    anyio.run(load.waves, rolled_back, 90.0)                             # under load
    back = wait_for(rolled_back, 10.0, "the watchdog's rollback")
    assert (back.version, back.rollback_of, back.rollout) == (
        trial.version + 1, trial.version - 1, "off")
    assert back.reason.startswith(("deadline-miss rate of class interactive",
                                   "cost")), back.reason
    took = back.applied_at - trial.applied_at
    assert took < 30.0                                                   # within the window
    during = _tokens(eng)
    canary_share = _good_share(settled, during)
    eng.wait_stat("admission", "config_version", back.version, timeout=5.0)
    assert "rollout.version" not in eng.stats("admission")
    eng.wait_stat("streamer", "rollout.rolled_back", 1, timeout=5.0)  # on its heartbeat
    assert eng.stats("streamer")["rollout.canary_share"] == 0.0

    mark = len(load.results)
    anyio.run(load.waves, lambda: len(load.results) >= mark + 32, 60.0)  # settled again
    after = _good_share(during, _tokens(eng))
    print(f"\nrollback after {took:.2f} s; good share of output tokens: settled "
          f"{_good_share(start, settled):.3f}, canary {canary_share:.3f}, after {after:.3f}; "
          f"tokens wasted meanwhile {during[1] - settled[1]:.0f} of "
          f"{during[0] + during[1] - settled[0] - settled[1]:.0f}")
    assert canary_share < 0.9 < after
    _drained(eng, load)


def test_a_good_candidate_is_promoted(eng):
    load = Load(eng)
    with eng.client(api_key=OPERATOR_KEY) as ops:
        trial = ops.config("apply", GOOD, actor="test").current
    assert trial.rollout == "canary"

    def promoted():
        last = _history(eng)[-1]
        return last if last.applied_by == "watchdog" else None

    anyio.run(load.waves, promoted, 60.0)
    v = wait_for(promoted, 10.0, "the watchdog's promotion")
    assert (v.version, v.promotion_of, v.rollout, v.rollback_of) == (
        trial.version + 1, trial.version, "off", None)
    assert v.reason.startswith("held ")
    eng.wait_stat("admission", "config_version", v.version, timeout=5.0)
    eng.wait_stat("scheduler", "config_version", v.version, timeout=5.0)
    eng.wait_stat("streamer", "rollout.promoted", 1, timeout=5.0)   # on its heartbeat
    _drained(eng, load)


# -- the watch across a restart of the streamer (last in the module: it kills it) -----

# a bad candidate judged on more requests than one wave brings, so that the kill lands
# mid-trial: the rollback needs canary requests from both sides of the restart
SLOW_BAD = ('[admission]\npolicy = "fcfs"\n[rollout]\nmode = "canary"\nshare = 0.5\n'
            'window_s = 120.0\nmin_requests = 16\nmax_miss_rate_increase = 0.25\n'
            'max_wait_increase_s = 15.0\npromote_after_s = 600.0\n')


class KilledLoad(Load):
    """Waves as ``Load``'s, each request's end recorded (failed ones too), and the ids open
    at any moment (``open``)."""

    def __init__(self, eng: Engine) -> None:
        super().__init__(eng)
        self.open: set[str] = set()
        self.waves = 0
        self.resumed: dict[str, float] = {}

    async def ask(self, client, rid: str, n: int, tenant: str, doomed: bool) -> str:
        self.open.add(rid)
        try:
            return await super().ask(client, rid, n, tenant, doomed)
        except RequestFailed as exc:
            return f"failed:{exc.reason}"
        finally:
            self.open.discard(rid)

    async def waves_until(self, until, limit_s: float) -> None:
        """Waves from one client until ``until()``; after a wave with a failure (the
        streamer was killed), the next waits for the engine to be whole again. ``waves``:
        the waves done. (One client for all: it has heard the streamer's instance by its
        second wave. A client that never heard the killed instance cannot tell its open
        requests went to it; they would end only at their timeout.)"""
        deadline = time.monotonic() + limit_s
        async with self.eng.async_client() as client:
            while time.monotonic() < deadline and not until():
                failed = sum(o.startswith("failed") for o in self.results.values())
                async with anyio.create_task_group() as tg:
                    for tenant in ("a", "b"):
                        for doomed in (False, True, False, True):
                            tg.start_soon(self.one, client, tenant, doomed)
                self.waves += 1
                if sum(o.startswith("failed") for o in self.results.values()) > failed:
                    await anyio.to_thread.run_sync(_whole, self.eng)
                    # the restarted streamer's watch, before any new request
                    self.resumed = await anyio.to_thread.run_sync(
                        lambda: self.eng.settled_stats("streamer"))


def _whole(eng: Engine) -> dict:
    def probe():
        try:
            comps = eng.status()
        except Exception:                              # not back yet: polled until it is
            return None
        return comps if all(c.alive and c.state == "ready" for c in comps.values()) else None
    return wait_for(probe, 120, "every component ready again")


def _journal_canary_ends(eng: Engine) -> int:
    path = eng.run_dir / WATCH_FILE
    if not path.exists():
        return 0
    got = WatchJournal.read(path)
    return 0 if got is None else got[0].canary_ended_before + sum(
        isinstance(s, Ended) and s.canary for s in got[1])


def test_the_watch_survives_a_kill_of_the_streamer_and_still_rolls_back(eng):
    load = KilledLoad(eng)
    with eng.client(api_key=OPERATOR_KEY) as ops:
        trial = ops.config("apply", SLOW_BAD, actor="test").current
    assert trial.rollout == "canary"
    eng.wait_stat("admission", "rollout.version", trial.version, timeout=5.0)
    mark = len(load.results)
    anyio.run(load.waves_until, lambda: len(load.results) >= mark + 8, 60.0)   # one wave
    written = wait_for(lambda: _journal_canary_ends(eng), 5.0, "the journal's first ends",
                       until=lambda n: n >= 4)
    assert _history(eng)[-1].version == trial.version               # still on trial
    pid = eng.status()["streamer"].pid
    killed: set[str] = set()
    at_kill: list[int] = []

    def rolled_back():
        last = _history_or_none(eng)
        return last if last is not None and last.applied_by == "watchdog" else None

    async def kill_mid_wave() -> None:
        await await_for(lambda: load.waves >= 2 and len(load.open) >= 4, 60.0,
                        "a later wave in flight")
        killed.update(load.open)
        os.kill(pid, signal.SIGKILL)
        at_kill.append(_journal_canary_ends(eng))       # before a new streamer starts

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_mid_wave)
            tg.start_soon(load.waves_until, lambda: bool(killed) and rolled_back(), 180.0)

    anyio.run(run)
    back = wait_for(rolled_back, 30.0, "the watchdog's rollback after the restart")
    comps = eng.status()
    assert comps["streamer"].pid != pid
    s = eng.stats("streamer")
    assert (s["rollout.resumed"], s["rollout.rolled_back"]) == (1, 1)
    # the restarted streamer went on with the canary ends the journal held at the kill
    assert load.resumed["rollout.resumed"] == 1 and load.resumed["rollout.trial_version"] \
        == trial.version
    assert load.resumed["rollout.canary_ended"] == at_kill[0] >= written
    assert (back.version, back.rollback_of, back.rollout) == (
        trial.version + 1, trial.version - 1, "off")
    assert back.reason.startswith(("deadline-miss rate of class interactive", "cost")), \
        back.reason
    assert not (eng.run_dir / WATCH_FILE).exists()
    eng.wait_stat("admission", "config_version", back.version, timeout=5.0)
    assert "rollout.version" not in eng.stats("admission")

    # lost: only what was open at the kill (it fails: the client sees a new streamer)
    failed = {rid: o for rid, o in load.results.items() if o.startswith("failed")}
    assert set(failed) <= killed, (failed, killed)
    assert all(o.startswith(("failed:engine_restarted", "failed:engine_unreachable"))
               for o in failed.values()), failed
    assert len(load.results) == load.n and not load.open      # every request answered
    print(f"\nkilled the streamer with {len(killed)} requests open ({len(failed)} failed); "
          f"{at_kill[0]} canary ends in the journal at the kill; rolled back "
          f"{back.applied_at - trial.applied_at:.2f} s into the trial: {back.reason}")
    eng.wait_stat("admission", "outstanding", 0, timeout=10.0)
    eng.wait_kv_free(timeout=10.0)
    adm = eng.settled_stats("admission")
    assert (adm["reserved_kv_blocks"], adm["queued"]) == (0, 0)
    assert eng.settled_stats("streamer")["active_requests"] == 0


def _history_or_none(eng: Engine):
    try:
        with eng.client(api_key=OPERATOR_KEY, max_retries=0) as ops:
            return ops.config("history").history[-1]
    except Exception:                                  # the streamer is restarting
        return None
