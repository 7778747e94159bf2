"""Benchmarks: scripts that print numbers (``python -m parallel_lab.bench <name>``), never tests."""
