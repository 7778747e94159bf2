"""Megatron's split of the vit's blocks with torch.distributed.tensor.parallel (``strategy.impl=
dtensor``), the same split as ``megatron.py``'s (read that first), as torchtitan writes it.

- Each sublayer (``attn``, ``mlp``) gets ``PrepareModuleInput`` to a Replicate DTensor, kept as a
  DTensor (``use_local_output=False``): q, k and v (``ColwiseParallel``) then take the same
  DTensor, their input-gradients add up as Partial DTensors, and the one conversion back sums them
  in one all-reduce (a ``ColwiseParallel`` fed a plain tensor converts it itself: one all-reduce
  per layer, three for q, k, v). ``proj``/``fc2`` are ``RowwiseParallel``: one all-reduce forward.
- Sequence parallelism: the embedding's output becomes a Shard(1) DTensor (``PrepareModuleOutput``),
  the residual stream stays one, ``norm1``/``norm2`` are ``SequenceParallel``, the sublayers'
  inputs are all-gathered to Replicate and ``RowwiseParallel(output_layouts=Shard(1))``
  reduce-scatters; the head's input is all-gathered to a plain tensor (the pool sees all tokens).
  DTensor all-reduces the LayerNorms' and row biases' Partial gradients itself.

Counting: DTensor issues functional collectives (``torch.ops._c10d_functional``), which the
counter's wrappers of ``torch.distributed`` never see; ``CountFunctional`` records them.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallel_lab.strategies.tp.megatron import TOKENS, TPGroup, _slice_dropout, blocks, dense_mlp


def _block_plan(sequence_parallel: bool, dense: bool = True) -> dict:
    """dense=False: an MoE block (models/moe.py), whose MLP stays whole on every tp rank and takes
    the attention's all-reduced plain tensor (its experts are sharded by strategy.ep instead)."""
    entering = Shard(TOKENS) if sequence_parallel else Replicate()
    leaving = Shard(TOKENS) if sequence_parallel else Replicate()
    plan = {}
    sublayers = (("attn", ("q", "k", "v"), "proj"), ("mlp", ("fc1",), "fc2"))[: 1 + dense]
    for sublayer, columns, row in sublayers:
        plan[sublayer] = PrepareModuleInput(
            input_layouts=(entering,), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        plan.update({f"{sublayer}.{c}": ColwiseParallel() for c in columns})
        plan[f"{sublayer}.{row}"] = RowwiseParallel(output_layouts=leaving, use_local_output=not sequence_parallel)
    if sequence_parallel:
        plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
    return plan


def split_transformer_dtensor(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> dict[str, int]:
    """``split.split_transformer`` on a 1-D DeviceMesh; {sharded parameter: its split dim}."""
    # The heads' and hidden features' dropouts see this rank's local slice (the layers return
    # local tensors): they draw the whole sample's mask and keep their slice, as in the manual split.
    # Under SP the sublayers' output dropouts would see DTensors: refused in tp/rules.py.
    local = TPGroup(None, mesh.get_local_rank(), mesh.size())
    for block in blocks(model):
        dense = dense_mlp(model, block)
        parallelize_module(model.get_submodule(block), mesh, _block_plan(sequence_parallel, dense))
        _slice_dropout(model, f"{block}.attn.core.drop", 1, local)
        if dense:
            _slice_dropout(model, f"{block}.mlp.drop1", -1, local)
    if sequence_parallel:
        if hasattr(model, "embed"):
            parallelize_module(
                model.embed,
                mesh,
                PrepareModuleOutput(
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(TOKENS),), use_local_output=False
                ),
            )
        if hasattr(model, "head"):
            parallelize_module(
                model.head,
                mesh,
                PrepareModuleInput(
                    input_layouts=(Shard(TOKENS),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
            )
    return {
        name: p.placements[0].dim
        for name, p in model.named_parameters()
        if hasattr(p, "placements") and isinstance(p.placements[0], Shard)
    }


class CountFunctional:
    """A TorchDispatchMode that records every functional collective DTensor issues in ``counter``
    (comm/counter.py's units: an all-reduce of B bytes is 2B, an all-gather its output, a
    reduce-scatter its input) under ``group`` (the tp mesh's), entered around a training step."""

    def __new__(cls, counter, group=None):
        from torch.utils._python_dispatch import TorchDispatchMode

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func._opname if func.namespace == "_c10d_functional" else ""
                if name.startswith("all_reduce"):
                    counter.record("all_reduce", 2 * _nbytes(args[0]), group)
                elif name.startswith("all_gather_into_tensor"):
                    counter.record("all_gather_into_tensor", _nbytes(out), group)
                elif name.startswith("reduce_scatter_tensor"):
                    counter.record("reduce_scatter_tensor", _nbytes(args[0]), group)
                return out

        return _Mode()


def _nbytes(t) -> int:
    return t.numel() * t.element_size()
