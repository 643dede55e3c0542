"""The live config change's core: overlay, the refusal of restart-only fields, versions."""
from __future__ import annotations

import msgspec

from schemas.config import ReplicaSpec, load_config
from schemas.config_change import (
    ROUTER,
    ConfigHistory,
    ConfigVersion,
    PolicySections,
    Refused,
    RouterSections,
    candidate,
    changed_fields,
)

BOOT = load_config(None, topology={"run_dir": "/tmp/weir-test"}, kv={"num_blocks": 64},
                   engine={"max_model_len": 512})


def _history() -> ConfigHistory:
    return ConfigHistory(BOOT, 1000.0)


def test_version_zero_is_the_boot_config() -> None:
    h = _history()
    assert h.current == ConfigVersion(0, PolicySections.of(BOOT).digest(), "startup", 1000.0)
    assert h.config == BOOT


def test_a_candidate_keeps_what_it_leaves_out() -> None:
    new = candidate(BOOT, '[admission]\npolicy = "fcfs"\n[scheduler]\nfairness = "fcfs"\n')
    assert new.admission.policy == "fcfs" and new.scheduler.fairness == "fcfs"
    assert new.admission.tenants == BOOT.admission.tenants
    assert new.kv == BOOT.kv and new.scheduler.max_num_seqs == BOOT.scheduler.max_num_seqs
    assert changed_fields(BOOT, new) == ["admission.policy", "scheduler.fairness"]


def test_apply_numbers_hashes_and_records_who_and_when() -> None:
    h = _history()
    v = h.apply('[admission]\nttft_headroom = 0.3\n', "ops/alice", 1001.5)
    assert isinstance(v, ConfigVersion)
    assert (v.version, v.applied_by, v.applied_at, v.changed, v.rollback_of) == (
        1, "ops/alice", 1001.5, ("admission.ttft_headroom",), None)
    assert v.sha256 == PolicySections.of(h.config).digest() != h.versions[0].sha256
    assert h.config.admission.ttft_headroom == 0.3


def test_the_hash_is_the_policy_not_the_file_layout() -> None:
    a, b = _history(), _history()
    va = a.apply('[admission]\npolicy = "fcfs"\nkv_safety = 0.2\n', "x", 1.0)
    vb = b.apply('# the same policy, in two steps\n[admission]\nkv_safety = 0.2\n', "y", 2.0)
    vb2 = b.apply('[admission]\npolicy = "fcfs"\n', "y", 3.0)
    assert isinstance(va, ConfigVersion) and isinstance(vb, ConfigVersion)
    assert isinstance(vb2, ConfigVersion)
    assert vb2.sha256 == va.sha256 != vb.sha256


def test_restart_only_fields_are_refused_by_name_and_nothing_is_applied() -> None:
    h = _history()
    r = h.apply('[admission]\npolicy = "fcfs"\n[engine]\ndtype = "bfloat16"\n'
                '[kv]\nnum_blocks = 128\n[topology]\nbase_port = 9000\n'
                '[scheduler]\nmax_num_seqs = 4\n', "op", 5.0)
    assert isinstance(r, Refused)
    assert r.reasons == (
        "engine.dtype needs a restart (the model, dtype and device are loaded at start)",
        "kv.num_blocks needs a restart (the KV pool is sized and allocated at start)",
        "scheduler.max_num_seqs needs a restart (the executor's batch buffers and step "
        "pipeline are sized at start)",
        "topology.base_port needs a restart (sockets are bound at start)")
    assert h.current.version == 0 and h.config == BOOT


def test_restating_a_restart_only_field_unchanged_is_fine() -> None:
    h = _history()
    v = h.apply('[kv]\nnum_blocks = 64\n[admission]\npolicy = "fcfs"\n', "op", 5.0)
    assert isinstance(v, ConfigVersion) and v.changed == ("admission.policy",)


def test_an_invalid_or_unknown_field_is_refused_with_the_config_error() -> None:
    h = _history()
    bad = h.apply('[admission]\nttft_headroom = 1.5\n', "op", 5.0)
    unknown = h.apply('[admission]\nno_such = 1\n', "op", 5.0)
    not_toml = h.apply('[admission\n', "op", 5.0)
    assert isinstance(bad, Refused) and "ttft_headroom must be in [0, 1)" in bad.message
    assert isinstance(unknown, Refused) and "no_such" in unknown.message
    assert isinstance(not_toml, Refused) and not_toml.message.startswith(
        "config not applied: not TOML")
    assert len(h.versions) == 1


