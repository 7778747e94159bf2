"""DeepSpeed config files as users write them, and the toolkit's reading of them, shared by the
unit tests of that reading and the runs that train on the files."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

ISSUE_13_DS_CONFIG = {  # DeepSpeed's CIFAR example as the issue quotes it
    "train_batch_size": 16,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 0,
        "allgather_bucket_size": 50000000,
        "reduce_bucket_size": 50000000,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "cpu_offload": False,
    },
}


def ds_file(folder: Path, content: dict, name: str = "ds_config.json") -> str:
    """content written as folder/name; its path."""
    path = folder / name
    path.write_text(json.dumps(content))
    return str(path)


def validated(folder: Path, *overrides: str) -> DictConfig:
    """The config a run in folder/run would get, validated as the parent does (the overrides given
    explicitly on the command line)."""
    from parallel_lab.config import compose_config, validate

    return validate(compose_config(list(overrides)), folder / "run", explicit=list(overrides))


# ----- issue 26: "auto" as the Hugging Face integration fills it -----
HF_ZERO3 = {  # the Hugging Face docs' ZeRO-3 offload config, as users copy it (auto = "the trainer decides")
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_STEPS, HF_BATCH, HF_LR = 4, 16, 1e-3
# The schedule's "auto" values come from trainer.lr_scheduler_params here (given wins over HF's rule:
# warm-up = trainer.warmup_steps); warming up from trainer.lr to trainer.lr keeps the rate constant,
# which the plain reference (constant-LR Adam) can mirror.
HF_RUN = (
    "world_size=2",
    f"trainer.steps={HF_STEPS}",
    f"trainer.global_batch={HF_BATCH}",
    f"trainer.lr={HF_LR}",
    "trainer.eval_batches=0",
    f"+trainer.lr_scheduler_params.warmup_min_lr={HF_LR}",
    "+trainer.lr_scheduler_params.warmup_num_steps=1",
)
HIDDEN = 256  # cnn's widest layer output (fc1.out_features): HF's hidden_size here
HF_RESOLVED = {  # key path -> (value, source) that config.yaml's ds_auto must show for HF_RUN
    "fp16.enabled": (False, "trainer.precision=fp32"),
    "bf16.enabled": (False, "trainer.precision=fp32"),
    "optimizer.params.lr": (HF_LR, "trainer.lr"),
    "optimizer.params.betas": ([0.9, 0.999], "trainer.betas"),
    "optimizer.params.eps": (1e-8, "trainer.eps"),
    "optimizer.params.weight_decay": (0.0, "trainer.weight_decay"),
    "scheduler.params.warmup_min_lr": (HF_LR, "trainer.lr_scheduler_params.warmup_min_lr"),
    "scheduler.params.warmup_max_lr": (HF_LR, "trainer.lr"),
    "scheduler.params.warmup_num_steps": (1, "trainer.lr_scheduler_params.warmup_num_steps"),
    "scheduler.params.total_num_steps": (HF_STEPS, "trainer.steps"),
    "zero_optimization.reduce_bucket_size": (HIDDEN**2, "hidden_size^2, hidden_size 256 (model=cnn fc1.out_features)"),
    "zero_optimization.stage3_prefetch_bucket_size": (
        int(0.9 * HIDDEN**2),
        "0.9 x hidden_size^2, hidden_size 256 (model=cnn fc1.out_features)",
    ),
    "zero_optimization.stage3_param_persistence_threshold": (
        10 * HIDDEN,
        "10 x hidden_size, hidden_size 256 (model=cnn fc1.out_features)",
    ),
    "gradient_accumulation_steps": (1, "trainer.grad_accum"),
    "gradient_clipping": (0.0, "trainer.grad_clip"),
    "train_batch_size": (HF_BATCH, "trainer.global_batch"),
    "train_micro_batch_size_per_gpu": (
        HF_BATCH // 2,
        f"trainer.global_batch {HF_BATCH} / (world_size 2 x trainer.grad_accum 1)",
    ),
}


def assert_resolved(cfg, key: str) -> None:
    """ds_auto shows every "auto" of the file with its value and source; the run uses those values."""
    table = {k: (v["value"], v["from"]) for k, v in cfg.ds_auto[key].items()}
    assert table == HF_RESOLVED
    t = cfg.trainer
    assert (t.optimizer, t.lr, list(t.betas), t.eps, t.weight_decay) == ("adamw", HF_LR, [0.9, 0.999], 1e-8, 0.0)
    assert (t.global_batch, t.grad_accum, t.grad_clip) == (HF_BATCH, 1, 0.0)
    assert t.lr_scheduler == "WarmupDecayLR"
    assert dict(t.lr_scheduler_params) == {
        "warmup_min_lr": HF_LR,
        "warmup_max_lr": HF_LR,
        "warmup_num_steps": 1,
        "total_num_steps": HF_STEPS,
    }
