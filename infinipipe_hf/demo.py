"""``python -m infinipipe_hf.demo``: the command lives in :mod:`infinipipe_hf.cli.demo`."""
import sys

from infinipipe_hf.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
