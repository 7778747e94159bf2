"""``plan.recommend=true`` with ``plan.hardware``: every (tp, pp, virtual stages, data-parallel
degree, micro-batch, recompute, sequence parallelism) on ``plan.gpus`` GPUs ranked by predicted
tokens/s among those that fit the GPU's memory (Narayanan et al., arXiv 2104.04473, section 3:
tp inside a node, pp across, data parallelism for the rest), with no run.

The candidates: every layout of the strategy that splits the world into data x pipeline x tensor
ranks (the one whose degree is its pipeline's stages), and every other registered multi-process
strategy (ddp, fsdp, zero*, ...) at its own layout on ``plan.gpus`` with each ``trainer.grad_accum``;
each priced by ``steptime.predict``.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from parallel_lab.errors import ConfigError
from parallel_lab.plan.cluster import context
from parallel_lab.plan.cluster.hardware import Hardware, from_config
from parallel_lab.plan.cluster.layout import cluster_precision, describe, shape_text
from parallel_lab.plan.cluster.shape import ModelShape, from_model_config
from parallel_lab.plan.cluster.steptime import ClusterPrediction, ClusterRun, predict
from parallel_lab.strategies.mesh import TENSOR, MeshDims
from parallel_lab.strategies.planning import ClusterLayout

RECOMPUTE = ("none", "selective", "full")
MICRO = (1, 2, 4, 8)
VIRTUAL = (1, 2, 4)
INTERLEAVED_1F1B, ONE_F_ONE_B = "interleaved_1f1b", "1f1b"
CONTEXT = "cp"  # strategy.<key> of the context-parallel degree (strategies/cp/rules.py ContextOptions)


@dataclass(frozen=True)
class Candidate:
    run: ClusterRun
    prediction: ClusterPrediction
    command: str = ""  # the overrides that ask for it

    @property
    def fits(self) -> bool:
        return self.prediction.memory_bytes_per_gpu <= self.run.hw.hbm_bytes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(shape: ModelShape, hw: Hardware, gpus: int, global_batch: int):
    """Every (dims, schedule, v, micro-batches, sp) the model and batch allow."""
    for tp in tensor_degrees(shape, hw, gpus):
        for pp in [p for p in _divisors(gpus // tp) if shape.layers % p == 0]:
            dp = gpus // (tp * pp)
            for virtual in [v for v in VIRTUAL if (v == 1 or pp > 1) and shape.layers % (pp * v) == 0]:
                for micro in [m for m in MICRO if global_batch % (dp * m) == 0]:
                    schedule = (INTERLEAVED_1F1B if virtual > 1 else ONE_F_ONE_B) if pp > 1 else None
                    yield ClusterLayout(
                        dims=MeshDims(replicate=dp, pp=pp, tp=tp),
                        schedule=schedule,
                        virtual_stages=virtual,
                        microbatches=global_batch // (dp * micro),
                        sequence_parallel=tp > 1,
                    )


def ordered(candidates: list[Candidate]) -> list[Candidate]:
    """Best predicted throughput first; those that do not fit last."""
    return sorted(candidates, key=lambda c: (not c.fits, c.prediction.step_time_s))


def rank(
    shape: ModelShape, hw: Hardware, gpus: int, global_batch: int, precision: str, name: str = ""
) -> list[Candidate]:
    """Every pipeline-family candidate (``name``: the strategy its commands name)."""
    out = []
    for layout in layouts(shape, hw, gpus, global_batch):
        for recompute in RECOMPUTE:
            run = ClusterRun(shape, hw, layout, global_batch, precision, recompute)
            out.append(Candidate(run, predict(run), overrides(run, name)))
    return ordered(out)


def tensor_degrees(shape: ModelShape, hw: Hardware, gpus: int) -> list[int]:
    """The tensor-parallel degrees a layout may use: inside one node (its links are the fast ones),
    dividing the GPUs and the heads (Narayanan et al., section 3)."""
    return [t for t in (1, 2, 4, 8, 16) if t <= hw.gpus_per_node and gpus % t == 0 and shape.heads % t == 0]


def other_strategies(cfg: DictConfig, given: list[str], gpus: int) -> list[Candidate]:
    """Every other multi-process strategy at its own layout on ``gpus``, each grad_accum and
    recompute; a strategy whose options have ``strategy.tp`` (FSDP2 x TP, torchtitan's 2-D layout;
    tp x replicate) at every tensor degree a node allows, its data-parallel ranks the rest."""
    from parallel_lab.config.compose import compose_each_strategy
    from parallel_lab.plan.cluster.layout import cluster_run
    from parallel_lab.strategies import get_strategy_class, registered_names

    keep = [o for o in given if not o.lstrip("+~").startswith(("strategy", "trainer.grad_accum", "trainer.recompute"))]
    batch, shape = int(cfg.trainer.global_batch), from_model_config(cfg.model)
    degrees = tensor_degrees(shape, from_config(cfg.plan.hardware), gpus)
    contexts = context.degrees(shape, gpus)

    def accums(tp: int, cp: int) -> list[int]:
        ranks = gpus // (tp * cp)
        return [a for a in MICRO if (gpus // tp) % cp == 0 and batch % (ranks * a) == 0]

    def candidates_fit(rules) -> bool:  # composing costs ~0.2 s a strategy: only those with a grad_accum that fits
        keys = {f.name for f in dataclasses.fields(rules.Options)}
        tps, cps = degrees if TENSOR in keys else [1], contexts if CONTEXT in keys else [1]
        return any(accums(t, c) for t in tps for c in cps)

    names = [
        n
        for n in registered_names()
        if not get_strategy_class(n).plan.single_process
        and get_strategy_class(n).plan.degree_key != "stages"
        and candidates_fit(get_strategy_class(n).plan)
    ]
    out = []
    composed = cfg if keep == list(given) else None  # the command's own config: composed once already
    for name, base in zip(names, compose_each_strategy(keep, names, composed)):
        if isinstance(base, ConfigError):
            continue
        own = get_strategy_class(name).plan.degree_key == TENSOR  # strategy=tp: tp=1 would be plain data parallelism
        one = pickle.loads(pickle.dumps(base))  # one copy a strategy: each candidate sets all three keys it varies
        tps = [t for t in degrees if t > 1 or not own] if TENSOR in base.strategy else [None]
        for tp, cp in [(t, c) for t in tps for c in (contexts if CONTEXT in base.strategy else [1])]:
            split = [] if tp in (None, 1) else [f"strategy.{TENSOR}={tp}"]
            split += [f"strategy.{CONTEXT}={cp}"] if cp > 1 else []
            for accum in accums(tp or 1, cp):
                for recompute in RECOMPUTE:
                    args = [f"strategy={name}", *split, f"trainer.grad_accum={accum}", f"trainer.recompute={recompute}"]
                    one.trainer.grad_accum, one.trainer.recompute = accum, recompute
                    if tp is not None:
                        one.strategy.tp = tp
                    if CONTEXT in base.strategy:
                        one.strategy.cp = cp
                    try:
                        run = cluster_run(one, [*keep, *args])
                    except ConfigError:
                        continue
                    out.append(Candidate(run, predict(run), " ".join(args)))
    return out


def overrides(run: ClusterRun, strategy: str) -> str:
    """The command-line overrides that ask for this pipeline-family candidate."""
    lay, dims = run.layout, run.layout.dims
    return (
        f"strategy={strategy} strategy.tp={dims.tp} strategy.replicate={dims.replicate} strategy.stages={dims.pp} "
        f"strategy.virtual_stages={lay.virtual_stages} strategy.microbatches={lay.microbatches} "
        f"strategy.sequence_parallel={str(lay.sequence_parallel).lower()} trainer.recompute={run.recompute}"
    )


def pipeline_strategy() -> str:
    """The registered strategy whose own degree is its pipeline's stages (data x pipeline x tensor)."""
    from parallel_lab.strategies import get_strategy_class, registered_names

    return next(n for n in registered_names() if get_strategy_class(n).plan.degree_key == "stages")


