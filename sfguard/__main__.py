"""`python -m sfguard ARGS`: the `sfguard` command."""
import sys

from sfguard.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
