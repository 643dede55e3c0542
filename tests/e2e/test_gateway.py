"""The OpenAI-compatible gateway, driven by real clients: the official `openai` package,
raw httpx for disconnects and errors, and prometheus_client's parser for /metrics."""
import concurrent.futures

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import GATEWAY_KEY as KEY, GATEWAY_MODEL as MODEL
from tests.e2e.engine import wait_for


def test_openai_client_chat_and_completion(gw, oai):
    chat = oai.chat.completions.create(model=MODEL,
                                       messages=[{"role": "user", "content": "Name a fruit."}],
                                       max_tokens=20, temperature=0)
    parts = [c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=20,
        temperature=0, stream=True)]
    assert chat.choices[0].message.content == "".join(parts) != ""
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens > 0 and chat.usage.completion_tokens > 0

    comp = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16,
                                  temperature=0)
    chunks = list(oai.completions.create(model=MODEL, prompt="The capital of France is",
                                         max_tokens=16, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert comp.choices[0].text == streamed != ""
    assert comp.choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage.completion_tokens == 16 and usage.prompt_tokens == comp.usage.prompt_tokens
    # the second identical prompt is served partly from the (tenant-scoped) prefix cache
    again = oai.completions.create(model=MODEL, prompt="The capital of France is " * 8,
                                   max_tokens=2, temperature=0)
    again2 = oai.completions.create(model=MODEL, prompt="The capital of France is " * 8,
                                    max_tokens=2, temperature=0)
    assert again2.usage.prompt_tokens_details.cached_tokens >= 16
    assert (again.usage.prompt_tokens_details.cached_tokens
            < again2.usage.prompt_tokens_details.cached_tokens)


def test_parallel_sampling_n(gw, oai):
    """n choices share the prompt's KV (copy-on-write); each is its own sample, streamed
    with its index; usage sums them; every block comes back."""
    msgs = [{"role": "user", "content": "Seeded, write a word."}]
    # the first request computes the whole prompt, the second reads most of it from the
    # prefix cache, whose logits can differ in the last bits: a seeded draw (an exponential
    # race with per-token noise) still repeats (the inverse-CDF draw it replaced turned
    # the third choice's 5th token into its neighbour in the vocabulary here, AVX512 EPYC)
    res = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, n=3,
                                      temperature=1.0, seed=7)
    assert [c.index for c in res.choices] == [0, 1, 2]
    texts = [c.message.content for c in res.choices]
    assert len(set(texts)) > 1                          # independent samples
    assert all(c.finish_reason in ("stop", "length") for c in res.choices)
    assert res.usage.completion_tokens <= 36 and res.usage.completion_tokens >= 3
    again = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, n=3,
                                        temperature=1.0, seed=7)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert [c.message.content for c in again.choices] == texts      # seeded: reproducible
    chunks = list(oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                         n=2, temperature=1.0, stream=True))
    by_index = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and all(by_index.values())
    greedy = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2,
                                    temperature=0)
    single = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                    temperature=0)
    assert [c.text for c in greedy.choices] == [single.choices[0].text] * 2
    gw.wait_kv_free(timeout=2.0)


def test_penalties_and_logit_bias(gw, oai, model_path):
    """vLLM's and OpenAI's logit adjustments through the official client: penalties change
    a greedy continuation that repeats itself, a +100 bias makes one token the only
    choice, a -100 bias bans the greedy pick, and a bias on an id the vocabulary lacks is
    a clear 400 from the tokenizer."""
    from components.model.vocab import load_tokenizer
    wave = load_tokenizer(model_path).encode(" wave")[0]
    prompt = "The sea, the sea, the sea, the sea,"

    def go(max_tokens: int = 12, temperature: float = 0.0, **kw) -> str:
        return oai.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                      temperature=temperature, **kw).choices[0].text

    plain = go()
    assert go(frequency_penalty=1.5, presence_penalty=1.0) != plain
    assert go(extra_body={"repetition_penalty": 1.5}) != plain
    assert go(4, 0.7, seed=1, logit_bias={str(wave): 100}) == " wave" * 4
    first = go(1)
    banned = load_tokenizer(model_path).encode(first)[0]
    assert go(1, logit_bias={str(banned): -100}) not in ("", first)
    r = httpx.post(gw.base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "hi", "logit_bias": {"49152": 5}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text
    gw.wait_kv_free(timeout=2.0)


def test_min_tokens_holds_off_eos_and_stop_strings(gw, oai):
    """vLLM's min_tokens: a greedy reply that ends on EOS after a few tokens runs to at
    least min_tokens, and a stop string that would match in the first tokens does not."""
    msgs = [{"role": "user", "content": "Is water wet? Answer yes or no."}]

    def chat(**extra):
        return oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64,
                                           temperature=0, extra_body=extra)

    short = chat()
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 48, short
    held = chat(min_tokens=n + 8)
    assert held.usage.completion_tokens >= n + 8
    assert held.choices[0].message.content.startswith(short.choices[0].message.content)

    def comp(**extra):
        return oai.completions.create(model=MODEL, prompt="One, two, three, four, five, six,",
                                      max_tokens=16, temperature=0, stop=[","],
                                      extra_body=extra).choices[0]

    cut, longer = comp(), comp(min_tokens=6)
    assert cut.finish_reason == "stop" and "," not in cut.text
    assert longer.text.startswith(cut.text + ",") and longer.finish_reason == "stop"
    gw.wait_kv_free(timeout=2.0)


