"""parallel_lab: one CIFAR model, every parallelism strategy, every number proven.

Where things live (docs/architecture.md has the layers and the package-by-package table):

- ``cli/``, ``config/``, ``report/``: the parent process (command line, launch, validation, the comparison).
- ``worker/``: one rank (entry point, rendezvous from the environment, the training loop, measurements).
- ``comm/``: hand-written collectives and the communication counter.
- ``checkpoint/``: manifest and atomic commit, resume policy, restricted readers of foreign formats.
- ``strategies/``: the Strategy interface and one module or folder per parallelism.
- ``protocol.py``: what parent, workers and report share (run-folder files and their records).
"""

__version__ = "0.1.0"
