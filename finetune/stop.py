"""Stopping a run: preemption (SIGTERM or train.preemption_signal ends the run at a step boundary, with a
checkpoint), the launcher's stop of a rank whose peer failed, and divergence."""

from __future__ import annotations

import os
import signal


class Stopped(BaseException):
    """A stop signal before training started: the launcher ends the survivors when a rank dies, or the job was
    cancelled or preempted (STOP.signum says which signal). A BaseException, as KeyboardInterrupt is: it arrives
    anywhere (in the middle of reading the data, say), and no `except Exception` on the way may take it for that
    code's own failure (a damaged data file was reported once)."""


class Preempted(Exception):
    """The run stopped on a stop signal: at a step boundary after writing a checkpoint (`checkpoint`), or, for a
    signal after the last step's vote, once final/ was written (`final`; `checkpoint`: the end-of-run checkpoint,
    if any). `signum` is the one all ranks agreed on (StopVote), so every rank says the same."""

    def __init__(self, signum: int, step: int, checkpoint: str | None, final: str | None = None):
        self.signame = signal.Signals(signum).name
        super().__init__(f"{self.signame} at step {step}")
        self.signum, self.step, self.checkpoint, self.final = signum, step, checkpoint, final


class Diverged(Exception):
    """A non-finite loss or gradient norm: the run stops at that step and exports nothing."""


class StopRequest:
    """SIGTERM (a scheduler's preemption; torchrun forwards it to every rank and waits 30 s before SIGKILL) and
    train.preemption_signal. Before training starts, a signal stops the process at once (Stopped). From then on
    it is only noted, and the ranks agree on it through StopVote: all of them stop after the same optimizer step
    and write a checkpoint there (loop.train); a signal after the last step's vote lets the run finish final/
    first (run.train_and_export).

    A process forked from this one (datasets' tokenising workers) inherits the handler; the launcher's killpg
    reaches it too. It exits at once, quietly, with 128 + the signal: its parent says what happened."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False
        self.pid = os.getpid()  # the process that installed the handler
        # Stopped was raised in this process. What reaches run_cli may be another error made of it: Python 3.11
        # wraps an exception raised in a class body's __set_name__ (the signal landing while a module imports) in
        # a RuntimeError, which an `except Exception` around reading the data took for a damaged file.
        self.stopped = False

    def install(self, *names: str) -> None:
        self.pid = os.getpid()
        for name in {"SIGTERM", *names}:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self.pid:  # a forked worker: no traceback of its own, no message (its parent's is enough)
            os._exit(128 + signum)
        if not self.armed:
            self.stopped = True
            self.signum = signum
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
    """Whether any rank was asked to stop, and by which signal, agreed on by all ranks without stalling the device.

    Each optimizer step posts this rank's request (STOP.signum, 0 for none) in a MAX all-reduce on the host (a gloo
    group over a CPU tensor), which completes while the step's work is queued; the step's end reads it. Reading a
    device all-reduce would make the host wait for the device every step. A signal may reach some ranks only (one
    machine of several preempted): every rank reads the same signal, so all say the same and all stop
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

            self.flag = torch.tensor([STOP.signum or 0], dtype=torch.int32)
            self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def agreed(self) -> int:
        """The signal to stop for (0: go on)."""
        if self.group is None:
            return STOP.signum or 0
        self.work.wait()
        return int(self.flag.numpy()[0])  # host memory: numpy() refuses a device tensor, so nothing syncs


def agreed_signal() -> int:
    """The stop signal any rank noted so far (the largest number where they differ; 0: none), agreed on by every
    rank: one host collective, for the end of a run (StopVote agrees on it step by step while training)."""
    from finetune.cluster import host_gather

    return max(host_gather(STOP.signum or 0))
