"""How runs fail: the catalogue of bad inputs, and a crashing rank.

Every bad input goes through the real CLI and must give exactly one line
``parallel_lab: error: ...`` that names the bad value and says what to do instead, a non-zero exit,
no traceback, and a run folder that does not claim success (failed.json, no metrics.json, no
committed checkpoint).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parallel_lab.checkpoint import COMPLETE, checkpoint_name
from parallel_lab.comm.dist_env import cuda_gpus
from parallel_lab.config.resources import memory_available_bytes
from parallel_lab.data.cifar10 import TRAIN_MEMBERS
from parallel_lab.protocol import PIDS_DIR
from tests.support.cifar10_tarball import build_tarball, md5_of
from tests.support.cli import ROOT, assert_one_clean_line, run_cli
from tests.support.ds_configs import ISSUE_13_DS_CONFIG, ds_file
from tests.support.pickles import Evil

CLI_TIMEOUT = 120


def python_without(tmp: Path, packages: tuple[str, ...]) -> Path:
    """A virtualenv interpreter that sees this one's packages except `packages`, and whose bin/
    holds nothing but python (so no mpiexec, deepspeed or torchrun): a machine without them."""
    root = tmp / "venv"
    site = Path(next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)))
    new_site = root / site.relative_to(sys.prefix)
    new_site.mkdir(parents=True)
    (root / "bin").mkdir()
    shutil.copy(Path(sys.prefix) / "pyvenv.cfg", root / "pyvenv.cfg")
    (root / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    for entry in site.iterdir():
        if not entry.name.lower().startswith(packages):
            (new_site / entry.name).symlink_to(entry)
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory):
    """checkpoint_of(tmp, strategy): a fresh copy, under tmp, of the step-2 checkpoint of a short
    run of strategy; the run itself happens once per module."""
    built: dict[str, Path] = {}

    def copy(tmp: Path, strategy: str = "single") -> Path:
        if strategy not in built:
            source = tmp_path_factory.mktemp(f"source_{strategy}")
            run_cli(
                source,
                f"strategy={strategy}",
                "trainer.steps=2",
                "trainer.checkpoint_every=2",
                "trainer.global_batch=16",
                "data.size=64",
                "trainer.eval_batches=0",
                timeout=CLI_TIMEOUT,
            )
            built[strategy] = source / "checkpoints"
        shutil.copytree(built[strategy], tmp / "source" / "checkpoints")
        return tmp / "source" / "checkpoints" / checkpoint_name(2)

    return copy


def corrupt_checkpoint(tmp: Path, checkpoint_of) -> list[str]:
    folder = checkpoint_of(tmp)
    weights = folder / "model_optimizer.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit-pattern in the middle: same size, wrong content
    weights.write_bytes(bytes(data))
    return [f"trainer.resume={folder}"]


def incomplete_checkpoint(tmp: Path, checkpoint_of) -> list[str]:
    folder = checkpoint_of(tmp)
    (folder / COMPLETE).unlink()  # as if the writer died before committing
    return [f"trainer.resume={folder}"]


def other_strategy_checkpoint(tmp: Path, checkpoint_of) -> list[str]:
    return ["strategy=ddp", f"trainer.resume={checkpoint_of(tmp, 'single')}"]


def finished_checkpoint_dir(tmp: Path, checkpoint_of) -> list[str]:
    return [
        f"trainer.checkpoint_dir={checkpoint_of(tmp).parent}",
        "trainer.steps=2",
        "trainer.global_batch=16",
        "data.size=64",
        "strategy=single",
    ]


def _init_from_file(name: str, content: bytes):
    """trainer.init_from=<tmp>/<name> holding content."""

    def make(tmp: Path, _) -> list[str]:
        (tmp / name).write_bytes(content)
        return [f"trainer.init_from={tmp / name}"]

    return make


def init_from_other_model(tmp: Path, _) -> list[str]:
    """A torch.save state dict of the cnn, into a resnet18 run."""
    import torch

    from parallel_lab.models.cnn import SmallCNN

    torch.save(SmallCNN().state_dict(), tmp / "cnn.pt")
    return ["model=resnet18", f"trainer.init_from={tmp / 'cnn.pt'}"]


def init_optimizer_without_adam_state(tmp: Path, _) -> list[str]:
    from safetensors.torch import save_file

    from parallel_lab.models.cnn import SmallCNN

    save_file(SmallCNN().state_dict(), tmp / "model.safetensors")
    return [f"trainer.init_from={tmp / 'model.safetensors'}", "trainer.init_optimizer=true"]


def reused_checkpoint_dir(tmp: Path, checkpoint_of) -> list[str]:
    return [f"trainer.checkpoint_dir={checkpoint_of(tmp).parent}", "trainer.resume=never"]


def checkpoints_parent_folder(tmp: Path, checkpoint_of) -> list[str]:
    return [f"trainer.resume={checkpoint_of(tmp).parent}"]


def resume_beside_other_checkpoints(tmp: Path, checkpoint_of) -> list[str]:
    folder = checkpoint_of(tmp)
    shutil.copytree(folder, tmp / "other" / checkpoint_name(1))  # a restart could pick this one up
    return [
        f"trainer.resume={folder}",
        f"trainer.checkpoint_dir={tmp / 'other'}",
        "strategy=single",
        "trainer.global_batch=16",
        "data.size=64",
    ]


def tampered_tarball(tmp: Path, _checkpoint_of=None) -> list[str]:
    build_tarball(tmp)  # the expected md5 is the real CIFAR-10's: this file does not match it
    return ["data=cifar10", f"data.root={tmp}"]


def truncated_tarball(tmp: Path, _checkpoint_of=None) -> list[str]:
    path = build_tarball(tmp)
    path.write_bytes(path.read_bytes()[:300])
    return ["data=cifar10", f"data.root={tmp}", "data.md5=null"]


def evil_pickle_tarball(tmp: Path, _checkpoint_of=None) -> list[str]:
    path = build_tarball(tmp, {TRAIN_MEMBERS[0]: pickle.dumps({b"data": Evil()}, protocol=2)})
    return ["data=cifar10", f"data.root={tmp}", f"data.md5={md5_of(path)}"]


def garbage_member_tarball(tmp: Path, _checkpoint_of=None) -> list[str]:
    """A readable tar.gz whose first batch is not a pickle at all, vouched for by its own md5."""
    path = build_tarball(tmp, {TRAIN_MEMBERS[0]: b"\x80\x02not a pickle"})
    return ["data=cifar10", f"data.root={tmp}", f"data.md5={md5_of(path)}"]


def ds_config_disagreeing(tmp: Path, _checkpoint_of=None) -> list[str]:
    path = tmp / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 2}}))
    return ["strategy=zero2", "trainer.global_batch=32", f"strategy.ds_config={path}"]


def ds_config_refused_by_deepspeed(tmp: Path, _checkpoint_of=None) -> list[str]:
    batch = {"train_batch_size": 15, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    return ["strategy=zero2", f"strategy.ds_config={ds_file(tmp, batch)}"]


def ds_config_unknown_optimizer(tmp: Path, _checkpoint_of=None) -> list[str]:
    content = {"train_batch_size": 32, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    return ["strategy=zero1", f"strategy.ds_config={ds_file(tmp, content)}"]


def ds_config_unknown_scheduler(tmp: Path, _checkpoint_of=None) -> list[str]:
    content = {"train_batch_size": 32, "scheduler": {"type": "WarmupFoo", "params": {}}}
    return ["strategy=zero1", f"strategy.ds_config={ds_file(tmp, content)}"]


def ds_config_scheduler_params(tmp: Path, _checkpoint_of=None) -> list[str]:
    scheduler = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}  # total_num_steps missing
    content = {"train_batch_size": 32, "scheduler": scheduler, "zero_optimization": {"stage": 1}}
    return ["strategy=zero1", f"strategy.ds_config={ds_file(tmp, content)}"]


def ds_config_stage_contradicts(tmp: Path, _checkpoint_of=None) -> list[str]:
    return ["strategy=zero1", f"strategy.ds_config={ds_file(tmp, {'zero_optimization': {'stage': 3}})}"]


def ds_config_fp16_on_cpu(tmp: Path, _checkpoint_of=None) -> list[str]:
    return ["strategy=zero2", "device=cpu", f"strategy.ds_config={ds_file(tmp, {'fp16': {'enabled': True}})}"]


def recipe_fp16_on_single(tmp: Path, _checkpoint_of=None) -> list[str]:
    """A recipe's fp16 handed to strategy.precision, whose choices have none (device=cuda: on CPU
    the file's fp16 is refused before it is handed on)."""
    return ["strategy=single", "device=cuda", f"trainer.recipe={ds_file(tmp, {'fp16': {'enabled': True}})}"]


