"""The gateway's HTTP limits against a real uvicorn server on a socket, over a fake engine:
body size (413), read timeouts (408 / closed), header size (431), Content-Type (415),
malformed JSON (400, never 500), and /metrics credentials."""
from __future__ import annotations

import hashlib
import json
import time
import types

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from schemas.client import TenantUsage
from tests.components.gateway.fakes import FakeClient, serve

pytestmark = pytest.mark.anyio

JSON = {"content-type": "application/json"}
OK_BODY = b'{"prompt": "hi", "max_tokens": 2}'


async def raw(port: int, data: bytes, wait_s: float = 5.0, then: bytes = b"") -> bytes:
    """Send ``data`` (and ``then``), read until the server closes or ``wait_s`` passes."""
    out = b""
    async with await anyio.connect_tcp("127.0.0.1", port) as conn:
        await conn.send(data)
        if then:
            await conn.send(then)
        with anyio.move_on_after(wait_s):
            try:
                while True:
                    out += await conn.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                pass
    return out


def post_head(length: int | str, extra: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


async def test_content_length_over_the_limit_is_413_before_any_body():
    client = FakeClient()
    async with serve(client, max_body_bytes=64 << 10) as gw:
        t = time.monotonic()
        reply = await raw(gw.port, post_head(20 << 20))           # 20 MB announced, none sent
        assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()
        assert b'"code":"request_too_large"' in reply and time.monotonic() - t < 2
    assert client.submitted == []


async def test_streamed_body_over_the_limit_is_413():
    async with serve(FakeClient(), max_body_bytes=64 << 10) as gw:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (16 << 10, b" " * (16 << 10))
        reply = await raw(gw.port, head + chunk * 5)              # 80 KiB, never terminated
        assert reply.startswith(b"HTTP/1.1 413")


async def test_a_body_that_never_arrives_gets_408():
    async with serve(FakeClient(), read_timeout_s=0.5) as gw:
        t = time.monotonic()
        reply = await raw(gw.port, post_head(999999) + b'{"prompt": ', wait_s=5)
        assert reply.startswith(b"HTTP/1.1 408") and 0.4 < time.monotonic() - t < 3
        assert b'"code":"request_timeout"' in reply


async def test_half_sent_requests_are_closed_after_the_read_timeout():
    """300 connections that never finish their headers (and some that send nothing) are
    all closed after read_timeout_s; meanwhile and after, the gateway serves."""
    async with serve(FakeClient(), read_timeout_s=1.0) as gw:
        conns = []
        for i in range(300):
            conn = await anyio.connect_tcp("127.0.0.1", gw.port)
            if i % 10:
                await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            conns.append(conn)
        async with httpx.AsyncClient() as http:
            assert (await http.get(gw.url + "/health")).status_code == 200
        t = time.monotonic()
        replies = []
        for conn in conns:
            data = b""
            with anyio.fail_after(5):
                try:
                    while True:
                        data += await conn.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                    pass
            replies.append(data)
            await conn.aclose()
        assert time.monotonic() - t < 4
        assert sum(r.startswith(b"HTTP/1.1 408") for r in replies) == 270
        assert sum(r == b"" for r in replies) == 30                 # idle ones: just closed
        async with httpx.AsyncClient() as http:
            r = await http.post(gw.url + "/v1/completions", content=OK_BODY, headers=JSON)
            assert r.status_code == 200


async def test_oversized_headers_get_431():
    async with serve(FakeClient()) as gw:
        reply = await raw(gw.port, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                          + b"X-Big: " + b"a" * (100 << 10) + b"\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 431")


@pytest.mark.parametrize("content_type, status", [
    (None, 415), ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("application/json; charset=latin-1", 415), ("application/jsonx", 415),
    ("application/json", 200), ("Application/JSON; charset=UTF-8", 200),
    ("application/json;charset=\"utf-8\"", 200),
])
async def test_content_type_must_be_json(content_type, status):
    async with serve(FakeClient()) as gw, httpx.AsyncClient() as http:
        headers = {} if content_type is None else {"content-type": content_type}
        r = await http.post(gw.url + "/v1/completions", content=OK_BODY, headers=headers)
        assert r.status_code == status, r.text
        if status == 415:
            assert r.json()["error"]["code"] == "unsupported_media_type"


DEEP = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
BAD = [
    DEEP,                                                             # was a 500
    b'{"messages": [], "tools": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    b'{"prompt": "x", "seed": 1' + b"0" * 30 + b"}",                  # past 64 bits: was a 500
    b'{"prompt": "x", "top_k": 9223372036854775808}',                 # 2^63: failed a step
    b'{"prompt": [1, 2, 1' + b"0" * 30 + b"]}",
    b'{"prompt": "x", "stop_token_ids": [1' + b"0" * 25 + b"]}",
    b'{"prompt": "x", "priority": 1' + b"0" * 25 + b"}",
    b'{"prompt": "x", "n": 1' + b"0" * 25 + b"}",
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 25 + b"}",
    b'{"prompt": "x", "max_tokens": 2048}',
    b'{"prompt": "x", "temperature": 1e999}',
    b'{"prompt": "\xff\xfe"}',                                        # invalid UTF-8
    b'{"prompt": "\\ud800"}',                                         # lone surrogate
    b'{"prompt": {"a": 1}}', b'{"prompt": "x", "n": "two"}', b'{"prompt": "x", "stop": 5}',
    b'{"prompt": "x", "logit_bias": {"abc": 1}}', b'{"prompt": "x", "logit_bias": {"5": 1e9}}',
    b'{"prompt": "x", "stop": ["' + b"s" * 300 + b'"]}',
    b'{"prompt": "' + b"x" * 70000 + b'"}',                          # > max_model_len * 32 chars
    b"[]", b"null", b"", b"\x00" * 10, b'{"prompt": "x"',
]


@pytest.mark.parametrize("body", BAD, ids=range(len(BAD)))
async def test_malformed_requests_are_400_in_openai_shape(body):
    client = FakeClient()
    async with serve(client) as gw, httpx.AsyncClient() as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = await http.post(gw.url + path, content=body, headers=JSON)
            assert r.status_code == 400, (path, r.text[:300])
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert (await http.get(gw.url + "/health")).status_code == 200
    assert client.submitted == []


async def test_unsafe_request_ids_are_not_echoed():
    async with serve(FakeClient()) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/completions", content=OK_BODY,
                            headers={**JSON, "x-request-id": "ok-1"})
        assert r.headers["x-request-id"] == "ok-1"
        reply = await raw(gw.port, post_head(len(OK_BODY), "x-request-id: a\x7fb\r\n") + OK_BODY,
                          wait_s=1)
        assert reply.startswith(b"HTTP/1.1 200") or reply.startswith(b"HTTP/1.1 400")
        assert b"a\x7fb" not in reply


async def test_unknown_routes_and_methods_are_4xx_json():
    async with serve(FakeClient()) as gw, httpx.AsyncClient() as http:
        r = await http.get(gw.url + "/nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await http.get(gw.url + "/v1/completions")
        assert r.status_code == 405 and "error" in r.json()


def _series(text: str) -> dict[str, float]:
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_metrics_need_a_credential_when_keys_are_configured():
    stats = {"scheduler": {"running": 1}}
    usage = {"scheduler": {"acme": TenantUsage(0, 7, 3), "globex": TenantUsage(0, 9, 5)}}
    digest = lambda k: hashlib.sha256(k.encode()).hexdigest()
    keys = (types.SimpleNamespace(sha256=digest("sk-acme"), tenant="acme", role="tenant"),
            types.SimpleNamespace(sha256=digest("sk-globex"), tenant="globex", role="tenant"),
            types.SimpleNamespace(sha256=digest("sk-ops"), tenant="ops", role="operator"))
    async with serve(FakeClient(stats=stats, tenants=usage), keys=keys) as gw, \
            httpx.AsyncClient() as http:
        assert (await http.get(gw.url + "/metrics")).status_code == 401
        r = await http.get(gw.url + "/metrics", headers={"authorization": "Bearer sk-wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ops = _series((await http.get(gw.url + "/metrics",
                                      headers={"authorization": "Bearer sk-ops"})).text)
        acme = _series((await http.get(gw.url + "/metrics",
                                       headers={"authorization": "Bearer sk-acme"})).text)
        tenants = lambda series: {k for k in series if '"tenant"' in k}
        assert any('"globex"' in k for k in tenants(ops))
        assert any('"acme"' in k for k in tenants(ops))
        assert tenants(acme) and all('"tenant": "acme"' in k for k in tenants(acme))
        assert 'weir:num_requests_running{"model_name": "m"}' in acme     # engine-wide stays
        assert (await http.get(gw.url + "/health")).status_code == 200    # still open
    async with serve(FakeClient(stats=stats, tenants=usage)) as gw, httpx.AsyncClient() as http:
        open_ = _series((await http.get(gw.url + "/metrics")).text)       # no keys: open
        assert any('"globex"' in k for k in open_)


async def test_a_streamed_request_still_works_end_to_end():
    client = FakeClient(deltas=5, text="ab")
    async with serve(client) as gw, httpx.AsyncClient() as http:
        body = b'{"prompt": "hi", "max_tokens": 5, "stream": true}'
        r = await http.post(gw.url + "/v1/completions", content=body, headers=JSON)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert r.text.count('"text":"ab"') == 5


async def test_health_fails_once_the_engine_reports_a_component_given_up_on():
    """Liveness (issue 43, D3): a component the supervisor gave up on makes /health 503,
    so a liveness probe restarts the pod; /ready says 503 as well."""
    client = FakeClient(stats={"streamer": {}, "executor": {}})
    async with serve(client) as gw:
        async with httpx.AsyncClient() as http:
            assert (await http.get(gw.url + "/health")).status_code == 200
            client.states["executor"] = "dead"
            deadline = time.monotonic() + 5          # the engine's status is cached 1 s
            while (r := await http.get(gw.url + "/health")).status_code == 200:
                assert time.monotonic() < deadline
                await anyio.sleep(0.05)
            assert r.status_code == 503 and r.json()["status"] == "dead"
            assert "executor" in r.json()["reason"]
            assert (await http.get(gw.url + "/ready")).status_code == 503
