"""Hugging Face transformers references for the end-to-end tests: the same GGUF weights,
in float32 (the ``hf`` fixture in conftest.py loads them once per session)."""
from __future__ import annotations

from pathlib import Path

import torch


def load_hf(model_path: Path):
    """``(tokenizer, model)`` from the GGUF file, float32, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenizers import pre_tokenizers

    tok = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    # HF's GGUF converter drops SmolLM2's digit split; the model's own tokenizer.json
    # (and llama.cpp for tokenizer.ggml.pre=smollm) splits digits before byte-level BPE.
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                 dtype=torch.float32)
    model.eval()
    return tok, model


def hf_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy continuation of ``ids`` (``generate``, no EOS stop)."""
    tok, model = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


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
