"""python -m testhosts (from deploy/): the same CLI as python deploy/testhosts.py."""

import sys

from .cli import main

sys.exit(main())
