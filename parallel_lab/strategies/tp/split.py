"""The one entry point of Megatron's split of the vit's blocks (docs/tp.md): the strategy's, and
a pipeline stage's in a pp x tp layout (it splits whatever ``block*`` children the module has)."""

from __future__ import annotations

from torch import nn

from parallel_lab.strategies.tp.megatron import TPGroup, split_transformer_manual


def split_transformer(model: nn.Module, tp, sequence_parallel: bool) -> dict[str, int]:
    """Split ``model``'s blocks in place over ``tp``: a ``TPGroup`` (group, rank, size) uses this
    project's f/g functions (``megatron.py``), a 1-D ``DeviceMesh`` torch.distributed.tensor.parallel
    (``megatron_dtensor.py``). Returns {parameter name: the dimension it is split along} of the
    sharded parameters."""
    if isinstance(tp, TPGroup):
        return split_transformer_manual(model, tp, sequence_parallel)
    from parallel_lab.strategies.tp.megatron_dtensor import split_transformer_dtensor

    return split_transformer_dtensor(model, tp, sequence_parallel)
