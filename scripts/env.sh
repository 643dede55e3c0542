#!/usr/bin/env bash
# Create or reuse the project's virtual environment (.venv) and install Weir into it.
# Usage: source scripts/env.sh [extra]   e.g. "test". Reinstalls only when pyproject.toml changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${WEIR_VENV:-$ROOT/.venv}"
EXTRA="${1:-}"
STAMP="$VENV/.weir-stamp${EXTRA:+-$EXTRA}"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "weir: installing into $VENV ..." >&2
  # CPU torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
  quiet() { { grep -v "^WARNING: Location" || true; } >&2; }   # this machine's pip mirror notes
  "$VENV/bin/pip" install --quiet --disable-pip-version-check torch==2.13.0 2>&1 | quiet
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$ROOT${EXTRA:+[$EXTRA]}" 2>&1 | quiet
  # Hugging Face's `kernels` distribution (required by transformers >= 5.25, left behind when
  # pip moves transformers back below it) installs a top-level module `kernels`: Weir's name.
  if "$VENV/bin/python" -c "import importlib.metadata as m; m.distribution('kernels')" 2>/dev/null; then
    echo "weir: removing the PyPI package 'kernels' from $VENV: its module shadows Weir's kernels/" >&2
    "$VENV/bin/pip" uninstall --quiet --yes kernels 2>&1 | quiet
  fi
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
