"""``tp``'s options (``TPOptions``) and parent-side rules (``TPPlan``): what it splits of each model,
the options it refuses, the (replicate, tp) mesh it lays out, and what the planner predicts
(``predict.py``). Torch-free at import: the parent reads it before any process starts
(strategies/planning.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from parallel_lab.choices import Choice, Precision
from parallel_lab.errors import ConfigError
from parallel_lab.strategies.cp.rules import ContextOptions, check_context, context_flop_share
from parallel_lab.strategies.ep.rules import check_ep, expert_parallel_meta
from parallel_lab.strategies.mesh import MeshDims, check_degrees
from parallel_lab.strategies.options import StrategyOptions
from parallel_lab.strategies.planning import SAMPLE_SHAPE, ClusterLayout, ComputeShape, PlanRules, SavedBytes
from parallel_lab.strategies.registry import register_rules
from parallel_lab.strategies.tp.cp_rules import check_tp_context
from parallel_lab.strategies.tp.plans import block_plan

if TYPE_CHECKING:
    from torch import nn

# (column-parallel layer, row-parallel layer) pairs; None = the row layer's input is replicated.
# vit, gpt: Megatron's per-block split, built from the model's blocks (plans.py ``block_plan``); the gpt's
# vocabulary layers too (tp/vocab.py ``vocab_layers``).
TP_PLANS: dict[str, list[tuple[str | None, str]]] = {
    "cnn": [("fc1", "fc2")],
    "resnet18": [(None, "fc")],
    "vit": [],
    "gpt": [],
}
BLOCK_SPLIT = ("vit", "gpt")  # the models split block by block (tp/megatron.py)
CONV_PLANS: dict[str, list[tuple[str | None, str]]] = {
    "cnn": [("block1.0", "block2.0")],
}


def split_plan(model_name: str, split_conv: bool, model: nn.Module) -> list[tuple[str | None, str]]:
    """(column, row) pairs of ``model`` (the vit's and the gpt's come from their blocks)."""
    if model_name in BLOCK_SPLIT:
        from parallel_lab.strategies.tp.megatron import vit_plan

        return vit_plan(model)
    return (CONV_PLANS.get(model_name, []) if split_conv else []) + TP_PLANS[model_name]


def config_split_plan(model: DictConfig, split_conv: bool) -> list[tuple[str | None, str]]:
    """``split_plan`` from ``model.*`` alone (torch-free, models/layout.py): the same pairs."""
    from parallel_lab.models.layout import children, weight_shapes

    if model.name not in BLOCK_SPLIT:
        return (CONV_PLANS.get(model.name, []) if split_conv else []) + TP_PLANS[model.name]
    shapes = weight_shapes(model)
    blocks = [name for name, _ in children(model) if name.startswith("block")]
    return block_plan(blocks, shapes.__contains__)


def split_widths(model: DictConfig, split_conv: bool) -> list[tuple[str, int, str]]:
    """(layer, width, which width) for every dimension ``config_split_plan`` splits: a column
    layer's output features/channels, a row layer's input ones (models/layout.py)."""
    from parallel_lab.models.layout import weight_shapes

    shapes, widths = weight_shapes(model), []
    for column, row in config_split_plan(model, split_conv):
        if column is not None:
            widths.append((column, shapes[column][0], "output features/channels"))
        widths.append((row, shapes[row][1], "input features/channels"))
    return widths


def tp_dims(opts: DictConfig) -> MeshDims:
    """strategy.replicate copies of strategy.cp context-parallel groups (the gpt, tp/cp_rules.py) of
    a tp group of strategy.tp consecutive ranks; the tp group is laid out even at tp=1 (f and g talk
    over it, never over the world)."""
    return MeshDims(replicate=opts.replicate, cp=opts.get("cp", 1), tp=opts.tp, ep=opts.get("ep", 1), named=("tp",))


def check_vit_split(cfg: DictConfig, tp: int, sequence_parallel: bool, impl: str) -> None:
    """Megatron's split needs whole heads and hidden features per rank; sequence parallelism whole
    tokens; DTensor's SP regions would hand DTensors to the per-sample dropout (also fsdp's 2-D)."""
    from parallel_lab.models import IMAGE, vit_sizes
    from parallel_lab.models.layout import vit_widths

    sizes = vit_sizes(cfg.model)
    if sizes["heads"] % tp:
        raise ConfigError(
            f"strategy.tp={tp} does not divide model.heads={sizes['heads']} (each rank holds whole heads); "
            f"use a strategy.tp that divides {sizes['heads']}"
        )
    hidden = vit_widths(sizes["dim"], sizes["heads"], float(cfg.model.get("width", 1.0)), sizes["mlp_ratio"])[1]
    if hidden % tp:
        raise ConfigError(
            f"strategy.tp={tp} does not divide the {hidden} output features of mlp.fc1 (the MLP's hidden width); "
            f"use a strategy.tp that divides {hidden}"
        )
    tokens = (IMAGE // sizes["patch"]) ** 2
    if sequence_parallel and tokens % tp:
        raise ConfigError(
            f"strategy.tp={tp} does not divide the {tokens} tokens of model.patch={sizes['patch']} "
            f"(strategy.sequence_parallel=true); use a strategy.tp that divides {tokens}"
        )
    if sequence_parallel and impl == "dtensor" and sizes["dropout"] > 0:
        raise ConfigError(
            f"model.dropout={sizes['dropout']} with strategy.impl=dtensor strategy.sequence_parallel=true: "
            "the per-sample dropout after attn.proj/mlp.fc2 would get a DTensor; use strategy.impl=manual"
        )


class TensorImpl(Choice):
    """strategy.impl of tp: whose layers split the weights."""

    manual = "manual"
    dtensor = "dtensor"
    deepspeed = "deepspeed"  # DeepSpeed's AutoTP training (tp/ds_autotp.py)


@dataclass
class TPOptions(ContextOptions, StrategyOptions):
    """``strategy=tp`` options (with ``strategy.cp``/``cp_impl`` on the gpt: context parallelism
    inside the vocab-parallel split, tp/cp_rules.py)."""

    tp: int = 2  # tensor-parallel degree: must divide every split width; replicate x tp = world_size
    replicate: int = 1  # data-parallel copies of the tp group (dp x tp on a 2-D mesh); 1 = tp only
    # manual (our f/g autograd.Functions) | dtensor (torch.distributed.tensor.parallel) | deepspeed (AutoTP)
    impl: TensorImpl = TensorImpl.manual
    split_conv: bool = False  # cnn + manual only: also split block1's conv output / block2's input channels
    # vit and gpt, tp > 1 (Korthikanti et al., arXiv 2205.05198): LayerNorm/residual/dropout regions hold
    # tokens/tp of the tokens; each all-reduce becomes an all-gather + a reduce-scatter (tp/megatron.py)
    sequence_parallel: bool = False
    # Expert parallelism (model.moe_experts > 0, impl=manual, no SP): the MoE MLPs stay whole on
    # every tp rank, their experts sharded over ep of the replicas (strategies/ep/); replicate=1
    # then becomes world_size / tp (ep needs replicas). 1 = none.
    ep: int = 1
    # fp32 | bf16 (manual impl): as Megatron trains, bf16 weights and activations in forward and
    # backward (every tp collective carries bf16), fp32 master weights, gradients and Adam state: the
    # forward runs on a bf16 copy of this rank's fp32 shards (strategies/precision.py)
    precision: Precision = Precision.fp32


@register_rules("tp")
class TPPlan(PlanRules):
    Options = TPOptions
    degree_key = "tp"
    weight_copies = True  # strategy.precision=bf16: Bf16Compute on the rank's shards

    @classmethod
    def cluster_layout(cls, cfg: DictConfig) -> ClusterLayout:
        """Megatron's split (arXiv 1909.08053), optionally sequence-parallel (arXiv 2205.05198)."""
        layout = super().cluster_layout(cfg)
        return dataclasses.replace(layout, sequence_parallel=bool(cfg.strategy.get("sequence_parallel", False)))

    @classmethod
    def norm_refusal(cls, cfg: DictConfig) -> str | None:
        """Every tp rank runs the whole batch through the replicated BatchNorm layers, so plain
        BatchNorm already matches single; syncing over strategy.replicate copies is not built here.
        A BatchNorm after block1's split conv would see a slice of its channels."""
        from parallel_lab.models import norm_of

        norm = norm_of(cfg.model)
        if norm == "syncbatch":
            return (
                "model.norm=syncbatch: strategy=tp ranks all normalise the same whole batch (model.norm=batch "
                "already matches single); SyncBatchNorm over strategy.replicate is not built, use model.norm=batch"
            )
        if norm == "batch" and cfg.strategy.get("split_conv"):
            return (
                "model.norm=batch with strategy.split_conv=true: block1's BatchNorm would see a slice of its "
                "channels; set strategy.split_conv=false"
            )
        return None

    @classmethod
    def dims(cls, cfg: DictConfig) -> MeshDims:
        return tp_dims(cfg.strategy)

    @classmethod
    def data_parallel_size(cls, cfg: DictConfig) -> int:
        """Every tp rank sees its replica's whole batch, the cp ranks the same samples (=
        strategy.replicate once the degrees check; the planner asks before setting them)."""
        return cfg.world_size // cfg.strategy.tp // (cfg.strategy.get("cp") or 1)

    @classmethod
    def check_options(cls, opts: DictConfig, cfg: DictConfig) -> None:
        if opts.tp < 1:
            raise ConfigError(f"strategy.tp={opts.tp} must be >= 1; use strategy.tp=2")
        check_tp_context(opts, cfg)  # strategy.cp: the gpt's manual split only
        if opts.precision == "bf16" and opts.get("ep", 1) > 1:
            raise ConfigError(
                f"strategy.precision=bf16 with strategy=tp strategy.ep={opts.ep}: the experts' all-to-all is "
                "planned in fp32 only; use strategy.precision=fp32 or strategy.ep=1"
            )
        if opts.precision == "bf16" and opts.impl != "manual":
            raise ConfigError(
                f"strategy.precision=bf16 with strategy=tp strategy.impl={opts.impl}: bf16 runs on the manual "
                "split's shards; use strategy.impl=manual"
            )
        if opts.impl == "deepspeed":  # AutoTP's own layer specs and refusals (tp/ds_autotp.py)
            from parallel_lab.strategies.tp.ds_rules import check_deepspeed_tp

            return check_deepspeed_tp(opts, cfg)
        model_name = cfg.model.name
        if model_name not in TP_PLANS:
            raise ConfigError(
                f"strategy=tp has no split plan for model={model_name}; use model={' or model='.join(TP_PLANS)}"
            )
        if opts.split_conv and model_name not in CONV_PLANS:
            raise ConfigError(
                f"strategy.split_conv=true is only defined for model={', '.join(CONV_PLANS)}; "
                f"set strategy.split_conv=false"
            )
        if opts.split_conv and opts.impl != "manual":
            raise ConfigError(
                "strategy.split_conv=true needs strategy.impl=manual "
                "(ColwiseParallel/RowwiseParallel split nn.Linear only)"
            )
        if opts.ep > 1 and opts.replicate == 1 and opts.tp > 0 and cfg.world_size % opts.tp == 0:
            # ep spans data-parallel ranks: at the default replicate=1 the replicas fill the world
            opts.replicate = cfg.world_size // opts.tp
        degrees = {"cp": ("cp", "context-parallel ranks")} if opts.cp != 1 else {}
        check_degrees(cfg, tp_dims(opts), {**degrees, "tp": ("tp", "tensor-parallel degree")})  # before the model
        if opts.ep != 1 and (opts.impl != "manual" or opts.sequence_parallel):
            raise ConfigError(
                f"strategy.ep={opts.ep} runs with strategy.impl=manual without sequence parallelism (each tp rank "
                "then routes the same tokens); use those, or strategy.ep=1"
            )
        check_ep(cfg, tp_dims(opts))
        if model_name == "gpt":
            from parallel_lab.strategies.tp.gpt_rules import check_gpt_split

            check_gpt_split(cfg, opts)
        if opts.cp != 1:  # the sequence's chunks, Ulysses' heads of a tp rank (tp divides them by now)
            check_context(opts, cfg)
        if model_name == "vit" or opts.sequence_parallel and model_name != "gpt":
            cls._check_vit(opts, cfg)
        for name, width, what in cls._split_widths(cfg, opts):
            if width % opts.tp:
                raise ConfigError(
                    f"strategy.tp={opts.tp} does not divide the {width} {what} of {name}; "
                    f"use a strategy.tp that divides {width} (e.g. strategy.tp=2)"
                )

    @classmethod
    def _check_vit(cls, opts: DictConfig, cfg: DictConfig) -> None:
        if opts.sequence_parallel and cfg.model.name != "vit":
            raise ConfigError(
                f"strategy.sequence_parallel=true shards the vit's tokens, model={cfg.model.name} has none; "
                "use model=vit or strategy.sequence_parallel=false"
            )
        if opts.sequence_parallel and opts.tp < 2:
            raise ConfigError(
                f"strategy.sequence_parallel=true needs strategy.tp > 1 (got strategy.tp={opts.tp}); "
                "use strategy.tp=2 or strategy.sequence_parallel=false"
            )
        check_vit_split(cfg, opts.tp, opts.sequence_parallel, opts.impl)

    @classmethod
    def _split_widths(cls, cfg: DictConfig, opts: DictConfig) -> list[tuple[str, int, str]]:
        """(layer, width, which width) for every dimension the plan splits, from model.* alone
        (models/layout.py: torch-free, the meta model's shapes)."""
        if cfg.model.name == "gpt":  # its split widths are checked in model.* terms (gpt_rules.py)
            return []
        return split_widths(cfg.model, opts.split_conv)

    @classmethod
    def compute_shape(cls, cfg: DictConfig, model: nn.Module) -> ComputeShape:
        """A tp rank runs its replica's whole batch through the model, the split layers' FLOPs / tp."""
        from parallel_lab.strategies.tp.predict import tp_share

        if cfg.strategy.impl == "deepspeed":
            return super().compute_shape(cfg, model)
        plan = split_plan(cfg.model.name, cfg.strategy.split_conv, model)
        split = [layer for pair in plan for layer in pair if layer]
        calls = None
        if cfg.model.name == "gpt":  # the blocks as the vit's, and the head over V/tp of the vocabulary
            from parallel_lab.strategies.tp.gpt_predict import gpt_collective_calls, gpt_split_layers

            split, calls = gpt_split_layers(model), gpt_collective_calls(cfg, model)
        elif cfg.model.name == "vit":  # each rank's attention core runs on its heads only
            from parallel_lab.strategies.tp.megatron import blocks

            split += [f"{b}.attn.core" for b in blocks(model)]
            calls = 4 * len(blocks(model)) * cfg.trainer.grad_accum  # 2 per block each way (SP: of each kind)
        share = tp_share(model, split, cfg.strategy.tp)
        note = f"tp rank does {share:.2f} of the FLOPs on the whole batch"
        if (cfg.strategy.get("cp") or 1) > 1:  # the gpt's: on its seq/cp tokens (cp/rules.py)
            share = context_flop_share(cfg, model, tuple(split), cfg.strategy.tp)
            note = f"a cp x tp rank does {share:.2f} of the FLOPs"
        shape = super().compute_shape(cfg, model)
        return ComputeShape(shape.micro_batch, shape.slots, share, calls, note)

    @classmethod
    def predict_memory(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, int]:
        """This rank's slices of the split layers plus everything replicated (``predict.py``)."""
        from parallel_lab.strategies.tp.predict import predict_tp_memory

        if cfg.strategy.impl == "deepspeed":
            from parallel_lab.strategies.tp.ds_rules import predict_autotp_memory

            return predict_autotp_memory(cfg, model, rank)
        if cfg.model.name == "gpt":
            from parallel_lab.strategies.tp.gpt_predict import predict_gpt_memory

            return predict_gpt_memory(cfg, model, rank)
        return predict_tp_memory(cfg, model, split_plan(cfg.model.name, cfg.strategy.split_conv, model), rank)

    @classmethod
    def activation_bytes(
        cls, cfg: DictConfig, model: nn.Module, rank: int, micro: int, saved: SavedBytes
    ) -> tuple[int, int]:
        """vit: what this rank's split model saves, counted on a meta copy split as the run splits
        it (heads/t, hidden/t; under SP the token regions /t); other models: the whole model's.
        Under strategy.ep: the rank's E / ep experts behind the exchanges (ep/rules.py
        expert_parallel_meta), every expert equally loaded, the MoE MLP whole on every tp rank."""
        if cfg.model.name == "gpt" and cfg.strategy.impl == "manual":  # with its vocab-parallel loss
            from parallel_lab.models import input_shape
            from parallel_lab.strategies.tp.gpt_predict import split_meta_gpt

            return saved(split_meta_gpt(cfg, model, rank), micro, input_shape(model), False), micro
        model = expert_parallel_meta(model, cls.dims(cfg), rank)  # ep: the rank's experts behind the exchanges
        if cfg.model.name != "vit" or cfg.strategy.tp < 2:
            return super().activation_bytes(cfg, model, rank, micro, saved)
        from parallel_lab.strategies.tp.predict import split_meta_vit

        return saved(split_meta_vit(cfg, model, rank), micro, SAMPLE_SHAPE, True), micro

    @classmethod
    def predict_comm(cls, cfg: DictConfig, model: nn.Module, rank: int) -> dict[str, float]:
        from parallel_lab.strategies.tp.predict import predict_tp_comm

        if cfg.strategy.impl == "deepspeed":
            return None  # AutoTP's collectives are not predicted here
        if cfg.model.name == "gpt":
            from parallel_lab.strategies.tp.gpt_predict import predict_gpt_comm

            return predict_gpt_comm(cfg, model)
        if cfg.model.name == "vit":
            from parallel_lab.strategies.tp.predict import predict_vit_comm

            return predict_vit_comm(cfg, model)
        return predict_tp_comm(cfg, model, split_plan(cfg.model.name, cfg.strategy.split_conv, model))
