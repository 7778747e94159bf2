"""The building blocks of the full state (``full_state.py``): tensors described without reading
them (``TensorMeta``), mappings that read one tensor when asked (``LazyState``), and the one-line
refusal of a file that is not what it claims. Everything is read with ``torch.load(weights_only=True)``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from parallel_lab.checkpoint.manifest import CheckpointError

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")
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


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint '{path}' {what}; point trainer.resume at a checkpoint this toolkit wrote")


def _load(file: Path, mmap: bool = False) -> dict:
    """torch.load of one of our files (tensors and plain values only); a file that is not what it
    claims is a one-line CheckpointError. mmap=True maps the tensors' bytes without reading them."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # unpickling errors come in many types; each is one line
        raise _bad(file.parent, f"has an unreadable {file.name} ({type(exc).__name__})") from None


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
