"""Where the ranks compute, decided in the parent before any process starts.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected", seen on a 1-GPU H100 with
world_size=2), and then only after every worker has imported torch and joined the group. So on one
node the parent counts the GPUs it can see: ``device=cuda`` with more ranks than GPUs is refused,
and ``device=auto`` becomes ``cuda`` only when every rank gets a GPU of its own, else ``cpu`` (with a
one-line warning when GPUs were there but too few). Several nodes: every host decides for itself
in the worker (parallel_lab.comm.dist_env.pick_device); the parent may run on a login node.
"""

from __future__ import annotations

from omegaconf import DictConfig

from parallel_lab.comm.dist_env import cuda_gpus
from parallel_lab.errors import ConfigError, Warn, print_warning


def resolve_device(cfg: DictConfig, warn: Warn = print_warning) -> None:
    """Check or settle ``cfg.device`` for a one-node run (cfg.launcher.nproc_per_node is known)."""
    if cfg.device == "cpu" or cfg.launcher.nodes > 1:
        return
    gpus, ranks = cuda_gpus(), cfg.launcher.nproc_per_node
    if cfg.device == "cuda" and gpus == 0:
        raise ConfigError("device=cuda but no CUDA GPU is visible here; use device=cpu or device=auto")
    if cfg.device == "cuda" and ranks > gpus:
        raise ConfigError(
            f"device=cuda with world_size={cfg.world_size} puts {ranks} ranks on this node but {gpus} CUDA "
            f"GPU(s) are visible (NCCL needs one GPU per rank); set world_size={gpus} or device=cpu"
        )
    if cfg.device == "auto":
        cfg.device = "cuda" if 0 < ranks <= gpus else "cpu"
        if 0 < gpus < ranks:
            warn(
                f"device=auto: {ranks} ranks on this node but {gpus} CUDA GPU(s) (NCCL needs one per rank), "
                f"so this run uses cpu and gloo; set world_size={gpus} to run on the GPU"
            )
