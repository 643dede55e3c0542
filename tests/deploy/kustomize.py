"""Render a kustomization of deploy/k8s without a cluster.

``render(dir)`` runs ``kubectl kustomize`` where kubectl is installed, else ``render_py``:
a small renderer of the kustomize features deploy/k8s uses (resources, a configMapGenerator
with files and ``behavior: merge``, the name hash suffix and its references, strategic
merge patches by ``path``). Anything else in a kustomization raises, so that a feature
added to the manifests is never silently rendered wrong; where kubectl is there, a test
checks that both renderers agree.
"""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "configMapGenerator", "patches"}
# strategic merge: lists of these fields merge item by item on the key (Kubernetes'
# patchMergeKey); any other list in a patch replaces the target's
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort",
              "imagePullSecrets": "name"}


def render(path: str | Path) -> list[dict]:
    if shutil.which("kubectl"):
        return render_kubectl(path)
    return render_py(path)


def render_kubectl(path: str | Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {path}: {out.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def render_py(path: str | Path) -> list[dict]:
    objects, generated = _build(Path(path))
    renames = {}
    for name, cm in generated.items():
        cm["metadata"]["name"] = renames[name] = f"{name}-{config_map_hash(cm)}"
    for obj in objects:
        _rename_config_maps(obj, renames)
    return objects


def config_map_hash(cm: dict) -> str:
    """kustomize's name suffix: sha256 of the ConfigMap's JSON as Go encodes it (sorted
    keys, HTML characters escaped), 10 hex digits with 0, 1, 3, a, e replaced by letters
    (no vowels, no confusable digits). kustomize looks the name up by a path its lookup
    does not split, so the name in the hashed JSON is always empty."""
    m = {"kind": "ConfigMap", "name": "", "data": cm.get("data", {})}
    if cm.get("binaryData"):
        m["binaryData"] = cm["binaryData"]
    text = json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _build(root: Path) -> tuple[list[dict], dict[str, dict]]:
    """The objects of one kustomization and, by name, the ConfigMaps it generated (not yet
    hash-suffixed: an overlay may still merge into them)."""
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise NotImplementedError(f"{root}: render_py does not implement {sorted(unknown)}")
    objects: list[dict] = []
    generated: dict[str, dict] = {}
    for res in spec.get("resources", ()):
        path = root / res
        if path.is_dir():
            sub_objects, sub_generated = _build(path)
            objects += sub_objects
            generated.update(sub_generated)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for gen in spec.get("configMapGenerator", ()):
        extra = set(gen) - {"name", "files", "behavior"}
        if extra:
            raise NotImplementedError(f"{root}: configMapGenerator {sorted(extra)}")
        data = {}
        for entry in gen.get("files", ()):
            key, _, file = entry.partition("=") if "=" in entry else (None, "", entry)
            data[key or Path(file).name] = (root / file).read_text()
        behavior = gen.get("behavior", "create")
        name = gen["name"]
        if behavior == "create":
            if name in generated:
                raise ValueError(f"{root}: ConfigMap {name} generated twice")
            cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                  "data": data}
            generated[name] = cm
            objects.append(cm)
        elif behavior in ("merge", "replace"):
            cm = generated[name]
            cm["data"] = {**cm["data"], **data} if behavior == "merge" else data
        else:
            raise NotImplementedError(f"{root}: configMapGenerator behavior {behavior}")
    for patch in spec.get("patches", ()):
        if set(patch) != {"path"}:
            raise NotImplementedError(f"{root}: patches other than by path: {patch}")
        body = yaml.safe_load((root / patch["path"]).read_text())
        targets = [o for o in objects if o["kind"] == body["kind"]
                   and o["metadata"]["name"] == body["metadata"]["name"]]
        if len(targets) != 1:
            raise ValueError(f"{root}: patch {patch['path']} matches {len(targets)} objects")
        merged = strategic_merge(targets[0], body)
        targets[0].clear()
        targets[0].update(merged)
    return objects, generated


def strategic_merge(target, patch, field: str = ""):
    """Merge ``patch`` into ``target``: maps key by key, lists of MERGE_KEYS item by item,
    other values replaced, a null value deleting the field. Patch directives ($patch,
    $setElementOrder, ...) are not implemented and raise."""
    if isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise NotImplementedError(f"strategic merge directive in {field}: {list(patch)}")
        if not isinstance(target, dict):
            return copy.deepcopy(patch)
        out = dict(target)
        for key, value in patch.items():
            if value is None:            # a null deletes the field (kustomize does too)
                out.pop(key, None)
                continue
            out[key] = (strategic_merge(target[key], value, key) if key in target
                        else copy.deepcopy(value))
        return out
    if isinstance(patch, list) and field in MERGE_KEYS and isinstance(target, list):
        key = MERGE_KEYS[field]
        out = list(target)
        for item in patch:
            index = next((i for i, t in enumerate(out) if t.get(key) == item.get(key)), None)
            if index is None:
                out.append(copy.deepcopy(item))
            else:
                out[index] = strategic_merge(out[index], item, field)
        return out
    return copy.deepcopy(patch)


def _rename_config_maps(obj: dict, renames: dict[str, str]) -> None:
    """Point a pod template's ConfigMap references (volumes, envFrom, env) at the
    hash-suffixed names."""
    pod = obj.get("spec", {}).get("template", {}).get("spec")
    if pod is None:
        return
    for vol in pod.get("volumes", ()):
        if "configMap" in vol:
            vol["configMap"]["name"] = renames.get(vol["configMap"]["name"],
                                                   vol["configMap"]["name"])
        for source in vol.get("projected", {}).get("sources", ()):
            if "configMap" in source:
                source["configMap"]["name"] = renames.get(source["configMap"]["name"],
                                                          source["configMap"]["name"])
    for container in (*pod.get("initContainers", ()), *pod.get("containers", ())):
        for ref in container.get("envFrom", ()):
            if "configMapRef" in ref:
                ref["configMapRef"]["name"] = renames.get(ref["configMapRef"]["name"],
                                                          ref["configMapRef"]["name"])
        for env in container.get("env", ()):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                ref["name"] = renames.get(ref["name"], ref["name"])
