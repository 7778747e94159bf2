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
* ``deepspeed/`` (ZeRO 0-3, offload or not; ``deepspeed_state.py``): DeepSpeed's ``zero_to_fp32`` merge of the per-rank
  flat fp32 partitions, applied to the master weights and to each Adam moment alike (the moments
  have the master's flat layout); ZeRO-0 holds the plain torch optimizer state. This is the job
  of DeepSpeed's universal checkpoint (``ds_to_universal``, Lian et al., arXiv 2406.18820) done in
  memory, with the files read by ``ds_reader.weights_only_load``.

Everything is read with ``torch.load(weights_only=True)`` or the allowlist unpicklers; the lazy
mappings and the one-line refusals are ``lazy_state.py``'s.

**Streaming.** ``FullState.model`` and each ``FullState.optim[name]`` are ``LazyState`` mappings: a
tensor is read from disk when it is asked for, handed over, and not kept. Files are opened with
``torch.load(mmap=True)`` anew for every tensor, so only that tensor's pages are touched, and they
are unmapped when it is returned (a mapping kept open would keep every page it ever touched
resident). A reader therefore holds one tensor (two while a sharded one is concatenated) beside
what the target strategy holds; ``docs/checkpoints.md`` has the measured peak RSS.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from parallel_lab.checkpoint.deepspeed_state import read_deepspeed_folder
from parallel_lab.checkpoint.lazy_state import (
    ADAM_KEYS,
    MOMENTS,
    LazyState,
    TensorMeta,
    _as_fp32,
    _bad,
    _fp32_dtype,
    _lazy_adam,
    _load,
    _meta,
    _named_adam,
    shape_of,
)
from parallel_lab.checkpoint.manifest import read_manifest

__all__ = ["ADAM_KEYS", "FORMATS", "FullState", "LazyState", "consolidate", "detect_format", "read_deepspeed_folder"]
FORMATS = ("replicated", "rank_shards", "dcp", "deepspeed")


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
    except Exception as exc:  # DCP wraps every failure; one line is what the user needs
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
        except Exception as exc:  # as above
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
    except Exception as exc:  # DCP wraps every failure; one line is what the user needs
        raise _bad(path, f"has unreadable {folder.name}/ files ({type(exc).__name__})") from None
    return state


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
