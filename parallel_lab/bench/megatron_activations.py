"""``python -m parallel_lab.bench megatron_activations [--t 1,2,4] [--shape k=v,...] [--batch B]``

Korthikanti et al. (arXiv 2205.05198) Table 2: the activation bytes one transformer layer saves
for backward, with 16-bit activations and 1-byte dropout masks (s tokens, b micro-batch, h hidden,
a heads, t the tensor-parallel degree):

    no parallelism                      sbh (34 + 5as/h)
    tensor parallel                     sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel          sbh (34/t + 5as/(ht))
    tp + selective recompute            sbh (10 + 24/t)
    tp + sp + selective recompute       sbh (34/t)
    full recompute                      2sbh

beside one vit block (models/vit.py) configured to the paper's assumptions -- MLP 4h, dropout on
where GPT has it (model.dropout_placement=gpt: none after GELU), the block cast to bf16 as
ZeRO/FSDP's gathered parameters are -- split as strategy=tp splits it
(Megatron's manual split, tp/megatron.py), with trainer.recompute's regions:

- measured: the storages autograd saves in a real forward of the block on each rank (a
  saved-tensors hook, parameters left out), t = 1 in this process, t > 1 on t real gloo ranks
  (``cli/run.py`` run_ranks; about 10 s per degree on this 2-core machine, t = 4 included);
- planned: the planner's count (``plan/predict.py`` saved_activation_bytes) of the same block split
  on the meta device (``tp/predict.py`` split_meta_vit).

Every difference from the formula is a term derived from the block's own modules (``differences``)
and the bench checks measured = planned = paper + those terms, to the byte, on every row.
The last line is the largest relative distance between the measurement and the paper.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

# h = 256, a = 8 heads of 32, s = 64 tokens (4 x 4 patches of a 32 x 32 image), MLP 4h, dropout on
# where GPT has it: 5as/h = 10, so the attention's s² terms weigh in the totals as they do in the
# paper's GPT layers.
SHAPE = {"dim": 256, "heads": 8, "patch": 4, "mlp_ratio": 4.0, "dropout": 0.1, "dropout_placement": "gpt"}
BATCH = 4
BF16 = torch.bfloat16
# (key, the paper's row, sequence parallel, trainer.recompute); "none" runs unsplit (t = 1 only)
ROWS = (
    ("none", "no parallelism", False, "none"),
    ("tensor", "tensor parallel", False, "none"),
    ("tensor+sp", "tensor + sequence parallel", True, "none"),
    ("tensor+selective", "tp + selective recompute", False, "selective"),
    ("tensor+sp+selective", "tp + sp + selective recompute", True, "selective"),
    ("full", "full recompute", False, "full"),
)
OPTIONS = {key: (sp, mode) for key, _, sp, mode in ROWS}
FORMULA = {
    "none": "sbh(34 + 5as/h)",
    "tensor": "sbh(10 + 24/t + 5as/(ht))",
    "tensor+sp": "sbh(34/t + 5as/(ht))",
    "tensor+selective": "sbh(10 + 24/t)",
    "tensor+sp+selective": "sbh(34/t)",
    "full": "2sbh",
}


def paper_bytes(row: str, t: int, a: int, s: int, h: int, b: int) -> float:
    """Table 2 of arXiv 2205.05198, bytes per layer."""
    att = 5 * a * s / h
    coefficient = {
        "none": 34 + att,
        "tensor": 10 + 24 / t + att / t,
        "tensor+sp": 34 / t + att / t,
        "tensor+selective": 10 + 24 / t,
        "tensor+sp+selective": 34 / t,
        "full": 2,
    }[row]
    return s * b * h * coefficient


def sizes(keys: dict) -> dict:
    """a, s, h, the MLP width and the dropout of a vit built with ``keys``."""
    from parallel_lab.models.layout import scaled_dim
    from parallel_lab.models.vit import DEFAULTS, IMAGE

    k = {**DEFAULTS, **keys}
    h = scaled_dim(k["dim"], k["heads"], 1.0)
    return {
        "a": k["heads"],
        "s": (IMAGE // k["patch"]) ** 2,
        "h": h,
        "hidden": round(h * k["mlp_ratio"]),
        "p": k["dropout"],
        "placement": k["dropout_placement"],
    }


def layer_norm_stat_bytes() -> int:
    """Bytes of one of LayerNorm's saved mean/rstd elements in a bf16 forward on this device
    (CPU keeps them in the input's dtype, CUDA in float32)."""
    x = torch.zeros(1, 8, dtype=BF16)
    return torch.native_layer_norm(x, [8], None, None, 1e-5)[1].element_size()


def differences(row: str, t: int, z: dict, b: int, stat: int) -> list[tuple[str, float]]:
    """(what, bytes) the vit block saves beyond the paper's row, each from its modules."""
    s, (sp, mode) = z["s"], OPTIONS[row]
    if mode == "full":  # the checkpoint keeps the block's input alone: 2sbh (the row runs without SP)
        return []
    out = []
    if z["p"] > 0 and z["placement"] == "vit":
        drop1 = (
            "mlp.drop1: a dropout after GELU (model.dropout_placement=vit; GPT has none), its 1-byte mask of sb·4h/t"
        )
        out.append((drop1, s * b * z["hidden"] / t))
    local = s // t if sp else s  # tokens in the LayerNorms' region
    stats = f"LayerNorm's saved mean and rstd: 2 norms x 2 x b x s{'/t' if sp else ''} x {stat} B"
    out.append((stats, 4 * b * local * stat))
    return out


def _model(keys: dict, meta: bool) -> nn.Module:
    from omegaconf import OmegaConf

    from parallel_lab.models import build_meta_model, build_model

    cfg = OmegaConf.create({"name": "vit", "num_classes": 10, "depth": 1, **keys})
    model = build_meta_model(cfg) if meta else build_model(cfg, seed=0)
    return model.train()


def measured_bytes(block: nn.Module, x: torch.Tensor, mode: str) -> int:
    """Bytes of the distinct storages autograd saves in one forward of ``block`` (parameters left out)."""
    from parallel_lab.models.recompute import recomputing

    params = {p.untyped_storage()._cdata for p in block.parameters()}
    seen: dict[int, int] = {}
    alive = []  # a storage freed before the count ends would hand its address to the next one

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in params:
            seen[storage._cdata] = storage.nbytes()
            alive.append(storage)
        return tensor

    with recomputing(block, mode), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


def _split(model: nn.Module, t: int, rank: int, sp: bool) -> nn.Module:
    from parallel_lab.strategies.tp.megatron import TPGroup
    from parallel_lab.strategies.tp.split import split_transformer

    if t > 1:
        split_transformer(model, TPGroup(None, rank, t), sp)  # group None: the world (t ranks)
    return model


def measure(keys: dict, batch: int, t: int, rank: int) -> dict[str, int]:
    """Row -> bytes one real bf16 block saves on this rank at degree t (world = t ranks, or t = 1)."""
    z, out = sizes(keys), {}
    for row, _, sp, mode in ROWS:
        if row == "none" and t > 1:
            continue
        block = _split(_model(keys, meta=False).to(BF16), t, rank, sp).block0
        torch.manual_seed(rank)
        x = torch.randn(batch, z["s"] // t if sp else z["s"], z["h"], dtype=BF16)
        out[row] = measured_bytes(block, x, mode)
    return out


def measure_rank(rank: int, world_size: int, keys: dict, batch: int) -> None:
    """run_ranks' body: print this rank's measure() as one JSON line."""
    print(json.dumps(measure(keys, batch, world_size, rank)))


def planned(keys: dict, batch: int, t: int, rank: int) -> dict[str, int]:
    """Row -> the planner's count of the same block, split on the meta device as the run splits it."""
    from omegaconf import OmegaConf

    from parallel_lab.plan.predict import saved_activation_bytes
    from parallel_lab.strategies.tp.predict import split_meta_vit

    z, out = sizes(keys), {}
    for row, _, sp, mode in ROWS:
        if row == "none" and t > 1:
            continue
        model = _model(keys, meta=True)
        if t > 1:
            cfg = OmegaConf.create({"strategy": dict(tp=t, sequence_parallel=sp, impl="manual")})
            model = split_meta_vit(cfg, model, rank)
        shape = (z["s"] // t if sp else z["s"], z["h"])
        out[row] = saved_activation_bytes(nn.Sequential(model.block0), batch, shape, False, BF16, recompute=mode)
    return out


def measure_world(keys: dict, batch: int, t: int) -> list[dict[str, int]]:
    """Every rank's measure() at degree t: in this process at t = 1, else on t gloo ranks."""
    if t == 1:
        return [measure(keys, batch, 1, 0)]
    from parallel_lab.cli.run import run_ranks

    outputs = run_ranks(measure_rank, t, timeout=300, keys=keys, batch=batch)
    return [json.loads(o.strip().splitlines()[-1]) for o in outputs]


def table(keys: dict, batch: int, ts: tuple[int, ...]) -> list[dict]:
    """One entry per (row, t): paper, measured and planned (the most any rank saves), the explained terms."""
    z, stat = sizes(keys), layer_norm_stat_bytes()
    entries = []
    for t in ts:
        ranks = measure_world(keys, batch, t)
        plans = [planned(keys, batch, t, r) for r in range(t)]
        for row, label, _, _ in ROWS:
            if row not in ranks[0]:
                continue
            terms = differences(row, t, z, batch, stat)
            paper = paper_bytes(row, t, z["a"], z["s"], z["h"], batch)
            entries.append(
                {
                    "row": row,
                    "label": label,
                    "t": t,
                    "paper": paper,
                    "measured": max(r[row] for r in ranks),
                    "measured_min": min(r[row] for r in ranks),
                    "planned": max(p[row] for p in plans),
                    "explained": paper + sum(n for _, n in terms),
                    "terms": terms,
                }
            )
    return entries


def mismatches(entries: list[dict]) -> list[str]:
    """Rows where the ranks differ, planned != measured, or paper + explained terms != measured."""
    bad = []
    for e in entries:
        where = f"{e['row']}, t={e['t']}"
        if e["measured"] != e["measured_min"]:
            bad.append(f"{where}: the ranks saved {e['measured_min']} .. {e['measured']} bytes")
        if e["planned"] != e["measured"]:
            bad.append(f"{where}: planned {e['planned']} != measured {e['measured']}")
        if abs(e["explained"] - e["measured"]) > 1e-6:
            bad.append(f"{where}: paper + explained terms {e['explained']:.0f} != measured {e['measured']}")
    return bad


def last_line(entries: list[dict]) -> str:
    worst = max(entries, key=lambda e: abs(e["measured"] - e["paper"]) / e["paper"])
    rel = abs(worst["measured"] - worst["paper"]) / worst["paper"]
    return f"max |measured − paper| / paper: {100 * rel:.2f}% ({worst['row']}, t={worst['t']})"


def render(entries: list[dict], keys: dict, batch: int) -> str:
    z = sizes(keys)
    sbh = z["s"] * batch * z["h"]
    lines = [
        "Korthikanti et al. (arXiv 2205.05198) Table 2: activation bytes per transformer layer, 16-bit "
        "activations, 1-byte dropout masks.",
        f"One vit block (models/vit.py) cast to bf16, dropout {z['p']} ({z['placement']} placement): "
        f"a = {z['a']} heads, s = {z['s']} tokens, "
        f"h = {z['h']}, MLP {z['hidden']}, b = {batch} (sbh = {sbh:,} elements; "
        f"5as/h = {5 * z['a'] * z['s'] / z['h']:g}).",
        "Measured: autograd's saved storages in a real forward on each rank (t > 1: t gloo ranks, Megatron's manual "
        "split); planned: the planner's meta-device count of the same split block. Units: bytes, and sbh.",
        "",
        "| row | paper | t | paper bytes (sbh) | measured (sbh) | planned | measured − paper (sbh) | explained |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        diff = e["measured"] - e["paper"]
        ok = "yes" if abs(e["explained"] - e["measured"]) < 1e-6 else "NO"
        lines.append(
            f"| {e['label']} | {FORMULA[e['row']]} | {e['t']} | {e['paper']:,.0f} ({e['paper'] / sbh:.4g}) "
            f"| {e['measured']:,} ({e['measured'] / sbh:.4g}) | {e['planned']:,} "
            f"| {diff:+,.0f} ({diff / sbh:+.4g}) | {ok} |"
        )
    return "\n".join(lines)


EXPLAIN = """
What the vit block saves, item by item, against the paper's (sec. 4.1) list:
- the same bytes as Megatron's: LayerNorm inputs (2sbh each); q/k/v's shared input (one storage,
  2sbh); q and kᵀ for the scores: torch.matmul saves contiguous copies of the head-split views
  (2sbh/t each), v the same; softmax saves its output (2as²b/t); the attention dropout's 1-byte
  mask (as²b/t) and its output for the product with v (2as²b/t); proj's input (the heads' output
  reshaped, a copy: 2sbh/t); the two sublayer dropouts' masks (sbh each, /t under SP); fc1's input
  (2sbh; under SP the column layers keep their input's shard, 2sbh/t, and gather it again in
  backward, as Megatron does); GELU's input (8sbh/t); fc2's input (8sbh/t; with
  model.dropout_placement=vit it is drop1's output and drop1 adds its mask);
- selective recompute: the checkpoint keeps q, k, v (the three linear outputs, 6sbh/t) where
  the unrecomputed core kept its copies of them: the same bytes;
- full recompute: only the block's input (2sbh), kept by the checkpoint.
Differences (each row's "explained" says paper + these terms = measured, to the byte):"""


def explain_terms(entries: list[dict]) -> str:
    seen: dict[str, list[str]] = {}
    for e in entries:
        for text, n in e["terms"]:
            seen.setdefault(text, []).append(f"{e['row']} t={e['t']}: {n:+,.0f} B")
    return "\n".join(f"- {text}\n    ({'; '.join(where)})" for text, where in seen.items())


def parse_keys(text: str | None) -> dict:
    keys = dict(SHAPE)
    for pair in filter(None, (text or "").split(",")):
        key, _, value = pair.partition("=")
        value = value.strip()
        keys[key.strip()] = value if not value[:1].isdigit() else float(value) if "." in value else int(value)
    return keys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel_lab.bench megatron_activations")
    parser.add_argument(
        "--t", default="1,2,4", help="tensor-parallel degrees (t > 1: t gloo processes, about 10 s each here)"
    )
    parser.add_argument("--shape", help="model.<key>=value pairs over the default, e.g. dim=512,heads=16,patch=2")
    parser.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args(argv)
    keys = parse_keys(args.shape)
    entries = table(keys, args.batch, tuple(int(t) for t in args.t.split(",")))
    print(render(entries, keys, args.batch))
    print(EXPLAIN)
    print(explain_terms(entries))
    bad = mismatches(entries)
    for line in bad:
        print(f"MISMATCH {line}", file=sys.stderr)
    print(last_line(entries))
    return 1 if bad else 0