def ds_config_many_conflicts(tmp: Path, _checkpoint_of=None) -> list[str]:
    path = ds_file(tmp, ISSUE_13_DS_CONFIG)
    overrides = ["trainer.global_batch=32", "trainer.grad_clip=0", "strategy.precision=fp32"]
    return ["strategy=zero2", f"strategy.ds_config={path}", *overrides]


def more_ranks_than_memory(tmp: Path, _checkpoint_of=None) -> list[str]:
    """64 ranks of 200000 synthetic images, ~7 GiB each: more than any test machine holds. Skipped where
    it would fit or cannot be checked (no /proc/meminfo), since there the run would really start 64 workers."""
    available = memory_available_bytes()
    if available is None or available > 64 * 7 * 2**30:
        pytest.skip(f"the memory check cannot refuse 64 x 7 GiB here (MemAvailable {available} bytes)")
    return ["world_size=64", "data.size=200000"]


def uneven_hostfile(tmp: Path, _checkpoint_of=None) -> list[str]:
    path = tmp / "hostfile"
    path.write_text("node0 slots=1\nnode1 slots=2\n")
    return ["launcher=deepspeed", f"launcher.hostfile={path}", "world_size=3"]


# id: (overrides or a function building them in tmp_path, text(s) the error line must contain)
CATALOGUE = {
    "unknown-strategy": (["strategy=nope"], "nope"),
    "unknown-model": (["model=vgg"], "vgg"),
    "model-width-0": (["model.width=0"], ("model.width=0", "model.width=1")),
    "unknown-data": (["data=imagenet"], "imagenet"),
    "unknown-launcher": (["launcher=pbs"], "pbs"),
    "unknown-key": (["trainer.stepz=3"], "stepz"),
    "hosts-world-size": (
        ["launcher=torchrun", "launcher.hosts=[node0,node1]", "launcher.nproc_per_node=2"],
        ("world_size=2", "2 x 2 = 4"),
    ),
    "hosts-with-spawn": (["launcher.hosts=[node0,node1]"], ("launcher=spawn", "launcher=torchrun")),
    "hosts-and-hostfile": (
        ["launcher=mpirun", "launcher.hosts=[node0,node1]", "launcher.hostfile=/etc/hostname"],
        "launcher.hostfile=/etc/hostname",
    ),
    "hostfile-missing": (["launcher=mpirun", "launcher.hostfile=/nonexistent/hosts"], "/nonexistent/hosts"),
    "hostfile-uneven-slots": (uneven_hostfile, "[1, 2]"),
    "hosts-repeated": (["launcher=torchrun", "launcher.hosts=[node0,node0]"], "['node0', 'node0']"),
    "master-addr-loopback-on-hosts": (
        ["launcher=torchrun", "launcher.hosts=[node0,node1]", "launcher.master_addr=127.0.0.1"],
        "launcher.master_addr=127.0.0.1",
    ),
    "ds-runner-mpich": (
        ["launcher=deepspeed", "strategy=zero2", "launcher.hosts=[node0,node1]", "launcher.ds_runner=mpich"],
        "launcher.ds_runner=mpich",
    ),
    "host-unreachable": (
        ["launcher=torchrun", "launcher.hosts=[node0,node1]", "launcher.remote_shell=false"],
        ("cannot reach host 'node0'", "launcher.remote_shell=null"),
    ),
    "wrong-type-int": (["trainer.steps=ten"], "'ten'"),
    "wrong-type-float": (["trainer.lr=fast"], "'fast'"),
    "override-syntax": (["trainer.steps=[1"], "[1"),
    "zero-stage-5": (["strategy=zero3", "strategy.stage=5"], "strategy.stage=5"),
    "zero4": (["strategy=zero4"], "zero4"),
    "offload-with-zero0": (["strategy=zero0", "strategy.offload=cpu"], "strategy.offload=cpu"),
    "fp16-on-cpu": (["strategy=zero2", "strategy.precision=fp16", "device=cpu"], "strategy.precision=fp16"),
    "precision-unknown": (["trainer.precision=fp8"], ("trainer.precision=fp8", "use trainer.precision=fp32 or bf16")),
    "precision-bf16-on-dp": (["strategy=dp", "trainer.precision=bf16"], ("strategy=dp has no bf16 mode",)),
    "precision-bf16-on-pp-deepspeed": (
        ["strategy=pp", "strategy.impl=deepspeed", "trainer.precision=bf16"],
        ("strategy.precision=bf16 with strategy=pp strategy.impl=deepspeed", "use strategy.impl=manual"),
    ),
    "precision-bf16-on-tp-dtensor": (
        ["strategy=tp", "strategy.impl=dtensor", "trainer.precision=bf16"],
        ("strategy.precision=bf16 with strategy=tp strategy.impl=dtensor",),
    ),
    "precision-contradicts-strategy": (
        ["strategy=zero2", "trainer.precision=bf16", "strategy.precision=fp32"],
        "strategy.precision=fp32",
    ),
    "single-precision-unknown": (
        ["strategy=single", "strategy.precision=fp16"],
        ("strategy.precision=fp16", "use strategy.precision=fp32 or bf16"),
    ),
    "ddp-precision-unknown": (
        ["strategy=ddp", "strategy.precision=fp8"],
        ("strategy.precision=fp8", "use strategy.precision=fp32 or bf16"),
    ),
    "zero-precision-unknown": (
        ["strategy=zero2", "strategy.precision=fp8"],
        ("strategy.precision=fp8", "use strategy.precision=fp32, bf16 or fp16"),
    ),
    "zero-offload-unknown": (
        ["strategy=zero2", "strategy.offload=nvme"],
        ("strategy.offload=nvme", "use strategy.offload=none or cpu"),
    ),
    "fsdp-sharding-unknown": (
        ["strategy=fsdp", "strategy.sharding=half"],
        ("strategy.sharding=half", "use strategy.sharding=full, grad_op, no_shard or hybrid"),
    ),
    "fsdp-mixed-precision-unknown": (
        ["strategy=fsdp", "strategy.mixed_precision=fp16"],
        ("strategy.mixed_precision=fp16", "use strategy.mixed_precision=fp32 or bf16"),
    ),
    "pp-schedule-unknown": (
        ["strategy=pp", "strategy.schedule=zb"],
        ("strategy.schedule=zb", "use strategy.schedule=gpipe, 1f1b, interleaved_1f1b or zero_bubble"),
    ),
    "pp-impl-unknown": (
        ["strategy=pp", "strategy.impl=dtensor"],
        ("strategy.impl=dtensor", "use strategy.impl=manual, torch or deepspeed"),
    ),
    "tp-impl-unknown": (
        ["strategy=tp", "strategy.impl=torch"],
        ("strategy.impl=torch", "use strategy.impl=manual, dtensor or deepspeed"),
    ),
    "ds-config-batch": (ds_config_disagreeing, "train_batch_size=64"),
    "fsdp-hybrid": (["strategy=fsdp", "strategy.sharding=hybrid"], ("strategy.sharding=hybrid", "strategy.replicate=")),
    "tp-dp-degree": (
        ["strategy=tp", "strategy.replicate=2"],
        ("strategy.replicate=2 x strategy.tp=2 = 4", "world_size=2"),
    ),
    "ds-config-refused-by-deepspeed": (ds_config_refused_by_deepspeed, ("refused by DeepSpeed", "15 != 4 * 2 * 2")),
    "ds-config-unknown-optimizer": (ds_config_unknown_optimizer, ("optimizer.type=Lamb", "Adam, AdamW or SGD")),
    "ds-config-unknown-scheduler": (ds_config_unknown_scheduler, ("WarmupFoo", "WarmupLR")),
    "ds-config-scheduler-params": (ds_config_scheduler_params, ("WarmupDecayLR", "total_num_steps")),
    "ds-config-stage-contradicts": (ds_config_stage_contradicts, ("zero_optimization.stage=3", "use strategy=zero3")),
    "ds-config-fp16-on-cpu": (ds_config_fp16_on_cpu, ("fp16.enabled", "bf16")),
    "ds-config-recipe-fp16-on-single": (
        recipe_fp16_on_single,
        ("strategy.precision=fp16", "use strategy.precision=fp32 or bf16", "set by trainer.recipe="),
    ),
    "ds-config-conflicts-at-once": (
        ds_config_many_conflicts,
        (
            "train_batch_size=16 vs trainer.global_batch=32",
            "gradient_clipping=1.0 vs trainer.grad_clip=0",
            "bf16.enabled=true vs strategy.precision=fp32",
            "zero_optimization.stage=0 vs strategy=zero2",
            "strategy=zero0",
        ),
    ),
    "deepspeed-flag-vs-strategy": (["--deepspeed", "strategy=ddp"], ("--deepspeed", "strategy=ddp")),
    "world-size-0": (["world_size=0"], "world_size=0"),
    "master-port-beyond-16-bits": (["launcher.master_port=70000"], ("launcher.master_port=70000", "65536")),
    "eval-batches-negative": (["trainer.eval_batches=-1"], ("trainer.eval_batches=-1", "trainer.eval_batches=2")),
    "world-size-1000": (["world_size=1000"], "world_size=1000"),
    "world-size-beyond-memory": (more_ranks_than_memory, ("world_size=64 needs about 64 x", "GiB available")),
    "batch-not-divisible": (["trainer.global_batch=33"], "global_batch=33"),
    "grad-accum-not-dividing": (["trainer.global_batch=32", "trainer.grad_accum=3"], "grad_accum=3"),
    "tp-degree": (["strategy=tp", "strategy.tp=3", "world_size=3"], ("strategy.tp=3", "256", "fc1")),
    "tp-gpt-kv-heads": (
        ["strategy=tp", "model=gpt", "data=tokens", "model.kv_heads=1"],
        ("strategy.tp=2 does not divide model.kv_heads=1", "use a strategy.tp that divides 1"),
    ),
    "pp-stages": (["strategy=pp", "world_size=6", "strategy.stages=6"], ("strategy.stages=6", "5 cuttable blocks")),
    "pp-virtual-stages": (
        ["strategy=pp", "model=vit", "strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=4"],
        ("strategy.stages=2 x strategy.virtual_stages=4", "6 cuttable blocks"),
    ),
    "pp-schedule-impl": (
        ["strategy=pp", "strategy.impl=deepspeed", "strategy.schedule=zero_bubble"],
        ("strategy.schedule=zero_bubble", "strategy.impl=deepspeed", "use strategy.impl=manual"),
    ),
    "pp-microbatches": (
        ["strategy=pp", "strategy.microbatches=3", "trainer.global_batch=32"],
        ("strategy.microbatches=3", "32"),
    ),
    "manual-ddp-allreduce": (
        ["strategy=manual_ddp", "strategy.allreduce=tree"],
        ("strategy.allreduce=tree", "use strategy.allreduce=star, ring, builtin or mpi"),
    ),
    "manual-ddp-bucket": (["strategy=manual_ddp", "strategy.bucket_mb=-5"], "strategy.bucket_mb=-5"),
    # MPI's COMM_WORLD exists only when mpiexec started the ranks; mpi4py reduces host memory only.
    "manual-ddp-mpi-spawn": (
        ["strategy=manual_ddp", "strategy.allreduce=mpi"],
        ("strategy.allreduce=mpi", "launcher=spawn", "add launcher=mpirun"),
    ),
    "manual-ddp-mpi-cuda": (
        ["strategy=manual_ddp", "strategy.allreduce=mpi", "launcher=mpirun", "device=cuda"],
        ("strategy.allreduce=mpi", "device=cuda", "device=cpu"),
    ),
    "ddp-bucket": (["strategy.bucket_cap_mb=0"], "bucket_cap_mb=0"),
    "device": (["device=tpu"], ("device=tpu", "use device=auto, cpu or cuda")),
    # NCCL refuses two ranks on one GPU: more ranks than visible GPUs (none here) is refused up front.
    "device-cuda-too-few-gpus": (
        lambda tmp_path, _: ["device=cuda", f"world_size={cuda_gpus() + 1}"],
        ("device=cuda", "device=cpu"),
    ),
    "optimizer": (["trainer.optimizer=lbfgs"], ("trainer.optimizer=lbfgs", "use trainer.optimizer=adam, adamw or sgd")),
    "checkpoint-every": (["trainer.checkpoint_every=-1"], "checkpoint_every=-1"),
    "keep-checkpoints": (["trainer.keep_checkpoints=0"], "keep_checkpoints=0"),
    "fault-mode": (["fault.mode=explode"], ("fault.mode=explode", "use fault.mode=raise or kill")),
    "fault-at": (["fault.at=never"], ("fault.at=never", "use fault.at=step or checkpoint")),
    "fault-at-no-checkpoint": (
        ["fault.rank=0", "fault.at=checkpoint", "fault.step=3", "trainer.checkpoint_every=2"],
        "fault.step=3",
    ),
    "max-restarts-without-torchrun": (["launcher.max_restarts=2"], "launcher.max_restarts=2"),
    "max-restarts-negative": (["launcher=torchrun", "launcher.max_restarts=-1"], ("launcher.max_restarts=-1", ">= 0")),
    "grace-s-zero": (["launcher.grace_s=0"], ("launcher.grace_s=0", "> 0")),
    "dist-timeout-zero": (["dist_timeout_s=0"], "dist_timeout_s=0"),
    "lr-negative": (["trainer.lr=-1"], ("trainer.lr=-1", "> 0")),
    "lr-zero": (["trainer.lr=0"], ("trainer.lr=0", "> 0")),
    "lr-nan": (["trainer.lr=nan"], ("trainer.lr=nan", "finite")),
    "lr-inf": (["trainer.lr=inf"], ("trainer.lr=inf", "finite")),
    "weight-decay-negative": (["trainer.weight_decay=-0.1"], ("trainer.weight_decay=-0.1", ">= 0")),
    "weight-decay-nan": (["trainer.weight_decay=nan"], ("trainer.weight_decay=nan", "finite")),
    "grad-clip-nan": (["trainer.grad_clip=nan"], ("trainer.grad_clip=nan", "finite")),
    "sgd-momentum-1": (["trainer.optimizer=sgd", "trainer.momentum=1"], ("trainer.momentum=1", "[0, 1)")),
    "sgd-momentum-negative": (["trainer.optimizer=sgd", "trainer.momentum=-0.5"], ("trainer.momentum=-0.5", "[0, 1)")),
    "threads-zero": (["trainer.threads=0"], ("trainer.threads=0", "trainer.threads=null")),
    "cifar-no-root": (["data=cifar10"], "data.root"),
    "cifar-missing-tarball": (["data=cifar10", "data.root=/nonexistent"], "/nonexistent"),
    "cifar-tampered-tarball": (tampered_tarball, "md5"),
    "cifar-truncated-tarball": (truncated_tarball, "cifar-10-python.tar.gz"),
    "cifar-disallowed-pickle-global": (evil_pickle_tarball, "not allowed"),
    "cifar-garbage-member": (garbage_member_tarball, ("data_batch_1", "was refused")),
    "resume-missing": (["trainer.resume=/nonexistent/step_00000002"], "/nonexistent/step_00000002"),
    "resume-corrupt-checkpoint": (corrupt_checkpoint, "sha256"),
    "resume-incomplete-checkpoint": (incomplete_checkpoint, "incomplete"),
    "resume-other-strategy": (other_strategy_checkpoint, "strategy=single"),
    "resume-finished-run": (finished_checkpoint_dir, "already at step 2"),
    "never-into-used-checkpoint-dir": (reused_checkpoint_dir, "already holds step_00000002"),
    "resume-parent-folder": (checkpoints_parent_folder, "step_00000002"),
    "resume-beside-other-checkpoints": (resume_beside_other_checkpoints, "already holds step_00000001"),
    "init-from-unknown-format": (
        _init_from_file("weights.bin", b"GGUF not ours at all"),
        ("weights.bin", "unknown format", "point trainer.init_from at"),
    ),
    "init-from-not-what-it-claims": (
        _init_from_file("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"),
        ("model.safetensors", "not a readable safetensors checkpoint"),
    ),
    "init-from-disallowed-pickle-global": (
        _init_from_file("evil.pt", pickle.dumps(Evil())),
        ("evil.pt", "not a readable torch checkpoint", "weights_only=True) refused it"),
    ),
    "init-from-other-model": (init_from_other_model, ("cnn.pt", "does not fit model=resnet18")),
    "init-from-missing": (["trainer.init_from=/nonexistent/w.pt"], ("/nonexistent/w.pt", "does not exist")),
    "init-optimizer-without-init-from": (["trainer.init_optimizer=true"], ("trainer.init_optimizer=true", "add")),
    "init-optimizer-no-adam-state": (
        init_optimizer_without_adam_state,
        ("no Adam state", "drop trainer.init_optimizer"),
    ),
    "init-from-and-resume": (
        ["trainer.init_from=/x.pt", "trainer.resume=/y"],
        ("trainer.init_from=/x.pt", "trainer.resume=/y", "keep one"),
    ),
    "min-nodes-without-torchrun": (
        ["launcher.min_nodes=1"],
        ("launcher.min_nodes=1", "launcher=spawn", "add launcher=torchrun"),
    ),
    "min-nodes-beyond-hosts": (
        ["launcher=torchrun", "launcher.hosts=[node0,node1]", "launcher.min_nodes=3"],
        ("launcher.min_nodes=3", "2 host(s)", "at most 2"),
    ),
    "min-nodes-batch-not-split": (
        [
            "launcher=torchrun",
            "launcher.hosts=[a,b,c]",
            "world_size=3",
            "launcher.min_nodes=2",
            "trainer.global_batch=33",
            "trainer.checkpoint_every=5",
        ],
        ("launcher.min_nodes=2", "2 ranks", "trainer.global_batch=33"),
    ),
    "min-nodes-no-checkpoints": (
        ["launcher=torchrun", "launcher.hosts=[node0,node1]", "launcher.min_nodes=1"],
        ("launcher.min_nodes=1", "trainer.checkpoint_every=0", "set trainer.checkpoint_every"),
    ),
    "profile-steps-0": (["trainer.profile=true", "trainer.profile_steps=0"], ("trainer.profile_steps=0", ">= 1")),
    "profile-steps-past-the-run": (
        ["trainer.profile=true", "trainer.steps=3", "trainer.profile_steps=2"],
        ("trainer.profile_steps=2", "trainer.steps to 4"),
    ),
}

