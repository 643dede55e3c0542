"""An admission policy and requests for its tests: two tenants and three classes on a
pool of 16-token blocks, no KV safety margin."""
from __future__ import annotations

from components.admission.policy import AdmissionPolicy
from schemas.config import load_config
from schemas.wire import SamplingParams, Tokenized

BS = 16
CLASSES = [
    {"name": "interactive", "priority": 0, "ttft_slo_ms": 1000, "max_queue_ms": 500},
    {"name": "batch", "priority": 10, "max_queue_ms": 60000, "aging_per_s": 1.0,
     "may_degrade": True, "min_max_tokens": 8, "max_tokens": 256},
    {"name": "bulk", "priority": 20},
]


def policy(kind="deadline", num_blocks=100, tenants=None, classes=CLASSES, fairness="vtc",
           **admission):
    cfg = load_config(None, topology={"run_dir": "/x"}, scheduler={"fairness": fairness},
                      kv={"num_blocks": num_blocks, "block_size": BS, "watermark": 0.0},
                      engine={"max_model_len": min(1024, num_blocks * BS)},
                      admission={"policy": kind, "classes": classes,
                                 "tenants": tenants or [{"name": "a"}, {"name": "b"}],
                                 "kv_safety": 0.0, **admission})
    return AdmissionPolicy(cfg)


def req(rid="r", tenant="a", prompt=32, max_tokens=32, cls=None, n=1, deadline=None,
        priority=0):
    return Tokenized(rid, tenant, list(range(prompt)), [], SamplingParams(max_tokens=max_tokens,
                     n=n), 0, (), deadline, priority, service_class=cls)
