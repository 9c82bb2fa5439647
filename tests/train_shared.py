"""A real run that tests of more than one module read (test_worker.py, test_multidevice.py): one worker alone (no
TF_CONFIG: the default strategy) trains digits at the global batch (64) and the learning rate (0.004) that the
multi-replica runs reach after their warm-up. Trained once per test session, when a test first asks for it (a
module's fixture returns it); read only."""

from __future__ import annotations

_RUNS: dict[str, object] = {}


def digits_alone(tmp_path_factory):
    """The `Workers` of that run, which succeeded (its log, its task folder's progress.json)."""
    if "alone" not in _RUNS:
        from test_worker import Workers, run_ok

        _RUNS["alone"] = run_ok(Workers(tmp_path_factory.mktemp("alone") / "run", [
            "--entrypoint", "worker.examples.digits:task", "--batch-size-per-replica", "64",
            "--learning-rate", "0.004"], n=1))
    return _RUNS["alone"]
