"""compose.yaml is valid and runs every component, the collector, Jaeger and Prometheus;
its `router` profile runs two whole-engine replicas behind a router."""
import shutil
import subprocess
from pathlib import Path

import msgspec
import yaml

from components.admission.request_log import log_path
from components.streamer.live_config import HISTORY_FILE, WATCH_FILE, history_path
from schemas.config import COMPONENTS, SLO_CLASSES, load_config
from tests.deploy import weir_toml

ROOT = Path(__file__).resolve().parent.parent
ROUTER_PROFILE = ("replica-0", "replica-1", "router")


def test_compose_config_is_valid():
    if shutil.which("docker-compose"):
        for profile in ([], ["--profile", "router"]):
            out = subprocess.run(["docker-compose", "-f", str(ROOT / "compose.yaml"), *profile,
                                  "config", "-q"], capture_output=True, text=True, cwd=ROOT)
            assert out.returncode == 0, out.stderr
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    assert set(COMPONENTS) | {"gateway", "supervisor", "otel-collector", "jaeger",
                              "prometheus"} <= set(services)
    for name in (*COMPONENTS, "gateway", "supervisor"):
        svc = services[name]
        assert svc["image"] == "weir:latest" and "healthcheck" in svc, name
        assert svc["stop_signal"] == "SIGTERM"
    named = set(spec.get("volumes") or ())
    for svc in services.values():
        for vol in svc.get("volumes", ()):
            source = vol.split(":")[0]
            assert source in named or (ROOT / source).exists(), vol
    # an operator's key for `weir config` / `weir replicas`, from the keys volume; the
    # router's config history on a writable volume of its own
    assert all(services[n]["environment"]["WEIR_OPERATOR_KEY_FILE"] ==
               "/etc/weir/keys/operator.key" for n in ("streamer", *ROUTER_PROFILE))
    router = weir_toml.load((ROOT / "deploy/router/router.toml").read_text(), "route").router
    assert f"router-state:{Path(router.config_history).parent}" in services["router"]["volumes"]
    assert (ROOT / "Dockerfile").exists()


def test_compose_topology_config_is_tcp_and_traced():
    cfg = load_config(ROOT / "deploy" / "compose.toml")
    t = cfg.topology
    assert t.transport == "tcp"
    assert t.inbox("executor") == "tcp://executor:7464"
    assert t.heartbeats() == "tcp://supervisor:7467" and t.control() == "tcp://supervisor:7468"
    assert t.client_connect == "tcp://streamer:7450"
    assert cfg.telemetry.exporter == "otlp" and "otel-collector" in cfg.telemetry.otlp_endpoint
    assert cfg.gateway.host == "0.0.0.0"
    # the stack ships the SLO-first defaults, as weir serve with no config does
    assert cfg.admission == load_config(topology={"run_dir": "/tmp"}).admission
    assert cfg.admission.policy == "deadline" and cfg.admission.classes == SLO_CLASSES


def test_compose_engine_keeps_a_run_directory_on_a_volume():
    """topology.run_dir is set, and over tcp it places no socket; admission's request log
    and the streamer's history resolve there, on the one named volume both mount
    writable."""
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    cfg = load_config(ROOT / "deploy" / "compose.toml")
    t = cfg.topology
    assert t.transport == "tcp" and t.run_dir == "/var/lib/weir"
    bare = msgspec.structs.replace(t, run_dir="")
    for bind in (False, True):
        assert [t.inbox(c, bind) for c in COMPONENTS] == [bare.inbox(c, bind)
                                                         for c in COMPONENTS]
        assert (t.heartbeats(bind), t.control(bind), t.kv_events(bind)) == (
            bare.heartbeats(bind), bare.control(bind), bare.kv_events(bind))
        assert not any(a.startswith("ipc://") for a in (
            *(t.inbox(c, bind) for c in COMPONENTS), t.heartbeats(bind), t.control(bind),
            t.kv_events(bind)))
    assert (t.client_endpoint, t.client_connect) == (bare.client_endpoint,
                                                     bare.client_connect)
    # the request log is on (the default), both files in the run directory
    assert log_path(cfg) == Path(t.run_dir) / "requests.jsonl"
    assert history_path(cfg) == Path(t.run_dir) / HISTORY_FILE
    assert history_path(cfg).with_name(WATCH_FILE).parent == Path(t.run_dir)

    def volume_at(name: str, path: Path) -> str:
        for vol in services[name]["volumes"]:
            src, dst, *mode = vol.split(":")
            if Path(dst) == path.parent and "ro" not in mode:
                assert src in (spec.get("volumes") or {}), f"{name}: {vol} is no named volume"
                return src
        raise AssertionError(f"{name}: nothing writable mounted at {path.parent}")

    assert volume_at("admission", log_path(cfg)) == volume_at("streamer", history_path(cfg))
    # and both still mount the config and the keys (their volumes replace the anchor's)
    for name in ("admission", "streamer"):
        assert _mounted(services[name], "deploy/compose.toml") == "/etc/weir/weir.toml"
        assert _mounted(services[name], "deploy/keys") == cfg.security.curve_keys_dir


