"""The suite's time, kept in view (a pytest plugin, loaded by conftest.py): each cluster test module's seconds
against its budget in tests/budgets.toml, and the run's end names the modules over budget and the suite's wall
time. A warning, never a failure: machines are noisy (the promise is the whole suite in 15 minutes on 2 cores).

The suite runs on WORKERS pytest-xdist workers (pyproject's addopts), a module on one worker whole (its module
fixtures start once); the heaviest modules by budget go first, so that no long one is left to run alone at the
end. Most of a cluster test's time is waiting (a heartbeat timeout, a grace, an SSH or Slurm round trip), so two
workers on two cores take about half the time; a module's seconds are its seconds beside the other worker."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

BUDGETS = Path(__file__).with_name("budgets.toml")
SUITE_S = 15 * 60  # the whole suite's budget, on this project's 2-core machine
WORKERS = 2  # `-n 2` in pyproject.toml's addopts


def budgets() -> dict[str, float]:
    """Module file name -> seconds, as tests/budgets.toml gives them."""
    return {name: float(s) for name, s in tomllib.loads(BUDGETS.read_text())["seconds"].items()}


def heaviest_first(items: list) -> list:
    """Test items in the order the workers should take their modules: by budget, largest first (a module without
    one, a quick one, last); the order within a module kept."""
    limits = budgets()
    return sorted(items, key=lambda item: -limits.get(Path(str(item.fspath)).name, 0.0))


class Budget:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.spent: dict[str, float] = defaultdict(float)
        self.cluster: set[str] = set()  # modules with a test marked `cluster`

    def pytest_runtest_logreport(self, report) -> None:
        module = Path(report.nodeid.split("::")[0]).name
        self.spent[module] += report.duration  # setup, call and teardown
        if "cluster" in report.keywords:
            self.cluster.add(module)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        wall = time.monotonic() - self.start
        tr, limits = terminalreporter, budgets()
        over = sorted(((self.spent[m], limits[m], m) for m in self.cluster if m in limits and self.spent[m] > limits[m]),
                      reverse=True)
        missing = sorted(m for m in self.cluster if m not in limits and self.spent.get(m))
        tr.section("time")
        for spent, limit, module in over:
            tr.write_line(f"over budget: {module} took {spent:.0f} s, its budget is {limit:.0f} s (tests/budgets.toml)")
        for module in missing:
            tr.write_line(f"no budget: {module} took {self.spent[module]:.0f} s; give it one in tests/budgets.toml")
        slow = sorted(((s, m) for m, s in self.spent.items()), reverse=True)[:10]
        tr.write_line("slowest modules: " + ", ".join(f"{m} {s:.0f} s" for s, m in slow))
        tr.write_line(f"suite wall time: {wall:.0f} s ({wall / 60:.1f} min; the budget is {SUITE_S // 60} min)")
