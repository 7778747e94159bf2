"""The comparison, in the parent: ``table`` turns metrics.json files into comparison.md/.csv/.json,
``plots`` draws them, ``parity`` judges each row against the measured noise floor. It reads records
(``parallel_lab.protocol``) only; ``cli/sweep.py`` calls it at the end of a ``--multirun`` (re-render
any time: ``python -m parallel_lab.report``).
"""
