"""Start a finetune run as a fresh process group with a time limit, and watch its output.

Shared by `finetune parity` and the benchmarks under bench/. A run under `accelerate launch` is a
launcher plus one process per rank; a plain `subprocess.run(timeout=...)` kills only the launcher
and leaves the ranks running (and holding their memory). Here every run gets its own session, and the launcher
and every process it started are killed when it times out, when the caller has seen enough of it
(`stop_at`), or when it ends (leftovers of its group).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def finetune_command(
    args: list[str], accelerate_config: str | os.PathLike | None = None, launch_args: tuple[str, ...] = ()
) -> list[str]:
    """`python -m finetune ARGS`, or `accelerate launch --config_file CONFIG [LAUNCH_ARGS] -m finetune ARGS` with
    a free rendezvous port (port 0: never the default 29500, which another job on the machine may hold)."""
    if accelerate_config is None:
        return [sys.executable, "-m", "finetune", *args]
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config)]
    return [*launcher, "--main_process_port", "0", *launch_args, "-m", "finetune", *args]


def kill_job(proc: subprocess.Popen) -> None:
    """Kill a launch: the launcher's process group and every process it started. torchrun starts each rank in
    a session of its own (torch.distributed.elastic's subprocess handler: start_new_session=True), so the
    launcher's group alone misses the ranks, which then keep their memory, hold the output pipe open (a reader
    never sees its end) and wait up to 30 minutes for a rendezvous that is gone: its descendants are collected
    first, while the launcher is alive to name them."""
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


@dataclass
class Launched:
    rc: int  # 0 also when the caller stopped the run at `stop_at`
    wall_s: float
    output: str  # stdout and stderr, interleaved as written
    timed_out: bool = False
    stopped: bool = False  # killed on purpose at `stop_at`
    marks: dict[str, float] = field(default_factory=dict)  # name -> seconds from launch to the first line with it


def launch(
    cmd: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    stop_at: str | None = None,
    marks: dict[str, str] | None = None,
    cwd: Path = ROOT,
) -> Launched:
    """Run cmd in a new process group; return its exit code, wall time and output.

    log: where the output goes, each line stamped with the seconds since launch.
    stop_at: once a line contains it, the group is killed and the run counts as done (rc 0): what comes
    after (a final checkpoint, the export, interpreter exit) is then neither waited for nor timed.
    marks: {name: text}: the time of the first line containing each text (startup phases, steps)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def kill() -> None:
        kill_job(proc)

    fired = threading.Event()

    def expire() -> None:
        fired.set()
        kill()

    timer = threading.Timer(timeout, expire)
    timer.start()
    lines: list[str] = []
    seen: dict[str, float] = {}
    stopped = False
    sink = open(log, "w") if log is not None else None  # written as it comes: a long run can be watched
    try:
        for line in proc.stdout:
            now = time.perf_counter() - t0
            lines.append(f"{now:8.2f} {line}")
            if sink:
                sink.write(lines[-1])
                sink.flush()
            for name, text in (marks or {}).items():
                if name not in seen and text in line:
                    seen[name] = now
            if stop_at and stop_at in line:
                stopped = True
                kill()
                break
        proc.wait()
    finally:
        timer.cancel()
        kill()  # what the launcher left behind (its ranks share the group)
        proc.stdout.close()
        if sink:
            sink.close()
    output = "".join(line[9:] for line in lines)
    rc = 0 if stopped else proc.returncode
    return Launched(rc, time.perf_counter() - t0, output, fired.is_set() and not stopped, stopped, seen)
