"""Structured output's languages as llguidance grammars, and the model's vocabulary as
llguidance reads it. The tokenizer process checks a request's language here (a bad schema,
regex or grammar is refused before it is queued); the executor builds its matchers from
the same grammar text (components/executor/constraints.py). llguidance is imported when a
request first asks for structured output, never at a process's start."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from schemas.client import StructuredOutput

if TYPE_CHECKING:
    import llguidance

    from components.model.vocab import TokenizerBundle

# JSON as a model would write it on one line: one space after "," and ":", no other
# whitespace. With flexible whitespace (``json_whitespace``) nothing bounds it: drawing at
# random under the masks, whole budgets went to spaces and newlines inside an object.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def limits() -> llguidance.LLParserLimits:
    """llguidance's limits on the work of one language, tighter than its defaults where
    they bound a step's time: its lexer's fuel per mask (50k, default 200k), to build its
    regexes (200k, default 1M) and its states (20k, default 250k). A pathological regex
    (``a{1000}{1000}``) then reaches them in 0.12 s instead of 1.26 s (2-core AVX512 EPYC)
    while ordinary schemas, dates or 2000-character strings are far from them (1-8 ms to a
    first mask, < 1 ms a step)."""
    import llguidance

    return llguidance.LLParserLimits(step_lexer_fuel=50_000, initial_lexer_fuel=200_000,
                                     max_lexer_states=20_000)


def kind(so: StructuredOutput) -> str:
    """Which kind of language (``json``, ``json_object``, ``regex``, ``choice``,
    ``grammar``): what traces and logs may say of it."""
    return next((k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None),
                "json_object")


def grammar_of(so: StructuredOutput) -> str:
    """llguidance's grammar text for a (well-formed, see ``check_structured``) request.
    Raises ValueError where the text is not even JSON (a schema that does not parse)."""
    from llguidance import LLMatcher

    if so.json is not None or so.json_object:
        schema = so.json if so.json is not None else '{"type": "object"}'
        try:
            json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"json schema is not valid JSON: {exc}") from None
        return LLMatcher.grammar_from_json_schema(
            schema, overrides=None if so.json_whitespace else _COMPACT)
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c)
                                                                   for c in so.choice))
    from llguidance import grammar_from

    return grammar_from("grammar", so.grammar or "")   # Lark, or llama.cpp's GBNF


def ll_tokenizer(bundle: TokenizerBundle, vocab_size: int | None = None
                 ) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance reads it: the same tokenizer, its EOS ids, and the
    model's vocabulary size (its logits' width: larger than the tokenizer's where a model
    pads it). 0.4 s for SmolLM2's 49152 tokens: built once per process, as it starts."""
    import llguidance

    return llguidance.LLTokenizer(bundle.tokenizer.to_str(),
                                  n_vocab=vocab_size or bundle.vocab_size,
                                  eos_token=list(bundle.eos_token_ids) or None)


def check(so: StructuredOutput, tok: llguidance.LLTokenizer) -> str | None:
    """Why ``so``'s language cannot be used with this vocabulary, or None: a schema
    llguidance does not accept, a regex or grammar that does not parse. What passes can
    still reach its parser's limits (``limits()``) later, on the tokens it meets
    (``a{1000}{1000}`` after its first): the request then fails ``structured_output_error``
    with llguidance's reason (``Constraint.error``). Which path a language takes is the
    model's to choose, so no probe here could rule that out."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_of(so)
    except ValueError as exc:
        return f"invalid structured output: {str(exc)[:500]}"
    if why := LLMatcher.validate_grammar(grammar, tok, limits=limits()):
        return f"invalid structured output: {why[:500]}"
    return None
