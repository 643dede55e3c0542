"""The recorded request log's cost per request (components/admission/request_log.py), beside
admission's own decision, on this machine.

    scripts/run bench/request_log [--requests 2000]

For prompts of 8, 128 and 512 prefix blocks (half shared, half the request's own): the
microseconds and bytes a request's line costs (its row, the block renumbering, the encode
and one ``O_APPEND`` write), then the policy core's decide + release of a 256-token request
(no I/O, no span) for scale.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from components.admission.request_log import RequestLog
from kernels.machine import summary_line
from schemas.wire import RequestHeader, SamplingParams, Tokenized
from tests.components.admission.policies import policy, req


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    n = ap.parse_args().requests
    print(summary_line())
    out = Path(tempfile.mkdtemp(prefix="weir-request-log-"))
    for blocks in (8, 128, 512):
        path = out / f"r{blocks}.jsonl"
        log = RequestLog(path, 16, max_bytes=1 << 40, remember=65536)
        toks = []
        for i in range(n):
            header = RequestHeader(f"r{i}", "a", SamplingParams(max_tokens=64), time.time_ns(),
                                   asked_class="interactive")
            own = [10**9 + i * blocks + j for j in range(blocks - blocks // 2)]
            toks.append(Tokenized(header, list(range(blocks * 16)),
                                  list(range(blocks // 2)) + own))
        start = time.perf_counter()
        for tok in toks:
            log.arrived(tok)
            log.expected(tok.request_id, 64)
            log.end(tok.request_id, 64)
        us = (time.perf_counter() - start) / n * 1e6
        print(f"request log, {blocks} prefix blocks: {us:.1f} us and "
              f"{(path.stat().st_size - 37) / n:.0f} bytes a request")
    p = policy()
    reqs = [req(f"q{i}", prompt=256, max_tokens=64) for i in range(n)]
    start = time.perf_counter()
    for r in reqs:
        p.decide(r, 0, 0.0)
        p.released([r.request_id], 0.0, {r.request_id: 64}, {r.request_id: 0.1})
    print(f"admission's policy core, decide + release: "
          f"{(time.perf_counter() - start) / n * 1e6:.1f} us a request")


if __name__ == "__main__":
    main()
