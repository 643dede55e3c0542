"""The report's pictures, several runs side by side in each: the engine's timeline, TTFT and TPOT
CDFs per service class against their SLO, and each tenant's cumulative weighted service.

matplotlib is imported inside the functions (so importing this module costs nothing), and every
figure is drawn on its own Agg canvas: no pyplot, no global figure state. Margins are fixed
rather than computed by a layout engine, which would draw every figure twice."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from weir.replay.report import Summary
from weir.replay.types import COMPLETED, RunResult, Slo


def write_plots(runs: Sequence[RunResult], summaries: Sequence[Summary], out_dir: Path,
                slos: dict[str, Slo], default: Slo) -> list[Path]:
    """Write timeline.png, ttft_cdf.png, tpot_cdf.png and service.png into ``out_dir``;
    ``summaries[i]`` summarizes ``runs[i]``. Returns the paths written."""
    if len(runs) != len(summaries):
        raise ValueError(f"{len(runs)} runs but {len(summaries)} summaries")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    scaling = "\n".join(_scaling(run) for run in runs)
    figures = {
        "timeline.png": _timeline(runs, scaling),
        "ttft_cdf.png": _cdf(runs, slos, default, "TTFT", scaling),
        "tpot_cdf.png": _cdf(runs, slos, default, "TPOT", scaling),
        "service.png": _service(summaries, scaling),
    }
    paths = []
    for name, fig in figures.items():
        fig.savefig(out_dir / name, dpi=90)
        paths.append(out_dir / name)
    return paths


def _scaling(run: RunResult) -> str:
    s = run.scaling
    invalid = "" if run.valid else "  INVALID: " + "; ".join(run.invalid_reasons)
    return (f"{run.label} ({run.mode}): length ×{s.length:g}, time ×{s.time:g}, "
            f"block {s.block_size}, seed {s.seed}{invalid}")


def _figure(rows: int, title: str, axes_titles: bool = False):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    head = 0.2 + 0.16 * (title.count("\n") + 1) + 0.25 * axes_titles   # inches above the axes
    height = head + 0.6 + 2.5 * rows
    fig = Figure(figsize=(10, height))
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=9, y=1 - 0.1 / height, va="top")
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - head / height, bottom=0.6 / height,
                        hspace=0.3)
    return fig, fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]


def _offered(run: RunResult) -> tuple[list[float], list[float]]:
    """Arrivals per second as a step curve: equal buckets over the run's arrivals, about five
    arrivals a bucket, at most 60 buckets."""
    arrivals = sorted(r.arrival_s for r in run.records)
    if not arrivals:
        return [], []
    start, span = arrivals[0], arrivals[-1] - arrivals[0]
    buckets = max(1, min(60, len(arrivals) // 5))
    width = max(span / buckets, 0.001)
    counts = [0] * buckets
    for t in arrivals:
        counts[min(int((t - start) / width), buckets - 1)] += 1
    rates = [c / width for c in counts]
    return [start + k * width for k in range(buckets + 1)], rates + rates[-1:]


def _timeline(runs: Sequence[RunResult], scaling: str):
    fig, axes = _figure(4, "Engine timeline\n" + scaling)
    for run in runs:
        t, rate = _offered(run)
        axes[0].step(t, rate, where="post", label=run.label)
        line = run.timeline
        ts = [p.t_s for p in line]
        axes[1].plot(ts, [p.running for p in line], label=run.label)
        axes[2].plot(ts, [p.waiting for p in line], label=run.label)
        axes[3].plot([p.t_s for p in line if p.kv_total_blocks > 0],
                     [p.kv_used_blocks / p.kv_total_blocks for p in line
                      if p.kv_total_blocks > 0], label=run.label)
    for ax, ylabel in zip(axes, ("offered (req/s)", "running batch", "queue depth",
                                 "KV used (fraction)")):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[3].set_ylim(0, 1.05)
    axes[3].set_xlabel("time (s)")
    axes[0].legend(fontsize=8)
    return fig


def _cdf(runs: Sequence[RunResult], slos: dict[str, Slo], default: Slo, metric: str,
         scaling: str):
    """CDF of TTFT or TPOT (ms) of completed requests, a line per run/class, the SLO dashed."""
    fig, (ax,) = _figure(1, f"{metric} CDF of completed requests\n" + scaling)
    classes = sorted({r.service_class for run in runs for r in run.records})
    drawn = False
    for run in runs:
        for cls in classes:
            done = [r for r in run.records if r.terminal == COMPLETED and r.service_class == cls]
            values = [r.ttft_s if metric == "TTFT" else r.tpot_s for r in done]
            ms = sorted(v * 1000 for v in values if v is not None)
            if ms:
                ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post",
                        label=f"{run.label}/{cls}")
                drawn = True
    for k, cls in enumerate(classes):
        slo = slos.get(cls, default)
        bound = slo.ttft_ms if metric == "TTFT" else slo.tpot_ms
        ax.axvline(bound, color="black", linestyle=("--", ":", "-.")[k % 3], linewidth=1,
                   label=f"SLO {cls}: {bound:g} ms")
    if not drawn:
        ax.text(0.5, 0.5, "no completed requests", transform=ax.transAxes, ha="center")
    ax.set_xlabel(f"{metric} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if classes:
        ax.legend(fontsize=8)
    return fig


def _service(summaries: Sequence[Summary], scaling: str):
    fig, axes = _figure(max(1, len(summaries)), "Cumulative weighted service per tenant "
                        "(prompt ×1 + output ×2, ÷ weight)\n" + scaling, axes_titles=True)
    for ax, s in zip(axes, summaries):
        for tenant, curve in s.service_curves.items():
            ax.plot([t for t, _ in curve], [v for _, v in curve],
                    label=f"{tenant} (w={s.weights.get(tenant, 1.0):g})")
        ax.set_title(f"{s.label}: max backlogged service gap {s.max_backlogged_gap:.1f}",
                     fontsize=9)
        ax.set_ylabel("weighted service")
        ax.grid(alpha=0.3)
        if s.service_curves:
            ax.legend(fontsize=8)
    axes[-1].set_xlabel("time (s)")
    return fig
