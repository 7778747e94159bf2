"""``RankShardState``: the state of strategies whose ranks hold different parts of the model
(tensor and pipeline parallel): each rank writes and reads its own ``shard_rank<k>.pt``."""

from __future__ import annotations

from pathlib import Path

import torch

from parallel_lab.errors import ConfigError
from parallel_lab.strategies.memory import local_tensor
from parallel_lab.strategies.state import State


def _map_state(optim_state: dict, fn) -> dict:
    """An optimizer state_dict with fn(param index, tensor) applied to every per-parameter tensor
    except Adam's scalar step counter."""
    state = {
        index: {k: fn(index, v) if torch.is_tensor(v) and k != "step" else v for k, v in per_param.items()}
        for index, per_param in optim_state["state"].items()
    }
    return {**optim_state, "state": state}


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A saved local shard as the kind of tensor the parameter is (a DTensor with its layout)."""
    if not hasattr(param, "placements"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(param.device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


class RankShardState(State):
    """One checkpoint file per rank (DTensors saved as their local shards, so loading needs no
    DTensor types); the strategy says how its parameters are gathered (``full_parameters``)."""

    def _shard_file(self, directory: Path) -> Path:
        return directory / f"shard_rank{self.env.rank}.pt"

    def save(self, directory: Path) -> None:
        torch.save(
            {
                "model": {k: local_tensor(v) for k, v in self.model.state_dict().items()},
                "optimizer": _map_state(self.optimizer.state_dict(), lambda index, value: local_tensor(value)),
            },
            self._shard_file(directory),
        )

    def load(self, directory: Path) -> None:
        state = torch.load(self._shard_file(directory), map_location=self.device, weights_only=True)
        self._load_local(state, directory)

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor ``name`` (a pipeline stage holds its tensors whole;
        tensor parallel cuts its split layers)."""
        return full

    def load_full(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, dict]) -> None:
        """Each rank cuts its own part of the full state, then loads it as its own shard file."""
        from parallel_lab.strategies.replicated import indexed_optimizer_state

        # clone: a part is a view of the full tensor, which would otherwise stay alive with it
        local = {name: self.local_part(name, model_state[name]).clone() for name in self.model.state_dict()}
        optim = indexed_optimizer_state(self.optimizer, self.model, optim_state, self.local_part)
        self._load_local({"model": local, "optimizer": optim}, "the resharded checkpoint")

    def _load_local(self, state: dict, directory) -> None:
        mine = self.model.state_dict()  # shares storage with the parameters and buffers
        if set(mine) != set(state["model"]):
            raise ConfigError(
                f"checkpoint '{directory}': shard_rank{self.env.rank}.pt holds "
                f"{sorted(state['model'])}, this rank has {sorted(mine)}; resume with the same "
                f"strategy options, or trainer.resume=never"
            )
        with torch.no_grad():
            for name, tensor in mine.items():
                local_tensor(tensor).copy_(state["model"][name])
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.optimizer.load_state_dict(_map_state(state["optimizer"], lambda index, value: _like(params[index], value)))
