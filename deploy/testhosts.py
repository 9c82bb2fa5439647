#!/usr/bin/env python3
"""Fake cluster hosts for tests (the code is the package deploy/testhosts/); this file is its CLI:

    python deploy/testhosts.py up 2 --state /tmp/th    # also: down, env, crash, cut, restore, revive
"""

import sys

if __name__ == "__main__":
    # sys.path[0] is deploy/, where the package `testhosts` (a folder) wins over this file.
    from testhosts.cli import main

    sys.exit(main())
