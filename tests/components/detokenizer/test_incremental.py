"""IncrementalDetokenizer: streamed text equals the full decode; stop strings cut it cleanly."""
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from components.detokenizer.incremental import DetokOutput, IncrementalDetokenizer
from components.model.fetch import default_model_path
from components.model.vocab import load_tokenizer
from schemas.wire import carried_tail

TEXTS = [
    "Hello, world! This is a plain sentence.",
    "emoji 😀🎉 family 👨‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽 end",
    "😀😀😀",
    "你好，世界！这是一个测试。日本語のテキスト 한국어",
    "Café naïve résumé Ångström e\u0301",
    "<|im_start|>assistant\nSure<|im_end|>\n<|endoftext|>after",
    "code:\n    def f(x):\n        return x ** 2\n\n\n",
    "numbers 1234567890 and   spaces\t\ttabs",
    "literal replacement char \ufffd in the text \ufffd",
    "\x00\x01 control chars",
    "ends with an emoji 🤖",
    "",
]

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def bundle():
    return load_tokenizer(default_model_path())


def full_decode(bundle, ids, skip=True):
    return bundle.tokenizer.decode(ids, skip_special_tokens=skip)


def stream(bundle, ids, sizes=None, skip=True, stop=()):
    """Push ids in chunks (one at a time unless sizes); return (chunks emitted, flush text,
    detok)."""
    detok = IncrementalDetokenizer(bundle.tokenizer, bundle.special_ids,
                                   skip_special_tokens=skip, stop=stop)
    chunks, i = [], 0
    sizes = iter(sizes) if sizes is not None else None
    while i < len(ids):
        n = next(sizes) if sizes is not None else 1
        out = detok.push(ids[i:i + n])
        assert isinstance(out, DetokOutput)
        chunks.append(out)
        i += n
    return chunks, detok.flush(), detok


def random_sizes(seed):
    rng = random.Random(seed)
    return (rng.randint(1, 5) for _ in iter(int, 1))


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(bundle, text):
    ids = bundle.encode(text)
    chunks, tail, _ = stream(bundle, ids)
    assert "".join(c.text for c in chunks) + tail == full_decode(bundle, ids)
    assert not any(c.stopped for c in chunks)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(4))
def test_random_chunks_equal_full_decode(bundle, text, seed):
    ids = bundle.encode(text)
    chunks, tail, _ = stream(bundle, ids, random_sizes(seed))
    assert "".join(c.text for c in chunks) + tail == full_decode(bundle, ids)


@pytest.mark.parametrize("text", [t for t in TEXTS if FFFD not in t])
def test_no_replacement_char_mid_stream(bundle, text):
    ids = bundle.encode(text)
    chunks, tail, _ = stream(bundle, ids)
    assert not any(FFFD in c.text for c in chunks) and FFFD not in tail


def test_emoji_is_split_across_byte_tokens(bundle):
    ids = bundle.encode("😀🎉")
    assert any(FFFD in full_decode(bundle, [i]) for i in ids)
    chunks, tail, _ = stream(bundle, ids)
    texts = [c.text for c in chunks]
    assert "".join(texts) == "😀🎉" and tail == ""
    assert texts[0] == ""


def test_special_tokens_skipped_or_kept(bundle):
    ids = bundle.encode("<|im_start|>assistant\nHi<|im_end|>")
    skipped, tail, _ = stream(bundle, ids)
    assert "".join(c.text for c in skipped) + tail == "assistant\nHi"
    kept, tail, _ = stream(bundle, ids, skip=False)
    assert "".join(c.text for c in kept) + tail == "<|im_start|>assistant\nHi<|im_end|>"


def test_incomplete_utf8_at_end_is_flushed_as_replacement(bundle):
    ids = bundle.encode("ok 😀")[:-1]
    chunks, tail, _ = stream(bundle, ids)
    assert "".join(c.text for c in chunks) == "ok "
    assert tail == FFFD
    assert "".join(c.text for c in chunks) + tail == full_decode(bundle, ids)


def test_invalid_byte_sequence_followed_by_text(bundle):
    lead = bundle.encode("😀")[:-1]
    ids = lead + bundle.encode("abc") + lead + lead + bundle.encode(" 😀 x")
    chunks, tail, _ = stream(bundle, ids)
    streamed = "".join(c.text for c in chunks) + tail
    assert streamed == full_decode(bundle, ids)
    assert FFFD in streamed


class CountingTokenizer:
    def __init__(self, inner):
        self.inner = inner
        self.lengths = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decodes_a_small_window_not_the_whole_sequence(bundle):
    text = " ".join(TEXTS) * 10
    ids = bundle.encode(text)
    counting = CountingTokenizer(bundle.tokenizer)
    detok = IncrementalDetokenizer(counting, bundle.special_ids)
    out = "".join(detok.push([i]).text for i in ids) + detok.flush()
    assert out == full_decode(bundle, ids)
    assert len(ids) > 1000
    assert max(counting.lengths) <= 8
    assert len(counting.lengths) <= 2 * len(ids) + 1