# A value outside a typed key's choices (choices.py): refused in one line before anything starts.
BAD_CHOICE = {
    "precision-unknown",
    "single-precision-unknown",
    "ddp-precision-unknown",
    "zero-precision-unknown",
    "zero-offload-unknown",
    "fsdp-sharding-unknown",
    "fsdp-mixed-precision-unknown",
    "pp-schedule-unknown",
    "pp-impl-unknown",
    "tp-impl-unknown",
    "manual-ddp-allreduce",
    "device",
    "optimizer",
    "fault-mode",
    "fault-at",
    "ds-config-recipe-fp16-on-single",
}
# A damaged or foreign CIFAR-10 tarball: its md5 and members are checked in the parent (issue 32 item 6).
CIFAR_TARBALLS = {
    "cifar-tampered-tarball",
    "cifar-truncated-tarball",
    "cifar-disallowed-pickle-global",
    "cifar-garbage-member",
}
# Refused by validate() in the parent: no worker may have started (each writes pids/rank<k>.pid first).
REFUSED_BEFORE_WORKERS = {
    *BAD_CHOICE,
    "init-from-unknown-format",
    "init-from-not-what-it-claims",
    "init-from-disallowed-pickle-global",
    "init-from-other-model",
    "init-from-missing",
    "init-optimizer-without-init-from",
    "init-optimizer-no-adam-state",
    "init-from-and-resume",
    "min-nodes-without-torchrun",
    "min-nodes-beyond-hosts",
    "min-nodes-batch-not-split",
    "min-nodes-no-checkpoints",
    "profile-steps-0",
    "profile-steps-past-the-run",
    "device-cuda-too-few-gpus",
    "manual-ddp-mpi-spawn",
    "manual-ddp-mpi-cuda",
    "fsdp-hybrid",
    "tp-dp-degree",
    "hosts-world-size",
    "hosts-with-spawn",
    "hosts-and-hostfile",
    "hostfile-missing",
    "hostfile-uneven-slots",
    "hosts-repeated",
    "master-addr-loopback-on-hosts",
    "host-unreachable",
    "ds-runner-mpich",
    "max-restarts-negative",
    "grace-s-zero",
    "dist-timeout-zero",
    "lr-negative",
    "lr-zero",
    "lr-nan",
    "lr-inf",
    "weight-decay-negative",
    "weight-decay-nan",
    "grad-clip-nan",
    "sgd-momentum-1",
    "sgd-momentum-negative",
    "threads-zero",
    "world-size-beyond-memory",
    "ds-config-refused-by-deepspeed",
    "ds-config-conflicts-at-once",
    "master-port-beyond-16-bits",
    "eval-batches-negative",
    *CIFAR_TARBALLS,
}
# Refused before Hydra makes the run folder: not even failed.json is written.
NOTHING_WRITTEN = {"master-port-beyond-16-bits", "eval-batches-negative", "lr-nan", *BAD_CHOICE, *CIFAR_TARBALLS}


