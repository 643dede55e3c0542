"""The report's plots: two runs side by side produce the four PNGs, and the module imports
matplotlib only when it draws."""
import ast
from pathlib import Path

import pytest

from weir.replay import plots
from weir.replay.plots import write_plots
from weir.replay.report import summarize
from weir.replay.types import REJECTED, RequestRecord, RunResult, Scaling, Slo, TimelinePoint

PNG = b"\x89PNG\r\n\x1a\n"
SLOS, DEFAULT = {"chat": Slo(200, 40)}, Slo(1000, 100)


def _run(label, scale, valid=True):
    recs = [RequestRecord(index=i, request_id=f"{label}{i}", tenant=("a", "b")[i % 2],
                          service_class=("chat", "batch")[i % 3 == 0], arrival_s=i * 0.2 * scale,
                          sent_s=i * 0.2 * scale, ttft_s=0.05 + 0.02 * i, itl_s=[0.03] * 4,
                          e2e_s=0.17 + 0.02 * i, prompt_tokens=32, output_tokens=5)
            for i in range(8)]
    recs.append(RequestRecord(index=8, request_id=f"{label}8", arrival_s=1.0, sent_s=1.0,
                              terminal=REJECTED, decision="reject"))
    timeline = [TimelinePoint(t * 0.25, t % 3, t % 2, 4 * t, 64) for t in range(10)]
    return RunResult(label=label, mode="simulated", records=recs, timeline=timeline,
                     scaling=Scaling(time=scale), duration_s=2.5 * scale, valid=valid)


def test_two_runs_make_four_pngs(tmp_path):
    runs = [_run("fcfs", 1.0), _run("vtc", 2.0, valid=False)]
    summaries = [summarize(r, SLOS, DEFAULT) for r in runs]
    paths = write_plots(runs, summaries, tmp_path / "plots", SLOS, DEFAULT)
    assert [p.name for p in paths] == ["timeline.png", "ttft_cdf.png", "tpot_cdf.png",
                                       "service.png"]
    for p in paths:
        assert p.parent == tmp_path / "plots"
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 1000


def test_runs_and_summaries_must_pair_up(tmp_path):
    with pytest.raises(ValueError):
        write_plots([_run("a", 1.0)], [], tmp_path, SLOS, DEFAULT)


def test_matplotlib_is_imported_only_inside_functions():
    tree = ast.parse(Path(plots.__file__).read_text())
    top = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    top += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert top and not [name for name in top if name.startswith("matplotlib")]
