"""The deterministic serving mode's request half: fixed chunk boundaries, the flags on the
plan, no drafts, prefix hits taken to a boundary, the step-cost model's plan factor, the
rule that says which requests run so, the config's checks and what a response is pinned to.
Exact, on the real core and pool (test_core.py's harness)."""
from __future__ import annotations

import msgspec
import pytest

from components.costs.cost_model import DET_MIN, StepCostModel, StepShape
from components.gateway.errors import ApiError
from components.gateway.openai_api import ChatCompletionRequest, parse, submit_batch
from components.kv_manager.pool import BlockPool
from components.model.hashing import block_hashes
from components.model.prompt import deterministic_scope
from components.scheduler.core import SchedulerCore
from components.scheduler.determinism import cached_blocks, chunk_tokens
from components.streamer.pinned import kernel_plan_id, pinned
from schemas.client import ComponentStatus, SamplingParams
from schemas.config import (
    ConfigError,
    KvConfig,
    SchedulerConfig,
    ServiceClass,
    deterministic_chunk,
    load_config as load,
)
from schemas.resolve import deterministic
from schemas.validate import check_params
from schemas.wire import AllocRequest, KvOps, SeqStep
from tests.components.scheduler.test_core import BS, EPOCH, Kv, admitted, prompt, result, start

# ---------------------------------------------------------------- the chunking rule


@pytest.mark.parametrize("planned,todo,chunk,want", [
    (0, 100, 32, 32), (32, 68, 32, 32), (64, 36, 32, 32), (96, 4, 32, 4),
    (0, 20, 32, 20),                  # a prompt shorter than a chunk: whole
    (48, 100, 32, 16),                # after a hit mid-chunk (never taken: to the boundary)
    (31, 1, 32, 1)])
def test_a_chunk_ends_on_the_next_multiple_of_the_chunk_or_at_the_end(planned, todo, chunk,
                                                                       want):
    assert chunk_tokens(planned, todo, chunk) == want


@pytest.mark.parametrize("num_tokens,want", [
    (32, (0, 4)), (33, (4, 4)), (64, (4, 4)), (65, (8, 4)), (100, (12, 4)), (10, (0, 4))])
def test_a_prefix_hit_is_whole_chunks_and_leaves_the_last_token(num_tokens, want):
    assert cached_blocks(num_tokens, 32, 8) == want


@pytest.mark.parametrize("chunk,budget,block,want", [
    (512, 2048, 16, 512), (500, 2048, 16, 496), (512, 256, 16, 256), (512, 100, 16, 96),
    (16, 2048, 64, 64)])
def test_the_chunk_in_force_is_whole_blocks_within_the_step_budget(chunk, budget, block, want):
    sched = SchedulerConfig(max_num_batched_tokens=budget, deterministic_chunk=chunk)
    assert deterministic_chunk(sched, block) == want


def make(budget=64, chunk=16) -> SchedulerCore:
    return SchedulerCore(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                         lookahead_tokens=4, deterministic_chunk=chunk),
                         KvConfig(block_size=BS, num_blocks=64, grow_blocks=2), 256,
                         epoch=EPOCH)


def test_a_deterministic_prompt_runs_in_fixed_chunks_and_flags_its_steps():
    core, kv, toks = make(), Kv(64), prompt(40)
    plan = start(core, kv, admitted("r", toks, deterministic=True))
    assert plan.deterministic and plan.new_seqs[0].deterministic
    sizes = [plan.steps[0].num_tokens]
    while not plan.steps[0].sample:
        core.on_result(result(plan, {}))
        plan = core.schedule()
        sizes.append(plan.steps[0].num_tokens)
    assert sizes == [16, 16, 8]
    # the same prompt not deterministic: one chunk, the step not flagged
    core, kv = make(), Kv(64)
    plan = start(core, kv, admitted("q", toks))
    assert plan.steps == [SeqStep(1, 40, [], True)]
    assert not plan.deterministic and not plan.new_seqs[0].deterministic


