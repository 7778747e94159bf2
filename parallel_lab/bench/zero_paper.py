"""``python -m parallel_lab.bench zero_paper [--model vit|resnet18|cnn] [--shape k=v,...] [--width W] [--nd ...]``

The ZeRO paper's Table 1 (Rajbhandari et al., arXiv 1910.02054): per-device model-state memory of
a Ψ = 7.5 B model trained with mixed-precision Adam (K = 12: fp32 master 4 + momentum 4 + variance
4 bytes per parameter, beside 2-byte parameters and 2-byte gradients), in GB = 1e9 bytes, for
Nd = 1 ... 1024 data-parallel devices, columns baseline (16Ψ), Pos (4Ψ + 12Ψ/Nd), Pos+g
(2Ψ + 14Ψ/Nd) and Pos+g+p (16Ψ/Nd) -- beside

- the planner's prediction of DeepSpeed 0.19.8's real buffers (``strategies/zero/predict.py``,
  checked to the byte against real runs) for a model of this toolkit built at about 7.5 B
  parameters on the meta device, fp16, stages 0-3 = the four columns; the rank holding the most;
  model states only; scaled to exactly Ψ = 7.5 B. By default the paper's kind of model, a
  transformer: the vit at hidden 4096, 37 layers, 32 heads, MLP 4 x hidden, 64 patches
  (7,451,515,402 parameters; its largest tensor, an MLP weight, is 0.9% of Ψ). ``--model resnet18
  --width 26`` (7,542,900,362) keeps the CNN table, where one tensor is 21% of Ψ;
- DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs`` for stage 2,
  ``estimate_zero3_model_states_mem_needs`` for stage 3, GPU column without offload, as
  ``bench ds_estimate`` calls them; DeepSpeed has none for stages 0 and 1), at Ψ = 7.5 B.

Every difference is explained below the table; the last line is the largest relative distance
between the plan and the paper.
"""

from __future__ import annotations

import argparse
import functools
from decimal import ROUND_HALF_UP, Decimal

from parallel_lab.strategies.zero import zero_name

PSI = 7.5e9
GB = 1e9  # the paper's GB; DeepSpeed's estimate_*_all_live prints bytes / 2**30 and calls it GB
ND = (1, 4, 16, 64, 256, 1024)
COLUMNS = ("baseline", "Pos", "Pos+g", "Pos+g+p")  # = ZeRO stage 0, 1, 2, 3
STATE = ("param_bytes", "master_param_bytes", "grad_bytes", "optim_bytes")


def paper_bytes(stage: int, nd: int, psi: float = PSI, k: int = 12) -> float:
    """Table 1's formula: 2Ψ parameters + 2Ψ gradients + KΨ optimizer states, stage 1 dividing
    the KΨ by Nd, stage 2 also the gradients, stage 3 everything."""
    params, grads, optim = 2 * psi, 2 * psi, k * psi
    return params / (nd if stage >= 3 else 1) + grads / (nd if stage >= 2 else 1) + optim / (nd if stage >= 1 else 1)


