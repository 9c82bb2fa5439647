"""pytest fixtures for a real local Slurm cluster (deploy/slurmcluster.py).

Enable for every test file with `pytest_plugins = ["slurm_fixtures"]` in tests/conftest.py,
or import the fixtures into one test file: `from slurm_fixtures import slurm_cluster`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "deploy"))
from slurmcluster import SlurmCluster, _tail, slurm_missing  # noqa: E402

IN_CI = os.environ.get("CI") == "true"


def require_slurm() -> None:
    """Skip with the reason when no Slurm cluster can be started here; under CI=true, fail."""
    why = slurm_missing()
    if why is None:
        return
    if IN_CI:
        pytest.fail(f"real Slurm test cluster required under CI=true: {why}")
    pytest.skip(f"real Slurm test cluster: {why} (always runs under CI=true)")


def _start(n: int, **kw) -> SlurmCluster:
    sc = SlurmCluster(n, **kw)   # its own short folder under /tmp (socket paths stay < 108 chars)
    sc.start()
    print(f"\nslurm cluster {sc.prefix}: {n} node(s) up in {sc.timings['start']:.2f}s")
    return sc


def _stop(sc: SlurmCluster, request, failed_before: int) -> None:
    """Stop the cluster; if a test failed meanwhile, print the daemons' log tails first."""
    if request.session.testsfailed > failed_before and sc.workdir and sc.nodes:
        print(f"slurm cluster {sc.prefix} ({sc.subnet}.0/24) timings: {sc.timings}")
        for i in ["ctl", *range(len(sc.nodes))]:
            lines = [x for x in _tail(sc.log(i), 100_000).splitlines() if "mpi" not in x.lower()]
            print(f"--- {sc.log(i)} (without MPI plugin noise)\n" + "\n".join(lines[-40:]))
    sc.stop()


def private_cluster(request, n: int = 2):
    """For a fixture (`yield from`): an n-node cluster of its own, stopped after it, also after a failure."""
    require_slurm()
    failed_before = request.session.testsfailed
    sc = _start(n)
    try:
        yield sc
    finally:
        _stop(sc, request, failed_before)


@pytest.fixture(scope="session")
def slurm_cluster(request):
    """A 2-node cluster (partition `debug`, one CPU per node) shared by the whole session.
    Tests must leave it working: use `make_slurm_cluster` to break nodes."""
    yield from private_cluster(request)


@pytest.fixture
def make_slurm_cluster(request):
    """Factory: `make_slurm_cluster(n=2, **SlurmCluster kwargs)` starts a private cluster;
    every cluster it made is stopped after the test, also when the test failed."""
    require_slurm()
    failed_before = request.session.testsfailed
    made: list[SlurmCluster] = []

    def make(n: int = 2, **kw) -> SlurmCluster:
        made.append(_start(n, **kw))   # a failed start cleans up after itself
        return made[-1]

    try:
        yield make
    finally:
        errors = []
        for sc in made:
            try:
                _stop(sc, request, failed_before)
            except Exception as e:   # stop the others anyway
                errors.append(e)
        if errors:
            raise errors[0]
