"""`python SCRIPT ARGS` in a warm fork (tests/warm.py; a client whose first argument is --script): the
script runs as __main__ with its own directory first on sys.path, as the interpreter runs a script."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(args: list[str]) -> int:
    sys.argv = list(args)
    sys.path[0] = str(Path(args[0]).resolve().parent)
    runpy.run_path(args[0], run_name="__main__")
    return 0
