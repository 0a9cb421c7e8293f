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
  launcher stopped by a signal while launching finetune says so in one line (the ranks say where to resume), and
  so does a launch whose rank was killed by a signal before any rank could name the failure (the others stopped
  by torchrun: exit 143).
  A launch whose Accelerate config needs a package finetune installs as an extra (DeepSpeed), where it is not
  installed (accelerate's ImportError), is one line naming the install, exit 2.
  Anything else (a crash, another program) keeps the default traceback. FINETUNE_LAUNCHER_TRACEBACK=1 keeps
  it always.

One process (`distributed_type: 'NO'`, accelerate_configs/single.yaml) is not launched through torchrun:
accelerate's `simple_launcher` starts the run as a plain child process and waits for it. There a failure reaches
the launcher as subprocess.CalledProcessError (a traceback after our message, exit 1), and a SIGTERM to the
launcher ends the launcher alone: the run goes on, orphaned, and never checkpoints. So, in an `accelerate launch`
process of finetune (`install_excepthook`):

- the child writes its message to the file FINETUNE_LAUNCHER_ERROR_FILE names (set by the launcher for its
  children; torchrun's error file wins where there is one), and the launcher reports a CalledProcessError whose
  child left that message as above: a few lines ending with the message, the child's exit code;
- SIGTERM (or a preemption signal: train.preemption_signal's choices but SIGINT) to the launcher is forwarded to
  its children (the run stops at the step boundary with a checkpoint, as its ranks do under torchrun), the
  launcher waits for them and exits with 128+N after one line. Under torchrun its agent installs its own handler
  over this one for SIGTERM and SIGHUP (and SIGINT, SIGQUIT), which forwards the signal the same way; SIGUSR1 and
  SIGUSR2 it would leave to their default action (the launcher ends, its ranks orphaned): this handler forwards
  them there too;
- Ctrl-C (SIGINT to the terminal's process group: the child has it too) ends the simple launcher in a
  KeyboardInterrupt: one line once the child has exited, exit 130, as torchrun's launcher exits.

tests/test_launcher_report.py::test_one_process_under_accelerate_launch_still_needs_the_workaround fails once
accelerate forwards the signal and stops printing the traceback itself.

The hook reaches the launcher through `finetune-launcher.pth` (see setup.py), which Python runs at start-up and
which imports this module only in a launcher's interpreter (`accelerate launch`, torchrun: by its command line);
importing it takes about a quarter of a millisecond, and the hook does nothing until an exception reaches the top
of the process (or, in an `accelerate launch` of finetune, a SIGTERM arrives).
"""

from __future__ import annotations

import atexit
import os
import sys

MARK = "finetune"  # top-level key of an error file written here; torch reads only "message"
SHOW_TRACEBACK = "FINETUNE_LAUNCHER_TRACEBACK"
CHILD_ERROR_FILE = "FINETUNE_LAUNCHER_ERROR_FILE"  # set by an `accelerate launch` of finetune for its children
# accelerate's launcher stops with an ImportError when the Accelerate config needs a package that finetune installs as
# an extra ("DeepSpeed is not installed => run `pip3 install deepspeed` ...", commands/launch.py): its start -> the extra
EXTRAS = {"DeepSpeed is not installed": "deepspeed"}
_stopped_by: list[int] = []  # the signal this launcher forwarded to its children
# torchrun's own one-line records about its ranks ("failed (exitcode: 2) local_rank: 0 ...", "Sending process N closing
# signal SIGTERM", "Received Signals.SIGTERM death signal"): they repeat what the ranks said, so in a launch of
# finetune they go to a file the report names (_torchrun_records_to_file), not to the screen.
TORCHRUN_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")
_torchrun_log: list[str] = []  # the file they went to, once one did


def write_error_file(message: str) -> None:
    """This rank's message in torchrun's error file (under its agent) or, under accelerate's simple launcher, in
    the file the launcher named: for the launcher's report."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE") or os.environ.get(CHILD_ERROR_FILE)
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
    if _launches_finetune() and os.environ.get(SHOW_TRACEBACK) != "1":
        _forward_stop_signal()
        _torchrun_records_to_file()


def _torchrun_records_to_file() -> None:
    """torchrun's warnings and errors about its ranks into <tmp>/finetune-launcher-<pid>.log (a filter on its
    loggers, set before torch creates them; a record that cannot be written stays on the screen). Off the screen,
    they also cannot print logging's "--- Logging error ---" traceback when a second stop signal lands while one is
    being written."""
    import logging
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"finetune-launcher-{os.getpid()}.log")

    class ToFile(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.levelno < logging.WARNING:
                return True
            try:  # the first record truncates: a file of an earlier launcher with the same pid is not this one's
                with open(path, "a" if _torchrun_log else "w") as f:
                    f.write(f"{record.levelname} {record.name}: {record.getMessage()}\n")
            except OSError:
                return True
            if not _torchrun_log:
                _torchrun_log.append(path)
            return False

    for name in TORCHRUN_LOGGERS:
        logging.getLogger(name).addFilter(ToFile())
    atexit.register(_remove_unnamed_log)


def _remove_unnamed_log() -> None:
    """At a launcher's ordinary exit (a run that ended well, or a failure shown with its traceback) no report named
    the file: it goes. A report that names it ends the launcher with os._exit, which skips this."""
    for path in _torchrun_log:
        try:
            os.remove(path)
        except OSError:
            pass


def _torchrun_note() -> str:
    return f" (torchrun's own log lines: {_torchrun_log[0]})" if _torchrun_log else ""


def _launches_finetune() -> bool:
    """Whether this process is an `accelerate launch` (or `python -m accelerate.commands.launch`) of finetune. Read
    from the command line the process was started with: while the .pth runs, `python -m`'s sys.argv is not set."""
    argv = command_line()
    script = next((i for i, a in enumerate(argv) if os.path.basename(a) == "accelerate"), None)
    launcher = script is not None and argv[script + 1 : script + 2] == ["launch"]
    launcher = launcher or "accelerate.commands.launch" in argv
    return launcher and any("finetune" in arg for arg in argv)


def command_line() -> list[str]:
    """The command line this process was started with (/proc; else sys.argv)."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return list(sys.argv)


def _forward_stop_signal() -> None:
    """An `accelerate launch` of finetune: its children write their messages where this process reads them, and a
    stop signal to it (SIGTERM, or one of train.preemption_signal's) is forwarded to them: accelerate's simple
    launcher would end here and leave the run orphaned, and torchrun's agent handles only SIGTERM, SIGINT, SIGHUP and
    SIGQUIT (SIGUSR1 would end it and orphan its ranks). Not SIGINT: Ctrl-C reaches every process of the terminal's
    group, the ranks too. A signal this process ignores stays ignored (scripts/slurm.sbatch: SLURM sends SIGUSR1 to
    the ranks themselves)."""
    import signal
    import tempfile

    from finetune.config.schema import PREEMPTION_SIGNALS  # an import of some 0.08 s, in a launch of finetune only

    os.environ[CHILD_ERROR_FILE] = os.path.join(tempfile.gettempdir(), f"finetune-launcher-{os.getpid()}.json")

    def forward(signum, frame) -> None:
        children = _children()
        if not children:  # nothing started yet: stop as without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        _stopped_by.append(signum)
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for name in PREEMPTION_SIGNALS:
        signum = getattr(signal, name)
        if signum != signal.SIGINT and signal.getsignal(signum) != signal.SIG_IGN:
            signal.signal(signum, forward)


def _children() -> list[int]:
    """The processes this one started (from /proc; empty where there is none)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # field 4, after the (command name)
                found.append(int(entry))
    return found


def _wait_for_children() -> None:
    """Until the processes this one started have exited; a second Ctrl-C stops waiting."""
    try:
        for pid in _children():
            os.waitpid(pid, 0)
    except (KeyboardInterrupt, ChildProcessError):
        pass


def report(error: BaseException) -> int | None:
    """Print the launcher's report of `error` without a traceback and return the exit code; None when the
    error is not one finetune named (the default traceback is then shown)."""
    kind = type(error)
    if kind.__name__ == "CalledProcessError" and kind.__module__ == "subprocess" and _launches_finetune():
        return _report_child(error)
    if kind is KeyboardInterrupt and _launches_finetune():  # Ctrl-C under the simple launcher (torchrun: below)
        _wait_for_children()  # the terminal's Ctrl-C reached the run too: its message comes first
        print("[launcher] interrupted (Ctrl-C); the run was interrupted too (its message is above).", file=sys.stderr)
        return 130
    missing = [(text, extra) for text, extra in EXTRAS.items() if kind is ImportError and str(error).startswith(text)]
    if missing and _launches_finetune():
        text, extra = missing[0]
        print(
            f"[launcher] {text}, and this Accelerate config needs it: pip install 'finetune[{extra}]'", file=sys.stderr
        )
        return 2
    if not kind.__module__.startswith("torch.distributed.elastic"):
        return None
    if kind.__name__ == "SignalException" and _argv_names_finetune():
        signame = getattr(error.sigval, "name", str(error.sigval))
        print(
            f"[launcher] stopped by {signame}; every rank was asked to stop (their messages are above)."
            + _torchrun_note(),
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
        return _report_killed(error, failures)
    others = [f"rank {rank} exit code {f.exitcode}" for rank, f in failures.items() if rank not in ours]
    named = ", ".join(f"rank {rank}" for rank in ours)
    lines = [f"[launcher] {error.name} failed: {named} stopped with the message below"]
    if others:
        lines[0] += f"; also stopped: {', '.join(others)}"
    lines[0] += _torchrun_note()
    messages = list(dict.fromkeys(f.error_file_data["message"]["message"] for f in ours.values()))
    print("\n".join(lines + messages), file=sys.stderr)
    import signal

    codes = [128 - f.exitcode if f.exitcode < 0 else f.exitcode for f in ours.values()]  # os._exit(-N): 256 - N
    # a rank that named the failure and exited with its own code wins over one that torchrun's SIGTERM then reached
    # after it had written its message (bad input: rank 1 exits 2 first, rank 0 is stopped: 143)
    return next((code for code in codes if code != 128 + signal.SIGTERM), codes[0])


def _report_killed(error, failures: dict) -> int | None:
    """No rank named the failure because one was killed by a signal (kill -9, the kernel's out-of-memory killer)
    and torchrun stopped the others (exit 143, each saying so and where to resume) before a collective told them
    of it; or every rank was stopped by a signal sent to the ranks themselves (exit 128 + N, each saying so: under
    scripts/slurm.sbatch SLURM's SIGUSR1 reaches the ranks, not the launcher). One line, exit 128 + the signal;
    anything else (a crash: its traceback is above) is not ours."""
    import signal

    killed = {rank: -f.exitcode for rank, f in failures.items() if f.exitcode < 0}
    stopped = all(f.exitcode < 0 or f.exitcode - 128 in signal.valid_signals() for f in failures.values())
    if not (stopped and _argv_names_finetune()):
        return None
    if not killed:
        signums = [f.exitcode - 128 for f in failures.values()]
        signum = next((n for n in signums if n != signal.SIGTERM), signal.SIGTERM)  # torchrun's own SIGTERM follows
        names = ", ".join(dict.fromkeys(_signal_name(n) for n in signums))
        print(
            f"[launcher] {error.name} stopped: every rank was stopped by {names} (their messages are above)."
            + _torchrun_note(),
            file=sys.stderr,
        )
        return 128 + signum
    how = "; ".join(
        f"rank {rank} exit code -{signum} ({_signal_name(signum)}"
        + (": kill -9, or the system's out-of-memory killer)" if signum == signal.SIGKILL else ")")
        for rank, signum in killed.items()
    )
    others = "; the others were stopped (their messages are above)" if len(killed) < len(failures) else ""
    print(f"[launcher] {error.name} failed: {how}{others}." + _torchrun_note(), file=sys.stderr)
    return 128 + next(iter(killed.values()))


def _argv_names_finetune() -> bool:
    """Whether this launcher's own arguments name finetune (its ranks are finetune's)."""
    return any("finetune" in arg for arg in sys.argv)


def _signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _report_child(error) -> int | None:
    """accelerate's simple launcher (one process): the run's child failed, or this launcher forwarded a stop."""
    import json

    if _stopped_by:
        import signal

        name = signal.Signals(_stopped_by[0]).name
        print(f"[launcher] stopped by {name}; the run was asked to stop (its message is above).", file=sys.stderr)
        return 128 + _stopped_by[0]
    path = os.environ.get(CHILD_ERROR_FILE, "")
    try:
        with open(path) as f:
            data = json.load(f)
        os.remove(path)
    except (OSError, ValueError):
        return None  # a crash: its traceback is above, and the launcher's own stays
    if not (isinstance(data, dict) and data.get(MARK)):
        return None
    print(f"[launcher] finetune stopped with the message below\n{data['message']['message']}", file=sys.stderr)
    return error.returncode
