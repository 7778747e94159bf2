"""Every numeric key's range, checked in the parent before anything is written (issue 32 item 6).

Each numeric key of the schema declares the values it takes beside its default
(``config/schema.py``: ``ranged``); ``config/validate.py check_ranges`` refuses any other value in one
line naming the key, the value and the range, exit 2, before Hydra makes a run folder. The catalogue
below holds a bad value for every declared key (a test checks that none is missing and that no
numeric key goes undeclared), each through the real CLI parent.
"""

from __future__ import annotations

import dataclasses

import pytest

from parallel_lab.config.schema import RANGE
from parallel_lab.config.validate import RANGED_SECTIONS
from tests.support.cli import assert_one_clean_line, compose_cfg, run_cli

CLI_TIMEOUT = 120

# id: (overrides, texts the one error line must hold: the key=value and the range)
RANGE_CASES = {
    "world-size-65": (["world_size=65"], ("world_size=65", "in [1, 64]")),
    "dist-timeout-negative": (["dist_timeout_s=-5"], ("dist_timeout_s=-5", ">= 1")),
    "steps-negative": (["trainer.steps=-1"], ("trainer.steps=-1", ">= 1")),
    "global-batch-0": (["trainer.global_batch=0"], ("trainer.global_batch=0", ">= 1")),
    "grad-accum-0": (["trainer.grad_accum=0"], ("trainer.grad_accum=0", ">= 1")),
    "lr-negative": (["trainer.lr=-0.1"], ("trainer.lr=-0.1", "> 0")),
    "momentum-with-adam": (["trainer.momentum=1.5"], ("trainer.momentum=1.5", "in [0, 1)")),
    "weight-decay-inf": (["trainer.weight_decay=inf"], ("trainer.weight_decay=inf", "finite", ">= 0")),
    "betas-beta2-1": (["trainer.betas=[0.9,1.0]"], ("trainer.betas=[0.9, 1.0]", "2 finite numbers in [0, 1)")),
    "betas-one": (["trainer.betas=[0.9]"], ("trainer.betas=[0.9]", "2 finite numbers")),
    "betas-not-numbers": (["trainer.betas=[a,b]"], ("trainer.betas=['a', 'b']", "2 finite numbers")),
    "eps-negative": (["trainer.eps=-1e-8"], ("trainer.eps=-1e-08", ">= 0")),
    "grad-clip-negative": (["trainer.grad_clip=-1"], ("trainer.grad_clip=-1.0", ">= 0")),
    "seed-negative": (["trainer.seed=-1"], ("trainer.seed=-1", "in [0, 2^63)")),
    "warmup-steps-negative": (["trainer.warmup_steps=-1"], ("trainer.warmup_steps=-1", ">= 0")),
    "rounds-0": (["trainer.rounds=0"], ("trainer.rounds=0", ">= 1")),
    # The case: it trained (profile=false never read it).
    "profile-steps-negative": (["trainer.profile_steps=-3"], ("trainer.profile_steps=-3", ">= 1")),
    "threads-per-rank-0": (["trainer.threads_per_rank=0"], ("trainer.threads_per_rank=0", ">= 1")),
    "threads-negative": (["trainer.threads=-2"], ("trainer.threads=-2", ">= 1", "trainer.threads=null")),
    "eval-batches-negative": (["trainer.eval_batches=-3"], ("trainer.eval_batches=-3", ">= 0")),
    "checkpoint-every-negative": (["trainer.checkpoint_every=-2"], ("trainer.checkpoint_every=-2", ">= 0")),
    "keep-checkpoints-0": (["trainer.keep_checkpoints=0"], ("trainer.keep_checkpoints=0", ">= 1")),
    "ulp-jitter-seed-negative": (
        ["strategy=single", "trainer.ulp_jitter_seed=-1"],
        ("trainer.ulp_jitter_seed=-1", "in [0, 2^63)"),
    ),
    "grad-ulp-seed-negative": (
        ["strategy=single", "trainer.grad_ulp_seed=-7"],
        ("trainer.grad_ulp_seed=-7", "in [0, 2^63)"),
    ),
    "num-classes-9": (["model.num_classes=9"], ("model.num_classes=9", ">= 10", "labels are 0-9")),
    "width-inf": (["model.width=inf"], ("model.width=inf", "in (0, 1000]")),
    "vit-patch-0": (["model=vit", "model.patch=0"], ("model.patch=0", ">= 1")),
    "vit-dim-negative": (["model=vit", "model.dim=-64"], ("model.dim=-64", ">= 1")),
    "vit-depth-0": (["model=vit", "model.depth=0"], ("model.depth=0", ">= 1")),
    "vit-heads-0": (["model=vit", "model.heads=0"], ("model.heads=0", ">= 1")),
    "vit-mlp-ratio-0": (["model=vit", "model.mlp_ratio=0"], ("model.mlp_ratio=0", "> 0")),
    "vit-dropout-1": (["model=vit", "model.dropout=1.0"], ("model.dropout=1.0", "in [0, 1)")),
    "data-size-0": (["data.size=0"], ("data.size=0", ">= 1")),
    "master-port-negative": (["launcher.master_port=-1"], ("launcher.master_port=-1", "in [0, 65536)")),
    "nodes-0": (["launcher=torchrun", "launcher.nodes=0"], ("launcher.nodes=0", ">= 1")),
    "nproc-per-node-0": (["launcher=torchrun", "launcher.nproc_per_node=0"], ("launcher.nproc_per_node=0", ">= 1")),
    "max-restarts-negative": (["launcher=torchrun", "launcher.max_restarts=-1"], ("launcher.max_restarts=-1", ">= 0")),
    "min-nodes-0": (["launcher=torchrun", "launcher.min_nodes=0"], ("launcher.min_nodes=0", ">= 1")),
    "grace-s-nan": (["launcher.grace_s=nan"], ("launcher.grace_s=nan", "finite", "> 0")),
    "fault-rank-beyond-world": (["fault.rank=2"], ("fault.rank=2", "in [-1, world_size=2)")),
    "fault-rank-below-never": (["fault.rank=-2"], ("fault.rank=-2", "in [-1, world_size=2)")),
    "fault-step-negative": (["fault.step=-1"], ("fault.step=-1", ">= 0")),
    "plan-world-sizes-0": (["plan.world_sizes=[2,0]"], ("plan.world_sizes=[2, 0]", "integers >= 1")),
    "plan-gpus-0": (["plan.gpus=0"], ("plan.gpus=0", ">= 1")),
    "gpt-layers-0": (["model=gpt", "data=tokens", "model.layers=0"], ("model.layers=0", ">= 1")),
    "gpt-hidden-0": (["model=gpt", "data=tokens", "model.hidden=0"], ("model.hidden=0", ">= 1")),
    "gpt-kv-heads-0": (["model=gpt", "data=tokens", "model.kv_heads=0"], ("model.kv_heads=0", ">= 1")),
    "gpt-ffn-0": (["model=gpt", "data=tokens", "model.ffn=0"], ("model.ffn=0", ">= 1")),
    "gpt-seq-0": (["model=gpt", "data=tokens", "model.seq=0"], ("model.seq=0", ">= 1")),
    "gpt-vocab-0": (["model=gpt", "data=tokens", "model.vocab=0"], ("model.vocab=0", ">= 1")),
    "tokens-seq-0": (["model=gpt", "data=tokens", "data.seq=0"], ("data.seq=0", ">= 1")),
    "tokens-vocab-1": (["model=gpt", "data=tokens", "data.vocab=1"], ("data.vocab=1", ">= 2")),
    "moe-experts-negative": (["model=vit", "model.moe_experts=-1"], ("model.moe_experts=-1", ">= 0")),
    "moe-topk-0": (["model=vit", "model.moe_experts=4", "model.moe_topk=0"], ("model.moe_topk=0", ">= 1")),
    "moe-every-0": (["model=vit", "model.moe_experts=4", "model.moe_every=0"], ("model.moe_every=0", ">= 1")),
    "moe-aux-weight-negative": (
        ["model=vit", "model.moe_experts=4", "model.moe_aux_weight=-0.1"],
        ("model.moe_aux_weight=-0.1", ">= 0"),
    ),
    "moe-capacity-factor-0": (
        ["model=vit", "model.moe_experts=4", "model.moe_capacity_factor=0"],
        ("model.moe_capacity_factor=0", "> 0"),
    ),
    # A strategy's float options: finite (their bounds are each strategy's validate_options).
    "ddp-bucket-nan": (["strategy=ddp", "strategy.bucket_cap_mb=nan"], ("strategy.bucket_cap_mb=nan", "finite")),
    "zero-bucket-inf": (["strategy=zero2", "strategy.bucket_mb=inf"], ("strategy.bucket_mb=inf", "finite")),
    "manual-ddp-bucket-minus-inf": (
        ["strategy=manual_ddp", "strategy.bucket_mb=-inf"],
        ("strategy.bucket_mb=-inf", "finite"),
    ),
}
AS_A_PROCESS = {"profile-steps-negative"}  # the case through a fresh `python -m parallel_lab`
NUMERIC_TYPES = {"int", "float", "Optional[int]", "Optional[float]"}
NUMERIC_LISTS = {"trainer.betas", "plan.world_sizes"}  # untyped lists whose items are numbers


