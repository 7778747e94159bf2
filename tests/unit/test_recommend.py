"""plan.recommend=true (parallel_lab/plan/recommend.py, candidates.py): the ranking is by the predicted
samples/s among those that fit, a candidate over the cap never ranks above one that fits and says by
how much, every loser says why, bad input is one line and exit 2. Nothing here is timed: the
calibration is made up (its figures only order the candidates); ``python -m parallel_lab.bench
recommend`` checks the picks against real runs."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from parallel_lab.plan.calibrate import Calibration
from parallel_lab.plan.candidates import Candidate, candidates
from parallel_lab.plan.census import KINDS
from parallel_lab.plan.main import main as plan_main
from parallel_lab.plan.recommend import NO_COMM, Ranked, rank, recommend

MiB = 2**20


def made_up_calibration() -> Calibration:
    """A machine of round numbers: enough for predict_step to order candidates, nothing measured."""
    line = {"per_call_s": 1e-5, "per_unit_s": 1e-10}
    ab = {"alpha_s": 1e-4, "beta_Bps": 1e9}
    ops = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    return Calibration(
        cpu_count=2,
        ops={f"{kind}@fp32": dict(line) for kind in KINDS},
        optimizer={"per_param_s": 2e-9, "per_tensor_s": 5e-5},
        collectives={impl: {op: dict(ab) for op in ops} for impl in ("gloo", "hand")},
    )


def ranked(name: str, step_ms: float, peak_mib: float, **parts_ms: float) -> Ranked:
    cfg = OmegaConf.create({"trainer": {"global_batch": 64}})
    parts = {k: v / 1000 for k, v in parts_ms.items()}
    s = step_ms / 1000
    return Ranked(Candidate(name, [f"strategy={name}"], cfg), int(peak_mib * MiB), 0, s, 0.9 * s, 1.1 * s, parts)


def test_ranks_by_predicted_samples_per_s_and_says_why_each_lost() -> None:
    slow_comm = ranked("a", 30, 10, compute=20, exposed_comm=10, optimizer=0, idle=0)
    fast = ranked("b", 20, 10, compute=20, exposed_comm=0, optimizer=0, idle=0)
    bubbly = ranked("c", 26, 10, compute=20, exposed_comm=0, optimizer=0, idle=6)
    heavy_opt = ranked("d", 22, 10, compute=20, exposed_comm=0, optimizer=2, idle=0)
    out = rank([slow_comm, bubbly, fast, heavy_opt], cap_bytes=100 * MiB)
    assert [r.candidate.strategy for r in out] == ["b", "d", "c", "a"]
    assert [r.rank for r in out] == [1, 2, 3, 4]
    assert [r.samples_per_s for r in out] == sorted((r.samples_per_s for r in out), reverse=True)
    assert out[0].why == "recommended"
    assert out[1].why.startswith("optimizer: +2.00 ms/step")
    assert out[2].why.startswith("bubble: +6.00 ms/step")
    assert out[3].why == "communication: +10.00 ms/step (step +10.00 ms)"  # intervals apart: no overlap note


def test_over_the_cap_never_ranks_above_a_fit_and_says_by_how_much() -> None:
    fastest_but_big = ranked("big", 5, 150, compute=5)
    fits = ranked("small", 50, 60, compute=50)
    out = rank([fastest_but_big, fits], cap_bytes=100 * MiB)
    assert [r.candidate.strategy for r in out] == ["small", "big"]
    assert (out[0].rank, out[0].fits, out[1].rank, out[1].fits) == (1, True, 0, False)
    assert out[1].why.startswith("memory: 50 MiB over the cap")


def test_no_time_prediction_is_listed_never_ranked() -> None:
    """A layout whose communication has no rule (HSDP) would otherwise look free: it is never ranked."""
    free_comm = ranked("hsdp", 1, 10, compute=1)
    free_comm.unknown = NO_COMM
    timed = ranked("timed", 50, 10, compute=50)
    out = rank([free_comm, timed], cap_bytes=100 * MiB)
    assert [(r.candidate.strategy, r.rank) for r in out] == [("timed", 1), ("hsdp", 0)]
    assert out[1].why == NO_COMM


def test_candidates_are_what_the_run_accepts() -> None:
    """A real search (cnn, world 2, one strategy): each candidate is a validated config, the strategy
    as configured first, and a value the run refuses is no candidate (recompute on the cnn)."""
    cands = candidates(["strategy=ddp", "world_size=2"])
    labels = [c.label for c in cands]
    assert labels[0] == "strategy=ddp"
    assert "strategy=ddp strategy.bucket_cap_mb=1.0" in labels
    assert all(c.cfg.world_size == 2 and c.cfg.strategy.name == "ddp" for c in cands)
    assert cands[0].levers == [["trainer.grad_accum=2"]]  # no recompute: the cnn has no blocks


def test_the_overrides_alone_make_the_run() -> None:
    """A candidate's overrides are what a run needs: at world 3 a pipeline's 3 stages (which the planner
    derives from the world size) are among them, and the run's own full validation accepts them."""
    from parallel_lab.config import compose_config
    from parallel_lab.config.validate import validate

    user = ["strategy=pp", "world_size=3", "trainer.global_batch=48"]
    cands = candidates(user)
    assert cands and all("strategy.stages=3" in c.overrides for c in cands)
    for c in cands[:3]:
        argv = [*user, *c.overrides]
        validate(compose_config(argv), explicit=argv, warn=lambda message: None)  # raises ConfigError if refused