# These go through a fresh `python -m parallel_lab` process (exit status, stderr as a user sees them);
# the rest call the same main() in this process: each is refused in the parent before anything starts,
# so a new interpreter per case (~3 s of imports on 2 cores) would prove nothing more.
# One per place a refusal can come from: Hydra's choice and type checks, the validation before the
# run folder exists, and a file read in the parent.
AS_A_PROCESS = {
    "unknown-strategy",
    "wrong-type-int",
    "lr-nan",
    "resume-corrupt-checkpoint",
}


@pytest.mark.parametrize("case", list(CATALOGUE))
def test_bad_input_catalogue(tmp_path, checkpoint_of, case):
    overrides, named = CATALOGUE[case]
    if callable(overrides):
        overrides = overrides(tmp_path, checkpoint_of)
    run_dir = tmp_path / "run"
    result = run_cli(run_dir, *overrides, check=False, timeout=CLI_TIMEOUT, in_process=case not in AS_A_PROCESS)
    line = assert_one_clean_line(result, run_dir, named)
    if case in REFUSED_BEFORE_WORKERS:
        assert result.returncode == 2 and not (run_dir / PIDS_DIR).exists(), "a worker started"
    if case.startswith("ds-config"):  # a refused DeepSpeed file: one line a reader takes in (issue 26)
        assert len(line) < 300, f"{len(line)} characters: {line}"
    if case in NOTHING_WRITTEN:
        assert not run_dir.exists(), f"{case}: {sorted(p.name for p in run_dir.iterdir())} written"


