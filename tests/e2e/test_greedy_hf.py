"""Greedy decoding through all seven processes equals Hugging Face transformers (fp32,
same GGUF), and does not depend on what else is in the batch."""
import anyio
import pytest
import torch

from tests.e2e.prompts import CHATS, COMPLETIONS, LONG
from weir import AsyncClient

N_TOKENS = 32


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenizers import pre_tokenizers

    tok = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    # HF's GGUF converter drops SmolLM2's digit split; the model's own tokenizer.json
    # (and llama.cpp for tokenizer.ggml.pre=smollm) splits digits before byte-level BPE.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                 dtype=torch.float32)
    model.eval()
    return tok, model


def hf_greedy(hf, ids: list[int]) -> list[int]:
    tok, model = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


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
    reqs = list(requests())
    assert len(reqs) >= 10
    with engine.client() as c:
        for req in reqs:
            want_prompt = hf_prompt_ids(hf, req)
            got = c.generate(**req, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
            assert got.usage.prompt_tokens == len(want_prompt), req
            assert got.token_ids == hf_greedy(hf, want_prompt), req
            assert got.finish_reason == "length"


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


def test_concurrency_does_not_change_output(engine):
    reqs = list(requests()) + [{"prompt": p + " Tell me more."} for p in COMPLETIONS] + [
        {"prompt": "Once upon a time, " * k} for k in (1, 3, 7, 12)]
    assert len(reqs) >= 16
    with engine.client() as c:
        alone = [c.generate(**r, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True).token_ids
                 for r in reqs]
    together = anyio.run(_run_all, engine.endpoint, reqs)
    assert together == alone
    engine.wait_kv_free(timeout=2.0)
