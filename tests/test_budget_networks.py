"""Every network of the test suite's sizes under its least reachable memory budget (tests/test_budget.py's
`check_budgets`: every step within the budget, measured as planned in every memory mode, training bit for bit as
the program without a budget). A file of its own, so that the test runner's workers share these networks with the
rest of tests/test_budget.py rather than one worker running all of them."""
from __future__ import annotations

import pytest

from tests.test_budget import CASES, FRACTIONS, check_budgets
from tests.test_memory_modes import NETWORKS as NETWORKS_AT_TEST_SIZE

OTHERS = [(name, image) for name, image in NETWORKS_AT_TEST_SIZE if name not in {c[0] for c in CASES}]


@pytest.mark.parametrize("name,image", OTHERS, ids=[n for n, _ in OTHERS])
def test_every_network_fits_its_budgets(name, image, tmp_path):
    """Every other network at the test size, at its least reachable budget (`check_budgets`; the networks of
    tests/test_budget.py check the budget halfway as well)."""
    check_budgets(name, image, 2, tmp_path, fractions=FRACTIONS[:1])
