"""Megatron's split of the vit's transformer blocks (Shoeybi et al., arXiv 1909.08053, sec. 3),
with optional sequence parallelism (Korthikanti et al., arXiv 2205.05198, sec. 4.2.2). The gpt's
blocks split the same way (``split_blocks``; its vocabulary ends: ``vocab.py``).

``split_transformer(model, tp, sequence_parallel)`` (``tp/split.py``) is the one entry point (the strategy's, and a
pipeline stage's later: it splits whatever ``block*`` children the module has, and an ``embed`` /
``head`` only where present). ``tp`` is a ``TPGroup`` (this project's f/g functions,
``strategy.impl=manual``) or a 1-D ``DeviceMesh`` (torch.distributed.tensor.parallel,
``strategy.impl=dtensor``, ``megatron_dtensor.py``).

Per block (``models/vit.py``), t = the tp degree:

- attention: ``attn.q``, ``attn.k``, ``attn.v`` column-parallel (rank r holds output features
  [r*dim/t, (r+1)*dim/t) of each = heads r*heads/t .. of them: attention runs on its own heads
  with no communication), ``attn.proj`` row-parallel;
- MLP: ``mlp.fc1`` column-parallel, ``mlp.fc2`` row-parallel.

The attention's and the MLP's input enter the split region once (one f, whose backward is the
block's sublayer's one all-reduce, shared by q, k and v), and each sublayer leaves it by one g:
2 all-reduces of (batch, tokens, dim) per block forward, 2 backward. ``embed`` and ``head``
stay whole on every rank.

Sequence parallelism: the regions between the split layers (norm1/norm2, the residual stream, the
sublayers' output dropout) hold tokens [r*tokens/t, (r+1)*tokens/t) only. f becomes an all-gather
of the tokens, g a reduce-scatter (the same bytes on the wire, ``comm.py``). As in Megatron, the
column layers keep their input's shard for backward, not the gathered tokens, and gather it again
there (``comm.sequence_parallel_columns``: one Function for q, k and v, run by the attention's
entry hook, whose outputs the three ``GatheredColumn`` layers hand back); the embedding's output
is scattered to the ranks' tokens (its gradient all-gathered back), and the head pools its tokens'
sum and all-reduces the (batch, dim) pool (the mean of all tokens, on every rank). The weights used
on a slice of the tokens (every LayerNorm, the row layers' biases) receive a slice's gradient: the
strategy sums those over the tp ranks after backward (``sequence_parallel_params``).

Dropout: the vit draws each sample's mask from the sample (models/dropout.py). A rank holding a
slice (heads in the attention core, hidden features after fc1, tokens in the SP regions) draws the
whole sample's mask, as single does, and keeps its slice (``SlicedDropout``): the same training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallel_lab.strategies.tp.comm import (
    copy_to_tp,
    gather_from_sequence,
    gather_to_replicated,
    reduce_from_tp,
    scatter_to_sequence,
    sequence_parallel_columns,
)
from parallel_lab.strategies.tp.layers import ColumnParallel, RowParallel, replace_module
from parallel_lab.strategies.tp.plans import COLUMNS, ROWS, block_plan
from parallel_lab.strategies.tp.plans import block_columns as plan_block_columns

TOKENS = 1  # the tokens dimension of the vit's (batch, tokens, dim) activations
# Per sublayer: the module whose input enters the split region, its row layer, its dropouts.
SUBLAYERS = {"attn": ("attn.proj", "attn.drop"), "mlp": ("mlp.fc2", "mlp.drop2")}


@dataclass(frozen=True)
class TPGroup:
    """The tp ranks for the manual split: their process group (None: the world), this rank, t.
    The planner passes a group of None on the meta device, where nothing communicates."""

    group: object
    rank: int
    size: int


def blocks(model: nn.Module) -> list[str]:
    """The transformer blocks among the module's children (``block0`` ...), in order."""
    return [name for name, child in model.named_children() if name.startswith("block") and hasattr(child, "attn")]


def has_layer(model: nn.Module, name: str) -> bool:
    """Whether ``model`` has a submodule ``name`` (the gpt's gelu MLP sets ``gate`` to None)."""
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def dense_mlp(model: nn.Module, block: str) -> bool:
    """Whether the block's MLP is the dense fc1 -> fc2 that Megatron splits; an MoE MLP
    (models/moe.py) stays whole on every tp rank (its experts are sharded by strategy.ep instead)."""
    return has_layer(model, f"{block}.{COLUMNS[-1]}")


