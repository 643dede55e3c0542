"""The detokenizer process's batch logic: ids outside the vocabulary (only a forged or
corrupt message carries them) are dropped instead of crashing the process."""
from components.detokenizer.service import DetokenizerService
from components.tokenizer.vocab import load_tokenizer
from schemas.wire import DetokParams, Finished, SampleLogprobs, TextDelta, TokenBatch, TokenOut
from weir.model_fetch import default_model_path


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
    entries = [SampleLogprobs(-float(i), [ids[i], 7], [-float(i), -9.0]) for i in range(1, len(ids))]
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
