"""The recommender's candidates (``plan.recommend=true``): every strategy x its main options x
micro-batches x recompute, each a list of overrides that the run's own validation accepts.

One home for the search space. It is keyed by *option name*, never by strategy (no code outside
``strategies/`` names one): a strategy is searched over each of its ``Options`` fields named in
``SEARCH``, every other field keeping its default, so a new strategy with a ``schedule`` or an
``offload`` field is searched with no edit here. A combination the run would refuse (tp whose
degree does not divide the heads, offload at ZeRO stage 0, zero_bubble with virtual_stages > 1 under impl=manual, a
batch that does not split into the micro-batches) is simply not a candidate: the same
``check_split`` as a run (``configs._at_world``) decides.

Left out on purpose: ``impl`` (tp/pp: manual, torch, deepspeed) and FSDP's ``version``: the step
model tells no implementation apart (same bytes, same FLOPs), so each would be a tie tripling the
table, and FSDP1 brings no memory rule, so it could never fit (give ``strategy.impl=`` to rank one);
precision (bf16 is another training, not a faster layout of the same one:
``trainer.precision=bf16`` ranks bf16 candidates), pp's ``balance=time`` (it measures), option
values that need another launcher (``allreduce=mpi``: refused by the validation anyway), and the
one-process strategies at a world size above 1 (they would leave the other ranks idle).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
import os
import pickle
import sys
import typing
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import yaml
from omegaconf import DictConfig, OmegaConf

from parallel_lab.config import compose_config
from parallel_lab.errors import ConfigError
from parallel_lab.plan.configs import _at_world, _given, with_strategy
from parallel_lab.strategies import get_strategy_rules, sweep_names

EVERY = None  # SEARCH value: every member of the field's Enum, or both of a bool
# strategy.<option> -> the values tried (the default is always among them, and tried first).
SEARCH: dict[str, tuple | None] = {
    "offload": EVERY,  # ZeRO: optimizer state (stage 3: parameters) on CPU
    "sharding": EVERY,  # FSDP: full / grad_op (reshard after forward or not) / no_shard / hybrid
    "bucket_cap_mb": (1.0, 25.0),  # DDP's gradient buckets: many small ones overlap more
    "bucketed": EVERY,  # manual_ddp: overlap backward or one all-reduce after it
    "allreduce": EVERY,  # manual_ddp's ring / star / the library's
    "sequence_parallel": EVERY,  # tp (and pp x tp) on the vit
    "split_conv": EVERY,  # tp on the cnn: split the convs too
    "schedule": EVERY,  # pp: gpipe / 1f1b / interleaved / zero bubble
    "virtual_stages": (1, 2),  # pp: chunks per rank (interleaved schedules)
    "microbatches": (2, 4, 8),  # pp: micro-batches per step (the bubble against the per-pass cost)
    # 2-D meshes: data-parallel copies x the strategy's own degree; the divisors of the world below it
    # (replicate = world leaves the strategy's own degree at 1: data parallelism done the long way)
    "replicate": "divisors",
}
# trainer.<key> -> values tried for every strategy (a key the run refuses for the model drops out).
TRAINER_SEARCH: dict[str, tuple] = {
    "grad_accum": (1, 2),  # micro-batches of a data-parallel rank: half the activations, twice the passes
    "recompute": ("none", "selective", "full"),  # models with blocks only (config/validate.py)
}


# A trainer key not searched for a strategy with its own option for the same thing: a pipeline's
# micro-batches already split the batch (grad_accum on top would only repeat them, at twice the cost).
OWN_SPLIT = {"grad_accum": "microbatches"}


@dataclass
class Candidate:
    """One configuration to rank: the overrides that make it (beyond the user's) and its validated config.
    ``levers``: its memory-lever variants (trainer.grad_accum, trainer.recompute) not yet validated,
    tried only where it does not fit (``with_levers``): a lever only adds work to a step."""

    strategy: str
    overrides: list[str]
    cfg: DictConfig
    levers: list[list[str]] = field(default_factory=list)
    _base: DictConfig | None = field(default=None, repr=False)  # the strategy's composed config (shared)
    _user: list[str] = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        return " ".join(self.overrides)


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n) if n % d == 0) or (1,)


def option_values(options_cls: type, world: int) -> dict[str, tuple]:
    """The searched fields of one strategy's Options dataclass -> the values tried, default first."""
    hints = typing.get_type_hints(options_cls)
    out: dict[str, tuple] = {}
    for f in dataclasses.fields(options_cls):
        if f.name not in SEARCH:
            continue
        spec, kind = SEARCH[f.name], hints[f.name]
        if spec == "divisors":
            values = _divisors(world)
        elif spec is EVERY and isinstance(kind, type) and issubclass(kind, enum.Enum):
            values = tuple(m.name for m in kind)
        elif spec is EVERY and kind is bool:
            values = (False, True)
        elif spec is EVERY:
            raise TypeError(f"SEARCH[{f.name!r}] = EVERY needs an Enum or bool field; {options_cls.__name__}: {kind}")
        else:
            values = spec
        default = f.default.name if isinstance(f.default, enum.Enum) else f.default
        out[f.name] = (default, *(v for v in values if v != default)) if default in values else tuple(values)
    return out


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _option_choices(rules: type, world: int, overrides: list[str]) -> list[list[str]]:
    """Every combination of the searched option values as overrides, the defaults left out (so the
    first is the strategy as configured); a key the user gave is kept as given."""
    axes = []
    for name, values in option_values(rules.Options, world).items():
        if not _given(overrides, f"strategy.{name}"):
            axes.append([None if v == values[0] else f"strategy.{name}={_text(v)}" for v in values])
    return [[o for o in combo if o] for combo in itertools.product(*axes)]


def _current(base: DictConfig, name: str) -> str:
    """trainer.<name> as configured, as text (an Enum by its name): what a lever value is compared to."""
    value = base.trainer[name]
    return str(value.name if isinstance(value, enum.Enum) else value)


def _lever_choices(
    base: DictConfig, rules: type, world: int, overrides: list[str], as_configured: DictConfig | None
) -> list[list[str]]:
    """Every combination of the memory levers' other values (the configured one left out)."""
    axes = []
    own = {f.name for f in dataclasses.fields(rules.Options)}
    for name, values in _trainer_values(base, overrides, world, as_configured).items():
        if not _given(overrides, f"trainer.{name}") and OWN_SPLIT.get(name, "") not in own:
            current = _current(base, name)
            axes.append([None] + [f"trainer.{name}={v}" for v in values if str(v) != current])
    return [[o for o in combo if o] for combo in itertools.product(*axes)][1:]


@contextmanager
def _overridden(cfg: DictConfig, extra: list[str]):
    """``cfg`` with the candidate's overrides set, restored on exit: ``_at_world`` copies it, so one
    copy per candidate instead of two (a whole config's copy is ~1.5 ms; ~300 candidates at world 4)."""
    old = []
    try:
        for item in extra:
            key, _, value = item.partition("=")
            old.append((key, OmegaConf.select(cfg, key)))
            OmegaConf.update(cfg, key, yaml.safe_load(value), merge=False)
        yield cfg
    finally:
        for key, value in reversed(old):
            OmegaConf.update(cfg, key, value, merge=False)


def _validated(base: DictConfig, extra: list[str], overrides: list[str], world: int) -> DictConfig | None:
    """The candidate's config as the run validates it, or None where the run would refuse it."""
    try:
        with _overridden(base, extra):
            return _at_world(base, [*overrides, *extra], world, scale=False)
    except (ConfigError, ValueError):
        return None


def _trainer_values(
    base: DictConfig, overrides: list[str], world: int, as_configured: DictConfig | None
) -> dict[str, tuple]:
    """TRAINER_SEARCH less the values refused with the strategy as configured (``as_configured``: its
    validated config, None where refused; recompute on a model without blocks): pruned before the
    product, since the options cannot make them valid. The configured value is that config itself."""
    if as_configured is None:
        return TRAINER_SEARCH
    return {k: tuple(v for v in vs if str(v) == _current(base, k)
                     or _validated(base, [f"trainer.{k}={v}"], overrides, world) is not None)
            for k, vs in TRAINER_SEARCH.items()}  # fmt: skip


def _fingerprint(cfg: DictConfig) -> str:
    """Two candidates whose validated strategy and trainer sections agree are one configuration
    (their plain values' repr: a seventh of a yaml dump's time)."""
    return repr(OmegaConf.to_container(cfg.strategy)) + repr(OmegaConf.to_container(cfg.trainer))


def one_world(cfg: DictConfig) -> None:
    """The recommender ranks at one world size: plan.world_sizes is refused (ConfigError)."""
    if cfg.plan.world_sizes:
        raise ConfigError(
            f"plan.recommend=true ranks at one world size, got plan.world_sizes={list(cfg.plan.world_sizes)}; "
            f"drop plan.world_sizes and set world_size=N"
        )


def candidates(overrides: list[str], base: DictConfig | None = None) -> list[Candidate]:
    """Every candidate at the configured world size, memory levers as configured, in search order
    (each strategy as configured first). With ``strategy=`` given, that strategy's options only.
    ``base``: the overrides' composed config where the caller has it (composing takes ~0.1 s)."""
    base = compose_config(overrides) if base is None else base
    world = int(base.world_size)
    chosen = _given(overrides, "strategy")
    names = [base.strategy.name] if chosen else sweep_names()
    out, seen = [], set()
    for name in names:
        rules = get_strategy_rules(name)  # torch-free: the enumeration runs while torch imports (main.py)
        if rules.single_process and world > 1 and not chosen:
            continue
        base_n = copy.deepcopy(base) if chosen else with_strategy(base, overrides, name)
        OmegaConf.set_struct(base_n, False)
        as_configured = _validated(base_n, [], overrides, world)  # the first option choice, and the levers'
        levers = _lever_choices(base_n, rules, world, overrides, as_configured)
        for extra in _option_choices(rules, world, overrides):
            cfg = _validated(base_n, extra, overrides, world) if extra else as_configured
            if cfg is None:
                continue  # the run would refuse it: not a candidate
            key = _fingerprint(cfg)
            if key not in seen:
                seen.add(key)
                extra = [*extra, *_derived_degree(rules, base_n, cfg, overrides)]
                out.append(Candidate(name, [f"strategy={name}", *extra], cfg, levers, base_n, overrides))
    return out


def _derived_degree(rules: type, base: DictConfig, cfg: DictConfig, overrides: list[str]) -> list[str]:
    """The degree the planner derived from the world size (pp's stages, tp's degree: ``_at_world``),
    as an override where it differs from the configured one, so the overrides alone make the run."""
    key = rules.degree_key
    if not key or _given(overrides, f"strategy.{key}") or cfg.strategy[key] == base.strategy[key]:
        return []
    return [f"strategy.{key}={cfg.strategy[key]}"]


def with_levers(c: Candidate) -> list[Candidate]:
    """``c``'s memory-lever variants that the run accepts (grad_accum, recompute: fewer bytes held
    for more work), for a candidate over the cap."""
    out = []
    for lever in c.levers:
        extra = [*c.overrides[1:], *lever]
        cfg = _validated(c._base, extra, c._user, int(c.cfg.world_size))
        if cfg is not None:
            out.append(Candidate(c.strategy, [*c.overrides, *lever], cfg))
    return out


def candidates_started(
    overrides: list[str], base: DictConfig, fork: bool | None = None
) -> Callable[[], list[Candidate]]:
    """``candidates(overrides, base)`` in a forked process, started now; the returned function waits
    for its list. The enumeration needs no torch (each strategy's rules validate it), so a parent
    that has not imported torch yet forks before doing so: on two cores the enumeration (~2 s of
    CPU for resnet18 at world 8: 210 validations) runs while the parent imports torch (~2.5 s).
    Where torch is already imported or the platform cannot fork, it runs here, now (``fork``: True
    or False to choose). A ConfigError raised there is raised by the returned function."""
    fork = ("torch" not in sys.modules and hasattr(os, "fork")) if fork is None else fork
    if not fork:
        done = _outcome(overrides, base)
        return lambda: _unpacked(done)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its list, pickled down the pipe, and out without the parent's exit hooks
        os.close(read)
        code = 1
        try:
            with os.fdopen(write, "wb") as pipe:
                pickle.dump(_outcome(overrides, base), pipe, protocol=pickle.HIGHEST_PROTOCOL)
            code = 0
        finally:
            os._exit(code)
    os.close(write)

    def result() -> list[Candidate]:
        with os.fdopen(read, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not data:
            raise RuntimeError(f"the candidates' process {pid} ended with status {status}")
        return _unpacked(pickle.loads(data))

    return result


def _outcome(overrides: list[str], base: DictConfig) -> tuple[list[Candidate] | None, ConfigError | None]:
    try:
        return candidates(overrides, base), None
    except ConfigError as exc:
        return None, exc


def _unpacked(outcome: tuple[list[Candidate] | None, ConfigError | None]) -> list[Candidate]:
    found, error = outcome
    if error is not None:
        raise error
    return found
