"""An admission policy and requests for its tests: two tenants and three classes on a
pool of 16-token blocks, no KV safety margin."""
from __future__ import annotations

from components.admission.policy import AdmissionPolicy
from schemas.config import load_config
from schemas.wire import SamplingParams
from tests import messages as msgs

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
    return msgs.tokenized(rid, tenant, list(range(prompt)), [],
                          SamplingParams(max_tokens=max_tokens, n=n), 0, (), deadline, priority,
                          service_class=cls)


def traced_service(monkeypatch, policy: AdmissionPolicy):
    """The admission service around ``policy``, its spans kept in memory and what it sends
    (to the streamer and the scheduler alike) appended to a list: ``(service, exporter,
    sent)``; drive it with ``anyio.run(service._admit, request, None, cached)``."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from components.admission import service

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(service, "_TRACER", provider.get_tracer("test"))
    svc = service.AdmissionService(policy.config)
    svc.policy, sent = policy, []

    class Sink:
        async def send(self, msg, traceparent=None):
            sent.append(msg)

    svc.to_streamer = svc.to_scheduler = Sink()
    return svc, exporter, sent
