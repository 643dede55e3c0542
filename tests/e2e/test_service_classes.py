"""Service classes through the whole engine (deadline admission): the class a client asks
for over the SDK, the CLI and HTTP, the class a tenant may not have (class_not_allowed),
the tenant's default, and a degrade (a tenant whose KV budget is smaller than a request's
whole horizon) as the SDK's Completion and the gateway's headers and usage report it."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import free_port
from tests.e2e.engine import ROOT, Engine
from weir.errors import RequestRejected

DEFAULT_KEY, TIGHT_KEY = "sk-classes-default", "sk-classes-tight"

# kv_safety = 0 keeps the degrade arithmetic exact: a 10-token prompt asking for 64 tokens
# needs ceil(74 / 16) = 5 blocks; tenant "tight" may reserve 3, so admission lowers
# max_tokens to 3 * 16 - 10 = 38.
CONFIG = """
[kv]
num_blocks = 256
[engine]
max_model_len = 1024
[admission]
policy = "deadline"
kv_safety = 0.0
classes = [
  { name = "interactive", priority = 0, ttft_slo_ms = 5000, max_queue_ms = 2000 },
  { name = "batch", priority = 10, max_queue_ms = 60000, may_degrade = true, min_max_tokens = 4 },
]
tenants = [
  { name = "default", classes = ["interactive", "batch"] },
  { name = "bulk", classes = ["batch"] },
  { name = "tight", classes = ["batch"], kv_blocks = 3 },
]
"""
PROMPT_IDS = list(range(1000, 1010))        # 10 tokens: no full block, so nothing cached
DEGRADED_TO = 38


def _key(key: str, tenant: str) -> str:
    return f'{{ sha256 = "{hashlib.sha256(key.encode()).hexdigest()}", tenant = "{tenant}" }}'


@pytest.fixture(scope="module")
def eng(tmp_path_factory, model_path):
    e = Engine(tmp_path_factory.mktemp("classes"), CONFIG, http_port=free_port(),
               gateway_extra=f"api_keys = [{_key(DEFAULT_KEY, 'default')}, "
                             f"{_key(TIGHT_KEY, 'tight')}]\n")
    yield e
    e.stop()


def _auth(key: str, service_class: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    if service_class is not None:
        headers["x-weir-class"] = service_class
    return headers


def _released(eng: Engine) -> None:
    """Admission has released every request (tenant tight's budget is whole again)."""
    eng.wait_stat("admission", "outstanding", 0, timeout=5.0)


def test_sdk_class_default_lower_and_refused(eng):
    with eng.client() as c:
        default = c.generate("The sky is", max_tokens=4, temperature=0)
        batch = c.generate("The sky is", max_tokens=4, temperature=0, service_class="batch")
        bulk = c.generate("The sky is", max_tokens=4, temperature=0, tenant="bulk")
        with pytest.raises(RequestRejected) as up:
            c.generate("The sky is", max_tokens=4, tenant="bulk", service_class="interactive")
        with pytest.raises(RequestRejected) as unknown:
            c.generate("The sky is", max_tokens=4, service_class="gold")
    assert (default.service_class, batch.service_class, bulk.service_class) == (
        "interactive", "batch", "batch")
    for done in (default, batch, bulk):
        assert not done.degraded and done.max_tokens == 4 and done.queued_s >= 0.0
    assert batch.to_dict()["service_class"] == "batch"
    assert {"degraded", "max_tokens", "queued_s"} <= set(batch.to_dict())
    assert up.value.reason == unknown.value.reason == "class_not_allowed"
    assert "interactive" in up.value.message and "gold" in unknown.value.message
    _released(eng)


def test_sdk_degrade_lowers_max_tokens_and_says_so(eng):
    _released(eng)
    with eng.client() as c:
        done = c.generate(prompt_token_ids=PROMPT_IDS, max_tokens=64, tenant="tight",
                          ignore_eos=True, temperature=0)
    assert (done.service_class, done.degraded, done.max_tokens) == ("batch", True, DEGRADED_TO)
    assert done.usage.completion_tokens == DEGRADED_TO and done.finish_reason == "length"
    _released(eng)


def test_http_class_header_body_and_refusal(eng):
    url = eng.base_url + "/v1/completions"
    with httpx.Client(timeout=60) as http:
        plain = http.post(url, headers=_auth(DEFAULT_KEY),
                          json={"prompt": "The sky is", "max_tokens": 3})
        header = http.post(url, headers=_auth(DEFAULT_KEY, "batch"),
                           json={"prompt": "The sky is", "max_tokens": 3})
        body_wins = http.post(eng.base_url + "/v1/chat/completions",
                              headers=_auth(DEFAULT_KEY, "interactive"),
                              json={"messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 3, "service_class": "batch"})
        refused = http.post(url, headers=_auth(DEFAULT_KEY, "gold"),
                            json={"prompt": "The sky is", "max_tokens": 3})
    assert plain.status_code == header.status_code == body_wins.status_code == 200
    assert plain.json()["usage"]["weir"]["service_class"] == "interactive"
    weir = header.json()["usage"]["weir"]
    assert weir["service_class"] == "batch" and weir["degraded"] is False
    assert weir["max_tokens"] == 3 and weir["queued_ms"] >= 0.0
    assert "x-weir-degraded" not in header.headers
    assert body_wins.json()["usage"]["weir"]["service_class"] == "batch"
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "class_not_allowed"
    _released(eng)


def test_http_degraded_stream_has_headers_and_usage(eng):
    _released(eng)
    body = {"prompt": PROMPT_IDS, "max_tokens": 64, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", eng.base_url + "/v1/completions", json=body,
                         headers=_auth(TIGHT_KEY, "batch")) as r:
            assert r.status_code == 200
            headers = dict(r.headers)
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert headers["x-weir-degraded"] == "true"
    assert headers["x-weir-max-tokens"] == str(DEGRADED_TO)
    usage = json.loads(lines[-1][6:])["usage"]
    assert usage["completion_tokens"] == DEGRADED_TO
    assert usage["weir"]["service_class"] == "batch" and usage["weir"]["degraded"] is True
    assert usage["weir"]["max_tokens"] == DEGRADED_TO
    _released(eng)


def test_cli_generate_class_flag(eng):
    env = dict(os.environ, PYTHONPATH=str(ROOT), WEIR_API_KEY=eng.service_key)
    out = subprocess.run(
        [sys.executable, "-m", "weir.cli", "generate", "The sky is", "--class", "batch",
         "--max-tokens", "3", "--temperature", "0", "--json", "--endpoint", eng.endpoint,
         "--logprobs", "2", "--repetition-penalty", "1.1", "--prompt-logprobs", "1",
         "--min-tokens", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["service_class"] == "batch" and result["degraded"] is False
    assert result["max_tokens"] == 3
    lps = result["logprobs"]                  # one per token, each with its top two
    assert [e["token_id"] for e in lps] == result["token_ids"]
    assert all(len(e["top"]) == 2 and e["logprob"] <= 0 for e in lps)
    prompt = result["prompt"]                 # the prompt's tokens after the first, named
    assert prompt["text"] == "The sky is" and len(result["token_ids"]) == 3
    assert [e["token_id"] for e in prompt["logprobs"]] == prompt["token_ids"][1:]
