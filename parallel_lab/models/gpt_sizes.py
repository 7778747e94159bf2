"""gpt's sizes (torch-free: the parent validates model=gpt before importing torch): the tiny
default, the presets (model.preset=<name>), and how a config resolves to sizes. The model: gpt.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The tiny default: trains on CPU in seconds (conf/model/gpt.yaml writes it out). ffn null = 4 x
# hidden, kv_heads null = heads (plain multi-head attention).
DEFAULTS: dict[str, Any] = {
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "kv_heads": None,
    "ffn": None,
    "seq": 64,
    "vocab": 256,
    "tied": True,
    "positions": "learned",
    "mlp": "gelu",
    "bias": True,
    "dropout": 0.0,
}
POSITIONS = ("learned", "rotary")
MLPS = ("gelu", "swiglu")
ROPE_THETA = 10_000.0  # RoFormer's base (Su et al. arXiv 2104.09864); Llama 3 uses 500,000 (no effect on shapes)


def _megatron(layers: int, hidden: int, heads: int, vocab: int = 51_200) -> dict[str, Any]:
    """A Megatron-LM GPT: 4h MLP of GELU, learned positions, tied embeddings, seq 2048, the GPT-2
    tokenizer's vocabulary padded to 51,200, biases."""
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": heads,
        "ffn": 4 * hidden,
        "seq": 2048,
        "vocab": vocab,
        "tied": True,
        "positions": "learned",
        "mlp": "gelu",
        "bias": True,
    }


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, vocab: int) -> dict[str, Any]:
    """A Llama: SwiGLU MLP, rotary positions, untied embeddings, no biases (LayerNorm kept here
    where Llama has RMSNorm: h parameters per norm fewer, nothing else changes)."""
    return {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "ffn": ffn,
        "seq": seq,
        "vocab": vocab,
        "tied": False,
        "positions": "rotary",
        "mlp": "swiglu",
        "bias": False,
    }


# model.preset=<name>: published shapes. Each row's source beside it.
PRESETS: dict[str, dict[str, Any]] = {
    # Brown et al. 2020 (arXiv 2005.14165) Table 2.1, GPT-3 175B: 96 layers, d_model 12288, 96 heads,
    # n_ctx 2048; the GPT-2 BPE vocabulary of 50,257 (section 2.1 / GPT-2's tokenizer), tied, learned.
    "gpt3_175b": _megatron(96, 12288, 96, vocab=50_257),
    # Narayanan et al. 2021 (arXiv 2104.04473) Table 1 (heads, hidden, layers); seq 2048, vocab 51,200 (section 5).
    "narayanan_1.7b": _megatron(24, 2304, 24),
    "narayanan_3.6b": _megatron(30, 3072, 32),
    "narayanan_7.5b": _megatron(36, 4096, 32),
    "narayanan_18b": _megatron(40, 6144, 48),
    "narayanan_39b": _megatron(48, 8192, 64),
    "narayanan_76b": _megatron(60, 10240, 80),
    "narayanan_145b": _megatron(80, 12288, 96),
    "narayanan_310b": _megatron(96, 16384, 128),
    "narayanan_530b": _megatron(105, 20480, 128),
    "narayanan_1t": _megatron(128, 25600, 160),
    # Korthikanti et al. 2022 (arXiv 2205.05198) Table 3 (heads, hidden, layers); seq 2048, vocab 51,200.
    "korthikanti_22b": _megatron(48, 6144, 64),
    "korthikanti_175b": _megatron(96, 12288, 96),
    "korthikanti_530b": _megatron(105, 20480, 128),
    "korthikanti_1t": _megatron(128, 25600, 160),
    # Llama 3 (arXiv 2407.21783) Table 3: layers, model dim, FFN dim, heads, 8 KV heads; seq 8192
    # (pre-training; section 3.4.2); vocab 128,256 (the released models' config.json; the paper says "128K").
    "llama3_8b": _llama(32, 4096, 32, 8, 14336, 8192, 128_256),
    "llama3_70b": _llama(80, 8192, 64, 8, 28672, 8192, 128_256),
    "llama3_405b": _llama(126, 16384, 128, 8, 53248, 8192, 128_256),
    # Generic shapes for advice tables. 1.3B: GPT-3 XL (Brown et al. Table 2.1: 24 layers, d_model
    # 2048) with Megatron's 16 heads of 128 and vocab 51,200. 7B/13B/70B: Llama 2 (Touvron et al.
    # arXiv 2307.09288, Table 1 and the released config.json: dims 4096/5120/8192, FFN 11008/13824/
    # 28672, seq 4096, vocab 32,000; 70B with 8 KV heads).
    "generic_1.3b": _megatron(24, 2048, 16),
    "generic_7b": _llama(32, 4096, 32, 32, 11008, 4096, 32_000),
    "generic_13b": _llama(40, 5120, 40, 40, 13824, 4096, 32_000),
    "generic_70b": _llama(80, 8192, 64, 8, 28672, 4096, 32_000),
}


def resolve_sizes(preset: str | None, given: dict[str, Any]) -> dict[str, Any]:
    """The model's sizes: DEFAULTS, then the preset's row, then every key given (not None).
    ffn and kv_heads, still None, become 4 x hidden and heads."""
    sizes = {**DEFAULTS, **(PRESETS[preset] if preset else {})}
    sizes.update({k: v for k, v in given.items() if k in DEFAULTS and v is not None})
    if sizes["ffn"] is None:
        sizes["ffn"] = 4 * sizes["hidden"]
    if sizes["kv_heads"] is None:
        sizes["kv_heads"] = sizes["heads"]
    return sizes


def gpt_sizes(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The sizes a model config asks for: ``preset``'s row (if any) under every key it sets."""
    return resolve_sizes(cfg.get("preset"), {key: cfg.get(key) for key in DEFAULTS})
