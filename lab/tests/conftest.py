"""The lab's tests check the tools that produce evidence, not the reference: every one is slow
(python -m pytest -q -m slow runs them; the fast spec leaves them out)."""

import os
import sys

import pytest

LAB = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, LAB)  # the lab's modules by their own names (summarize, bench, mini_sd3, ...)
sys.path.insert(0, os.path.dirname(LAB))  # the top level, and lab.mini_sd3 for --reward lab.mini_sd3:...
sys.path.insert(0, os.path.join(os.path.dirname(LAB), "tests"))  # the top level's test helpers (flows, ...)

from flows import float64  # noqa: E402,F401  (the fixture: torch's default dtype float64 for a test)


def pytest_collection_modifyitems(items):
    for item in items:
        if str(item.fspath).startswith(LAB):
            item.add_marker(pytest.mark.slow)