def test_a_service_class_may_change_but_not_go() -> None:
    h = _history()
    names = list(BOOT.admission.service_classes())
    assert len(names) >= 2
    kept = "\n".join(f'[[admission.classes]]\nname = "{n}"\n' for n in names[1:])
    r = h.apply(f'[[admission.tenants]]\nname = "default"\ndefault_class = "{names[1]}"\n'
                + kept, "op", 5.0)
    assert isinstance(r, Refused)
    assert r.reasons == (f"admission.classes removes {names[0]}: requests in flight keep "
                         "their class (change it or leave it unused)",)


def test_speculation_may_drop_below_but_not_rise_above_its_start() -> None:
    h = _history()
    down = h.apply('[speculative]\nmax_k = 1\n', "op", 5.0)
    assert isinstance(down, ConfigVersion) and down.changed == ("speculative.max_k",)
    back = h.apply(f'[speculative]\nmax_k = {BOOT.speculative.max_k}\n', "op", 6.0)
    assert isinstance(back, ConfigVersion)
    up = h.apply(f'[speculative]\nmax_k = {BOOT.speculative.max_k + 1}\n', "op", 7.0)
    assert isinstance(up, Refused) and "speculative.max_k" in up.message
    method = h.apply('[speculative]\nmethod = "off"\n', "op", 7.0)
    assert isinstance(method, Refused) and method.reasons == (
        "speculative.method needs a restart (the draft method and model are loaded at start)",)


def test_rollback_restores_an_earlier_policy_as_a_new_version() -> None:
    h = _history()
    h.apply('[admission]\npolicy = "fcfs"\n', "a", 1.0)
    h.apply('[scheduler]\nchunking = "fixed"\n', "b", 2.0)
    prev = h.rollback(None, "c", 3.0)             # the one before the current
    assert isinstance(prev, ConfigVersion)
    assert (prev.version, prev.rollback_of, prev.changed) == (3, 1, ("scheduler.chunking",))
    assert prev.sha256 == h.versions[1].sha256
    to_boot = h.rollback(0, "c", 4.0)
    assert isinstance(to_boot, ConfigVersion) and to_boot.sha256 == h.versions[0].sha256
    assert h.config == BOOT and [v.version for v in h.versions] == [0, 1, 2, 3, 4]
    missing = h.rollback(9, "c", 5.0)
    assert isinstance(missing, Refused) and missing.reasons == (
        "no version 9 (versions 0..4)",)


# ---------------------------------------------------------------------- a router's scope
ROUTER_BOOT = load_config(None, topology={"run_dir": "/tmp/weir-test"}, router={
    "replicas": [{"name": "r0", "endpoint": "tcp://r0:7450"}],
    "tenants": [{"name": "acme", "max_outstanding": 10}]})


def _router() -> ConfigHistory:
    return ConfigHistory(ROUTER_BOOT, 1000.0, ROUTER)


def test_a_routers_weights_policy_budgets_and_queue_bounds_change_live() -> None:
    h = _router()
    v = h.apply('[router]\npolicy = "least_loaded"\nweights = { queue = 2.5 }\n'
                'fleet_queue_max = 16\nfleet_queue_max_wait_s = 5.0\nreroute_attempts = 1\n'
                'tenants = [{ name = "acme", max_outstanding = 4, weight = 3.0, '
                'token_rate = 100.0 }]\n', "op", 1001.0)
    assert isinstance(v, ConfigVersion)
    assert v.changed == ("router.fleet_queue_max", "router.fleet_queue_max_wait_s",
                         "router.policy", "router.reroute_attempts", "router.tenants",
                         "router.weights")
    rc = h.config.router
    assert (rc.policy, rc.weights.queue, rc.weights.prefix, rc.tenants[0].weight) == (
        "least_loaded", 2.5, 1.0, 3.0)
    assert rc.replicas == ROUTER_BOOT.router.replicas
    assert v.sha256 == RouterSections.of(h.config).digest()


def test_a_routers_restart_only_fields_are_refused_by_name() -> None:
    h = _router()
    r = h.apply('[router]\npolicy = "round_robin"\nfleet_queue = false\n'
                'heartbeat_timeout_s = 5.0\ndiscovery = "dns"\ndiscovery_name = "x"\n'
                'replicas = [{ name = "r9", endpoint = "tcp://r9:7450" }]\n'
                '[scheduler]\nfairness = "fcfs"\n[kv]\nblock_size = 32\n'
                '[topology]\nclient_endpoint = "tcp://0.0.0.0:9"\n', "op", 5.0)
    assert isinstance(r, Refused)
    assert r.reasons == (
        "kv.block_size needs a restart (the router hashes prompts in blocks of the size set "
        "at start)",
        "router.discovery needs a restart (discovery is set up at start)",
        "router.discovery_name needs a restart (discovery is set up at start)",
        "router.fleet_queue needs a restart (the fleet queue is made or not at start; its "
        "bounds change live)",
        "router.heartbeat_timeout_s needs a restart (the replicas' heartbeat and "
        "load-report timing is set at start)",
        "router.replicas needs a restart (the replica list is read at start; change it "
        "live with `weir replicas add/remove`)",
        "scheduler.fairness is an engine's: apply it to each replica with --endpoint "
        "naming it",
        "topology.client_endpoint needs a restart (sockets are bound at start)")
    assert h.current.version == 0 and h.config == ROUTER_BOOT


