"""Data: CIFAR-shaped tensors and the batch order every strategy shares.

Every strategy sees the same global batch at every step: a DistributedSampler shuffles with the
same seed and epoch everywhere (its permutation does not depend on the number of replicas), rank r
takes every N-th index, so the union of the ranks' batches at step s is exactly the single-process
batch s. Tensor/pipeline-parallel strategies have a data-parallel size of 1 and see the whole batch.

This package's root is torch-free (``specs.py``: the names and the parent's checks); the datasets and the batch
order (``load_datasets``, ``train_batches``, ``eval_batches``) are in ``batches.py``, loaded at first
use of those names.
"""

from parallel_lab.data.specs import DATASETS, dataset_bytes, validate_data_config  # noqa: F401  (re-exported)

BATCHES = ("load_datasets", "train_batches", "eval_batches")  # batches.py's, loaded at first use


def __getattr__(name: str):
    """PEP 562: the torch-built names (``BATCHES``) import batches.py (and torch) when first asked for."""
    if name in BATCHES:
        from parallel_lab.data import batches

        return getattr(batches, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
