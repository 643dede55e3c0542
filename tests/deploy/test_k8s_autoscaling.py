"""deploy/k8s/overlays/autoscaling: the HPA on the replicas' StatefulSet, the Prometheus
adapter's rules it reads through, and the windows set from the measured cold start. Checked
as the base is (rendered, kubernetes-validate strict, test_k8s_manifests' consistency
check), and against what Weir exports: every metric the HPA asks for is one the adapter's
rules serve, from a series the router's gateway exports under that name."""
from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml

from components.gateway.metrics import GatewayMetrics
from tests.deploy import weir_toml
from tests.deploy.kustomize import render
from tests.deploy.test_k8s_manifests import (
    K8S,
    consistency_problems,
    one,
    validate,
    weir_config,
)

OVERLAY = K8S / "overlays" / "autoscaling"
# scripts/bench/startup.py and one `weir serve` with an empty kernel-plan and step-cost
# cache (a new node), on the CPU image's model (SmolLM2-135M Q4_1), 2 cores; docs/deploy.md
COLD_START_S = 17.4         # spawn -> ready, nothing cached (kernel plan 11.1 s measured)
ROUTER_HEARTBEAT_S = 1.0    # the router hears a ready replica within a heartbeat or two


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(OVERLAY)


@pytest.fixture(scope="module")
def hpa(objects) -> dict:
    return one(objects, "HorizontalPodAutoscaler", "weir-replica")


@pytest.fixture(scope="module")
def adapter(objects) -> dict:
    cm = one(objects, "ConfigMap", "weir-prometheus-adapter")
    return yaml.safe_load(cm["data"]["config.yaml"])


def exported_series() -> set[str]:
    """Every sample name the router's gateway exports for the autoscaling signals, from a
    router's stats with one replica and one class."""
    m = GatewayMetrics("m")
    fields = ("queue_s", "kv_used", "prefill_backlog_tokens", "decode_backlog_tokens",
              "load_rejections", "headroom/interactive")
    m.engine.stats = {"router": {**{f"signal/r0/{f}": 1.0 for f in fields},
                                 **{f"fleet/{f}": 1.0 for f in fields + ("replicas",)}}}
    return {s.name for fam in m.engine.collect() for s in fam.samples
            if fam.name.startswith("weir:")} | {
        f"{fam.name}_total" for fam in m.engine.collect() if fam.type == "counter"}


def _series_names(query: str, exported: set[str]) -> set[str]:
    """The exported names a rule's seriesQuery selects (a name, or __name__=~"...")."""
    if (m := re.search(r'__name__=~"([^"]+)"', query)) is not None:
        return {n for n in exported if re.fullmatch(m.group(1), n)}
    name = query.split("{", 1)[0]
    return {name} & exported


def served(rules: list[dict]) -> dict[str, str]:
    """metric name the adapter serves -> the exported series it comes from."""
    exported = exported_series()
    out = {}
    for rule in rules:
        names = _series_names(rule["seriesQuery"], exported)
        assert names, f"{rule['seriesQuery']} selects nothing Weir exports"
        for name in names:
            m = re.search(rule["name"]["matches"], name)
            assert m is not None, (rule["name"], name)
            as_ = re.sub(r"\$\{(\d+)\}", lambda g, m=m: m.group(int(g.group(1))),
                         rule["name"]["as"])
            out[as_] = name
    return out


def test_every_object_is_valid_and_agrees(objects):
    for obj in objects:
        validate(obj)
    assert consistency_problems(objects) == []


def test_the_validator_checks_the_hpa_too(hpa):
    broken = copy.deepcopy(hpa)
    broken["spec"]["metrics"][0]["pods"]["target"]["averageValue"] = {"v": 1}
    misspelled = copy.deepcopy(hpa)
    misspelled["spec"]["behavior"]["scaleUp"]["stabilisationWindowSeconds"] = 0
    for bad in (broken, misspelled):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(bad)


def test_the_hpa_scales_the_statefulset_the_router_finds(objects, hpa):
    sts = one(objects, "StatefulSet", "weir-replica")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "StatefulSet",
                                                             sts["metadata"]["name"])
    assert "replicas" not in sts["spec"]                 # the HPA's alone
    assert hpa["spec"]["minReplicas"] >= 2               # a warm floor, never zero
    # the router follows the pods the HPA runs through their headless Service: no list
    router = weir_toml.load(weir_config(objects)["data"]["router.toml"], "route")
    assert router.router.discovery == "dns" and not router.router.replicas
    assert router.router.discovery_name == sts["spec"]["serviceName"]


def test_a_replica_count_beside_the_hpa_is_caught(objects):
    broken = copy.deepcopy(objects)
    one(broken, "StatefulSet", "weir-replica")["spec"]["replicas"] = 2
    assert any("beside the HPA" in p for p in consistency_problems(broken))


