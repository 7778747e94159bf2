"""What makes a cold ``plan.recommend=true`` cheaper changes no prediction (parallel_lab/plan/
candidates.py ``candidates_started``, recommend.py ``predict_all``, metamemo.py ``_DynamoFree``):
the candidates enumerated in a forked process are the ones enumerated here, the recommender's
plain-values step predictions are the DictConfig path's to the bit, and the meta kernels'
TorchDynamo wrappers are bypassed only while a planner mode is open. Nothing here is timed."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from parallel_lab.config import compose_config
from parallel_lab.errors import ConfigError
from parallel_lab.models import build_meta_model
from parallel_lab.plan.candidates import candidates, candidates_started
from parallel_lab.plan.census import _Counter
from parallel_lab.plan.metamemo import MetaMemo, _disable_dynamo_targets
from parallel_lab.plan.predict import Values
from parallel_lab.plan.recommend import predict_all, predict_time
from parallel_lab.strategies import get_strategy_class
from tests.unit.test_recommend import made_up_calibration

OVERRIDES = ["model=cnn", "world_size=2", "plan.recommend=true", "strategy=pp"]


@pytest.fixture(scope="module")
def pp_candidates() -> list:
    return candidates(OVERRIDES, compose_config(OVERRIDES))


def test_the_forked_enumeration_is_the_one_made_here(pp_candidates) -> None:
    cfg = compose_config(OVERRIDES)
    here = pp_candidates
    forked = candidates_started(OVERRIDES, cfg, fork=True)()
    assert len(here) > 1
    assert [c.overrides for c in forked] == [c.overrides for c in here]
    assert [OmegaConf.to_container(c.cfg) for c in forked] == [OmegaConf.to_container(c.cfg) for c in here]
    assert [c.levers for c in forked] == [c.levers for c in here]


def test_a_refusal_in_the_forked_enumeration_is_raised_by_the_caller() -> None:
    cfg = compose_config(OVERRIDES)
    cfg.strategy.name = "no_such_strategy"  # what the enumeration refuses (the rules' lookup)
    with pytest.raises(ConfigError, match="no_such_strategy") as here:
        candidates(OVERRIDES, cfg)
    pending = candidates_started(OVERRIDES, cfg, fork=True)
    with pytest.raises(ConfigError, match="no_such_strategy") as forked:
        pending()
    assert str(forked.value) == str(here.value)


def test_the_plain_values_predictions_are_the_configs_to_the_bit(pp_candidates) -> None:
    fsdp = [*OVERRIDES[:-1], "strategy=fsdp"]  # FSDP2: the DTensor optimizer's part
    cands = pp_candidates[:3] + candidates(fsdp, compose_config(fsdp))[:1]
    calib = made_up_calibration()
    predicted, _ = predict_all(cands, calib, cap_bytes=2**40)
    model = build_meta_model(cands[0].cfg.model)
    timed = [r for r in predicted if not r.unknown]
    assert {r.candidate.strategy for r in timed} == {"fsdp", "pp"} and len(timed) == 4
    with MetaMemo():  # as predict_all: another model object, so its census is counted again
        for r in timed:  # the DictConfig path: predict_step reading the candidate's config itself
            cls = get_strategy_class(r.candidate.strategy)
            point, low, high, parts = predict_time(r.candidate.cfg, cls, model, calib)
            assert (r.step_s, r.step_low_s, r.step_high_s, r.parts) == (point, min(low, point), max(high, point), parts)
            values = Values.of(OmegaConf.to_container(r.candidate.cfg, resolve=True))
            assert predict_time(values, cls, model, calib) == (point, low, high, parts)


def test_dynamos_wrappers_are_bypassed_only_inside_a_planner_mode() -> None:
    targets = _disable_dynamo_targets()
    relu = next(fn for fn in targets if fn.__name__ == "relu")  # ReLU's meta kernel's reference
    before = {id(fn): fn.__dict__.get("__dynamo_disable") for fn in targets}
    x = torch.empty(4, 8, device="meta", requires_grad=True)
    with _Counter() as counter:
        assert relu.__dict__.get("__dynamo_disable") in (relu, before[id(relu)])
        torch.relu(x).sum().backward()
    assert counter.census.calls["memory"] > 0  # ReLU ran and was counted
    assert {id(fn): fn.__dict__.get("__dynamo_disable") for fn in targets} == before  # torch's own, or none
