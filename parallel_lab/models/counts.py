"""How big a model is, from ``model.*`` alone (torch-free): its parameter count and the bytes autograd
saves per sample. The parent's memory check (config/resources.py) needs no more, so it never imports
torch for it (about 1.5 s of CPU in every command's parent). tests/unit/test_layout.py checks the
count against the meta model's for configs of every model; tests/unit/test_resources.py the saved
bytes against a real forward."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from parallel_lab.models.gpt_sizes import gpt_sizes
from parallel_lab.models.layout import RESNET_CHANNELS, cnn_widths, moe_block, scaled, vit_widths
from parallel_lab.models.specs import IMAGE, moe_options, norm_of, vit_sizes

# Saved for backward per sample of batch at the default sizes (the vit's too: an estimate elsewhere).
ACTIVATION_BYTES_PER_SAMPLE = {"cnn": 386_096, "resnet18": 4_705_328, "vit": 1_082_160}


def linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def param_count(cfg: DictConfig) -> int:
    """Every parameter the model of ``cfg`` (model.*) has: count_params of its meta build."""
    counts = {"cnn": _cnn, "resnet18": _resnet18, "vit": _vit, "gpt": _gpt_count}
    return counts[cfg.name](cfg)


def activation_bytes_per_sample(cfg: DictConfig) -> int:
    """What autograd saves per sample, about (the planner counts it exactly)."""
    return gpt_activation_bytes(gpt_sizes(cfg)) if cfg.name == "gpt" else ACTIVATION_BYTES_PER_SAMPLE[cfg.name]


def gpt_activation_bytes(s: dict[str, Any]) -> int:
    """Korthikanti et al. (arXiv 2205.05198): s h (34 + 5 a s / h) bytes per layer in 16-bit, twice
    that in fp32, plus the logits and their log-softmax."""
    seq, hidden = s["seq"], s["hidden"]
    per_layer = seq * hidden * (34 + 5 * s["heads"] * seq / hidden)
    return int(2 * s["layers"] * per_layer + 2 * 4 * seq * s["vocab"])


def _cnn(cfg: DictConfig) -> int:
    c1, c2, hidden, features = cnn_widths(float(cfg.get("width", 1.0)))
    norm = 0 if norm_of(cfg) == "group" else 2  # BatchNorm2d's weight and bias per channel
    convs = sum(linear(9 * c_in, c_out) + norm * c_out for c_in, c_out in ((3, c1), (c1, c2), (c2, c2)))
    return convs + linear(features, hidden) + linear(hidden, cfg.num_classes)


def _resnet18(cfg: DictConfig) -> int:
    channels = [scaled(c, float(cfg.get("width", 1.0))) for c in RESNET_CHANNELS]

    def block(c_in: int, c_out: int, stride: int) -> int:  # two 3x3 convolutions, each normed (2 c_out)
        body = 9 * c_in * c_out + 9 * c_out * c_out + 4 * c_out
        return body + (c_in * c_out + 2 * c_out if stride != 1 or c_in != c_out else 0)  # the 1x1 shortcut

    total, c_in = 27 * channels[0] + 2 * channels[0], channels[0]  # the stem
    for c_out, stride in zip(channels, (1, 2, 2, 2)):
        total += block(c_in, c_out, stride) + block(c_out, c_out, 1)
        c_in = c_out
    return total + linear(channels[-1], cfg.num_classes)


def _mlp_or_experts(i: int, dim: int, hidden: int, dense: int, moe: dict) -> int:
    """Block i's MLP: the dense one, or an MoE layer's router and experts (models/moe.py)."""
    if not moe_block(i, moe["moe_experts"], moe["moe_every"]):
        return dense
    return dim * moe["moe_experts"] + moe["moe_experts"] * (linear(dim, hidden) + linear(hidden, dim))


def _vit(cfg: DictConfig) -> int:
    s, moe = vit_sizes(cfg), moe_options(cfg)
    dim, hidden = vit_widths(s["dim"], s["heads"], float(cfg.get("width", 1.0)), s["mlp_ratio"])
    embed = linear(3 * s["patch"] ** 2, dim) + (IMAGE // s["patch"]) ** 2 * dim  # patch convolution, positions
    dense = linear(dim, hidden) + linear(hidden, dim)
    blocks = sum(
        4 * dim + 4 * linear(dim, dim) + _mlp_or_experts(i, dim, hidden, dense, moe) for i in range(s["depth"])
    )
    return embed + blocks + 2 * dim + linear(dim, cfg.num_classes)


def _gpt_count(cfg: DictConfig) -> int:
    s, moe = gpt_sizes(cfg), moe_options(cfg)
    h, ffn, bias = s["hidden"], s["ffn"], s["bias"]
    kv = s["kv_heads"] * (h // s["heads"])
    embed = s["vocab"] * h + (s["seq"] * h if s["positions"] == "learned" else 0)
    attention = 2 * linear(h, h, bias) + 2 * linear(h, kv, bias)
    gate = linear(h, ffn, bias) if s["mlp"] == "swiglu" else 0
    dense = gate + linear(h, ffn, bias) + linear(ffn, h, bias)
    blocks = sum(4 * h + attention + _mlp_or_experts(i, h, ffn, dense, moe) for i in range(s["layers"]))
    return embed + blocks + 2 * h + (0 if s["tied"] else h * s["vocab"])
