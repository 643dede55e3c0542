"""Cancelling mid-stream returns every KV block within 1 s; killing the client process,
within the streamer's client timeout (2 s of silence) and 1 s more."""
import os
import signal
import subprocess
import sys

from tests.e2e.engine import ROOT


def test_cancel_mid_stream_frees_kv(engine):
    with engine.client() as c:
        stream = c.stream("Tell me a very long story.", max_tokens=600, temperature=0.0,
                          ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 5:
                engine.wait_stat("kv_manager", "leased_seqs", 1, timeout=0.5, at_least=True)
                stream.cancel()
        assert stream.result.finish_reason == "cancelled"
        assert len(stream.result.token_ids) < 600
    engine.wait_kv_free(timeout=1.0)
    engine.wait_stat("scheduler", "running", 0, timeout=0.5)


CLIENT = """
import sys
from weir import Client
with Client(sys.argv[1]) as c:
    for i, _ in enumerate(c.stream("Count slowly to one thousand.", max_tokens=800,
                                   temperature=0.0, ignore_eos=True)):
        if i == 3:
            print("streaming", flush=True)
"""


def test_killed_client_frees_kv(engine):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, engine.endpoint], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"streaming"
        engine.wait_stat("kv_manager", "leased_seqs", 1, timeout=0.5, at_least=True)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    elapsed = engine.wait_kv_free(timeout=3.0)
    assert elapsed < 3.0
    cancelled = engine.status()["streamer"].stats["requests.cancelled"]
    assert cancelled >= 1