def test_an_engine_refuses_the_router_section_and_says_where_it_goes() -> None:
    r = _history().apply('[router]\npolicy = "round_robin"\n', "op", 5.0)
    assert isinstance(r, Refused) and r.reasons == (
        "router.policy is a router's: apply it with --endpoint naming the router",)


def test_a_rollback_restores_only_live_fields() -> None:
    h = _router()
    h.apply('[router]\npolicy = "round_robin"\n', "op", 1.0)
    # the history resumed by a router started with another replica list (a changed file)
    boot2 = msgspec.structs.replace(ROUTER_BOOT, router=msgspec.structs.replace(
        h.config.router, replicas=(ReplicaSpec("r1", "tcp://r1:7450"),)))
    h2 = ConfigHistory.resumed(boot2, h.versions, h.sections,
                               RouterSections.of(ROUTER_BOOT).digest(), 2.0, ROUTER)
    assert h2.current.version == 2 and h2.current.applied_by == "startup"
    assert h2.current.changed == ("router.replicas",)
    v = h2.rollback(0, "op", 3.0)
    assert isinstance(v, ConfigVersion) and v.changed == ("router.policy",)
    assert h2.config.router.policy == "cache_aware"
    assert h2.config.router.replicas == (ReplicaSpec("r1", "tcp://r1:7450"),)


def test_resumed_with_the_same_file_the_version_in_force_stays() -> None:
    h = _router()
    h.apply('[router]\nweights = { tenant = 0.7 }\n', "op", 1.0)
    h.apply('[router]\nkv_high = 0.9\n', "op", 2.0)
    again = ConfigHistory.resumed(ROUTER_BOOT, h.versions, h.sections,
                                  RouterSections.of(ROUTER_BOOT).digest(), 9.0, ROUTER)
    assert again.versions == h.versions and again.config == h.config
    assert (again.config.router.weights.tenant, again.config.router.kv_high) == (0.7, 0.9)
    fresh = ConfigHistory.resumed(ROUTER_BOOT, [], [], "", 9.0, ROUTER)
    assert [v.version for v in fresh.versions] == [0] and fresh.config == ROUTER_BOOT


# ---------------------------------------------------------------- trials (shadow, canary)
def _trial_history() -> ConfigHistory:
    boot = load_config(None, topology={"run_dir": "/x"},
                       admission={"tenants": [{"name": "default"}, {"name": "a"},
                                              {"name": "b"}]})
    return ConfigHistory(boot, 100.0)


def test_a_canary_is_a_trial_beside_the_settled_config():
    h = _trial_history()
    v1 = h.apply('[admission]\nkv_safety = 0.3\n', "ops", 101.0)
    v2 = h.apply('[admission]\npolicy = "fcfs"\n[rollout]\nmode = "canary"\nshare = 0.5\n',
                 "ops", 102.0)
    assert (v2.version, v2.rollout, v2.changed) == (
        2, "canary", ("admission.policy", "rollout.mode", "rollout.share"))
    assert (h.settled, h.trial) == (1, 2)
    assert h.config.admission.policy == "deadline" and h.config.admission.kv_safety == 0.3
    assert h.sections[2].admission.kv_safety == 0.3      # laid over the settled config
    p = h.promote("watchdog", 103.0, "held")
    assert (p.version, p.promotion_of, p.rollout, p.reason, p.applied_by) == (
        3, 2, "off", "held", "watchdog")
    assert p.changed == ("rollout.mode",)                 # against the trial
    assert (h.settled, h.trial) == (3, None)
    assert h.config.admission.policy == "fcfs" and h.config.rollout.share == 0.5
    assert h.config.rollout.mode == "off"
    assert v1.rollout == "off"


def test_a_rollback_during_a_trial_restores_the_settled_config():
    h = _trial_history()
    h.apply('[admission]\npolicy = "fcfs"\n[rollout]\nmode = "shadow"\n', "ops", 101.0)
    assert (h.settled, h.trial) == (0, 1)
    v = h.rollback(None, "watchdog", 102.0, "misses")
    assert (v.version, v.rollback_of, v.reason, v.changed) == (
        2, 0, "misses", ("admission.policy", "rollout.mode"))
    assert (h.settled, h.trial) == (2, None) and h.config.admission.policy == "deadline"
    assert h.sections[2].digest() == h.sections[0].digest()
    assert h.promote("watchdog", 103.0).reasons == ("no candidate is on trial",)
    refused = h.rollback(1, "ops", 103.0)
    assert refused.reasons == ("version 1 was a shadow trial, never in force: apply its "
                               "file again to try it again",)


