"""compose.yaml is valid and runs every component, the collector, Jaeger and Prometheus."""
import shutil
import subprocess
from pathlib import Path

import yaml

from schemas.config import COMPONENTS, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_compose_config_is_valid():
    if shutil.which("docker-compose"):
        out = subprocess.run(["docker-compose", "-f", str(ROOT / "compose.yaml"), "config", "-q"],
                             capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    assert set(COMPONENTS) | {"gateway", "supervisor", "otel-collector", "jaeger",
                              "prometheus"} <= set(services)
    for name in (*COMPONENTS, "gateway", "supervisor"):
        svc = services[name]
        assert svc["image"] == "weir:latest" and "healthcheck" in svc, name
        assert svc["stop_signal"] == "SIGTERM"
    for svc in services.values():
        for vol in svc.get("volumes", ()):
            assert (ROOT / vol.split(":")[0]).exists(), vol
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
