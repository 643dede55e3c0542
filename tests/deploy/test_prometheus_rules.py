"""deploy/prometheus-rules.yml: valid for Prometheus (``promtool check rules``), each alert
firing on the series it is for and quiet on a healthy engine's (``promtool test rules``),
and every metric it reads one the gateway really exports."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from components.gateway.metrics import GatewayMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not installed (Debian's prometheus package; "
                             "./scripts/test installs it under CI)")


@needs_promtool
def test_promtool_checks_the_rules():
    out = subprocess.run([promtool, "check", "rules", "prometheus-rules.yml"], cwd=DEPLOY,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_each_alert_fires_on_its_series_and_not_on_a_healthy_engine():
    out = subprocess.run([promtool, "test", "rules", "prometheus-rules.test.yml"], cwd=DEPLOY,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_metric_the_rules_read_is_exported_by_the_gateway():
    m = GatewayMetrics("m")
    m.engine.stats = {                  # one sample of each family the rules read
        "admission": {"decisions.reject.interactive": 1, "rejections.queue_full.interactive": 1},
        "streamer": {"slo.ttft.missed.interactive": 1, "slo.tpot.met.interactive": 1},
        "scheduler": {}, "kv_manager": {"total_blocks": 8, "free_blocks": 4}}
    exported = set(re.findall(r"^(weir:[a-z_]+)", m.render().decode(), re.M))
    read = set(re.findall(r"weir:[a-z_]+", (DEPLOY / "prometheus-rules.yml").read_text()))
    assert read and read <= exported, read - exported


def test_prometheus_loads_the_rules_in_compose():
    assert "prometheus-rules.yml" in (DEPLOY / "prometheus.yml").read_text()
    assert "deploy/prometheus-rules.yml" in (DEPLOY.parent / "compose.yaml").read_text()
