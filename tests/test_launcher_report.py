"""finetune.launcher_report: what the launcher shows when a run stops for a reason finetune names.

The report is built from the error files the ranks write (checked in process, on torch's own ProcessFailure and
ChildFailedError); the hook reaches the launcher through finetune-launcher.pth, which the install puts in
site-packages (checked by a real `accelerate launch`). test_bad_inputs.py runs cases of its corpus through
`accelerate launch` too.
"""

from __future__ import annotations

import os
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_killing_the_group
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record

from finetune.launcher_report import install_excepthook, report, write_error_file
from finetune.launching import finetune_command

MESSAGE = "finetune: 1 problem in the run config:\n  - learning_rate: must be > 0, got -1.0"


def failure(tmp_path: Path, rank: int, exitcode: int, message: str | None, monkeypatch) -> ProcessFailure:
    """A rank's failure as torchrun's agent reads it: from the error file the rank wrote (or none)."""
    path = tmp_path / f"error_{rank}.json"
    if message is not None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        write_error_file(message)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_a_failure_finetune_named_ends_with_its_message(tmp_path, monkeypatch, capsys):
    failures = {
        1: failure(tmp_path, 1, 143, None, monkeypatch),  # stopped by the launcher: no error file
        0: failure(tmp_path, 0, 2, MESSAGE, monkeypatch),
    }
    assert report(ChildFailedError("finetune", failures)) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-2:] == MESSAGE.splitlines()
    assert "rank 0 stopped with the message below" in err and "rank 1 exit code 143" in err
    assert "Traceback" not in err
    # the rank that named it was then killed by a signal (torchrun's SIGTERM): 128 + N, not os._exit(-15)'s 241
    failures[0] = failure(tmp_path, 0, -signal.SIGTERM, MESSAGE, monkeypatch)
    assert report(ChildFailedError("finetune", failures)) == 128 + signal.SIGTERM
    # both named it, but torchrun's SIGTERM reached rank 0 after it wrote its message and before it exited 2: the
    # other rank's own code is the run's (was 143, the launch's bad-input test failing once in CI)
    failures[1] = failure(tmp_path, 1, 2, MESSAGE, monkeypatch)
    assert report(ChildFailedError("finetune", failures)) == 2


def test_the_same_message_from_every_rank_is_shown_once(tmp_path, monkeypatch, capsys):
    failures = {r: failure(tmp_path, r, 1, "finetune: diverged at step 3", monkeypatch) for r in (0, 1)}
    assert report(ChildFailedError("finetune", failures)) == 1
    err = capsys.readouterr().err
    assert err.count("diverged at step 3") == 1 and "rank 0, rank 1 stopped" in err


def test_a_killed_rank_that_no_rank_named_is_one_line(tmp_path, monkeypatch, capsys):
    """Rank 1 killed (-9) while rank 0 waited in a collective: torchrun's SIGTERM reached rank 0 before gloo's
    error did, so rank 0 stopped as stopped by the launcher (143, its message on the screen, no error file). Seen
    in tests/test_faults.py under ZeRO-3 with the other rank in a checkpoint's barrier."""
    failures = {0: failure(tmp_path, 0, 143, None, monkeypatch), 1: failure(tmp_path, 1, -9, None, monkeypatch)}
    monkeypatch.setattr(sys, "argv", ["accelerate", "launch", "-m", "finetune", "--config", "x.yaml"])
    assert report(ChildFailedError("finetune", failures)) == 128 + signal.SIGKILL
    err = capsys.readouterr().err.strip()
    assert err.startswith("[launcher] finetune failed: rank 1 exit code -9 (SIGKILL: kill -9, or the system's")
    assert "the others were stopped" in err and "\n" not in err
    capsys.readouterr()
    # SIGUSR1 sent to the ranks themselves (scripts/slurm.sbatch: the launcher ignores it) before training started:
    # each rank said so and exited 138 (one may get torchrun's SIGTERM first: 143). Was ChildFailedError's traceback.
    stopped = {0: failure(tmp_path, 0, 138, None, monkeypatch), 1: failure(tmp_path, 1, 143, None, monkeypatch)}
    assert report(ChildFailedError("finetune", stopped)) == 128 + signal.SIGUSR1
    err = capsys.readouterr().err.strip()
    assert err.startswith("[launcher] finetune stopped: every rank was stopped by SIGUSR1, SIGTERM") and "\n" not in err
    crashed = {**failures, 0: failure(tmp_path, 0, 1, None, monkeypatch)}  # rank 0 crashed: its traceback stays
    assert report(ChildFailedError("finetune", crashed)) is None
    monkeypatch.setattr(sys, "argv", ["accelerate", "launch", "other.py"])  # not finetune's ranks
    assert report(ChildFailedError("other.py", failures)) is None


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record, under pytest
def test_other_failures_keep_the_traceback(tmp_path, monkeypatch, capsys):
    """A crash (no error file), and an error file written by torch's own @record, are not ours."""
    crashed = {0: failure(tmp_path, 0, 1, None, monkeypatch)}
    assert report(ChildFailedError("finetune", crashed)) is None

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "recorded.json"))

    @record
    def crash():
        raise ValueError("boom")

    with pytest.raises(ValueError):
        crash()
    recorded = {0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "recorded.json"))}
    assert "boom" in str(recorded[0].message)
    assert report(ChildFailedError("finetune", recorded)) is None
    assert report(ValueError("not the launcher's")) is None
    assert capsys.readouterr().err == ""


