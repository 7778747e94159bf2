"""Models: plain single-device networks (CIFAR-10 classifiers and a GPT on token data). They know
nothing of parallelism.

All are ``nn.Sequential`` of coarse blocks, which is all a pipeline strategy needs to cut them into
contiguous stages, and all a tensor-parallel strategy needs to find the layers it splits.

This package's root is torch-free (``specs.py``: the names, the sizes and their validation: the
parent refuses a bad model config before importing torch); the networks and what builds or feeds
them (``BUILT``) are in ``build.py``, loaded at first use of those names.
"""

from parallel_lab.models.specs import (  # noqa: F401  (re-exported: the torch-free names)
    IMAGE,
    IMAGE_SHAPE,
    MODEL_NAMES,
    MOE_DEFAULTS,
    NORMS,
    RECOMPUTABLE,
    VIT_DEFAULTS,
    moe_options,
    norm_of,
    sample_shape,
    validate_model_config,
    vit_sizes,
)

BUILT = (  # build.py's (torch), loaded at first use
    "MODELS",
    "build_model",
    "build_meta_model",
    "count_params",
    "input_shape",
    "sample_input",
    "loss_target",
    "training_loss",
)


def __getattr__(name: str):
    """PEP 562: the torch-built names (``BUILT``) import build.py (and torch) when first asked for."""
    if name in BUILT:
        from parallel_lab.models import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
