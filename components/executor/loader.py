"""Load a Llama-family checkpoint (GGUF file or Hugging Face directory) into fp32 tensors.

Canonical weight names (all float32, row-major ``[out, in]`` for linear layers):

    embed                     [vocab, hidden]
    layers.{i}.attn_norm      [hidden]
    layers.{i}.q / k / v      [heads * head_dim | kv_heads * head_dim, hidden]
    layers.{i}.q_bias / k_bias / v_bias   (optional, e.g. Qwen2)
    layers.{i}.o              [hidden, heads * head_dim]
    layers.{i}.mlp_norm       [hidden]
    layers.{i}.gate / up      [intermediate, hidden]
    layers.{i}.down           [hidden, intermediate]
    norm                      [hidden]
    lm_head                   [vocab, hidden]  (the same tensor object as ``embed`` when tied)

Q and K rows follow the Hugging Face (rotate-half) RoPE convention.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from components.model.gguf_header import read_header
from components.model.kv_sizing import gguf_attention, hf_attention
from schemas.model import ModelSpec

_LAYER_KEYS = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "q": ("attn_q.weight", "self_attn.q_proj.weight"),
    "k": ("attn_k.weight", "self_attn.k_proj.weight"),
    "v": ("attn_v.weight", "self_attn.v_proj.weight"),
    "q_bias": ("attn_q.bias", "self_attn.q_proj.bias"),
    "k_bias": ("attn_k.bias", "self_attn.k_proj.bias"),
    "v_bias": ("attn_v.bias", "self_attn.v_proj.bias"),
    "o": ("attn_output.weight", "self_attn.o_proj.weight"),
    "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "down": ("ffn_down.weight", "mlp.down_proj.weight"),
}
_GLOBAL_KEYS = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
}
_GGUF_MAP = {g: c for c, (g, _) in _GLOBAL_KEYS.items()}
_HF_MAP = {h: c for c, (_, h) in _GLOBAL_KEYS.items()}
_GGUF_LAYER = {g: c for c, (g, _) in _LAYER_KEYS.items()}
_HF_LAYER = {h: c for c, (_, h) in _LAYER_KEYS.items()}
_PERMUTED_ARCHS = {"llama"}


def load_model(path: str | Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Read a ``.gguf`` file or a Hugging Face directory (config.json + *.safetensors).

    Returns the model's spec and its weights under the canonical names above, as float32.
    Raises ValueError for unsupported features (unknown tensors, RoPE scaling).
    """
    path = Path(path)
    if path.is_dir():
        return _load_hf_dir(path)
    return _load_gguf(path)


def _canonical(name: str, global_map: dict, layer_map: dict, prefix: str) -> str | None:
    if name in global_map:
        return global_map[name]
    m = re.fullmatch(prefix + r"(\d+)\.(.+)", name)
    if m and m.group(2) in layer_map:
        return f"layers.{m.group(1)}.{layer_map[m.group(2)]}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-pair RoPE permutation of Q/K rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _finish(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> tuple[ModelSpec, dict]:
    if "lm_head" not in weights:
        weights["lm_head"] = weights["embed"]
    required = {"embed", "norm"} | {f"layers.{i}.{k}" for i in range(spec.num_layers)
                                    for k in _LAYER_KEYS if not k.endswith("_bias")}
    missing = required - weights.keys()
    if missing:
        raise ValueError(f"checkpoint lacks tensors: {sorted(missing)[:5]}")
    return spec, weights


def _dequant(raw: torch.Tensor, qtype: QT) -> torch.Tensor:
    """Flat fp32 values of one GGUF tensor's bytes (``raw`` is uint8)."""
    if qtype == QT.F32:
        return raw.view(torch.float32).clone()
    if qtype in (QT.F16, QT.BF16):
        return raw.view(torch.float16 if qtype == QT.F16 else torch.bfloat16).float()
    block, nbytes = GGML_QUANT_SIZES[qtype]
    b = raw.view(-1, nbytes)
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    if qtype == QT.Q8_0:
        return (b[:, 2:].contiguous().view(torch.int8).float() * d).reshape(-1)
    if qtype in (QT.Q4_0, QT.Q4_1):
        qs = b[:, nbytes - block // 2:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=1).float()
        if qtype == QT.Q4_0:
            return ((q - 8.0) * d).reshape(-1)
        m = b[:, 2:4].contiguous().view(torch.float16).float()
        return (q * d + m).reshape(-1)
    return torch.from_numpy(gguf_dequantize(raw.numpy(), qtype)).reshape(-1)


def _load_gguf(path: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    mm, meta, infos, start = read_header(path, string_arrays=False)   # no vocabulary
    arch = meta.get("general.architecture", "llama")
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)
    if a("rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"RoPE scaling {a('rope.scaling.type')!r} is not supported")
    n_head, shape = gguf_attention(meta)
    n_kv, head_dim, hidden = shape.kv_heads, shape.head_dim, a("embedding_length")
    if a("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    data = torch.from_numpy(mm)
    weights: dict[str, torch.Tensor] = {}
    for name, dims, qtype, offset in infos:
        qtype = QT(qtype)
        canon = _canonical(name, _GGUF_MAP, _GGUF_LAYER, r"blk\.")
        if canon is None:
            raise ValueError(f"unsupported GGUF tensor {name!r}")
        n = int(np.prod(dims))
        block, nbytes = GGML_QUANT_SIZES[qtype]
        raw = data[start + offset:start + offset + n // block * nbytes]
        w = _dequant(raw, qtype).reshape(list(reversed(dims)))
        if arch in _PERMUTED_ARCHS and canon.endswith((".q", ".k", ".q_bias", ".k_bias")):
            w = _unpermute(w, n_head if ".q" in canon else n_kv)
        weights[canon] = w
    eos = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot")
           if f"tokenizer.ggml.{k}_token_id" in meta]
    spec = ModelSpec(
        name=re.sub(r"\.(I?Q\d\w*|F16|F32|BF16)$", "", path.stem, flags=re.I),
        num_layers=shape.layers, hidden_size=hidden,
        intermediate_size=a("feed_forward_length"), num_heads=n_head, num_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=a("vocab_size", weights["embed"].shape[0]),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=a("context_length", 2048),
        tie_word_embeddings="lm_head" not in weights,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )
    return _finish(spec, weights)


def _load_hf_dir(path: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling {rope!r} is not supported")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {path}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(f).items():
            canon = _canonical(name, _HF_MAP, _HF_LAYER, r"model\.layers\.")
            if canon is None:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ValueError(f"unsupported tensor {name!r} in {f.name}")
            weights[canon] = t.float()
    tied = cfg.get("tie_word_embeddings", False) or "lm_head" not in weights
    if tied:
        weights.pop("lm_head", None)
    eos: list[int] = []
    gen = path / "generation_config.json"
    for src in (cfg, json.loads(gen.read_text()) if gen.exists() else {}):
        e = src.get("eos_token_id")
        eos += [e] if isinstance(e, int) else list(e or [])
    n_head, shape = hf_attention(cfg)
    spec = ModelSpec(
        name=path.name, num_layers=shape.layers, hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_heads=n_head,
        num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        vocab_size=cfg["vocab_size"],
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=cfg.get("max_position_embeddings", 2048), tie_word_embeddings=tied,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=tuple(dict.fromkeys(eos)),
    )
    return _finish(spec, weights)