def _mounted(svc: dict, host_path: str) -> str:
    """Where the service mounts ``host_path`` (a path relative to the repository)."""
    for vol in svc["volumes"]:
        src, dst, *_ = vol.split(":")
        if (ROOT / src).resolve() == (ROOT / host_path).resolve():
            return dst
    raise AssertionError(f"{host_path} is not mounted: {svc['volumes']}")


def test_compose_router_profile():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    # the default stack is unchanged: only the router profile's services have a profile
    assert {n for n, s in services.items() if "profiles" in s} == set(ROUTER_PROFILE)
    for name in ROUTER_PROFILE:
        svc = services[name]
        assert svc["profiles"] == ["router"], name
        assert svc["image"] == "weir:latest" and "healthcheck" in svc, name
        assert svc["stop_signal"] == "SIGTERM", name
        assert svc["depends_on"]["keys"]["condition"] == "service_completed_successfully"
        assert "otel-collector" in svc["depends_on"], name
    default_ports = {p.rsplit(":", 1)[0] for n, s in services.items() if n not in ROUTER_PROFILE
                     for p in s.get("ports", ())}
    router = services["router"]
    assert not default_ports & {p.rsplit(":", 1)[0] for p in router["ports"]}, \
        "the router's host ports clash with the default stack's"
    assert {r: router["depends_on"][r]["condition"] for r in ("replica-0", "replica-1")} == \
        {"replica-0": "service_healthy", "replica-1": "service_healthy"}

    # the router's config, as `weir route` reads it from its mount
    cmd = router["command"]
    assert cmd[:3] == ["weir", "route", "--config"]
    assert cmd[3] == _mounted(router, "deploy/router/router.toml")
    router_cfg = weir_toml.load((ROOT / "deploy/router/router.toml").read_text(), "route")
    assert router_cfg.gateway.host == "0.0.0.0"
    # it publishes its client endpoint and gateway (on other host ports, above)
    assert {int(p.rsplit(":", 1)[1]) for p in router["ports"]} == {
        weir_toml.endpoint_port(router_cfg.topology.client_endpoint), router_cfg.gateway.port}
    listed = {weir_toml.endpoint_host(r.endpoint): r for r in router_cfg.router.replicas}
    assert set(listed) == {"replica-0", "replica-1"}
    # two replica pools for a canary by pool (docs/operations.md): each replica's pool in
    # the router's list is the label its service carries; both take the operator's key
    assert {n: r.pool for n, r in listed.items()} == {
        "replica-0": "stable", "replica-1": "canary"} == {
        n: services[n]["labels"]["dev.weir.pool"] for n in listed}
    for name in listed:
        assert "WEIR_OPERATOR_KEY_FILE" in services[name]["environment"]
    assert "WEIR_OPERATOR_KEY_FILE" in router["environment"]

    for name in ("replica-0", "replica-1"):
        svc = services[name]
        cmd = svc["command"]
        assert cmd[:3] == ["weir", "serve", "--config"]
        assert cmd[3] == _mounted(svc, "deploy/router/replica.toml")
        cfg = weir_toml.load((ROOT / "deploy/router/replica.toml").read_text(), "serve")
        # `weir serve` binds --endpoint: the config's endpoint, on the port the router dials
        assert cmd[cmd.index("--endpoint") + 1] == cfg.topology.client_endpoint
        zmq = weir_toml.endpoint_port(cfg.topology.client_endpoint)
        events = weir_toml.endpoint_port(cfg.topology.kv_events_endpoint)
        rep = listed[name]
        assert (weir_toml.endpoint_port(rep.endpoint), weir_toml.endpoint_port(rep.kv_events),
                weir_toml.endpoint_host(rep.kv_events)) == (zmq, events, name)
        assert f"tcp://127.0.0.1:{zmq}" in svc["healthcheck"]["test"]
        # the router hashes prefixes as the replicas' kv_managers do, and refuses (and
        # bounds its client frames by) what their context window could not hold
        assert (cfg.engine.model, cfg.kv.block_size, cfg.engine.max_model_len) == \
            (router_cfg.engine.model, router_cfg.kv.block_size, router_cfg.engine.max_model_len)
        assert cfg.gateway.host == "0.0.0.0"
        for c in (cfg, router_cfg):
            assert c.security.curve and c.security.curve_keys_dir == _mounted(svc, "deploy/keys")
            assert c.telemetry.exporter == "otlp" and "otel-collector" in c.telemetry.otlp_endpoint
    assert router_cfg.security.curve_keys_dir == _mounted(router, "deploy/keys")
