"""Load the deployment's Weir configs (deploy/router/*.toml, the k8s ConfigMap's) with
Weir's own schema, and check the router's section against the router's contract.

The router's fields (``[topology] kv_events_endpoint``, ``[router]``) arrive with the
router itself; where this checkout's schema does not know them yet they are checked here
(``check_router_section``, ``endpoint_port``) and left out of the schema's validation,
which then covers every other field. Once the schema has them it validates them too.
"""
from __future__ import annotations

import tomllib
from urllib.parse import urlsplit

import msgspec

from schemas.config import Topology, WeirConfig

POLICIES = ("cache_aware", "round_robin", "least_loaded")


def pending_fields() -> list[str]:
    """The router's config fields this checkout's schema does not know yet."""
    missing = []
    if "kv_events_endpoint" not in Topology.__struct_fields__:
        missing.append("topology.kv_events_endpoint")
    if "router" not in WeirConfig.__struct_fields__:
        missing.append("router")
    return missing


def load(text: str, serve: bool = False) -> tuple[dict, WeirConfig]:
    """The TOML as parsed, and as Weir's config loader validates it (``load_config``'s
    conversion; a bad field raises ``msgspec.ValidationError``). ``serve``: as ``weir
    serve`` loads it, which gives the topology a run directory of its own."""
    raw = tomllib.loads(text)
    checked = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    if serve:
        checked["topology"] = {**checked.get("topology", {}), "run_dir": "/tmp/weir-run"}
    pending = pending_fields()
    if "topology.kv_events_endpoint" in pending:
        checked.get("topology", {}).pop("kv_events_endpoint", None)
    if "router" in pending:
        checked.pop("router", None)
    checked.setdefault("topology", {})
    cfg = msgspec.convert(checked, WeirConfig)
    if "router" in raw:
        check_router_section(raw["router"])
    if "kv_events_endpoint" in raw.get("topology", {}):
        endpoint_port(raw["topology"]["kv_events_endpoint"])
    return raw, cfg


def check_router_section(router: dict) -> None:
    """The ``[router]`` section as the router's contract has it."""
    assert set(router) <= {"policy", "heartbeat_timeout_s", "replicas"}, sorted(router)
    assert router.get("policy", "cache_aware") in POLICIES, router.get("policy")
    assert float(router.get("heartbeat_timeout_s", 2.0)) > 0
    replicas = router["replicas"]
    assert replicas, "the router lists no replicas"
    for rep in replicas:
        assert set(rep) == {"name", "endpoint", "kv_events"}, sorted(rep)
        endpoint_port(rep["endpoint"])
        endpoint_port(rep["kv_events"])
    names = [r["name"] for r in replicas]
    assert len(set(names)) == len(names), f"duplicate replica names: {names}"


def endpoint_port(endpoint: str) -> int:
    """The port of a ``tcp://host:port`` address (AssertionError otherwise)."""
    parts = urlsplit(endpoint)
    assert parts.scheme == "tcp" and parts.hostname and parts.port, endpoint
    return parts.port


def endpoint_host(endpoint: str) -> str:
    endpoint_port(endpoint)
    return urlsplit(endpoint).hostname
