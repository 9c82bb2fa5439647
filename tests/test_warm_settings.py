"""A forked attempt computes what a cold one computes (issue 54, class 3): a framework reads its settings from the
environment once, when it is imported, and a fork server imported it before the program ran. A script that sets
JAX_ENABLE_X64 before `import jax`, as JAX documents, trains in float64 in its cold attempt and, restarted from the
fork server, in float64 again: the forked attempt starts its program again cold, saying why."""

from __future__ import annotations

import json
import sys

from conftest import need, write_spec
from test_standby import restarted_warm

X64 = """
import os, sys, time
os.environ["JAX_ENABLE_X64"] = "1"  # before jax is imported, as JAX documents
import jax.numpy as jnp

folder, attempt = os.environ["MGPU_RUN_DIR"], os.environ["MGPU_ATTEMPT"]
with open(os.path.join(folder, f"dtype-{attempt}"), "w") as f:
    f.write(str(jnp.zeros(1).dtype))
if attempt == "0":
    while not os.path.exists(os.path.join(folder, "go")):  # the test's word: the fork server is ready
        time.sleep(0.1)
    sys.exit(1)
"""


def test_a_setting_made_before_the_import_holds_after_a_warm_restart(cli, tmp_path):
    need("jax")
    (tmp_path / "x64.py").write_text(X64)
    command = json.dumps([sys.executable, "x64.py"])
    spec = write_spec(tmp_path, f'backend = "jax"\ncommand = {command}', n=1, launch="max_restarts = 1")
    out, folder = restarted_warm(cli, tmp_path, spec)
    dtypes = [(folder / f"dtype-{n}").read_text() for n in (0, 1)]
    assert dtypes == ["float64", "float64"], (dtypes, out)
    assert "this attempt starts cold: the training set JAX_ENABLE_X64='1' after its fork server had imported jax" \
           in out and "under None (a framework reads its settings when it is imported)" in out, out