def paper_round(gb: float) -> str:
    """As Table 1 prints its numbers: half up, 3 significant digits, at most 2 decimals (120,
    52.5, 41.3, 7.5, 1.88, 0.47)."""
    places = 0 if gb >= 100 else 1 if gb >= 10 else 2
    text = str(Decimal(repr(gb)).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text


# The default model: a 7.5 B transformer shaped as Megatron's GPT models of that size (hidden 4096,
# MLP 4 x hidden, 32 heads of 128), with 37 layers of 12h² + 13h parameters each (201 M) to reach Ψ.
# A CIFAR image in 4 x 4 patches gives 64 tokens (the vit has no vocabulary: its "embedding" is the
# patch projection, 3 x 4 x 4 x hidden, and 64 positions).
VIT_7B = {"dim": 4096, "depth": 37, "heads": 32, "mlp_ratio": 4.0, "patch": 4}
DEFAULT_SHAPES = {"vit": VIT_7B, "resnet18": {"width": 26.0}, "cnn": {"width": 180.0}}
Shape = tuple[tuple[str, float], ...]  # model.<key>=value pairs, hashable for the composed-config cache


def model_keys(name: str, shape: Shape) -> dict:
    return {"name": name, "num_classes": 10, **dict(shape)}


def scaled_model(name: str, shape: Shape):
    """(meta model, its parameter count, its largest layer's parameters as DeepSpeed counts them)."""
    from omegaconf import OmegaConf

    from parallel_lab.models import build_meta_model

    model = build_meta_model(OmegaConf.create(model_keys(name, shape)))
    params = sum(p.numel() for p in model.parameters())
    # deepspeed.runtime.zero.stage3.model_to_params (its data_ptr() dedup does not work on the meta device)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return model, params, largest


def plan_cfg(name: str, shape: Shape, stage: int, nd: int, precision: str = "fp16"):
    """The config a run would have (strategy=zero<stage>, fp16 = the paper's mixed precision,
    world_size=nd), as the planner reads it (plain values: the prediction is evaluated for every rank)."""
    from omegaconf import OmegaConf

    from parallel_lab.plan.predict import Values

    cfg = Values.of(OmegaConf.to_container(_base_cfg(name, shape), resolve=True))
    cfg.strategy.update(name=zero_name(stage), stage=stage, precision=precision)  # bf16: fp16's layout
    cfg.world_size = nd
    cfg.trainer.global_batch = nd  # one sample per device: the batch plays no part in model states
    return cfg


@functools.cache
def _base_cfg(name: str, shape: Shape):
    """ZeRO stage 0 composed once per model (Hydra's compose is the slow part; the ZeRO options are
    one class, so plan_cfg sets the stage); callers only read it."""
    from parallel_lab.config import compose_config

    return compose_config([f"strategy={zero_name(0)}", f"model={name}", *(f"model.{k}={v}" for k, v in shape)])


def plan_bytes(model, name: str, shape: Shape, stage: int, nd: int, precision: str = "fp16") -> tuple[int, int]:
    """(model-state bytes of the rank holding the most, of the rank holding the least)."""
    from parallel_lab.strategies.zero.predict import predict_zero_memory

    cfg = plan_cfg(name, shape, stage, nd, precision)
    ranks = range(nd) if stage == 2 else [0]  # only stage 2's ranks differ (its partition boundaries)
    totals = []
    for rank in ranks:
        state = predict_zero_memory(cfg, model, rank)
        totals.append(sum(state[k] for k in STATE))
    return max(totals), min(totals)


def deepspeed_bytes(stage: int, nd: int, psi: float, largest: float) -> float | None:
    """DeepSpeed's own GPU estimate without offload (stage 2: 2Ψ + 18Ψ/N; stage 3: 4 x the
    largest layer + 18Ψ/N); None for stages 0-1, which it has no estimator for."""
    if stage < 2:
        return None
    import os

    import torch

    from parallel_lab.strategies.zero.strategy import import_deepspeed

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")  # no probe, no notice
    import_deepspeed()
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return float(estimate_zero2_model_states_mem_needs(int(psi), nd, 1, cpu_offload=False)[1])
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    return float(estimate_zero3_model_states_mem_needs(int(psi), int(largest), nd, 1, cpu_offload=False)[1])


def rows(name: str, shape: Shape, nds: tuple[int, ...]) -> tuple[list[dict], dict]:
    model, params, largest = scaled_model(name, shape)
    scale = PSI / params
    out = []
    for nd in nds:
        for stage in range(4):
            most, least = plan_bytes(model, name, shape, stage, nd)
            ds = deepspeed_bytes(stage, nd, PSI, largest * scale)
            out.append(
                {
                    "nd": nd,
                    "stage": stage,
                    "paper": paper_bytes(stage, nd) / GB,
                    "plan": most * scale / GB,
                    "plan_least": least * scale / GB,
                    "deepspeed": None if ds is None else ds / GB,
                }
            )
    info = {"params": params, "largest_param": max(p.numel() for p in model.parameters()), "largest_layer": largest}
    return out, info


def _gb(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.4g}" if x >= 1 else f"{x:.3g}"


def _pct(x: float | None, paper: float) -> str:
    return "—" if x is None else f"{100 * (x - paper) / paper:+.2f}%"


def explain(info: dict, name: str, shape: Shape) -> str:
    psi, big = info["params"], info["largest_param"]
    return f"""What each difference is (GB = 1e9 bytes; the plan's and DeepSpeed's numbers for Ψ = 7.5 B exactly):

- Paper: Table 1's formulas to the byte; printed as the paper prints them (3 significant digits,
  at most 2 decimals), they are its published numbers.
- Plan, stage 0 (baseline): DeepSpeed's stage-0 16-bit path (FP16_UnfusedOptimizer) keeps an fp32
  copy of every parameter beside the 16-bit module: 2Ψ + 4Ψ + 2Ψ + 8Ψ = 16Ψ, the paper's number.
- Plan, stages 1-2: padding. The flat 16-bit buffer is padded to a multiple of 2 x Nd elements
  before it is cut into Nd partitions (at most 2 x Nd - 1 elements: bytes, not GB).
- Plan, stage 2: DeepSpeed 0.19.8 keeps the *whole* 16-bit gradient of every parameter that
  overlaps a rank's partition, not only the part inside it (measured on real runs: docs/plan.md).
  Once partitions are smaller than the largest parameter ({big:,} of {psi:,} elements,
  {100 * big / psi:.2g}% of the {name}'s Ψ), the rank whose partition lies inside it holds
  all of its gradient, 2 x {big * PSI / psi / GB:.3g} G elements = {2 * big * PSI / psi / GB:.3g} GB,
  where the paper counts 2Ψ/Nd; a partition straddling the boundary of two such parameters holds
  both. The ranks differ: the one holding the least is shown after "/".
  How large this is depends on the model's largest tensor, not on Ψ.
- Plan, stage 3: each parameter is padded to a multiple of Nd before it is split (at most
  Nd - 1 elements per parameter tensor): bytes, not GB.
- DeepSpeed's estimators count 18 bytes per parameter divided by Nd: 2 (16-bit gradients) + 4 (an
  fp32 gradient partition) + 4 (fp32 master) + 8 (Adam), the paper's 2 + 12 plus DeepSpeed's fp32
  gradient partition, 4Ψ/Nd more (stage 2 adds the 16-bit parameters, 2Ψ, as the paper does).
  DeepSpeed 0.19.8 holds that fp32 gradient partition only during the optimizer step (without
  offload; with offload it keeps it from init), so it is not resident model state. Stage 3
  adds 4 bytes x the largest layer (its gathered 16-bit parameters and gradients, the working set
  the paper leaves out with activations). Stage 2's estimator does not know the whole-gradient
  layout above. DeepSpeed has no estimator for stages 0 and 1 (—); its tables print bytes / 2**30
  as "GB", converted here with GB = 1e9.
- Left out everywhere, as in the paper's Table 1: activations, the gradient reduction buckets
  (25 MiB per rank here, `comm_buffer_bytes`), temporary buffers and fragmentation."""


def parse_shape(name: str, text: str | None, width: float | None) -> Shape:
    """DEFAULT_SHAPES[name], then --width, then --shape's key=value pairs (model.<key> of the config)."""
    shape = dict(DEFAULT_SHAPES[name])
    if width is not None:
        shape["width"] = width
    for pair in filter(None, (text or "").split(",")):
        key, _, value = pair.partition("=")
        shape[key.strip()] = float(value) if "." in value else int(value)
    return tuple(sorted(shape.items()))


def describe(name: str, shape: Shape, params: int) -> str:
    """The model as a reader compares it with the paper's: a transformer by its hidden size, layers,
    heads and sequence; a CNN by its width multiplier."""
    keys = dict(shape)
    if name != "vit":
        return f"{name} width {keys.get('width', 1.0):g} ({params:,} parameters)"
    from parallel_lab.models.vit import DEFAULTS, IMAGE

    s = {**DEFAULTS, **keys}
    hidden = round(s["dim"] * keys.get("width", 1.0))
    return (
        f"a transformer (model=vit): hidden {hidden}, {s['depth']} layers, {s['heads']} heads of "
        f"{hidden // s['heads']}, MLP {round(hidden * s['mlp_ratio'])}, {(IMAGE // s['patch']) ** 2} patches of "
        f"{s['patch']}x{s['patch']} (no vocabulary) = {params:,} parameters"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench zero_paper")
    parser.add_argument("--model", default="vit", choices=sorted(DEFAULT_SHAPES), help="the toolkit model at ~7.5 B")
    parser.add_argument("--shape", help="model.<key>=value pairs over the default shape, e.g. depth=36,heads=16")
    parser.add_argument("--width", type=float, help="model.width (the CNN table: --model resnet18, width 26)")
    parser.add_argument("--nd", default=",".join(map(str, ND)), help="data-parallel degrees, comma-separated")
    args = parser.parse_args(argv)
    nds = tuple(int(n) for n in args.nd.split(","))
    shape = parse_shape(args.model, args.shape, args.width)
    table, info = rows(args.model, shape, nds)
    by = {(r["nd"], r["stage"]): r for r in table}
    print(
        f"ZeRO paper Table 1 (arXiv 1910.02054): per-device model states, Ψ = 7.5 B, K = 12 (mixed-precision Adam), "
        f"GB = 1e9. Ψ here is the paper's: a parameter count (everywhere else in parallel_lab Ψ is the fp32 "
        f"parameter bytes, 4 x the count: docs/glossary.md#psi).\n"
        f"Plan: DeepSpeed 0.19.8's buffers as the planner predicts them for "
        f"{describe(args.model, shape, info['params'])}, fp16, scaled by 7.5e9 / {info['params']:,}.\n"
    )
    print("Paper, as published:\n")
    print("| Nd | baseline (16Ψ) | Pos (4Ψ+12Ψ/Nd) | Pos+g (2Ψ+14Ψ/Nd) | Pos+g+p (16Ψ/Nd) |")
    print("|---|---|---|---|---|")
    for nd in nds:
        print(f"| {nd} | " + " | ".join(paper_round(by[(nd, s)]["paper"]) for s in range(4)) + " |")
    print("\nPaper vs plan (the rank holding the most / the least) vs DeepSpeed's estimator, GB per device:\n")
    print("| Nd | column | ZeRO stage | paper | plan | plan − paper | DeepSpeed estimate | DeepSpeed − paper |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        plan = _gb(r["plan"]) + ("" if abs(r["plan"] - r["plan_least"]) < 5e-5 else f" / {_gb(r['plan_least'])}")
        print(
            f"| {r['nd']} | {COLUMNS[r['stage']]} | {r['stage']} | {_gb(r['paper'])} | {plan} "
            f"| {_pct(r['plan'], r['paper'])} | {_gb(r['deepspeed'])} | {_pct(r['deepspeed'], r['paper'])} |"
        )
    print("\n" + explain(info, args.model, shape) + "\n")
    worst = max(table, key=lambda r: abs(r["plan"] - r["paper"]) / r["paper"])
    err = 100 * abs(worst["plan"] - worst["paper"]) / worst["paper"]
    print(f"max |plan − paper| / paper: {err:.2f}% (stage {worst['stage']}, Nd {worst['nd']})")
    return 0
