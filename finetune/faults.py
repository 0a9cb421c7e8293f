"""Fault injection for the fault tests: FINETUNE_FAULT makes a named point of the run fail on purpose."""

from __future__ import annotations

import os
import time

from finetune.stop import STOP


def fault_point(name: str, step: int) -> None:
    """Fault injection for the crash, hang and storage tests: FINETUNE_FAULT=<name>:<step>[:<rank>[:<seconds>]],
    several comma-separated. A name starting with "hang-" makes that process stop answering (sleep), "slow-" makes
    it work `seconds` longer there (a large model's write), "enospc-" raises the error a full disk gives, "signal-"
    sends it the signal named in place of seconds (SIGTERM by default: a preemption reaching this process there); any
    other name kills it (SIGKILL) there."""
    for fault in os.environ.get("FINETUNE_FAULT", "").split(","):
        spec = fault.split(":")
        if len(spec) >= 2 and spec[0] == name and int(spec[1]) == step:
            if len(spec) < 3 or spec[2] == os.environ.get("RANK", "0"):
                _inject(name, step, spec)


def _inject(name: str, step: int, spec: list[str]) -> None:
    if name.startswith("hang-"):  # until the launcher stops the job (SIGTERM), as it would kill a stuck process
        while not STOP.requested:
            time.sleep(0.2)
        os._exit(143)
    if name.startswith("slow-"):
        time.sleep(float(spec[3]))
        return
    if name.startswith("signal-"):
        import signal

        os.kill(os.getpid(), getattr(signal, spec[3] if len(spec) > 3 else "SIGTERM"))
        return
    if name.startswith("enospc-"):
        import errno

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"(injected at {name} {step})")
    os.kill(os.getpid(), 9)
