"""``python -m parallel_lab.plan [hydra overrides]``: see ``parallel_lab.plan``."""

import gc

from parallel_lab.plan.main import main

if __name__ == "__main__":
    main()
    # Everything alive now out of the exit's collection: with torch imported it walked ~300k objects,
    # 0.5-1 s of CPU after the answer was printed (measured).
    gc.freeze()
