"""deploy/k8s renders (kustomize, no cluster), every object is valid against Kubernetes'
own schemas (kubernetes-validate, strict: unknown fields fail too), and the objects agree
with each other and with the Weir configs they mount: what a cluster would only reveal
when a pod fails to start or the router cannot reach a replica."""
from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate  # the test extra (pyproject.toml): bundles the schemas
import pytest
import yaml

from schemas.config import SLO_CLASSES
from tests.deploy import weir_toml
from tests.deploy.kustomize import render, render_kubectl, render_py

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/gpu", "overlays/autoscaling",
                  "overlays/pool-canary"]
K8S_VERSION = "1.30"          # the oldest Kubernetes the manifests are checked against
WORKLOADS = ("Deployment", "StatefulSet")


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / request.param)


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# -- rendering and schemas


@pytest.mark.skipif(not shutil.which("kubectl"), reason="no kubectl to compare with")
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_fallback_renderer_matches_kubectl(kustomization):
    """Where kubectl is missing the tests render with tests/deploy/kustomize.py: it must
    produce exactly what kustomize does, generated names included."""
    def keyed(objs):
        return {(o["kind"], o["metadata"]["name"]): o for o in objs}

    assert keyed(render_py(K8S / kustomization)) == keyed(render_kubectl(K8S / kustomization))


def test_every_object_is_valid(rendered):
    name, objects = rendered
    kinds = sorted(o["kind"] for o in objects)
    extra = ["ConfigMap", "HorizontalPodAutoscaler"] if name == "overlays/autoscaling" else \
        ["Service", "StatefulSet"] if name == "overlays/pool-canary" else []
    assert kinds == sorted(["ConfigMap", "Deployment", "Service", "Service", "StatefulSet"]
                           + extra), name
    for obj in objects:
        validate(obj)


