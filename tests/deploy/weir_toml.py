"""Load the deployment's Weir configs (deploy/router/*.toml, the k8s ConfigMap's) as the
command that runs them does: Weir's own loader, with the overrides ``weir serve`` and
``weir route`` apply (weir/cli.py). Either raises ConfigError on a bad field."""
from __future__ import annotations

import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from schemas.config import WeirConfig, load_config

RUN_DIR = "/tmp/weir-run"     # both commands make a run directory for their ipc sockets


def load(text: str, command: str) -> WeirConfig:
    """The config ``weir <command> --config FILE`` runs, FILE holding ``text``."""
    overrides = {"serve": {"topology": {"run_dir": RUN_DIR}},
                 "route": {"topology": {"run_dir": RUN_DIR, "transport": "ipc"}}}[command]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weir.toml"
        path.write_text(text)
        cfg = load_config(path, **overrides)
    if command == "route":
        assert cfg.router.replicas or cfg.router.discovery != "static", \
            "weir route refuses a config without replicas or discovery"
    return cfg


def endpoint_port(endpoint: str) -> int:
    """The port of a ``tcp://host:port`` address (AssertionError otherwise)."""
    parts = urlsplit(endpoint)
    assert parts.scheme == "tcp" and parts.hostname and parts.port, endpoint
    return parts.port


def endpoint_host(endpoint: str) -> str:
    endpoint_port(endpoint)
    return urlsplit(endpoint).hostname
