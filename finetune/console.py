"""What the screen shows: the main process's lines and real errors. Everything else goes to output_dir/logs/.

Every rank writes output_dir/logs/rank<N>.log: its own lines, every third-party log record and Python warning,
and (other ranks) whatever third-party code prints. On the screen:
  main process   our lines; third-party warnings and errors, except the known ones nobody can act on (QUIET)
  other ranks    errors only (a failing rank still says why)
Until output_dir is settled (a previous run there is refused or cleared first, see run.restore_or_start), the
rank's log is held in memory; `attach` writes it out.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import re
import sys
import time
import warnings

OURS = "finetune"
# Third-party lines nobody can act on: kept in the rank's log, never on the screen (pattern, why).
QUIET = (
    ("Setting accelerator to CPU", "DeepSpeed's device auto-detection on a machine without a GPU"),
    ("Removed shared tensor", "accelerate saving a model with tied weights: expected, and reloads fine"),
    ("LOAD REPORT", "transformers' weight-loading table: summarised in one line on the screen"),
)
QUIET_WARNINGS = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)  # library internals
_LOAD_ROW = re.compile(r"^\s*(\S+)\s*\|\s*(MISSING|UNEXPECTED|MISMATCH\w*)\b", re.M)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class RankLog(logging.Handler):
    """output_dir/logs/rank<N>.log; records (and printed text) are held in memory until `attach`."""

    def __init__(self, rank: int):
        super().__init__(logging.DEBUG)
        self.rank = rank
        self.pending: list[str] = []
        self.file = None
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)

    def write(self, text: str) -> None:
        if self.file is None:
            self.pending.append(text)
        else:
            self.file.write(text)
            self.file.flush()

    def open(self, path: str) -> None:
        self.file = open(path, "a", encoding="utf-8")
        self.file.write("".join(self.pending))
        self.file.flush()
        self.pending = []


class _Printed(io.TextIOBase):
    """sys.stdout of a non-main rank: what third-party code prints goes to the rank's log."""

    def __init__(self, log: RankLog):
        self.log = log

    def write(self, text: str) -> int:
        self.log.write(text)
        return len(text)

    def writable(self) -> bool:
        return True


class ScreenFilter(logging.Filter):
    """Which records reach the screen, and how they read there."""

    def __init__(self, main: bool, rank: int):
        super().__init__()
        self.main, self.rank = main, rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.screen = record.getMessage()
        ours = record.name == OURS or record.name.startswith(OURS + ".")
        if not self.main:  # errors, and what only one rank does that the job should see (extra every_rank)
            record.prefix = f"[finetune rank{self.rank}]" if ours else f"[{record.name.split('.')[0]} rank{self.rank}]"
            return record.levelno >= logging.ERROR or getattr(record, "every_rank", False)
        if ours:
            record.prefix = "[finetune]"
            return record.levelno >= logging.INFO
        if record.levelno < logging.WARNING or getattr(record, "category", None) in QUIET_WARNINGS:
            return False
        text = record.getMessage()
        if "LOAD REPORT" in text:  # the record itself stays whole: the rank's log gets the table
            record.prefix, record.screen = "[finetune]", summarize_load_report(text, self.rank)
            return True
        if record.levelno < logging.ERROR and any(pattern in text for pattern, _ in QUIET):
            return False
        record.prefix = "[warning]" if record.name == "py.warnings" else f"[{record.name.split('.')[0]}]"
        return True


def summarize_load_report(text: str, rank: int = 0) -> str:
    """transformers' load report table as one line: which weights are new and which were not used."""
    rows = _LOAD_ROW.findall(_ANSI.sub("", text))
    parts = []
    for status, what in (
        ("MISSING", "newly initialised (not in the checkpoint)"),
        ("UNEXPECTED", "in the checkpoint but unused"),
        ("MISMATCH", "reinitialised (shape mismatch)"),
    ):
        keys = [k for k, s in rows if s.startswith(status)]
        if keys:
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            parts.append(f"{what}: {shown}")
    body = "; ".join(parts) or "see the load report"
    return f"model weights {body} (transformers' load report in logs/rank{rank}.log)"


class _State:
    log: RankLog | None = None
    started: float = time.time()


