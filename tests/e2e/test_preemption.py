"""Preemption on the live engine: a deliberately tiny KV pool and a small host tier, 16
concurrent long greedy generations, four held to a regex. Every request finishes with the
same tokens as on an unconstrained engine; victims are both swapped to the host tier and
recomputed, and the engine reports both; every block (both tiers) is back at the end."""
import re

import anyio
import pytest

from tests.e2e.engine import Engine, side_by_side

PROMPTS = [f"Tale {i}: the keeper of lighthouse number {i * 7 + 3} wrote in her log that"
           for i in range(16)]
MAX_TOKENS = 64


# a quarter of them held to a language (structured output) that 64 tokens cannot finish,
# and whose next tokens depend on what came before (a JSON list of words): a victim
# recomputed or swapped in must carry on in it, its matcher rebuilt from its output
HELD = set(PROMPTS[1::4])
WORDS = {"type": "array", "minItems": 30,
         "items": {"type": "string", "pattern": "^[a-z]{1,12}$"}}


async def _run_all(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    async with engine.async_client() as c:
        async def one(p: str) -> None:
            extra = {"structured": {"json": WORDS}} if p in HELD else {}
            res = await c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                   **extra)
            out[p] = res.token_ids
            if p in HELD:                       # a prefix of the list, never anything else
                assert re.fullmatch(r'\[("[a-z]{1,12}", )*("[a-z]{0,12}("(, ?)?)?)?', res.text), \
                    res.text
        async with anyio.create_task_group() as tg:
            for p in PROMPTS:
                tg.start_soon(one, p)
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory, model_path):
    # the FCFS baseline: it lets in more than the tiny pool holds, which is what preemption
    # is for (the default deadline policy reserves KV and refuses what does not fit)
    base = """
[engine]
max_model_len = 512
[admission]
policy = "fcfs"
[scheduler]
max_num_seqs = 16
max_num_batched_tokens = 128
[kv]
"""
    # the host tier holds two 2-block victims: the first victims of a full pool are swapped,
    # and once two wait there a third must be recomputed (12 blocks left that to timing)
    tiny = Engine(tmp_path_factory.mktemp("tiny"),
                  base + "num_blocks = 32\nnum_cpu_blocks = 4\ngrow_blocks = 1\n", wait=False)
    roomy = Engine(tmp_path_factory.mktemp("roomy"), base + "num_blocks = 512\n", wait=False)
    with side_by_side(tiny, roomy):
        yield tiny, roomy


def test_tiny_pool_preempts_by_swap_and_recompute_and_loses_nothing(engines):
    tiny, roomy = engines
    constrained = anyio.run(_run_all, tiny)
    reference = anyio.run(_run_all, roomy)
    assert len(constrained) == len(PROMPTS)
    for p in PROMPTS:
        assert len(constrained[p]) == MAX_TOKENS
        assert constrained[p] == reference[p], p
    sched = tiny.stats("scheduler")
    kinds = {k: v for k, v in sched.items() if k.startswith("preemptions")}
    assert sched["preemptions.swap"] > 0 and sched["preemptions.recompute"] > 0, kinds
    assert sched["preemptions"] == sched["preemptions.swap"] + sched["preemptions.recompute"]
    assert sched["wasted_tokens"] > 0 and sched["swapped_out_blocks"] > 0
    assert roomy.stats("scheduler")["preemptions"] == 0
    assert tiny.stats("executor")["copied_blocks"] > 0
    tiny.wait_kv_free(timeout=2.0)                        # free == total, both tiers
    print("tiny engine scheduler stats:", {k: v for k, v in sched.items() if "preempt" in k
                                           or "wasted" in k or "swapped" in k})


PAGE = ("Chapter {i}. The archive held maps of every river in the valley, drawn by hand over "
        "two centuries, with notes on floods, bridges, mills and the families who ran them. ")


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_evicted_prefix_is_demoted_to_the_host_tier_and_promoted_on_a_hit(tmp_path, model_path,
                                                                          kv_dtype):
    """A prefix evicted from the pool goes to the host tier and comes back on a hit, with the
    same tokens; with an fp8 cache (kv.dtype, a bf16 model) too: its rounded keys travel
    as bytes, and the executor reports the cache's type."""
    bf16 = 'dtype = "bfloat16"\n' if kv_dtype != "auto" else ""
    eng = Engine(tmp_path, f"[engine]\nmax_model_len = 384\n{bf16}"
                           f'[kv]\nnum_blocks = 24\nnum_cpu_blocks = 16\ndtype = "{kv_dtype}"\n')
    try:
        want = {"auto": "float32", "fp8_e4m3": "float8_e4m3fn"}[kv_dtype]
        assert eng.status()["executor"].info["kv.dtype"] == want
        with eng.client() as c:
            def ask(i):
                return c.generate(PAGE.format(i=i) * 4, max_tokens=2, temperature=0.0,
                                  ignore_eos=True)
            first = ask(0)
            assert first.usage.prompt_tokens > 144
            for i in (1, 2, 3):            # each evicts older prefixes from the 24-block pool
                ask(i)
            eng.wait_stat("kv_manager", "demoted_blocks", 9, at_least=True)
            again = ask(0)                 # its blocks now live only in the host tier
        assert again.usage.cached_tokens == 144, again.usage
        eng.wait_stat("kv_manager", "promoted_blocks", 9, at_least=True)
        assert again.token_ids == first.token_ids
        eng.wait_kv_free(timeout=2.0)
    finally:
        eng.stop()