# --- stop strings -------------------------------------------------------------------------------

def run_stop(bundle, text, stop, sizes=None):
    ids = bundle.encode(text)
    chunks, tail, detok = stream(bundle, ids, sizes, stop=stop)
    return "".join(c.text for c in chunks) + tail, chunks, detok


def test_stop_single_token(bundle):
    text = "Hello world. Goodbye world."
    ids = bundle.encode(text)
    assert bundle.tokenizer.id_to_token(ids[1]) == "Ġworld"
    out, chunks, detok = run_stop(bundle, text, [" world"])
    assert out == "Hello"
    assert detok.stopped and detok.matched_stop == " world"
    first = next(i for i, c in enumerate(chunks) if c.stopped)
    assert first == 1
    assert all(c.stopped and c.text == "" for c in chunks[first + 1:])


def test_stop_spanning_tokens(bundle):
    out, chunks, detok = run_stop(bundle, "The answer is 42, obviously.", ["is 42"])
    assert out == "The answer "
    assert detok.stopped


def test_stop_inside_multibyte_and_emoji(bundle):
    assert run_stop(bundle, "Bonjour 😀 le monde", ["😀"])[0] == "Bonjour "
    assert run_stop(bundle, "naïve café", ["é"])[0] == "naïve caf"


def test_stop_never_emits_anything_after(bundle):
    text = "first line\nSTOP here and more text after STOP"
    for seed in range(5):
        out, chunks, _ = run_stop(bundle, text, ["STOP"], random_sizes(seed))
        assert out == "first line\n"
        assert "STOP" not in out


def test_earliest_stop_wins(bundle):
    assert run_stop(bundle, "alpha beta gamma", ["gamma", "beta"])[0] == "alpha "
    out, _, detok = run_stop(bundle, "alpha beta gamma", ["a b", "beta"])
    assert out == "alph" and detok.matched_stop == "a b"


def test_partial_stop_is_held_then_released(bundle):
    text = "wait ### not a stop"
    ids = bundle.encode(text)
    detok = IncrementalDetokenizer(bundle.tokenizer, bundle.special_ids, stop=["####"])
    emitted = ""
    for i in ids:
        out = detok.push([i])
        emitted += out.text
        assert not out.stopped
        assert not emitted.endswith("#")
    emitted += detok.flush()
    assert emitted == text and not detok.stopped


def test_partial_stop_at_end_is_flushed(bundle):
    out, chunks, detok = run_stop(bundle, "the end is wit", ["with"])
    assert "".join(c.text for c in chunks) == "the end is "
    assert out == "the end is wit" and not detok.stopped


def test_stop_matched_in_flushed_text(bundle):
    out, _, detok = run_stop(bundle, "abc 😀", ["c 😀"])
    assert out == "ab" and detok.stopped


def test_stop_string_in_skipped_special_token_does_not_fire(bundle):
    out, _, detok = run_stop(bundle, "a<|im_end|>b", ["<|im_end|>"])
    assert out == "ab" and not detok.stopped


def test_no_stop_string_matches_before_min_tokens(bundle):
    text = "Hi. I am here. Yes."
    ids = bundle.encode(text)
    first = next(i for i in range(len(ids)) if "." in bundle.tokenizer.decode(ids[:i + 1]))
    for min_tokens, want in [(0, "Hi"), (first + 1, "Hi"), (first + 2, "Hi. I am here")]:
        detok = IncrementalDetokenizer(bundle.tokenizer, bundle.special_ids, stop=["."],
                                       min_tokens=min_tokens)
        out = ""
        for i in ids:
            got = detok.push([i])
            out += got.text
            if got.stopped:
                break
        assert out == want and detok.stopped, min_tokens
    # past the end: nothing ever matches, every character comes out
    detok = IncrementalDetokenizer(bundle.tokenizer, bundle.special_ids, stop=["."],
                                   min_tokens=len(ids) + 1)
    assert "".join(detok.push([i]).text for i in ids) + detok.flush() == text
    assert not detok.stopped


def test_push_after_flush_raises(bundle):
    detok = IncrementalDetokenizer(bundle.tokenizer, bundle.special_ids)
    detok.push(bundle.encode("hi"))
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.push([5])


# --- properties ---------------------------------------------------------------------------------

_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=8)


