"""Greedy decoding through all seven processes equals Hugging Face transformers (fp32,
same GGUF), and does not depend on what else is in the batch."""
import anyio

from tests.e2e.hf import hf_logits_along
from tests.e2e.prompts import CHATS, COMPLETIONS, LONG
from weir import AsyncClient

N_TOKENS = 32


def requests():
    for p in COMPLETIONS:
        yield {"prompt": p}
    for c in CHATS:
        yield {"messages": [{"role": "user", "content": c}]}


def hf_prompt_ids(hf, req) -> list[int]:
    tok, _ = hf
    if "prompt" in req:
        return tok(req["prompt"], add_special_tokens=False).input_ids
    text = tok.apply_chat_template(req["messages"], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def test_long_prompt_exceeds_prefill_budget(hf):
    assert len(hf_prompt_ids(hf, {"prompt": LONG})) > 256    # the e2e engine's token budget


def test_greedy_matches_hf(engine, hf):
    """Each request alone. HF's greedy continuation is, token by token, the argmax of HF's
    logits given the prompt and the tokens before it, so one teacher-forced forward over
    Weir's output (``hf_logits_along``) checks every token against HF's choice: ~0.2 s a
    request where ``generate``'s 32 steps take ~3 s on 2 cores."""
    reqs = list(requests())
    assert len(reqs) >= 10
    with engine.client() as c:
        for req in reqs:
            want_prompt = hf_prompt_ids(hf, req)
            got = c.generate(**req, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
            assert got.usage.prompt_tokens == len(want_prompt), req
            assert len(got.token_ids) == N_TOKENS and got.finish_reason == "length"
            hf_choice = hf_logits_along(hf, want_prompt, got.token_ids).argmax(-1).tolist()
            assert got.token_ids == hf_choice, req


async def _run_all(endpoint, reqs):
    results = [None] * len(reqs)

    async def one(i, req, client):
        results[i] = (await client.generate(**req, max_tokens=N_TOKENS, temperature=0.0,
                                            ignore_eos=True)).token_ids

    async with AsyncClient(endpoint) as client:
        async with anyio.create_task_group() as tg:
            for i, req in enumerate(reqs):
                tg.start_soon(one, i, req, client)
    return results


def test_concurrency_does_not_change_output(engine, hf):
    """Twenty requests at once, of different lengths, decode in shared steps; each one's
    output is still HF's greedy continuation of its prompt, token by token (the same check
    as above, so equal to what it gives alone, where the test above holds it to HF)."""
    reqs = list(requests()) + [{"prompt": p + " Tell me more."} for p in COMPLETIONS] + [
        {"prompt": "Once upon a time, " * k} for k in (1, 3, 7, 12)]
    assert len(reqs) >= 16
    together = anyio.run(_run_all, engine.endpoint, reqs)
    for req, got in zip(reqs, together):
        assert len(got) == N_TOKENS, req
        hf_choice = hf_logits_along(hf, hf_prompt_ids(hf, req), got).argmax(-1).tolist()
        assert got == hf_choice, req
    engine.wait_kv_free(timeout=2.0)
