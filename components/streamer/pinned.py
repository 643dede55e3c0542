"""What a deterministic request's output is pinned to (``Pinned`` on its ``Accepted``):
read from the components' fixed facts in the supervisor's status (``ComponentStatus.info``,
``weir status``): the executor's model digest and kernel plan, the tokenizer's chat
template digest, and this build's version. Pure."""
from __future__ import annotations

import hashlib
import importlib.metadata

from components.model.identity import MODEL_SHA256, PLAN_ID, TEMPLATE_SHA256
from schemas.client import ComponentStatus, Pinned


def engine_version() -> str:
    try:
        return importlib.metadata.version("weir")
    except importlib.metadata.PackageNotFoundError:       # run from a source tree
        return "0+unknown"


def kernel_plan_id(info: dict[str, str]) -> str:
    """The executor's plan id: its own (``kernel.deterministic_plan``) where it reports
    one, else a digest of every ``kernel.*`` and ``kv.*`` fact it reports (the plan's
    choices, the threads it was timed on, the cache's element type); "" before it has
    reported."""
    if info.get(PLAN_ID):
        return info[PLAN_ID]
    facts = sorted((k, v) for k, v in info.items() if k.startswith(("kernel.", "kv.")))
    if not facts:
        return ""
    blob = "\n".join(f"{k}={v}" for k, v in facts)
    return "plan-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def pinned(components: tuple[ComponentStatus, ...], version: str) -> Pinned:
    """The pin from the supervisor's latest status (a fact not reported yet is "")."""
    info = {c.name: c.info for c in components}
    executor, tokenizer = info.get("executor", {}), info.get("tokenizer", {})
    model = executor.get(MODEL_SHA256, "")
    template = tokenizer.get(TEMPLATE_SHA256, "")
    plan = kernel_plan_id(executor)
    blob = "\n".join((model, template, plan, version))
    return Pinned(model, template, plan, version,
                  "fp_" + hashlib.sha256(blob.encode()).hexdigest()[:16])
