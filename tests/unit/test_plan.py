"""The planner (``python -m parallel_lab.plan``): in-process, no worker started.

- the command line writes its table, json and figures for every strategy, and an impossible fit is
  a "does not fit: needs X, has Y" row, not an error;
- a config a run would refuse (tp degree not dividing a width, more pp stages than blocks) is the
  run's own one-line error, exit 2;
- at a large world size the FSDP2 and tp predictions equal the shards torch really builds, read
  from real sharded modules in one process on torch's fake process group (no data moved), and a
  planner that ignores FSDP2's padding is caught;
- predictions against measured runs: ``tests/integration/test_sharded.py`` and the other run tests
  check every ``predicted_*`` of their runs within 1% (``assert_plan_matches``); the world-3 matrix
  (``tests/integration/test_plan.py``) is ``extra``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from parallel_lab.cli.run import run_cli
from parallel_lab.models import build_meta_model
from parallel_lab.plan.main import main as plan_main
from parallel_lab.plan.predict import MODEL_STATE
from parallel_lab.strategies import get_strategy_class, sweep_names

TOLERANCE = 0.01


def run_plan(*overrides: str) -> tuple[int, str, str]:
    """The planner's main() in this process: (exit code, stdout, stderr)."""
    from hydra.core.global_hydra import GlobalHydra

    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            plan_main(list(overrides))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        GlobalHydra.instance().clear()
    return code, out.getvalue(), err.getvalue()


def test_plan_tables_every_strategy_and_says_what_does_not_fit(tmp_path):
    code, stdout, stderr = run_plan(
        "model=cnn", "world_size=4", "trainer.global_batch=4", "plan.device_memory=3MiB", f"plan.out={tmp_path}"
    )
    assert code == 0, stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    rows = {r["strategy"]: r for r in plan["rows"]}
    assert set(rows) == set(sweep_names())
    assert (tmp_path / "plan.md").read_text() in stdout
    assert (tmp_path / "plan.png").stat().st_size > 0 and (tmp_path / "plan.csv").is_file()
    params = sum(p.numel() for p in build_meta_model(OmegaConf.create({"name": "cnn", "num_classes": 10})).parameters())
    # A full replica holds every fp32 weight, gradient and Adam moment (16 bytes x 0.32M = 4.9 MiB):
    # it cannot fit in 3 MiB; full sharding over 4 ranks (a quarter each, plus activations) can.
    assert rows["ddp"]["param_bytes"] == 4 * params
    assert rows["ddp"]["fits"].startswith("does not fit: needs ") and ", has 3 MiB" in rows["ddp"]["fits"]
    assert rows["fsdp"]["fits"].startswith("fits")
    assert rows["tp"]["param_bytes"] < rows["ddp"]["param_bytes"]
    # Every rank of a 4-rank zero3 run is planned, and each holds about a quarter.
    zero3 = [r for r in plan["ranks"] if r["strategy"] == "zero3"]
    assert [r["rank"] for r in zero3] == [0, 1, 2, 3]
    assert all(abs(r["state"]["param_bytes"] - params) / params < 0.01 for r in zero3)


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=tp", "strategy.tp=3", "world_size=3"],  # 3 does not divide cnn's 256 fc1 features
        ["strategy=pp", "world_size=6", "strategy.stages=6"],  # cnn has 5 cuttable blocks
    ],
    ids=["tp-degree", "pp-stages"],
)
def test_plan_refuses_what_a_run_refuses_with_the_same_line(tmp_path, overrides):
    code, _, stderr = run_plan(*overrides, f"plan.out={tmp_path / 'plan'}")
    assert code == 2
    (line,) = stderr.strip().splitlines()
    run = run_cli(tmp_path / "run", *overrides, check=False, in_process=True)
    (run_line,) = [x for x in run.stderr.splitlines() if "parallel_lab: error:" in x]
    assert line.removeprefix("parallel_lab.plan: error: ") == run_line.removeprefix("parallel_lab: error: ")
    assert not (tmp_path / "plan").exists()  # nothing half-written


