"""What the launcher shows when a run stops for a reason finetune names.

Under `accelerate launch` (and torchrun) the ranks run under torch.distributed.elastic's agent. When a rank
exits non-zero, the agent raises ChildFailedError; when the launcher itself gets SIGTERM/SIGINT (a scheduler's
preemption, Ctrl-C), it raises SignalException. Neither accelerate's launcher nor torchrun catches them, so
after our one-line message the user reads some 40 lines of the launcher's own Python traceback.

This module is the one place that works around it (tests/test_launcher_report.py fails once accelerate stops
printing that traceback, so the workaround can go):

- `write_error_file`: a rank that stops with a message of ours writes it to torchrun's error file
  (TORCHELASTIC_ERROR_FILE), marked as ours. The launcher's failure report then names the message instead of
  "To enable traceback see ...".
- `install_excepthook`: in the launcher process, a failure whose ranks left such a message is reported in a
  few lines ending with that message, and the launcher exits with the rank's exit code (2: bad input). A
  launcher stopped by a signal while launching finetune says so in one line (the ranks say where to resume).
  Anything else (a crash, another program) keeps the default traceback. FINETUNE_LAUNCHER_TRACEBACK=1 keeps
  it always.

The hook reaches the launcher through `finetune-launcher.pth` (see setup.py), which Python runs at start-up;
importing this module takes about a quarter of a millisecond, and the hook does nothing until an exception
reaches the top of a process.
"""

from __future__ import annotations

import os
import sys

MARK = "finetune"  # top-level key of an error file written here; torch reads only "message"
SHOW_TRACEBACK = "FINETUNE_LAUNCHER_TRACEBACK"


def write_error_file(message: str) -> None:
    """Under torchrun's agent: this rank's message in its error file, for the launcher's report."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    data = {
        MARK: True,
        "message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}},
    }
    tmp = f"{path}.{os.getpid()}.tmp"  # the agent reads the file as soon as this rank exits: whole or absent
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def install_excepthook() -> None:
    if getattr(sys.excepthook, MARK, False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        code = None if os.environ.get(SHOW_TRACEBACK) == "1" else report(value)
        if code is None:
            previous(kind, value, tb)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the exit code of the rank that named the failure, not the interpreter's 1

    setattr(hook, MARK, True)
    sys.excepthook = hook


def report(error: BaseException) -> int | None:
    """Print the launcher's report of `error` without a traceback and return the exit code; None when the
    error is not one finetune named (the default traceback is then shown)."""
    kind = type(error)
    if not kind.__module__.startswith("torch.distributed.elastic"):
        return None
    if kind.__name__ == "SignalException" and any("finetune" in arg for arg in sys.argv):
        signame = getattr(error.sigval, "name", str(error.sigval))
        print(
            f"[launcher] stopped by {signame}; every rank was asked to stop (their messages are above).",
            file=sys.stderr,
        )
        return 128 + int(error.sigval)
    if kind.__name__ != "ChildFailedError":
        return None
    failures = dict(sorted(error.failures.items()))
    ours = {
        rank: f for rank, f in failures.items() if isinstance(f.error_file_data, dict) and f.error_file_data.get(MARK)
    }
    if not ours:
        return None
    others = [f"rank {rank} exit code {f.exitcode}" for rank, f in failures.items() if rank not in ours]
    named = ", ".join(f"rank {rank}" for rank in ours)
    lines = [f"[launcher] {error.name} failed: {named} stopped with the message below"]
    if others:
        lines[0] += f"; also stopped: {', '.join(others)}"
    messages = list(dict.fromkeys(f.error_file_data["message"]["message"] for f in ours.values()))
    print("\n".join(lines + messages), file=sys.stderr)
    return next(iter(ours.values())).exitcode
