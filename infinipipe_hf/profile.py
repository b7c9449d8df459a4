"""``python -m infinipipe_hf.profile``: the command lives in :mod:`infinipipe_hf.cli.profile`."""
import sys

from infinipipe_hf.cli.profile import main

if __name__ == "__main__":
    sys.exit(main())
