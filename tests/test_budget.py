"""The suite's budget file holds together: each module it names exists, and the budgets add up to the 15 minutes
the whole suite may take on this project's 2-core machine on its two workers, with a minute left for the quick
tests; pyproject.toml runs the suite on those workers."""

from budget import BUDGETS, SUITE_S, WORKERS, budgets, tomllib
from conftest import REPO


def test_budgets_name_existing_modules_and_add_up_to_the_suites_budget():
    limits = budgets()
    assert limits and all((BUDGETS.parent / name).is_file() for name in limits), limits
    assert all(0 < s for s in limits.values()), limits
    assert sum(limits.values()) <= WORKERS * (SUITE_S - 60), sum(limits.values())


def test_the_suite_runs_on_its_workers_a_module_whole_in_the_budgets_order():
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"].split()
    assert addopts[addopts.index("-n") + 1] == str(WORKERS), addopts
    assert "--dist=loadfile" in addopts and "--no-loadscope-reorder" in addopts, addopts
