"""``python -m weir.launch COMPONENT CONFIG_JSON``: run one component as this process."""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
from pathlib import Path

import msgspec

from bus.component import run
from components import service_class
from schemas.config import WeirConfig

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A component never outlives the supervisor that spawned it (Linux): a supervisor
    killed without draining takes its children along instead of leaving them serving
    nobody. Elsewhere the supervisor's heartbeat timeout is the only bound."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    name, config_path = argv
    die_with_parent()
    config = msgspec.json.decode(Path(config_path).read_bytes(), type=WeirConfig)
    run(service_class(name), config, Path(config_path).parent)
    # Stopped cleanly: sockets closed, traces flushed. Python's own teardown (freeing the
    # interpreter's objects one by one: torch's modules, the vocabulary's dicts) took
    # 0.5-1.5 s more per process, and every stop or restart of the engine waited on it.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
