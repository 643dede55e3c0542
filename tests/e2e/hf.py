"""Hugging Face transformers references for the end-to-end tests: the same GGUF weights,
in float32 (the ``hf`` fixture in conftest.py loads them once per session)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch


@contextlib.contextmanager
def _gguf_read_once():
    """While transformers loads the GGUF: one ``gguf.GGUFReader`` per file, and one tensor
    name map per (architecture, layers). Its GGUF path reads the file's header three times
    (tokenizer, config, weights: ~6 s each on 2 cores) and builds the name map again for
    each of the 397 names it converts (~12 s in all). The same file gives the same reader
    and the same arguments the same map, so what transformers computes is unchanged; only
    the repeats go."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}
    maps: dict = {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    def name_map(*args):
        if args not in maps:
            maps[args] = real_map(*args)
        return maps[args]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def load_hf(model_path: Path):
    """``(tokenizer, model)`` from the GGUF file, float32, eval mode."""
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_read_once():
        tok = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
        model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                     dtype=torch.float32)
    # HF's GGUF converter drops SmolLM2's digit split; the model's own tokenizer.json
    # (and llama.cpp for tokenizer.ggml.pre=smollm) splits digits before byte-level BPE.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    model.eval()
    return tok, model


def hf_logits_along(hf, ids: list[int], generated: list[int]) -> torch.Tensor:
    """HF's float32 logits ``[len(generated), vocab]`` for each position of ``generated``
    after ``ids`` + the generated tokens before it: one teacher-forced forward instead of
    ``generate``'s prefill and one step per token.

    A greedy output equals HF's greedy generation exactly when every token is the argmax
    of its row here: at the first token that differed, the prefix would be HF's own."""
    _, model = hf
    with torch.inference_mode():
        x = torch.tensor([ids + generated[:-1]])
        return model(x, logits_to_keep=len(generated)).logits[0].float()
