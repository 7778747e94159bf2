"""What the parent knows of the models without building one (torch-free at import): their names,
the vit's and MoE's sizes, one sample's shape, and the checks of ``model.*`` (gpt's sizes:
gpt_sizes.py)."""

from __future__ import annotations

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError

MODEL_NAMES = ("cnn", "resnet18", "vit", "gpt")  # model=<name>; build.py maps each to its class
RECOMPUTABLE = ("vit", "gpt")  # models with transformer blocks trainer.recompute can recompute
VIT_DEFAULTS = {
    "patch": 4,
    "dim": 64,
    "depth": 4,
    "heads": 4,
    "mlp_ratio": 2.0,
    "dropout": 0.0,
    "dropout_placement": "vit",
}
# model.dropout_placement: where the vit's MLP has dropout. vit: after GELU and after fc2
# (Dosovitskiy et al., as timm's Mlp); gpt: after fc2 only, as GPT-2 and Megatron's ParallelMLP
# (arXiv 2205.05198's activation count assumes that layout).
VIT_PLACEMENTS = ("vit", "gpt")
IMAGE = 32  # CIFAR-10's side
IMAGE_SHAPE = (3, IMAGE, IMAGE)  # one CIFAR image: the input of cnn, resnet18 and vit
NORMS = ("group", "batch", "syncbatch")  # model.norm (config/schema.py Norm)
# model.moe_* defaults, the one home (config/schema.py ModelConfig leaves them null; models/moe.py).
MOE_DEFAULTS = {
    "moe_experts": 0,
    "moe_topk": 1,
    "moe_every": 2,
    "moe_aux_weight": 0.01,
    "moe_capacity_factor": None,
}


def norm_of(cfg: DictConfig) -> str:
    """model.norm as a plain string (a str-Enum in a typed config, a string in a loaded config.yaml)."""
    value = cfg.get("norm", "group")
    return getattr(value, "value", value)


def validate_model_config(cfg: DictConfig) -> None:
    if cfg.name not in MODEL_NAMES:
        raise ConfigError(f"unknown model '{cfg.name}'; choose one of: {', '.join(MODEL_NAMES)} (model=<name>)")
    width = cfg.get("width", 1.0)
    if not (isinstance(width, (int, float)) and 0 < width <= 1000):
        raise ConfigError(f"model.width={width} must be a number in (0, 1000]; use model.width=1 (the default)")
    if norm_of(cfg) not in NORMS:
        raise ConfigError(f"model.norm={norm_of(cfg)} is unknown; use model.norm={'|'.join(NORMS)} (default group)")
    if cfg.name == "vit":
        _validate_vit(cfg)
    _validate_moe(cfg)
    if cfg.name == "gpt":
        _validate_gpt(cfg)


def vit_sizes(cfg: DictConfig) -> dict:
    """The vit's sizes: each model.<key> the config sets, else the vit's default (models/vit.py)."""
    return {key: default if cfg.get(key) is None else cfg.get(key) for key, default in VIT_DEFAULTS.items()}


def moe_options(cfg: DictConfig) -> dict:
    """The model.moe_* keys: each the config sets, else its default (models/moe.py MOE_DEFAULTS)."""
    return {key: default if cfg.get(key) is None else cfg.get(key) for key, default in MOE_DEFAULTS.items()}


def _validate_moe(cfg: DictConfig) -> None:
    m = moe_options(cfg)
    if not m["moe_experts"]:
        return
    if cfg.name not in ("vit", "gpt"):
        raise ConfigError(
            f"model.moe_experts={m['moe_experts']}: only the vit and the gpt have MoE layers; "
            "use model=vit or model=gpt"
        )
    for key, low in (("moe_experts", 1), ("moe_topk", 1), ("moe_every", 1)):
        if not isinstance(m[key], int) or isinstance(m[key], bool) or m[key] < low:
            raise ConfigError(f"model.{key}={m[key]} must be an integer >= {low}; e.g. model.{key}=2")
    if m["moe_topk"] > m["moe_experts"]:
        raise ConfigError(
            f"model.moe_topk={m['moe_topk']} exceeds model.moe_experts={m['moe_experts']}; "
            f"use model.moe_topk<={m['moe_experts']}"
        )
    depth_key, depth, dropout = _moe_host(cfg)
    if m["moe_every"] > depth:
        raise ConfigError(
            f"model.moe_every={m['moe_every']} > model.{depth_key}={depth} leaves no MoE block; use model.moe_every=2"
        )
    cf = m["moe_capacity_factor"]
    if cf is not None and not (isinstance(cf, (int, float)) and cf > 0):
        raise ConfigError(f"model.moe_capacity_factor={cf} must be > 0 (null = dropless); e.g. 1.25")
    if dropout:
        raise ConfigError(
            f"model.dropout={dropout} with MoE layers: experts reorder tokens, a sample's "
            "mask cannot follow them; use model.dropout=0"
        )
    if cfg.name == "gpt" and _gpt_value(cfg, "mlp") != "gelu":
        raise ConfigError(
            f"model.mlp={_gpt_value(cfg, 'mlp')} with MoE layers: each expert is the dense GELU MLP "
            "(fc1 -> GELU -> fc2, models/moe.py); use model.mlp=gelu"
        )