def block_columns(model: nn.Module, block: str) -> list[str]:
    """The block's column-parallel layers (tp/plans.py ``block_columns``)."""
    return plan_block_columns(lambda name: has_layer(model, f"{block}.{name}"))


def vit_plan(model: nn.Module) -> list[tuple[str | None, str]]:
    """The (column, row) pairs of ``tp/rules.py``'s plans (plans.py ``block_plan``) of the module's blocks.
    The gpt's blocks split alike."""
    return block_plan(blocks(model), lambda name: has_layer(model, name))


def split_transformer_manual(
    model: nn.Module, tp: TPGroup, sequence_parallel: bool, dtensor_layout: bool = False
) -> dict[str, int]:
    """``tp/split.py``'s ``split_transformer`` with this project's f/g functions. dtensor_layout:
    under SP, save what the dtensor split saves (the planner's count of it): the column layers
    keep the all-gathered input (DTensor's ColwiseParallel gathers before the Linear, which saves
    what it gets), and the head gets all tokens gathered instead of pooling its own."""
    shard_dims = split_blocks(model, tp, sequence_parallel, dtensor_layout)
    if sequence_parallel:
        if hasattr(model, "embed"):
            model.embed.register_forward_hook(
                lambda _m, _a, out: scatter_to_sequence(out, TOKENS, tp.group, tp.rank, tp.size)
            )
        if hasattr(model, "head") and dtensor_layout:
            model.head.register_forward_pre_hook(
                lambda _m, args: (gather_to_replicated(args[0], TOKENS, tp.group, tp.rank, tp.size),)
            )
        elif hasattr(model, "head"):
            replace_module(model, "head", SequenceParallelHead(model.head, tp))
    return shard_dims


def split_blocks(
    model: nn.Module, tp: TPGroup, sequence_parallel: bool, dtensor_layout: bool = False
) -> dict[str, int]:
    """Every ``block*`` child split in place (the vit's and the gpt's alike); {parameter: split dim}."""
    shard_dims: dict[str, int] = {}
    for block in blocks(model):
        shard_dims.update(_split_block(model, block, tp, sequence_parallel, dtensor_layout))
    return {n: d for n, d in shard_dims.items() if n in dict(model.named_parameters())}  # bias=False: none


def _split_block(
    model: nn.Module, block: str, tp: TPGroup, sequence_parallel: bool, keep_gathered: bool
) -> dict[str, int]:
    shard_dims: dict[str, int] = {}
    column_cls = GatheredColumn if sequence_parallel and not keep_gathered else ColumnParallel
    dense = dense_mlp(model, block)
    columns = block_columns(model, block)
    for column in columns:
        name = f"{block}.{column}"
        replace_module(model, name, column_cls(model.get_submodule(name), tp.group, tp.rank, tp.size, True))
        shard_dims.update({f"{name}.weight": 0, f"{name}.bias": 0})
    for sublayer, (row, drop) in SUBLAYERS.items() if dense else list(SUBLAYERS.items())[:1]:
        name = f"{block}.{row}"
        layer = RowParallel(model.get_submodule(name), tp.group, tp.rank, tp.size, True, sequence_parallel)
        replace_module(model, name, layer)
        shard_dims[f"{name}.weight"] = 1
        entering = tuple(c.split(".")[1] for c in columns if c.startswith(f"{sublayer}."))
        model.get_submodule(f"{block}.{sublayer}").register_forward_pre_hook(
            _entry(tp, sequence_parallel, entering, keep_gathered)
        )
        if not has_layer(model, f"{block}.{drop}"):  # the gpt's MLP has one dropout, ``drop``, after fc2
            drop = f"{sublayer}.drop"
        if sequence_parallel:  # the sublayer's output dropout acts on this rank's tokens
            _slice_dropout(model, f"{block}.{drop}", TOKENS, tp)
    _slice_dropout(model, f"{block}.attn.core.drop", 1, tp)  # (batch, heads, tokens, tokens): its heads
    if dense and has_layer(model, f"{block}.mlp.drop1"):
        _slice_dropout(model, f"{block}.mlp.drop1", -1, tp)  # (batch, tokens, hidden): its hidden features
    return shard_dims