def test_validator_rejects_broken_manifests():
    """The schema check is real: a wrong type or a misspelled field fails it."""
    objects = render(K8S / "base")
    sts = one(objects, "StatefulSet", "weir-replica")
    validate(sts)

    wrong_type = copy.deepcopy(sts)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "7450"
    misspelled = copy.deepcopy(sts)
    misspelled["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    replicas_text = copy.deepcopy(sts)
    replicas_text["spec"]["replicas"] = "two"
    no_selector = copy.deepcopy(one(objects, "Deployment", "weir-router"))
    del no_selector["spec"]["selector"]
    for broken in (wrong_type, misspelled, replicas_text, no_selector):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(broken)


# -- cross-object consistency


def _ports(container: dict) -> dict:
    """name → containerPort, and each port number → itself."""
    ports = {}
    for p in container.get("ports", ()):
        ports[p["containerPort"]] = p["containerPort"]
        if "name" in p:
            ports[p["name"]] = p["containerPort"]
    return ports


def _cpu(quantity) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _config_text(objects: list[dict], pod: dict, container: dict, problems: list) -> str | None:
    """The text of the file the container's ``--config`` names, from the ConfigMap mounted
    there."""
    cmd = container.get("command", []) + container.get("args", [])
    if "--config" not in cmd:
        problems.append(f"{container['name']}: no --config in {cmd}")
        return None
    path = cmd[cmd.index("--config") + 1]
    volumes = {v["name"]: v for v in pod.get("volumes", ())}
    for mount in container.get("volumeMounts", ()):
        vol = volumes.get(mount["name"], {})
        if "configMap" not in vol:
            continue
        if mount.get("subPath") and mount["mountPath"] == path:
            key = mount["subPath"]
        elif not mount.get("subPath") and path.startswith(mount["mountPath"].rstrip("/") + "/"):
            key = path[len(mount["mountPath"].rstrip("/")) + 1:]
        else:
            continue
        items = {i["path"]: i["key"] for i in vol["configMap"].get("items", ())}
        if items:                     # only the listed keys, at their paths
            if key not in items:
                continue
            key = items[key]
        cms = [c for c in by_kind(objects, "ConfigMap")
               if c["metadata"]["name"] == vol["configMap"]["name"]]
        if cms and key in cms[0].get("data", {}):
            return cms[0]["data"][key]
    problems.append(f"{container['name']}: --config {path} is no mounted ConfigMap key")
    return None


def consistency_problems(objects: list[dict]) -> list[str]:
    """What would break in a cluster although each object is valid alone."""
    problems: list[str] = []
    config_maps = {c["metadata"]["name"]: c.get("data", {}) for c in by_kind(objects, "ConfigMap")}
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    replicas, routers = [], []       # (workload, its config), the routers' configs

    for wl in workloads:
        name = f"{wl['kind']}/{wl['metadata']['name']}"
        pod = wl["spec"]["template"]["spec"]
        labels = wl["spec"]["template"]["metadata"].get("labels", {})
        if not wl["spec"]["selector"]["matchLabels"].items() <= labels.items():
            problems.append(f"{name}: selector does not match its pod labels")
        volumes = {v["name"]: v for v in pod.get("volumes", ())}
        for vol in volumes.values():
            if "configMap" in vol:
                cm = vol["configMap"]["name"]
                if cm not in config_maps:
                    problems.append(f"{name}: volume {vol['name']} mounts missing ConfigMap {cm}")
                for item in vol["configMap"].get("items", ()):
                    if item["key"] not in config_maps.get(cm, {}):
                        problems.append(f"{name}: ConfigMap {cm} has no key {item['key']}")
        for c in pod["containers"]:
            ports = _ports(c)
            for mount in c.get("volumeMounts", ()):
                vol = volumes.get(mount["name"])
                if vol is None:
                    problems.append(f"{name}: mount of undeclared volume {mount['name']}")
                elif "configMap" in vol and mount.get("subPath") and not vol["configMap"].get(
                        "items") and mount["subPath"] not in config_maps.get(
                            vol["configMap"]["name"], {}):
                    problems.append(f"{name}: subPath {mount['subPath']} is no key of "
                                    f"ConfigMap {vol['configMap']['name']}")
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = c.get(kind)
                if probe is None:
                    if kind != "startupProbe":
                        problems.append(f"{name}: no {kind}")
                    continue
                if probe["httpGet"]["port"] not in ports:
                    problems.append(f"{name}: {kind} port {probe['httpGet']['port']} is no "
                                    f"container port")
            res = c.get("resources", {})
            for section in ("requests", "limits"):
                for r in ("cpu", "memory"):
                    if r not in res.get(section, {}):
                        problems.append(f"{name}: no resources.{section}.{r}")
            env = {e["name"]: e.get("value") for e in c.get("env", ())}
            text = _config_text(objects, pod, c, problems)
            if text is None:
                continue
            cmd = c.get("command", [])
            try:
                cfg = weir_toml.load(text, "serve" if cmd[:2] == ["weir", "serve"] else "route")
            except Exception as exc:        # noqa: BLE001 - reported as a problem
                problems.append(f"{name}: its config does not load: {exc}")
                continue
            if cfg.gateway.host != "0.0.0.0" or ports.get("http") != cfg.gateway.port:
                problems.append(f"{name}: the gateway is not on the http port of the pod")
            for probe in ("livenessProbe", "readinessProbe"):
                if c.get(probe) and ports.get(c[probe]["httpGet"]["port"]) != cfg.gateway.port:
                    problems.append(f"{name}: {probe} is not on the gateway's port")
            if weir_toml.endpoint_port(cfg.topology.client_endpoint) != ports.get("zmq"):
                problems.append(f"{name}: client_endpoint is not on the zmq port")
            keys_dir = cfg.security.curve_keys_dir
            if cfg.security.curve and not any(m["mountPath"] == keys_dir
                                              for m in c.get("volumeMounts", ())):
                problems.append(f"{name}: curve_keys_dir {keys_dir} is not mounted")
            if env.get("WEIR_CURVE_KEYS_DIR") != keys_dir:
                problems.append(f"{name}: WEIR_CURVE_KEYS_DIR is not the config's keys dir")
            secrets = {v["secret"]["secretName"] for v in volumes.values() if "secret" in v}
            service_key = next((e.get("valueFrom", {}).get("secretKeyRef", {})
                                for e in c.get("env", ()) if e["name"] == "WEIR_SERVICE_KEY"), {})
            if service_key.get("name") not in secrets or service_key.get("key") != "service.key":
                problems.append(f"{name}: WEIR_SERVICE_KEY is not the keys Secret's service.key")
            operator_key = next((e.get("valueFrom", {}).get("secretKeyRef", {})
                                 for e in c.get("env", ()) if e["name"] == "WEIR_OPERATOR_KEY"),
                                {})
            if operator_key.get("name") not in secrets or \
                    operator_key.get("key") != "operator.key":
                problems.append(f"{name}: WEIR_OPERATOR_KEY is not the keys Secret's "
                                f"operator.key")
            if cfg.telemetry.exporter != "otlp" or not env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
                problems.append(f"{name}: traces go nowhere (exporter, "
                                f"OTEL_EXPORTER_OTLP_ENDPOINT)")
            gpus = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
            if (cfg.engine.device == "cuda") != (gpus > 0):
                problems.append(f"{name}: engine.device {cfg.engine.device} with {gpus} GPUs")
            cpu_limit = res.get("limits", {}).get("cpu")
            if cmd[:2] == ["weir", "serve"]:
                if cpu_limit and not 0 < cfg.engine.num_threads <= _cpu(cpu_limit):
                    problems.append(f"{name}: engine.num_threads {cfg.engine.num_threads} "
                                    f"does not fit the CPU limit {cpu_limit}")
                events = cfg.topology.kv_events_endpoint
                if not events or weir_toml.endpoint_port(events) != ports.get("kv-events"):
                    problems.append(f"{name}: kv_events_endpoint is not on the kv-events port")
                if "--endpoint" in cmd and cmd[cmd.index("--endpoint") + 1] != \
                        cfg.topology.client_endpoint:
                    problems.append(f"{name}: --endpoint differs from the config's")
                # the run directory (request log, config history) on a writable volume
                # that outlives the container: not the container's own /tmp
                run_dir = cmd[cmd.index("--run-dir") + 1] if "--run-dir" in cmd else ""
                claims = {t["metadata"]["name"]
                          for t in wl["spec"].get("volumeClaimTemplates", ())}
                if not any(m["mountPath"] == run_dir and not m.get("readOnly")
                           and (m["name"] in claims or any(
                               k in volumes.get(m["name"], {})
                               for k in ("emptyDir", "persistentVolumeClaim")))
                           for m in c.get("volumeMounts", ())):
                    problems.append(f"{name}: the run directory is not on a writable volume "
                                    f"of its own")
                replicas.append((wl, cfg))
            elif cmd[:2] == ["weir", "route"]:
                routers.append(cfg)
                history = Path(cfg.router.config_history)
                if not cfg.router.config_history or not any(
                        m["mountPath"] == str(history.parent)
                        and not m.get("readOnly") for m in c.get("volumeMounts", ())):
                    problems.append(f"{name}: router.config_history is not on a writable "
                                    f"volume of its own")
            else:
                problems.append(f"{name}: runs neither weir serve nor weir route: {cmd}")

    # Services: each selects the pods of exactly one workload, on ports those pods have
    services = by_kind(objects, "Service")
    for svc in services:
        sel = svc["spec"].get("selector", {})
        matched = [wl for wl in workloads
                   if sel and sel.items() <= wl["spec"]["template"]["metadata"]["labels"].items()]
        if len(matched) != 1:
            problems.append(f"Service/{svc['metadata']['name']} selects {len(matched)} workloads")
            continue
        ports = _ports(matched[0]["spec"]["template"]["spec"]["containers"][0])
        for p in svc["spec"]["ports"]:
            if p.get("targetPort", p["port"]) not in ports:
                problems.append(f"Service/{svc['metadata']['name']}: targetPort "
                                f"{p.get('targetPort')} is no container port")

    # The router's replicas: found by resolving a replica StatefulSet's headless Service
    # (which publishes pods not yet ready: the router judges them by heartbeats), on the
    # ports those pods serve; or, listed, exactly the StatefulSet's pods by their DNS names
    # through that Service; same model and block size
    if not routers or not replicas:
        problems.append(f"{len(routers)} routers, {len(replicas)} replica workloads")
    expected = {}
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h
            for h in by_kind(objects, "HorizontalPodAutoscaler")
            if h["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"}
    headlesses: dict = {}                # headless Service name -> (it, ports, config)
    for wl, cfg in replicas:
        hpa = hpas.get(wl["metadata"]["name"])
        if hpa is not None and "replicas" in wl["spec"]:
            problems.append(f"StatefulSet {wl['metadata']['name']}: a replica count beside "
                            f"the HPA that owns it")
        if wl["kind"] != "StatefulSet":
            problems.append(f"{wl['kind']}/{wl['metadata']['name']}: replicas need stable "
                            f"names: a StatefulSet")
            continue
        svc_name = wl["spec"]["serviceName"]
        headless = [s for s in services if s["metadata"]["name"] == svc_name
                    and s["spec"].get("clusterIP") == "None"]
        if not headless:
            problems.append(f"StatefulSet {wl['metadata']['name']}: no headless Service "
                            f"{svc_name}")
            continue
        svc_ports = {p["port"] for p in headless[0]["spec"]["ports"]}
        zmq = weir_toml.endpoint_port(cfg.topology.client_endpoint)
        events = weir_toml.endpoint_port(cfg.topology.kv_events_endpoint)
        if not {zmq, events} <= svc_ports:
            problems.append(f"Service/{svc_name} does not expose ports {zmq} and {events}")
        # the pods it may run: the count, or up to the HPA's maxReplicas
        count = hpa["spec"]["maxReplicas"] if hpa is not None else wl["spec"].get("replicas", 1)
        for i in range(count):
            host = f"{wl['metadata']['name']}-{i}.{svc_name}"
            expected[host] = (zmq, events, cfg)
        headlesses[svc_name] = (headless[0], zmq, events, cfg)
    for cfg in routers:
        rc = cfg.router
        names = ([rc.discovery_name] if rc.discovery_name else []) + sorted(
            rc.discovery_pools.values())
        for dns_name in names if rc.discovery == "dns" else []:     # one per replica pool
            found = headlesses.get(dns_name.split(".")[0])
            if found is None:
                problems.append(f"router: discovery_name {dns_name} is no headless "
                                f"Service of a replica StatefulSet")
                continue
            svc, zmq, events, rcfg = found
            if not svc["spec"].get("publishNotReadyAddresses"):
                problems.append(f"Service/{svc['metadata']['name']}: the router finds pods "
                                f"through it: publishNotReadyAddresses must be true")
            if (rc.discovery_port, rc.discovery_kv_events_port) != (zmq, events):
                problems.append("router: discovery ports differ from what the replicas serve")
            if (rcfg.engine.model, rcfg.kv.block_size, rcfg.engine.max_model_len) != \
                    (cfg.engine.model, cfg.kv.block_size, cfg.engine.max_model_len):
                problems.append("router: engine.model / kv.block_size / max_model_len "
                                "differ from the discovered replicas'")
        if rc.discovery == "dns":
            continue
        listed = {}
        for rep in cfg.router.replicas:
            host = weir_toml.endpoint_host(rep.endpoint)
            listed[host] = rep
            if weir_toml.endpoint_host(rep.kv_events) != host:
                problems.append(f"router: {rep.name}'s kv_events is another host")
            if host not in expected:
                problems.append(f"router: replica {rep.name} at {host} is no pod of a "
                                f"replica StatefulSet")
                continue
            zmq, events, rcfg = expected[host]
            if (weir_toml.endpoint_port(rep.endpoint),
                    weir_toml.endpoint_port(rep.kv_events)) != (zmq, events):
                problems.append(f"router: replica {rep.name} on other ports than it serves")
            if (rcfg.engine.model, rcfg.kv.block_size, rcfg.engine.max_model_len) != \
                    (cfg.engine.model, cfg.kv.block_size, cfg.engine.max_model_len):
                problems.append(f"router: engine.model / kv.block_size / max_model_len "
                                f"differ from {rep.name}'s")
        for host in sorted(set(expected) - set(listed)):
            problems.append(f"router: replica pod {host} is not in its list")
    return problems


def test_objects_agree(rendered):
    name, objects = rendered
    assert consistency_problems(objects) == [], name


def weir_config(objects: list[dict]) -> dict:
    (cm,) = [c for c in by_kind(objects, "ConfigMap")
             if c["metadata"]["name"].startswith("weir-config")]
    return cm


def _router_toml(objects: list[dict]) -> tuple[dict, str]:
    cm = weir_config(objects)
    return cm, cm["data"]["router.toml"]


STATIC_REPLICAS = "".join(
    f'\n[[router.replicas]]\nname = "weir-replica-{i}"\n'
    f'endpoint = "tcp://weir-replica-{i}.weir-replica:7450"\n'
    f'kv_events = "tcp://weir-replica-{i}.weir-replica:7470"\n' for i in range(2))


def _static(router_toml: str) -> str:
    """The router's config with the StatefulSet's two pods listed instead of discovered."""
    lines = [line for line in router_toml.splitlines() if not line.startswith("discovery")]
    return "\n".join(lines) + STATIC_REPLICAS


def test_the_router_discovers_the_replicas_and_scaling_needs_no_change_to_it():
    objects = render(K8S / "base")
    router = weir_toml.load(_router_toml(objects)[1], "route").router
    assert (router.discovery, router.discovery_name, router.replicas) == (
        "dns", "weir-replica", ())
    one(objects, "StatefulSet", "weir-replica")["spec"]["replicas"] = 5
    assert consistency_problems(objects) == []
    cm, router_toml = _router_toml(objects)          # a listed router: exactly the pods
    cm["data"]["router.toml"] = _static(router_toml)
    assert any("weir-replica-4.weir-replica is not in its list" in p
               for p in consistency_problems(objects))


@pytest.mark.parametrize("breakage,reported", [
    ("extra_replica", "at weir-replica-2.weir-replica is no pod"),
    ("scaled_up", "weir-replica-2.weir-replica is not in its list"),
    ("discovery_name", "discovery_name weir-replicas is no headless Service"),
    ("discovery_port", "discovery ports differ"),
    ("not_ready_hidden", "publishNotReadyAddresses must be true"),
    ("selector", "Service/weir-router selects 0 workloads"),
    ("probe_port", "readinessProbe port metrics is no container port"),
    ("config_key", "subPath weir.toml is no key"),
    ("model", "engine.model / kv.block_size / max_model_len differ"),
    ("kv_port", "on other ports than it serves"),
    ("operator_key", "WEIR_OPERATOR_KEY is not the keys Secret's operator.key"),
    ("history_volume", "router.config_history is not on a writable volume"),
    ("run_dir_flag", "the run directory is not on a writable volume"),
    ("run_dir_volume", "the run directory is not on a writable volume"),
])
def test_consistency_check_catches_breakage(breakage, reported):
    objects = copy.deepcopy(render(K8S / "base"))
    sts = one(objects, "StatefulSet", "weir-replica")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    cm, router_toml = _router_toml(objects)
    if breakage == "extra_replica":      # a listed router names a pod that does not exist
        cm["data"]["router.toml"] = _static(router_toml) + (
            '\n[[router.replicas]]\nname = "weir-replica-2"\n'
            'endpoint = "tcp://weir-replica-2.weir-replica:7450"\n'
            'kv_events = "tcp://weir-replica-2.weir-replica:7470"\n')
    elif breakage == "scaled_up":        # a pod a listed router does not know
        cm["data"]["router.toml"] = _static(router_toml)
        sts["spec"]["replicas"] = 3
    elif breakage == "discovery_name":
        cm["data"]["router.toml"] = router_toml.replace('"weir-replica"', '"weir-replicas"')
    elif breakage == "discovery_port":
        cm["data"]["router.toml"] = router_toml.replace("discovery_port = 7450",
                                                        "discovery_port = 7451")
    elif breakage == "not_ready_hidden":
        one(objects, "Service", "weir-replica")["spec"]["publishNotReadyAddresses"] = False
    elif breakage == "selector":
        selector = one(objects, "Service", "weir-router")["spec"]["selector"]
        selector["app.kubernetes.io/component"] = "gateway"
    elif breakage == "probe_port":
        container["readinessProbe"]["httpGet"]["port"] = "metrics"
    elif breakage == "config_key":
        container["volumeMounts"][0]["subPath"] = "weir.toml"
    elif breakage == "model":
        cm["data"]["router.toml"] = router_toml.replace("SmolLM2-135M-Instruct.Q4_1.gguf",
                                                        "other.gguf", 1)
    elif breakage == "kv_port":
        cm["data"]["router.toml"] = _static(router_toml).replace(":7470", ":7469", 1)
    elif breakage == "operator_key":
        container["env"] = [e for e in container["env"] if e["name"] != "WEIR_OPERATOR_KEY"]
    elif breakage == "history_volume":
        cm["data"]["router.toml"] = router_toml.replace("/var/lib/weir/", "/tmp/weir/")
    elif breakage == "run_dir_flag":      # `weir serve` makes one in the container's /tmp
        i = container["command"].index("--run-dir")
        del container["command"][i:i + 2]
    elif breakage == "run_dir_volume":
        container["volumeMounts"] = [m for m in container["volumeMounts"]
                                     if m["mountPath"] != "/var/lib/weir"]
    problems = consistency_problems(objects)
    assert any(reported in p for p in problems), problems


# -- what each variant runs


def test_configs_match_between_router_and_replicas(rendered):
    name, objects = rendered
    data = weir_config(objects)["data"]
    assert set(data) == {"replica.toml", "router.toml"}
    replica = weir_toml.load(data["replica.toml"], "serve")
    router = weir_toml.load(data["router.toml"], "route")
    assert replica.engine.model == router.engine.model
    assert replica.kv.block_size == router.kv.block_size
    assert router.router.policy == "cache_aware"
    assert replica.security.curve and router.security.curve
    # the replicas run the SLO-first defaults (deadline admission, SLO_CLASSES)
    assert replica.admission.policy == "deadline" and replica.admission.classes == SLO_CLASSES
    if name == "overlays/gpu":
        assert (replica.engine.device, replica.engine.dtype) == ("cuda", "bfloat16")
    else:
        assert replica.engine.device != "cuda"


def test_gpu_overlay_puts_only_replicas_on_gpus():
    objects = render(K8S / "overlays" / "gpu")
    base = render(K8S / "base")
    pod = one(objects, "StatefulSet", "weir-replica")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    # the rest of the container is the base's (the patch merged by name, replaced nothing)
    base_container = one(base, "StatefulSet", "weir-replica")["spec"]["template"]["spec"][
        "containers"][0]
    assert {k: v for k, v in container.items() if k not in ("image", "resources")} == \
        {k: v for k, v in base_container.items() if k not in ("image", "resources")}
    router = one(objects, "Deployment", "weir-router")
    assert "nvidia.com/gpu" not in yaml.safe_dump(router)
    base_router = copy.deepcopy(one(base, "Deployment", "weir-router"))
    (volume,) = [v for v in base_router["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    volume["configMap"]["name"] = by_kind(objects, "ConfigMap")[0]["metadata"]["name"]
    assert router["spec"] == base_router["spec"]
    # the router's config is the base's; the replicas' config changed, so did its name
    gpu_cm, base_cm = by_kind(objects, "ConfigMap")[0], by_kind(base, "ConfigMap")[0]
    assert gpu_cm["data"]["router.toml"] == base_cm["data"]["router.toml"]
    assert gpu_cm["metadata"]["name"] != base_cm["metadata"]["name"]


def test_cpu_overlay_is_the_base():
    assert render(K8S / "overlays" / "cpu") == render(K8S / "base")


def test_keys_secret_holds_what_weir_keys_generate_writes(tmp_path):
    """The pods mount the Secret `kubectl create secret generic weir-curve-keys
    --from-file=DIR` makes of `weir keys generate DIR` (its plain files; the client key is
    mapped into authorized/ again), and Weir reads it as a keys directory."""
    from bus import curve
    from bus.identity import generate_service_key

    keys = curve.generate(tmp_path / "keys")
    generate_service_key(keys / "service.key")
    generate_service_key(keys / "operator.key")
    files = {p.name for p in keys.iterdir() if p.is_file()}
    if shutil.which("kubectl"):       # the Secret as docs/deploy.md makes it
        out = subprocess.run(["kubectl", "create", "secret", "generic", "weir-curve-keys",
                              f"--from-file={keys}", "--dry-run=client", "-o", "yaml"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        secret = yaml.safe_load(out.stdout)
        validate(secret)
        assert set(secret["data"]) == files
    objects = render(K8S / "base")
    for wl in (o for o in objects if o["kind"] in WORKLOADS):
        (vol,) = [v for v in wl["spec"]["template"]["spec"]["volumes"] if "secret" in v]
        items = vol["secret"]["items"]
        assert {i["key"] for i in items} == files, wl["metadata"]["name"]
        # lay the Secret out as the kubelet would, and load it the way Weir does
        mounted = tmp_path / wl["metadata"]["name"]
        for item in items:
            (mounted / item["path"]).parent.mkdir(parents=True, exist_ok=True)
            (mounted / item["path"]).write_bytes((keys / item["key"]).read_bytes())
        loaded = curve.load(mounted)
        assert loaded.authorized is not None and any(loaded.authorized.glob("*.key"))


def test_the_pool_canary_overlay_runs_two_pools_the_router_resolves_apart():
    """overlays/pool-canary: the base's StatefulSet is the pool "stable", a second one the
    pool "canary", each behind its own headless Service, whose selectors do not overlap
    (a pod in both would be found under both names); the router names one per pool."""
    objects = render(K8S / "overlays" / "pool-canary")
    router = weir_toml.load(_router_toml(objects)[1], "route").router
    assert router.discovery == "dns" and router.discovery_pools == {
        "stable": "weir-replica", "canary": "weir-replica-canary"}
    stable = one(objects, "StatefulSet", "weir-replica")
    canary = one(objects, "StatefulSet", "weir-replica-canary")
    assert canary["spec"]["replicas"] == 1
    for svc, own in (("weir-replica", stable), ("weir-replica-canary", canary)):
        sel = one(objects, "Service", svc)["spec"]["selector"]
        for sts in (stable, canary):
            labels = sts["spec"]["template"]["metadata"]["labels"]
            assert (sel.items() <= labels.items()) == (sts is own), (svc, sts["metadata"])
    # the same engine in both pools (the candidate is what differs, put on live)
    assert stable["spec"]["template"]["spec"] == canary["spec"]["template"]["spec"]
    broken = copy.deepcopy(objects)
    cm, router_toml = _router_toml(broken)
    cm["data"]["router.toml"] = router_toml.replace('"weir-replica-canary"', '"weir-canary"')
    assert any("discovery_name weir-canary is no headless Service" in p
               for p in consistency_problems(broken))
