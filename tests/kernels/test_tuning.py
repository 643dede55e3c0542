"""Kernel choice by measurement, with injected timings: each candidate is picked where it
is fastest, a layout that saves too little is not kept, and the cache key. (Forced choices
are tested where they are applied: tests/components/executor/test_kernel_candidates.py.)"""
import pytest

from kernels import tuning
from kernels.tuning import KernelPlan, choose_fastest, choose_linear, pick

ALL = (1, 8, 64, 512)


def table(**candidates):
    """Seconds per bucket for each candidate given (name=[...], a list aligned with ALL;
    None: that candidate cannot run the bucket)."""
    return {name: {b: t for b, t in zip(ALL, times) if t is not None}
            for name, times in candidates.items() if times is not None}


@pytest.mark.parametrize("winner", tuning.LINEAR)
def test_the_fastest_candidate_is_picked_everywhere_it_wins(winner):
    times = {c: [2.0, 2.0, 2.0, 2.0] for c in tuning.LINEAR}
    times[winner] = [1.0, 1.0, 1.0, 1.0]
    assert choose_linear(table(**times)) == [(512, winner)]


def test_avx2_like_bf16_through_fp32_weights_above_one_token():
    """An AVX2-only CPU, bf16 model: no oneDNN bf16, no native kernel; torch's bf16 GEMM is
    ~5x slower than fp32 past a few tokens. fp32 weights win there; the margin keeps the
    bf16 layout only if it saves 10% where it is used."""
    t = table(torch=[1.0, 8.0, 56.0, 400.0], fp32=[1.05, 5.0, 11.0, 90.0])
    assert choose_linear(t) == [(512, "fp32")]           # 1 token: 5% is not worth a layout
    t = table(torch=[1.0, 2.0, 56.0, 400.0], fp32=[3.0, 5.0, 11.0, 90.0])
    assert choose_linear(t) == [(8, "torch"), (512, "fp32")]


def test_zen4_like_native_for_small_steps_onednn_above():
    t = table(native=[1.0, 2.0, 10.0, None], onednn=[3.0, 3.0, 4.0, 20.0],
              torch=[5.0, 5.0, 6.0, 22.0])
    got = choose_linear(t)
    assert got == [(8, "native"), (512, "onednn")]
    assert [pick(got, m) for m in (1, 5, 8, 9, 64, 100, 4096)] == \
        ["native", "native", "native", "onednn", "onednn", "onednn", "onednn"]


def test_amx_like_native_only_for_one_token():
    t = table(native=[1.0, 4.0, 30.0, None], onednn=[2.0, 1.5, 3.0, 20.0],
              torch=[3.0, 2.5, 5.0, 25.0])
    assert choose_linear(t) == [(1, "native"), (512, "onednn")]


def test_amx_tiles_share_the_native_layout_so_a_small_win_keeps_both():
    """The AMX linear runs the native kernel's packed weights: where each wins some sizes,
    both stay even by a hair (no second copy to pay for), and the table runs each where
    it is faster; a distinct layout winning by as little is dropped."""
    t = table(native=[1.0, 3.0, 9.0, None], amx=[1.02, 1.0, 2.0, 10.0],
              onednn=[3.0, 2.5, 2.6, 9.0])
    assert choose_linear(t) == [(1, "native"), (64, "amx"), (512, "onednn")]
    # the same 2% with oneDNN's own copy of the weights in place of the AMX kernel
    t = table(native=[1.0, 3.0, 9.0, None], onednn=[1.02, 1.0, 2.0, 10.0])
    assert choose_linear(t) == [(512, "onednn")]
    assert tuning.layout_of("amx") == tuning.layout_of("native") != tuning.layout_of("onednn")


def test_a_layout_that_saves_less_than_the_margin_is_not_kept():
    # torch wins one bucket by 5%: not worth a second copy of the weights
    t = table(onednn=[1.0, 1.0, 1.05, 4.0], torch=[2.0, 2.0, 1.0, 5.0])
    assert choose_linear(t, margin=0.10) == [(512, "onednn")]
    # by half it is
    t = table(onednn=[1.0, 1.0, 2.0, 8.0], torch=[2.0, 2.0, 1.0, 4.0])
    assert choose_linear(t, margin=0.10) == [(8, "onednn"), (512, "torch")]


def test_the_margin_weighs_small_and_large_steps_alike():
    """Zen 4's gate_up, measured (ms): oneDNN ties the native kernel at 64-256 tokens and
    loses by 1.1-1.5x below. Summed, the large steps' times hide that (9% in all); on
    average over the steps native wins, it saves 19%, so its layout is kept."""
    ms = {"native": [0.138, 0.140, 0.147, 0.223, 0.271, 0.368, 0.844, 1.308, 2.389, None],
          "onednn": [0.195, 0.208, 0.180, 0.241, 0.297, 0.501, 0.822, 1.515, 2.398, 4.8]}
    t = {c: {m: v for m, v in zip((1, 2, 4, 8, 16, 32, 64, 128, 256, 512), ts) if v}
         for c, ts in ms.items()}
    assert choose_linear(t) == [(256, "native"), (512, "onednn")]


def test_a_candidate_that_cannot_run_large_steps_needs_another_for_them():
    t = table(native=[1.0, 1.0, 1.0, None], torch=[9.0, 9.0, 9.0, 9.0])
    assert choose_linear(t) == [(64, "native"), (512, "torch")]


def test_choose_fastest():
    assert choose_fastest({"native": 2.0, "torch": 1.0}) == "torch"
    assert choose_fastest({"native": 1.0, "torch": 1.0}) == "native"     # ties: name order


