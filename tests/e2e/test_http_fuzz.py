"""The HTTP half of the issue's fuzz test, short and seeded: scripts/reliability/fuzz_http.py's
generated requests (wrong types, huge values, 20 MB bodies, bad unicode, deep JSON, wrong
content types, bad headers and framing) against the real engine's gateway, after an idle
flood past its connection cap (a completion must still be served, and every idle
connection closed by the gateway). No 5xx but a documented 503, no process dies or
restarts, nothing leaks, and a greedy request returns the same text afterwards.
``scripts/run reliability/fuzz_http --examples 2000 --idle-flood 3000`` is the long run."""
import pytest

from scripts.reliability import fuzz_http as fuzz
from tests.e2e.conftest import GATEWAY_KEY, start_gateway

EXAMPLES = 200
SEED = 20261130
MAX_CONNECTIONS = 64
FLOOD = 100                # idle connections: past MAX_CONNECTIONS


@pytest.fixture(scope="module")
def gw(tmp_path_factory, model_path):
    eng = start_gateway(tmp_path_factory, "read_timeout_s = 1.0\nstream_stall_timeout_s = 5.0\n"
                        f"max_connections = {MAX_CONNECTIONS}\nfirst_byte_timeout_s = 1.0\n"
                        "keepalive_timeout_s = 1.0\n")
    yield eng
    eng.stop()


@pytest.mark.timeout(600)         # ~20 s of requests on an idle machine; far more on a busy one
def test_http_fuzz(gw):
    before = gw.status()
    report = fuzz.run(gw.base_url, GATEWAY_KEY, EXAMPLES, SEED, timeout=30, log=print,
                      mix=fuzz.LIGHT_MIX, flood=FLOOD)
    assert not report.failures, "\n".join(report.failures[:20])
    assert report.sent >= EXAMPLES
    assert report.statuses[200] >= 10 and report.statuses[400] >= 50     # it reached the engine
    assert gw.proc.poll() is None
    after = gw.status()
    for name, comp in before.items():
        now = after[name]
        assert now.alive and now.pid == comp.pid and now.restarts == comp.restarts, name
    gw.wait_kv_free(timeout=10.0)
