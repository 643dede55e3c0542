"""Structured output's languages, as the tokenizer checks them before a request is queued:
each form becomes a grammar llguidance accepts with SmolLM2's vocabulary, and a schema,
regex or grammar that does not parse is refused with llguidance's reason."""
import json

import pytest

from components.model.structured import check, grammar_of, ll_tokenizer
from components.model.vocab import load_tokenizer
from schemas.client import StructuredOutput

llguidance = pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def bundle(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def vocab(bundle):
    return ll_tokenizer(bundle)


def sentences(so: StructuredOutput, vocab, bundle, texts: list[str]) -> list[bool]:
    """Whether each text (tokenized as the model would write it) is a whole sentence."""
    out = []
    for text in texts:
        m = llguidance.LLMatcher(vocab, grammar_of(so))
        ok = m.consume_tokens(bundle.encode(text)) and m.is_accepting()
        out.append(bool(ok))
    return out


def test_the_vocabulary_is_the_models(vocab, bundle):
    assert vocab.vocab_size == bundle.vocab_size == 49152
    assert vocab.eos_tokens == list(bundle.eos_token_ids) == [2]


@pytest.mark.parametrize("so, good, bad", [
    (StructuredOutput(json=json.dumps({"type": "object", "required": ["a"],
                                       "properties": {"a": {"type": "integer"}},
                                       "additionalProperties": False})),
     ['{"a": 1}', '{"a": -20}'], ['{"a": "1"}', '{"a":1}', '{ "a": 1}', '{}', '{"a": 1, "b": 2}']),
    (StructuredOutput(json=json.dumps({"type": "object"}), json_whitespace=True),
     ['{"a":1}', '{\n  "a": [1, 2]\n}'], ['[1]', '{"a":1']),
    (StructuredOutput(json_object=True), ['{"x": [1, 2]}', '{}'], ['[1]', '"x"', '{"x":1}']),
    (StructuredOutput(regex=r"[0-9]{2}-[a-z]+"), ["12-ab", "00-z"], ["1-ab", "12-", "12-AB"]),
    (StructuredOutput(choice=("yes", "no", "a \"quoted\" one")),
     ["yes", "no", 'a "quoted" one'], ["ye", "yes!", "maybe"]),
    (StructuredOutput(grammar='start: "x" ("," "y")*'), ["x", "x,y,y"], ["y", "x,"]),
    (StructuredOutput(grammar='root ::= "a" [0-9]+'), ["a1", "a42"], ["a", "b1"]),   # GBNF
])
def test_each_form_is_its_language(so, good, bad, vocab, bundle):
    assert check(so, vocab) is None
    assert sentences(so, vocab, bundle, good) == [True] * len(good)
    assert sentences(so, vocab, bundle, bad) == [False] * len(bad)


@pytest.mark.parametrize("so, words", [
    (StructuredOutput(regex="a(b"), "unclosed group"),
    (StructuredOutput(json="{not json"), "not valid JSON"),
    (StructuredOutput(json='{"type": "nonsense"}'), "nonsense"),
    (StructuredOutput(grammar="start: undefined_rule"), "undefined_rule"),
    (StructuredOutput(grammar="root ::= ("), "grammar"),
])
def test_what_does_not_parse_is_refused_with_the_reason(so, words, vocab):
    why = check(so, vocab)
    assert why is not None and why.startswith("invalid structured output") and words in why
    assert len(why) <= 600


def test_kind_names_the_language_and_nothing_of_it():
    from components.model.structured import kind

    assert [kind(StructuredOutput(**f)) for f in (
        {"json": '{"secret": 1}'}, {"json_object": True}, {"regex": "s3cret"},
        {"choice": ("a",)}, {"grammar": 'start: "x"'})] == [
        "json", "json_object", "regex", "choice", "grammar"]


class _Sink:
    async def send(self, *args, **kwargs) -> None:
        pass


async def _tokenizer_service(tmp_path, model_path):
    from components.tokenizer.service import TokenizerService
    from schemas.config import load_config

    service = TokenizerService(load_config(topology={"run_dir": str(tmp_path)},
                                           engine={"model": str(model_path)}))
    service.inbox = lambda accepts: _Sink()
    service.push_to = lambda component: _Sink()
    await service.setup()
    return service


@pytest.mark.anyio
async def test_the_tokenizer_checks_languages_with_the_vocabulary_it_built_at_setup(
        tmp_path, model_path, monkeypatch):
    from components.model import structured

    service = await _tokenizer_service(tmp_path, model_path)
    built = []
    monkeypatch.setattr(structured, "ll_tokenizer", lambda *a: built.append(a))
    assert service._check_structured(StructuredOutput(regex="[0-9]+")) is None
    assert "invalid structured output" in service._check_structured(StructuredOutput(regex="("))
    assert built == []                        # nothing built on a request


@pytest.mark.anyio
async def test_a_vocabulary_llguidance_cannot_read_refuses_structured_requests(
        tmp_path, model_path, monkeypatch):
    """The tokenizer still starts and tokenizes; each structured request gets the reason."""
    from components.model import structured

    def unreadable(*args):
        raise ValueError("no such token kind")

    monkeypatch.setattr(structured, "ll_tokenizer", unreadable)
    service = await _tokenizer_service(tmp_path, model_path)
    why = service._check_structured(StructuredOutput(regex="[0-9]+"))
    assert why.startswith("structured output is unavailable") and "no such token kind" in why
