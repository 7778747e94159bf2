"""``python -m parallel_lab [overrides]``: the command line lives in :mod:`parallel_lab.cli.main`."""

from parallel_lab.cli.main import main

if __name__ == "__main__":
    main()
