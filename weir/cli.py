"""The ``weir`` command: serve, generate, status, replay, simulate, calibrate, ...

Past 400 lines, most of it the argument parser of every subcommand; each subcommand is a
short function that loads a config and calls the library (the replay tools' own bodies
are in weir/replay/commands.py)."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from datetime import UTC
from pathlib import Path

from components.model.kv_sizing import sized
from schemas.config import ConfigError, load_config


def _serve(args: argparse.Namespace) -> int:
    from bus import curve
    from bus.log import configure
    from bus.supervisor import Supervisor
    from components.model.fetch import resolve_model
    from weir.client import default_endpoint

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="weir-run-")
    try:
        config = load_config(
            args.config,
            topology={"run_dir": run_dir, "client_endpoint": args.endpoint or default_endpoint()},
            engine={"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
                    "device": args.device},
            kv={"num_blocks": args.num_blocks, "memory_gib": args.kv_memory_gib,
                "cpu_memory_gib": args.kv_cpu_memory_gib},
            scheduler={"step_log": args.step_log},
            admission={"policy": args.admission_policy},
            gateway={"port": args.http_port or _env_int("WEIR_HTTP_PORT")})
        config = sized(config)
    except ConfigError as exc:
        print(f"weir serve: {exc}", file=sys.stderr)
        return 2
    configure("supervisor", config.log_level)
    curve.configure(config)
    print(f"weir: model {resolve_model(config.engine.model)}", file=sys.stderr)

    def ready(sup: Supervisor) -> None:
        http = (f", http://{config.gateway.host}:{config.gateway.port}/v1"
                if config.gateway.enabled else "")
        print(f"weir: admission {config.admission.describe()}", file=sys.stderr)
        print(f"weir: ready on {config.topology.client_endpoint}{http} "
              f"(run dir {run_dir})", file=sys.stderr, flush=True)

    return _run_supervisor(Supervisor(config).serve, ready, "weir serve")


def _route(args: argparse.Namespace) -> int:
    """``weir route``: the router (and an HTTP gateway in front of it) under a supervisor."""
    import msgspec

    from bus import curve
    from bus.log import configure
    from bus.supervisor import Supervisor
    from weir.client import default_endpoint
    from weir.forms import replica_address

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="weir-route-")
    router: dict = {"policy": args.policy}
    try:
        if args.replica:
            router["replicas"] = [msgspec.structs.asdict(replica_address(item))
                                  for item in args.replica]
        config = load_config(
            args.config,
            topology={"run_dir": run_dir, "transport": "ipc",
                      "client_endpoint": args.endpoint or (
                          None if args.config else default_endpoint())},
            engine={"model": args.model},
            gateway={"port": args.http_port or _env_int("WEIR_HTTP_PORT")},
            router=router)
        if not config.router.replicas and config.router.discovery == "static":
            raise ConfigError("no replicas: give --replica NAME=ENDPOINT[,KV_EVENTS] or "
                              "[[router.replicas]] in the config, or router.discovery")
    except (ConfigError, ValueError) as exc:
        print(f"weir route: {exc}", file=sys.stderr)
        return 2
    configure("supervisor", config.log_level)
    curve.configure(config)

    def ready(sup: Supervisor) -> None:
        http = (f", http://{config.gateway.host}:{config.gateway.port}/v1"
                if config.gateway.enabled else "")
        rc = config.router
        names = ", ".join([r.name for r in rc.replicas] + (
            [f"the replicas {rc.discovery_name} resolves to"] if rc.discovery == "dns" else []))
        print(f"weir: routing on {config.topology.client_endpoint}{http} to {names} "
              f"({config.router.policy})", file=sys.stderr, flush=True)

    return _run_supervisor(Supervisor(config, components=("router",)).serve, ready,
                           "weir route")


def _run_supervisor(serve, ready, prog: str) -> int:
    """Run a supervisor's ``serve`` until it stops: its status (0, or 3 when a component
    was given up on: bus.supervisor.EXIT_GIVEN_UP), or 1 with its startup error as one line
    (the supervisor's task group wraps it in an exception group)."""
    import anyio

    from bus.component import find_in_group
    from bus.supervisor import StartupError

    try:
        code = anyio.run(serve, ready)
    except BaseException as exc:
        if (failed := find_in_group(exc, StartupError)) is None:
            raise
        print(f"{prog}: {failed}", file=sys.stderr)
        return 1
    if code:
        print(f"{prog}: a component stayed down past supervisor.max_restarts; exiting "
              f"{code} so that its process manager starts it again", file=sys.stderr)
    return code or 0


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _trace(args: argparse.Namespace) -> int:
    from weir.trace_view import load, render, render_steps, steps, timeline

    if not args.steps and not args.request_id:
        print("weir trace: give a REQUEST_ID, or --steps for the scheduler's steps",
              file=sys.stderr)
        return 2
    ids = re.fullmatch(r"(\d*)(\.\.(\d*))?", args.step_ids)
    if ids is None or (ids[2] and not (ids[1] or ids[3])):
        print(f"weir trace: --step-ids wants FIRST..LAST, FIRST.., ..LAST or one step id, not "
              f"{args.step_ids!r}", file=sys.stderr)
        return 2
    first = int(ids[1] or 0)
    if ids[2]:                                              # a range: FIRST..LAST
        last = int(ids[3]) if ids[3] else None
    else:                                                   # one id, or all
        last = first if ids[1] else None
    try:
        spans = load(args.file)
        if args.steps:
            text = render_steps(steps(spans, first, last), min(s["start_ns"] for s in spans))
        else:
            text = render(timeline(spans, args.request_id), args.request_id)
    except (OSError, LookupError, ValueError) as exc:
        print(f"weir trace: {exc}", file=sys.stderr)
        return 1
    print(text)
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    from components.gateway.auth import hash_key

    print(hash_key(args.key))
    return 0


def _config_or_exit(args: argparse.Namespace):
    try:
        return sized(load_config(args.config))
    except ConfigError as exc:
        sys.exit(f"weir {args.command}: {exc}")


def _component(args: argparse.Namespace) -> int:
    """Run one component in this process (compose / multi-host deployments)."""
    from bus.component import run
    from components import service_class

    run(service_class(args.name), _config_or_exit(args))
    return 0


def _supervise(args: argparse.Namespace) -> int:
    """Watch components started elsewhere: heartbeats, status relay, drain on SIGTERM."""
    import anyio

    from bus import curve
    from bus.log import configure
    from bus.supervisor import Supervisor

    config = _config_or_exit(args)
    configure("supervisor", config.log_level)
    curve.configure(config)
    return anyio.run(Supervisor(config, spawn=False).serve, None) or 0


def _keys(args: argparse.Namespace) -> int:
    from bus.curve import generate
    from bus.identity import generate_service_key

    d = generate(args.dir)
    generate_service_key(d / "service.key")      # the gateway's credential to the streamer
    # an operator's (weir config, weir replicas): WEIR_OPERATOR_KEY_FILE in a deployment
    generate_service_key(d / "operator.key")
    print(d)
    return 0


def _file_or_text(value: str) -> str:
    """``@path``: the file's text; anything else: itself."""
    return Path(value[1:]).read_text() if value.startswith("@") else value


def _generate(args: argparse.Namespace) -> int:
    from weir.client import Client
    from weir.errors import WeirError

    params = {"max_tokens": args.max_tokens, "temperature": args.temperature,
              "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
              "presence_penalty": args.presence_penalty,
              "frequency_penalty": args.frequency_penalty,
              "repetition_penalty": args.repetition_penalty, "logprobs": args.logprobs,
              "min_tokens": args.min_tokens, "prompt_logprobs": args.prompt_logprobs}
    if args.ignore_eos:
        params["ignore_eos"] = True
    forms = {"json": args.json_schema, "regex": args.regex, "choice": args.choice,
             "grammar": args.grammar, "json_object": args.json_object or None}
    forms = {k: v for k, v in forms.items() if v is not None}
    if forms:
        if len(forms) > 1:
            print("weir generate: give one of --json-schema, --json-object, --regex, --choice "
                  "and --grammar", file=sys.stderr)
            return 2
        try:
            params["structured"] = {k: _file_or_text(v) if k in ("json", "grammar") else v
                                    for k, v in forms.items()}
        except OSError as exc:
            print(f"weir generate: {exc}", file=sys.stderr)
            return 2
    if args.chat:
        kwargs = {"messages": [{"role": "user", "content": args.prompt}]}
    else:
        kwargs = {"prompt": args.prompt}
    try:
        with Client(args.endpoint, tenant=args.tenant, timeout=args.timeout) as client:
            stream = client.stream(**kwargs, **params, service_class=args.service_class)
            for delta in stream:
                if not args.json:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
            result = stream.result
    except WeirError as exc:
        print(f"\nweir generate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        sys.stdout.write("\n")
        if result.degraded:
            print(f"weir generate: degraded by admission to max_tokens={result.max_tokens} "
                  f"(class {result.service_class})", file=sys.stderr)
    return 0


def _replicas(args: argparse.Namespace) -> int:
    """A router's replicas: listed (its status), or changed (an operator's key)."""
    from weir.client import Client
    from weir.errors import WeirError

    try:
        with Client(args.endpoint) as client:
            if args.action == "list":
                router = next((c for c in client.status(timeout=args.timeout).components
                               if c.name == "router"), None)
                if router is None:
                    print("weir replicas: this endpoint is not a router", file=sys.stderr)
                    return 1
                stats = router.stats
                names = sorted({k.split(".")[1] for k in stats if k.startswith("replica.")})
                out = {n: {"pool": router.info.get(f"replica.{n}.pool", "default"),
                           "healthy": bool(stats.get(f"replica.{n}.healthy")),
                           "retiring": bool(stats.get(f"replica.{n}.retiring")),
                           "discovered": bool(stats.get(f"replica.{n}.discovered")),
                           "open": int(stats.get(f"replica.{n}.open", 0))} for n in names}
            else:
                done = (client.change_replicas(add=args.replicas, timeout=args.timeout)
                        if args.action == "add" else
                        client.change_replicas(remove=args.replicas, timeout=args.timeout))
                out = {"replicas": list(done.replicas), "retiring": list(done.retiring),
                       "pools": dict(done.pools)}
    except (WeirError, ValueError) as exc:
        print(f"weir replicas: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


def _config(args: argparse.Namespace) -> int:
    """An engine's or a router's live config (an operator's key): apply a TOML file, roll
    back, or list the versions."""
    import getpass
    from datetime import datetime

    import msgspec

    from weir.client import Client
    from weir.errors import WeirError

    try:
        if args.action == "apply" and not args.target:
            raise ValueError("apply needs a TOML file")
        toml = ("" if args.action != "apply" else sys.stdin.read() if args.target == "-"
                else Path(args.target).read_text())
        version = int(args.target) if args.action == "rollback" and args.target else None
        with Client(args.endpoint) as client:
            answer = client.config(args.action, toml, version,
                                   args.actor or getpass.getuser(), args.timeout)
    except (WeirError, OSError, ValueError) as exc:
        print(f"weir config {args.action}: {exc}", file=sys.stderr)
        return 1
    rows = answer.history if args.action == "history" else (answer.current,)
    for v in rows:
        if v is None:
            continue
        if args.json:
            print(json.dumps(msgspec.to_builtins(v)))
            continue
        when = datetime.fromtimestamp(v.applied_at, UTC).isoformat(timespec="seconds")
        what = (f"rollback to {v.rollback_of}" if v.rollback_of is not None
                else f"promotion of {v.promotion_of}" if v.promotion_of is not None
                else ", ".join(v.changed) or "-")
        if v.rollout != "off":
            what = f"{v.rollout} trial: {what}"
        if v.reason:
            what += f" ({v.reason})"
        print(f"version {v.version:<4} sha256 {v.sha256[:16]} {when} by {v.applied_by}: {what}")
    return 0


def _status(args: argparse.Namespace) -> int:
    import msgspec

    from weir.client import Client
    from weir.errors import WeirError

    try:
        with Client(args.endpoint) as client:
            report = client.status(timeout=args.timeout)
    except WeirError as exc:
        print(f"weir status: {exc}", file=sys.stderr)
        return 1
    comps = {c.name: c for c in report.components}
    if args.component:                      # health check: exit 0 iff that component is ready
        c = comps.get(args.component)
        ok = c is not None and c.alive and c.state == "ready"
        print(f"{args.component}: {'ready' if ok else 'not ready'}")
        return 0 if ok else 1
    sched = comps.get("scheduler").stats if "scheduler" in comps else {}
    kv = comps.get("kv_manager").stats if "kv_manager" in comps else {}
    adm = comps.get("admission").stats if "admission" in comps else {}
    out = {
        "draining": report.draining,
        "components": {c.name: {"alive": c.alive, "pid": c.pid, "state": c.state,
                                "restarts": c.restarts, "heartbeat_age_s": c.heartbeat_age_s}
                       for c in report.components},
        "admission": {
            "outstanding": int(adm.get("outstanding", 0)), "queued": int(adm.get("queued", 0)),
            "reserved_kv_blocks": int(adm.get("reserved_kv_blocks", 0)),
            "queue_depth": {k.split(".", 1)[1]: int(v) for k, v in adm.items()
                            if k.startswith("queue_depth.")},
            "rejections": {k.split(".", 1)[1]: int(v) for k, v in adm.items()
                           if k.startswith("rejections.")}},
        "scheduler": {"running": int(sched.get("running", 0)),
                      "waiting": int(sched.get("waiting", 0)),
                      "preemptions": {"recompute": int(sched.get("preemptions.recompute", 0)),
                                      "swap": int(sched.get("preemptions.swap", 0))},
                      "wasted_tokens": int(sched.get("wasted_tokens", 0))},
        "tenants": {t: msgspec.structs.asdict(u) for c in report.components
                    for t, u in sorted(c.tenants.items())},
        "kv": {"total_blocks": int(kv.get("total_blocks", 0)),
               "free_blocks": int(kv.get("free_blocks", 0)),
               "cached_blocks": int(kv.get("cached_blocks", 0)),
               # None until the kv_manager has reported (while starting)
               "usage": (round(1 - kv["free_blocks"] / kv["total_blocks"], 4)
                         if kv.get("total_blocks") else None),
               "cpu_total_blocks": int(kv.get("cpu_total_blocks", 0)),
               "cpu_free_blocks": int(kv.get("cpu_free_blocks", 0)),
               "cpu_cached_blocks": int(kv.get("cpu_cached_blocks", 0)),
               "swapped_seqs": int(kv.get("swapped_seqs", 0)),
               "prefix_query_tokens": int(kv.get("prefix_query_tokens", 0)),
               "prefix_hit_tokens": int(kv.get("prefix_hit_tokens", 0)),
               "below_watermark": bool(kv.get("below_watermark", 0))},
        # admission's policy and the service classes in force
        "policy": (comps["admission"].info.get("admission")
                   if "admission" in comps else None),
        # the live config version admission and the scheduler decide by (weir config)
        "config": {"admission_version": int(adm.get("config_version", 0)),
                   "scheduler_version": int(sched.get("config_version", 0)),
                   "sha256": (comps["admission"].info.get("config_sha256", "")
                              if "admission" in comps else "")},
        # the executor's kernel plan: what runs each operation, and how it was chosen
        "kernels": {k.split(".", 1)[1]: v for k, v in (
            comps["executor"].info if "executor" in comps else {}).items()
            if k.startswith("kernel.")},
    }
    if "router" in comps:                   # a router in front of replicas (weir route)
        rs = comps["router"].stats
        names = sorted({k.split(".")[1] for k in rs if k.startswith("replica.")})
        out["router"] = {
            "active_requests": int(rs.get("active_requests", 0)),
            "sessions": int(rs.get("sessions", 0)),
            "session_moves": int(rs.get("session_moves", 0)),
            "rerouted": int(rs.get("requests.rerouted", 0)),
            "decisions": {k.split(".", 2)[2]: int(v) for k, v in rs.items()
                          if k.startswith("requests.reason.")},
            # the router's own live config version (weir config --endpoint ROUTER)
            "config": {"version": int(rs.get("config_version", 0)),
                       "sha256": comps["router"].info.get("config_sha256", ""),
                       "policy": comps["router"].info.get("router_policy", "")},
            "replicas": {n: {"pool": comps["router"].info.get(f"replica.{n}.pool", "default"),
                             **{k.split(".", 2)[2]: v for k, v in rs.items()
                                if k.startswith(f"replica.{n}.")}} for n in names},
            # a canary by pool (components/router/pool_canary.py): 0 when none runs
            "pool_canary": {k.split(".", 1)[1]: v for k, v in rs.items()
                            if k.startswith("pool_canary.")}}
    if args.json:
        print(json.dumps(out))
        return 0
    if "router" in out:
        r = out["router"]
        print(f"router       active {r['active_requests']} sessions {r['sessions']} moves "
              f"{r['session_moves']} rerouted {r['rerouted']} " + " ".join(
                  f"{k} {v}" for k, v in sorted(r["decisions"].items())))
        rcv = r["config"]
        print(f"router       config version {rcv['version']} policy {rcv['policy']}"
              + (f" sha256 {rcv['sha256'][:16]}" if rcv["sha256"] else ""))
        for n, rep in r["replicas"].items():
            print(f"replica {n:12} pool {rep.get('pool', 'default'):10} "
                  f"{'healthy' if rep.get('healthy') else 'OUT':7} open "
                  f"{int(rep.get('open', 0))} routed {int(rep.get('routed', 0))} cached view "
                  f"{int(rep.get('index_blocks', 0))} blocks "
                  f"(gaps {int(rep.get('index_gaps', 0))})")
    for name, c in out["components"].items():
        print(f"{name:12} {'alive' if c['alive'] else 'DEAD':5} pid {c['pid']:<7} {c['state']}")
    s = out["scheduler"]
    a = out["admission"]
    if out["policy"]:
        print(f"policy       {out['policy']}")
    cv = out["config"]
    print(f"config       version {cv['admission_version']} (scheduler "
          f"{cv['scheduler_version']}){' sha256 ' + cv['sha256'][:16] if cv['sha256'] else ''}")
    print(f"admission    outstanding {a['outstanding']} queued {a['queued']} reserved_kv_blocks "
          f"{a['reserved_kv_blocks']}" + "".join(f" rejected[{k}] {v}"
                                                 for k, v in sorted(a["rejections"].items())))
    print(f"scheduler    running {s['running']} waiting {s['waiting']} preemptions "
          f"recompute {s['preemptions']['recompute']} swap {s['preemptions']['swap']} "
          f"wasted_tokens {s['wasted_tokens']}")
    k = out["kv"]
    print(f"kv           total {k['total_blocks']} free {k['free_blocks']} "
          f"cached {k['cached_blocks']}"
          f" usage {'unknown' if k['usage'] is None else format(k['usage'], '.1%')}"
          f"{' BELOW WATERMARK' if k['below_watermark'] else ''}")
    print(f"kv cpu tier  total {k['cpu_total_blocks']} free {k['cpu_free_blocks']} cached "
          f"{k['cpu_cached_blocks']} swapped_seqs {k['swapped_seqs']}")
    print(f"prefix cache hit {k['prefix_hit_tokens']} of {k['prefix_query_tokens']} tokens")
    if out["kernels"]:
        print("kernels      " + ", ".join(f"{k} {v}" for k, v in out["kernels"].items()))
    for tenant, u in out["tenants"].items():
        print(f"tenant {tenant:12} processed {u['processed_tokens']} generated "
              f"{u['generated_tokens']} tokens, kv_blocks {u['kv_blocks']}, virtual_counter "
              f"{u.get('virtual_counter', 0)}, running {u.get('running', 0)}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """The kernel plans cached on this machine (``<cache>/tuning``): whether each is clean or
    provisional (kernels/tuning_guard.py), and ``--remeasure`` to have the next start
    measure one (``--key``) or all of them again."""
    from components.executor.plan_cache import mark_remeasure, plans
    from components.model.fetch import cache_dir

    root = cache_dir() / "tuning"
    found = plans(root)
    if args.key:
        found = [p for p in found if p["key"].startswith(args.key)]
        if not found:
            print(f"no cached kernel plan with key {args.key!r} under {root}", file=sys.stderr)
            return 1
    if args.remeasure:
        for p in found:
            mark_remeasure(root / f"{p['key']}.json")
            p["status"] = "remeasure at next start"
    if args.json:
        print(json.dumps(found))
        return 0
    for p in found:
        print(f"{p['key']}  {p['measured']:19}  load {p['load']:>5}  {p['status']}")
    if not found:
        print(f"no cached kernel plans under {root}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir", description="Weir LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    endpoint_help = "client endpoint (default $WEIR_ENDPOINT or tcp://127.0.0.1:7450)"

    s = sub.add_parser("serve", help="run every component locally")
    s.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory")
    s.add_argument("--config", default=None, help="a TOML config file")
    s.add_argument("--endpoint", default=None, help=endpoint_help)
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                   help="where the executor runs (auto: the first GPU if any)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool")
    s.add_argument("--kv-memory-gib", type=float, default=None,
                   help="the KV pool in GiB instead: the blocks that fit (kv.memory_gib)")
    s.add_argument("--kv-cpu-memory-gib", type=float, default=None,
                   help="the host-memory KV tier in GiB (kv.cpu_memory_gib; vLLM's swap space)")
    s.add_argument("--run-dir", default=None, help="directory for ipc sockets")
    s.add_argument("--step-log", default=None,
                   help="append each step's shape and time to this JSONL (weir calibrate)")
    s.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible gateway port (default $WEIR_HTTP_PORT or 8000)")
    s.add_argument("--admission-policy", choices=["deadline", "fcfs"], default=None,
                   help="admission.policy: deadline (the default: SLO classes, refuse what "
                        "cannot start in time) or fcfs (the baseline: accept under the caps)")
    s.set_defaults(func=_serve)

    ro = sub.add_parser("route", help="one endpoint in front of several engines: cache-aware "
                                      "routing with sticky sessions and failover")
    ro.add_argument("--config", default=None, help="a TOML config ([router] and the "
                    "replicas' model, max_model_len, kv.block_size, tenants and classes)")
    ro.add_argument("--replica", action="append", default=[],
                    metavar="NAME=ENDPOINT[,KV_EVENTS[,POOL]]",
                    help="an engine's client endpoint, its KV events address and its replica "
                         "pool (default: default) (repeat)")
    ro.add_argument("--policy", choices=["cache_aware", "least_loaded", "round_robin"],
                    default=None)
    ro.add_argument("--model", default=None,
                    help="the replicas' model (the router tokenizes to find cached prefixes)")
    ro.add_argument("--endpoint", default=None, help=endpoint_help)
    ro.add_argument("--run-dir", default=None, help="directory for ipc sockets")
    ro.add_argument("--http-port", type=int, default=None,
                    help="OpenAI-compatible gateway port in front of the router")
    ro.set_defaults(func=_route)

    g = sub.add_parser("generate", help="stream a completion to stdout")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="Hugging Face's (1 is off; 1.1-1.3 curbs a small model's loops)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="each token's log-probability and the K most likely (with --json)")
    g.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="each prompt token's log-probability and the K most likely (with "
                        "--json); the prompt is computed whole, not read from the cache")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="no EOS, stop id or stop string ends it before this many tokens")
    g.add_argument("--ignore-eos", action="store_true")
    so = g.add_argument_group("structured output (one of)")
    so.add_argument("--json-schema", default=None, metavar="SCHEMA",
                    help="the output is JSON valid under this JSON Schema (text, or @file)")
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", default=None, help="the output matches this regex, whole")
    so.add_argument("--choice", action="append", default=None,
                    help="the output is one of these strings (repeat)")
    so.add_argument("--grammar", default=None, metavar="GRAMMAR",
                    help="the output is a sentence of this Lark or GBNF grammar (text, or @file)")
    g.add_argument("--tenant", default="default")
    g.add_argument("--class", dest="service_class", default=None,
                   help="service class to run under (default: the tenant's); only one at "
                        "or below the tenant's default is granted")
    g.add_argument("--timeout", type=float, default=None)
    g.add_argument("--json", action="store_true", help="print one JSON object at the end")
    g.add_argument("--endpoint", default=None, help=endpoint_help)
    g.set_defaults(func=_generate)

    from schemas.config import COMPONENTS

    comp = sub.add_parser("component", help="run one component (for compose / multi-host)")
    comp.add_argument("name", choices=(*COMPONENTS, "gateway"))
    comp.add_argument("--config", required=True, help="a TOML config with a tcp topology")
    comp.set_defaults(func=_component)

    tr = sub.add_parser("trace", help="print a request's timeline, or the scheduler's steps, "
                                      "from a JSONL span export")
    tr.add_argument("request_id", nargs="?", default="")
    tr.add_argument("--file", required=True, help="spans.jsonl written by telemetry.exporter=jsonl")
    tr.add_argument("--steps", action="store_true",
                    help="one line a scheduler step: its token budget and why, the step's "
                         "predicted and measured ms, running and waiting; start ms from the "
                         "file's first span")
    tr.add_argument("--step-ids", default="", metavar="FIRST..LAST",
                    help="with --steps: only these step ids (e.g. 8..12, or 20..)")
    tr.set_defaults(func=_trace)

    hk = sub.add_parser("hash-key", help="print the SHA-256 to store for an API key")
    hk.add_argument("key")
    hk.set_defaults(func=_hash_key)

    sup = sub.add_parser("supervise", help="watch components started elsewhere")
    sup.add_argument("--config", required=True)
    sup.set_defaults(func=_supervise)

    ks = sub.add_parser("keys", help="create CURVE keys for the bus ([security] curve), "
                                     "the gateway's service key (service.key) and an "
                                     "operator's key (operator.key)")
    ks.add_argument("action", choices=["generate"])
    ks.add_argument("dir", help="the directory for [security] curve_keys_dir")
    ks.set_defaults(func=_keys)

    rp = sub.add_parser("replicas", help="list a router's replicas, or add and retire "
                                          "them while it runs (an operator's key)")
    rp.add_argument("action", choices=["list", "add", "remove"])
    rp.add_argument("replicas", nargs="*", metavar="REPLICA",
                    help="add: NAME=ENDPOINT[,KV_EVENTS[,POOL]] (as `weir route "
                         "--replica`); remove: NAME (no new requests go there; it is let go once "
                         "its open ones end)")
    rp.add_argument("--timeout", type=float, default=5.0)
    rp.add_argument("--endpoint", default=None, help=endpoint_help)
    rp.set_defaults(func=_replicas)

    cf = sub.add_parser("config", help="an engine's or a router's live config (an operator's "
                                       "key): apply a TOML's policy sections without a "
                                       "restart, list the versions, or roll back")
    cf.add_argument("action", choices=["apply", "history", "rollback"])
    cf.add_argument("target", nargs="?", default=None, metavar="FILE | VERSION",
                    help="apply: the TOML file, - for standard input (laid over the running "
                         "config; only the policy sections may differ: docs/operations.md "
                         "lists them for an engine and a router); rollback: the version to "
                         "restore "
                         "(default: the one before the current)")
    cf.add_argument("--actor", default=None, help="who applies it (default: $USER)")
    cf.add_argument("--json", action="store_true", help="one JSON object per version")
    cf.add_argument("--timeout", type=float, default=5.0)
    cf.add_argument("--endpoint", default=None, help=endpoint_help)
    cf.set_defaults(func=_config)

    pl = sub.add_parser("plan", help="the executor's kernel plans cached on this machine: "
                        "clean or provisional (measured under load), and --remeasure")
    pl.add_argument("--key", default=None, help="only the plan whose key starts with this")
    pl.add_argument("--remeasure", action="store_true",
                    help="have the next executor start measure the plan(s) again")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_plan)

    st = sub.add_parser("status", help="show components, queue and KV state")
    st.add_argument("--json", action="store_true")
    st.add_argument("--component", default=None,
                    help="exit 0 only if this component is alive and ready (health checks)")
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--endpoint", default=None, help=endpoint_help)
    st.set_defaults(func=_status)

    from weir.replay.commands import add_commands

    add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
