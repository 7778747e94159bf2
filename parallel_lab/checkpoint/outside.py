"""``trainer.init_from=<path>``: a new run's starting weights (and, with ``trainer.init_optimizer=true``,
Adam's state) from a checkpoint this toolkit did not necessarily write.

What is read, picked by what the path holds (never by its name alone):

* one of our ``step_*`` checkpoints (``complete.json``): ``full_state.consolidate``, any strategy;
* a plain DeepSpeed ``engine.save_checkpoint(dir)`` folder (its ``latest`` file names the tag
  folder) or one tag folder (``mp_rank_00_model_states.pt``): any ZeRO stage, any world size,
  merged as DeepSpeed's zero_to_fp32 does (``deepspeed_state.read_deepspeed_folder``, arXiv 2406.18820);
* a torch Distributed Checkpoint folder (``.metadata``): ``{"model": ..., "optimizer": ...}`` as
  ``dcp.save`` wrote it (optimizer state keyed by name, as ``get_state_dict`` gives it, or by
  index, as ``Optimizer.state_dict`` does), or a bare model state_dict;
* a ``.safetensors`` file (weights only; a ``<stem>.optimizer.safetensors`` or ``optimizer.safetensors``
  beside it, as ``python -m parallel_lab.checkpoint export --optimizer`` writes, gives Adam's state);
* a ``torch.save`` file: a state_dict, or a dict holding one under model / state_dict /
  model_state_dict (and optimizer / optimizer_state_dict).

Files are read with ``torch.load(weights_only=True)``, safetensors or the allowlist unpicklers; the
result is checked against this run's model (every tensor, in its shape) in the parent before any
process starts, so a file that is not what it claims, or another model's, is one line and exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from parallel_lab.checkpoint.deepspeed_state import read_deepspeed_folder
from parallel_lab.checkpoint.full_state import ADAM_KEYS, _check_shapes, consolidate, read_dcp_folder, reference_model
from parallel_lab.checkpoint.manifest import COMPLETE, CheckpointError
from parallel_lab.checkpoint.manifest import init_from_error as _error

PREFIXES = ("module.", "_orig_mod.", "model.")  # wrappers' prefixes: DDP/DeepSpeed, torch.compile, Lightning


@dataclass
class Outside:
    """Weights and Adam state by this run's parameter names, and what they came from."""

    model: dict[str, torch.Tensor]
    optim: dict[str, dict[str, torch.Tensor]]
    format: str


def detect(path: Path) -> str:
    """Which kind of file or folder path is (see the module docstring)."""
    if path.is_dir():
        if (path / COMPLETE).is_file():
            return "parallel_lab"
        if (path / "latest").is_file() or (path / "mp_rank_00_model_states.pt").is_file():
            return "deepspeed"
        if (path / ".metadata").is_file():
            return "dcp"
        raise _error(path, "is a folder of no known kind (complete.json, DeepSpeed's latest, DCP's .metadata)")
    if not path.is_file():
        raise _error(path, "does not exist")
    with path.open("rb") as f:
        head = f.read(8)
    if path.suffix == ".safetensors":
        return "safetensors"
    if head[:2] == b"PK" or head[:1] == b"\x80":  # a torch.save zip, or a legacy pickle
        return "torch"
    raise _error(path, "is neither a torch.save file nor .safetensors (unknown format)")


def _one_line(exc: Exception) -> str:
    """The gist of a reader's error: torch's weights_only refusal is many lines, its reason one of them."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            reason = " ".join([line.split("WeightsUnpickler error:")[1], *lines[i + 1 : i + 2]]).strip()
            return f"torch.load(weights_only=True) refused it: {reason}"[:200]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def _rename(state: dict, known: set[str]) -> dict:
    """Keys under this run's names: a wrapper's prefix dropped where the key itself is unknown."""
    out = {}
    for key, value in state.items():
        while key not in known and key.startswith(PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def _by_name(optim: dict, names: list[str]) -> dict[str, dict]:
    """Adam's per-parameter state by name: keyed by index (Optimizer.state_dict) or by name."""
    state = optim.get("state", optim) if isinstance(optim, dict) else {}
    out = {}
    for key, value in state.items():
        name = names[int(key)] if isinstance(key, int) or str(key).isdigit() else key
        out[name] = {k: v for k, v in value.items() if k in ADAM_KEYS}
    return out


def _from_dict(state: dict, names: list[str]) -> tuple[dict, dict]:
    """A loaded dict: a bare state_dict, or one under the usual keys next to an optimizer's."""
    for key in ("model", "state_dict", "model_state_dict", "module"):
        if isinstance(state.get(key), dict):
            optim = next((state[k] for k in ("optimizer", "optimizer_state_dict", "optim") if k in state), {})
            return state[key], _by_name(optim or {}, names)
    return state, {}


def _read(path: Path, kind: str, model_cfg: DictConfig, names: list[str]) -> tuple[dict, dict]:
    if kind == "parallel_lab":
        full = consolidate(path)
        return full.model, full.optim
    if kind == "deepspeed":
        folder = path / (path / "latest").read_text().strip() if (path / "latest").is_file() else path
        return read_deepspeed_folder(folder, names)
    if kind == "dcp":
        return _from_dict(read_dcp_folder(path, path), names)
    if kind == "safetensors":
        from safetensors.torch import load_file

        model = load_file(path)
        # export's two layouts: w.safetensors + w.optimizer.safetensors, or a folder's model/optimizer.safetensors
        beside = [path.with_name(path.name.removesuffix(".safetensors") + ".optimizer.safetensors")]
        adam_file = next((f for f in [*beside, path.with_name("optimizer.safetensors")] if f.is_file()), None)
        flat = load_file(adam_file) if adam_file is not None and adam_file != path else {}
        optim: dict[str, dict] = {}
        for key, value in flat.items():
            name, _, what = key.rpartition(".")
            optim.setdefault(name, {})[what] = value
        return model, optim
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise _error(path, f"holds a {type(state).__name__}, not a state dict")
    return _from_dict(state, names)


def read_outside(path: str | Path, model_cfg: DictConfig, with_optimizer: bool) -> Outside:
    """The weights (and Adam's state when with_optimizer) at path, checked against model_cfg's model."""
    path = Path(path)
    kind = detect(path)
    model = reference_model(model_cfg)
    names = [n for n, _ in model.named_parameters()]
    try:
        params, optim = _read(path, kind, model_cfg, names)
    except CheckpointError as exc:
        raise _error(path, f"cannot be read as a {kind} checkpoint ({str(exc).split(';')[0]})") from None
    except Exception as exc:  # unpickling and format errors come in many types; one line each
        raise _error(path, f"is not a readable {kind} checkpoint ({_one_line(exc)})") from None
    known = set(model.state_dict())
    params = {k: v for k, v in _rename(params, known).items() if k in known}
    optim = _rename(optim, known)
    try:
        _check_shapes(path, model, params, optim)
    except CheckpointError as exc:
        reason = str(exc).split(";")[0].replace(f"checkpoint '{path}' ", "")
        raise _error(path, f"does not fit model={model_cfg.name}: it {reason}") from None
    if with_optimizer and set(optim) != set(names):
        raise CheckpointError(
            f"trainer.init_optimizer=true but trainer.init_from={path} holds no Adam state for every "
            f"parameter ({len(optim)} of {len(names)}); drop trainer.init_optimizer to start Adam afresh"
        )
    model_state = {k: v.float() if v.is_floating_point() else v for k, v in params.items()}
    return Outside(model_state, optim if with_optimizer else {}, kind)
