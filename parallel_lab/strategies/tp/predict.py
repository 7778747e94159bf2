"""What ``tp`` will hold and send, from the model's shapes alone (``parallel_lab.plan``).

The manual split (``layers.py``) keeps, on tp rank r, ``torch.chunk``'s r-th slice of a
column-parallel layer's weight and bias (dim 0) and of a row-parallel layer's weight (dim 1); the
row layer's bias and every other layer stay whole. torch's optimizer then holds its state for
exactly those tensors (Adam: two moments and a 4-byte step tensor each).

Communication per step (counter units: an all-reduce of B bytes counts 2B), batch b = the
per-step micro-batch (every tp rank sees the whole batch):
- a column layer's ``f`` all-reduces the gradient of its (whole) input in backward, unless that
  input is the data (no gradient flows there);
- a row layer's ``g`` all-reduces its output in forward; a row layer fed by replicated
  features (no column layer before it) also runs ``f`` on its whole input.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from parallel_lab.models.flops import layer_flops
from parallel_lab.strategies.memory import chunk_rows, predicted_optimizer_bytes


def _sharded_numels(model: torch.nn.Module, plan, tp: int, rank: int, rows_split: tuple = ()) -> list[int]:
    """Element count of every parameter rank holds after the split, model order. rows_split: more
    layers split along dim 0 as a column layer is (the gpt's vocabulary layers, tp/vocab.py)."""
    column = {c for c, _ in plan if c} | set(rows_split)
    row = {r for _, r in plan}
    numels = []
    for name, p in model.named_parameters():
        layer, _, kind = name.rpartition(".")
        if layer in column:
            held, _ = chunk_rows(p.shape[0], tp, rank)
            numels.append(p.numel() // p.shape[0] * held)
        elif layer in row and kind == "weight":
            held, _ = chunk_rows(p.shape[1], tp, rank)
            numels.append(p.numel() // p.shape[1] * held)
        else:
            numels.append(p.numel())
    return numels


def predict_tp_memory(
    cfg: DictConfig, model: torch.nn.Module, plan, rank: int, rows_split: tuple = ()
) -> dict[str, int]:
    """strategy.ep: the other ranks' experts left out (strategies/ep/); rows_split: ``_sharded_numels``'."""
    from parallel_lab.strategies.ep.groups import ep_rank
    from parallel_lab.strategies.ep.rules import other_experts
    from parallel_lab.strategies.mesh import MeshDims

    s = cfg.strategy  # tp/rules.py tp_dims's layout (that module imports this one)
    dims = MeshDims(replicate=s.replicate, tp=s.tp, ep=s.get("ep", 1), named=("tp",))
    others = other_experts(model, dims.ep, ep_rank(dims, rank)) if dims.ep > 1 else set()
    sharded = _sharded_numels(model, plan, cfg.strategy.tp, rank % cfg.strategy.tp, rows_split)
    numels = [n for n, p in zip(sharded, model.parameters()) if id(p) not in others]
    return {
        "param_bytes": 4 * sum(numels),
        "grad_bytes": 4 * sum(numels),
        "optim_bytes": predicted_optimizer_bytes(numels, cfg.trainer, step_counters=True),
    }


def _io_shapes(model: torch.nn.Module, names: set[str], batch: int) -> dict[str, tuple]:
    """Input and output shapes of the named layers for one batch (meta device forward)."""
    shapes: dict[str, tuple] = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda mod, args, out, n=n: shapes.__setitem__(n, (args[0].shape, out.shape))
        )
        for n in names
    ]
    try:
        with torch.no_grad():
            model(torch.empty(batch, 3, 32, 32, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return shapes


def activation_elem(cfg: DictConfig) -> int:
    """Bytes per element of what the tp collectives carry: the activations and their gradients,
    bf16 under strategy.precision=bf16 (the forward runs on bf16 copies, Megatron's bf16), else fp32.
    Gradients of the weights stay fp32 (the master copy's .grad)."""
    return 2 if cfg.strategy.get("precision") == "bf16" else 4


def predict_tp_comm(cfg: DictConfig, model: torch.nn.Module, plan) -> dict[str, float]:
    if cfg.world_size < 2:
        return {}
    if cfg.strategy.tp < 2:
        return {"all_reduce": 2.0 * 4 * sum(p.numel() for p in model.parameters())}  # plain data parallel
    batch = cfg.trainer.global_batch // cfg.trainer.grad_accum // (cfg.strategy.get("replicate") or 1)
    names = {n for pair in plan for n in pair if n}
    shapes = _io_shapes(model, names, batch)
    first = next(n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False)))
    elems = 0
    for column, row in plan:
        if column is not None and column != first:
            elems += shapes[column][0].numel()  # f: backward all-reduce of the input's gradient
        if column is None:
            elems += shapes[row][0].numel()  # f on the replicated input of a lone row layer
        elems += shapes[row][1].numel()  # g: forward all-reduce of the partial sums
    comm = {"all_reduce": 2.0 * activation_elem(cfg) * elems * cfg.trainer.grad_accum}
    if (cfg.strategy.get("replicate") or 1) > 1:  # dp x tp: each shard's gradients all-reduced over replicas
        comm["all_reduce"] += 2.0 * 4 * sum(_sharded_numels(model, plan, cfg.strategy.tp, 0))
    return comm


def tp_share(model: nn.Module, split_layers: list[str], degree: int) -> float:
    """A tp rank's share of the model's FLOPs: the split layers divided by the degree."""
    flops = layer_flops(model, 1)
    split = sum(f for name, f in flops.items() if name in split_layers)
    return (sum(flops.values()) - split + split / degree) / sum(flops.values())


# ----- the vit's Megatron split (tp/megatron.py) -----
def split_meta_vit(cfg: DictConfig, model: nn.Module, rank: int) -> nn.Module:
    """A meta copy of the vit split as tp rank ``rank % tp`` splits it (the manual split; on the
    meta device its collectives only shape their outputs): the planner counts what it saves.
    Under SP dtensor's split saves the column layers' gathered input and normalises all tokens in
    its head, the manual one the input's shard and its own tokens: dtensor_layout."""
    import copy

    from parallel_lab.strategies.tp.megatron import TPGroup, split_transformer_manual

    tp, sp = cfg.strategy.tp, bool(cfg.strategy.get("sequence_parallel"))
    split = copy.deepcopy(model)
    dtensor = cfg.strategy.get("impl", "dtensor") == "dtensor"  # fsdp's 2-D layout splits with DTensor
    split_transformer_manual(split, TPGroup(None, rank % tp, tp), sp, dtensor_layout=dtensor)
    return split


def block_collectives(sequence_parallel: bool, impl: str, recompute: str, dropout: float = 0.0) -> dict[str, int]:
    """Collectives of (batch, tokens, dim) one split vit block issues per micro-batch, by kind:
    Megatron's 2 all-reduces forward (g) and 2 backward (f); under SP each is an all-gather and a
    reduce-scatter, and the manual split's column layers gather their input's shard again in
    backward (``comm.sequence_parallel_columns``: 2 more all-gathers; DTensor keeps the gathered
    input instead). selective recompute reruns the attention core alone, which communicates
    nothing. trainer.recompute=full reruns the block's forward in backward, and with it the
    forward's collectives, up to the last op that saves a tensor: torch's non-reentrant checkpoint
    stops there (its early stop). The MLP's g (fc2's all-reduce or reduce-scatter) is followed by
    a saving op only when dropout is on (drop2 keeps its mask), so without dropout the recompute
    repeats 1 all-reduce (SP: 2 all-gathers and 1 reduce-scatter), with dropout all 2 (2 and 2)."""
    full = recompute == "full"
    again = (1 + (dropout > 0)) * full  # the attention's g always, the MLP's only with dropout
    if not sequence_parallel:
        return {"all_reduce": 4 + again}
    # each sublayer's entry saves its shard, so both entries' all-gathers are always rerun
    return {"all_gather": 4 + 2 * (impl == "manual") + 2 * full, "reduce_scatter": 4 + again}


def vit_comm_formula(
    batch: int,
    tokens: int,
    dim: int,
    depth: int,
    sequence_parallel: bool,
    impl: str,
    elem: int = 4,
    recompute: str = "none",
    dropout: float = 0.0,
) -> dict[str, float]:
    """Bytes per micro-batch one tp rank issues (comm/counter.py's units: an all-reduce of B bytes
    counts 2B; an all-gather its output, a reduce-scatter its input), tp > 1: ``block_collectives``
    per block, each of one (batch, tokens, dim) activation of ``elem`` bytes per element; under SP
    also the embedding's output gradient all-gathered backward, and the head's pool all-reduced
    forward (manual: the (batch, dim) token sums) or its input all-gathered forward (dtensor)."""
    act = batch * tokens * dim * elem  # one (batch, tokens, dim) activation
    per_block = block_collectives(sequence_parallel, impl, recompute, dropout)
    if not sequence_parallel:
        return {"all_reduce": depth * per_block["all_reduce"] * 2.0 * act}  # an all-reduce counts 2B
    gather, scatter = (
        ("all_gather_single", "reduce_scatter_single")
        if impl == "manual"
        else ("all_gather_into_tensor", "reduce_scatter_tensor")
    )
    comm = {
        gather: depth * per_block["all_gather"] * act + act,  # + embed's backward gather
        scatter: depth * per_block["reduce_scatter"] * float(act),
    }
    if impl == "manual":
        comm["all_reduce"] = 2.0 * batch * dim * elem  # the head's pool
    else:
        comm[gather] += act  # the head's input gathered
    return comm


def recompute_mode(cfg: DictConfig) -> str:
    """trainer.recompute as a plain string (a Choice in a typed config, a string in config.yaml)."""
    mode = cfg.trainer.get("recompute") or "none"
    return getattr(mode, "value", mode)


def sequence_parallel_grad_numel(dim: int, depth: int, impl: str) -> int:
    """Elements of the weights whose gradient is a sum over the tp ranks under SP, all-reduced once
    per step: per block 2 LayerNorms (weight, bias); manual also the 2 row layers' biases (added to
    this rank's tokens) and the head's LayerNorm (on its tokens). DTensor computes the row biases'
    gradients from the all-gathered gradient, and its head sees every token."""
    return depth * 6 * dim + 2 * dim if impl == "manual" else depth * 4 * dim


def predict_vit_comm(cfg: DictConfig, model: nn.Module) -> dict[str, float]:
    """Per step: ``vit_comm_formula`` per micro-batch, the SP weights' gradient sums once per step
    and, with replicas, the data-parallel gradient average."""
    from parallel_lab.models import vit_sizes
    from parallel_lab.models.vit import IMAGE
    from parallel_lab.strategies.tp.megatron import blocks

    s, tp, accum = cfg.strategy, cfg.strategy.tp, cfg.trainer.grad_accum
    if cfg.world_size < 2:
        return {}
    replicate = s.get("replicate") or 1
    if tp < 2:
        return {"all_reduce": 2.0 * 4 * sum(p.numel() for p in model.parameters())}
    from parallel_lab.strategies.tp.megatron import dense_mlp

    depth, dim = len(blocks(model)), model.embed.pos.shape[-1]
    moe_blocks = sum(not dense_mlp(model, b) for b in blocks(model))
    sizes = vit_sizes(cfg.model)
    tokens = (IMAGE // sizes["patch"]) ** 2
    batch = cfg.trainer.global_batch // accum // replicate
    sp = bool(s.get("sequence_parallel"))
    # An MoE block's MLP is not split: its attention's 2 of the block's 4 all-reduces (ep refuses SP)
    formula = vit_comm_formula(
        batch,
        tokens,
        dim,
        depth - moe_blocks / 2,
        sp,
        s.impl,
        activation_elem(cfg),
        recompute_mode(cfg),
        sizes["dropout"],
    )
    comm = {op: n * accum for op, n in formula.items()}
    if sp:
        comm["all_reduce"] = comm.get("all_reduce", 0.0) + 2.0 * 4 * sequence_parallel_grad_numel(dim, depth, s.impl)
    if replicate > 1:
        from parallel_lab.strategies.ep.rules import balanced_comm, expert_ids
        from parallel_lab.strategies.tp.megatron import vit_plan

        experts = expert_ids(model) if s.get("ep", 1) > 1 else set()  # reduced over their own replicas
        sharded = _sharded_numels(model, vit_plan(model), tp, 0)
        dense = sum(n for n, p in zip(sharded, model.parameters()) if id(p) not in experts)
        comm["all_reduce"] = comm.get("all_reduce", 0.0) + 2.0 * 4 * dense
        comm.update(balanced_comm(cfg, model, batch))
    return comm