def run_recommend(cfg: DictConfig, overrides_: list[str], out: Path, top: int = 10) -> Path:
    """Rank, write cluster_recommend.md/.json under ``out``; the text's path."""
    start = time.perf_counter()
    shape = from_model_config(cfg.model, bool(cfg.plan.get("fused_attention", False)))
    hw = from_config(cfg.plan.hardware)
    gpus = int(cfg.plan.gpus or cfg.world_size)
    precision = cluster_precision(cfg, overrides_)
    ranked = rank(shape, hw, gpus, int(cfg.trainer.global_batch), precision, pipeline_strategy())
    ranked = ordered(ranked + other_strategies(cfg, overrides_, gpus))
    fitting = [c for c in ranked if c.fits]
    lines = [
        f"Cluster recommendation: {shape_text(shape)}; {gpus} x {hw.name}, global batch {cfg.trainer.global_batch}, "
        f"{precision}: {len(fitting)} of {len(ranked)} layouts fit ({time.perf_counter() - start:.1f} s)",
        "",
        "| rank | layout | micro-batch | recompute | step s | tokens/s/GPU | MFU | GiB/GPU | command |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, c in enumerate(fitting[:top], 1):
        p = c.prediction
        lines.append(
            f"| {i} | {describe(c.run)} | {p.micro_batch} | {c.run.recompute} | {p.step_time_s:.3f} | "
            f"{p.tokens_per_s_per_gpu:,.0f} | {100 * p.mfu:.1f}% | {p.memory_bytes_per_gpu / 2**30:.1f} | "
            f"`{c.command}` |"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster_recommend.md").write_text("\n".join(lines) + "\n")
    records = [{"layout": describe(c.run), "command": c.command, **c.prediction.to_json()} for c in fitting]
    (out / "cluster_recommend.json").write_text(json.dumps(records[:100], indent=1) + "\n")
    return out / "cluster_recommend.md"