def test_a_deterministic_chunk_is_never_cut_by_what_the_budget_leaves():
    # budget 40, chunk 24: a takes its first chunk (24); b, deterministic, would have 16
    # left: it waits for a step with room for its whole chunk; c (not deterministic) takes
    # what is left
    core, kv = make(budget=40, chunk=24), Kv(64)
    plan = start(core, kv, admitted("a", prompt(60), deterministic=True),
                 admitted("b", prompt(60, 300), deterministic=True),
                 admitted("c", prompt(60, 500)))
    assert [(s.seq_id, s.num_tokens) for s in plan.steps] == [(1, 24), (3, 16)]
    assert plan.deterministic
    core.on_result(result(plan, {}))
    plan = core.schedule()
    assert [(s.seq_id, s.num_tokens) for s in plan.steps] == [(1, 24), (3, 16)]
    core.on_result(result(plan, {}))
    plan = core.schedule()                  # a's last chunk (12), b's first (24), c's 4
    assert [(s.seq_id, s.num_tokens) for s in plan.steps] == [(1, 12), (2, 24), (3, 4)]


def test_a_stall_free_budget_below_the_chunk_does_not_starve_the_first_prefill():
    core, kv = make(budget=64, chunk=32), Kv(64)
    for r in (admitted("a", prompt(70), deterministic=True),
              admitted("b", prompt(70, 300), deterministic=True)):
        core.add(r)
    core.schedule()
    core.on_grants(kv.apply(core.take_kv_ops()))
    plan = core.schedule(budget=10)         # chunking.py's cap beside decoding streams
    assert [(s.seq_id, s.num_tokens) for s in plan.steps] == [(1, 32)]


def test_a_deterministic_prompt_takes_a_prefix_hit_only_to_a_chunk_boundary():
    core, toks = make(chunk=16), prompt(40)
    core.add(admitted("r", toks, deterministic=True))
    ops = core.take_kv_ops()
    assert ops == KvOps(EPOCH, [], [AllocRequest(
        1, 6, "t1", block_hashes(toks, BS, "t1", "m"), toks[:40], 4, promote=True,
        cached_multiple=2)])


def test_the_pool_takes_a_hit_down_to_its_multiple():
    pool, toks = BlockPool(32, BS, True), prompt(40)
    hashes = block_hashes(toks, BS, "t", "m")
    pool.allocate(1, 6, scope="t", block_hashes=hashes, token_ids=toks[:40],
                  max_cached_blocks=4)
    pool.free(1, 40)                        # its 5 full blocks enter the cache
    g = pool.allocate(2, 6, scope="t", block_hashes=hashes, token_ids=toks[:40],
                      max_cached_blocks=4)
    assert g.num_cached_tokens == 32
    pool.free(2, 40)
    g = pool.allocate(3, 6, scope="t", block_hashes=hashes, token_ids=toks[:40],
                      max_cached_blocks=3, cached_multiple=2)
    assert g.num_cached_tokens == 16        # 3 blocks match: 2, a chunk's


def test_deterministic_prompts_hash_in_a_scope_of_their_own():
    assert deterministic_scope("acme") == "acme\0deterministic"
    toks = prompt(40)
    assert block_hashes(toks, BS, "acme", "m") != block_hashes(
        toks, BS, deterministic_scope("acme"), "m")


def test_speculation_gives_a_deterministic_row_no_drafts():
    from tests.components.scheduler import test_speculation as spec
    core, kv = spec.make(max_k=3), spec.Kv()
    plan = spec.prefilled(core, kv, spec.admitted("a", 10, deterministic=True),
                          spec.admitted("b", 10))
    assert plan.deterministic
    assert [(st.seq_id, st.draft_k) for st in plan.steps] == [(1, 0), (2, 3)]
    assert core.planner.last_spec.k == {2: 3}


# ---------------------------------------------------------------- the step-cost model

def _fast_model() -> StepCostModel:
    m = StepCostModel(deterministic_factor=1.5)
    m.set_prior([0.01, 0.001, 0.0, 0.0, 0.0])
    return m


def test_the_deterministic_plan_is_priced_at_the_prior_factor_until_measured():
    m, shape = _fast_model(), StepShape(100, 100, 1, 5050)
    assert m.predict(shape) == pytest.approx(0.11)
    assert m.predict(shape, deterministic=True) == pytest.approx(0.165)
    for i in range(DET_MIN - 1):
        m.observe(shape, 0.11 * (2.0 + i / 100), deterministic=True)
    assert m.deterministic_factor() == 1.5
    m.observe(shape, 0.11 * 2.5, deterministic=True)
    assert m.deterministic_factor() == pytest.approx(2.04)     # the median of 8
    assert m.predict(shape) == pytest.approx(0.11)             # the fast plan's unchanged
    assert m.predict(shape, deterministic=True) == pytest.approx(0.11 * 2.04)


