"""The planner's command line: compose, validate, predict every (strategy, world size, rank),
write plan.md/.csv/.json, plan.png and (several world sizes) scaling.png, print the table."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from parallel_lab.errors import ConfigError
from parallel_lab.plan.configs import Planned, planned_configs
from parallel_lab.plan.sizes import human, parse_bytes

# torch is imported only once the input is known good (the predictions build meta models; plan.png
# draws with matplotlib): a bad override, size or split is refused in about 1 s of CPU, not 3
# (tests/unit/test_refusal_imports.py), as ``python -m parallel_lab`` refuses its own.


def device_memory_bytes(setting: str | None) -> tuple[int, str]:
    """(bytes, where the number came from): the setting, CUDA device 0, or MemAvailable."""
    if setting:
        return parse_bytes(setting), "plan.device_memory"
    from parallel_lab.comm.dist_env import cuda_gpus

    if cuda_gpus():  # no GPU driver here: 0, and torch is not imported for it
        import torch

        return torch.cuda.get_device_properties(0).total_memory, f"CUDA device 0 ({torch.cuda.get_device_name(0)})"
    from parallel_lab.config.resources import memory_available_bytes

    available = memory_available_bytes()
    if available is None:
        raise ConfigError(
            "cannot read this machine's memory; set plan.device_memory=<size>, e.g. plan.device_memory=24GiB"
        )
    return available, "this machine's MemAvailable"


def measured_points(dirs: list[str], model: DictConfig) -> list[dict]:
    """(strategy, world, model-state bytes of the rank holding the most) of every metrics.json
    under dirs whose model (and width) is the planned one."""
    from parallel_lab.plan.predict import MODEL_STATE

    points = []
    for top in dirs:
        for path in sorted(Path(top).expanduser().rglob("metrics.json")):
            metrics = json.loads(path.read_text())
            cfg_path = path.parent / "config.yaml"
            width = OmegaConf.load(cfg_path).model.get("width", 1.0) if cfg_path.is_file() else 1.0
            if metrics.get("status") != "ok" or metrics["model"] != model.name or float(width) != float(model.width):
                continue
            state = max(sum(r.get(k, 0) for k in MODEL_STATE) for r in metrics["ranks"])
            points.append({"strategy": metrics["strategy"], "world": metrics["world_size"], "model_state_bytes": state})
    return points


def build_plans(planned: list[Planned], device_bytes: int) -> tuple[list[dict], list[dict]]:
    """(summary rows, every rank's plan as json) for every planned (strategy, world size)."""
    from parallel_lab.models import build_meta_model
    from parallel_lab.plan.output import error_row, summary_row
    from parallel_lab.plan.predict import SavedBytesCache, plan_world

    models: dict = {}
    cache = SavedBytesCache()  # forwards the plans share
    rows, ranks = [], []
    for item in planned:
        if item.cfg is None:
            rows.append(error_row(item.strategy, item.world_size, item.error))
            continue
        key = OmegaConf.to_yaml(item.cfg.model)
        if key not in models:
            models[key] = build_meta_model(item.cfg.model)
        plans = plan_world(item.cfg, type_of(item.cfg), models[key], cache)
        rows.append(summary_row(plans, device_bytes))
        keep = plans if len(plans) <= 16 else [p for p in plans if p.rank == rows[-1]["rank"]]
        ranks += [p.to_json() for p in keep]
    return rows, ranks


def type_of(cfg: DictConfig) -> type:
    from parallel_lab.strategies import get_strategy_class

    return get_strategy_class(cfg.strategy.name)


def run(overrides: list[str]) -> Path:
    """Plan (or, with plan.recommend=true, recommend) and write the files; the table's path."""
    from parallel_lab.config import compose_config

    cfg = compose_config(overrides)
    out = Path(cfg.plan.out or f"runs/plan/{time.strftime('%Y-%m-%d_%H-%M-%S')}").expanduser()
    if cfg.plan.hardware is not None:  # a GPU cluster (plan/cluster): no measurement of this machine
        if cfg.plan.recommend:
            from parallel_lab.plan.cluster.recommend import run_recommend

            return run_recommend(cfg, overrides, out)
        from parallel_lab.plan.cluster.run import run_cluster

        return run_cluster(cfg, overrides, out)
    if cfg.plan.recommend:
        device_bytes, source = device_memory_bytes(cfg.plan.device_memory)
        from parallel_lab.plan.candidates import candidates_started, one_world

        one_world(cfg)
        pending = candidates_started(overrides, cfg)  # before torch's import, which it overlaps
        from parallel_lab.plan.recommend import run as recommend

        return recommend(overrides, device_bytes, source, out, cfg, pending)
    planned = planned_configs(overrides)  # a split a run refuses is refused here, before torch
    device_bytes, source = device_memory_bytes(cfg.plan.device_memory)
    rows, ranks = build_plans(planned, device_bytes)
    from parallel_lab.plan.output import plot_bars, plot_scaling, write_csv, write_json, write_markdown

    out.mkdir(parents=True, exist_ok=True)
    width = cfg.model.get("width", 1.0)
    header = (
        f"Plan: model={cfg.model.name} (width {width:g}, {rows_params(rows)} parameters), "
        f"global batch {cfg.trainer.global_batch} at world_size={cfg.world_size}"
        + (" (each rank keeps its micro-batch at every world size)" if cfg.plan.world_sizes else "")
        + f", optimizer {cfg.trainer.optimizer}, recompute {cfg.trainer.recompute}; per rank, the rank holding "
        f"the most; device memory {human(device_bytes)} ({source})."
    )
    write_markdown(rows, out / "plan.md", header)
    write_csv(rows, out / "plan.csv")
    write_json({"header": header, "device_memory_bytes": device_bytes, "rows": rows, "ranks": ranks}, out / "plan.json")
    plot_bars(bar_rows(rows), device_bytes, out / "plan.png")
    if len(cfg.plan.world_sizes) > 1:
        plot_scaling(rows, measured_points(list(cfg.plan.measured), cfg.model), out / "scaling.png")
    return out / "plan.md"


def bar_rows(rows: list[dict]) -> list[dict]:
    """plan.png draws one world size: the largest planned (one-process strategies at 1 beside it)."""
    worlds = [r["world"] for r in rows if r.get("total_bytes") is not None]
    largest = max(worlds, default=0)
    return [r for r in rows if r["world"] == largest or (r["world"] == 1 and _one_process(r["strategy"]))]


def _one_process(name: str) -> bool:
    """A strategy whose run is always one process (single, and dp's threads): planned at world 1."""
    from parallel_lab.strategies import get_strategy_class

    return name == "single" or get_strategy_class(name).plan.single_process


def rows_params(rows: list[dict]) -> str:
    params = next((r["params"] for r in rows if r.get("params")), None)
    return f"{params:,}" if params else "?"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        table = run(argv)
    except ConfigError as exc:
        print(f"parallel_lab.plan: error: {exc}", file=sys.stderr)
        sys.exit(2)
    out = table.parent
    print(table.read_text())
    if table.name.startswith("cluster_"):  # plan/cluster: the text and its json
        data = "plan.json" if table.name == "cluster_plan.md" else table.with_suffix(".json").name
        print(f"written: {out}/{table.name} {data}")
    elif table.name == "recommend.md":
        print(f"written: {out}/recommend.md .json")
    else:
        print(f"written: {out}/plan.md .csv .json .png" + (" scaling.png" if (out / "scaling.png").exists() else ""))
    return 0
