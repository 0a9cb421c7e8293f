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
    trains, the signal is only noted, and the ranks agree on it through StopVote: all of them stop after the
    same optimizer step and write a checkpoint there (loop.train)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False
        # Stopped was raised in this process. What reaches run_cli may be another error made of it: Python 3.11
        # wraps an exception raised in a class body's __set_name__ (the signal landing while a module imports) in
        # a RuntimeError, which an `except Exception` around reading the data took for a damaged file.
        self.stopped = False

    def install(self, *names: str) -> None:
        for name in {"SIGTERM", *names}:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.armed:
            self.stopped = True
            raise Stopped()
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


STOP = StopRequest()


class StopVote:
    """Whether any rank was asked to stop, agreed on by all ranks without stalling the device.

    Each optimizer step posts this rank's request (STOP) in an all-reduce on the host (a gloo group over a CPU
    tensor), which completes while the step's work is queued; the step's end reads the sum. Reading a device
    all-reduce would make the host wait for the device every step. Every rank reads the same sum, so all stop
    after the same step: the one in progress when the request was posted, or the next if the signal arrived after
    the post (at most two steps after the signal; the launcher allows 30 s)."""

    def __init__(self) -> None:
        from finetune.cluster import host_group

        self.group = host_group()  # all ranks, host-side (whatever the device's backend); None in one process
        self.flag = self.work = None

    def post(self) -> None:
        if self.group is not None:
            import torch
            import torch.distributed as dist

            self.flag = torch.tensor([float(STOP.requested)])
            self.work = dist.all_reduce(self.flag, group=self.group, async_op=True)

    def agreed(self) -> bool:
        if self.group is None:
            return STOP.requested
        self.work.wait()
        return bool(self.flag.numpy()[0] > 0)  # host memory: numpy() refuses a device tensor, so nothing syncs
