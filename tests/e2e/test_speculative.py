"""Speculative decoding through all seven processes: greedy output is still Hugging Face's,
token for token, with each draft source (n-gram prompt lookup; the served model as its own
draft, whose every greedy draft the target accepts), and a cancel in the middle of
speculating decodes gives every KV block back. One engine per method. Prompt lookup runs
under the scheduler's k (``control = "scheduler"``). The served model as its own draft costs
as much per draft token as the target, and once the scheduler has measured that it rightly
stops drafting, so that engine drafts ``max_k`` every step (``control = "fixed"``): what it
tests is verification, not the rule."""
import anyio
import pytest

from tests.e2e.conftest import BASE_TOML
from tests.e2e.engine import Engine
from tests.e2e.hf import hf_logits_along
from tests.e2e.prompts import CHATS, COMPLETIONS
from tests.e2e.test_greedy_hf import hf_prompt_ids
from weir import AsyncClient

N_TOKENS = 32
# output that copies its context: the n-gram source proposes (and the target accepts) runs
COPY = "Once upon a time, " * 7
CODE = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n\n") * 2

SPEC = {
    "ngram": '[speculative]\nmethod = "ngram"\nmax_k = 4\n',
    "draft": '[speculative]\nmethod = "draft"\nmax_k = 4\ncontrol = "fixed"\ndraft_model = ""\n'
             'draft_layers = 0\n',
}


@pytest.fixture(scope="module", params=sorted(SPEC))
def spec_engine(request, tmp_path_factory, model_path):
    eng = Engine(tmp_path_factory.mktemp(f"spec-{request.param}"),
                 BASE_TOML + SPEC[request.param])
    eng.method = request.param
    yield eng
    eng.stop()


def _requests():
    yield {"prompt": COPY}
    yield {"prompt": CODE}
    for p in (COMPLETIONS[0], COMPLETIONS[1]):
        yield {"prompt": p}
    yield {"messages": [{"role": "user", "content": CHATS[0]}]}


async def _together(endpoint, key, reqs):
    out = [None] * len(reqs)

    async def one(i, req, client):
        out[i] = (await client.generate(**req, max_tokens=N_TOKENS, temperature=0.0,
                                        ignore_eos=True)).token_ids

    async with AsyncClient(endpoint, api_key=key) as client:
        async with anyio.create_task_group() as tg:
            for i, req in enumerate(reqs):
                tg.start_soon(one, i, req, client)
    return out


def _assert_hf(hf, req, got):
    assert len(got) == N_TOKENS, req
    want = hf_logits_along(hf, hf_prompt_ids(hf, req), got).argmax(-1).tolist()
    assert got == want, req


def test_greedy_matches_hf_with_speculation(spec_engine, hf):
    """Each request alone (batch 1: where the scheduler drafts most), then all at once (verify
    rows beside plain decodes and prefill chunks): every token is HF's greedy choice, the
    check of test_greedy_hf.py. Speculation ran; with the model as its own draft every draft
    token was accepted."""
    before = spec_engine.settled_stats("executor")
    reqs = list(_requests())
    with spec_engine.client() as c:
        for req in reqs:
            got = c.generate(**req, max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
            assert got.finish_reason == "length", req
            _assert_hf(hf, req, got.token_ids)
    for req, got in zip(reqs, anyio.run(_together, spec_engine.endpoint,
                                        spec_engine.service_key, reqs)):
        _assert_hf(hf, req, got)
    spec_engine.wait_kv_free(timeout=2.0)
    ex = spec_engine.settled_stats("executor")
    drafted = ex["spec.drafted"] - before.get("spec.drafted", 0)
    accepted = ex["spec.accepted"] - before.get("spec.accepted", 0)
    assert drafted > 0 and accepted > 0, ex
    if spec_engine.method == "draft":
        assert accepted == drafted, ex            # the target's own greedy tokens
    sched = spec_engine.settled_stats("scheduler")
    assert sched["spec.verifies"] > 0 and sched["spec.emitted"] > sched["spec.verifies"], sched
    assert sum(v for k, v in sched.items() if k.startswith("spec.drafted.")) == ex["spec.drafted"]


def test_cancel_mid_speculation_frees_kv(spec_engine):
    """A long greedy copy, speculating, cancelled after a few deltas: every block is back
    (free == total) and the next request is served."""
    before = spec_engine.settled_stats("executor").get("spec.drafted", 0)
    with spec_engine.client() as c:
        stream = c.stream(COPY * 3, max_tokens=600, temperature=0.0, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 5:
                spec_engine.wait_stat("kv_manager", "leased_seqs", 1, timeout=0.5,
                                      at_least=True)
                spec_engine.wait_stat("executor", "spec.drafted", before + 1, timeout=2.0,
                                      at_least=True)
                stream.cancel()
        assert stream.result.finish_reason == "cancelled"
        assert len(stream.result.token_ids) < 600
        spec_engine.wait_kv_free(timeout=1.0)
        spec_engine.wait_stat("scheduler", "running", 0, timeout=0.5)
        after = c.generate(COPY, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert after.finish_reason == "length" and len(after.token_ids) == 8
    spec_engine.wait_kv_free(timeout=1.0)
