"""``python -m infinipipe_hf.plan``: the command lives in :mod:`infinipipe_hf.cli.plan`."""
import sys

from infinipipe_hf.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
