"""Any of our checkpoints as one strategy-neutral "full state", read offline (no process group).

The full state is what a single process would hold: the model's state_dict by its single-model
names (parameters in fp32, buffers), Adam's state per parameter name (``exp_avg``, ``exp_avg_sq``,
``step``) and the loop state every rank saved (step, data position, loss history, RNG). Resharding
(``trainer.reshard=true``) reads it here and each target strategy scatters it into its own layout
(``Strategy.load_full_state``); ``python -m parallel_lab.checkpoint`` inspects and exports it.

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
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from parallel_lab.checkpoint.manifest import CheckpointError, read_manifest

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
FORMATS = ("replicated", "rank_shards", "dcp", "deepspeed")


@dataclass
class FullState:
    """A checkpoint as one process would hold it (see the module docstring)."""

    model: dict[str, torch.Tensor]  # state_dict by single-model name
    optim: dict[str, dict[str, torch.Tensor]]  # parameter name -> Adam state (empty before step 1)
    param_names: list[str]  # parameters in the single model's order
    format: str
    step: int = 0
    batches_consumed: int = 0
    history: dict = field(default_factory=dict)
    rng: list = field(default_factory=list)  # every source rank's RNG state, rank order


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint '{path}' {what}; point trainer.resume at a checkpoint this toolkit wrote")


def _load(file: Path) -> dict:
    """torch.load of one of our files (tensors and plain values only); a file that is not what it
    claims is a one-line CheckpointError."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
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


def _read_replicated(path: Path, names: list[str]) -> tuple[dict, dict]:
    state = _load(path / "model_optimizer.pt")
    return dict(state["model"]), _named_adam(state["optimizer"], names)


