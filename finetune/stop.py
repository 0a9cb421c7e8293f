"""Stopping a run: preemption (SIGTERM or train.preemption_signal ends the run at a step boundary, with a
checkpoint), the launcher's stop of a rank whose peer failed, and divergence."""

from __future__ import annotations

import signal


class Stopped(BaseException):
    """A stop signal before training started (or after it ended): the launcher ends the survivors when a rank
    dies, or the job was cancelled. A BaseException, as KeyboardInterrupt is: it arrives anywhere (in the middle of
    reading the data, say), and no `except Exception` on the way may take it for that code's own failure (a
    damaged data file was reported once)."""


class Preempted(Exception):
    """The run stopped at a step boundary on a stop signal, after writing a checkpoint."""

    def __init__(self, signame: str, step: int, checkpoint: str):
        super().__init__(f"{signame} at step {step}")
        self.signame, self.step, self.checkpoint = signame, step, checkpoint


class Diverged(Exception):
    """A non-finite loss or gradient norm: the run stops at that step and exports nothing."""


class StopRequest:
    """SIGTERM (a scheduler's preemption; torchrun forwards it to every rank and waits 30 s before SIGKILL) and
    train.preemption_signal. Before training starts, a signal stops the process at once (Stopped). While it
    trains, the signal is only noted: the flag rides on the all-reduce every optimizer step starts with, so
    all ranks see it at the same step boundary, write a checkpoint there and stop (loop.train)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False

    def install(self, *names: str) -> None:
        for name in {"SIGTERM", *names}:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.armed:
            raise Stopped()
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


STOP = StopRequest()
