"""``python -m parallel_lab.plan [hydra overrides]``: see ``parallel_lab.plan``."""

import gc

# The collector off for this short command (the worker's pattern, parallel_lab/worker/__main__.py):
# torch, TorchDynamo and sympy allocate ~300k long-lived objects, and a recommendation's ~200
# configs and meta models ~1,000 collections that walk them again and again, 0.7-1.1 s of CPU
# of a cached recommendation's 5-9 s (measured); off, its peak memory grew 364 -> 398 MB on the
# largest row (192 candidates). The process ends when the answer is written.
gc.disable()

from parallel_lab.plan.main import main  # noqa: E402

if __name__ == "__main__":
    main()
    # Everything alive now out of the exit's collection: with torch imported it walked ~300k objects,
    # 0.5-1 s of CPU after the answer was printed (measured).
    gc.freeze()