def _concat(parts: list[torch.Tensor], full_shape: torch.Size) -> torch.Tensor:
    """Shards of one tensor (rank order) as the whole; a replicated tensor is the first copy."""
    first = parts[0]
    if tuple(first.shape) == tuple(full_shape):
        return first
    dim = next(d for d, (a, b) in enumerate(zip(first.shape, full_shape)) if a != b)
    return torch.cat(parts[: full_shape[dim] // first.shape[dim]], dim=dim)


def _read_rank_shards(path: Path, model: torch.nn.Module) -> tuple[dict, dict]:
    names = [n for n, _ in model.named_parameters()]
    shapes = {**{n: t.shape for n, t in model.state_dict().items()}}
    files = sorted(path.glob("shard_rank*.pt"), key=lambda f: int(re.sub(r"\D", "", f.stem)))
    tensors: dict[str, list] = {}
    adam: dict[str, dict[str, list]] = {}
    for file in files:
        shard = _load(file)
        local = [n for n in names if n in shard["model"]]  # the rank's optimizer order
        for name, tensor in shard["model"].items():
            tensors.setdefault(name, []).append(tensor)
        for name, state in _named_adam(shard["optimizer"], local).items():
            for key, value in state.items():
                adam.setdefault(name, {}).setdefault(key, []).append(value)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        raise _bad(path, f"lacks {missing[0]} in every shard_rank*.pt (a model of another shape?)")
    full = {n: _concat(tensors[n], shapes[n]) for n in shapes}
    optim = {
        n: {k: (v[0] if k == "step" else _concat(v, shapes[n])) for k, v in state.items()} for n, state in adam.items()
    }
    return full, optim


def _read_dcp(path: Path) -> tuple[dict, dict]:
    state = read_dcp_folder(path / "dcp", path)
    optim = state.get("optimizer", {}).get("state", {})
    return dict(state["model"]), {n: {k: v for k, v in s.items() if k in ADAM_KEYS} for n, s in optim.items()}


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
        buffers = {
            k: v.float() if v.is_floating_point() else v for k, v in sd["module"].items() if k in sd["buffer_names"]
        }
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


def _merge_zero(stage: int, world: int, flat_groups: list, model_states: list, paddings) -> dict:
    """DeepSpeed's own merge of per-rank flat partitions into full tensors by name (zero_to_fp32)."""
    from deepspeed.utils import zero_to_fp32 as z

    # It prints progress lines and a tqdm bar; neither belongs in a run's output.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if stage <= 2:
            merged = z._get_fp32_state_dict_from_zero2_checkpoint(world, flat_groups, model_states, False, paddings)
        else:
            merged = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, model_states, False)
    # zero3 hands back lazy GatheredTensors; contiguous() materialises both kinds.
    return {k: v.contiguous() for k, v in merged.items()}


def _read_deepspeed(path: Path, names: list[str]) -> tuple[dict, dict]:
    return read_deepspeed_folder(path / "deepspeed", names)


def read_deepspeed_folder(folder: Path, names: list[str]) -> tuple[dict, dict]:
    """One tag folder of DeepSpeed's engine.save_checkpoint (any ZeRO stage and world size): the
    full model state_dict and Adam's state by parameter name."""
    from parallel_lab.checkpoint.ds_reader import weights_only_load

    optim_files = sorted(folder.glob("*_optim_states.pt"), key=lambda f: int(re.search(r"rank_(\d+)", f.name)[1]))
    if not optim_files:  # ZeRO-0: the module and the torch optimizer's own state_dict
        sd = weights_only_load(str(folder / "mp_rank_00_model_states.pt"), map_location="cpu")
        return {k: v.float() if v.is_floating_point() else v for k, v in sd["module"].items()}, _named_adam(
            sd["optimizer"] or {}, names
        )
    shards = [weights_only_load(str(f), map_location="cpu")["optimizer_state_dict"] for f in optim_files]
    stage = int(shards[0]["zero_stage"])
    model_files = sorted(folder.glob("*model_states.pt")) if stage == 3 else [folder / "mp_rank_00_model_states.pt"]
    if stage == 3:
        model_files = sorted(model_files, key=lambda f: int(re.search(r"rank_(\d+)", f.name)[1]))
    model_states = _deepspeed_model_states(model_files)
    world = len(optim_files)
    master_key, inner_key = (
        ("fp32_flat_groups", "optimizer_state_dict")
        if stage == 3
        else ("single_partition_of_fp32_groups", "base_optimizer_state")
    )
    paddings = shards[0].get("param_alignment_paddings")
    model = {
        **model_states[0].buffers,
        **_merge_zero(stage, world, [s[master_key] for s in shards], model_states, paddings),
    }
    inner = [s[inner_key]["state"] for s in shards]
    optim: dict[str, dict] = {n: {} for n in model if n in names}
    if inner[0]:
        groups = sorted(inner[0])
        for key in ("exp_avg", "exp_avg_sq"):
            flat = [[rank_state[g][key] for g in groups] for rank_state in inner]
            for name, value in _merge_zero(stage, world, flat, model_states, paddings).items():
                if name in optim:
                    optim[name][key] = value
        for name in optim:
            optim[name]["step"] = inner[0][groups[0]]["step"].clone()
    else:
        optim = {}
    return model, optim


def consolidate(path: Path, model_cfg: DictConfig | None = None, manifest: dict | None = None) -> FullState:
    """The checkpoint at path (checked against complete.json) as its full state."""
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
            params, optim = _read_deepspeed(path, names)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise _bad(path, f"is not a {fmt} checkpoint of model {model_cfg.name} ({type(exc).__name__}: {exc})") from None
    _check_shapes(path, model, params, optim)
    trainers = sorted(path.glob("trainer_rank*.pt"), key=lambda f: int(re.sub(r"\D", "", f.stem)))
    if not trainers:
        raise _bad(path, "has no trainer_rank0.pt")
    loop = [_load(f) for f in trainers]
    return FullState(
        model={k: v.float() if v.is_floating_point() else v for k, v in params.items()},
        optim=optim,
        param_names=names,
        format=fmt,
        step=int(loop[0]["step"]),
        batches_consumed=int(loop[0]["batches_consumed"]),
        history=loop[0]["history"],
        rng=[state["rng"] for state in loop],
    )


def _check_shapes(path: Path, model: torch.nn.Module, params: dict, optim: dict) -> None:
    """Every tensor of the model is there, in its shape: another model is refused here, in one line."""
    for name, tensor in model.state_dict().items():
        got = params.get(name)
        if got is None or tuple(got.shape) != tuple(tensor.shape):
            what = "lacks" if got is None else f"has {name} of shape {tuple(got.shape)}, the model needs"
            raise _bad(path, f"{what} {name}{'' if got is None else ' ' + str(tuple(tensor.shape))} (another model?)")
    for name, state in optim.items():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state and tuple(state[key].shape) != tuple(params[name].shape):
                raise _bad(path, f"has Adam {key} of {name} in shape {tuple(state[key].shape)}")
