"""Hang forensics: a rank stuck past ddp_timeout writes its Python stack to output_dir/logs/, and the message
names the ranks that did not answer."""

from __future__ import annotations

import faulthandler
import os
import time

from finetune.parallel.topology import Launcher
from finetune.stop import Stopped


class Watchdog:
    """Hang forensics for multi-process runs.

    Every optimizer step re-arms a timer (faulthandler, a C thread that runs even while Python is stuck
    in a collective or in I/O). A process that makes no progress for `timeout` seconds, which is the
    collective timeout (ddp_timeout), writes the Python stack of every thread to
    output_dir/logs/stacks_rank<N>.txt. When a collective then fails, `not_answering` names the ranks
    that never reported the failure themselves: the stuck or dead ones.
    """

    def __init__(self, acc, output_dir: str, timeout: float):
        import torch.distributed as dist

        self.rank, self.world, self.timeout = acc.process_index, acc.num_processes, timeout
        self.store = dist.distributed_c10d._get_default_store() if self.world > 1 and dist.is_initialized() else None
        self.prefix = f"finetune/{Launcher.read().run_id or 'run'}"
        self.file = None
        if self.store is not None:
            logs = os.path.join(output_dir, "logs")
            os.makedirs(logs, exist_ok=True)
            self.path = os.path.join(logs, f"stacks_rank{self.rank}.txt")
            self.file = open(self.path, "w")

    def beat(self) -> None:
        """Progress: restart the clock."""
        if self.file is not None:
            faulthandler.dump_traceback_later(self.timeout * 0.9, exit=False, file=self.file)

    def stop(self) -> None:
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()

    def not_answering(self, wait: float = 5.0) -> list[int]:
        """After a failed collective: ranks that did not report the same failure within `wait` seconds."""
        if self.store is None:
            return []
        self.stop()
        faulthandler.dump_traceback(file=self.file, all_threads=True)
        self.file.flush()
        self.store.set(f"{self.prefix}/failed/{self.rank}", "1")
        keys = {r: f"{self.prefix}/failed/{r}" for r in range(self.world)}
        deadline = time.monotonic() + wait
        while True:
            missing = [r for r, k in keys.items() if not self.store.check([k])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)

    def describe(self, missing: list[int]) -> str:
        where = os.path.dirname(self.path) if self.file is not None else "output_dir/logs"
        if not missing:
            return f"Every rank saw the failure; Python stacks: {where}/stacks_rank*.txt."
        ranks = ", ".join(str(r) for r in missing)
        return (
            f"Rank(s) {ranks} did not answer (stuck or dead); the stacks of the ranks that were still alive are "
            f"in {where}/stacks_rank*.txt (a stuck rank's shows where it waits)."
        )


_active: Watchdog | None = None  # the run's watchdog, for the error report in finetune.cli


def start_watchdog(acc, output_dir: str, timeout: float) -> Watchdog:
    global _active
    _active = Watchdog(acc, output_dir, timeout)
    return _active


def explain_hang() -> str:
    """For the message after a failed collective: who did not answer, where the stacks are."""
    if _active is None or _active.store is None:
        return ""
    try:
        return _active.describe(_active.not_answering())
    except Stopped:  # the launcher ends the survivors while this rank waits for their answers
        return "(the launcher stopped this rank while it asked the other ranks)"
    except Exception as e:  # the store may be gone with the launcher
        return f"(could not ask the other ranks: {type(e).__name__})"
