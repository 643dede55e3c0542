"""`weir status` shows seven distinct live OS processes and agrees with the KV pool."""
import json
import os
import subprocess
import sys

from kernels import tuning
from kernels.machine import usable_cores
from schemas.config import COMPONENTS
from tests.e2e.engine import ROOT, wait_for


def test_seven_distinct_live_processes(engine):
    out = subprocess.run([sys.executable, "-m", "weir.cli", "status", "--json", "--endpoint",
                          engine.endpoint], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    status = json.loads(out.stdout)
    comps = status["components"]
    assert set(comps) == set(COMPONENTS)
    pids = {c["pid"] for c in comps.values()}
    assert len(pids) == 7 and os.getpid() not in pids
    for name, c in comps.items():
        assert c["alive"] and c["state"] == "ready", name
        os.kill(c["pid"], 0)                      # raises if no such process
        cmdline = open(f"/proc/{c['pid']}/cmdline", "rb").read().split(b"\0")
        assert b"weir.launch" in cmdline and name.encode() in cmdline
    assert status["kv"]["total_blocks"] == 512
    assert status["kv"]["free_blocks"] == status["kv"]["total_blocks"]
    assert status["scheduler"] == {"running": 0, "waiting": 0, "wasted_tokens": 0,
                                   "preemptions": {"recompute": 0, "swap": 0}}
    assert status["kv"]["cpu_free_blocks"] == status["kv"]["cpu_total_blocks"] > 0
    assert status["kv"]["below_watermark"] is False
    assert status["admission"]["queued"] == 0 and status["admission"]["outstanding"] == 0
    kernels = status["kernels"]                  # the executor's plan, and how it was made
    assert kernels["source"] in ("measured", "cached")
    assert kernels["threads"] == str(usable_cores())    # num_threads 0: each core it may use
    assert kernels["attention"] in ("cpu", "torch") and kernels["sampling"] in ("native", "torch")
    for role in ("qkv", "o", "gate_up", "down", "lm_head"):
        *bounded, last = kernels[f"linear.{role}"].split()   # e.g. "native<=4 onednn"
        assert last in tuning.LINEAR, kernels
        for entry in bounded:
            name, up_to = entry.split("<=")
            assert name in tuning.LINEAR and int(up_to) > 0, kernels
    out = subprocess.run([sys.executable, "-m", "weir.cli", "status", "--endpoint",
                          engine.endpoint], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    assert "admission    outstanding 0 queued 0" in out.stdout


def test_idle_components_beat_only_for_news_or_the_keepalive(engine):
    """An idle engine's components send a heartbeat only every keepalive (1 s), not every
    interval (0.1 s): each one's heartbeat ages past 0.25 s while nothing happens, and none
    goes silent past the keepalive (the supervisor's proof of life)."""
    engine.wait_kv_free(timeout=5.0)                 # what earlier tests sent has finished
    oldest: dict[str, float] = {}
    with engine.client() as c:        # one client: each new one is news to the streamer
        def all_aged() -> bool:
            for comp in c.status().components:
                oldest[comp.name] = max(oldest.get(comp.name, 0.0), comp.heartbeat_age_s)
                assert comp.alive and comp.heartbeat_age_s < 3.0, comp
            return len(oldest) >= 7 and min(oldest.values()) > 0.25

        wait_for(all_aged, 10, or_last=True)           # asserted below, with what was seen
    assert set(oldest) == set(COMPONENTS) and min(oldest.values()) > 0.25, oldest
