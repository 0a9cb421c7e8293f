"""finetune.launching, the launcher `finetune parity` and bench/ share: a run that outlives its time limit is
killed with everything it started (an accelerate launch leaves its ranks behind otherwise); a run stopped at a
line counts as done; each line's time is recorded. Plain Python children, no model: a few seconds."""

from __future__ import annotations

import os
import sys
import time

from finetune import launching

# A "launcher" that starts a "rank" and then waits on it; the rank in a session of its own, as torchrun starts
# them (so the launcher's process group does not hold it).
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print("rank", child.pid, flush=True)
time.sleep(0.3)
print("step 1/2 done", flush=True)
child.wait()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its reaper is dead too
        return f.read().split()[2] != "Z"


def rank_pid(output: str) -> int:
    return int(next(line for line in output.splitlines() if line.startswith("rank")).split()[1])


def test_timeout_kills_the_launcher_and_its_ranks(tmp_path):
    t0 = time.perf_counter()
    r = launching.launch([sys.executable, "-c", LAUNCHER], timeout=3, log=tmp_path / "run.log")
    assert r.timed_out and not r.stopped and r.rc != 0
    assert time.perf_counter() - t0 < 30  # not the grandchild's 120 s
    time.sleep(0.5)
    assert not alive(rank_pid(r.output))
    stamped = (tmp_path / "run.log").read_text().splitlines()
    assert float(stamped[0].split()[0]) >= 0 and stamped[0].split()[1] == "rank"  # "   0.05 rank 1234"


def test_stop_at_ends_the_run_as_done_and_marks_lines():
    r = launching.launch(
        [sys.executable, "-c", LAUNCHER], timeout=60, stop_at="step 1/2", marks={"rank": "rank ", "step": "step 1/"}
    )
    assert r.rc == 0 and r.stopped and not r.timed_out
    assert r.wall_s < 30
    assert 0 <= r.marks["rank"] <= r.marks["step"]
    time.sleep(0.5)
    assert not alive(rank_pid(r.output))


def test_exit_code_and_command():
    r = launching.launch([sys.executable, "-c", "import sys; print('x'); sys.exit(3)"], timeout=60)
    assert (r.rc, r.output, r.timed_out, r.stopped) == (3, "x\n", False, False)
    assert launching.finetune_command(["--config", "a.yaml"]) == [
        sys.executable,
        "-m",
        "finetune",
        "--config",
        "a.yaml",
    ]
    cmd = launching.finetune_command(["--config", "a.yaml"], "ddp.yaml")
    assert cmd[cmd.index("--main_process_port") + 1] == "0" and cmd[-4:] == ["-m", "finetune", "--config", "a.yaml"]