def test_port_already_in_use(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(tmp_path / "run", f"launcher.master_port={port}", check=False, timeout=CLI_TIMEOUT)
    assert_one_clean_line(result, tmp_path / "run", f"launcher.master_port={port}")


@pytest.mark.parametrize(
    "missing, overrides, named",
    [
        (("mpi4py", "mpich"), ["launcher=mpirun"], "mpiexec"),
        (("deepspeed",), ["strategy=zero2"], "DeepSpeed"),
        (("deepspeed",), ["launcher=deepspeed"], "deepspeed"),
    ],
)
def test_missing_tool_or_package(tmp_path, missing, overrides, named):
    python = python_without(tmp_path, missing)
    run_dir = tmp_path / "run"
    cmd = [str(python), "-m", "parallel_lab", f"hydra.run.dir={run_dir}", "trainer.progress=false", *overrides]
    env = {**os.environ, "PATH": f"{python.parent}:/usr/bin:/bin"}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT, env=env)
    assert_one_clean_line(result, run_dir, named)


# ----- a crashing rank -----


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="ignore"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize(
    "launcher, mode",
    [
        ("spawn", "raise"),
        # torchrun's agent ends every rank the same way for a raise as for a kill (below)
        pytest.param("torchrun", "raise", marks=pytest.mark.extra),
        ("torchrun", "kill"),
        pytest.param("spawn", "kill", marks=pytest.mark.extra),
    ],
)
def test_one_failing_rank_ends_every_rank_quickly(tmp_path, launcher, mode):
    run_dir = tmp_path / "run"
    result = run_cli(
        run_dir,
        "strategy=ddp",
        "trainer.steps=200",
        "fault.rank=1",
        "fault.step=2",
        f"fault.mode={mode}",
        f"launcher={launcher}",
        check=False,
        timeout=CLI_TIMEOUT,
    )
    ended = time.time()
    assert result.returncode != 0
    assert not (run_dir / "metrics.json").exists() and (run_dir / "failed.json").exists()
    assert result.stderr.strip().splitlines()[-1].startswith("parallel_lab: error:"), result.stderr[-3000:]
    pids = [int(p.read_text()) for p in (run_dir / "pids").glob("rank*.pid")]
    assert len(pids) == 2 and not [pid for pid in pids if _alive(pid)], "a worker outlived the run"
    assert _processes_mentioning(str(run_dir)) == []
    if mode == "raise":
        # Rank 1 wrote its traceback (errors/rank1.txt) when it raised: every rank ended within 30 s of it.
        raised_at = float((run_dir / "errors" / "rank1.txt").read_text().split()[0])
        assert ended - raised_at < 30
        assert result.stderr.count("raise InjectedFault(") == 1, result.stderr[-3000:]  # its traceback, once
        assert "rank 1 failed: InjectedFault" in result.stderr.strip().splitlines()[-1]