MACHINE = {"cpu": "Intel(R) Xeon(R) Platinum 8480+", "flags": "amx_bf16 avx2 avx512_bf16",
           "cores": 2, "threads": 2, "torch": "2.13.0"}
SHAPES = {"qkv": (960, 576), "lm_head": (49152, 576)}


def test_the_cache_key_changes_with_the_machine_and_nothing_else_equal():
    key = tuning.machine_key(MACHINE, "bfloat16", SHAPES, 2048)
    assert key == tuning.machine_key(dict(MACHINE), "bfloat16", dict(SHAPES), 2048)
    for change in ({"cpu": "AMD EPYC 9654 96-Core Processor"}, {"flags": "avx2"},
                   {"cores": 4}, {"threads": 1}, {"torch": "2.11.0"}):
        assert tuning.machine_key({**MACHINE, **change}, "bfloat16", SHAPES, 2048) != key
    assert tuning.machine_key(MACHINE, "float32", SHAPES, 2048) != key
    assert tuning.machine_key(MACHINE, "bfloat16", {**SHAPES, "o": (576, 576)}, 2048) != key
    assert tuning.machine_key(MACHINE, "bfloat16", SHAPES, 512) != key
    assert tuning.machine_key(MACHINE, "bfloat16", SHAPES, 2048, max_seqs=64) != key
    assert tuning.machine_key(MACHINE, "bfloat16", SHAPES, 2048, block_size=32) != key


def test_a_plan_round_trips_through_its_cache_file(tmp_path):
    plan = KernelPlan({"qkv": [(1, "native"), (2048, "onednn")]}, "native", "torch", "cpu",
                      layer_loop="python", timings={"sampling": {"native": 3.0}})
    path = tmp_path / "tuning" / "k.json"
    tuning.store(path, {"key": "k", **plan.to_json()})
    back = KernelPlan.from_json(tuning.load_cached(path), "k")
    assert (back.linear, back.elementwise, back.sampling, back.attention, back.source,
            back.layer_loop) == (plan.linear, "native", "torch", "cpu", "cached", "python")
    older = {k: v for k, v in plan.to_json().items() if k != "layer_loop"}
    assert KernelPlan.from_json(older, "k").layer_loop == "native"   # a cache from before it
    assert back.summary()["linear.qkv"] == "native<=1 onednn"
    assert tuning.load_cached(tmp_path / "missing.json") is None


def test_noise_does_not_fragment_the_table():
    # torch "wins" one bucket in the middle of oneDNN's range by a hair: timing noise; each
    # candidate gets one contiguous range of step sizes
    t = table(native=[1.0, 3.0, 9.0, None], onednn=[2.0, 1.0, 1.0, 4.0],
              torch=[3.0, 1.2, 0.98, 4.4])
    assert choose_linear(t, margin=0.0) == [(1, "native"), (512, "onednn")]


def _timed(table_s):
    """A timer for tuning.time_linear that returns ``table_s[name][m]`` for each candidate it
    is handed, and records which it was handed at each bucket."""
    asked = []

    def timer(fns):
        m = len(asked)
        asked.append(sorted(fns))
        return {name: table_s[name][m] for name in fns}
    return timer, asked


def test_a_candidate_far_behind_in_two_buckets_in_a_row_is_not_timed_above_them():
    import torch
    buckets = [1, 8, 64, 512, 2048]
    ms = 1e-3
    table_s = {"native": [0.1 * ms, 0.5 * ms, 2 * ms, 9 * ms, 30 * ms],
               # far behind at 1 and 8 too, but those calls are short: a fixed cost, kept
               "torch": [0.9 * ms, 0.9 * ms, 7 * ms, 40 * ms, 999],
               # 3x behind once (64), then close again: kept everywhere
               "fp32": [0.2 * ms, 0.6 * ms, 6 * ms, 10 * ms, 31 * ms]}
    timer, asked = _timed(table_s)
    noop = (lambda x, w: None, [None], 1 << 30)
    out = tuning.time_linear({c: noop for c in table_s}, 4, torch.float32, buckets, timer)
    assert asked == [["fp32", "native", "torch"]] * 4 + [["fp32", "native"]]
    assert sorted(out["torch"]) == [1, 8, 64, 512] and sorted(out["fp32"]) == buckets
    # the dropped candidate cannot win where it was not timed; the table is the same
    assert choose_linear(out) == choose_linear({**out, "torch": {**out["torch"], 2048: 999}})


def test_no_candidate_is_dropped_for_losing_only_short_calls_or_by_less_than_the_ratio():
    import torch
    buckets = [1, 8, 64]
    table_s = {"native": [1e-5, 1e-4, 1e-3], "torch": [9e-4, 9e-4, 2.9e-3]}
    timer, asked = _timed(table_s)
    noop = (lambda x, w: None, [None], 1 << 30)
    out = tuning.time_linear({c: noop for c in table_s}, 4, torch.float32, buckets, timer)
    assert asked == [["native", "torch"]] * 3 and sorted(out["torch"]) == buckets


def test_one_machine_measures_one_thing_at_a_time_whatever_its_key(tmp_path):
    """Inside ``measuring`` of any key (a plan, or step costs) the cache's machine-wide lock
    is held: another config's executor cannot time beside it; outside, it is free."""
    import fcntl

    def machine_lock_free() -> bool:
        with open(tmp_path / "measuring.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(f, fcntl.LOCK_UN)
            return True

    for path in (tmp_path / "tuning" / "a.json", tmp_path / "step_costs" / "b.json"):
        with tuning.measuring(path):
            assert not machine_lock_free()
            with open(path.with_suffix(".lock"), "a") as f:        # and its key's own lock
                with pytest.raises(BlockingIOError):
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert machine_lock_free()
