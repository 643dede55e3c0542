"""Engine start and stop on this machine, and the GGUF header read that used to bound them.

    scripts/run bench/startup [--runs 3] [--model PATH]

Prints the machine, then:
- the model file's header read by ``components.model.gguf_header.read_header`` and by the gguf
  package's ``GGUFReader`` (what the tokenizer and detokenizer used), side by side,
  median of ``--runs``, and their ratio;
- ``weir serve`` (seven processes, ipc, no gateway) from spawn to ``weir: ready``, and from
  SIGTERM to exit, median of ``--runs`` starts; with them (Linux: from /proc) the CPU time
  the supervisor and its components spent to be ready, and the share of one core they use
  while the engine sits idle for ``--idle`` seconds after it.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from components.model.fetch import default_model_path
from components.model.gguf_header import read_header
from kernels import machine
from scripts import ROOT


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def start_stop(model: Path, run_dir: Path, idle_s: float
               ) -> tuple[float, float, float | None, float | None]:
    """Seconds from spawning ``weir serve`` to its ready line and from SIGTERM to exit;
    the CPU seconds its processes spent until ready, and their CPU share of one core while
    idle for ``idle_s`` after."""
    cfg = run_dir / "weir.toml"
    cfg.write_text(f'[engine]\nmodel = "{model}"\n[kv]\nnum_blocks = 256\n'
                   '[gateway]\nenabled = false\n')
    log = run_dir / "serve.log"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "weir.cli", "serve", "--config", str(cfg),
                             "--run-dir", str(run_dir),
                             "--endpoint", f"ipc://{run_dir}/client.sock"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    try:
        while b"weir: ready" not in log.read_bytes():
            if proc.poll() is not None:
                raise RuntimeError(f"weir serve exited: {log.read_text()[-2000:]}")
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("weir serve not ready after 300 s")
            time.sleep(0.02)
        ready = time.perf_counter() - t0
        to_ready = sum(machine.component_cpu(proc.pid, include_root=True).values()) or None
        idle = None
        if idle_s > 0 and to_ready is not None:
            time.sleep(idle_s)                  # measuring an idle engine: nothing to poll
            after = sum(machine.component_cpu(proc.pid, include_root=True).values())
            idle = (after - to_ready) / idle_s
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        return ready, time.perf_counter() - t1, to_ready, idle
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--idle", type=float, default=5.0,
                    help="seconds to watch the ready engine's idle CPU (0: skip)")
    args = ap.parse_args()
    model = args.model or default_model_path()
    print(machine.summary_line())
    print(f"model: {model.name}")

    import gguf

    ours = timed(lambda: read_header(model), args.runs)
    theirs = timed(lambda: gguf.GGUFReader(str(model)), args.runs)
    print(f"GGUF header: components.model.gguf_header {ours:.3f} s, gguf.GGUFReader {theirs:.3f} s "
          f"({theirs / ours:.1f}x), median of {args.runs}")

    ready, stop, cpu, idle = [], [], [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as d:
            r, s, c, i = start_stop(model, Path(d), args.idle)
        ready.append(r)
        stop.append(s)
        cpu += [c] if c is not None else []
        idle += [i] if i is not None else []
    print(f"weir serve: spawn -> ready {statistics.median(ready):.2f} s "
          f"({', '.join(f'{x:.2f}' for x in ready)}), SIGTERM -> exit "
          f"{statistics.median(stop):.2f} s ({', '.join(f'{x:.2f}' for x in stop)})")
    if cpu:
        print(f"CPU to ready (supervisor and components): {statistics.median(cpu):.2f} s "
              f"({', '.join(f'{x:.2f}' for x in cpu)})")
    if idle:
        print(f"idle, {args.idle:g} s after ready: {100 * statistics.median(idle):.1f}% of one "
              f"core ({', '.join(f'{100 * x:.1f}' for x in idle)})")


if __name__ == "__main__":
    main()
