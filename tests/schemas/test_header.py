"""A request's header (schemas/wire.py): one absolute deadline per bound in the arrival's
clock, exact both ways, carried by composition through every message of the path."""
import msgspec

from schemas.wire import (
    NO_DEADLINE_NS,
    AdmissionMsg,
    Admitted,
    Envelope,
    NewRequest,
    RequestHeader,
    SamplingParams,
    SchedulerMsg,
    Tokenized,
    TokenizerMsg,
    deadline_ns,
)

ARRIVAL = 1_733_400_000_123_456_789          # a wall clock in ns


def test_a_deadline_is_absolute_in_the_arrivals_clock_exactly_both_ways():
    assert deadline_ns(ARRIVAL, None) is None
    assert deadline_ns(ARRIVAL, 0) == ARRIVAL
    assert deadline_ns(ARRIVAL, 1500) == ARRIVAL + 1_500_000_000
    assert deadline_ns(ARRIVAL, 1499.6) == ARRIVAL + 1_500_000_000    # whole milliseconds
    h = RequestHeader("r", "t", SamplingParams(), ARRIVAL,
                      ttft_deadline_ns=deadline_ns(ARRIVAL, 3000),
                      e2e_deadline_ns=deadline_ns(ARRIVAL, 2**40))
    assert (h.ttft_deadline_ms, h.e2e_deadline_ms) == (3000, 2**40)
    assert RequestHeader("r", "t", SamplingParams(), ARRIVAL).ttft_deadline_ms is None


def test_a_deadline_centuries_away_is_clamped_to_what_the_wire_holds():
    far = deadline_ns(ARRIVAL, 2**63 - 1)              # the largest deadline_ms a Submit may send
    assert far == NO_DEADLINE_NS
    h = RequestHeader("r", "t", SamplingParams(), ARRIVAL, ttft_deadline_ns=far)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(h), type=RequestHeader) == h


def test_every_message_of_the_path_carries_the_same_header_and_reads_through_it():
    h = RequestHeader("r", "acme", SamplingParams(max_tokens=7, n=2), ARRIVAL, 1, "batch",
                      ttft_deadline_ns=deadline_ns(ARRIVAL, 900))
    new = NewRequest(h, "hi", None)
    tok = Tokenized(h, [1, 2, 3], [11])
    granted = msgspec.structs.replace(h, granted_class="batch", tpot_slo_ms=100.0)
    adm = Admitted(granted, [1, 2, 3], [11], queued_ns=5, aging_per_s=0.5)
    for msg, union in ((new, TokenizerMsg), (tok, AdmissionMsg), (adm, SchedulerMsg)):
        frame = msgspec.msgpack.encode(Envelope(1, 2, None, msg))
        got = msgspec.msgpack.Decoder(Envelope[union]).decode(frame).body
        assert got == msg
        assert (got.request_id, got.tenant, got.params) == ("r", "acme", h.params)
    assert (tok.header is h, adm.header.asked_class, adm.header.granted_class) == \
        (True, "batch", "batch")
