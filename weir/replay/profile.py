"""Cost profiles: a step's time as a function of its shape, fitted to measured steps.

The simulator's executor takes its step times from a profile. A profile is fitted to a
step log: the JSON lines the scheduler writes with ``scheduler.step_log`` set (one per
step: its shape and the time from plan sent to result read, so bus round trips are
included), or lines of the same form that ``scripts/gpu_check`` writes from timed steps on
a GPU. ``weir calibrate`` runs a workload on the live engine to produce such a log and fits
it.

Model: ``seconds = c0 + c1·tokens + c2·pairs + c3·seqs + c4·context``, every coefficient
non-negative (a step never gets cheaper with more work), fitted by least squares on
*relative* error so a 10 ms decode step counts as much as a 500 ms prefill. ``pairs`` (query
rows × the keys each sees) carries attention's quadratic prefill cost; ``context`` its
per-position decode cost.
"""
from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from components.costs.cost_model import FEATURES, StepShape, fit_relative


class ProfileError(ValueError):
    pass


class CostProfile(msgspec.Struct, kw_only=True):
    coef: list[float]                           # seconds per unit of each of FEATURES
    features: tuple[str, ...] = FEATURES
    samples: int = 0
    median_rel_error: float = 0.0               # |predicted − measured| / measured
    p90_rel_error: float = 0.0
    source: str = ""                            # what measured the steps
    machine: dict = {}                          # kernels.machine.describe() where they ran
    engine: dict = {}                           # model, dtype, device, token budget

    def predict(self, shape: StepShape) -> float:
        c = self.coef
        return (c[0] + c[1] * shape.tokens + c[2] * shape.pairs + c[3] * shape.seqs
                + c[4] * shape.context)

    def describe(self) -> str:
        terms = ", ".join(f"{name} {value:.3g}" for name, value in zip(self.features, self.coef))
        return (f"{self.source or 'profile'}: {terms} s/unit; {self.samples} steps, "
                f"median error {self.median_rel_error:.1%}")


def _row(sample: dict) -> list[float]:
    return [1.0, sample["tokens"], sample["pairs"], sample["seqs"], sample["context"]]


def fit(samples: list[dict], *, source: str = "", machine: dict | None = None,
        engine: dict | None = None) -> CostProfile:
    """Fit, then refit without the steps the first fit misses by more than 3× its median
    error (a step stalled by something else on the machine is not the step's cost)."""
    good = [s for s in samples if s.get("measured_s", 0) > 0 and s.get("tokens", 0) > 0]
    if len(good) < len(FEATURES) * 2:
        raise ProfileError(f"a profile needs at least {len(FEATURES) * 2} measured steps, "
                           f"got {len(good)}")
    x = np.array([_row(s) for s in good], dtype=np.float64)
    y = np.array([s["measured_s"] for s in good], dtype=np.float64)
    coef = np.array(fit_relative(x, y))
    rel = np.abs(x @ coef - y) / y
    keep = rel <= max(3 * float(np.median(rel)), 0.05)
    if keep.sum() >= len(FEATURES) * 2 and not keep.all():
        coef = np.array(fit_relative(x[keep], y[keep]))
    rel = np.abs(x @ coef - y) / y
    return CostProfile(coef=[float(c) for c in coef], samples=len(good),
                       median_rel_error=float(np.median(rel)),
                       p90_rel_error=float(np.percentile(rel, 90)), source=source,
                       machine=machine or {}, engine=engine or {})


_SAMPLE_KEYS = ("tokens", "context", "seqs", "pairs", "measured_s")


def read_step_log(path: str | Path) -> list[dict]:
    """The steps of a step log; a malformed line is an error naming file and line."""
    out = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = msgspec.json.decode(line)
            except msgspec.DecodeError as exc:
                raise ProfileError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(row, dict) or any(
                    not isinstance(row.get(k), (int, float)) or isinstance(row.get(k), bool)
                    for k in _SAMPLE_KEYS):
                raise ProfileError(f"{path}:{number}: a step needs numeric "
                                   f"{', '.join(_SAMPLE_KEYS)}")
            out.append(row)
    return out


def save(profile: CostProfile, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile)) + b"\n")


def load(path: str | Path) -> CostProfile:
    try:
        profile = msgspec.json.decode(Path(path).read_bytes(), type=CostProfile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProfileError(f"{path}: not a cost profile ({exc})") from None
    if len(profile.coef) != len(FEATURES) or tuple(profile.features) != FEATURES:
        raise ProfileError(f"{path}: a profile needs coefficients for {', '.join(FEATURES)}")
    return profile


def default_path() -> Path:
    """Where ``weir calibrate`` writes, and ``weir simulate`` looks, by default."""
    base = Path.home() / ".cache" / "weir" / "profiles"
    return base / "local.json"


def reference_path() -> Path:
    """The calibrated profile shipped with Weir (``weir calibrate`` on a 2-core Intel Xeon
    with AMX, the default model, float32, bus round trips included): what ``weir simulate``
    runs on until this machine has a profile of its own."""
    return Path(__file__).resolve().parent / "profiles" / "reference-cpu.json"
