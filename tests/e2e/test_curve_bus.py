"""The engine over tcp with CURVE on every socket ([security] curve, client_curve = "on"):
it serves an SDK that holds the keys; a raw tcp peer without them is not heard, not even
as a malformed frame, while one with the cluster's client key is."""
import os
import subprocess
import sys

import zmq

from bus import curve
from bus.codec import encode
from schemas.wire import NewSeq, SeqStep, StepPlan
from tests.e2e.engine import ROOT, Engine, wait_for
from tests.e2e.test_tcp_topology import free_base_port, tcp_toml


def _raw_push(address: str, keys=None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.linger = 0
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    sock.connect(address)
    return sock


def test_serve_over_tcp_with_curve(tmp_path, model_path, monkeypatch):
    keys_dir = curve.generate(tmp_path / "keys")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    base = free_base_port()
    endpoint = f"tcp://127.0.0.1:{base + 10}"
    toml = tcp_toml(base, base + 10) + (f'[security]\ncurve = true\ncurve_keys_dir = "{keys_dir}"'
                                        f'\nclient_curve = "on"\n')
    env_keys = {curve.ENV_KEYS_DIR: str(keys_dir)}
    eng = Engine(run_dir, toml, extra_args=("--endpoint", endpoint))
    eng.endpoint = endpoint
    monkeypatch.setenv(curve.ENV_KEYS_DIR, str(keys_dir))     # this process: an SDK with keys
    curve.reset()
    try:
        with eng.client() as c:
            r = c.generate("The sky is", max_tokens=6, temperature=0.0, ignore_eos=True)
            assert r.usage.completion_tokens == 6
        eng.settled_stats("executor")         # stats ride on heartbeats: the steps have landed
        before = eng.status()
        assert all(st.alive and st.restarts == 0 for st in before.values())

        # a raw peer without keys: a forged step and junk at the executor's inbox, junk at
        # the supervisor's heartbeats; none of it is even received
        executor_inbox = f"tcp://127.0.0.1:{base + 4}"
        intruders = [_raw_push(executor_inbox), _raw_push(f"tcp://127.0.0.1:{base + 7}")]
        forged = StepPlan(1, [NewSeq(1, [1, 2, 3], 3, 0, [0], 0.0, 1.0, 0, None)],
                          [SeqStep(1, 3, [], True)], [])
        for sock in intruders:
            for frame in (encode(forged), b"\x91" * 100_000 + b"\xc0", b"junk"):
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    # the server already refused the handshake and zmq dropped the only pipe:
                    # the frame was not even queued, which is the point of this check
                    pass

        # the same junk with the cluster's client key does arrive (counted as malformed);
        # sent after the intruders' frames, it is also the barrier for them: once it is
        # counted, a forged step let in would have run and its junk been counted too
        member = _raw_push(executor_inbox, curve.load(keys_dir))
        member.send(b"junk")
        after = wait_for(lambda: (st := eng.status())["executor"].stats["malformed"] >= 1
                         and st, what="a keyed peer's frame arriving")
        assert after["executor"].stats["steps"] == before["executor"].stats["steps"]
        assert after["executor"].stats["malformed"] == 1

        # an SDK process without the keys gets no answer from the client endpoint
        env = {k: v for k, v in os.environ.items() if k != curve.ENV_KEYS_DIR}
        env["PYTHONPATH"] = str(ROOT)
        cli = [sys.executable, "-m", "weir.cli", "status", "--endpoint", endpoint,
               "--timeout", "2"]
        assert subprocess.run(cli, env=env, cwd=ROOT, capture_output=True,
                              timeout=60).returncode != 0
        ok = subprocess.run(cli, env={**env, **env_keys}, cwd=ROOT, capture_output=True)
        assert ok.returncode == 0, ok.stderr
        with eng.client() as c:
            assert c.generate("The sky is", max_tokens=6, temperature=0.0,
                              ignore_eos=True).text == r.text
        assert all(st.alive and st.restarts == 0 for st in eng.status().values())
        for sock in (*intruders, member):
            sock.close(0)
        eng.stop()                      # drain and Stop reach every process over CURVE
        assert eng.proc.returncode == 0, eng.log_path.read_text()[-3000:]
    finally:
        eng.stop()
        curve.reset()
