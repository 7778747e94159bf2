"""Checkpoints every strategy can resume from, exactly.

Layout (``trainer.checkpoint_dir``, default ``<run_dir>/checkpoints``)::

    step_00000004/                 one checkpoint: 4 optimizer steps done
        complete.json              written last; lists every file with its size and sha256
        trainer_rank<k>.pt         step, data-sampler position, RNG states, loss history
        ...                        model + optimizer, as the strategy saves them (its hooks)

Modules: ``manifest`` (names, ``complete.json``, the atomic commit and the check on load),
``policy`` (which checkpoint ``trainer.resume`` picks, and what must match), ``checkpointer``
(saving and restoring during training), and the restricted readers of the two foreign formats,
``dcp_reader`` (torch Distributed Checkpoint) and ``ds_reader`` (DeepSpeed).

How a checkpoint is written (``Checkpointer.save``): every rank writes into
``.tmp-step_00000004/``; a barrier; rank 0 hashes the files, writes ``complete.json`` (temp +
rename) and renames the folder to ``step_00000004`` (one atomic rename); a second barrier. A crash
at any point before that rename leaves only a ``.tmp-*`` folder, which resuming ignores. On load
every file is checked against ``complete.json``: a truncated or altered checkpoint is refused
(``trainer.resume=<path>``) or skipped for the previous good one (``trainer.resume=auto``).

What is saved where is the strategy's business (its ``State`` part: ``save``/``load``, strategies/state.py):
replicated strategies write one copy from rank 0, FSDP uses torch Distributed Checkpoint, ZeRO
uses DeepSpeed's own save_checkpoint/load_checkpoint, tensor/pipeline parallel write one shard
per rank. Everything is read back with ``torch.load(..., weights_only=True)``.

This package's root is torch-free (names, manifests, the resume policy: the parent checks them
before importing torch); ``Checkpointer`` and ``Resumed`` load ``checkpointer.py`` at first use.
"""

from parallel_lab.checkpoint.manifest import (
    COMPLETE,
    CheckpointError,
    checkpoint_name,
    complete_checkpoints,
    read_manifest,
    sha256_file,
)
from parallel_lab.checkpoint.policy import pick_checkpoint, validate_checkpoint_config

__all__ = [
    "COMPLETE",
    "CheckpointError",
    "Checkpointer",
    "Resumed",
    "checkpoint_name",
    "complete_checkpoints",
    "pick_checkpoint",
    "read_manifest",
    "sha256_file",
    "validate_checkpoint_config",
]
CHECKPOINTER = ("Checkpointer", "Resumed")  # checkpointer.py's (torch), loaded at first use


def __getattr__(name: str):
    """PEP 562: ``CHECKPOINTER``'s names import checkpointer.py (and torch) when first asked for."""
    if name in CHECKPOINTER:
        from parallel_lab.checkpoint import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
