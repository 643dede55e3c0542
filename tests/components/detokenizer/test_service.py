"""The detokenizer process's batch logic: ids outside the vocabulary (only a forged or
corrupt message carries them) are dropped instead of crashing the process."""
from components.detokenizer.service import DetokenizerService
from components.tokenizer.vocab import load_tokenizer
from schemas.wire import DetokParams, Finished, TextDelta, TokenBatch, TokenOut
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