def test_the_hpa_reads_only_metrics_the_adapter_serves_from_weir_series(hpa, adapter):
    per_pod = served(adapter["rules"])
    external = served(adapter["externalRules"])
    assert set(per_pod) == {"weir_slo_pressure_ratio", "weir_predicted_queue_seconds",
                            "weir_kv_pressure_ratio", "weir_prefill_backlog_tokens",
                            "weir_decode_backlog_tokens", "weir_load_rejections_per_second"}
    assert per_pod["weir_slo_pressure_ratio"] == "weir:replica_slo_headroom_ratio"
    assert per_pod["weir_load_rejections_per_second"] == "weir:replica_load_rejections_total"
    assert set(external) == {"weir_fleet_slo_pressure_ratio",
                             "weir_fleet_predicted_queue_seconds",
                             "weir_fleet_kv_pressure_ratio",
                             "weir_fleet_prefill_backlog_tokens",
                             "weir_fleet_decode_backlog_tokens",
                             "weir_fleet_serving_replicas",
                             "weir_fleet_load_rejections_per_second"}
    names = []
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods", metric     # per replica pod, averaged by the HPA
        names.append(metric["pods"]["metric"]["name"])
        assert metric["pods"]["target"]["type"] == "AverageValue"
    assert set(names) <= set(per_pod)
    assert set(names) == {"weir_slo_pressure_ratio", "weir_kv_pressure_ratio",
                          "weir_load_rejections_per_second"}
    # the class it scales for has a TTFT objective in the replicas' config
    (slo,) = [m for m in hpa["spec"]["metrics"]
              if m["pods"]["metric"]["name"] == "weir_slo_pressure_ratio"]
    assert slo["pods"]["metric"]["selector"]["matchLabels"] == {"class": "interactive"}


def test_every_rule_maps_the_replica_label_to_its_pod_and_templates_its_query(adapter):
    for rule in adapter["rules"]:
        overrides = rule["resources"]["overrides"]
        assert overrides == {"namespace": {"resource": "namespace"},
                             "replica": {"resource": "pod"}}, rule
        assert 'replica!=""' in rule["seriesQuery"] and 'namespace!=""' in rule["seriesQuery"]
    for rule in adapter["rules"] + adapter["externalRules"]:
        q = rule["metricsQuery"]
        assert all(t in q for t in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>")), q
        assert ("rate(" in q) == rule["seriesQuery"].split("{")[0].endswith("_total"), q
    # the HPA's headroom reads the gauge averaged over time, not the last sample (a point
    # sample scaled up on quiet load in the fleet simulator: docs/perf-log.md, issue 47)
    (pressure,) = [r for r in adapter["rules"]
                   if r["name"]["as"] == "weir_slo_pressure_ratio"]
    assert "avg_over_time(<<.Series>>{<<.LabelMatchers>>}[30s])" in pressure["metricsQuery"]


def test_windows_follow_the_measured_cold_start_and_the_drain(objects, hpa):
    sts = one(objects, "StatefulSet", "weir-replica")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    replica = weir_toml.load(weir_config(objects)["data"]["replica.toml"], "serve")
    drain_s = replica.streamer.drain_timeout_s
    ready_probe_s = container["readinessProbe"]["periodSeconds"]
    up_s = COLD_START_S + ready_probe_s + ROUTER_HEARTBEAT_S       # to its first request
    # a startup probe that outlasts a cold start
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 10 * COLD_START_S
    up, down = hpa["spec"]["behavior"]["scaleUp"], hpa["spec"]["behavior"]["scaleDown"]
    assert up["stabilizationWindowSeconds"] == 0
    assert all(p["periodSeconds"] >= up_s for p in up["policies"])      # one cold start
    assert down["stabilizationWindowSeconds"] >= 3 * (drain_s + up_s)
    assert all(p["periodSeconds"] >= drain_s + up_s for p in down["policies"])
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]
    # scale-down drains: the grace period holds the drain and the exit
    assert drain_s + 5 <= pod["terminationGracePeriodSeconds"] <= drain_s + 30


def test_prometheus_scrapes_the_router_gateway(objects):
    router = one(objects, "Deployment", "weir-router")
    notes = router["spec"]["template"]["metadata"]["annotations"]
    cfg = weir_toml.load(weir_config(objects)["data"]["router.toml"], "route")
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics",
                     "prometheus.io/port": str(cfg.gateway.port)}


def test_the_rest_is_the_base(objects):
    base = render(K8S / "base")
    for kind, name in (("Service", "weir-replica"), ("Service", "weir-router")):
        assert one(objects, kind, name) == one(base, kind, name)
    sts, base_sts = one(objects, "StatefulSet", "weir-replica"), copy.deepcopy(
        one(base, "StatefulSet", "weir-replica"))
    del base_sts["spec"]["replicas"]
    for s in (sts, base_sts):
        for v in s["spec"]["template"]["spec"]["volumes"]:
            v.get("configMap", {}).pop("name", None)
    assert sts == base_sts
    assert weir_config(objects)["data"]["replica.toml"] == \
        weir_config(base)["data"]["replica.toml"]