@pytest.mark.parametrize(
    "overrides, named",
    [(["plan.device_memory=lots"], "plan.device_memory=lots"), (["model.width=-2"], "model.width=-2")],
)
def test_plan_bad_input_is_one_line(tmp_path, overrides, named):
    code, stdout, stderr = run_plan(*overrides, f"plan.out={tmp_path / 'plan'}")
    assert code == 2 and not stdout
    (line,) = stderr.strip().splitlines()
    assert line.startswith("parallel_lab.plan: error: ") and named in line and "; " in line
    assert not (tmp_path / "plan").exists()


def test_plan_scales_to_1024_ranks_and_keeps_going_past_impossible_splits(tmp_path):
    worlds = [1, 64, 1024]
    code, _, stderr = run_plan(
        "model=cnn", "model.width=180", f"plan.world_sizes=[{','.join(map(str, worlds))}]", f"plan.out={tmp_path}"
    )
    assert code == 0, stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    rows = {(r["strategy"], r["world"]): r for r in plan["rows"]}
    params = rows[("zero3", 1024)]["params"]
    assert 5e9 < params < 2e10  # width 180 takes the 0.3M cnn to ~10B parameters
    # pp has 5 blocks: 64 stages is the run's own one-line error, as a row.
    assert rows[("pp", 64)]["fits"].startswith("cannot run: strategy.stages=64 is more than the 5 cuttable blocks")
    assert rows[("tp", 1024)]["param_bytes"] < rows[("tp", 64)]["param_bytes"]  # 46080 features split 1024 ways
    full = [rows[("fsdp", w)]["param_bytes"] for w in worlds]
    assert all(a > b for a, b in zip(full, full[1:]))  # full sharding: every doubling shrinks the shard
    assert (tmp_path / "scaling.png").stat().st_size > 0


# ----- the plan against real sharded modules at a large world size (fake process group) -----
@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """A one-process "world" on torch's fake backend: collectives return at once, no data moves;
    sharding code builds exactly the shards rank ``rank`` of ``world`` would hold."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def plan_cfg(*overrides: str):
    from parallel_lab.config import compose_config
    from parallel_lab.config.validate import check_split

    cfg = compose_config(list(overrides))
    check_split(cfg, get_strategy_class(cfg.strategy.name).plan)
    return cfg


def fsdp2_shards(model: torch.nn.Module, world: int) -> tuple[int, int]:
    """(bytes of the padded shard storages, elements this rank really holds) of FSDP2 built on
    the meta device: nothing allocated, the shapes are torch's own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from parallel_lab.strategies.fsdp.strategy import fsdp_units

    mesh = init_device_mesh("cpu", (world,))
    for _, unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp_params = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            fsdp_params += group.fsdp_params if group is not None else []
    storage = sum(fp._sharded_param_data.untyped_storage().nbytes() for fp in fsdp_params)
    return storage, sum(p._local_tensor.numel() for p in model.parameters())


def test_fsdp2_plan_equals_real_shards_at_1000_ranks():
    """World 1000 (not a power of two: most of cnn's parameters have fewer rows than ranks, so
    padding dominates). A planner that divides the bytes by N instead is caught."""
    world = 1000
    cfg = plan_cfg("strategy=fsdp", f"world_size={world}", "model=cnn", "model.width=2", "trainer.global_batch=1000")
    for rank in (0, 1, world - 1):
        with fake_world(rank, world):
            model = build_meta_model(cfg.model)
            predicted = get_strategy_class("fsdp").plan.predict_memory(cfg, model, rank)
            storage, held = fsdp2_shards(model, world)
        assert predicted["param_bytes"] == storage == predicted["grad_bytes"]
        assert predicted["optim_bytes"] == 8 * held  # Adam's moments: zeros_like the unpadded shard
        textbook = 4 * sum(p.numel() for p in build_meta_model(cfg.model).parameters()) / world
        assert abs(textbook - storage) / storage > TOLERANCE  # ignoring padding fails the 1% check


