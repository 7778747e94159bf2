"""Memoized meta kernels for the planner's meta passes (``MetaMemo``).

Many of aten's meta kernels are Python (torch._refs / torch._decomp, through torch._prims): GroupNorm's
forward and backward cost ~3 and ~9 ms a call on this machine's CPU, ReLU's and its backward ~1 ms;
a recommendation of resnet18 at world 8 makes hundreds of meta passes over the same few shapes
(every candidate's stages, micro-batches and saved-bytes counts). A meta kernel's outputs are a
function of its arguments' metadata alone (shapes, strides, dtypes: there is no data), so each
distinct call is computed once and its outputs' layout replayed after: the same shapes, strides,
dtypes and storages (sizes, and which outputs share one), so what the planner counts (FLOPs, bytes
moved, saved storages) is unchanged. Only functional operators on plain meta tensors are
memoized (no view, no in-place or out= variant, no output sharing an input's storage, no factory
without a tensor input: its dtype may be the global default); everything else runs.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# One output's layout: (shape, stride, storage offset, dtype, storage index, storage bytes), or
# None for an output that is None (a backward's unrequested gradient).
Layout = tuple | None


PLAIN = (torch.Tensor, torch.nn.Parameter)  # a subclass (DTensor, FakeTensor) dispatches its own way


def _key_of(value, tensors: list):
    """A hashable stand-in for one argument: a meta tensor by its metadata (and added to
    ``tensors``), sequences element-wise; TypeError for anything not memoizable (another device, a
    tensor subclass, a Generator)."""
    if isinstance(value, torch.Tensor):
        if type(value) not in PLAIN or value.device.type != "meta":
            raise TypeError("not a plain meta tensor")
        tensors.append(value)
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_key_of(v, tensors) for v in value))
    hash(value)  # TypeError: not memoizable (a Generator, ...)
    return value


def _functional(func) -> bool:
    """No argument or return aliased (views, in-place and out= variants write or share storage)."""
    schema = func._schema
    return not any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))


def _layouts(out, inputs: set[int]) -> tuple[list[Layout], type | None] | None:
    """Each output's layout, and the result's container (tuple, list; None: one tensor); None where
    an output is not a plain tensor or shares an input's storage (not memoized)."""
    single = isinstance(out, torch.Tensor)
    storages: dict[int, int] = {}
    layouts: list[Layout] = []
    for t in (out,) if single else out:
        if t is None:
            layouts.append(None)
            continue
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor:
            return None
        storage = t.untyped_storage()
        if storage._cdata in inputs:
            return None
        index = storages.setdefault(storage._cdata, len(storages))
        layouts.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, index, storage.nbytes()))
    return layouts, None if single else type(out)


def _replay(layouts: list[Layout], container: type | None):
    """Fresh meta tensors laid out as recorded: one storage per recorded storage, of its size."""
    storages: dict[int, torch.Tensor] = {}
    outs = []
    for layout in layouts:
        if layout is None:
            outs.append(None)
            continue
        shape, stride, offset, dtype, index, nbytes = layout
        if index not in storages:
            storages[index] = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        outs.append(storages[index].view(dtype).as_strided(shape, stride, offset))
    return outs[0] if container is None else container(outs)


class PlanMode(TorchDispatchMode):
    """The planner's dispatch modes (the census, this memo, the saved-bytes counts): meta passes that
    never run under ``torch.compile``. torch wraps a mode's ``__torch_dispatch__`` in
    ``torch._dynamo.disable`` unless ``_should_skip_dynamo`` says False (its documented opt-out):
    wrapped, the first operator imports TorchDynamo and every one after pays its frame switch
    (~10,000 a recommendation). Inside one, the meta kernels' own ``torch._disable_dynamo``
    wrappers call their function directly (``_DynamoFree``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __enter__(self):
        _DYNAMO_FREE.enter()
        try:
            return super().__enter__()
        except BaseException:
            _DYNAMO_FREE.exit()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _DYNAMO_FREE.exit()


class _DynamoFree:
    """The meta kernels' ``torch._disable_dynamo`` wrappers (every elementwise reference of
    ``torch._refs``: ReLU's meta kernel is one) calling their function directly while a planner mode
    is open: a wrapper's first call imports TorchDynamo to build ``torch._dynamo.disable(fn)``
    (2.2 s of CPU on the 2-core CPU, a cold recommendation's largest import after torch itself), a
    wrapper that only matters while ``torch.compile`` traces, which no meta pass of the planner
    does. The wrapper reuses what ``fn.__dynamo_disable`` holds; set here to ``fn`` itself on the
    outermost enter, for the wrappers that have none yet, and removed on the last exit, so a later
    ``torch.compile`` in the same process finds torch's own."""

    def __init__(self) -> None:
        self._depth = 0
        self._targets: list | None = None  # the wrapped functions, found once
        self._set: list = []

    def enter(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self._set = [fn for fn in self._wrapped() if "__dynamo_disable" not in fn.__dict__]
            for fn in self._set:  # setattr: a name with two underscores is mangled inside a class
                setattr(fn, "__dynamo_disable", fn)

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            for fn in self._set:
                fn.__dict__.pop("__dynamo_disable", None)
            self._set = []

    def _wrapped(self) -> list:
        if self._targets is None:
            self._targets = _disable_dynamo_targets()
        return self._targets


def _disable_dynamo_targets() -> list:
    """Every function a ``torch._disable_dynamo`` wrapper holds that the meta kernels can reach:
    from the decomposition tables (what the dispatcher calls) and torch._refs' modules (what the
    references call by name, e.g. LayerNorm's rsqrt), through each function's ``__wrapped__`` and
    its closure (a reference's wrappers, not all of which name what they wrap)."""
    import sys
    import types

    from torch._decomp import global_decomposition_table

    inner = torch._disable_dynamo(lambda: None).__code__
    stack = [f for table in global_decomposition_table.values() for f in table.values()]
    for name, module in list(sys.modules.items()):
        if name.startswith(("torch._refs", "torch._prims", "torch._decomp")) and module is not None:
            stack += list(vars(module).values())
    seen: set[int] = set()
    found: dict[int, object] = {}
    while stack:
        f = stack.pop()
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            continue
        seen.add(id(f))
        cells = {n: c for n, c in zip(f.__code__.co_freevars, f.__closure__ or ())}
        if f.__code__ is inner:
            found[id(cells["fn"].cell_contents)] = cells["fn"].cell_contents
        stack.append(getattr(f, "__wrapped__", None))
        for cell in cells.values():
            try:
                stack.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    return list(found.values())


_DYNAMO_FREE = _DynamoFree()


class MetaMemo(PlanMode):
    """``with MetaMemo():`` every functional operator on meta tensors computed once per distinct
    argument metadata (module docstring); enter it once around many meta passes."""

    def __init__(self) -> None:
        super().__init__()
        self._memo: dict[tuple, tuple[list[Layout], type | None] | None] = {}
        self._functional: dict[object, bool] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._functional.setdefault(func, _functional(func)):
            return func(*args, **kwargs)
        tensors: list[torch.Tensor] = []
        try:
            key = (func, _key_of(args, tensors), _key_of(tuple(sorted(kwargs.items())), tensors))
            if not tensors:
                raise TypeError("a factory")
        except TypeError:
            return func(*args, **kwargs)
        if key in self._memo:
            recorded = self._memo[key]
            if recorded is not None:
                return _replay(*recorded)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage()._cdata for t in tensors}
        self._memo[key] = _layouts(out, inputs) if isinstance(out, (torch.Tensor, tuple, list)) else None
        return out
