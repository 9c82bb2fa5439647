"""The suite's budget file holds together: each module it names exists, and the budgets add up to the 15 minutes
the whole suite may take on this project's 2-core machine, with a minute left for the quick tests."""

from budget import BUDGETS, SUITE_S, budgets


def test_budgets_name_existing_modules_and_add_up_to_the_suites_budget():
    limits = budgets()
    assert limits and all((BUDGETS.parent / name).is_file() for name in limits), limits
    assert all(0 < s for s in limits.values()), limits
    assert sum(limits.values()) <= SUITE_S - 60, sum(limits.values())
