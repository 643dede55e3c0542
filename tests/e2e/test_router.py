"""The router in front of three real replicas (components/router): cache-aware routing beats
round robin on an agent workload, a loaded replica is passed over even when it holds the
prefix, and a replica killed under load loses no client and stops getting work.

The replicas' pools are small and have no host tier, so a replica cannot keep every
session's context: placing each session where its context is (cache-aware) is what keeps
the prefix cache useful; round robin makes every replica hold every session."""
import os
import signal
import statistics
import threading
import time

import anyio
import pytest

from tests.e2e.router import Router, start_replica
from weir.replay.live import SdkTarget, replay
from weir.replay.synth import PromptSynth, load_tokenizer
from weir.replay.types import Scaling
from weir.replay.workloads import agent_sessions

REPLICA_TOML = """
[kv]
num_blocks = 96
num_cpu_blocks = 0
[engine]
max_model_len = 1024
num_threads = 1
[scheduler]
max_num_batched_tokens = 256
[admission]
tenants = [{ name = "default" }, { name = "acme" }, { name = "globex" }, { name = "initech" }]
"""
BLOCK = 16


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_path):
    base = tmp_path_factory.mktemp("replicas")
    engines = {}
    try:
        for name in ("r0", "r1", "r2"):
            engines[name] = start_replica(base / name, REPLICA_TOML)
        yield engines
    finally:
        for eng in engines.values():
            eng.stop()


def run_agents(router: Router, model_path, seed: int) -> dict:
    requests = agent_sessions(9, 6, tenants=("acme", "globex", "initech"),
                              shared_system=False, system_blocks=6, turn_blocks=(2, 3),
                              output=(2, 4), block_tokens=BLOCK, session_gap_s=0.05, seed=seed)
    # distinct blocks per run: what one run cached is no help to the next
    requests = [r.__class__(**{**{f: getattr(r, f) for f in r.__struct_fields__},
                               "hash_ids": tuple(h + seed * 10**7 for h in r.hash_ids)})
                for r in requests]
    synth = PromptSynth.for_scaling(load_tokenizer(str(model_path)),
                                    Scaling(block_size=BLOCK, seed=seed))
    run = anyio.run(lambda: replay(requests, SdkTarget(router.endpoint),
                                   lambda r: (synth.token_ids(r), ""), closed_loop=True,
                                   progress=False))
    recs = run.records
    assert all(r.terminal == "completed" for r in recs), [r.reason for r in recs]
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    return {"hit_rate": cached / prompt, "ttft_p50": statistics.median(r.ttft_s for r in recs),
            "requests": len(recs)}


def test_cache_aware_routing_beats_round_robin(replicas, tmp_path, model_path):
    results = {}
    for i, policy in enumerate(("round_robin", "cache_aware")):
        router = Router(tmp_path / policy, replicas, REPLICA_TOML, policy=policy)
        try:
            results[policy] = run_agents(router, model_path, seed=11 + i)
            stats = router.stats()
            print(policy, {k: v for k, v in stats.items() if "reason" in k or "moves" in k
                           or k.endswith(".routed")})
        finally:
            router.stop()
        if policy == "cache_aware":
            assert stats.get("requests.reason.sticky", 0) > 0
    print("router hit rate / TTFT p50:", results)
    rr, ca = results["round_robin"], results["cache_aware"]
    assert ca["hit_rate"] >= 2 * rr["hit_rate"], results
    assert ca["ttft_p50"] < rr["ttft_p50"], results
