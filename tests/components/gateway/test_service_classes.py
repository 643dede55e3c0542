"""Service classes over HTTP, against the real app over a fake engine: the class a request
asks for reaches the SDK, what admission granted comes back (degrade headers, the usage's
``weir`` object), and each admission rejection is its HTTP status."""
from __future__ import annotations

import json

import anyio
import httpx
import pytest

from schemas.client import Accepted
from tests.components.gateway.fakes import FakeClient, serve
from weir.errors import RequestRejected

pytestmark = pytest.mark.anyio

JSON = {"content-type": "application/json"}
DEGRADED = Accepted("r", 3, 0, "batch", 4, True, 0.25)


def sse_frames(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {")]


async def test_the_header_or_body_class_reaches_the_engine():
    client = FakeClient()
    async with serve(client) as gw, httpx.AsyncClient() as http:
        await http.post(gw.url + "/v1/completions", content=b'{"prompt": "hi"}',
                        headers={**JSON, "x-weir-class": "batch"})
        await http.post(gw.url + "/v1/chat/completions", headers={**JSON, "x-weir-class": "a"},
                        content=b'{"messages": [{"role": "user", "content": "hi"}],'
                                b' "service_class": "batch"}')
        await http.post(gw.url + "/v1/completions", content=b'{"prompt": "hi"}', headers=JSON)
    assert [s.get("service_class") for s in client.submitted] == ["batch", "batch", None]
    assert "service_class" not in client.submitted[2]      # the tenant's default


async def test_a_degraded_response_says_so_in_headers_and_usage():
    async with serve(FakeClient(deltas=2, accepted=DEGRADED)) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/completions", headers=JSON,
                            content=b'{"prompt": "hi", "max_tokens": 64}')
    assert r.status_code == 200
    assert r.headers["x-weir-degraded"] == "true" and r.headers["x-weir-max-tokens"] == "4"
    assert r.json()["usage"]["weir"] == {"service_class": "batch", "degraded": True,
                                         "max_tokens": 4, "queued_ms": 250.0}


USAGE = b', "stream": true, "stream_options": {"include_usage": true}}'


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 64' + USAGE),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]' + USAGE),
])
async def test_a_degraded_stream_has_the_headers_at_its_start(path, body):
    # The fake sets ``accepted`` only when its first delta is read, as the SDK does: the
    # headers are right only if the gateway builds them after that first event.
    async with serve(FakeClient(deltas=3, accepted=DEGRADED)) as gw, httpx.AsyncClient() as http:
        async with http.stream("POST", gw.url + path, content=body, headers=JSON) as r:
            assert r.headers["x-weir-degraded"] == "true"
            assert r.headers["x-weir-max-tokens"] == "4"
            text = (await r.aread()).decode()
    assert text.endswith("data: [DONE]\n\n")
    usage = sse_frames(text)[-1]
    assert usage["choices"] == [] and usage["usage"]["weir"] == {
        "service_class": "batch", "degraded": True, "max_tokens": 4, "queued_ms": 250.0}


async def test_an_undegraded_request_has_no_degrade_headers():
    granted = Accepted("r", 3, 0, "interactive", 16, False, 0.0)
    async with serve(FakeClient(accepted=granted)) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/completions", headers=JSON,
                            content=b'{"prompt": "hi", "stream": true}')
        plain = await http.post(gw.url + "/v1/completions", headers=JSON,
                                content=b'{"prompt": "hi"}')
    for resp in (r, plain):
        assert resp.status_code == 200
        assert "x-weir-degraded" not in resp.headers and "x-weir-max-tokens" not in resp.headers
    assert "usage" not in sse_frames(r.text)[-1]              # include_usage not asked
    assert plain.json()["usage"]["weir"] == {"service_class": "interactive", "degraded": False,
                                             "max_tokens": 16, "queued_ms": 0.0}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_cut_at_its_end_to_end_deadline_finishes_length_over_http(stream):
    """The bound reaches the engine; its ``deadline`` finish is ``length`` in the OpenAI
    body (what OpenAI clients parse) and ``deadline`` in the usage's ``weir`` object."""
    granted = Accepted("r", 3, 0, "interactive", 64, False, 0.0, e2e_deadline_ms=400)
    client = FakeClient(deltas=2, accepted=granted, finish_reason="deadline")
    body = b'{"prompt": "hi", "max_tokens": 64, "e2e_deadline_ms": 400' + \
        (USAGE if stream else b"}")
    async with serve(client) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/completions", headers=JSON, content=body)
    assert r.status_code == 200 and client.submitted[0]["e2e_deadline_ms"] == 400
    if stream:
        frames = sse_frames(r.text)
        assert [f["choices"][0]["finish_reason"] for f in frames[:-1]] == \
            [None, None, "length"]
        usage = frames[-1]["usage"]
    else:
        assert r.json()["choices"][0]["finish_reason"] == "length"
        usage = r.json()["usage"]
    assert usage["completion_tokens"] == 2 and usage["weir"]["deadline"] is True


