#!/usr/bin/env python3
"""`python bench/run.py ...`: the same as `python -m bench ...` from the repository root."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not bench/ (whose modules would shadow)
    from bench.cli import main

    sys.exit(main())
