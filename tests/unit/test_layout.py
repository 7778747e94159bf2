"""The torch-free answers the parent refuses with (models/layout.py: each model's top-level blocks
and the weight shapes a tensor-parallel split splits) and sizes its memory check with
(models/counts.py: the parameter count, the saved bytes per sample) equal the meta model's, for several configs
of every model: the tp plan and its split widths (tp/rules.py ``config_split_plan``,
``split_widths``), the pipeline's cuttable blocks (pp/cuts.py ``config_blocks``). Each
reference is read here from a model built on the meta device, so the two can never drift."""

from __future__ import annotations

import pytest
from omegaconf import DictConfig, OmegaConf

from parallel_lab.models import build_meta_model, count_params, validate_model_config
from parallel_lab.models.counts import activation_bytes_per_sample, param_count
from parallel_lab.models.layout import children, weight_shapes
from parallel_lab.strategies.pp.cuts import config_blocks
from parallel_lab.strategies.pp.plan import cuttable_blocks
from parallel_lab.strategies.tp.rules import config_split_plan, split_plan, split_widths
from tests.support.cli import compose_cfg

CONFIGS = {  # model -> the model.* keys of each config checked
    "cnn": [{}, {"width": 0.5}, {"width": 2.3, "norm": "batch"}, {"width": 0.01}],
    "resnet18": [{}, {"width": 0.5}, {"width": 1.7, "norm": "batch"}],
    "vit": [
        {},
        {"dim": 48, "heads": 3, "depth": 3, "mlp_ratio": 3.0},
        {"width": 1.5, "patch": 8, "mlp_ratio": 1.3},
        {"moe_experts": 4, "moe_every": 2},
        {"moe_experts": 2, "moe_every": 1, "depth": 2},
    ],
    "gpt": [
        {},
        {"layers": 3, "hidden": 96, "heads": 6, "kv_heads": 2, "mlp": "swiglu", "tied": False},
        {"ffn": 100, "positions": "rotary", "bias": False},
        {"preset": "narayanan_1.7b"},
        {"preset": "llama3_8b", "layers": 2},
        {"layers": 4, "moe_experts": 4, "moe_every": 2},
    ],
}
CASES = [(name, keys) for name, configs in CONFIGS.items() for keys in configs]
IDS = [f"{name}-{'-'.join(map(str, keys.values())) or 'default'}" for name, keys in CASES]


@pytest.fixture(scope="module")
def bases() -> dict[str, DictConfig]:
    return {name: compose_cfg(f"model={name}") for name in CONFIGS}


def model_cfg(bases: dict[str, DictConfig], name: str, keys: dict) -> DictConfig:
    cfg = bases[name].copy()
    for key, value in keys.items():
        OmegaConf.update(cfg, f"model.{key}", value)
    validate_model_config(cfg.model)
    return cfg.model


def meta_widths(model, plan) -> list[tuple[str, int, str]]:
    """The split widths read off the meta model's weights (a column's dim 0, a row's dim 1)."""
    widths = []
    for column, row in plan:
        if column is not None:
            widths.append((column, model.get_submodule(column).weight.shape[0], "output features/channels"))
        widths.append((row, model.get_submodule(row).weight.shape[1], "input features/channels"))
    return widths


@pytest.mark.parametrize("name, keys", CASES, ids=IDS)
def test_torch_free_layout_is_the_meta_models(bases, name, keys):
    cfg = model_cfg(bases, name, keys)
    model = build_meta_model(cfg)
    assert children(cfg) == [(n, any(True for _ in c.parameters())) for n, c in model.named_children()]
    assert param_count(cfg) == count_params(model)  # the parent's memory check (models/counts.py)
    assert activation_bytes_per_sample(cfg) == model.activation_bytes_per_sample
    assert config_blocks(DictConfig({"model": cfg})) == cuttable_blocks(model)
    for layer, shape in weight_shapes(cfg).items():
        assert tuple(model.get_submodule(layer).weight.shape[:2]) == shape, layer
    for split_conv in (False, True) if name == "cnn" else (False,):
        plan = split_plan(name, split_conv, model)
        assert config_split_plan(cfg, split_conv) == plan
        assert split_widths(cfg, split_conv) == meta_widths(model, plan)
