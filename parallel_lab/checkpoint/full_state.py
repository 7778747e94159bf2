"""Any of our checkpoints as one strategy-neutral "full state", read offline (no process group).

The full state is what a single process would hold: the model's state_dict by its single-model
names (parameters in fp32, buffers), Adam's state per parameter name (``exp_avg``, ``exp_avg_sq``,
``step``) and the loop state every rank saved (step, data position, loss history, RNG). Resharding
(``trainer.reshard=true``) reads it here and each target strategy scatters it into its own layout
(``State.load_full``, strategies/state.py); ``python -m parallel_lab.checkpoint`` inspects and exports it.

One reader per file format, picked by the files a checkpoint holds (never by strategy name):

* ``model_optimizer.pt`` (replicated): the one copy, optimizer state by parameter index.
* ``shard_rank<k>.pt`` (tensor/pipeline parallel): ranks 0..k-1 of the first replica hold the
  whole model; a shard smaller than the full parameter is concatenated along the dimension that
  differs, in rank order (``chunk``'s order, strategies/tp/layers.py).
* ``dcp/`` (torch Distributed Checkpoint): DCP's own no-process-group load with an empty state
  dict (what ``format_utils.dcp_to_torch_save`` does), through the restricted readers.
* ``deepspeed/`` (ZeRO 0-3, offload or not): DeepSpeed's ``zero_to_fp32`` merge of the per-rank
  flat fp32 partitions, applied to the master weights and to each Adam moment alike (the moments
  have the master's flat layout); ZeRO-0 holds the plain torch optimizer state. This is the job
  of DeepSpeed's universal checkpoint (``ds_to_universal``, Lian et al., arXiv 2406.18820) done in
  memory, with the files read by ``ds_reader.weights_only_load``.

Everything is read with ``torch.load(weights_only=True)`` or the allowlist unpicklers.

**Streaming.** ``FullState.model`` and each ``FullState.optim[name]`` are ``LazyState`` mappings: a
tensor is read from disk when it is asked for, handed over, and not kept. Files are opened with
``torch.load(mmap=True)`` anew for every tensor, so only that tensor's pages are touched, and they
are unmapped when it is returned (a mapping kept open would keep every page it ever touched
resident). A reader therefore holds one tensor (two while a sharded one is concatenated) beside
what the target strategy holds; ``docs/checkpoints.md`` has the measured peak RSS.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from parallel_lab.checkpoint.manifest import CheckpointError, read_manifest

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
FORMATS = ("replicated", "rank_shards", "dcp", "deepspeed")
MOMENTS = ("exp_avg", "exp_avg_sq")


class TensorMeta(NamedTuple):
    """What a tensor is, known without reading its data."""

    shape: tuple
    dtype: torch.dtype


class LazyState(Mapping):
    """name -> tensor, read by ``read(name)`` each time it is asked for and never cached.

    ``meta`` (shapes and dtypes, known without reading any tensor data) names what is there;
    iterate it and take one tensor at a time to keep only one in memory.
    """

    def __init__(self, meta: dict[str, TensorMeta], read: Callable[[str], torch.Tensor]) -> None:
        self.meta = {name: TensorMeta(tuple(m.shape), m.dtype) for name, m in meta.items()}
        self.shapes = {name: m.shape for name, m in self.meta.items()}
        self._read = read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        # DeepSpeed saves its flat fp32 groups with requires_grad=True: an op on them under autograd
        # would link the result to the mapped file through its graph and keep the file mapped.
        with torch.no_grad():
            return self._read(name).detach()

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __repr__(self) -> str:
        return f"LazyState({len(self.shapes)} tensors)"


def shape_of(state: Mapping, name: str) -> tuple | None:
    """A tensor's shape without reading it (LazyState) or from the tensor itself."""
    if isinstance(state, LazyState):
        return state.shapes.get(name)
    value = state.get(name)
    return None if value is None else tuple(value.shape)


def _as_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


@dataclass
class FullState:
    """A checkpoint as one process would hold it (see the module docstring)."""

    model: Mapping[str, torch.Tensor]  # state_dict by single-model name (LazyState: read on demand)
    optim: dict[str, Mapping[str, torch.Tensor]]  # parameter name -> Adam state (empty before step 1)
    param_names: list[str]  # parameters in the single model's order
    format: str
    step: int = 0
    batches_consumed: int = 0
    history: dict = field(default_factory=dict)
    rng: list = field(default_factory=list)  # every source rank's RNG state, rank order


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint '{path}' {what}; point trainer.resume at a checkpoint this toolkit wrote")


