"""The kernel plans cached on this machine, as ``weir plan`` shows them: which are clean,
which provisional (measured under load or with timings that do not grow with the rows: see
:mod:`kernels.tuning_guard`), and marking one to be measured again at the next start.

Reads the plan files as JSON (no torch): a file under ``<cache>/tuning`` is a plan when it
has a ``linear`` table (the step-cost samples live beside them)."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

from kernels import tuning_guard


def plans(root: Path) -> list[dict[str, object]]:
    """One row per cached plan, newest first: key, when measured, the load then, status."""
    rows = []
    for path in root.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or "linear" not in data:
            continue
        guard = data.get("guard") or {}
        at = guard.get("measured_at") or path.stat().st_mtime
        rows.append({"key": str(data.get("key", path.stem)),
                     "measured": datetime.datetime.fromtimestamp(
                         float(at), datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
                     "load": f"{float(guard['load']):.0%}" if "load" in guard else "?",
                     "status": status(guard), "at": float(at)})
    rows.sort(key=lambda r: -r["at"])
    for r in rows:
        del r["at"]
    return rows


def status(guard: dict) -> str:
    if not guard:
        return "unchecked (measured before the guard: measured again at the next start)"
    if guard.get("remeasure"):
        return "remeasure at next start"
    why = guard.get("provisional")
    if not why:
        return "clean"
    left = tuning_guard.MAX_ATTEMPTS - int(guard.get("attempts", 1))
    return f"provisional: {why}" + (" (measured again at a quieter start)" if left > 0 else
                                   " (kept: out of attempts)")


def mark_remeasure(path: Path) -> None:
    """The next start measures this plan again and replaces it (tuning_guard.due/better),
    under the lock executors measure under."""
    from kernels import tuning  # torch: only when a plan is changed

    with tuning.measuring(path):
        data = tuning.load_cached(path)
        if data is None:
            raise ValueError(f"{path} is not a readable kernel plan")
        data["guard"] = {**(data.get("guard") or {}), "remeasure": True}
        tuning.store(path, data)