def setup(progress_bars: bool = True) -> RankLog:
    """Route every log record and warning of this process (before the Accelerator exists: DeepSpeed's import
    already logs). Rank from the launcher's environment; idempotent. The libraries' progress bars (loading the
    weights, mapping the data) on rank 0 only, none with progress_bars False (disable_tqdm)."""
    from finetune.parallel.topology import Launcher  # here: finetune.parallel imports this module

    rank = Launcher.read().rank
    main = rank == 0
    _State.started = time.time()
    log = _State.log if _State.log is not None and _State.log.rank == rank else RankLog(rank)
    _State.log = log
    screen = logging.StreamHandler(sys.stdout)
    screen.addFilter(ScreenFilter(main, rank))
    screen.setFormatter(logging.Formatter("%(prefix)s %(screen)s"))
    root = logging.getLogger()
    for h in root.handlers[:]:  # our earlier handlers (a second run in one process); others (pytest's) stay
        if isinstance(h, RankLog) or any(isinstance(f, ScreenFilter) for f in h.filters):
            root.removeHandler(h)
    root.addHandler(screen)
    root.addHandler(log)
    root.setLevel(logging.INFO)
    logging.getLogger(OURS).setLevel(logging.INFO)
    # Known-harmless third-party warnings that would otherwise fill the log on every step:
    # DeepSpeed calls torch.distributed collectives that torch has renamed;
    # under DeepSpeed the engine steps the optimizer, so torch cannot see that it ran before the scheduler.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")
    warnings.showwarning = _log_warning
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_warning()
    datasets.utils.logging.set_verbosity_warning()
    if main and progress_bars:  # one progress bar per job, not one per rank
        transformers.utils.logging.enable_progress_bar()
        datasets.enable_progress_bars()
    else:
        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()
    if not main:
        sys.stdout = _Printed(log)
    adopt_library_loggers()
    return log


def set_main(main: bool) -> None:
    """The Accelerator's word on which process is the main one (setup could only read RANK)."""
    log = _State.log
    root = logging.getLogger()
    for h in root.handlers:
        for f in h.filters:
            if isinstance(f, ScreenFilter) and f.main != main:
                f.main = main
                sys.stdout = sys.__stdout__ if main else _Printed(log)


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    logging.getLogger("py.warnings").warning(
        "%s:%s: %s: %s", filename, lineno, category.__name__, message, extra={"category": category}
    )


def adopt_library_loggers() -> None:
    """Libraries that print through their own console handler (transformers, datasets, DeepSpeed) log through
    ours instead: the handler goes, the records propagate to the root's screen filter and rank log. A console
    handler a library put on the root logger goes too: Megatron-LM's training.py, imported with accelerate, calls
    logging.basicConfig with a handler that prints every record at INFO to stdout, so on every rank each of
    finetune's lines came a second time ("INFO:finetune:...") with every library's INFO records."""
    root = logging.getLogger()
    consoles = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    for h in root.handlers[:]:
        ours = isinstance(h, RankLog) or any(isinstance(f, ScreenFilter) for f in h.filters)
        if not ours and isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in consoles:
            root.removeHandler(h)
    for name, lib in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(lib, logging.Logger) or name == OURS or name.startswith(OURS + "."):
            continue
        consoles = [h for h in lib.handlers if type(h) is logging.StreamHandler]
        for h in consoles:
            lib.removeHandler(h)
        if consoles:
            lib.propagate = True


def quiet_import(module: str) -> None:
    """Import a library that prints or logs through its own console handler while being imported (DeepSpeed:
    "Setting accelerator to CPU" on every rank): what it says goes to the rank's log."""
    if _State.log is None or module in sys.modules:
        importlib.import_module(module)
        return
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        importlib.import_module(module)
    adopt_library_loggers()
    if captured.getvalue():
        _State.log.write(captured.getvalue())


@contextlib.contextmanager
def printed_to_log():
    """What third-party code prints meanwhile goes to the rank's log (every rank): Accelerator() under DeepSpeed
    prints "DeepSpeed <op> built successfully" for an op it builds as it starts. Exceptions pass through."""
    if _State.log is None:
        yield
        return
    with contextlib.redirect_stdout(_Printed(_State.log)):
        yield


def attach(output_dir: str) -> str | None:
    """output_dir is this run's now: write the rank's log there (what was held, then everything as it comes)."""
    log = _State.log
    if log is None:
        return None
    adopt_library_loggers()  # libraries imported since setup (model loading, prepare)
    logs = os.path.join(output_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    path = os.path.join(logs, f"rank{log.rank}.log")
    if log.file is None or log.file.name != path:
        log.open(path)
    return path


def wall_time() -> float:
    """Seconds since the run started (setup)."""
    return time.time() - _State.started
