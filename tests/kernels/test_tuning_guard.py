"""The kernel plan's guard, with injected readers and timers: the load other processes put
on the cores while a plan is measured, timings that do not grow with the rows timed again,
and which plans are provisional, measured again, or replaced."""
import pytest
import torch

from kernels import tuning, tuning_guard
from kernels.tuning_guard import LoadMeter, LoadSample

STAT = """cpu  900 10 300 5000 40 0 20 7 3 0
cpu0 100 1 30 2000 10 0 2 1 1 0
cpu1 200 2 60 2000 20 0 4 2 1 0
cpu2 600 7 210 1000 10 0 14 4 1 0
intr 123 0 0
ctxt 456
"""


def test_busy_ticks_count_the_watched_cores_busy_fields_only():
    # user + nice + system + irq + softirq + steal; not idle, iowait or guest
    assert tuning_guard.busy_ticks(STAT, {0}) == 100 + 1 + 30 + 0 + 2 + 1
    assert tuning_guard.busy_ticks(STAT, {0, 1}) == 134 + 200 + 2 + 60 + 0 + 4 + 2
    assert tuning_guard.busy_ticks(STAT, {2}) == 835
    assert tuning_guard.busy_ticks(STAT, set()) == 0
    assert tuning_guard.busy_ticks(STAT, None) == 134 + 268 + 835     # every core


def test_the_load_is_other_processes_cpu_time_over_the_cores():
    a = LoadSample(wall_s=100.0, busy_s=50.0, own_s=7.0)
    # 10 s on 2 cores: 13 s busy, 8 of them this process's (all its threads): 5 s others
    b = LoadSample(wall_s=110.0, busy_s=63.0, own_s=15.0)
    assert tuning_guard.load_between(a, b, 2) == 0.25
    assert tuning_guard.load_between(a, b, 1) == 0.5
    # accounting skew (own counted above the cores' busy ticks) is no load, not negative
    assert tuning_guard.load_between(a, LoadSample(110.0, 55.0, 15.0), 2) == 0.0
    assert tuning_guard.load_between(a, LoadSample(110.0, 200.0, 7.0), 2) == 1.0
    assert tuning_guard.load_between(a, a, 2) == 0.0


def test_the_meter_reads_at_the_start_and_end_of_its_window():
    reads = iter([LoadSample(0.0, 0.0, 0.0), LoadSample(4.0, 6.0, 2.0),
                  LoadSample(10.0, 10.0, 4.0), LoadSample(10.5, 10.5, 4.0)])
    slept = []
    meter = LoadMeter(read=lambda: next(reads), cores=2, sleep=slept.append)
    with meter:
        pass
    assert (meter.load, meter.window_s) == (0.5, 4.0)
    assert meter.probe() == 0.5 and slept == [tuning_guard.PROBE_S]


def test_the_real_reader_counts_this_process_threads_as_its_own():
    """0.3 s of CPU burnt on another thread of this process is this process's own time
    (os.times counts every thread), and part of the cores' busy time in /proc/stat."""
    import threading
    import time

    a = tuning_guard.read_sample()

    def burn():
        end = time.process_time() + 0.3
        while time.process_time() < end:
            sum(range(1000))
    t = threading.Thread(target=burn)
    t.start()
    t.join()
    b = tuning_guard.read_sample()
    assert b.own_s - a.own_s == pytest.approx(0.3, abs=0.05)
    assert b.busy_s - a.busy_s >= b.own_s - a.own_s - 0.05


def test_growth_from_256_rows_per_doubling():
    t = {1: 1.0, 8: 0.9, 256: 1.0, 512: 1.3, 1024: 1.7, 2048: 2.1}
    # below 256 a flat time is a fixed cost; 1024 -> 2048 grows 1.24x: too little
    assert tuning_guard.violations(t) == [(1024, 2048)]
    assert tuning_guard.min_growth(1024, 2048) == pytest.approx(1.3)
    assert tuning_guard.min_growth(1024, 1536) == pytest.approx(1.15)
    assert tuning_guard.violations({256: 1.0, 512: 0.9}) == [(256, 512)]


