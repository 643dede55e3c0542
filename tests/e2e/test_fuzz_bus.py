"""A short, seeded run of the live bus fuzzer (scripts/reliability/fuzz_bus.py): 300 hostile
frames at the client endpoints, the engine's and a router's in front of it (well-typed ones
included: what any client can send), and 300 undecodable frames at every other socket a
peer can reach; before them, two frames past each socket's size bound, which must be
dropped unread (issue 43, D4). No process may die or restart, status must answer, and
the engine must then give the same greedy text as before, from a cold and from a warm
prefix cache. Each client endpoint also takes an attach flood: 2000 Submits under one
idempotency key (issue 43, D1), each answered.

Well-typed forgeries at internal sockets (`--forge all`, the script's default) are a
longer, manual run: they can legitimately fail requests and write KV, and the components'
handlers are fuzzed by it; see the script."""
import time

import pytest

from scripts.reliability import fuzz_bus


@pytest.mark.timeout(300)
def test_live_fuzz_short(tmp_path, model_path):
    start = time.monotonic()
    report = fuzz_bus.run(messages=300, seed=1, sockets=list(fuzz_bus.ORDER), run_dir=tmp_path,
                          big=500, forge="client", probe_each=False, attach=2000)
    assert report.failures == [], report.failures
    assert report.restarts == 0
    assert report.sent == {name: 300 for name in fuzz_bus.ORDER}
    assert report.oversized == {name: 2 for name in fuzz_bus.ORDER}    # each bound held
    assert report.attached == {name: 2000 for name in fuzz_bus.CLIENT_SOCKETS}   # D1
    # the frames really arrived: each component counted its undecodable ones
    for name in fuzz_bus.ORDER:
        if name != "supervisor":
            assert report.malformed[name] >= report.rejected[name] * 0.9, (name, report)
    print(f"live fuzz: {sum(report.sent.values())} frames in {time.monotonic() - start:.0f}s")
