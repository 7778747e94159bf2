"""The parts of a strategy whose every rank holds the whole model and optimizer state (single, dp,
ddp, manual_ddp): ``ReplicatedState``, ``ReplicatedMemory``; their rules, ``ReplicatedPlan`` and
``OneProcessPlan``, are in ``replicated_rules.py`` (torch-free). A strategy that shards says so by
not using them."""

from __future__ import annotations

from pathlib import Path

import torch

from parallel_lab.strategies.memory import (
    HeldMemory,
    analytic_state_bytes,
)
from parallel_lab.strategies.replicated_rules import OneProcessPlan, ReplicatedPlan  # noqa: F401  (plugins import them here)
from parallel_lab.strategies.state import State

REPLICA_FILE = "model_optimizer.pt"


def indexed_optimizer_state(
    optimizer: torch.optim.Optimizer, module: torch.nn.Module, by_name: dict[str, dict], local=lambda name, t: t
) -> dict:
    """A torch optimizer state_dict for ``optimizer`` (built over ``module.parameters()``, in
    order) from Adam's state by parameter name; ``local(name, tensor)`` cuts a rank's part."""
    names = [n for n, _ in module.named_parameters()]
    state = {
        i: {k: (v.clone() if k == "step" else local(name, v).clone()) for k, v in by_name[name].items()}
        for i, name in enumerate(names)
        if name in by_name
    }
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}


@torch.no_grad()
def copy_tensors_into(module: torch.nn.Module, model_state) -> None:
    """``module.load_state_dict(model_state)`` one tensor at a time: load_state_dict first copies the
    mapping into a dict, which would read every tensor of a lazy (streamed) state at once."""
    mine = module.state_dict()  # shares storage with the parameters and buffers
    if set(mine) != set(model_state):
        missing, unexpected = sorted(set(mine) - set(model_state)), sorted(set(model_state) - set(mine))
        raise RuntimeError(f"state_dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, tensor in mine.items():
        tensor.copy_(model_state[name])


class ReplicatedState(State):
    """One copy of the state is the whole state."""

    def unwrapped_model(self) -> torch.nn.Module:
        """The user's module inside DDP/DataParallel wrappers, whose state_dict has the plain names."""
        return getattr(self.model, "module", self.model)

    def save(self, directory: Path) -> None:
        """Every replica holds the same, so rank 0 writes one copy and the others wait at the
        checkpointer's barrier."""
        if self.env.rank == 0:
            torch.save(
                {"model": self.unwrapped_model().state_dict(), "optimizer": self.optimizer.state_dict()},
                directory / REPLICA_FILE,
            )

    def load(self, directory: Path) -> None:
        """Every rank reads the one copy (weights_only: tensors and plain values only)."""
        state = torch.load(directory / REPLICA_FILE, map_location=self.device, weights_only=True)
        self.unwrapped_model().load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def load_full(self, model_state: dict[str, torch.Tensor], optim_state: dict[str, dict]) -> None:
        """Every rank holds it all: the state_dict as it is, Adam's state re-keyed by index."""
        module = self.unwrapped_model()
        copy_tensors_into(module, model_state)
        self.optimizer.load_state_dict(indexed_optimizer_state(self.optimizer, module, optim_state))

    def full_parameters(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]


class ReplicatedMemory(HeldMemory):
    def analytic(self, num_params: int) -> dict[str, int]:
        """A full replica: every parameter's weights, gradient and optimizer state."""
        return analytic_state_bytes(num_params, self.cfg.trainer)