def _fields():
    for prefix, schema in RANGED_SECTIONS:
        for f in dataclasses.fields(schema):
            yield (f"{prefix}.{f.name}" if prefix else f.name), f


@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_out_of_range_is_one_line_before_anything_is_written(tmp_path, case):
    overrides, named = RANGE_CASES[case]
    run_dir = tmp_path / "run"
    result = run_cli(run_dir, *overrides, check=False, timeout=CLI_TIMEOUT, in_process=case not in AS_A_PROCESS)
    line = assert_one_clean_line(result, run_dir, named)
    assert result.returncode == 2 and "is out of range" in line, line
    assert not run_dir.exists(), f"{case}: {sorted(p.name for p in run_dir.iterdir())} written"


def test_every_numeric_key_declares_a_range_and_the_catalogue_tries_each():
    """A numeric key added without a Range, or a Range without a bad value above, fails here."""
    numeric = {key for key, f in _fields() if f.type in NUMERIC_TYPES or key in NUMERIC_LISTS}
    declared = {key for key, f in _fields() if RANGE in f.metadata}
    assert numeric - declared == set(), f"numeric keys without a Range: {sorted(numeric - declared)}"
    tried = {o.split("=")[0] for overrides, _ in RANGE_CASES.values() for o in overrides}
    tried -= {o for o in tried if o.startswith("strategy.")}
    assert declared - tried == set(), f"ranged keys the catalogue never tries: {sorted(declared - tried)}"


