"""Workaround: pytest-xdist 3.8's `--dist loadgroup` under pytest 9.2 (pytest-xdist#1386).

xdist gives a test its xdist_group by writing "@<group>" into item._nodeid on the worker; pytest 9.2 keeps node ids
in Node._id and no longer reads _nodeid, so the suffix is lost and the scheduler deals a group's tests to any worker.
In this suite that split every grouped module over both workers, and each module fixture meant to run once ran in
each (the bf16 layouts fixture: about 3 minutes, twice). This hook writes the suffix where pytest 9 reads it.
tests/conftest.py imports it; tests/test_xdist_groups.py fails once xdist writes it itself (then delete this file).
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    for item in items:
        groups = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")
        }
        suffix = "@" + "_".join(sorted(groups))
        if groups and not item.nodeid.endswith(suffix):  # (before pytest 9 xdist's own suffix is there)
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)
