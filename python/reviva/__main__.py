"""`python -m reviva`: the command line, parsed in reviva/cli/main.py."""

import sys

from reviva.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
