"""The comparison, in the parent: ``rows`` reads the runs and judges each against its baseline,
``columns`` reads every number from a row, ``table`` writes comparison.md/.csv/.json, ``plots``
draws them, ``parity`` is the criterion (each row against the measured noise floor). It reads records
(``parallel_lab.protocol``) only; ``cli/sweep.py`` calls it at the end of a ``--multirun`` (re-render
any time: ``python -m parallel_lab.report``).
"""
