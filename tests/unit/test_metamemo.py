"""The planner's memoized meta kernels (plan/metamemo.py) change nothing it counts: a model's
census (calls, FLOPs, bytes moved per kind) and its saved-activation bytes, with and without
recompute, are the same counted under ``MetaMemo`` (each kernel's first call and its replays)
as without it, for a model of each kind of layer (GroupNorm convolutions, BatchNorm, the vit's and
the gpt's transformer blocks); and the replays are real (most calls of a second pass hit)."""

from __future__ import annotations

import pytest
import torch

from parallel_lab.models import build_meta_model
from parallel_lab.plan.census import count_pass
from parallel_lab.plan.metamemo import MetaMemo
from parallel_lab.plan.predict import recompute_peak_bytes, saved_activation_bytes
from tests.support.cli import compose_cfg

MODELS = [
    ("model=resnet18", "model.width=0.25"),
    ("model=cnn", "model.norm=batch"),
    ("model=vit",),
    ("model=gpt", "model.mlp=swiglu", "model.kv_heads=2"),
]


def counts(model: torch.nn.Module, recompute: str) -> tuple:
    shape = getattr(model, "input_shape", (3, 32, 32))
    census = count_pass(model, 4, shape)
    saved = [
        f(model, 4, shape, True, torch.float32, False, recompute)
        for f in (saved_activation_bytes, recompute_peak_bytes)
    ]
    bf16 = saved_activation_bytes(model, 2, shape, True, torch.bfloat16, False, recompute)
    return census.calls, census.units, census.thin, saved, bf16


@pytest.mark.parametrize("overrides", MODELS, ids=[o[0] for o in MODELS])
def test_memoized_meta_passes_count_what_plain_ones_do(overrides):
    model = build_meta_model(compose_cfg(*overrides).model)
    recompute = "full" if hasattr(model, "block0") else "none"
    plain = counts(model, recompute)
    memo = MetaMemo()
    with memo:
        first = counts(model, recompute)
        hits_before = len(memo._memo)
        second = counts(model, recompute)
    assert first == plain and second == plain
    assert hits_before > 10 and len(memo._memo) == hits_before  # the second pass added no new shape