def _load(file: Path, mmap: bool = False) -> dict:
    """torch.load of one of our files (tensors and plain values only); a file that is not what it
    claims is a one-line CheckpointError. mmap=True maps the tensors' bytes without reading them."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - unpickling errors come in many types; each is one line
        raise _bad(file.parent, f"has an unreadable {file.name} ({type(exc).__name__})") from None


def detect_format(path: Path) -> str:
    """Which writer made the checkpoint, by the files it holds."""
    if (path / "model_optimizer.pt").is_file():
        return "replicated"
    if (path / "dcp").is_dir():
        return "dcp"
    if (path / "deepspeed").is_dir():
        return "deepspeed"
    if any(path.glob("shard_rank*.pt")):
        return "rank_shards"
    raise _bad(path, "holds no model state this toolkit knows (model_optimizer.pt, dcp/, deepspeed/, shard_rank*.pt)")


def reference_model(model_cfg: DictConfig) -> torch.nn.Module:
    from parallel_lab.models import build_meta_model

    return build_meta_model(model_cfg)


def _named_adam(state: dict, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """A torch optimizer state_dict's per-index state under the parameters' names."""
    return {names[i]: {k: v for k, v in s.items() if k in ADAM_KEYS} for i, s in state.get("state", {}).items()}


def _lazy_adam(
    meta: dict[str, dict[str, TensorMeta]], read: Callable[[str, str], torch.Tensor]
) -> dict[str, LazyState]:
    """Adam's state by parameter name, each moment read by read(name, key) when asked for."""
    return {name: LazyState(keys, lambda key, name=name: read(name, key)) for name, keys in meta.items()}


def _fp32_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype


def _meta(state: dict, fp32: bool = False) -> dict[str, TensorMeta]:
    """Shapes and dtypes of a (mapped) state dict's tensors; fp32: floats as _as_fp32 hands them out."""
    return {n: TensorMeta(tuple(t.shape), _fp32_dtype(t.dtype) if fp32 else t.dtype) for n, t in state.items()}


def _read_replicated(path: Path, names: list[str]) -> tuple[LazyState, dict]:
    """model_optimizer.pt, mapped once per tensor asked for."""
    file = path / "model_optimizer.pt"
    state = _load(file, mmap=True)
    adam = _named_adam(state["optimizer"], names)
    model_meta, adam_meta = _meta(state["model"], fp32=True), {n: _meta(s) for n, s in adam.items()}
    del state, adam  # only the shapes stay; every tensor below maps the file again

    def read_model(name: str) -> torch.Tensor:
        return _as_fp32(_load(file, mmap=True)["model"][name].clone())

    def read_adam(name: str, key: str) -> torch.Tensor:
        return _named_adam(_load(file, mmap=True)["optimizer"], names)[name][key].clone()

    return LazyState(model_meta, read_model), _lazy_adam(adam_meta, read_adam)