def test_a_signal_to_the_launcher_of_finetune_is_one_line(monkeypatch, capsys):
    stop = SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
    monkeypatch.setattr(sys, "argv", ["accelerate", "launch", "-m", "torch.distributed.run", "other.py"])
    assert report(stop) is None
    monkeypatch.setattr(sys, "argv", ["accelerate", "launch", "-m", "finetune", "--config", "x.yaml"])
    assert report(stop) == 128 + signal.SIGTERM
    assert (
        capsys.readouterr().err.strip()
        == "[launcher] stopped by SIGTERM; every rank was asked to stop (their messages are above)."
    )


def test_ctrl_c_under_the_one_process_launcher_is_one_line(monkeypatch, capsys):
    """Ctrl-C reaches accelerate's simple launcher (single.yaml) and its child: the child says "interrupted" and exits
    130; the launcher's KeyboardInterrupt (in process.wait) was an 18-line traceback and exit -2."""
    from finetune import launcher_report

    monkeypatch.setattr(launcher_report, "_children", lambda: [])  # this process's own children are not a run's
    monkeypatch.setattr(launcher_report, "command_line", lambda: ["accelerate", "launch", "-m", "finetune"])
    assert report(KeyboardInterrupt()) == 130
    assert capsys.readouterr().err.startswith("[launcher] interrupted (Ctrl-C); the run was interrupted too")
    monkeypatch.setattr(launcher_report, "command_line", lambda: ["python", "train.py"])
    assert report(KeyboardInterrupt()) is None


