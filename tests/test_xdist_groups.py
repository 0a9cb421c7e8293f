"""The suite's workaround for xdist groups under pytest 9 (tests/xdist_groups.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

GROUPED = """
import os, pytest
pytestmark = pytest.mark.xdist_group("g")

@pytest.fixture(scope="module")
def once():
    print("SET UP IN", os.getpid())

@pytest.mark.parametrize("i", range(6))
def test_grouped(once, i):
    pass
"""


def workers_of_the_group(tmp_path: Path, *plugin: str) -> tuple[set[str], str]:
    tmp_path.mkdir()
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_other.py").write_text("def test_other():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    cmd = [sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", *plugin]
    proc = subprocess.run([*cmd, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = re.findall(r"\[(gw\d)\] .*PASSED .*test_grouped", proc.stdout)
    assert len(workers) == 6, proc.stdout[-3000:]  # every grouped test ran and was reported
    return set(workers), proc.stdout


def test_xdist_groups_still_need_the_workaround(tmp_path):
    """Without tests/xdist_groups.py, pytest-xdist deals a group's tests to both workers (the '@g' suffix never reaches
    the scheduler); with it, all six run on one worker. When the first assertion fails, xdist groups tests under
    this pytest again: delete tests/xdist_groups.py, its import in conftest.py and this test."""
    workers, out = workers_of_the_group(tmp_path / "without")
    assert "@g" not in out and len(workers) == 2, out[-3000:]
    workers, out = workers_of_the_group(tmp_path / "with", "-p", "xdist_groups")
    assert len(workers) == 1 and out.count("test_grouped.py::test_grouped[") == out.count("]@g"), out[-3000:]
