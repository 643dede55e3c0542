"""An fp8 KV cache (kv.dtype) on the live engine: it serves, reports its element type, and
moves blocks between tiers (prefix demotion to the host tier and promotion back) with
every block returned at the end."""
from tests.e2e.engine import Engine
from tests.e2e.test_preemption import PAGE


def test_an_fp8_kv_cache_serves_demotes_and_promotes(tmp_path, model_path):
    eng = Engine(tmp_path, "[engine]\nmax_model_len = 384\ndtype = \"bfloat16\"\n"
                           "[kv]\nnum_blocks = 24\nnum_cpu_blocks = 16\ndtype = \"fp8_e4m3\"\n")
    try:
        status = eng.status()
        assert status["executor"].info["kv.dtype"] == "float8_e4m3fn", status["executor"].info
        with eng.client() as c:
            def ask(i):
                return c.generate(PAGE.format(i=i) * 4, max_tokens=8, temperature=0.0,
                                  ignore_eos=True)
            first = ask(0)
            assert first.usage.prompt_tokens > 144 and len(first.token_ids) == 8
            assert first.text.strip()
            for i in (1, 2, 3):            # each evicts older prefixes from the 24-block pool
                ask(i)
            eng.wait_stat("kv_manager", "demoted_blocks", 9, at_least=True)
            again = ask(0)                 # its rounded keys now come back from the host tier
        assert again.usage.cached_tokens == 144, again.usage
        eng.wait_stat("kv_manager", "promoted_blocks", 9, at_least=True)
        assert again.token_ids == first.token_ids
        eng.wait_kv_free(timeout=2.0)
    finally:
        eng.stop()
