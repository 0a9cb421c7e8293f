"""Command line: the only reader of argv. argv + YAML -> typed, validated config -> run.

finetune --config RUN.yaml [--<field> VALUE ...]            train (any launcher)
accelerate launch --config_file accelerate_configs/ddp.yaml finetune --config RUN.yaml
"""

from __future__ import annotations

import difflib
import os
import signal
import sys

from finetune.checkpoint import WriteError
from finetune.config import ConfigError
from finetune.config.load import parse
from finetune.launcher_report import write_error_file
from finetune.report import PushFailed
from finetune.stop import STOP, Diverged, Preempted, Stopped

SUBCOMMANDS = ("parity", "merge", "plan", "plot", "prepare", "check")  # dispatched in run_cli


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def run_cli(argv: list[str] | None = None) -> int:
    """Parse and run; returns the exit code.

    Bad input: one clear message, exit code 2, no traceback. A dead peer or a stop by the launcher:
    one line per rank naming what happened and the last complete checkpoint to resume from.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["parity"]:
        from finetune.commands.parity import main as parity

        return parity(argv[1:])
    if argv[:1] == ["merge"]:
        from finetune.commands.merge import main as merge

        return merge(argv[1:])
    if argv[:1] == ["plan"]:
        from finetune.commands.plan import main as plan

        return plan(argv[1:])
    if argv[:1] == ["plot"]:
        from finetune.commands.plot import main as plot

        return plot(argv[1:])
    if argv[:1] == ["prepare"]:
        from finetune.commands.prepare import main as prepare

        return prepare(argv[1:])
    if argv[:1] == ["check"]:
        from finetune.commands.check import main as check

        return check(argv[1:])
    cfg = None
    rank = os.environ.get("RANK", "0")
    stop_in_callbacks(lambda: _stopped_message(rank, cfg))
    try:
        STOP.install()  # in the try: the launcher's SIGTERM can land while the handler is being installed
        _no_misspelled_subcommand(argv)
        cfg = parse(argv)
        STOP.install(cfg.train.preemption_signal)
        done = cfg.finished  # found while parsing: every rank read the same files
        if done and not done.differences:  # a requeued job whose run had finished
            if _is_main_rank():
                _tell(done.message(cfg.train.output_dir))
            return 0
        from finetune.run import run

        run(cfg)
    except BaseException as e:
        # The rank now stops for a reason of its own: the launcher's SIGTERM (sent as soon as another rank exits
        # first) is only noted, so that it cannot cut this rank's message or error file short with a traceback.
        STOP.armed = True
        code = _stopping(e, rank, cfg)
        if code is None:
            raise
        return code
    return 0


def _no_misspelled_subcommand(argv: list[str]) -> None:
    """`finetune chek ...`: a word first that is close to a subcommand's name is taken for it, not for a stray
    argument of a training run."""
    if argv and not argv[0].startswith("-"):
        close = difflib.get_close_matches(argv[0], SUBCOMMANDS, n=1, cutoff=0.6)
        if close:
            raise ConfigError([(argv[0], f"unknown command; did you mean `finetune {close[0]}`?")])


def _stopping(e: BaseException, rank: str, cfg) -> int | None:
    """Say why the run stops and return its exit code; None for a crash (its traceback is shown) and for
    SystemExit (--help)."""
    if isinstance(e, Stopped) or STOP.stopped:  # a stop signal, whatever error it was turned into on the way
        # No error file: the exit code says it, and the launcher's report would take this rank for the one that failed
        _tell(_stopped_message(rank, cfg))
        return _stopped_code()
    if isinstance(e, ConfigError):
        _stop_with(e.render())
        from finetune.parallel.base import tell_waiting_ranks

        tell_waiting_ranks(e)
        return 2
    if isinstance(e, Preempted):
        _stop_with(_preempted_message(e))
        return 128 + e.signum
    from finetune.parallel.base import NeverJoined

    if isinstance(e, (Diverged, PushFailed, WriteError, NeverJoined)):  # the run failed for a reason it can name
        _stop_with(f"finetune: {e}")
        return 1
    if isinstance(e, KeyboardInterrupt):
        _tell("finetune: interrupted")
        return 130
    if not isinstance(e, Exception):
        return None
    from finetune.parallel import is_peer_failure

    if not is_peer_failure(e):
        return None
    from finetune.watchdog import explain_hang

    first = (str(e).strip().splitlines() or [""])[0][:300]
    message = (
        f"finetune rank {rank}: a collective failed because another rank died or did not answer within "
        f"ddp_timeout (host_wait_timeout while one process worked alone) ({type(e).__name__}: {first}). "
        f"{explain_hang()} {_hint(cfg)}"
    )
    _stop_with(message, every_rank=True)  # each rank says what it saw
    return 1


def _preempted_message(e: Preempted) -> str:
    if e.final is None:
        return (
            f"finetune: stopped by {e.signame} (preemption) after step {e.step}; checkpoint saved: {e.checkpoint}. "
            "Continue with the same command plus --resume_from_checkpoint auto."
        )
    return (
        f"finetune: stopped by {e.signame} (preemption) after the last step ({e.step}), once the run had finished: "
        f"{e.final} is complete"
        + (f", and so is the end-of-run checkpoint {e.checkpoint}" if e.checkpoint else "")
        + ". Nothing is left to run."
    )


def _stopped_code() -> int:
    return 128 + (STOP.signum or signal.SIGTERM)


def _stopped_message(rank: str, cfg) -> str:
    name = signal.Signals(_stopped_code() - 128).name
    return (
        f"finetune rank {rank}: stopped by {name} before training started: the launcher stops every rank when one "
        f"fails (see its report of which), or the job was cancelled or preempted. {_hint(cfg)}"
    )


def stop_in_callbacks(message) -> None:
    """The stop signal raises Stopped wherever the main thread is. When that is a callback Python cannot raise out
    of (a weakref callback of the import system, a __del__), Python only prints "Exception ignored in ...", a
    traceback, and goes on: the rank would not stop. Stop there too, with the same line and exit code as the
    `except Stopped` of run_cli (tests/test_faults.py::test_stop_signal_inside_a_callback_still_stops)."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, Stopped):
            _tell(message())
            sys.stdout.flush()
            os._exit(_stopped_code())
        previous(unraisable)

    sys.unraisablehook = hook


def _stop_with(message: str, every_rank: bool = False) -> None:
    """A run that stops for a reason it names: the message on the screen (the main rank's, unless each rank
    says its own) and in torchrun's error file, for the launcher's report (finetune.launcher_report)."""
    if every_rank or _is_main_rank():
        _tell(message)
    write_error_file(message)


def _tell(text: str) -> None:
    """A rank's last words on stderr in one write, its newline included: print() writes the text and the newline
    apart, and the launcher's own log line (another process on the same stderr, as it stops the other ranks) was
    seen landing between them, in the middle of the message's last line."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _hint(cfg) -> str:
    from finetune.checkpoint import resume_hint

    return resume_hint(cfg.train.output_dir) if cfg is not None else ""


def main() -> None:
    """Console entry point. Exits hard once output is flushed, without destroying the process group: torch's
    process-group threads have been seen to abort the interpreter at exit ("terminate called without an active
    exception"), and destroying a gloo group that DDP's reducer still holds sometimes never returns (its
    destructor joins a worker thread; seen in about 1 of 15 two-process runs). The launcher and the peers
    see the process end either way."""
    code = run_cli()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
