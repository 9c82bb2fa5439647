"""`python -m bench [--quick] [--only NAME,...] [--reps N] [--out DIR]`: see bench/cli.py."""

import sys

from bench.cli import main

sys.exit(main())