EDGES = [  # the bounds themselves are values a run takes: refusing them would be a bug too
    "trainer.momentum=0",
    "trainer.betas=[0,0.999999]",
    "trainer.eps=0",
    "trainer.seed=9223372036854775807",
    "trainer.warmup_steps=0",
    "trainer.eval_batches=0",
    "model.width=1000",
    "launcher.master_port=65535",
    "fault.rank=1",
    "fault.rank=-1",
    "world_size=64",
    "plan.world_sizes=[1,1024]",
]


@pytest.mark.parametrize("edge", EDGES)
def test_the_edges_of_each_range_pass(edge):
    from parallel_lab.config import compose_config
    from parallel_lab.config.validate import check_ranges

    check_ranges(compose_config([edge]))


def test_a_strategy_option_declares_its_range_without_importing_config():
    """strategies/ sit below config/: an Options field declares its Range as a plain dict in its
    metadata ("range"), and check_ranges reads it; an undeclared float option must be finite."""
    from omegaconf import OmegaConf

    from parallel_lab.config.validate import check_ranges
    from parallel_lab.errors import ConfigError

    @dataclasses.dataclass
    class Options:
        degree: int = dataclasses.field(default=2, metadata={"range": {"low": 1, "note": " (1 = off)"}})
        size_mb: float = 25.0
        label: str = "x"

    def with_strategy(**strategy):  # a plain config: the schema's strategy would refuse unknown keys
        return OmegaConf.create({**OmegaConf.to_container(compose_cfg()), "strategy": strategy})

    def refusal(**strategy) -> str:
        cfg = with_strategy(**strategy)
        with pytest.raises(ConfigError) as caught:
            check_ranges(cfg, Options)
        return str(caught.value)

    assert refusal(degree=0).startswith(
        "strategy.degree=0 is out of range; set strategy.degree to an integer >= 1 (1 = off)"
    )
    assert "strategy.size_mb=nan" in refusal(size_mb=float("nan"))
    check_ranges(with_strategy(degree=1, size_mb=0.5), Options)