def test_echo_and_prompt_logprobs(gw, oai, model_path):
    """echo + logprobs, as evaluation harnesses score text: each prompt token's
    log-probability given those before it. Checked against the engine's own sampled
    logprobs: a greedy continuation, fed back as a prompt, scores what generating it
    reported (teacher forcing reads what sampling saw). max_tokens 0 gives the prompt
    alone; a prompt asked twice is computed twice (never read from the prefix cache);
    streamed equals whole; the SDK's prompt_logprobs name the same entries."""
    from components.model.vocab import load_tokenizer
    ids = load_tokenizer(model_path).encode("The capital of France is")
    with gw.client() as c:
        gen = c.generate(prompt_token_ids=ids, max_tokens=6, temperature=0, logprobs=0,
                         ignore_eos=True)
    whole = ids + gen.token_ids
    scored = oai.completions.create(model=MODEL, prompt=whole, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == "The capital of France is" + gen.text
    assert len(lp.tokens) == len(whole) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    for got, want in zip(lp.token_logprobs[len(ids):], gen.logprobs):
        assert abs(got - want.logprob) < 2e-3, (got, want.logprob)
    # greedy: each continuation token is the most likely there, as lm-eval's is_greedy asks
    for tok, top in zip(lp.tokens[len(ids):], lp.top_logprobs[len(ids):]):
        assert max(top, key=top.get) == tok
    again = oai.completions.create(model=MODEL, prompt=whole, max_tokens=2, echo=True,
                                   logprobs=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0      # computed, not cached
    assert again.choices[0].logprobs.token_logprobs[:len(whole)] == pytest.approx(
        lp.token_logprobs, abs=1e-4)
    assert len(again.choices[0].logprobs.tokens) == len(whole) + 2
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, echo=True,
        temperature=0, stream=True))
    plain = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                   temperature=0)
    assert text == "The capital of France is" + plain.choices[0].text
    with gw.client() as c:
        res = c.generate(prompt_token_ids=whole, max_tokens=1, temperature=0, prompt_logprobs=2)
    assert res.prompt.token_ids == tuple(whole)
    assert [e.logprob for e in res.prompt.logprobs] == pytest.approx(lp.token_logprobs[1:],
                                                                     abs=1e-4)
    assert all(len(e.top) == 2 for e in res.prompt.logprobs)
    gw.wait_kv_free(timeout=2.0)


def test_a_batch_of_prompts(gw, oai, model_path):
    """Several prompts in one completions request, as OpenAI's client and lm-eval send
    them: choice j of prompt i at i * n + j, each what that prompt alone gives; the
    scoring form (token ids, echo, logprobs, max_tokens 0) per prompt; streamed, the same
    texts under the same indices; every block comes back."""
    from components.model.vocab import load_tokenizer
    prompts = ["The capital of France is", "Once upon a time"]
    alone = [oai.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
             for p in prompts]
    both = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + \
        [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 20
    tok = load_tokenizer(model_path)
    ids = [tok.encode(p) for p in prompts]
    scored = oai.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    for c, p, i in zip(scored.choices, prompts, ids):
        assert c.text == p and len(c.logprobs.tokens) == len(i)
        assert c.logprobs.token_logprobs[0] is None
    streamed = {i: "" for i in range(4)}
    for chunk in oai.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                        temperature=0, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert list(streamed.values()) == [c.text for c in both.choices]
    with pytest.raises(openai.BadRequestError):                 # one bad prompt: none run
        oai.completions.create(model=MODEL, prompt=["fine", "x" * 70000], max_tokens=2)
    gw.wait_kv_free(timeout=2.0)


def test_logprobs_completion_chat_and_streamed(gw, oai):
    """Logprobs through the official client: one per output token, the tokens spell the
    text, offsets run along it, greedy picks are the most likely of their top, the stream
    carries the same numbers as the whole response, and chat's top_logprobs has as many
    entries as asked."""
    prompt = "The capital of France is"
    ask = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
               extra_body={"ignore_eos": True})
    full = oai.completions.create(**ask)
    lp = full.choices[0].logprobs
    assert "".join(lp.tokens) == full.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == full.usage.completion_tokens == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for t, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and top[t] == logprob == pytest.approx(max(top.values()))
    chunks = [c.choices[0].logprobs for c in oai.completions.create(**ask, stream=True)
              if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [x for c in chunks for x in c.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                           abs=1e-4)
    assert [x for c in chunks for x in c.text_offset] == lp.text_offset
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
               and c.bytes == list(c.token.encode()) for c in content)
    assert oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2).choices[0] \
        .logprobs is None
    two = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, n=2, temperature=1.0,
                                 seed=3, logprobs=1, extra_body={"ignore_eos": True})
    for c in two.choices:                # each choice its own tokens (the fork's first too)
        assert "".join(c.logprobs.tokens) == c.text and len(c.logprobs.token_logprobs) == 5
    gw.wait_kv_free(timeout=2.0)


