"""A DeepSpeed checkpoint folder (ZeRO 0-3, offload or not) as the full state: DeepSpeed's
``zero_to_fp32`` merge of the per-rank flat fp32 partitions, applied to the master weights and to
each Adam moment alike (the moments have the master's flat layout); ZeRO-0 holds the plain torch
optimizer state. The job of DeepSpeed's universal checkpoint (``ds_to_universal``, Lian et al.,
arXiv 2406.18820) done in memory, with the files read by ``ds_reader.weights_only_load``."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from parallel_lab.checkpoint.lazy_state import (
    ADAM_KEYS,
    LazyState,
    TensorMeta,
    _as_fp32,
    _lazy_adam,
    _meta,
    _named_adam,
)


def _deepspeed_model_states(files: list[Path]) -> list:
    from deepspeed.utils.zero_to_fp32 import zero_model_state

    from parallel_lab.checkpoint.ds_reader import weights_only_load

    states = []
    for file in files:
        sd = weights_only_load(str(file), map_location="cpu")
        buffers = {k: _as_fp32(v) for k, v in sd["module"].items() if k in sd["buffer_names"]}
        states.append(
            zero_model_state(
                buffers=buffers,
                param_shapes=sd["param_shapes"],
                shared_params=list(sd["shared_params"].items()),
                ds_version=sd.get("ds_version"),
                frozen_param_shapes=sd.get("frozen_param_shapes"),
                frozen_param_fragments=sd.get("frozen_param_fragments"),
            )
        )
    return states


def _rank_of(file: Path) -> int:
    return int(re.search(r"rank_(\d+)", file.name)[1])


@dataclass
class _ZeroLayout:
    """Where each parameter lies in the per-rank flat partitions of DeepSpeed's ZeRO files.

    Stages 1-2 (``_zero2_merge_trainable_params``): a group's full flat vector is the rank
    partitions end to end; parameter after parameter, each followed by its alignment padding.
    Stage 3 (``_zero3_merge_trainable_params``): every parameter is cut into world equal parts
    (the last padded); rank r's flat partition holds part r of each parameter in turn, and the
    groups are read as one vector. Both are DeepSpeed's own merge rules, applied one parameter at
    a time (``deepspeed.utils.zero_to_fp32.GatheredTensor`` for stage 3).
    """

    stage: int
    world: int
    where: dict[str, tuple]  # name -> (group, offset, numel) for stages 1-2; (offset, part numel) for 3
    shapes: dict[str, tuple]


def _zero_layout(stage: int, world: int, model_state, paddings) -> _ZeroLayout:
    where: dict[str, tuple] = {}
    shapes: dict[str, tuple] = {}
    if stage == 3:
        from deepspeed.utils.zero_to_fp32 import zero3_partitioned_param_info

        offset = 0
        for group in model_state.param_shapes:
            for name, shape in group.items():
                part, _ = zero3_partitioned_param_info(math.prod(shape), world)
                where[name], shapes[name] = (offset, part), tuple(shape)
                offset += part
        return _ZeroLayout(stage, world, where, shapes)
    for g, group in enumerate(model_state.param_shapes):
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            where[name], shapes[name] = (g, offset, numel), tuple(shape)
            offset += numel + (paddings[g][i] if paddings is not None else 0)
    return _ZeroLayout(stage, world, where, shapes)


def _zero12_slice(partitions: list[torch.Tensor], offset: int, numel: int) -> torch.Tensor:
    """Elements [offset, offset + numel) of the rank partitions laid end to end, without joining them."""
    pieces, start = [], 0
    for part in partitions:
        end = start + part.numel()
        lo, hi = max(offset, start), min(offset + numel, end)
        if lo < hi:
            pieces.append(part[lo - start : hi - start])
        start = end
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()


def _zero_tensor(layout: _ZeroLayout, flat: list[list[torch.Tensor]], name: str) -> torch.Tensor:
    """One parameter (or moment: same layout) from flat[rank][group], as a fresh tensor."""
    shape = layout.shapes[name]
    if layout.stage == 3:
        from deepspeed.utils.zero_to_fp32 import GatheredTensor

        offset, part = layout.where[name]
        group_offsets = [0, *itertools.accumulate(t.numel() for t in flat[0])]
        # contiguous() concatenates the parts: a fresh tensor, no longer backed by the mapped files
        return GatheredTensor(flat, group_offsets, offset, part, torch.Size(shape)).contiguous()
    group, offset, numel = layout.where[name]
    return _zero12_slice([rank[group] for rank in flat], offset, numel).view(shape)


def read_deepspeed_folder(folder: Path, names: list[str]) -> tuple[Mapping, dict]:
    """One tag folder of DeepSpeed's engine.save_checkpoint (any ZeRO stage and world size): the
    full model state_dict and Adam's state by parameter name, each tensor read when asked for."""
    from parallel_lab.checkpoint.ds_reader import weights_only_load

    optim_files = sorted(folder.glob("*_optim_states.pt"), key=_rank_of)
    if not optim_files:  # ZeRO-0: the module and the torch optimizer's own state_dict
        file = str(folder / "mp_rank_00_model_states.pt")
        sd = weights_only_load(file, map_location="cpu", mmap=True)
        adam = _named_adam(sd["optimizer"] or {}, names)
        model_meta, adam_meta = _meta(sd["module"], fp32=True), {n: _meta(s) for n, s in adam.items()}
        del sd, adam

        def read_module(name: str) -> torch.Tensor:
            return _as_fp32(weights_only_load(file, map_location="cpu", mmap=True)["module"][name].clone())

        def read_adam0(name: str, key: str) -> torch.Tensor:
            sd = weights_only_load(file, map_location="cpu", mmap=True)
            return _named_adam(sd["optimizer"] or {}, names)[name][key].clone()

        return LazyState(model_meta, read_module), _lazy_adam(adam_meta, read_adam0)

    def shards() -> list[dict]:
        """Every rank's optimizer_state_dict, mapped (nothing read until a tensor is touched)."""
        return [weights_only_load(str(f), map_location="cpu", mmap=True)["optimizer_state_dict"] for f in optim_files]

    first = shards()[0]
    stage, paddings = int(first["zero_stage"]), first.get("param_alignment_paddings")
    master_key, inner_key = (
        ("fp32_flat_groups", "optimizer_state_dict")
        if stage == 3
        else ("single_partition_of_fp32_groups", "base_optimizer_state")
    )
    groups = sorted(first[inner_key]["state"])
    has_adam = bool(groups)
    master_dtype = first[master_key][0].dtype
    adam_dtypes = {k: first[inner_key]["state"][groups[0]][k].dtype for k in ADAM_KEYS} if has_adam else {}
    del first
    # Every rank's model_states file holds the same shapes and buffers: rank 0's is enough.
    model_file = min(folder.glob("*model_states.pt"), key=_rank_of)
    model_state = _deepspeed_model_states([model_file])[0]
    layout = _zero_layout(stage, len(optim_files), model_state, paddings)
    shared = {alias: target for alias, target in model_state.shared_params if target in layout.shapes}
    buffers = model_state.buffers

    def flat(key: str) -> list[list[torch.Tensor]]:
        if key == "param":
            return [s[master_key] for s in shards()]
        return [[s[inner_key]["state"][g][key] for g in groups] for s in shards()]

    def read_model(name: str) -> torch.Tensor:
        if name in buffers:
            return buffers[name].clone()
        return _zero_tensor(layout, flat("param"), shared.get(name, name))

    def read_adam(name: str, key: str) -> torch.Tensor:
        if key == "step":
            return shards()[0][inner_key]["state"][groups[0]]["step"].clone()
        return _zero_tensor(layout, flat(key), name)

    params = {n: TensorMeta(shape, master_dtype) for n, shape in layout.shapes.items()}
    model_meta = {**_meta(buffers), **params, **{alias: params[target] for alias, target in shared.items()}}
    adam_meta = {
        n: {k: TensorMeta(() if k == "step" else shape, dtype) for k, dtype in adam_dtypes.items()}
        for n, shape in layout.shapes.items()
        if n in names
    }
    return LazyState(model_meta, read_model), (_lazy_adam(adam_meta, read_adam) if has_adam else {})