def test_a_preemption_signal_to_the_launcher_reaches_its_children(tmp_path):
    """SIGUSR1 (train.preemption_signal) to an `accelerate launch` of finetune: its default action ended the launcher
    and left the run training, orphaned. It is forwarded, as SIGTERM is, and the launcher waits for its child; a
    signal the launcher ignores (scripts/slurm.sbatch's trap) stays ignored."""
    script = tmp_path / "launcher.py"
    script.write_text(
        "import os, signal, subprocess, sys\n"
        "from finetune import launcher_report\n"
        "signal.signal(signal.SIGUSR2, signal.SIG_IGN)\n"
        "launcher_report._forward_stop_signal()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, sys, time; "
        "signal.signal(signal.SIGUSR1, lambda *_: sys.exit(138)); print(1, flush=True); time.sleep(60)'], "
        "stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "print(child.wait(), signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.split() == ["138", "True"], proc


def test_one_process_the_run_named_its_failure(tmp_path, monkeypatch, capsys):
    """accelerate's simple launcher (single.yaml) raises CalledProcessError for a failed child: reported in two
    lines ending with the message the child left in FINETUNE_LAUNCHER_ERROR_FILE, with the child's exit code; a
    crash (no file) keeps the traceback, and so does any other program's launcher."""
    from finetune import launcher_report

    command = ["/venv/bin/accelerate", "launch", "-m", "finetune", "--config", "x.yaml"]
    monkeypatch.setattr(launcher_report, "command_line", lambda: command)
    monkeypatch.setenv(launcher_report.CHILD_ERROR_FILE, str(tmp_path / "child.json"))
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    failed = subprocess.CalledProcessError(2, ["python", "-m", "finetune"])
    assert report(failed) is None  # no file: a crash
    write_error_file(MESSAGE)  # as the child does
    assert report(failed) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-2:] == MESSAGE.splitlines() and "Traceback" not in err
    assert not (tmp_path / "child.json").exists()  # read once, removed
    write_error_file(MESSAGE)
    command[:] = ["/venv/bin/python", "-m", "accelerate.commands.launch", "other.py"]
    assert report(failed) is None
    command[-1] = "-m finetune"  # python -m accelerate.commands.launch ... -m finetune
    assert report(failed) == 2


def test_a_deepspeed_config_without_deepspeed_names_the_install(monkeypatch, capsys):
    """accelerate's launcher raises ImportError for a DeepSpeed config where DeepSpeed is not installed (its
    deepspeed_launcher): one line naming finetune's extra, exit 2 (bad input), instead of its traceback and exit 1."""
    from finetune import launcher_report

    command = ["/venv/bin/accelerate", "launch", "--config_file", "zero2.yaml", "-m", "finetune", "--config", "x.yaml"]
    monkeypatch.setattr(launcher_report, "command_line", lambda: command)
    missing = ImportError("DeepSpeed is not installed => run `pip3 install deepspeed` or build it from source.")
    assert report(missing) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'finetune[deepspeed]'" in err and "Traceback" not in err, err
    command[-4:] = ["other.py"]  # another program's launch keeps accelerate's traceback
    assert report(missing) is None
    assert report(ImportError("No module named 'something_else'")) is None


def test_the_install_puts_the_hook_in_every_launcher():
    """This environment's finetune-launcher.pth; which interpreters load it: test_install.py."""
    pth = [Path(d) / "finetune-launcher.pth" for d in site.getsitepackages()]
    assert any(p.exists() for p in pth), f"no finetune-launcher.pth in {site.getsitepackages()}: ./run.sh setup"
    probe = "import sys; print(getattr(sys.excepthook, 'finetune', False))"
    cmd = [sys.executable, "-c", probe, "torchrun"]  # a launcher, by its command line
    fresh = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert fresh.stdout.strip() == "True", fresh
    before = sys.excepthook
    try:
        install_excepthook()
        hook = sys.excepthook
        install_excepthook()  # once only: the hook is not wrapped twice
        assert sys.excepthook is hook and getattr(hook, "finetune", False)
    finally:
        sys.excepthook = before


@pytest.mark.slow
def test_accelerate_launch_still_prints_its_traceback_without_the_workaround(assets, tmp_path):
    """The workaround's reason: accelerate's launcher lets torchrun's ChildFailedError reach the interpreter.
    When this fails, accelerate reports a failed rank without a traceback: remove finetune/launcher_report.py's
    hook, finetune-launcher.pth and setup.py."""
    args = ["--model", assets.llama, "--dataset", assets.instruction, "--learning_rate", "-1"]
    cmd = finetune_command([*args, "--output_dir", str(tmp_path / "out")], ROOT / "accelerate_configs" / "ddp.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shown = run_killing_the_group(cmd, env | {"FINETUNE_LAUNCHER_TRACEBACK": "1"}, 120)
    assert shown.returncode == 1 and "Traceback" in shown.stderr and "ChildFailedError" in shown.stderr, shown.stderr
    assert "world size 2" not in shown.stdout + shown.stderr  # refused before any Accelerator

    quiet = run_killing_the_group(cmd, env, 120)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stdout + quiet.stderr, quiet.stderr
    lines = [line for line in quiet.stderr.splitlines() if line.strip()]
    assert lines[-2:] == MESSAGE.splitlines(), quiet.stderr  # the last lines (test_bad_inputs.py checks the rest)


@pytest.mark.slow
def test_one_process_under_accelerate_launch_still_needs_the_workaround(assets, tmp_path):
    """Why launcher_report also handles accelerate's simple launcher (single.yaml): without it, a bad input ends in
    the launcher's CalledProcessError traceback (exit 1), and a SIGTERM to the launcher leaves the run running,
    orphaned. When this fails, accelerate does both itself: remove _forward_stop_signal and _report_child."""
    import psutil

    cfg = ROOT / "accelerate_configs" / "single.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FINETUNE_LAUNCHER_TRACEBACK": "1"}  # the workaround off
    bad = finetune_command(["--model", assets.llama, "--dataset", assets.instruction, "--learning_rate", "-1"], cfg)
    shown = run_killing_the_group([*bad, "--output_dir", str(tmp_path / "bad")], env, 120)
    assert shown.returncode == 1 and "CalledProcessError" in shown.stderr, shown.stderr[-3000:]

    args = ["--model", assets.llama, "--dataset", assets.instruction, "--max_steps", "100000", "--save_steps", "null"]
    cmd = finetune_command([*args, "--output_dir", str(tmp_path / "long"), "--disable_tqdm", "true"], cfg)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children = []
    try:
        for line in proc.stdout:
            if "] model:" in line:  # the run is past start-up
                break
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the launcher started no process"
        proc.terminate()
        proc.wait(timeout=60)
        time.sleep(2)
        orphans = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert orphans, "accelerate's launcher now forwards SIGTERM to its child: the workaround can go"
    finally:
        proc.kill()
        for c in children:
            if c.is_running():
                c.kill()


def test_torchrun_records_go_to_a_file_of_this_launcher_only(tmp_path, monkeypatch):
    """torchrun's records about its ranks go to <tmp>/finetune-launcher-<pid>.log, not the screen; a file an
    earlier launcher with the same pid left there (pids are reused; failed launches keep theirs) is replaced."""
    import logging
    import tempfile

    from finetune import launcher_report

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(launcher_report, "_torchrun_log", [])
    path = tmp_path / f"finetune-launcher-{os.getpid()}.log"
    path.write_text("ERROR torch.distributed.elastic.multiprocessing.api: failed (exitcode: 2) of an earlier run\n")
    loggers = [logging.getLogger(name) for name in launcher_report.TORCHRUN_LOGGERS]
    before = [list(lg.filters) for lg in loggers]
    try:
        launcher_report._torchrun_records_to_file()
        loggers[0].warning("Sending process %d closing signal SIGTERM", 7)
        loggers[1].error("Received Signals.SIGTERM death signal")
    finally:
        for lg, filters in zip(loggers, before, strict=True):
            lg.filters[:] = filters
    assert path.read_text().splitlines() == [
        "WARNING torch.distributed.elastic.multiprocessing.api: Sending process 7 closing signal SIGTERM",
        "ERROR torch.distributed.elastic.agent.server.api: Received Signals.SIGTERM death signal",
    ]
    assert launcher_report._torchrun_note() == f" (torchrun's own log lines: {path})"