def test_a_tight_cap_picks_a_memory_lever_with_the_planners_bytes() -> None:
    """End to end on real memory predictions: under a cap between ddp's peak and its peak at
    grad_accum=2, the pick is the lever variant and plain ddp is ranked below with its overage."""
    calib = made_up_calibration()
    loose = recommend(["strategy=ddp", "world_size=2"], 2**40, "test", calib)
    plain = next(r for r in loose.ranked if r.candidate.label == "strategy=ddp")
    assert all(r.fits for r in loose.ranked) and "trainer.grad_accum=2" not in str(loose.ranked[0].candidate.label)
    tight = recommend(["strategy=ddp", "world_size=2"], plain.peak_bytes - 1, "test", calib)
    top = tight.ranked[0]
    assert top.fits and top.candidate.overrides[-1] == "trainer.grad_accum=2" and top.peak_bytes < plain.peak_bytes
    over = next(r for r in tight.ranked if r.candidate.label == "strategy=ddp")
    assert over.rank == 0 and over.why.startswith("memory: 1 B over the cap")
    assert all(r.fits for r in tight.ranked[: sum(r.fits for r in tight.ranked)])


@pytest.mark.parametrize(
    "argv, named",
    [
        (["plan.recommend=true", "plan.world_sizes=[1,2]"], "plan.world_sizes"),
        (["plan.recommend=true", "plan.device_memory=lots"], "plan.device_memory=lots"),
        (["plan.recommend=maybe"], "plan.recommend"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, named, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        plan_main([*argv, f"plan.out={tmp_path}/out"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_the_planners_shortcuts_copy_and_share_only_what_is_safe() -> None:
    """What makes the recommender fast changes no config and mixes no models: a config copy
    (``configs._copy``, a pickle round trip) equals ``copy.deepcopy``'s, types and flags included, a
    change to it leaves the original as it was, and a type pickle cannot name is copied all the same;
    pp's validation shares one meta model per model config, and another width is another model."""
    import copy
    import dataclasses

    from parallel_lab.config import compose_config
    from parallel_lab.plan.configs import _copy
    from parallel_lab.strategies.pp.rules import meta_model

    cfg = compose_config(["strategy=pp", "model=vit"])
    OmegaConf.set_struct(cfg, False)
    copied, reference = _copy(cfg), copy.deepcopy(cfg)
    assert OmegaConf.to_yaml(copied) == OmegaConf.to_yaml(reference) == OmegaConf.to_yaml(cfg)
    assert OmegaConf.get_type(copied.strategy) is OmegaConf.get_type(reference.strategy) is not dict
    assert OmegaConf.is_struct(copied) == OmegaConf.is_struct(reference)
    copied.strategy.microbatches, copied.trainer.grad_accum = 8, 2
    assert (cfg.strategy.microbatches, cfg.trainer.grad_accum) == (reference.strategy.microbatches, 1)

    @dataclasses.dataclass
    class LocalOptions:  # a class pickle cannot name (a plugin's, defined in a function): deepcopy's way
        stages: int = 2

    local = OmegaConf.create({"strategy": OmegaConf.structured(LocalOptions)})
    assert _copy(local) == local and OmegaConf.get_type(_copy(local).strategy) is LocalOptions

    assert meta_model(cfg) is meta_model(copy.deepcopy(cfg))
    wider = copy.deepcopy(cfg)
    wider.model.width = 2.0
    params = [sum(p.numel() for p in meta_model(c).parameters()) for c in (cfg, wider)]
    assert params[1] > params[0]


def test_a_strategys_config_swapped_in_is_the_one_hydra_composes():
    """The recommender swaps each strategy's node into the composed config instead of composing
    again (plan/candidates.py with_strategy): the same config, value for value and type for type."""
    from omegaconf import OmegaConf

    from parallel_lab.config import compose_config
    from parallel_lab.plan.candidates import with_strategy
    from parallel_lab.strategies import sweep_names

    overrides = ["model=vit", "world_size=4"]
    base = compose_config(overrides)
    for name in sweep_names():
        swapped, composed = with_strategy(base, overrides, name), compose_config([*overrides, f"strategy={name}"])
        assert OmegaConf.to_yaml(swapped) == OmegaConf.to_yaml(composed), name
        assert OmegaConf.get_type(swapped.strategy) is OmegaConf.get_type(composed.strategy), name


def _merged_or_error(merge, plain: dict):
    """(yaml, each value's type, the config's type and struct flag), or the error's type and text."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = merge(plain)
    except OmegaConfBaseException as exc:
        return type(exc).__name__, str(exc).splitlines()[0]
    values = OmegaConf.to_container(cfg)
    return (
        OmegaConf.to_yaml(cfg),
        {k: type(v) for k, v in values.items()},
        OmegaConf.get_type(cfg),
        cfg._get_flag("struct"),
    )


def test_a_strategy_section_is_typed_as_hydras_merge_types_it():
    """validate_options merges only the keys whose value is not the schema's own (strategies/options.py
    ``_typed``): every strategy's section, as given, with each int, float or bool key changed, written
    as a string, given a value of the wrong type, and an unknown key, types to what
    ``OmegaConf.merge(schema, section)`` gives, or fails with its error."""
    import enum

    from parallel_lab.strategies import options_schemas
    from parallel_lab.strategies.options import _defaults, _typed

    checked = 0
    for cls in options_schemas().values():
        defaults = _defaults(cls)
        plains = [dict(defaults), {**defaults, "no_such_key": 1}]
        for key, value in defaults.items():
            if isinstance(value, bool):
                plains += [{**defaults, key: not value}, {**defaults, key: str(value).lower()}, {**defaults, key: 1}]
            elif isinstance(value, (int, float)):
                plains += [{**defaults, key: value + 1}, {**defaults, key: str(value)}, {**defaults, key: "lots"}]
            elif isinstance(value, enum.Enum):
                plains += [{**defaults, key: value.name}, {**defaults, key: "nope"}]
        for plain in plains:
            fast = _merged_or_error(lambda p: _typed(cls, p), plain)
            hydra = _merged_or_error(lambda p: OmegaConf.merge(OmegaConf.structured(cls), p), plain)
            assert fast == hydra, (cls.__name__, plain)
            checked += 1
    assert checked > 100
