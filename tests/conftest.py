"""Running the suite two tests at a time (scripts/test.sh passes `-n 2 --dist loadgroup`): each test file
is one group, so its module-scoped fixtures (a trained checkpoint shared by its tests) are built once, on
one worker. The node-loss drill's variants each take a minute or more and share nothing, so each is a
group of its own and the two workers split them instead of one worker running all four at the end."""

from __future__ import annotations

import pytest

_EACH_TEST_ITS_OWN_GROUP = {"test_node_loss_drill.py"}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = item.path.name
        group = item.nodeid if module in _EACH_TEST_ITS_OWN_GROUP else module
        item.add_marker(pytest.mark.xdist_group(group))
