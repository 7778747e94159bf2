"""The DeepSpeed config of a ZeRO run, generated from the Hydra config so every strategy trains the same.

Every batch setting comes from ``trainer.*``: ``train_batch_size = trainer.global_batch``,
``gradient_accumulation_steps = trainer.grad_accum``, ``train_micro_batch_size_per_gpu =
global_batch / world_size / grad_accum``, and ``gradient_clipping = trainer.grad_clip`` (DeepSpeed's
own default is 1.0; 0 here means off, as for every strategy). A user's ``strategy.ds_config=<file>``
is taken whole: the parent first turns what it sets into those trainer/strategy settings
(``parallel_lab/strategies/zero/ds_file.py``, refusing explicit command-line values that contradict it), and
here the file is the base of the config DeepSpeed gets, its optimizer and scheduler sections
replaced by the equivalent torch optimizer and schedule that every strategy runs.
"""

from __future__ import annotations

from omegaconf import DictConfig

# Bytes per element of each precision, by every name DeepSpeed and strategy.precision give it.
DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "half": 2, "bf16": 2, "bfloat16": 2}


def micro_batch(cfg: DictConfig) -> int:
    t = cfg.trainer
    return t.global_batch // (cfg.world_size * t.grad_accum)


def build_ds_config(cfg: DictConfig, opts: DictConfig) -> dict:
    """The DeepSpeed config for this run, every batch setting taken from ``trainer.*``."""
    t = cfg.trainer
    bucket = int(opts.bucket_mb * 2**20 / DTYPE_BYTES[opts.precision])
    zero: dict = {
        "stage": opts.stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if opts.stage == 1 and not (opts.get("ep") or 1) > 1:
        # ZeRO-1 as in the paper: gradients stay whole during backward and are reduced once at
        # the accumulation boundary (no per-bucket hooks; those make stage 1 behave like 2).
        # Not under strategy.ep: that path (allreduce_bucket, 0.19.8) divides the experts'
        # gradients by their expert-data-parallel size instead of the data-parallel size, ep times
        # too large (measured: zero1 ep=2 failed parity at 195x the envelope; with DeepSpeed's
        # default contiguous gradients it passes, as zero0 and zero2 do).
        zero.update(contiguous_gradients=False, overlap_comm=False)
    if opts.stage == 3:
        # Partition every parameter (DeepSpeed keeps ones below 100k elements whole by default,
        # which on resnet18 would leave most of the small convs replicated).
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=bucket)
    if opts.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        if opts.stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    ds = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": micro_batch(cfg),
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # the toolkit's torch optimizer also drives offload
        "zero_allow_untested_optimizer": True,  # torch SGD as the client optimizer
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if opts.precision != "fp32":
        ds[opts.precision] = {"enabled": True}
    if opts.ds_config:
        from parallel_lab.strategies.zero.ds_auto import apply_ds_auto, recorded

        # the file with each "auto" as the parent resolved it (config.yaml's ds_auto)
        user = apply_ds_auto(load_user_config(opts.ds_config), recorded(cfg, "strategy.ds_config"))
        ds = with_user_file(user, ds)
    return ds


# Sections the worker hands to DeepSpeed as objects instead: the torch optimizer with the file's
# hyper-parameters (trainer.*) and its schedule (trainer.lr_scheduler), stepped by the training loop.
HANDED_OVER = ("optimizer", "scheduler")
# Legacy offload flags and the keys that replace them: set one, never both.
LEGACY_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}


def load_user_config(path: str) -> dict:
    from parallel_lab.strategies.zero.ds_file import read_ds_file

    return read_ds_file("strategy.ds_config", path)


def with_user_file(user: dict, ours: dict) -> dict:
    """The user's file as DeepSpeed will run it. The parent (parallel_lab/strategies/zero/ds_file.py) has
    already made the trainer and strategy settings equal to what the file sets, so the generated
    batch, clipping and precision keys agree with it; the file's own ZeRO keys (buckets,
    overlap_comm, ...) win over the generated defaults."""
    merged = {k: v for k, v in user.items() if k not in HANDED_OVER}
    merged.update({k: v for k, v in ours.items() if k not in ("zero_optimization", "bf16", "fp16")})
    zero = dict(ours["zero_optimization"])
    user_zero = dict(user.get("zero_optimization") or {})
    for legacy, current in LEGACY_OFFLOAD.items():
        if legacy in user_zero:
            zero.pop(current, None)
    merged["zero_optimization"] = {**zero, **user_zero}
    for precision in ("bf16", "fp16"):
        section = {**(user.get(precision) or {}), **(ours.get(precision) or {"enabled": False})}
        if precision in user or precision in ours:
            merged[precision] = section
    return merged