def _concat(parts: list[torch.Tensor], full_shape: tuple) -> torch.Tensor:
    """Shards of one tensor (rank order) as the whole; a replicated tensor is the first copy."""
    first = parts[0]
    if tuple(first.shape) == tuple(full_shape):
        return first.clone()
    dim = next(d for d, (a, b) in enumerate(zip(first.shape, full_shape)) if a != b)
    return torch.cat(parts[: full_shape[dim] // first.shape[dim]], dim=dim)


def _read_rank_shards(path: Path, model: torch.nn.Module) -> tuple[LazyState, dict]:
    """shard_rank<k>.pt (tp/pp): a tensor is its shards from every file that has it, concatenated."""
    names = [n for n, _ in model.named_parameters()]
    meta = {n: TensorMeta(tuple(t.shape), _fp32_dtype(t.dtype)) for n, t in model.state_dict().items()}
    shapes = {n: m.shape for n, m in meta.items()}
    files = sorted(path.glob("shard_rank*.pt"), key=lambda f: int(re.sub(r"\D", "", f.stem)))

    def local_names(shard: dict) -> list[str]:
        return [n for n in names if n in shard["model"]]  # the rank's optimizer order

    held: set[str] = set()
    adam_meta: dict[str, dict[str, TensorMeta]] = {}
    for file in files:
        shard = _load(file, mmap=True)
        held |= set(shard["model"])
        for name, state in _named_adam(shard["optimizer"], local_names(shard)).items():
            for key, value in state.items():
                full = () if key == "step" else shapes[name]
                adam_meta.setdefault(name, {})[key] = TensorMeta(full, value.dtype)
    missing = [n for n in shapes if n not in held]
    if missing:
        raise _bad(path, f"lacks {missing[0]} in every shard_rank*.pt (a model of another shape?)")

    def parts(pick: Callable[[dict], torch.Tensor | None]) -> list[torch.Tensor]:
        found = (pick(_load(file, mmap=True)) for file in files)
        return [t for t in found if t is not None]

    def read_model(name: str) -> torch.Tensor:
        return _as_fp32(_concat(parts(lambda shard: shard["model"].get(name)), shapes[name]))

    def read_adam(name: str, key: str) -> torch.Tensor:
        found = parts(lambda shard: _named_adam(shard["optimizer"], local_names(shard)).get(name, {}).get(key))
        return found[0].clone() if key == "step" else _concat(found, shapes[name])

    return LazyState(meta, read_model), _lazy_adam(adam_meta, read_adam)


def _read_dcp(path: Path) -> tuple[LazyState, dict]:
    """dcp/: DCP's metadata names every tensor and its size; each is read alone when asked for."""
    from parallel_lab.checkpoint.dcp_reader import WeightsOnlyFileSystemReader, read_tensor

    folder = path / "dcp"
    try:
        metadata = WeightsOnlyFileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - DCP wraps every failure; one line is what the user needs
        raise _bad(path, f"has unreadable {folder.name}/ files ({type(exc).__name__})") from None
    model_meta: dict[str, TensorMeta] = {}
    adam_meta: dict[str, dict[str, TensorMeta]] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        size = getattr(meta, "size", None)
        if size is None:  # bytes entries (lr, betas): not part of the full state
            continue
        dtype = meta.properties.dtype
        if fqn.startswith("model."):
            model_meta[fqn[len("model.") :]] = TensorMeta(tuple(size), _fp32_dtype(dtype))
        elif fqn.startswith("optimizer.state."):
            name, _, key = fqn[len("optimizer.state.") :].rpartition(".")
            if key in ADAM_KEYS:
                adam_meta.setdefault(name, {})[key] = TensorMeta(tuple(size), dtype)

    def read(fqn: str) -> torch.Tensor:
        try:
            return read_tensor(folder, fqn, metadata)
        except Exception as exc:  # noqa: BLE001 - as above
            raise _bad(path, f"has unreadable {folder.name}/ files ({type(exc).__name__})") from None

    return (
        LazyState(model_meta, lambda name: _as_fp32(read(f"model.{name}"))),
        _lazy_adam(adam_meta, lambda name, key: read(f"optimizer.state.{name}.{key}")),
    )


def read_dcp_folder(folder: Path, path: Path) -> dict:
    """A torch DCP checkpoint's whole state dict, as written (nested), read without a process group."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from parallel_lab.checkpoint.dcp_reader import WeightsOnlyFileSystemReader, WeightsOnlyLoadPlanner

    class Planner(WeightsOnlyLoadPlanner, _EmptyStateDictLoadPlanner):
        """DCP's empty-state-dict planner (it builds the state from the metadata) with the
        weights_only byte loading."""

    state: dict = {}
    try:
        _load_state_dict(
            state, storage_reader=WeightsOnlyFileSystemReader(str(folder)), planner=Planner(), no_dist=True
        )
    except Exception as exc:  # noqa: BLE001 - DCP wraps every failure; one line is what the user needs
        raise _bad(path, f"has unreadable {folder.name}/ files ({type(exc).__name__})") from None
    return state


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


def consolidate(path: Path, model_cfg: DictConfig | None = None, manifest: dict | None = None) -> FullState:
    """The checkpoint at path (checked against complete.json) as its full state, read lazily."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    run = manifest.get("run", {})
    if run.get("model_config"):
        model_cfg = OmegaConf.create(run["model_config"])
    if model_cfg is None:  # written before complete.json kept the model config: the defaults
        model_cfg = OmegaConf.create({"name": run.get("model", "cnn"), "num_classes": 10})
    model = reference_model(model_cfg)
    names = [n for n, _ in model.named_parameters()]
    fmt = detect_format(path)
    try:
        if fmt == "replicated":
            params, optim = _read_replicated(path, names)
        elif fmt == "rank_shards":
            params, optim = _read_rank_shards(path, model)
        elif fmt == "dcp":
            params, optim = _read_dcp(path)
        else:
            params, optim = read_deepspeed_folder(path / "deepspeed", names)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise _bad(path, f"is not a {fmt} checkpoint of model {model_cfg.name} ({type(exc).__name__}: {exc})") from None
    _check_shapes(path, model, params, optim)
    trainers = sorted(path.glob("trainer_rank*.pt"), key=lambda f: int(re.sub(r"\D", "", f.stem)))
    if not trainers:
        raise _bad(path, "has no trainer_rank0.pt")
    loop = [_load(f) for f in trainers]
    return FullState(
        model=params,
        optim=optim,
        param_names=names,
        format=fmt,
        step=int(loop[0]["step"]),
        batches_consumed=int(loop[0]["batches_consumed"]),
        history=loop[0]["history"],
        rng=[state["rng"] for state in loop],
    )


def _check_shapes(path: Path, model: torch.nn.Module, params: Mapping, optim: Mapping) -> None:
    """Every tensor of the model is there, in its shape: another model is refused here, in one line
    (shapes only: nothing is read)."""
    for name, tensor in model.state_dict().items():
        got = shape_of(params, name)
        if got is None or got != tuple(tensor.shape):
            what = "lacks" if got is None else f"has {name} of shape {got}, the model needs"
            raise _bad(path, f"{what} {name}{'' if got is None else ' ' + str(tuple(tensor.shape))} (another model?)")
    for name, state in optim.items():
        for key in MOMENTS:
            got = shape_of(state, key)
            if got is not None and got != shape_of(params, name):
                raise _bad(path, f"has Adam {key} of {name} in shape {got}")