def _gpt_value(cfg: DictConfig, key: str):
    from parallel_lab.models.gpt_sizes import gpt_sizes

    return gpt_sizes(cfg)[key]


def _moe_host(cfg: DictConfig) -> tuple[str, int, float]:
    """(the depth key, its value, model.dropout) of the model the MoE layers sit in."""
    if cfg.name == "gpt":
        return "layers", _gpt_value(cfg, "layers"), _gpt_value(cfg, "dropout")
    s = vit_sizes(cfg)
    return "depth", s["depth"], s["dropout"]


def _validate_vit(cfg: DictConfig) -> None:
    s = vit_sizes(cfg)
    if norm_of(cfg) != "group":
        raise ConfigError(
            f"model.norm={norm_of(cfg)}: the vit has LayerNorm, no BatchNorm to change; "
            "use model.norm=group (the default)"
        )
    for key in ("patch", "dim", "depth", "heads"):
        if not isinstance(s[key], int) or isinstance(s[key], bool) or s[key] < 1:
            raise ConfigError(f"model.{key}={s[key]} must be an integer >= 1; use model.{key}={VIT_DEFAULTS[key]}")
    if IMAGE % s["patch"]:
        raise ConfigError(f"model.patch={s['patch']} does not divide the {IMAGE}-pixel image; use 1, 2, 4, 8, 16 or 32")
    if s["dim"] % s["heads"]:
        raise ConfigError(
            f"model.heads={s['heads']} does not divide model.dim={s['dim']}; use a dim that is a multiple of heads"
        )
    if not (isinstance(s["mlp_ratio"], (int, float)) and round(s["dim"] * s["mlp_ratio"]) >= 1):
        raise ConfigError(f"model.mlp_ratio={s['mlp_ratio']} gives no MLP width; use model.mlp_ratio=2")
    if not (isinstance(s["dropout"], (int, float)) and 0 <= s["dropout"] < 1):
        raise ConfigError(f"model.dropout={s['dropout']} must be in [0, 1); use model.dropout=0 (off, the default)")
    if s["dropout_placement"] not in VIT_PLACEMENTS:
        raise ConfigError(
            f"model.dropout_placement={s['dropout_placement']} is unknown; use model.dropout_placement=vit "
            "(the default: dropout after GELU too) or gpt (after fc2 only, as GPT and Megatron)"
        )


def _validate_gpt(cfg: DictConfig) -> None:
    from parallel_lab.models.gpt_sizes import MLPS, POSITIONS, PRESETS, gpt_sizes

    preset = cfg.get("preset")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"model.preset={preset} is unknown; use one of: {', '.join(PRESETS)}")
    if norm_of(cfg) != "group" or float(cfg.get("width", 1.0)) != 1.0:
        raise ConfigError(
            "model=gpt has LayerNorm and takes its widths from model.hidden/model.ffn; "
            "drop model.norm and model.width (use model.hidden=<n>)"
        )
    s = gpt_sizes(cfg)
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab"):
        if not isinstance(s[key], int) or isinstance(s[key], bool) or s[key] < 1:
            raise ConfigError(f"model.{key}={s[key]} must be an integer >= 1; e.g. model.{key}=64")
    if s["hidden"] % s["heads"] or (s["hidden"] // s["heads"]) % 2:
        raise ConfigError(
            f"model.heads={s['heads']} must divide model.hidden={s['hidden']} into an even head width; "
            f"use e.g. model.hidden={s['heads'] * 16}"
        )
    if s["heads"] % s["kv_heads"]:
        raise ConfigError(
            f"model.kv_heads={s['kv_heads']} must divide model.heads={s['heads']} (each kv head serves "
            f"heads / kv_heads query heads); use model.kv_heads={s['heads']} or a divisor of it"
        )
    for key, allowed in (("positions", POSITIONS), ("mlp", MLPS)):
        if s[key] not in allowed:
            raise ConfigError(f"model.{key}={s[key]} is unknown; use model.{key}={'|'.join(allowed)}")
    if not (isinstance(s["dropout"], (int, float)) and 0 <= s["dropout"] < 1):
        raise ConfigError(f"model.dropout={s['dropout']} must be in [0, 1); use model.dropout=0 (off, the default)")


def sample_shape(cfg: DictConfig) -> tuple[int, ...]:
    """One sample's input shape: a CIFAR image (3, 32, 32), or gpt's sequence of model.seq token ids."""
    if cfg.name != "gpt":
        return IMAGE_SHAPE
    from parallel_lab.models.gpt_sizes import gpt_sizes

    return (gpt_sizes(cfg)["seq"],)
