"""The names of the all-reduce algorithms ``comm/collectives.py`` implements, torch-free: they are
``strategy.allreduce``'s choices, which the parent checks before importing torch."""

ALGORITHMS = ("star", "ring", "builtin", "mpi")