def test_tp_plan_equals_real_dtensor_shards_at_256_ranks():
    """torch's own ColwiseParallel/RowwiseParallel (the dtensor impl) at tp=256 on cnn width 4."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = 256
    cfg = plan_cfg(
        "strategy=tp",
        f"strategy.tp={world}",
        f"world_size={world}",
        "model=cnn",
        "model.width=4",
        "strategy.impl=dtensor",
    )
    for rank in (0, world - 1):
        with fake_world(rank, world):
            model = build_meta_model(cfg.model)
            predicted = get_strategy_class("tp").plan.predict_memory(cfg, model, rank)
            mesh = init_device_mesh("cpu", (world,))
            parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            held = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
            tensors = sum(1 for _ in model.parameters())
        assert predicted["param_bytes"] == predicted["grad_bytes"] == 4 * held
        assert predicted["optim_bytes"] == 8 * held + 4 * tensors  # + Adam's 4-byte step tensors


def test_model_width_one_is_todays_model():
    for name in ("cnn", "resnet18"):
        base = build_meta_model(OmegaConf.create({"name": name, "num_classes": 10}))
        wide = build_meta_model(OmegaConf.create({"name": name, "num_classes": 10, "width": 1.0}))
        assert [(n, p.shape) for n, p in base.named_parameters()] == [(n, p.shape) for n, p in wide.named_parameters()]
        double = build_meta_model(OmegaConf.create({"name": name, "num_classes": 10, "width": 2.0}))
        ratio = sum(p.numel() for p in double.parameters()) / sum(p.numel() for p in base.parameters())
        assert 3.5 < ratio < 4.1  # parameters grow about width squared
    assert math.isclose(TOLERANCE, 0.01)
    assert MODEL_STATE[0] == "param_bytes"


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
def test_activation_prediction_equals_a_real_forward(name):
    """The meta-device count of saved activations equals what autograd saves in a real forward +
    loss (tests/support/activations.py's counter) at the same batch."""
    from parallel_lab.plan.predict import saved_activation_bytes
    from tests.support.activations import saved_for_backward_bytes

    cfg = OmegaConf.create({"name": name, "num_classes": 10})
    torch.manual_seed(0)
    real = get_model(cfg)
    assert saved_activation_bytes(build_meta_model(cfg), 3) == saved_for_backward_bytes(real, 3)


def get_model(cfg):
    from parallel_lab.models import build_model

    return build_model(cfg, seed=0)


# ----- bf16 / fp16 / offload: planned like fp32 (tests/integration/test_sharded.py checks them to the byte) -----
def test_plan_honours_trainer_precision_bf16_as_a_run_does():
    """trainer.precision=bf16 becomes each strategy's own precision key, as a run's validation
    does: ZeRO rows hold 2-byte parameters and gradients beside the fp32 master, fsdp/ddp fp32
    state, tp and pp fp32 state with bf16 activations; strategies without bf16 are "cannot run" rows with
    the run's own error."""
    from parallel_lab.plan.configs import planned_configs
    from parallel_lab.plan.main import build_plans

    row_list, ranks = build_plans(planned_configs(["model=cnn", "world_size=2", "trainer.precision=bf16"]), 2**40)
    rows = {r["strategy"]: r for r in row_list}
    psi = rows["zero0"]["params"]
    assert rows["dp"]["fits"].startswith("cannot run: trainer.precision=bf16: strategy=dp has no bf16 mode")
    # tp, pp: Megatron's bf16, fp32 state (their shards, stages) and bf16 activations on the wire
    fp32 = {}
    for name in ("tp", "pp"):
        assert not rows[name]["fits"].startswith("cannot run") and rows[name]["param_bytes"] == rows[name]["grad_bytes"]
        fp32_rows, fp32_ranks = build_plans(planned_configs(["model=cnn", "world_size=2", f"strategy={name}"]), 2**40)
        assert rows[name]["param_bytes"] == fp32_rows[0]["param_bytes"]
        fp32[name] = next(r["comm"] for r in fp32_ranks if r["rank"] == 0)
    # zero0: 16-bit module + FP16_UnfusedOptimizer's fp32 copy of every parameter = the paper's 16Ψ
    assert (rows["zero0"]["param_bytes"], rows["zero0"]["master_param_bytes"]) == (2 * psi, 4 * psi)
    assert rows["zero3"]["param_bytes"] == rows["zero3"]["grad_bytes"] == rows["zero3"]["master_param_bytes"] // 2
    assert rows["ddp"]["param_bytes"] == rows["manual_ddp"]["param_bytes"] == 4 * psi  # fp32; bf16 copies
    comm = {r["strategy"]: r["comm"] for r in ranks if r["rank"] == 0}
    assert comm["zero0"] == {"all_reduce": 2.0 * 2 * psi}  # bf16 gradients all-reduced: half of fp32's
    assert comm["tp"] == {"all_reduce": fp32["tp"]["all_reduce"] / 2}
    assert comm["pp"] == {"isend": fp32["pp"]["isend"] / 2}  # the stages send bf16 activations and gradients


def test_zero_fp16_and_offload_are_planned():
    """fp16 (a GPU's; refused on CPU) has the bf16 layout at every stage; offload is planned too
    (stages 1-3), DeepSpeed's fp32 gradient partition and its staging buffers included."""
    base = ["model=cnn", "world_size=4", "trainer.global_batch=8", "strategy=zero1", "device=cuda"]
    configs = {
        name: plan_cfg(*base, *extra)
        for name, extra in [
            ("bf16", ["strategy.precision=bf16"]),
            ("fp16", ["strategy.precision=fp16"]),
            ("offload", ["strategy.precision=bf16", "strategy.offload=cpu"]),
        ]
    }
    model = build_meta_model(configs["bf16"].model)
    cls = get_strategy_class("zero1")  # one class for zero0-3: the stage is the config's
    for stage in range(4):
        plans = {}
        for name, cfg in configs.items():
            cfg.strategy.stage, cfg.strategy.name = stage, f"zero{stage}"
            plans[name] = [cls.plan.predict_memory(cfg, model, r) for r in range(4)]
        assert plans["fp16"] == plans["bf16"] and all(plans["bf16"]), stage
        if stage:
            bf16, offload = plans["bf16"][0], plans["offload"][0]
            master = bf16["master_param_bytes"]
            expected = {1: bf16["grad_bytes"] + master, 2: master, 3: bf16["grad_bytes"] + master}[stage]
            assert offload["grad_bytes"] == expected and offload["comm_buffer_bytes"] > 0, (stage, offload)


@pytest.mark.parametrize("name", ["cnn", pytest.param("resnet18", marks=pytest.mark.extra)])
def test_bf16_activation_prediction_equals_a_real_bf16_forward(name):
    """In bf16 the meta-device count equals what autograd saves in a real bf16 forward + fp32 loss:
    the module itself in bf16 (ZeRO's, FSDP's gathered parameters), and single/ddp's forward on a
    bf16 copy of every weight (strategies/precision.py), whose saved copies count too."""
    import copy

    from parallel_lab.plan.predict import saved_activation_bytes
    from parallel_lab.strategies.precision import bf16_forward

    cfg = OmegaConf.create({"name": name, "num_classes": 10})
    real, meta, batch = get_model(cfg), build_meta_model(cfg), 3
    module_bf16 = copy.deepcopy(real).to(torch.bfloat16)
    x = torch.zeros(batch, 3, 32, 32)
    whole = _saved_bytes(module_bf16, lambda: module_bf16(x.to(torch.bfloat16)).float(), batch)
    copies = _saved_bytes(real, lambda: bf16_forward(real, x), batch)
    assert saved_activation_bytes(meta, batch, dtype=torch.bfloat16) == whole
    assert saved_activation_bytes(meta, batch, dtype=torch.bfloat16, weight_copies=True) == copies
    assert whole < saved_activation_bytes(meta, batch) < copies + whole  # about half of fp32's


def _saved_bytes(module: torch.nn.Module, forward, batch: int) -> int:
    """Distinct non-parameter storages autograd saves in forward() and a cross-entropy of it."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in params:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch.nn.functional.cross_entropy(forward(), torch.zeros(batch, dtype=torch.long))
    return sum(saved.values())


def test_planned_pipeline_stages_leave_room_for_tp_and_replicas():
    """The planner sets pp's stages from each world size divided by the mesh's other degrees
    (replicate x tp), as a run must be given them: world 8 with tp 2 and replicate 2 is 2 stages."""
    from parallel_lab.plan.configs import planned_configs

    for world, replicate, stages in ((4, 1, 2), (8, 2, 2), (8, 1, 4)):
        (planned,) = planned_configs(
            ["model=vit", "strategy=pp", "strategy.tp=2", f"strategy.replicate={replicate}", f"world_size={world}"]
        )
        assert planned.cfg.strategy.stages == stages, (world, replicate, planned.cfg.strategy.stages)
