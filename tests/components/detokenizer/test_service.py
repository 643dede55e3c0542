"""The detokenizer process's batch logic: ids outside the vocabulary (only a forged or
corrupt message carries them) are dropped instead of crashing the process."""
from components.detokenizer.service import DetokenizerService
from components.model.fetch import default_model_path
from components.model.vocab import load_tokenizer
from schemas.wire import (
    ChoiceEnd,
    DetokParams,
    Finished,
    SampleLogprobs,
    TextDelta,
    TokenBatch,
    TokenOut,
    Usage,
)


def test_out_of_vocabulary_ids_are_dropped_not_fatal():
    svc = DetokenizerService.__new__(DetokenizerService)
    svc.bundle, svc.streams = load_tokenizer(default_model_path()), {}
    hello = svc.bundle.encode("Hello")
    params = DetokParams((), True, 1, 0)
    events, _ = svc.process(TokenBatch([TokenOut("r", [-1, 2**40, *hello], params)]))
    assert events == [TextDelta("r", "Hello", (-1, 2**40, *hello))]
    events, _ = svc.process(TokenBatch([TokenOut("r", [10**12], None, "length")]))
    assert isinstance(events[-1], Finished)


def _service() -> DetokenizerService:
    svc = DetokenizerService.__new__(DetokenizerService)
    svc.bundle, svc.streams, svc.pieces = load_tokenizer(default_model_path()), {}, {}
    return svc


def test_prompt_logprobs_name_the_prompt_and_its_tokens():
    svc = _service()
    ids = svc.bundle.encode("The sea is blue")
    entries = [SampleLogprobs(-float(i), [ids[i], 7], [-float(i), -9.0])
               for i in range(1, len(ids))]
    out = TokenOut("r", [11], DetokParams((), True, len(ids), 0), prompt=(ids, entries))
    (delta,) = svc.process(TokenBatch([out]))[0]
    p = delta.prompt
    assert p.token_ids == tuple(ids) and p.text == "The sea is blue"
    assert p.first_token + "".join(e.token for e in p.logprobs) == "The sea is blue"
    assert [(e.token_id, e.logprob) for e in p.logprobs] == [(ids[i], -float(i))
                                                             for i in range(1, len(ids))]
    assert p.logprobs[0].top[1].token_id == 7
    # an id outside the vocabulary (a corrupt message) drops the prompt, not the process
    bad = TokenOut("q", [11], DetokParams((), True, 2, 0), prompt=([5, 2**40], entries[:1]))
    (delta,) = svc.process(TokenBatch([bad]))[0]
    assert delta.prompt is None and delta.token_ids == (11,)


def test_a_deadline_end_finishes_each_choice_with_no_empty_delta():
    """The scheduler ends a decoding request at its end-to-end deadline with a last output
    per open choice that brings no token: no empty delta goes out, and the request's one
    ``Finished`` says ``deadline`` with the tokens each choice streamed."""
    svc = _service()
    ids = svc.bundle.encode("Hello there")
    params = DetokParams((), True, 5, 1, 0.0, None, 2)
    first, _ = svc.process(TokenBatch([TokenOut("r", ids[:1], params),
                                       TokenOut("r", ids[1:], params, index=1)]))
    assert [type(e) for e in first] == [TextDelta, TextDelta]
    events, _ = svc.process(TokenBatch([
        TokenOut("r", [], None, "deadline", Usage(5, 1, 1), index=0),
        TokenOut("r", [], None, "deadline", Usage(5, len(ids) - 1, 1), index=1)]))
    assert events == [Finished("r", "deadline", Usage(5, len(ids), 1), "", 0.0, None,
                               (ChoiceEnd(0, "deadline", 1),
                                ChoiceEnd(1, "deadline", len(ids) - 1)))]
    assert not svc.streams
