"""One slow reader slows no one: three SSE clients that never read and one that reads a
byte a second, beside 8 normal streams. The normal streams' inter-token latency stays
within 1.5x of the same load read promptly, and the stalled clients are cancelled in the
engine with their KV freed.

Both runs carry the same requests, so the comparison isolates not reading from the extra
batch work those requests are (until they are cut off, which only lightens the batch)."""
import socket
import statistics
import threading
import time

import anyio
import httpx
import msgspec
import pytest

from tests.e2e.conftest import free_port
from tests.e2e.engine import Engine

CONFIG = """
[engine]
max_model_len = 1024
[kv]
num_blocks = 1024
[scheduler]
max_num_batched_tokens = 512
"""
GATEWAY = "stream_stall_timeout_s = 3.0\nsend_buffer_bytes = 8192\n"
HEAVY = {"prompt": "Write a very long story about the sea.", "max_tokens": 200, "n": 4,
         "stream": True, "ignore_eos": True, "temperature": 1.0}
NORMAL = {"max_tokens": 48, "stream": True, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def eng(tmp_path_factory, model_path):
    e = Engine(tmp_path_factory.mktemp("slow"), CONFIG, http_port=free_port(),
               gateway_extra=GATEWAY)
    yield e
    e.stop()


def _raw_stream(port: int, reader: str, stop: threading.Event, got: list) -> None:
    """A streaming request on a raw socket with a tiny receive buffer that reads nothing
    (``never``), a byte a second (``trickle``) or everything (``prompt``)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = msgspec.json.encode(HEAVY)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    s.settimeout(0.5)
    try:
        while not stop.is_set():
            if reader == "never":
                stop.wait(0.2)
                continue
            try:
                data = s.recv(1 if reader == "trickle" else 65536)
            except TimeoutError:
                continue
            if not data:
                break
            got.append(len(data))
            if reader == "trickle":
                stop.wait(1.0)
    except OSError:
        pass
    finally:
        s.close()


async def _normal(http, i: int, gaps: list) -> None:
    async with http.stream("POST", "/v1/completions",
                           json={**NORMAL, "prompt": f"Count slowly, take {i}:"}) as r:
        last = None
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now


def _run(eng, readers: list[str]) -> tuple[list[float], list]:
    stop, threads, got = threading.Event(), [], []
    for reader in readers:
        t = threading.Thread(target=_raw_stream, args=(eng.http_port, reader, stop, got))
        t.start()
        threads.append(t)
    eng.wait_stat("scheduler", "running", 4 * len(readers), timeout=60, at_least=True)
    gaps: list[float] = []

    async def normals():
        async with httpx.AsyncClient(base_url=eng.base_url, timeout=120) as http, \
                anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(_normal, http, i, gaps)
    anyio.run(normals)
    return gaps, (stop, threads)


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


def test_stalled_readers_neither_slow_the_others_nor_keep_their_kv(eng):
    base, (stop, threads) = _run(eng, ["prompt"] * 4)
    stop.set()
    for t in threads:
        t.join(10)
    eng.wait_kv_free(timeout=60)

    slow, (stop, threads) = _run(eng, ["never", "never", "never", "trickle"])
    print(f"\nITL of 8 normal streams: p50 {statistics.median(base) * 1e3:.1f} -> "
          f"{statistics.median(slow) * 1e3:.1f} ms, p99 {_p99(base) * 1e3:.1f} -> "
          f"{_p99(slow) * 1e3:.1f} ms (4 heavy streams read promptly -> 3 unread + 1 trickle)")
    try:
        assert _p99(slow) <= 1.5 * _p99(base)
        # the unread streams are cut off and every block comes back while they stay open
        eng.wait_kv_free(timeout=180)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