# ---------------------------------------------------------------- which requests, and config

@pytest.mark.parametrize("mode,asked,cls,want", [
    ("requested", False, None, False), ("requested", True, None, True),
    ("requested", False, ServiceClass("eval", deterministic=True), True),
    ("all", False, ServiceClass("chat"), True),
    ("off", False, ServiceClass("chat"), False)])
def test_who_runs_deterministically(mode, asked, cls, want):
    assert deterministic(mode, asked, cls) is want


def test_asking_an_engine_whose_mode_is_off_is_refused_with_the_reason():
    why = deterministic("off", True, None)
    assert isinstance(why, str) and 'engine.deterministic = "off"' in why


def test_the_config_refuses_what_cannot_be_served(tmp_path):
    def load_config(**sections):
        return load(topology={"run_dir": str(tmp_path)}, **sections)

    eval_class = {"classes": [{"name": "eval", "deterministic": True}]}
    assert load_config(admission=eval_class).admission.classes[0].deterministic
    with pytest.raises(ConfigError, match='eval set deterministic = true, but '
                                          'engine.deterministic is "off"'):
        load_config(admission=eval_class, engine={"deterministic": "off"})
    with pytest.raises(ConfigError, match="engine.deterministic"):
        load_config(engine={"deterministic": "sometimes"})
    with pytest.raises(ConfigError, match="deterministic_chunk must be >= 16"):
        load_config(scheduler={"deterministic_chunk": 8})
    with pytest.raises(ConfigError, match="deterministic_cost_factor must be in"):
        load_config(scheduler={"deterministic_cost_factor": 0.5})
    assert load_config().engine.deterministic == "requested"     # the default


def test_a_request_field_that_is_not_a_bool_is_refused():
    assert check_params(SamplingParams(deterministic="yes")) == \
        "deterministic must be true or false, got 'yes'"
    with pytest.raises(msgspec.ValidationError, match="deterministic"):
        msgspec.convert({"deterministic": 1}, SamplingParams)


def test_the_http_body_carries_the_field_as_an_extra_parameter():
    req = parse(b'{"messages": [{"role": "user", "content": "hi"}], "deterministic": true}',
                ChatCompletionRequest)
    assert submit_batch(req, "m")[0]["deterministic"] is True
    req = parse(b'{"messages": [{"role": "user", "content": "hi"}]}', ChatCompletionRequest)
    assert "deterministic" not in submit_batch(req, "m")[0]
    with pytest.raises(ApiError, match="deterministic"):
        parse(b'{"messages": [], "deterministic": "yes"}', ChatCompletionRequest)


# ---------------------------------------------------------------- what it is pinned to

def _status(executor: dict[str, str], tokenizer: dict[str, str]):
    return (ComponentStatus("executor", 1, True, "ready", 0, 0.0, info=executor),
            ComponentStatus("tokenizer", 2, True, "ready", 0, 0.0, info=tokenizer))


def test_the_pin_names_the_model_template_plan_and_version():
    ex = {"kernel.linear": "native", "kernel.threads": "2", "kv.dtype": "bfloat16",
          "model.sha256": "ab" * 32}
    pin = pinned(_status(ex, {"chat_template.sha256": "cd" * 32}), "0.1.0")
    assert (pin.model_sha256, pin.chat_template_sha256, pin.engine_version) == \
        ("ab" * 32, "cd" * 32, "0.1.0")
    assert pin.kernel_plan == kernel_plan_id(ex) and pin.kernel_plan.startswith("plan-")
    assert pin.fingerprint.startswith("fp_") and len(pin.fingerprint) == 19
    # any fact changed changes the fingerprint; the executor's own plan id wins
    other = pinned(_status({**ex, "kernel.threads": "4"}, {"chat_template.sha256": "cd" * 32}),
                   "0.1.0")
    assert other.kernel_plan != pin.kernel_plan and other.fingerprint != pin.fingerprint
    assert pinned(_status(ex, {}), "0.1.1").fingerprint != pin.fingerprint
    assert kernel_plan_id({**ex, "kernel.deterministic_plan": "inv-7"}) == "inv-7"
    assert kernel_plan_id({}) == ""
