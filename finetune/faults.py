"""Fault injection for the fault tests: FINETUNE_FAULT makes a named point of the run fail on purpose."""

from __future__ import annotations

import os
import time

from finetune.stop import STOP


def fault_point(name: str, step: int) -> None:
    """Fault injection for the crash, hang and storage tests: FINETUNE_FAULT=<name>:<step>[:<rank>[:<seconds>]]. A
    name starting with "hang-" makes that process stop answering (sleep), "slow-" makes it work `seconds` longer
    there (a large model's write), "enospc-" raises the error a full disk gives; any other name kills it (SIGKILL)
    there."""
    spec = os.environ.get("FINETUNE_FAULT", "").split(":")
    if len(spec) < 2 or spec[0] != name or int(spec[1]) != step:
        return
    if len(spec) >= 3 and spec[2] != os.environ.get("RANK", "0"):
        return
    if name.startswith("hang-"):  # until the launcher stops the job (SIGTERM), as it would kill a stuck process
        while not STOP.requested:
            time.sleep(0.2)
        os._exit(143)
    if name.startswith("slow-"):
        time.sleep(float(spec[3]))
        return
    if name.startswith("enospc-"):
        import errno

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"(injected at {name} {step})")
    os.kill(os.getpid(), 9)
