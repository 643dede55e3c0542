"""load_tokenizer must give the ids Hugging Face gives, from a GGUF file and from a HF directory.

Hugging Face's GGUF loader builds SmolLM2 with a bare ByteLevel pre-tokenizer, whereas the
model's own tokenizer.json (and llama.cpp for tokenizer.ggml.pre=smollm) first splits digits
one by one. The two disagree on whitespace before a digit ("\\n\\n1." is ["ĊĊ","1","."] for the
model, ["Ċ","Ċ","1","."] for the HF GGUF loader), so the GGUF reference here is HF's vocabulary,
merges and added tokens under the model's own pre-tokenizer.
"""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoTokenizer

from components.model.fetch import default_model_path
from components.model.vocab import load_tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "The quick brown fox jumps over the lazy dog.",
    "   leading and trailing spaces   ",
    "multiple     internal      spaces",
    "tabs\tand\nnewlines\r\nmixed\n\n\n",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "Café naïve résumé façade Ångström São Paulo",
    "e\u0301 combining acute",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트입니다",
    "Россия, привет мир",
    "مرحبا بالعالم",
    "emoji 😀🎉 family 👨‍👩‍👧‍👦 flag 🇫🇷 skin 👍🏽",
    "numbers 1234567890 3.14159 -42 1e10 2,000,000",
    "\n\n1. first\n2. second\n  10. indented",
    "year  2024 and\t7 tabs",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, {"nested": null}], "s": "\\u00e9"}',
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "text<|im_end|>more<|endoftext|>end",
    "a <|im_start|> b <repo_name> c <file_sep>",
    "<|im_start|<|im_end|>|>",
    "ＡＢＣ full-width ①②③ ½ ² Ⅻ",
    "zero\u200bwidth and nbsp\u00a0here",
    "\x00\x01 control \x7f chars",
    "ending with spaces and newline  \n",
    "URL https://example.com/path?q=1&r=2#frag",
    "Ünïcödé ÀÉÎÕÜ ñ ç ß œ æ ø",
]

SPECIAL_STRINGS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"]


@pytest.fixture(scope="module")
def bundle():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def hf():
    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def reference(hf):
    ref = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    return ref


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_reference(bundle, reference, text):
    assert bundle.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_texts_exercise_special_and_multibyte(bundle):
    ids = [i for t in TEXTS for i in bundle.encode(t)]
    assert {1, 2, 0, 3} <= set(ids)
    assert any("\ufffd" in bundle.tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text, tokens", [
    ("\n\n1.", ["ĊĊ", "1", "."]),
    ("  99", ["ĠĠ", "9", "9"]),
    ("x 12", ["x", "Ġ", "1", "2"]),
])
def test_digits_are_split_like_the_model_tokenizer(bundle, text, tokens):
    assert [bundle.tokenizer.id_to_token(i) for i in bundle.encode(text)] == tokens


def test_no_bos_added(bundle):
    assert bundle.encode("Hello")[0] != 1
    assert bundle.encode("<|im_start|>user")[0] == 1


def test_metadata_matches_hf(bundle, hf):
    assert bundle.vocab_size == len(hf) == 49152
    assert bundle.bos_token == hf.bos_token == "<|im_start|>"
    assert bundle.eos_token == hf.eos_token == "<|im_end|>"
    assert bundle.eos_token_ids == (hf.eos_token_id,)
    assert bundle.chat_template == hf.chat_template
    hf_special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert bundle.special_ids == hf_special == set(range(17))


_pieces = st.one_of(
    st.text(max_size=12),
    st.sampled_from(SPECIAL_STRINGS + ["  ", "\n\n", " 7", "42", "é", "😀", "\t"]),
)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_pieces, max_size=8).map("".join))
def test_random_text_ids_equal_reference(bundle, reference, text):
    assert bundle.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_hf_directory_matches_hf(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == hf.encode(text, add_special_tokens=False)
    assert loaded.chat_template == hf.chat_template
    assert (loaded.bos_token, loaded.eos_token) == (hf.bos_token, hf.eos_token)
    assert hf.eos_token_id in loaded.eos_token_ids
    assert loaded.special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert loaded.vocab_size == len(hf)


def test_rejects_unknown_path(tmp_path):
    with pytest.raises(ValueError):
        load_tokenizer(tmp_path)
