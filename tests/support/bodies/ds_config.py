"""Distributed test body: a DeepSpeed JSON file run our way equals DeepSpeed running it itself.

For each case, in one real (1-rank, gloo) process: engine A is ``deepspeed.initialize`` given the
user's file and nothing else, so DeepSpeed builds the optimizer and LR scheduler from the file
(``torch_adam: true`` added for Adam/AdamW: DeepSpeed's own switch to torch's kernel instead of its
compiled FusedAdam); B is the toolkit's ZeRO strategy on the config.yaml the parent wrote from the
same file (the file's sections turned into trainer settings, the torch optimizer from them, the
schedule stepped by our loop). Both train on the same batches; rank 0 prints per step the loss and
learning rate of each, and whether the final weights are bitwise equal, as JSON.
"""

from __future__ import annotations

import copy
import gc
import json
import os

import torch

from parallel_lab.comm.dist_env import read_dist_env
from parallel_lab.config import load_run_config
from parallel_lab.models import build_model
from parallel_lab.optim import make_scheduler, optimizer_factory
from parallel_lab.strategies import get_strategy_class
from parallel_lab.strategies.zero.strategy import import_deepspeed


def _their_config(path: str) -> dict:
    """The user's file, as a DeepSpeed user on CPU would run it without our toolkit."""
    ds = json.loads(open(path).read())
    ds = copy.deepcopy(ds)
    optimizer = ds.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        optimizer.setdefault("params", {})["torch_adam"] = True
    ds["zero_allow_untested_optimizer"] = True  # DeepSpeed's rule for torch SGD under ZeRO
    return ds


def _batches(cfg, steps: int):
    gen = torch.Generator().manual_seed(1234)
    size = cfg.trainer.global_batch
    images = [torch.randn(size, 3, 32, 32, generator=gen) for _ in range(steps)]
    return [(x, torch.randint(0, 10, (size,), generator=gen)) for x in images]


def _lr(optimizer) -> float:
    inner = getattr(optimizer, "optimizer", optimizer)
    return float(inner.param_groups[0]["lr"])


def compare_with_deepspeed(rank: int, world_size: int, cases: list[list[str]], steps: int) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = import_deepspeed()  # as the zero strategies do (no CPU shm op: inference only)

    results = []
    for file_path, config_path in cases:
        cfg = load_run_config(config_path)
        env = read_dist_env(cfg.device)
        batches = _batches(cfg, steps)
        model = build_model(cfg.model, cfg.trainer.seed)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_their_config(file_path)
        )
        dtype = next(engine.module.parameters()).dtype
        theirs = {"loss": [], "lr": [], "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__}
        for inputs, targets in batches:
            loss = torch.nn.functional.cross_entropy(engine(inputs.to(dtype)).float(), targets)
            engine.backward(loss)
            engine.step()
            theirs["loss"].append(loss.item())
            theirs["lr"].append(_lr(optimizer))
        their_params = [p.detach().float().clone() for p in engine.module.parameters()]
        engine.destroy()
        del engine, optimizer, scheduler
        gc.collect()

        strategy = get_strategy_class(cfg.strategy.name)(cfg, env)
        strategy.setup(build_model(cfg.model, cfg.trainer.seed), optimizer_factory(cfg.trainer))
        ours_scheduler = make_scheduler(cfg.trainer, strategy.optimizer)
        inner = getattr(strategy.optimizer, "optimizer", strategy.optimizer)
        ours = {"loss": [], "lr": [], "optimizer": type(inner).__name__}
        for inputs, targets in batches:
            loss = strategy.train_step(inputs, targets, 0, 1)
            strategy.optimizer_step()
            if ours_scheduler is not None:
                ours_scheduler.step()
            ours["loss"].append(loss.item())
            ours["lr"].append(_lr(strategy.optimizer))
        same = all(torch.equal(a, b) for a, b in zip(their_params, strategy.state.full_parameters()))
        strategy.teardown()
        del strategy
        gc.collect()
        results.append({"file": file_path, "theirs": theirs, "ours": ours, "same_weights": same})
    if rank == 0:
        print(json.dumps(results))
