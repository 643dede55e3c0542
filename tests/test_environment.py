"""The environment the suite runs in: Weir's top-level ``kernels`` package is the one imported.

Hugging Face's ``kernels`` distribution (which transformers >= 5.25 requires) installs a
top-level module of the same name. Beside it, transformers imports Weir's package as its
own and fails, and every HF reference test errors at setup (as CI did on 2026-12-03).
"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_is_weirs_package():
    import kernels
    assert Path(kernels.__file__).resolve().parent == ROOT / "kernels"


def test_no_other_distribution_installs_a_kernels_module():
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise AssertionError(
        f"the PyPI package 'kernels' {dist.version} is installed ({dist.locate_file('')}); its "
        "module shadows Weir's kernels/. `pip uninstall kernels` (scripts/env.sh does) and keep "
        "transformers below 5.25 (pyproject.toml's test extra)")


def test_transformers_imports_from_the_repository_root():
    # the import chain that failed: a config class -> activations -> integrations.hub_kernels
    code = "import transformers.activations; from transformers import LlamaConfig; LlamaConfig()"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
