"""The models' structure from ``model.*`` alone (torch-free: the parent refuses a bad split or cut
before importing torch): each model's widths, its top-level blocks (``children``: what a pipeline
cuts between) and the weight shapes of the layers a tensor-parallel split can split
(``weight_shapes``). The networks (cnn.py, resnet.py, vit.py, gpt.py) take their widths from here;
tests/unit/test_layout.py checks both answers against the meta model for configs of every model."""

from __future__ import annotations

from omegaconf import DictConfig

from parallel_lab.models.specs import IMAGE, moe_options, vit_sizes

CNN_CHANNELS = (32, 64)  # block1's and block2's output channels at width 1 (block3 keeps block2's)
CNN_HIDDEN = 256  # fc1's output features at width 1
CNN_POOLS = 3  # block1..3 each halve the image (MaxPool2d(2)): fc1 sees (IMAGE / 8)^2 positions
RESNET_CHANNELS = (64, 128, 256, 512)  # the stem's/layer1's, layer2's, layer3's, layer4's at width 1

Shapes = dict[str, tuple[int, int]]  # layer -> its weight's (dim 0, dim 1): (out, in) features/channels


def cnn_widths(width: float, hidden: int = CNN_HIDDEN) -> tuple[int, int, int, int]:
    """The cnn's (block1's channels, block2's and block3's, fc1's outputs, fc1's inputs) at ``width``."""
    c1, c2, hidden = (max(1, round(c * width)) for c in (*CNN_CHANNELS, hidden))  # width 1: 32, 64, 256
    return c1, c2, hidden, c2 * (IMAGE // 2**CNN_POOLS) ** 2


def scaled(channels: int, width: float) -> int:
    """resnet18's channels x width, rounded to a multiple of 32 (GroupNorm's 32 groups must divide
    it); width 1 keeps 64, 128, 256, 512."""
    return max(32, round(channels * width / 32) * 32)


def scaled_dim(dim: int, heads: int, width: float) -> int:
    """model.width on the vit: dim x width, rounded to a multiple of heads (width 1 keeps dim)."""
    return max(heads, round(dim * width / heads) * heads)


def vit_widths(dim: int, heads: int, width: float, mlp_ratio: float) -> tuple[int, int]:
    """The vit's (token width, MLP hidden width)."""
    dim = scaled_dim(dim, heads, width)
    return dim, round(dim * mlp_ratio)


def moe_block(i: int, experts: int, every: int) -> bool:
    """Whether block i (the vit's or the gpt's) has an MoE MLP: every ``every``-th block (V-MoE's layout)."""
    return experts > 0 and i % every == every - 1


def children(cfg: DictConfig) -> list[tuple[str, bool]]:
    """The model's top-level children in order, each with whether it holds parameters."""
    if cfg.name == "cnn":
        names = ("block1", "block2", "block3", "flatten", "fc1", "relu", "fc2")
        return [(n, n not in ("flatten", "relu")) for n in names]
    if cfg.name == "resnet18":
        return [(n, True) for n in ("stem", "layer1", "layer2", "layer3", "layer4")] + [("pool", False), ("fc", True)]
    depth = _gpt(cfg)["layers"] if cfg.name == "gpt" else vit_sizes(cfg)["depth"]
    return [("embed", True), *((f"block{i}", True) for i in range(depth)), ("head", True)]


def weight_shapes(cfg: DictConfig) -> Shapes:
    """The weight shapes of every layer a tensor-parallel plan can split (tp/rules.py): the cnn's
    first two convolutions and its classifier, resnet18's fc, each transformer block's attention
    and dense MLP Linears (none for an MoE block's MLP)."""
    width = float(cfg.get("width", 1.0))
    if cfg.name == "cnn":
        c1, c2, hidden, features = cnn_widths(width)
        return {"block1.0": (c1, 3), "block2.0": (c2, c1), "fc1": (hidden, features), "fc2": (cfg.num_classes, hidden)}
    if cfg.name == "resnet18":
        return {"fc": (cfg.num_classes, scaled(RESNET_CHANNELS[-1], width))}
    if cfg.name == "gpt":
        return _gpt_shapes(_gpt(cfg), moe_options(cfg))
    s, m = vit_sizes(cfg), moe_options(cfg)
    dim, hidden = vit_widths(s["dim"], s["heads"], width, s["mlp_ratio"])
    shapes: Shapes = {}
    for i in range(s["depth"]):
        shapes.update({f"block{i}.attn.{n}": (dim, dim) for n in ("q", "k", "v", "proj")})
        if not moe_block(i, m["moe_experts"], m["moe_every"]):
            shapes.update({f"block{i}.mlp.fc1": (hidden, dim), f"block{i}.mlp.fc2": (dim, hidden)})
    return shapes


def _gpt(cfg: DictConfig) -> dict:
    from parallel_lab.models.gpt_sizes import gpt_sizes

    return gpt_sizes(cfg)


def _gpt_shapes(s: dict, m: dict) -> Shapes:
    h, ffn, kv = s["hidden"], s["ffn"], s["kv_heads"] * (s["hidden"] // s["heads"])
    attention = {"attn.q": (h, h), "attn.k": (kv, h), "attn.v": (kv, h), "attn.proj": (h, h)}
    mlp = {"mlp.gate": (ffn, h)} if s["mlp"] == "swiglu" else {}
    mlp.update({"mlp.fc1": (ffn, h), "mlp.fc2": (h, ffn)})
    shapes: Shapes = {}
    for i in range(s["layers"]):
        dense = not moe_block(i, m["moe_experts"], m["moe_every"])
        shapes.update({f"block{i}.{name}": shape for name, shape in {**attention, **(mlp if dense else {})}.items()})
    return shapes
