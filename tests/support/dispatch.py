"""Which float comparisons ``make test`` runs a second time under the foreign CPU dispatch
(the Makefile's FOREIGN_DISPATCH: docs/testing.md), each with the reason it is there.

Every test marked ``parity`` or ``floats`` is a float comparison; running all of them twice took
``make test`` past its 10 minutes once the transformer arrived (2026-11-26: 102 ids, 212-255 s).
The second pass keeps one test per kind of verdict a foreign CPU could move: the parity criterion
itself, the convolutions (oneDNN) and matrix products (MKL) a strategy computes with (the cnn under
single and ddp; the transformer's Megatron split with sequence parallelism and dropout, whose sums
run in another order than single's), the 16-bit tolerance, and the bits pinned at model
construction. Left to ``make test-all``: DeepSpeed's rows and the pipeline matrix (the same torch
kernels on CPU, summed in orders the listed tests already move), measured at 18 s and 16 s of
this pass on 2026-11-26, which took ``make test`` from a fresh clone to 629 s. ``make test-all`` still runs every
``parity or floats`` id under the foreign dispatch. tests/conftest.py marks the listed tests
``dispatch``; a listed prefix that matches no test fails the run (tests/unit/test_dispatch_list.py).
"""

from __future__ import annotations

DISPATCH: dict[str, str] = {
    "tests/unit/test_parity.py": "the criterion's arithmetic: envelope, jitter, Adam's bound",
    "tests/integration/test_spine.py::test_single_and_ddp_match_independent_reference": (
        "plain-torch kernels, single and ddp, against the independent reference"
    ),
    "tests/integration/test_tp_vit.py::test_tp_vit_is_singles_training_with_the_megatron_bytes[manual-sp-dropout]": (
        "the transformer: Megatron split, sequence parallelism, per-sample dropout (the dtensor and bf16 ids: "
        "the same kernels, and the 16-bit tolerance has its own id)"
    ),
    "tests/integration/test_bf16.py::test_bf16_row_matches_the_bf16_reference[ddp]": (
        "the 16-bit tolerance (one row: the others are the same bf16 kernels under DeepSpeed/FSDP casts)"
    ),
    "tests/integration/test_batchnorm.py::test_group_norm_models_are_built_bit_for_bit_as_before": (
        "bits at model construction (ATen's uniform_ differs under its default kernels)"
    ),
    "tests/unit/test_cifar10.py::test_loader_reads_the_tarball": "the loader's normalised pixel",
}


def listed(nodeid: str) -> str | None:
    """The DISPATCH prefix this test id falls under, or None."""
    return next(
        (
            prefix
            for prefix in DISPATCH
            if nodeid == prefix or nodeid.startswith(prefix + "[") or nodeid.startswith(prefix + "::")
        ),
        None,
    )


def files() -> list[str]:
    """The test files the listed tests live in: the second pass collects only these."""
    return sorted({prefix.split("::")[0] for prefix in DISPATCH})


if __name__ == "__main__":  # the Makefile's second pass: `pytest ... $(python -m tests.support.dispatch)`
    print(" ".join(files()))