@pytest.mark.parametrize("reason, retry_after_s, status, retry_header", [
    ("tenant_token_budget", 2.2, 429, "3"),
    ("tenant_kv_budget", None, 429, None),
    ("queue_full", 1.0, 503, "1"),
    ("deadline_unmeetable", 0.4, 503, "1"),
    ("deadline_expired", None, 503, None),
    ("class_not_allowed", None, 403, None),
    ("overloaded", 5.0, 503, "5"),
    ("tenant_over_budget", 1.5, 429, "2"),
    ("prompt_too_long", None, 400, None),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_admission_rejections_map_to_http_statuses(reason, retry_after_s, status,
                                                         retry_header, stream):
    reject = RequestRejected("r", reason, f"refused: {reason}", retry_after_s)
    body = b'{"prompt": "hi", "stream": %s}' % (b"true" if stream else b"false")
    async with serve(FakeClient(reject=reject)) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/completions", content=body,
                            headers={**JSON, "x-weir-class": "interactive"})
    assert r.status_code == status
    assert r.json()["error"]["code"] == reason
    assert r.headers.get("retry-after") == retry_header


async def test_a_batch_of_prompts_is_one_request_each_and_one_answer():
    """Completions with a list of prompts: one engine request each (their own ids), the
    choices in order, usage summed; streamed, every prompt's deltas under its own index,
    each choice finished, the usage summed."""
    client = FakeClient(deltas=2, text="x")
    async with serve(client) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/completions", headers=JSON,
                            content=b'{"prompt": ["a", [5, 6], "c"], "max_tokens": 4}')
        st = await http.post(gw.url + "/v1/completions", headers=JSON,
                             content=b'{"prompt": ["a", "b"], "stream": true, "n": 1,'
                                     b' "stream_options": {"include_usage": true}}')
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == 9 and body["usage"]["completion_tokens"] == 6
    assert [s.get("prompt", s.get("prompt_token_ids")) for s in client.submitted[:3]] == \
        ["a", [5, 6], "c"]
    assert len({s.request_id for s in client.streams}) == 5
    frames = sse_frames(st.text)
    texts = {0: "", 1: ""}
    for f in frames:
        for c in f["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: "xx", 1: "xx"}
    assert sorted(c["index"] for f in frames for c in f["choices"] if c["finish_reason"]) == [0, 1]
    assert frames[-1]["usage"]["completion_tokens"] == 4 and st.text.endswith("data: [DONE]\n\n")


async def test_a_refused_prompt_of_a_batch_refuses_the_batch_and_frees_the_rest():
    """The second of three is refused while the first still runs: the answer is that
    refusal, and the first is cancelled (its KV freed), not left running."""
    reject = RequestRejected("r", "overloaded", "engine busy", 1.5)
    client = FakeClient(deltas=50, delay=0.05, reject=reject, reject_from=1)
    async with serve(client) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/completions", headers=JSON,
                            content=b'{"prompt": ["a", "b", "c"]}')
        with anyio.fail_after(5):
            await client.streams[0].cancelled.wait()
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"


@pytest.mark.parametrize("after, status", [(0.0, 503), (0.3, 200)])
async def test_a_streamed_batch_refused_in_part_frees_the_rest(after, status):
    """The second prompt refused before the first's first token (the answer is the 503)
    or after the stream began (an error frame ends it): either way the first prompt,
    still running, is cancelled."""
    reject = RequestRejected("r", "overloaded", "engine busy", 1.5)
    client = FakeClient(deltas=50, delay=0.05, reject=reject, reject_from=1, reject_after=after)
    async with serve(client) as gw, httpx.AsyncClient() as http:
        r = await http.post(gw.url + "/v1/completions", headers=JSON,
                            content=b'{"prompt": ["a", "b"], "stream": true}')
        with anyio.fail_after(5):
            await client.streams[0].cancelled.wait()
    assert r.status_code == status
    if status == 200:
        assert sse_frames(r.text)[-1]["error"]["message"].startswith("request failed")
