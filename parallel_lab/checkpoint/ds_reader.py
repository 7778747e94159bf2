"""DeepSpeed checkpoints read with ``torch.load(weights_only=True)``.

DeepSpeed's own loader (``TorchCheckpointEngine.load``) unpickles with ``weights_only=False``,
which would run whatever code a tampered file names. Its ZeRO files hold tensors, plain values
and three DeepSpeed types (found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on
zero1-3 checkpoints, with and without offload); this engine allows exactly those and nothing else.
"""

from __future__ import annotations

import torch


def allowed_deepspeed_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def weights_only_load(path: str, map_location=None, mmap: bool = False) -> dict:
    """torch.load of a DeepSpeed file: tensors, plain values and the allowed DeepSpeed types only
    (mmap=True: the tensors' bytes are mapped, read only when touched)."""
    with torch.serialization.safe_globals(allowed_deepspeed_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def use_weights_only_loading(engine) -> None:
    """Swap the engine's checkpoint loader for one that refuses anything but the allowed types."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return weights_only_load(path, map_location)

    if not isinstance(engine.checkpoint_engine, TorchCheckpointEngine):
        raise RuntimeError(f"unexpected DeepSpeed checkpoint engine {type(engine.checkpoint_engine).__name__}")
    engine.checkpoint_engine.__class__ = WeightsOnlyCheckpointEngine
