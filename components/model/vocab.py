"""Load a model's tokenizer from a GGUF file or a Hugging Face directory."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from components.model.gguf_header import read_header

_GGUF_NORMAL, _GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED = 1, 2, 3, 4

# tokenizer.ggml.pre -> whether digits are split one by one before the GPT-2 regex
# (llama.cpp's table; for smollm it matches the Hub tokenizer.json's
# Sequence[Digits(individual_digits), ByteLevel]).
_GGUF_PRE_SPLITS_DIGITS = {"gpt2": False, "smollm": True, "starcoder": True, "refact": True}


@dataclass(frozen=True, eq=False)
class TokenizerBundle:
    """A ready tokenizer plus the facts about it that serving needs."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    special_ids: frozenset[int]
    add_bos: bool

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids for text; special-token strings in text become their ids.

        BOS is prepended only when the model asks for it and text does not already start with it.
        A batch of one, since ``encode_batch`` releases the GIL and ``encode`` does not
        (tokenizers 0.23): on a worker thread (the router's long prompts) it leaves the event
        loop running. The same ids, at the same cost (measured 36 us vs 37 us at 10 words,
        4.5 ms both at 2000); 420K characters held another thread off 222 ms, now 2 ms.
        """
        ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_path: str | Path) -> TokenizerBundle:
    """Build the tokenizer for a .gguf file or a directory holding tokenizer.json."""
    path = Path(model_path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return _from_hf_dir(path)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    raise ValueError(f"{path}: expected a .gguf file or a directory with tokenizer.json")


def _from_gguf(path: Path) -> TokenizerBundle:
    get = read_header(path).meta.get

    kind = get("tokenizer.ggml.model")
    pre = get("tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported "
                         "(only gpt2 byte-level BPE)")
    if pre not in _GGUF_PRE_SPLITS_DIGITS:
        raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; "
                         "load the model from a Hugging Face directory with tokenizer.json")

    tokens: list[str] = get("tokenizer.ggml.tokens")
    types: list[int] = get("tokenizer.ggml.token_type") or [_GGUF_NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               unk_token=None, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    digits = pre_tokenizers.Digits(individual_digits=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([digits, byte_level])
                         if _GGUF_PRE_SPLITS_DIGITS[pre] else byte_level)
    tok.decoder = decoders.ByteLevel()

    special = [i for i, t in enumerate(types) if t in (_GGUF_CONTROL, _GGUF_UNKNOWN)]
    user = [i for i, t in enumerate(types) if t == _GGUF_USER_DEFINED]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

    bos_id = get("tokenizer.ggml.bos_token_id")
    eos_ids = [get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                "tokenizer.ggml.eom_token_id")]
    eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None))
    return TokenizerBundle(
        tokenizer=tok,
        chat_template=get("tokenizer.chat_template"),
        bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        bos_token_id=int(bos_id) if bos_id is not None else None,
        eos_token_ids=eos_ids,
        special_ids=frozenset(special),
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
    )


def _from_hf_dir(path: Path) -> TokenizerBundle:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = _read_json(path / "tokenizer_config.json")

    bos = _token_text(config.get("bos_token"))
    eos = _token_text(config.get("eos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    eos_ids = [tok.token_to_id(eos)] if eos else []
    for extra in ("generation_config.json", "config.json"):
        found = _read_json(path / extra).get("eos_token_id")
        eos_ids += found if isinstance(found, list) else [found]
    eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None))

    add_bos = config.get("add_bos_token")
    if add_bos is None:
        add_bos = bos_id is not None and tok.encode("", add_special_tokens=True).ids[:1] == [bos_id]
    special = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return TokenizerBundle(
        tokenizer=tok,
        chat_template=_hf_chat_template(path, config),
        bos_token=bos,
        eos_token=eos or (tok.id_to_token(eos_ids[0]) if eos_ids else None),
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        special_ids=special,
        add_bos=bool(add_bos),
    )


def _hf_chat_template(path: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
