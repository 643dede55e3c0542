"""One package per process; ``SERVICES`` maps each component to its service class.

The packages not in ``SERVICES`` are libraries that processes share (``model``, ``tenancy``,
``costs``); no process package imports another (tests/test_layering.py)."""

SERVICES = {
    "tokenizer": "components.tokenizer.service:TokenizerService",
    "admission": "components.admission.service:AdmissionService",
    "scheduler": "components.scheduler.service:SchedulerService",
    "kv_manager": "components.kv_manager.service:KvManagerService",
    "executor": "components.executor.service:ExecutorService",
    "detokenizer": "components.detokenizer.service:DetokenizerService",
    "streamer": "components.streamer.service:StreamerService",
    "gateway": "components.gateway.service:GatewayService",
    "router": "components.router.service:RouterService",
}


def service_class(name: str):
    import importlib

    module, _, attr = SERVICES[name].partition(":")
    return getattr(importlib.import_module(module), attr)
