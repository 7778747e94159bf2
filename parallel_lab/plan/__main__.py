"""``python -m parallel_lab.plan [hydra overrides]``: see ``parallel_lab.plan``."""

from parallel_lab.plan.main import main

if __name__ == "__main__":
    main()
