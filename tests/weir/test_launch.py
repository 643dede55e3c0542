"""A component dies with the supervisor that spawned it; starting one loads only what it needs."""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import weir.launch as b, time; b.die_with_parent(); print('up', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_component_dies_with_its_parent():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while True:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        stat = Path(f"/proc/{child}/stat")
        if stat.exists() and stat.read_text().split()[2] == "Z":
            return
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.02)


def test_launching_a_component_loads_neither_the_sdk_nor_torch():
    """Every component starts as ``python -m weir.launch``: the weir package loads its SDK
    names on first use, and kernels (machine facts, read by the scheduler) loads no torch."""
    probe = ("import sys, weir.launch, kernels.machine; "
             "print(sorted(m for m in ('weir.client', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    assert out.stdout.strip() == "[]"
    sdk = subprocess.run([sys.executable, "-c", "import weir; print(weir.Client.__module__)"],
                         cwd=ROOT, capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert sdk.stdout.strip() == "weir.client"
