"""The worker runtime: one process of a run (``python -m parallel_lab.worker <run_dir>/config.yaml``)."""