def test_models_health_ready_and_request_id(gw):
    r = httpx.get(gw.base_url + "/v1/models")
    assert r.json()["data"][0]["id"] == MODEL
    assert httpx.get(gw.base_url + "/health").json() == {"status": "ok"}
    assert httpx.get(gw.base_url + "/ready").status_code == 200
    r = httpx.post(gw.base_url + "/v1/completions",
                   headers={"Authorization": f"Bearer {KEY}", "x-request-id": "abc-123"},
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"


def test_disconnect_cancels_and_frees_kv(gw):
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", gw.base_url + "/v1/completions",
                         headers={"Authorization": f"Bearer {KEY}"},
                         json={"model": MODEL, "prompt": "Write a long story.", "max_tokens": 800,
                               "temperature": 0, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            gw.wait_stat("kv_manager", "leased_seqs", 1, timeout=0.5)
        # leaving the block closes the connection mid-stream
    elapsed = gw.wait_kv_free(timeout=1.0)
    assert elapsed < 1.0


@pytest.mark.parametrize("body, words", [
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "top_p": 2}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "n": 17}, "n must be"),
    ({"model": MODEL, "prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ({"model": MODEL, "max_tokens": 3}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "gpt-9", "prompt": "hi"}, "gpt-9"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**70}, "seed"),             # was a 500
    ({"model": MODEL, "prompt": "hi", "top_k": 2**63}, "top_k"),           # failed a step
    ({"model": MODEL, "prompt": [1, 2**70]}, "prompt_token_ids"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 1024}, "context window"),
])
def test_bad_parameters_get_openai_errors(gw, body, words):
    r = httpx.post(gw.base_url + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code in (400, 404)
    err = r.json()["error"]
    assert words in err["message"] and err["type"]


def test_invalid_json_and_unknown_key(gw):
    r = httpx.post(gw.base_url + "/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(gw.base_url + "/v1/chat/completions", content=b"[" * 5000 + b"]" * 5000,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400                                          # was a 500
    r = httpx.post(gw.base_url + "/v1/completions", content=b'{"prompt": "x"}',
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"})
    assert r.status_code == 415
    r = httpx.post(gw.base_url + "/v1/chat/completions", headers={"Authorization": "Bearer nope"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.base_url + "/v1", api_key="wrong", max_retries=0) \
            .completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_overload_gets_503_with_retry_after(gw):
    def call(i):
        return httpx.post(gw.base_url + "/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 40,
                                "temperature": 0, "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(call, range(12)))
    codes = [r.status_code for r in results]
    assert 200 in codes and 503 in codes, codes
    for r in results:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "overloaded"
    gw.wait_kv_free(timeout=2.0)


def _metrics(gw) -> dict[str, float]:
    r = httpx.get(gw.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    text = r.text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("" if "finished_reason" not in s.labels
                            else f"[{s.labels['finished_reason']}]")
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_metrics_parse_and_move(gw, oai):
    assert httpx.get(gw.base_url + "/metrics").status_code == 401      # keys configured
    # a labelled histogram has samples once it has observed one request (run alone, this
    # test's module has sent none before it)
    oai.completions.create(model=MODEL, prompt="Warm up.", max_tokens=3, temperature=0,
                           extra_body={"ignore_eos": True})
    before = _metrics(gw)
    for name in ("weir:time_to_first_token_seconds_count", "weir:e2e_request_latency_seconds_count",
                 "weir:num_requests_running", "weir:num_requests_waiting",
                 "weir:kv_cache_usage_perc", "weir:prefix_cache_queries_total",
                 "weir:prefix_cache_hits_total", "weir:request_queue_time_seconds_count",
                 "weir:inter_token_latency_seconds_count", "weir:kv_cpu_tier_blocks",
                 "weir:kv_cpu_tier_free_blocks", "weir:kv_cpu_tier_cached_blocks",
                 "weir:kv_below_watermark", "weir:num_preemptions_total",
                 "weir:kv_swapped_out_blocks_total"):
        assert name in before, name
    oai.completions.create(model=MODEL,
                           prompt="Count with me: one, two, three, four, five, six, seven,",
                           max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    # the gateway's own histograms move at once; the engine's counters arrive with the
    # next heartbeat
    after = wait_for(lambda: (m := _metrics(gw)).get("weir:generation_tokens_total", 0)
                     >= before.get("weir:generation_tokens_total", 0) + 5
                     and m.get("weir:request_e2e_seconds_count", 0)
                     >= before.get("weir:request_e2e_seconds_count", 0) + 1 and m,
                     what="the engine's counters counting the request")
    assert (after["weir:e2e_request_latency_seconds_count"]
            == before["weir:e2e_request_latency_seconds_count"] + 1)
    assert (after["weir:generation_tokens_total"]
            == before.get("weir:generation_tokens_total", 0) + 5)
    assert (after["weir:request_success_total[length]"]
            == before.get("weir:request_success_total[length]", 0) + 1)
    assert (after["weir:inter_token_latency_seconds_count"]
            >= before["weir:inter_token_latency_seconds_count"] + 4)
    assert after["weir:prefix_cache_queries_total"] > before["weir:prefix_cache_queries_total"]
    # the streamer times HTTP traffic too (the gateway is its client); its counts ride on
    # heartbeats, so requests of earlier tests may still be landing in ``before``: at least one
    assert (after["weir:request_e2e_seconds_count"]
            >= before.get("weir:request_e2e_seconds_count", 0) + 1)


ENGINE_WIDE = ("weir:request_ttft_seconds_count", "weir:request_tpot_seconds_count",
               "weir:request_e2e_seconds_count", "weir:slo_requests_total",
               "weir:request_queue_seconds_count", "weir:request_prefill_seconds_count",
               "weir:request_decode_seconds_count", "weir:request_admission_queue_seconds_count")
GOODPUT = ("weir:goodput_requests_total", "weir:slo_missed_requests_total",
           "weir:goodput_tokens_total", "weir:slo_missed_tokens_total",
           "weir:request_itl_seconds_count")


def _settled_metrics(gw, names=ENGINE_WIDE, timeout: float = 10.0) -> dict[str, float]:
    """The gateway's metrics once the engine holds no request (KV all free) and two reads
    more than a heartbeat apart agree on ``names``: the engine-wide counts ride on the
    streamer's heartbeats, so a request an earlier test finished can land a beat late."""
    gw.wait_kv_free(timeout=timeout)
    last: list[dict[str, float] | None] = [None]

    def agree():
        cur = _metrics(gw)
        same = last[0] is not None and all(cur.get(n, 0) == last[0].get(n, 0) for n in names)
        last[0] = cur
        return same and cur
    # reads 0.25 s apart: more than a heartbeat
    return wait_for(agree, timeout=timeout, what="the engine-wide metrics settling",
                    interval=0.25)


def test_engine_wide_latency_and_slo_metrics_count_sdk_traffic(gw):
    """A request over the SDK never touches HTTP: the gateway's own histograms stay still,
    the streamer's (the default class ``interactive``, TTFT against the request's own
    deadline) move."""
    before = _settled_metrics(gw, ENGINE_WIDE + GOODPUT)
    met = gw.stats("streamer").get("slo.ttft.met.interactive", 0)
    with gw.client() as c:
        done = c.generate("Count with me: one, two, three,", max_tokens=4, temperature=0,
                          ignore_eos=True, deadline_ms=60_000)
    assert done.usage.completion_tokens == 4
    gw.wait_stat("streamer", "slo.ttft.met.interactive", met + 1, timeout=2.0)
    after = _settled_metrics(gw, ENGINE_WIDE + GOODPUT)
    for name in ENGINE_WIDE:
        # judged twice, TTFT and TPOT: the interactive class has both targets
        step = 2 if name == "weir:slo_requests_total" else 1
        assert after[name] == before.get(name, 0) + step, name
    moved = {name: after.get(name, 0) - before.get(name, 0) for name in GOODPUT}
    # counted once, good or missed (whichever, its 4 tokens with it); 3 gaps between 4 deltas
    good = moved["weir:goodput_requests_total"]
    assert good + moved["weir:slo_missed_requests_total"] == 1, moved
    assert moved["weir:goodput_tokens_total"] == 4 * good, moved
    assert moved["weir:slo_missed_tokens_total"] == 4 * (1 - good), moved
    assert moved["weir:request_itl_seconds_count"] == 3, moved
    for name in ("weir:e2e_request_latency_seconds_count",      # (none yet, run alone)
                 "weir:time_to_first_token_seconds_count"):
        assert after.get(name, 0) == before.get(name, 0), name
