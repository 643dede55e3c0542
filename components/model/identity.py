"""What a model is, as digests: the weights' files and the chat template, for a
deterministic request's pin (``schemas.client.Pinned``).

A model's digest is the sha256 over its files (a GGUF file, or a Hugging Face directory's
weights, config and tokenizer files, by name, in order). Reading a large model takes
seconds, so a digest is kept per file in the cache directory, keyed by the file's path,
size and modification time: a file changed in place is read again."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# the facts' names in the components' ``info()`` (``weir status``), which the streamer reads
# a pin from (components/streamer/pinned.py)
MODEL_SHA256 = "model.sha256"                  # the executor's
TEMPLATE_SHA256 = "chat_template.sha256"       # the tokenizer's
PLAN_ID = "kernel.deterministic_plan"          # the executor's (executor/determinism.plan_id)

_MODEL_FILES = ("*.gguf", "*.safetensors", "*.bin", "config.json", "generation_config.json",
                "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                "chat_template.json")


def model_files(path: Path) -> list[Path]:
    """The files a model's digest covers, in order."""
    if path.is_file():
        return [path]
    found = {f for pattern in _MODEL_FILES for f in path.glob(pattern) if f.is_file()}
    return sorted(found, key=lambda f: f.name)


def file_sha256(path: Path, cache: Path | None = None) -> str:
    """The sha256 of ``path``'s bytes, from ``cache`` (a JSON file) when it has this
    path at this size and modification time."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    known: dict[str, str] = {}
    if cache is not None:
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
        if isinstance(known, dict) and isinstance(known.get(key), str):
            return known[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        known = known if isinstance(known, dict) else {}
        known[key] = digest
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            tmp.replace(cache)
        except OSError:
            pass                      # a read-only cache: the digest is read again next start
    return digest


def model_sha256(path: Path, cache: Path | None = None) -> str:
    """The model's digest: its one file's sha256, or the sha256 over its files' names and
    digests."""
    files = model_files(path)
    if len(files) == 1 and path.is_file():
        return file_sha256(path, cache)
    blob = "\n".join(f"{f.name} {file_sha256(f, cache)}" for f in files)
    return hashlib.sha256(blob.encode()).hexdigest()


def text_sha256(text: str | None) -> str:
    """A chat template's digest ("" for none)."""
    return "" if text is None else hashlib.sha256(text.encode()).hexdigest()
