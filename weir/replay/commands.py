"""The ``weir replay``, ``weir simulate`` and ``weir calibrate`` commands: load and scale a
trace, synthesize its prompts, run it (live against targets, or simulated under configs),
and write one comparison: a table, per-request records, summary JSON and plots."""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from weir.replay.types import RunResult, Scaling, Slo, TraceRequest

DEFAULT_SLO = Slo(2000.0, 200.0)


def add_trace_args(p: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        p.add_argument("trace",
                       help="a trace file: Mooncake/Weir/OTel JSONL, Azure or BurstGPT CSV")
    p.add_argument("--format", default="auto",
                   help="auto (default), mooncake, azure, burstgpt, weir or otel")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every length by this (e.g. 0.0625 = ÷16)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every arrival time by this (> 1 stretches, lowering the rate)")
    p.add_argument("--block-size", type=int, default=512,
                   help="the trace's prefix block in tokens, before scaling (Mooncake: 512; "
                        "a request log names its own)")
    p.add_argument("--seed", type=int, default=0,
                   help="prompt synthesis seed (and the simulator's draws of accepted drafts)")
    p.add_argument("--start", type=int, default=0, help="skip this many requests first")
    p.add_argument("--limit", type=int, default=None, help="replay at most this many requests")
    p.add_argument("--slo", default=None,
                   help="default SLO, e.g. ttft=2000,tpot=200 (ms); default "
                        f"ttft={DEFAULT_SLO.ttft_ms:g},tpot={DEFAULT_SLO.tpot_ms:g}")
    p.add_argument("--slo-class", action="append", default=[], metavar="CLASS:ttft=..,tpot=..",
                   help="the SLO of one service class (repeatable)")
    p.add_argument("--class-mix", default=None, metavar="NAME=SHARE,...",
                   help="give requests without a class one of these, drawn by the seed "
                        "(e.g. interactive=0.7,batch=0.3)")
    p.add_argument("--tenant-mix", default=None, metavar="NAME=SHARE,...",
                   help="give requests without a tenant one of these, drawn by the seed")
    p.add_argument("--model", default=None,
                   help="the served model whose tokenizer builds the prompts (default: "
                        "the embedded default)")
    p.add_argument("--out", default=None,
                   help="directory for records, summary.json, comparison.txt and plots "
                        "(default: ./weir-replay-<time>)")
    p.add_argument("--no-plots", action="store_true")


def parse_slo(text: str) -> Slo:
    values = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("ttft", "tpot") or not value:
            raise ValueError(f"bad SLO {text!r}: expected ttft=MS,tpot=MS")
        values[key.strip()] = float(value)
    if len(values) != 2:
        raise ValueError(f"bad SLO {text!r}: give both ttft and tpot")
    return Slo(values["ttft"], values["tpot"])


def _slos(args) -> tuple[dict[str, Slo], Slo]:
    default = parse_slo(args.slo) if args.slo else DEFAULT_SLO
    per_class = {}
    for item in args.slo_class:
        name, _, spec = item.partition(":")
        per_class[name] = parse_slo(spec)
    return per_class, default


def load_scaled(args) -> tuple[list[TraceRequest], Scaling]:
    from weir.replay.synth import scale
    from weir.replay.traces import load_trace

    requests = load_trace(args.trace, args.format)
    end = None if args.limit is None else args.start + args.limit
    requests = requests[args.start:end]
    if not requests:
        raise ValueError(f"{args.trace}: no requests in --start/--limit's window")
    first = requests[0].arrival_s
    import msgspec

    requests = [msgspec.structs.replace(r, index=i, arrival_s=r.arrival_s - first)
                for i, r in enumerate(requests)]
    scaling = Scaling(length=args.length_scale, time=args.time_scale,
                      block_size=args.block_size, seed=args.seed)
    requests = _assign(requests, "service_class", args.class_mix, args.seed)
    requests = _assign(requests, "tenant", args.tenant_mix, args.seed + 1)
    return scale(requests, scaling), scaling


def _assign(requests: list[TraceRequest], field: str, mix: str | None,
            seed: int) -> list[TraceRequest]:
    """Give each request without ``field`` a value drawn from ``mix`` ("a=0.7,b=0.3")."""
    if not mix:
        return requests
    import random

    import msgspec

    names, weights = [], []
    for part in mix.split(","):
        name, _, share = part.partition("=")
        if not name.strip() or not share:
            raise ValueError(f"bad mix {mix!r}: expected NAME=SHARE,...")
        names.append(name.strip())
        weights.append(float(share))
    rng = random.Random(seed)
    return [r if getattr(r, field) else
            msgspec.structs.replace(r, **{field: rng.choices(names, weights)[0]})
            for r in requests]


def _out_dir(args) -> Path:
    out = Path(args.out or f"weir-replay-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _slug(label: str) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
    return keep.strip("_")[:60] or "run"


def write_outputs(runs: list[RunResult], args, out: Path) -> str:
    """Summaries, the comparison table (returned), records and plots."""
    from weir.replay.records import write_records
    from weir.replay.report import render_table, summarize, write_summary_json

    slos, default = _slos(args)
    for cls, slo in args.config_slos.items() if hasattr(args, "config_slos") else ():
        slos.setdefault(cls, slo)              # the config's classes, unless a flag says
    summaries = [summarize(run, slos, default, weights=run.meta.get("weights"))
                 for run in runs]     # a simulated run carries its config's tenant weights
    table = render_table(summaries)
    (out / "comparison.txt").write_text(table + "\n")
    write_summary_json(summaries, out / "summary.json")
    for i, run in enumerate(runs):
        write_records(run.records, out / f"records-{i}-{_slug(run.label)}.jsonl")
    if not args.no_plots:
        from weir.replay.plots import write_plots

        write_plots(runs, summaries, out, slos, default)
    return table


# ---------------------------------------------------------------------------- simulate
def parse_speculative(text: str) -> dict:
    """``--speculative``: "off", or ``METHOD:K[:ACCEPT][:CONTROL]`` (method "ngram" or
    "draft", k its ``max_k``, ACCEPT the acceptance rate, as the scheduler's prior and the
    simulated executor's true rate, CONTROL "scheduler" or "fixed"): the fields of the
    config's ``[speculative]`` section it sets."""
    parts = [p.strip() for p in text.split(":")]
    if parts == ["off"]:
        return {"method": "off"}
    control = parts.pop() if parts[-1] in ("scheduler", "fixed") else None
    if not 2 <= len(parts) <= 3 or parts[0] not in ("ngram", "draft"):
        raise ValueError(f"bad --speculative {text!r}: expected off or "
                         f"METHOD:K[:ACCEPT][:scheduler|fixed], e.g. ngram:4:0.7")
    try:
        out: dict = {"method": parts[0], "max_k": int(parts[1])}
        if len(parts) == 3:
            out["acceptance_prior"] = float(parts[2])
    except ValueError:
        raise ValueError(f"bad --speculative {text!r}: K is an integer and ACCEPT a "
                         f"number in [0, 1)") from None
    if control is not None:
        out["control"] = control
    return out


def with_speculative(cfg, text: str | None):
    """``cfg`` with its ``[speculative]`` section changed as ``--speculative text`` says
    (the rest of the section, per-class priors included, kept); ``cfg`` for None."""
    import msgspec

    if text is None:
        return cfg
    spec = msgspec.structs.replace(cfg.speculative, **parse_speculative(text))
    return msgspec.structs.replace(cfg, speculative=spec)


def pick_profile(given: str | None, command: str) -> tuple[Path, bool] | None:
    """The cost profile to simulate with: ``given``, else this machine's, else the shipped
    reference profile (said on stderr), and whether it is the reference; None (said) when
    ``given`` does not exist."""
    from weir.replay import profile as profiles

    prof_path = Path(given) if given else profiles.default_path()
    if prof_path.exists():
        return prof_path, False
    if given:
        print(f"weir {command}: no cost profile at {prof_path}", file=sys.stderr)
        return None
    # a new machine: the shipped profile, until `weir calibrate` measures this one
    print(f"weir {command}: no local cost profile at {prof_path}; using the shipped "
          f"reference profile ({profiles.reference_path().name}): its step times are another "
          f"machine's, so run `weir calibrate` to measure this one", file=sys.stderr)
    return profiles.reference_path(), True


def class_slos(cfg) -> dict[str, Slo]:
    """The SLOs a config's service classes set."""
    return {cls.name: Slo(cls.ttft_slo_ms if cls.ttft_slo_ms is not None else math.inf,
                          cls.tpot_slo_ms if cls.tpot_slo_ms is not None else math.inf)
            for cls in cfg.admission.classes
            if cls.ttft_slo_ms is not None or cls.tpot_slo_ms is not None}


def simulate_cmd(args) -> int:
    import msgspec

    from components.model.kv_sizing import sized
    from schemas.config import SpeculativeConfig, load_config
    from weir.replay import profile as profiles
    from weir.replay.sim import Simulator, fast_block_hashes
    from weir.replay.synth import PromptSynth, load_tokenizer

    requests, scaling = load_scaled(args)
    picked = pick_profile(args.profile, "simulate")
    if picked is None:
        return 2
    prof_path, reference = picked
    prof = profiles.load(prof_path)
    synth = PromptSynth.for_scaling(load_tokenizer(args.model), scaling)
    if args.autoscale:
        return _fleet(args, requests, scaling, prof, prof_path, reference, synth)
    runs = []
    args.config_slos = {}
    specs = args.speculative or [None]
    for text in specs:                   # a bad one stops the run before any simulates
        if text is not None:
            msgspec.structs.replace(SpeculativeConfig(), **parse_speculative(text))
    for path, text in ((p, t) for p in args.config or [None] for t in specs):
        cfg = with_speculative(sized(load_config(path, topology={"run_dir": "/nonexistent"})),
                               text)
        for name, slo in class_slos(cfg).items():   # SLOs from the configs' service classes
            args.config_slos.setdefault(name, slo)
        label = (path or "defaults") + (f" spec={text}" if text is not None else "")
        # compared with and without speculation, every run's scheduler starts from the
        # profile's step costs (k is chosen from them)
        sim = Simulator(cfg, prof, label=label, tokens=synth.token_ids,
                        hashes=fast_block_hashes(cfg.kv.block_size), seed=args.seed,
                        cost_prior=True if args.speculative else None)
        run = sim.run(requests, scaling)
        run.meta["config"] = path or "defaults"
        print(f"weir simulate: {run.label}: {len(requests)} requests in "
              f"{run.meta['sim_wall_s']:.2f} s", file=sys.stderr)
        if cfg.speculative.on:
            print(f"weir simulate: {run.label}: {speculation_line(run.meta['speculation'])}",
                  file=sys.stderr)
        runs.append(run)
    out = _out_dir(args)
    print(f"profile: {'the shipped reference profile, ' if reference else ''}{prof_path}: "
          f"{prof.describe()}")
    print(f"profile machine: {prof.machine.get('cpu', '?')} {prof.machine.get('flags', '')}")
    print(write_outputs(runs, args, out))
    print(f"wrote {out}/")
    return 0


def speculation_line(stats: dict) -> str:
    """One line of a simulated run's speculation counters (``SchedulerCore.spec_stats``)."""
    drafted = sum(v for k, v in stats.items() if k.startswith("spec.drafted."))
    accepted = sum(v for k, v in stats.items() if k.startswith("spec.accepted."))
    verifies = stats.get("spec.verifies", 0)
    rows = {int(k.rsplit(".", 1)[1]): v for k, v in stats.items() if k.startswith("spec.k.")}
    mean_k = sum(k * v for k, v in rows.items()) / max(sum(rows.values()), 1)
    return (f"speculation: {int(verifies)} verifies, {int(drafted)} drafted, "
            f"{int(accepted)} accepted ({accepted / drafted if drafted else 0:.0%}), "
            f"{stats.get('spec.emitted', 0) / verifies if verifies else 0:.2f} tokens per "
            f"verify, mean k {mean_k:.2f} over {int(sum(rows.values()))} decode rows")


def _fleet(args, requests, scaling, prof, prof_path, reference, synth) -> int:
    """``--autoscale``: one fleet run per rule over the same trace, under one config."""
    from components.model.kv_sizing import sized
    from schemas.config import load_config
    from weir.replay.autoscale import parse_rule
    from weir.replay.fleet import FleetSim, render_fleet_table, render_timeline
    from weir.replay.report import summarize
    from weir.replay.sim import fast_block_hashes

    if len(args.config) > 1:
        raise ValueError("--autoscale compares rules under one --config")
    path = args.config[0] if args.config else None
    cfg = sized(load_config(path, topology={"run_dir": "/nonexistent"}))
    args.config_slos = {}
    for cls in cfg.admission.classes:
        if cls.ttft_slo_ms is not None or cls.tpot_slo_ms is not None:
            args.config_slos.setdefault(cls.name, Slo(
                cls.ttft_slo_ms if cls.ttft_slo_ms is not None else math.inf,
                cls.tpot_slo_ms if cls.tpot_slo_ms is not None else math.inf))
    slos, default = _slos(args)
    for cls, slo in args.config_slos.items():
        slos.setdefault(cls, slo)
    ttfts = [s.ttft_ms for s in slos.values() if math.isfinite(s.ttft_ms)]
    ttft_slo_s = min(ttfts or [default.ttft_ms]) / 1e3
    bounds = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
              "up_window_s": args.scale_up_window_s,
              "down_window_s": args.scale_down_window_s}
    results, met = [], []
    for spec in args.autoscale:
        rule = parse_rule(spec, **bounds)
        sim = FleetSim(cfg, prof, rule, tokens=synth.token_ids,
                       hashes=fast_block_hashes(cfg.kv.block_size),
                       cold_start_s=args.cold_start_s, scale_interval_s=args.scale_interval_s,
                       ttft_slo_s=ttft_slo_s, average_queue=not args.queue_point_sample,
                       initial=args.replicas if rule.kind != "fixed" else None)
        res = sim.run(requests, scaling)
        res.run.meta["config"] = path or "defaults"
        print(f"weir simulate: {rule.label}: {len(requests)} requests, "
              f"{res.run.meta['replicas']} replicas in {res.run.meta['sim_wall_s']:.2f} s",
              file=sys.stderr)
        results.append(res)
        met.append(summarize(res.run, slos, default).slo_met)
    out = _out_dir(args)
    print(f"profile: {'the shipped reference profile, ' if reference else ''}{prof_path}: "
          f"{prof.describe()}")
    print(write_outputs([r.run for r in results], args, out))
    table = render_fleet_table(results, met)
    print(f"\nautoscalers: cold start {args.cold_start_s:g} s, every "
          f"{args.scale_interval_s:g} s, windows up {args.scale_up_window_s:g} s / down "
          f"{args.scale_down_window_s:g} s, replicas {args.min_replicas}-{args.max_replicas}, "
          f"TTFT SLO {ttft_slo_s * 1e3:g} ms")
    print(table)
    (out / "fleet.txt").write_text(table + "\n")
    for i, res in enumerate(results):
        (out / f"fleet-{i}-{_slug(res.rule.label)}.tsv").write_text(render_timeline(res))
    print(f"wrote {out}/")
    return 0


# ---------------------------------------------------------------------------- qualify
def qualify_cmd(args) -> int:
    """A candidate against the current config on one trace: exit 0 PASS, 1 FAIL."""
    from components.model.kv_sizing import sized
    from schemas.config import load_config
    from schemas.config_change import candidate, check
    from weir.replay import profile as profiles
    from weir.replay.qualify import judge, measure, render
    from weir.replay.sim import Simulator, fast_block_hashes
    from weir.replay.synth import PromptSynth, load_tokenizer
    from weir.replay.traces import request_log_block_size

    current = sized(load_config(args.against, topology={"run_dir": "/nonexistent"}))
    try:
        text = Path(args.candidate).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the candidate {args.candidate}: {exc.strerror}") from None
    cand = sized(candidate(current, text))         # a partial file lays over the current
    refused = check(current, cand, current)
    if args.block_size is None:                    # a request log names its own blocks
        args.block_size = request_log_block_size(args.trace) or 512
    requests, scaling = load_scaled(args)
    picked = pick_profile(args.profile, "qualify")
    if picked is None:
        return 2
    prof_path, reference = picked
    prof = profiles.load(prof_path)
    synth = PromptSynth.for_scaling(load_tokenizer(args.model), scaling)
    runs = []
    for label, cfg in ((args.against, current), (args.candidate, cand)):
        sim = Simulator(cfg, prof, label=label, tokens=synth.token_ids,
                        hashes=fast_block_hashes(cfg.kv.block_size), seed=args.seed)
        runs.append(sim.run(requests, scaling))
        print(f"weir qualify: {label}: {len(requests)} requests in "
              f"{runs[-1].meta['sim_wall_s']:.2f} s", file=sys.stderr)
    slos, default = _slos(args)
    for cls in current.admission.classes:          # a class with no target: completing is met
        slos.setdefault(cls.name, class_slos(current).get(cls.name, Slo(math.inf, math.inf)))
    classes = {r.index: r.service_class for r in runs[0].records}
    verdict = judge(measure(runs[0], classes, slos, default),
                    measure(runs[1], classes, slos, default), cand.rollout, refused)
    if args.out:
        args.config_slos = {}
        write_outputs(runs, args, _out_dir(args))
    if args.json:
        import msgspec

        print(msgspec.json.encode({
            "verdict": "PASS" if verdict.passed else "FAIL", **msgspec.to_builtins(verdict),
            "trace": args.trace, "requests": len(requests),
            "scaling": msgspec.to_builtins(scaling),
            "profile": str(prof_path), "reference_profile": reference}).decode())
    else:
        print(f"trace: {args.trace}, {len(requests)} requests, lengths x{scaling.length:g}, "
              f"time x{scaling.time:g}, block {scaling.block_size}; profile "
              f"{'(the shipped reference) ' if reference else ''}{prof_path}")
        print(render(verdict))
    return 0 if verdict.passed else 1


# ---------------------------------------------------------------------------- replay
def replay_cmd(args) -> int:
    import os

    import anyio
    import msgspec

    from weir.client import default_endpoint
    from weir.replay.live import HttpTarget, SdkTarget, replay
    from weir.replay.synth import PromptSynth, load_tokenizer

    requests, scaling = load_scaled(args)
    tokenizer = load_tokenizer(args.model)
    key = args.api_key or os.environ.get("WEIR_API_KEY")
    targets = args.target or [default_endpoint()]
    runs = []
    for i, target in enumerate(targets):
        # one server given the same prompts twice would answer the second run from its
        # prefix cache: --seed-per-target gives each target its own (same-shaped) prompts
        mine = msgspec.structs.replace(
            scaling, seed=scaling.seed + (i if args.seed_per_target else 0))
        synth = PromptSynth.for_scaling(tokenizer, mine)

        http = target.startswith("http")

        def prompt(req: TraceRequest, synth=synth, http=http):
            return synth.token_ids(req), synth.text(req) if http else ""

        t = (HttpTarget(target, args.served_model or "", key) if target.startswith("http")
             else SdkTarget(target, key))
        print(f"weir replay: {len(requests)} requests → {target}", file=sys.stderr)
        run = anyio.run(lambda t=t, mine=mine: replay(requests, t, prompt, scaling=mine,
                                                      closed_loop=args.closed_loop,
                                                      max_lag_ms=args.max_lag_ms))
        runs.append(run)
    out = _out_dir(args)
    print(write_outputs(runs, args, out))
    print(f"wrote {out}/ (each record's trace_id finds its trace in Jaeger)")
    return 0 if all(r.valid for r in runs) else 3


# ---------------------------------------------------------------------------- calibrate
def calibrate_cmd(args) -> int:
    from weir.replay import profile as profiles
    from weir.replay.calibrate import calibrate, from_steps

    out = Path(args.out) if args.out else profiles.default_path()
    if args.from_steps:
        prof = from_steps(args.from_steps, out)
    else:
        prof = calibrate(args.config, out, model=args.model, dtype=args.dtype,
                         max_model_len=args.max_model_len, device=args.device,
                         quick=args.quick)
    print(prof.describe())
    print(f"wrote {out}")
    return 0


def add_commands(sub) -> None:
    r = sub.add_parser("replay", help="replay a trace against live servers, open loop")
    add_trace_args(r)
    r.add_argument("--target", action="append", default=[],
                   help="a Weir SDK endpoint (tcp://, ipc://) or an OpenAI-compatible URL "
                        "(http://host:port); repeat to compare (default: $WEIR_ENDPOINT)")
    r.add_argument("--api-key", default=None, help="default $WEIR_API_KEY")
    r.add_argument("--served-model", default=None, help="the model name for HTTP targets")
    r.add_argument("--seed-per-target", action="store_true",
                   help="each target gets its own prompts (same lengths and sharing), for "
                        "targets that share one server's prefix cache")
    r.add_argument("--closed-loop", action="store_true",
                   help="a session's next turn waits for the previous answer")
    r.add_argument("--max-lag-ms", type=float, default=100.0,
                   help="a run whose p99 schedule lag exceeds this is invalid")
    r.set_defaults(func=_guard(replay_cmd, "replay"))

    s = sub.add_parser("simulate", help="run a trace through the real policies on a "
                                        "virtual clock, one run per --config")
    add_trace_args(s)
    s.add_argument("--config", action="append", default=[],
                   help="a Weir TOML config; repeat to compare side by side")
    s.add_argument("--speculative", action="append", default=[],
                   metavar="off|METHOD:K[:ACCEPT][:scheduler|fixed]",
                   help="override each config's [speculative] section, e.g. ngram:4:0.7 "
                        "(k per row chosen by the scheduler, up to 4, drafts accepted at "
                        "0.7) or ngram:4:0.7:fixed (every decode row drafts 4); repeat to "
                        "compare, one run per config and value")
    s.add_argument("--profile", default=None,
                   help="a cost profile from `weir calibrate` (default: this machine's, "
                        "~/.cache/weir/profiles/local.json, else the shipped reference "
                        "profile)")
    f = s.add_argument_group("fleet", "simulate a fleet of replicas behind the router's "
                             "routing policy, one run per --autoscale (weir/replay/fleet.py)")
    f.add_argument("--autoscale", action="append", default=[], metavar="KIND:TARGET",
                   help="fixed:N, rps:REQ_PER_S_PER_REPLICA, util:BUSY_FRACTION or "
                        "headroom:SHARE_OF_TTFT_SLO (predicted queue); repeat to compare")
    f.add_argument("--replicas", type=int, default=None,
                   help="replicas serving at the start (default: N for fixed, else "
                        "--min-replicas)")
    f.add_argument("--min-replicas", type=int, default=1)
    f.add_argument("--max-replicas", type=int, default=16)
    f.add_argument("--cold-start-s", type=float, default=30.0,
                   help="a new replica serves this long after it is asked for (paid from "
                        "the start)")
    f.add_argument("--scale-interval-s", type=float, default=15.0,
                   help="how often the autoscaler evaluates its rule")
    f.add_argument("--scale-up-window-s", type=float, default=0.0,
                   help="scale up to the lowest recommendation of this window")
    f.add_argument("--scale-down-window-s", type=float, default=300.0,
                   help="scale down to the highest recommendation of this window")
    f.add_argument("--queue-point-sample", action="store_true",
                   help="the headroom rule reads the predicted queue scraped at each "
                        "evaluation (default: its mean over the interval's load reports)")
    s.set_defaults(func=_guard(simulate_cmd, "simulate"))

    q = sub.add_parser("qualify", help="a candidate config against the current one on "
                                       "recorded traffic, simulated: PASS or FAIL against "
                                       "the candidate's [rollout] bars")
    q.add_argument("candidate", help="the candidate TOML (may be partial: laid over "
                                     "--against, as `weir config apply` lays it)")
    q.add_argument("--against", required=True, help="the config running now (TOML)")
    q.add_argument("--trace", required=True,
                   help="the traffic: an engine's request log (run dir requests.jsonl), "
                        "its span export, or a Mooncake/Azure/BurstGPT/Weir trace")
    add_trace_args(q, positional=False)
    q.set_defaults(block_size=None)
    q.add_argument("--profile", default=None,
                   help="a cost profile from `weir calibrate` (default: this machine's, else "
                        "the shipped reference profile)")
    q.add_argument("--json", action="store_true", help="print the verdict as JSON")
    q.set_defaults(func=_guard(qualify_cmd, "qualify"))

    c = sub.add_parser("calibrate", help="measure step costs on a local engine and write "
                                         "the cost profile `weir simulate` uses")
    c.add_argument("--config", default=None)
    c.add_argument("--model", default=None)
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    c.add_argument("--max-model-len", type=int, default=None)
    c.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    c.add_argument("--quick", action="store_true", help="fewer shapes (about half the time)")
    c.add_argument("--from-steps", default=None,
                   help="fit a step log (scheduler.step_log or gpu_check's) instead")
    c.add_argument("--out", default=None, help="default ~/.cache/weir/profiles/local.json")
    c.set_defaults(func=_guard(calibrate_cmd, "calibrate"))


def _guard(fn, name: str):
    """Input errors (a bad trace row, config or profile) end with one clear line."""
    def run(args) -> int:
        from schemas.config import ConfigError
        from weir.replay.profile import ProfileError
        from weir.replay.traces import TraceError

        try:
            return fn(args)
        except (TraceError, ConfigError, ProfileError, ValueError, OSError) as exc:
            print(f"weir {name}: {exc}", file=sys.stderr)
            return 2
    return run
