"""Benchmarks: scripts that print numbers and ratios. Never timed assertions in tests."""
