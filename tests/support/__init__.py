"""What the tests share: helpers (``cli``, ``checks``, the plain-torch ``reference``...) and, under
``bodies/``, the distributed test bodies that ``parallel_lab.cli.run.run_ranks`` runs on every rank.
Fixtures stay in ``tests/conftest.py``; no test module imports another test module."""