def _scripted(first, again):
    """A timer for tuning.time_linear: the first pass takes ``first[name][m]``; each later
    call at a bucket takes the next of ``again[(name, m)]``. Candidates return their rows,
    so the timer knows the bucket. Records (bucket, names) per call."""
    calls = []
    again = {k: list(v) for k, v in again.items()}

    def timer(fns):
        rows = {name: fn() for name, fn in fns.items()}
        m = next(iter(rows.values()), None)
        calls.append((m, sorted(fns)))
        if len([c for c in calls if c[0] == m]) == 1:
            return {name: first[name][m] for name in fns}
        return {name: again[(name, m)].pop(0) for name in fns}
    return timer, calls


ROWS = (lambda x, w: x.shape[0], [None], 1 << 30)
BUCKETS = [256, 512, 1024, 2048]


def cores(*loads):
    """A meter on 2 cores whose reads, after the first, find ``loads`` (each since the
    first read); records how many reads were made."""
    reads = []

    def read():
        i = len(reads)
        reads.append(i)
        wall = 10.0 * i
        return LoadSample(wall, loads[i - 1] * 2 * wall if i else 0.0, 0.0)
    return LoadMeter(read=read, cores=2), reads


def test_a_bucket_that_breaks_the_growth_is_timed_again_and_keeps_its_least_time():
    """onednn's 1024-row time was taken under a burst: 2048 rows look barely slower. Timed
    again at both buckets, each keeps its least time, the growth is back and the choice
    follows the clean times; torch, whose times grow, is not timed again."""
    ms = 1e-3
    first = {"onednn": {256: 1 * ms, 512: 2 * ms, 1024: 6.0 * ms, 2048: 7.5 * ms},
             "torch": {256: 1.2 * ms, 512: 2.3 * ms, 1024: 4.2 * ms, 2048: 8.2 * ms}}
    timer, calls = _scripted(first, {("onednn", 1024): [4.0 * ms],
                                     ("onednn", 2048): [7.6 * ms]})
    found = {}
    meter, _ = cores(0.0)
    out = tuning.time_linear(dict.fromkeys(first, ROWS), 4, torch.float32, BUCKETS, timer,
                             anomalies=found, meter=meter)
    assert calls == [(m, ["onednn", "torch"]) for m in BUCKETS] + \
        [(1024, ["onednn"]), (2048, ["onednn"])]
    assert out["onednn"] == {256: 1 * ms, 512: 2 * ms, 1024: 4.0 * ms, 2048: 7.5 * ms}
    assert out["torch"] == first["torch"]
    assert found == {"onednn@1024": {"status": "settled", "ratio": 1.875}}
    # the disturbed pass had sent the large steps to torch (the incident on the AMX Xeon)
    assert tuning.choose_linear(first) == [(512, "onednn"), (2048, "torch")]
    assert tuning.choose_linear(out) == [(2048, "onednn")]


def test_a_plateau_that_quiet_cores_repeat_is_the_kernels_own_and_kept():
    """oneDNN's bf16 GEMM on the AMX Xeon: as long at 1024 rows as at 2048, in every plan.
    Other processes only add time, so a plateau still there when timed again on quiet cores
    is the kernel's: no second retry, not provisional."""
    ms = 1e-3
    first = {"onednn": {256: 0.4 * ms, 512: 0.75 * ms, 1024: 1.56 * ms, 2048: 1.55 * ms}}
    timer, calls = _scripted(first, {("onednn", 1024): [1.50 * ms],
                                     ("onednn", 2048): [1.58 * ms]})
    found = {}
    meter, reads = cores(0.02)
    out = tuning.time_linear({"onednn": ROWS}, 4, torch.float32, BUCKETS, timer,
                             anomalies=found, meter=meter)
    assert len(calls) == 6 and len(reads) == 2
    assert out["onednn"][1024] == 1.50 * ms and out["onednn"][2048] == 1.55 * ms
    assert found == {"onednn@1024": {"status": "reproduced", "ratio": 1.033}}
    assert tuning_guard.judge(0.02, {"linear.down": found}, 2) == ""