def test_a_trial_may_not_add_tenants_or_classes():
    h = _trial_history()
    refused = h.apply('[admission]\ntenants = [{ name = "default" }, { name = "a" }, '
                      '{ name = "b" }, { name = "c" }]\n[rollout]\nmode = "canary"\n',
                      "ops", 101.0)
    assert refused.reasons == (
        'a canary trial adds the tenant c: what it admitted under it would outlive a '
        'rollback (add it with rollout.mode = "off" first)',)
    assert h.current.version == 0 and h.trial is None
    ok = h.apply('[admission]\ntenants = [{ name = "default" }, { name = "a" }, '
                 '{ name = "b" }, { name = "c" }]\n', "ops", 101.0)
    assert ok.version == 1


def test_an_engine_started_with_a_rollout_mode_is_settled():
    h = ConfigHistory(load_config(None, topology={"run_dir": "/x"},
                                  rollout={"mode": "canary"}), 0.0)
    assert h.trial is None and h.config.rollout.mode == "off"


# ------------------------------------------------------- a router's history and the trials
def test_a_routers_only_trial_is_a_pool_canary_and_it_refuses_the_rollout_section() -> None:
    h = _router()
    assert not h.sections[0].trial and h.sections[0].rollout.mode == "off"
    r = h.apply('[rollout]\nmode = "canary"\n', "op", 1.0)
    assert isinstance(r, Refused) and r.reasons == (
        "rollout.mode is an engine's: apply it to each replica with --endpoint naming it",)
    v = h.apply('[router]\npolicy = "round_robin"\n', "op", 2.0)
    assert isinstance(v, ConfigVersion) and v.rollout == "off"
    assert (h.settled, h.trial) == (1, None)
    assert h.promote("op", 3.0) == Refused(("no candidate is on trial",))
    back = h.rollback(None, "op", 3.0)
    assert isinstance(back, ConfigVersion) and back.rollback_of == 0
    assert h.config.router.policy == "cache_aware"


def test_a_router_history_saved_before_the_trial_fields_resumes() -> None:
    h = _router()
    h.apply('[router]\nkv_high = 0.9\n', "op", 1.0)
    old = [msgspec.json.encode({k: v for k, v in msgspec.to_builtins(x).items()
                                if k not in ("rollout", "promotion_of", "reason")})
           for x in h.versions]
    versions = [msgspec.json.decode(raw, type=ConfigVersion) for raw in old]
    assert [(v.rollout, v.promotion_of, v.reason) for v in versions] == [("off", None, "")] * 2
    again = ConfigHistory.resumed(ROUTER_BOOT, versions, h.sections,
                                  RouterSections.of(ROUTER_BOOT).digest(), 9.0, ROUTER)
    assert (again.settled, again.trial) == (1, None)
    assert again.config.router.kv_high == 0.9 and again.versions == h.versions


def test_a_router_records_a_pool_canary_as_a_trial_and_ends_it() -> None:
    """begin_trial: the candidate (engine sections and its [rollout]) beside the settled
    config; promote puts its admission in force at the router, rollback the settled one."""
    h = _router()
    new = candidate(h.config, '[admission]\nttft_headroom = 0.4\n[scheduler]\n'
                              'fairness = "fcfs"\n[rollout]\nmode = "canary"\npool = "canary"\n')
    v = h.begin_trial(new, "op", 5.0)
    assert (v.version, v.rollout, h.trial, h.settled) == (1, "canary", 1, 0)
    assert "rollout.pool" in v.changed and "scheduler.fairness" in v.changed
    assert h.config.admission.ttft_headroom != 0.4            # the router's stays settled
    p = h.promote("watchdog", 6.0, "held")
    assert isinstance(p, ConfigVersion) and (p.promotion_of, p.reason) == (1, "held")
    assert h.config.admission.ttft_headroom == 0.4 and h.config.rollout.mode == "off"
    h.begin_trial(candidate(h.config, '[admission]\nttft_headroom = 0.1\n[rollout]\n'
                                      'mode = "canary"\npool = "canary"\n'), "op", 7.0)
    back = h.rollback(None, "watchdog", 8.0, "missed")
    assert isinstance(back, ConfigVersion) and back.rollback_of == 2
    assert h.config.admission.ttft_headroom == 0.4 and h.trial is None


def test_an_engine_refuses_a_canary_by_pool() -> None:
    h = ConfigHistory(BOOT, 0.0)
    r = h.apply('[rollout]\nmode = "canary"\npool = "canary"\n', "op", 1.0)
    assert isinstance(r, Refused) and r.reasons == (
        "rollout.pool 'canary': a canary by replica pool is a router's (apply it with "
        "--endpoint naming the router)",)