def cycle(sizes):
    while True:
        yield from sizes


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40), _sizes)
def test_property_text_roundtrip(bundle, text, sizes):
    ids = bundle.encode(text)
    chunks, tail, _ = stream(bundle, ids, cycle(sizes))
    assert "".join(c.text for c in chunks) + tail == full_decode(bundle, ids)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 49151), max_size=30), _sizes, st.booleans())
def test_property_arbitrary_ids(bundle, ids, sizes, skip):
    chunks, tail, _ = stream(bundle, ids, cycle(sizes), skip=skip)
    assert "".join(c.text for c in chunks) + tail == full_decode(bundle, ids, skip)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(min_size=1, max_size=40), st.data())
def test_property_stop_truncates_at_first_occurrence(bundle, text, data):
    ids = bundle.encode(text)
    decoded = full_decode(bundle, ids)
    if not decoded:
        return
    start = data.draw(st.integers(0, len(decoded) - 1))
    stop = decoded[start:start + data.draw(st.integers(1, 4))]
    sizes = data.draw(_sizes)
    chunks, tail, detok = stream(bundle, ids, cycle(sizes), stop=[stop])
    assert "".join(c.text for c in chunks) + tail == decoded[:decoded.find(stop)]
    assert detok.stopped and tail == ""


# ------------------------------------------------------------------ a migrated stream
# (components/router/migration.py): the first placement streamed k tokens, the
# continuation gets their tail as ``carried`` and streams the rest


def handed_over(bundle, ids, k, stop=(), min_tokens=0, sizes=None):
    """The text a client hears when ``ids`` stream on one detokenizer up to ``k`` and on
    a continuation's from there, and the continuation (None: the first placement had
    stopped by k, so nothing moved)."""
    first = IncrementalDetokenizer(bundle.tokenizer, bundle.special_ids, stop=stop,
                                   min_tokens=min_tokens)
    heard = ""
    for i in range(0, k, 2 if sizes else 1):
        out = first.push(ids[i:min(i + (2 if sizes else 1), k)])
        heard += out.text
        if out.stopped:
            return heard, None
    carried = ids[:k][-carried_tail(tuple(stop)):]
    then = IncrementalDetokenizer(bundle.tokenizer, bundle.special_ids, stop=stop,
                                  min_tokens=max(min_tokens - k, 0), carried=carried)
    for i in range(k, len(ids), 3 if sizes else 1):
        out = then.push(ids[i:i + (3 if sizes else 1)])
        heard += out.text
        if out.stopped:
            return heard, then
    return heard + then.flush(), then


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
@pytest.mark.parametrize("sizes", [False, True], ids=["one", "chunks"])
def test_a_continuation_s_text_follows_the_carried_text_exactly(bundle, text, sizes):
    """At every handover point, split characters and all: the client hears exactly the
    text one detokenizer streams, nothing twice, nothing lost."""
    ids = bundle.encode(text)
    want = run_stop(bundle, text, ())[0]
    assert want == full_decode(bundle, ids)
    for k in range(1, len(ids)):
        assert handed_over(bundle, ids, k, sizes=sizes)[0] == want, k


@pytest.mark.parametrize("text,stop", [
    ("Hello world. Goodbye world.", [" world"]),
    ("The answer is 42, obviously.", ["is 42"]),
    ("wait ### not a stop, ## still #### here", ["####"]),
    ("Bonjour 😀 le monde 😀", ["😀 le"]),
    ("alpha beta gamma", ["gamma", "a b"]),
    ("the end is wit", ["with"]),
    ("abc 😀 and more", ["c 😀"]),
])
def test_a_stop_string_across_the_handover_is_caught(bundle, text, stop):
    """A stop string that began in the carried output (its start held, never streamed)
    ends the continuation where one detokenizer would have: the same text, the same stop."""
    ids = bundle.encode(text)
    for sizes in (False, True):
        want, _, solo = run_stop(bundle, text, stop)
        for k in range(1, len(ids)):
            heard, then = handed_over(bundle, ids, k, stop=stop, sizes=sizes)
            assert heard == want, (k, sizes)
            if then is not None:
                assert then.matched_stop == solo.matched_stop, (k, sizes)


def test_a_continuation_before_min_tokens_holds_nothing_carried(bundle):
    """Sent before the first placement reached ``min_tokens`` (the continuation's is
    less the carried tokens), stops match from the same token on as in one stream."""
    text = "Hi. I am here. Yes. Again."
    ids = bundle.encode(text)
    for min_tokens in (3, 6, 9):
        solo = IncrementalDetokenizer(bundle.tokenizer, bundle.special_ids, stop=["."],
                                      min_tokens=min_tokens)
        want = ""
        for i in ids:
            got = solo.push([i])
            want += got.text
            if got.stopped:
                break
        for k in range(1, min_tokens):
            assert handed_over(bundle, ids, k, stop=["."], min_tokens=min_tokens)[0] == want
