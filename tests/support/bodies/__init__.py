"""Distributed test bodies: plain functions ``fn(rank, world_size, **kwargs)`` that
``parallel_lab.cli.run.run_ranks(fn, world_size, ...)`` runs on real gloo ranks forked from the
zygote (which imports them by module name: they must live in an importable module, never inside a
test function)."""