def _entry(tp: TPGroup, sequence_parallel: bool, columns: tuple[str, ...], keep_gathered: bool = False):
    """The forward pre-hook where a sublayer's input enters the split region, once for all its
    column layers: f (identity; all-reduce backward) or, under SP, the all-gather of the tokens
    and every column layer's output at once, the input kept as this rank's shard (the layers then
    return those outputs: ``GatheredColumn``; the sublayer itself gets the shard). ``columns`` are
    found by name in the hooked sublayer: a deep copy of the split model (the planner's bf16 cast)
    runs its own layers. keep_gathered: the gathered tokens are the sublayer's input, which its
    column layers save (the dtensor split's layout, for the planner)."""

    def enter(sublayer: nn.Module, args: tuple) -> tuple:
        (x,) = args
        if not sequence_parallel:
            return (copy_to_tp(x, tp.group),)
        if keep_gathered:
            return (gather_from_sequence(x, TOKENS, tp.group, tp.size),)
        layers = [sublayer.get_submodule(name) for name in columns]
        outputs = sequence_parallel_columns(x, TOKENS, tp.group, tp.size, [(c.weight, c.bias) for c in layers])
        for column, out in zip(layers, outputs):
            column.pending = out
        return (x,)

    return enter


class GatheredColumn(ColumnParallel):
    """A column layer under SP: its output was computed, from all ranks' tokens, by its sublayer's
    entry (``_entry``) together with its siblings'; this hands it back (the input it is called on
    is the shard, which the entry already used)."""

    pending: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.pending = self.pending, None
        if out is None:
            raise RuntimeError("a sequence-parallel column layer ran outside its sublayer (no entry hook computed it)")
        return out


def _slice_dropout(model: nn.Module, name: str, dim: int, tp: TPGroup) -> None:
    layer = model.get_submodule(name)
    if not isinstance(layer, nn.Identity):  # dropout 0 builds Identity: nothing drawn, nothing to slice
        replace_module(model, name, SlicedDropout(layer, dim, tp.rank, tp.size))


class SlicedDropout(nn.Module):
    """A SampleDropout (models/dropout.py) on a rank holding chunk ``rank`` of ``size`` along
    ``dim``: draws the whole sample's mask, as the single run does, and keeps this rank's chunk."""

    def __init__(self, dropout: nn.Module, dim: int, rank: int, size: int) -> None:
        super().__init__()
        self.dropout, self.dim, self.rank, self.size = dropout, dim, rank, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        full = list(x.shape)
        full[self.dim] *= self.size
        shape = x.new_empty(()).expand(full)  # carries the whole shape, holds one element
        # contiguous: the saved mask is this rank's chunk, not a view of the whole mask's storage
        keep = self.dropout._keep(shape).chunk(self.size, self.dim)[self.rank].contiguous()
        return torch.where(keep, x * (1.0 / (1.0 - self.dropout.p)), 0.0)


class SequenceParallelHead(nn.Module):
    """The vit's head (LayerNorm, mean over tokens, Linear) on this rank's tokens: the sum of its
    tokens, all-reduced (g) and divided by all tokens, is the mean single takes. Keeps the head's
    ``norm`` and ``fc`` (and their parameter names)."""

    def __init__(self, head: nn.Module, tp: TPGroup) -> None:
        super().__init__()
        self.norm, self.fc, self.tp = head.norm, head.fc, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = reduce_from_tp(self.norm(x).sum(dim=TOKENS), self.tp.group)
        return self.fc(pooled / (x.shape[TOKENS] * self.tp.size))


def sequence_parallel_params(model: nn.Module) -> list[str]:
    """Replicated parameters that see only this rank's tokens under SP (their gradients are a
    slice's): every LayerNorm in the blocks and the head, and the row layers' biases."""
    names = []
    for block in blocks(model):
        names += [f"{block}.{n}.{p}" for n in ("norm1", "norm2") for p in ("weight", "bias")]
        names += [f"{block}.{row}.bias" for row in ROWS]
    if hasattr(model, "head"):
        names += ["head.norm.weight", "head.norm.bias"]
    params = dict(model.named_parameters())
    return [n for n in names if n in params]
