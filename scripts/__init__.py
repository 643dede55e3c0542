"""Weir's tools, by purpose: ``bench/`` (benchmarks against Hugging Face and vLLM),
``reliability/`` (soak and fuzzers against a live engine) and ``gpu/`` (the GPU checks and
timings). They run as modules of this package, never as files: ``scripts/run bench/step ...``
(or ``python -m scripts.bench.step`` from the repo root), so every tool imports ``weir``,
``components``, ``tests.e2e`` and its neighbours by their full names and none edits
``sys.path``. ``scripts/run`` is the one bootstrap: it makes the venv and puts the repo root
on ``PYTHONPATH``.

Only the standard library here: ``scripts/gpu_check`` imports this package on a machine with
torch and nothing else of Weir's dependencies."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The repository's root (the tools' data, ``.bench/`` and the model paths hang off it)."""