def test_a_plateau_timed_again_on_busy_cores_is_timed_once_more():
    ms = 1e-3
    first = {"onednn": {256: 0.4 * ms, 512: 0.75 * ms, 1024: 1.56 * ms, 2048: 1.55 * ms}}
    timer, calls = _scripted(first, {("onednn", 1024): [1.9 * ms, 1.52 * ms],
                                     ("onednn", 2048): [1.6 * ms, 1.57 * ms]})
    found = {}
    meter, reads = cores(0.3, 0.05)
    tuning.time_linear({"onednn": ROWS}, 4, torch.float32, BUCKETS, timer, anomalies=found,
                       meter=meter)
    assert [c[0] for c in calls[4:]] == [1024, 2048, 1024, 2048] and len(reads) == 3
    assert found == {"onednn@1024": {"status": "reproduced", "ratio": 1.02}}


def test_timings_still_flat_on_busy_cores_after_the_retries_are_unsettled_and_provisional():
    ms = 1e-3
    first = {"torch": {256: 1 * ms, 512: 2 * ms, 1024: 6.0 * ms, 2048: 6.0 * ms}}
    timer, calls = _scripted(first, {("torch", 1024): [5.0 * ms, 7.0 * ms],
                                     ("torch", 2048): [4.5 * ms, 3.0 * ms]})
    found = {}
    meter, _ = cores(0.4, 0.35)
    out = tuning.time_linear({"torch": ROWS}, 4, torch.float32, BUCKETS, timer,
                             anomalies=found, meter=meter)
    assert [c[0] for c in calls[4:]] == [1024, 2048] * tuning_guard.RETRIES
    assert out["torch"] == {256: 1 * ms, 512: 2 * ms, 1024: 5.0 * ms, 2048: 3.0 * ms}
    assert found == {"torch@1024": {"status": "unsettled", "ratio": 0.6}}
    assert tuning_guard.judge(0.01, {"linear.qkv": found}, 2) == (
        "timings that do not grow with the rows and stayed so when timed again on busy "
        "cores: linear.qkv.torch@1024")


def test_clean_timings_are_timed_once():
    ms = 1e-3
    first = {"amx": {256: 1 * ms, 512: 1.9 * ms, 1024: 3.8 * ms, 2048: 7.9 * ms}}
    timer, calls = _scripted(first, {})
    found = {}
    meter, reads = cores()
    tuning.time_linear({"amx": ROWS}, 4, torch.float32, BUCKETS, timer, anomalies=found,
                       meter=meter)
    assert len(calls) == 4 and found == {} and len(reads) == 1


def test_a_loaded_measurement_is_provisional_and_names_the_load():
    assert tuning_guard.judge(0.38, {}, 2) == (
        "other processes used 38% of the 2 cores while it was measured (limit 20%)")
    assert tuning_guard.judge(tuning_guard.LOAD_LIMIT, {}, 2) == ""


@pytest.mark.parametrize("guard, now, want", [
    ({"load": 0.02, "provisional": "", "attempts": 1}, 0.0, False),       # clean: never
    ({"load": 0.4, "provisional": "x", "attempts": 1}, 0.1, True),        # quieter now
    ({"load": 0.4, "provisional": "x", "attempts": 1}, 0.5, False),       # busier now
    ({"load": 0.02, "provisional": "x", "attempts": 2}, 0.05, True),      # unsettled, quiet
    ({"load": 0.02, "provisional": "x", "attempts": 2}, 0.2, False),      # unsettled, busy
    ({"load": 0.4, "provisional": "x", "attempts": 3}, 0.0, False),       # out of attempts
    ({"load": 0.02, "provisional": "", "remeasure": True}, 0.9, True),    # an operator's
    (None, 0.9, True),                                                    # before the guard
])
def test_which_cached_plans_are_measured_again(guard, now, want):
    probed = []

    def load_now():
        probed.append(1)
        return now
    assert tuning_guard.due(guard, load_now) is want
    # a clean plan (or one out of attempts) costs no probe at start
    assert probed == ([] if guard is None or guard.get("remeasure")
                      or not guard["provisional"] or guard["attempts"] >= 3 else [1])


def test_which_new_measurement_replaces_the_cached_one():
    better = tuning_guard.better
    assert better({"load": 0.3, "provisional": ""}, {"load": 0.0, "provisional": "x"})
    assert better({"load": 0.2, "provisional": "x"}, {"load": 0.4, "provisional": "x"})
    assert not better({"load": 0.5, "provisional": "x"}, {"load": 0.4, "provisional": "x"})
    assert better({"load": 0.5, "provisional": "x"}, None)
    assert better({"load": 0.5, "provisional": "x"}, {"load": 0.0, "remeasure": True})
