"""The README's test command (`pytest -n 2 --dist loadgroup`) relies on conftest's groups reaching pytest-xdist's
scheduler: tests sharing a compiled model run on one worker, and only one Ray cluster runs at a time. When they do
not (a hook order, or pytest 9.2 with pytest-xdist 3.8, whose group suffix no longer reaches the node id), nothing
fails, the suite only gets slower — so this test checks it."""

from __future__ import annotations

import pytest


def test_the_module_group_reaches_the_scheduler(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run by a pytest-xdist worker with --dist loadgroup")
    assert request.node.nodeid.endswith("@tests/test_xdist_groups.py"), request.node.nodeid
