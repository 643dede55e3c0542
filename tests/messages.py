"""Tests' constructors for the messages that carry a request's header (``NewRequest``,
``Tokenized``, ``Admitted``): the request's terms as keywords, relative deadlines in
milliseconds from arrival (as a client and most tests think of them), made absolute in the
header exactly as the streamer and admission make them (``schemas.wire.deadline_ns``)."""
from __future__ import annotations

from schemas.wire import (
    Admitted,
    HeldRequest,
    NewRequest,
    RequestHeader,
    SamplingParams,
    Tokenized,
    deadline_ns,
)


def header(request_id: str, tenant: str, params: SamplingParams, arrival_ns: int, *,
           deadline_ms: float | None = None, priority: int = 0, asked_class: str | None = None,
           granted_class: str | None = None, tpot_slo_ms: float | None = None,
           e2e_deadline_ms: float | None = None) -> RequestHeader:
    return RequestHeader(request_id, tenant, params, arrival_ns, priority, asked_class,
                         granted_class, deadline_ns(arrival_ns, deadline_ms),
                         deadline_ns(arrival_ns, e2e_deadline_ms), tpot_slo_ms)


def new_request(request_id: str, tenant: str, prompt: str | None, messages, params:
                SamplingParams, arrival_ns: int, prompt_token_ids: list[int] | None = None,
                deadline_ms: float | None = None, priority: int = 0,
                service_class: str | None = None, tools=(),
                e2e_deadline_ms: float | None = None) -> NewRequest:
    """``service_class``: the class the client asked for."""
    return NewRequest(header(request_id, tenant, params, arrival_ns, deadline_ms=deadline_ms,
                             priority=priority, asked_class=service_class,
                             e2e_deadline_ms=e2e_deadline_ms),
                      prompt, messages, prompt_token_ids, tools)


def tokenized(request_id: str, tenant: str, prompt_token_ids: list[int],
              block_hashes: list[int], params: SamplingParams, arrival_ns: int,
              eos_token_ids: tuple[int, ...] = (), deadline_ms: float | None = None,
              priority: int = 0, public_scope: str = "", public_blocks: int = 0,
              service_class: str | None = None,
              e2e_deadline_ms: float | None = None) -> Tokenized:
    """``service_class``: the class the client asked for."""
    return Tokenized(header(request_id, tenant, params, arrival_ns, deadline_ms=deadline_ms,
                            priority=priority, asked_class=service_class,
                            e2e_deadline_ms=e2e_deadline_ms),
                     prompt_token_ids, block_hashes, eos_token_ids, public_scope, public_blocks)


def admitted(request_id: str, tenant: str, prompt_token_ids: list[int],
             block_hashes: list[int], params: SamplingParams, arrival_ns: int,
             eos_token_ids: tuple[int, ...] = (), deadline_ms: float | None = None,
             priority: int = 0, public_scope: str = "", public_blocks: int = 0,
             service_class: str | None = None, tpot_slo_ms: float | None = None,
             queued_ns: int = 0, e2e_deadline_ms: float | None = None,
             held: HeldRequest | None = None, drop_late: bool = False,
             aging_per_s: float = 0.0) -> Admitted:
    """``service_class``: the class admission granted; the deadlines, those in force."""
    return Admitted(header(request_id, tenant, params, arrival_ns, deadline_ms=deadline_ms,
                           priority=priority, granted_class=service_class,
                           tpot_slo_ms=tpot_slo_ms, e2e_deadline_ms=e2e_deadline_ms),
                    prompt_token_ids, block_hashes, eos_token_ids, public_scope, public_blocks,
                    queued_ns, held, drop_late, aging_per_s)
