"""Which float comparisons ``make test`` runs a second time under the foreign CPU dispatch
(the Makefile's FOREIGN_DISPATCH: docs/testing.md), each with the reason it is there.

Every test marked ``parity`` or ``floats`` is a float comparison; running all of them twice took
``make test`` past its 10 minutes once the transformer arrived (2026-11-26: 102 ids, 212-255 s).
The second pass keeps one test per kind of verdict a foreign CPU could move: the parity criterion
itself, each family of kernels a strategy computes with (plain torch, DeepSpeed, the pipeline's
split, tensor parallelism's split on the transformer with sequence parallelism and dropout), the
16-bit tolerance, and the bits pinned at model construction. ``make test-all`` still runs every
``parity or floats`` id under the foreign dispatch. tests/conftest.py marks the listed tests
``dispatch``; a listed prefix that matches no test fails the run (tests/unit/test_dispatch_list.py).
"""

from __future__ import annotations

DISPATCH: dict[str, str] = {
    "tests/unit/test_parity.py": "the criterion's arithmetic: envelope, jitter, Adam's bound",
    "tests/integration/test_spine.py::test_single_and_ddp_match_independent_reference": (
        "plain-torch kernels, single and ddp, against the independent reference"
    ),
    "tests/integration/test_sharded.py::test_zero_matches_single_process": "DeepSpeed's kernels, every ZeRO stage",
    "tests/integration/test_pipeline_parallel.py::test_pp_two_stages_match_reference_in_one_set_of_ranks": (
        "the pipeline's micro-batch sums, every schedule"
    ),
    "tests/integration/test_tp_vit.py": "the transformer: Megatron split, sequence parallelism, per-sample dropout",
    "tests/integration/test_bf16.py::test_bf16_row_matches_the_bf16_reference": "the 16-bit tolerance",
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
