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


def test_the_same_message_from_every_rank_is_shown_once(tmp_path, monkeypatch, capsys):
    failures = {r: failure(tmp_path, r, 1, "finetune: diverged at step 3", monkeypatch) for r in (0, 1)}
    assert report(ChildFailedError("finetune", failures)) == 1
    err = capsys.readouterr().err
    assert err.count("diverged at step 3") == 1 and "rank 0, rank 1 stopped" in err


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


def test_the_install_puts_the_hook_in_every_interpreter():
    pth = [Path(d) / "finetune-launcher.pth" for d in site.getsitepackages()]
    assert any(p.exists() for p in pth), f"no finetune-launcher.pth in {site.getsitepackages()}: ./run.sh setup"
    probe = "import sys; print(getattr(sys.excepthook, 'finetune', False))"
    fresh = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
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
