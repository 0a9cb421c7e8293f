"""Faults: a rank killed mid-run, preemption, a run killed while writing a checkpoint, a full disk, a damaged
checkpoint, divergence, a stuck rank. Nothing hangs, nothing is lost, one message says what happened."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import conftest
import psutil
import pytest
from conftest import ROOT, base_args, crash_after, finetune, grid_param, max_rel_diff, max_weight_diff

from finetune.launching import kill_job

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("faults")]  # one worker: the straight runs once


STEPS = 20  # checkpoints every 5: faults at 10 and 15, stops between 6 and 14, and resumes with steps left


def run_args(assets) -> list[str]:
    return base_args(
        assets.llama, assets.instruction, "--max_steps", str(STEPS), "--save_steps", "5", "--eval_fraction", "0"
    )


@pytest.fixture(scope="module")
def straight(assets, tmp_path_factory):
    """The uninterrupted run under each launcher (computed once per launcher)."""
    cache = {}

    def get(launcher: str):
        if launcher not in cache:
            cache[launcher] = finetune(
                tmp_path_factory.mktemp(launcher) / "straight", *run_args(assets), launcher=launcher
            )
        return cache[launcher]

    return get


def seeded_step(what: str) -> int:
    """A random step between 6 and 14, seeded; pytest shows the line when the test fails (FINETUNE_TEST_SEED
    replays it)."""
    seed = int(os.environ.get("FINETUNE_TEST_SEED", random.randrange(2**31)))
    step = random.Random(seed).randint(6, 14)
    print(f"FINETUNE_TEST_SEED={seed}: {what} after step {step}")
    return step


LAUNCHED: list[subprocess.Popen] = []  # launches of the running test (killed, with their ranks, when it ends)


@pytest.fixture(autouse=True)
def no_launch_outlives_its_test():
    yield
    while LAUNCHED:
        kill_job(LAUNCHED.pop())


@dataclass
class Launch:
    """A run under `accelerate launch`, its output read by a thread (a reader that never blocks the test)."""

    proc: subprocess.Popen
    lines: list[str]
    reader: threading.Thread
    reached: threading.Event  # the output reported the step `start` was given

    @classmethod
    def start(cls, cmd: list[str], step: int, cwd=ROOT, env: dict | None = None) -> Launch:
        """cmd (anything that runs finetune) in a session of its own, killed with its processes when the test ends."""
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            start_new_session=True,
        )
        LAUNCHED.append(proc)
        lines: list[str] = []
        reached = threading.Event()

        def read() -> None:
            for line in proc.stdout:
                lines.append(line)
                if f"step {step}/" in line:
                    reached.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        return cls(proc, lines, reader, reached)

    def wait_for_step(self, limit_s: float) -> Launch:
        """Until the output reports the step; fails with the output so far if the run exits first or takes longer
        than limit_s."""
        deadline = time.monotonic() + limit_s
        while not self.reached.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.reader.join(timeout=5)
                how = (
                    f"exited with {self.proc.returncode}" if self.proc.poll() is not None else f"took over {limit_s} s"
                )
                raise AssertionError(f"the run {how} before the step it waited for:\n{''.join(self.lines)[-4000:]}")
        return self

    def finish(self, timeout: float) -> str:
        """Its whole output, once the launcher has exited (TimeoutExpired after timeout seconds)."""
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)  # ranks that outlive the launcher keep the pipe open: take what came
        return "".join(self.lines)


def launch_until(
    out, assets, launcher: str, step: int, limit_s: float = 240, launch_args: tuple = (), more: tuple = ()
) -> Launch:
    """Start the run under `accelerate launch` (launch_args before the program, more after run_args) and read its
    output until it reports `step`."""
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "accelerate_configs" / f"{launcher}.yaml"), "--main_process_port", "0",
        *launch_args, "-m", "finetune", "--output_dir", str(out), "--disable_tqdm", "true", *run_args(assets), *more,
    ]  # fmt: skip
    return Launch.start(cmd, step).wait_for_step(limit_s)


def assert_resume_finishes(out, launcher: str, straight_run, assets) -> None:
    resumed = finetune(out, *run_args(assets), "--resume_from_checkpoint", "auto", launcher=launcher)
    assert_resume_equal(out, resumed, launcher, straight_run)


def assert_resume_equal(out, resumed, launcher: str, straight_run) -> None:
    """The resumed run logged every step and ends where the uninterrupted run does: weights (bit-equal under DDP,
    1e-6 elsewhere) and per-step losses (1e-6 relative)."""
    assert [r["step"] for r in resumed.train_rows] == list(range(1, STEPS + 1))
    worst = max_weight_diff(straight_run.output_dir / "final", out / "final")
    assert worst == 0.0 if launcher == "ddp" else worst <= 1e-6, worst
    la, lb = straight_run.losses(), resumed.losses()
    assert len(la) == len(lb) == STEPS
    assert max_rel_diff(la, lb) <= 1e-6


def kill_rank_1(proc: subprocess.Popen) -> None:
    victims = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if p.environ().get("RANK") == "1" and "finetune" in " ".join(p.cmdline())
    ]
    assert len(victims) == 1, [p.cmdline() for p in victims]
    victims[0].kill()


def test_killed_rank_stops_everyone_and_names_where_to_resume(assets, tmp_path):
    """Rank 1 killed mid-training: the survivors stop within seconds, each says what happened and where to resume.
    (A resume after a rank killed: the storage faults' under every layout, and --max_restarts', below.)"""
    launcher = "ddp"
    out = tmp_path / "crashed"
    run = launch_until(out, assets, launcher, seeded_step("rank 1 killed"))
    kill_rank_1(run.proc)
    killed = time.monotonic()
    output = run.finish(timeout=90)
    elapsed = time.monotonic() - killed
    assert run.proc.returncode != 0
    assert elapsed < 60, f"survivors took {elapsed:.0f} s to exit"
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert "finetune rank 0:" in output and "Last complete checkpoint" in output, output[-3000:]
    assert "rank 1 exit code -9" in output and "Traceback" not in output, output[-3000:]  # named by the launcher
    named = re.search(r"torchrun's own log lines: (\S+)\)", output)  # and the file it names is there to read
    assert named and "failed (exitcode: -9)" in Path(named[1]).read_text(), output[-3000:]
    assert f"Last complete checkpoint: {out / 'checkpoints' / 'step_'}" in output, output[-3000:]


# The restart is torchrun's, its rendezvous ours (base.restart_init_method): one layout; each layout's checkpoint and
# resume are the storage faults'.
@pytest.mark.parametrize("launcher", ["zero3"])
def test_max_restarts_continue_the_run_after_a_killed_rank(assets, tmp_path, launcher, straight):
    """`accelerate launch --max_restarts 1` with --resume_from_checkpoint auto: rank 1 killed mid-run, torchrun
    restarts the ranks, they say so, resume from the newest intact checkpoint, and the launch exits 0 with the
    uninterrupted run's weights and losses. (The restarted ranks connected to the previous attempt's dead
    addresses before base.restart_init_method.)"""
    out = tmp_path / "restarted"
    step = seeded_step("rank 1 killed")
    run = launch_until(
        out, assets, launcher, step, launch_args=("--max_restarts", "1"), more=("--resume_from_checkpoint", "auto")
    )
    kill_rank_1(run.proc)
    output = run.finish(timeout=180)
    assert run.proc.returncode == 0, output[-4000:]
    resumed = re.findall(r"resumed from \S+/step_(\d+) at step (\d+)", output)
    assert len(resumed) == 1 and "restart 1 of at most 1 of this launch" in output, output[-4000:]
    at = int(resumed[0][1])
    assert at in (5, 10) and at <= step, (at, step)
    # torchrun logged the killed rank into the launcher's file; a launch that ended well leaves no such file behind
    assert not (Path(tempfile.gettempdir()) / f"finetune-launcher-{run.proc.pid}.log").exists()
    result = conftest.Result(0, output, out)
    if launcher in conftest.EXPECTED:
        conftest.assert_layout(result.train_rows, launcher)
    assert_resume_equal(out, result, launcher, straight(launcher))


def test_torchrun_still_shares_one_store_across_restarts(monkeypatch):
    """Why base.restart_init_method exists: torchrun's static rendezvous (every shipped one-machine config)
    hands each attempt of a launch the same store, and torch's env:// rendezvous gives the ranks no key space of
    their attempt: what attempt 0 wrote (gloo's rank addresses) is there for attempt 1. Fails once torch separates
    attempts (in either place), and the workaround can go. The workaround's stores do separate them."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
    from torch.distributed.rendezvous import rendezvous

    from finetune.parallel.base import restart_init_method

    port = conftest.free_port()
    agent = create_rdzv_handler(RendezvousParameters("static", f"127.0.0.1:{port}", "run", 1, 1, rank=0, timeout=30))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(k, v)

    def worker_store(url: str, attempt: int):
        info = agent.next_rendezvous()  # what the agent does before it starts each attempt's ranks
        monkeypatch.setenv("MASTER_ADDR", info.bootstrap_store_info.master_addr)
        monkeypatch.setenv("MASTER_PORT", str(info.bootstrap_store_info.master_port))
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        return next(rendezvous(url))[0]

    worker_store("env://", 0).set("gloo/rank_0", "attempt 0's address")
    assert worker_store("env://", 1).check(["gloo/rank_0"]), "torch separates attempts: drop restart_init_method"
    ours = restart_init_method()
    assert ours and ours != "env://"
    worker_store(ours, 0).set("gloo/rank_0", "attempt 0's address")
    assert not worker_store(ours, 1).check(["gloo/rank_0"])
    assert worker_store(ours, 0).check(["gloo/rank_0"])


def test_ranks_that_never_join_are_named_and_a_refusal_reaches_the_waiting_ranks(monkeypatch, capsys):
    """base.await_join, in the rendezvous every rank passes before the process group: a rank that never comes is
    named after the timeout (exit 1, one line); a rank that refused its run config before joining tells the
    waiting ones, which stop at once with its problems and where it was (exit 2). (tests/test_multinode.py runs the
    refusal on two machines.)"""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from finetune import cli
    from finetune.config import ConfigError
    from finetune.parallel import base

    port = conftest.free_port()
    agent = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3", "RANK": "0", "GROUP_RANK": "0"}
    for k, v in {**env, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    store, rank, world = base._attempt_store()
    start = time.monotonic()
    with pytest.raises(base.NeverJoined) as never:
        base.await_join(store, rank, world, timedelta(seconds=1))
    assert 1 <= time.monotonic() - start < 5
    assert str(never.value).startswith("ranks 1, 2 of 3 never came to start the run within 1 s (ddp_timeout)")
    assert cli._stopping(never.value, "0", None) == 1 and f"finetune: {never.value}" in capsys.readouterr().err

    monkeypatch.setenv("RANK", "2")  # rank 2, on machine 1, refuses its config before joining
    monkeypatch.setenv("GROUP_RANK", "1")
    base.tell_waiting_ranks(ConfigError([("dataset", "no file or directory matches 'x.jsonl'")]))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("GROUP_RANK", "0")
    start = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        base.await_join(store, rank, world, timedelta(seconds=60))
    assert time.monotonic() - start < 5
    where = f"on machine 1 ({socket.gethostname()}), rank 2"
    assert refused.value.problems == [("dataset", f"{where}: no file or directory matches 'x.jsonl'")]
    del agent


def preempt(out, assets, launcher: str, more: tuple = ()) -> str:
    """A scheduler's preemption: SIGTERM to `accelerate launch` at a seeded step (torchrun's agent forwards it to
    its ranks; accelerate's simple launcher, with finetune.launcher_report, to its one child). Every rank finishes
    its step, a checkpoint of the step reached is written, the run says where to resume, no process outlives the
    launcher, and the launcher exits 128 + 15 without a traceback. Returns the run's output."""
    run = launch_until(out, assets, launcher, seeded_step("SIGTERM to the launcher"), more=more)
    proc = run.proc
    started = psutil.Process(proc.pid).children(recursive=True)
    assert any("finetune" in " ".join(p.cmdline()) for p in started), [p.cmdline() for p in started]
    proc.terminate()
    output = run.finish(timeout=90)
    alive = [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes outlived the launcher: {alive}"
    assert proc.returncode != 0, output[-3000:]
    match = re.search(r"stopped by SIGTERM \(preemption\) after step (\d+); checkpoint saved: (\S+)\.", output)
    assert match, output[-3000:]
    step = int(match.group(1))
    assert 6 <= step < STEPS and match.group(2).endswith(f"step_{step}")
    assert "Traceback" not in output and "[launcher] stopped by SIGTERM" in output, output[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM  # the launcher's code for the signal (launcher_report)
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert not (out / "final").exists()
    return output


def test_sigterm_to_the_one_process_launcher_checkpoints_the_step_reached(assets, tmp_path, straight):
    """preempt under accelerate's simple launcher (single.yaml; under torchrun's agent: every layout's life in
    test_storage_faults_and_a_preemption_in_one_run), and the resume equals the uninterrupted run."""
    out = tmp_path / "preempted"
    preempt(out, assets, "single")
    assert_resume_finishes(out, "single", straight("single"), assets)


def test_a_preemption_on_an_evaluation_step_evaluates_it_on_resume(assets, tmp_path):
    """SIGTERM on a step that evaluates (eval_steps 1): the checkpoint is written before the evaluation (the grace
    period is short) and says the evaluation is pending; the resumed run evaluates that step first, so the metrics
    log has the uninterrupted run's evaluations, every step's, and its losses."""
    more = ("--eval_fraction", "0.1", "--eval_steps", "1")
    uninterrupted = finetune(tmp_path / "straight", *run_args(assets), *more)
    out = tmp_path / "preempted"
    preempt(out, assets, "single", more=more)
    resumed = finetune(out, *run_args(assets), *more, "--resume_from_checkpoint", "auto")
    assert [r["step"] for r in resumed.eval_rows] == list(range(1, STEPS + 1))
    want, got = ([r["eval_loss"] for r in run.eval_rows] for run in (uninterrupted, resumed))
    assert max_rel_diff(want, got) <= 1e-6 and max_rel_diff(uninterrupted.losses(), resumed.losses()) <= 1e-6


def test_a_pending_evaluation_that_stops_the_run_early_logs_the_carried_steps(assets, tmp_path):
    """A checkpoint preempted on an evaluation step between two log rows (step 4: rows every 3 steps) holds one
    unlogged step and a pending evaluation; the resumed run's early stopping ends the run at that evaluation, before
    any step of its own. The row of the carried step has its loss but no throughput (no step was timed): it had
    divided by the resumed run's own step count, 0."""
    args = base_args(assets.llama, assets.instruction, "--max_steps", "6", "--eval_fraction", "0.1")
    args += ["--eval_steps", "2", "--save_steps", "4", "--logging_steps", "3", "--metric_for_best_model", "eval_loss"]
    out = tmp_path / "run"
    finetune(out, *args)
    crash_after(out, 4)
    state_file = out / "checkpoints" / "step_4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["window"] and state["window"]["steps"] == 1, state.get("window")  # step 4, not yet logged
    state_file.write_text(json.dumps({**state, "eval_pending": True}))  # as a preemption on step 4 leaves it:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in rows if not ("eval_loss" in r and r["step"] == 4)]  # ... and step 4 not evaluated
    assert len(kept) == len(rows) - 1
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    stopping = ("--early_stopping_patience", "1", "--early_stopping_threshold", "1e9")  # step 4's eval stops it
    resumed = finetune(out, *args, *stopping, "--resume_from_checkpoint", "latest")
    assert [r["step"] for r in resumed.eval_rows] == [2, 4], resumed.eval_rows
    row = resumed.train_rows[-1]
    assert row["step"] == 4 and row["loss"] > 0 and row["tokens_per_s"] is None and row["mfu"] is None, row
    assert "early stopping" in resumed.output.lower() and (out / "final").is_dir(), resumed.output[-3000:]


def test_a_pending_evaluation_of_another_runs_checkpoint_that_is_the_best_is_kept_in_this_run(assets, tmp_path):
    """A run started from another run's checkpoint preempted on an evaluation step: that evaluation, made first, is
    the best (here the highest eval_loss: the loss falls after it); with load_best_model_at_end the best needs a
    checkpoint of this run's (the one it started from is the other run's), so it is written, and the end exports
    it. Before, the export failed after training."""
    args = base_args(assets.llama, assets.instruction, "--max_steps", "6", "--eval_fraction", "0.1")
    args += ["--eval_steps", "2", "--save_steps", "4", "--metric_for_best_model", "eval_loss"]
    args += ["--greater_is_better", "true", "--load_best_model_at_end", "true", "--learning_rate", "1e-3"]
    other = tmp_path / "other"
    finetune(other, *args)
    state_file = other / "checkpoints" / "step_4" / "trainer_state.json"
    state = json.loads(state_file.read_text())  # preempted before step 4's evaluation, with a best below it:
    state_file.write_text(json.dumps({**state, "eval_pending": True, "best_step": 2, "best_metric": 0.0}))
    out = tmp_path / "run"
    started = finetune(out, *args, "--resume_from_checkpoint", str(state_file.parent))
    losses = {r["step"]: r["eval_loss"] for r in started.eval_rows}
    assert list(losses) == [4, 6] and losses[6] < losses[4], losses
    assert (out / "checkpoints" / "step_4").is_dir() and (out / "final").is_dir()
    assert max_weight_diff(out / "final", out / "checkpoints" / "step_4") == 0  # the best exported


def test_slurm_preemption_and_requeue_continue_the_run(assets, tmp_path, straight):
    """preemption_signal (SIGUSR1) end to end: scripts/slurm.sbatch on one node (stand-in srun and scontrol; a real
    accelerate launch of multinode_ddp.yaml, 2 ranks, rendezvous on 127.0.0.1): SIGUSR1 to every process of the job
    step but rank 0, as SLURM's `--signal=USR1@300` sends it where only one machine of several is preempted (or
    its signal comes later). The launcher ignores it (the script's trap, which finetune's launcher hook keeps), the
    ranks agree on it (rank 0 says SIGUSR1 too: it had said "stopped by  (preemption)", then crashed) and checkpoint
    the step they reached, and the job exits 128 + 10; the requeued job (the same script again, as `--requeue` reruns
    it) continues from that checkpoint (--resume_from_checkpoint auto) and ends equal to the uninterrupted run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {  # srun: the launch line on this one node (exec: its processes are the job step's)
        "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do case "$1" in --output) shift 2;; *) shift;; esac; done\n'
        'SLURM_NODEID=0 exec "$@"\n',
        "scontrol": "#!/bin/bash\necho 127.0.0.1\n",
    }
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run = tmp_path / "run.yaml"
    run.write_text(json.dumps({"model": assets.llama, "dataset": assets.instruction}))
    out = tmp_path / "out"
    script = [
        "bash", str(ROOT / "scripts" / "slurm.sbatch"), str(ROOT / "accelerate_configs" / "multinode_ddp.yaml"),
        str(run), "--output_dir", str(out), "--disable_tqdm", "true", *run_args(assets),
    ]  # fmt: skip
    env = {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",  # the fakes, then this venv's
        "PYTHONPATH": str(ROOT),  # `accelerate` (the venv's, on PATH) imports this checkout
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "node-a",
        "SLURM_JOB_ID": "42",
        "GPUS_PER_NODE": "2",
    }

    def submit(until_step: int) -> Launch:
        for _ in range(3):  # another process may take the free port before the launcher binds it: another port
            job = Launch.start(script, until_step, tmp_path, {**env, "MAIN_PORT": str(conftest.free_port())})
            try:
                return job.wait_for_step(240)
            except AssertionError:
                if "address already in use" not in "".join(job.lines).lower():
                    raise
        raise AssertionError("3 ports in a row were taken before the launcher could listen on them")

    job = submit(seeded_step("SIGUSR1 to the job step"))
    step_processes = psutil.Process(job.proc.pid).children(recursive=True)
    ranks = [p for p in step_processes if "RANK" in p.environ() and "finetune" in " ".join(p.cmdline())]
    assert len(ranks) == 2, [p.cmdline() for p in step_processes]
    for p in step_processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.environ().get("RANK") != "0":
                p.send_signal(signal.SIGUSR1)
    output = job.finish(timeout=90)
    match = re.search(r"stopped by SIGUSR1 \(preemption\) after step (\d+); checkpoint saved: (\S+)\.", output)
    assert match, output[-3000:]
    step = int(match.group(1))
    assert "Traceback" not in output and job.proc.returncode == 128 + signal.SIGUSR1, (job.proc.returncode, output)
    # the launcher outlived the signal (the script's trap) and reported its ranks' exit, as the job step's end
    assert "stopped with the message below" in output, output[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}" and not (out / "final").exists()

    requeued = submit(step + 1)
    output = requeued.finish(timeout=240)
    assert requeued.proc.returncode == 0, output[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{step}'}" in output, output[-3000:]
    assert_resume_equal(out, conftest.Result(0, output, out), "ddp", straight("ddp"))


def test_kill_while_writing_a_checkpoint_keeps_the_previous_one_and_auto_resumes(assets, tmp_path):
    """`--resume_from_checkpoint auto`, as a restarting launcher uses it: a process killed while writing its
    first checkpoint leaves none, so the next start is fresh; one killed while writing step 4 leaves step 2
    complete and named by `latest` (the half-written one stays hidden); the next start resumes from it and
    removes the half-written one (also where it would not reach that step again: the storage faults' preemption)."""
    args = base_args(assets.gpt2, assets.text, "--max_steps", "6", "--save_steps", "2", "--eval_fraction", "0")
    args += ["--resume_from_checkpoint", "auto"]
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    died = finetune(out, *args, launcher="python", expect_ok=False, extra_env={"FINETUNE_FAULT": "in-checkpoint:2"})
    assert died.returncode == -9 and (out / "metrics.jsonl").exists() and not (ckpts / "latest").exists()
    fresh = finetune(out, *args, launcher="python", expect_ok=False, extra_env={"FINETUNE_FAULT": "in-checkpoint:4"})
    assert fresh.returncode == -9 and "resumed from" not in fresh.output
    assert (ckpts / "latest").read_text().strip() == "step_2"
    assert (ckpts / ".tmp_step_4").exists() and not (ckpts / "step_4").exists()
    resumed = finetune(out, *args)
    assert "resumed from" in resumed.output and "step_2" in resumed.output
    assert f"removed {ckpts / '.tmp_step_4'}: a checkpoint the stopped run did not finish" in resumed.output
    assert [r["step"] for r in resumed.train_rows] == [1, 2, 3, 4, 5, 6]
    assert not (ckpts / ".tmp_step_4").exists() and (out / "final" / "model.safetensors").exists()


def test_a_run_stopped_while_removing_the_checkpoint_it_wrote_again_keeps_the_new_one(tmp_path, monkeypatch):
    """A resumed run writes the step it resumed from again (and every run its final/): the old directory is renamed
    aside before the new one takes its place, and removed last. Before, it was removed first: a run stopped during
    that removal (minutes, for hundreds of GB) had neither. The next start (a resume, or --overwrite_output_dir)
    removes what is left aside; final.replaced<pid> stayed for good before (only checkpoints/ was looked at)."""
    from finetune import checkpoint
    from finetune.run import _clear_previous_run

    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    left = [stopped_while_replacing(ckpts / "step_4", monkeypatch), stopped_while_replacing(run / "final", monkeypatch)]
    assert [p.name.split(".replaced")[0] for p in left] == ["step_4", "final"], left
    lone = ckpts / "step_9.replaced1"  # a stop between the two renames: the only copy of step_9, kept
    lone.mkdir()
    (run / "other.replaced1").mkdir()  # not a directory replace_directory writes: not finetune's to remove
    assert checkpoint.remove_half_written(str(run)) == [str(p) for p in left]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_4", "step_9.replaced1"]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "final", "other.replaced1"]

    again = tmp_path / "again"  # --overwrite_output_dir removes it with the final/ it was left beside
    stopped_while_replacing(again / "final", monkeypatch)
    (tmp_path / "lone" / "final.replaced1").mkdir(parents=True)  # the only copy of final/, kept
    for output_dir in (again, tmp_path / "lone"):
        _clear_previous_run(str(output_dir))
    assert list(again.iterdir()) == [] and (tmp_path / "lone" / "final.replaced1").is_dir()


def stopped_while_replacing(old: Path, monkeypatch) -> Path:
    """replace_directory(new, old) stopped while it removes the old copy: the new one is in place; what is left."""
    from finetune import checkpoint

    new = old.parent / f".tmp_{old.name}"
    for path, text in ((old, "old"), (new, "new")):
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(text)

    def stopped(path, ignore_errors=False):
        raise KeyboardInterrupt  # the stop arrives while the old copy is being removed

    monkeypatch.setattr(checkpoint.shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.replace_directory(str(new), str(old))
    monkeypatch.undo()
    assert (old / "trainer_state.json").read_text() == "new" and not new.exists()
    (left,) = old.parent.glob(f"{old.name}.replaced*")
    return left


def test_a_stop_signal_on_the_last_step_or_after_it_loses_nothing(assets, tmp_path):
    """SIGTERM while the last step runs (FINETUNE_FAULT signal-before-step): a preemption as on any other step, with
    its checkpoint (also with save_steps null), exit 143, no final/ yet. The resume (auto) gets SIGTERM while it
    writes final/ (signal-in-export): final/ is finished first, then the run exits 143 saying so. Before, the first
    signal was ignored, and one during the export stopped it half-way: .tmp_final left, no final/, no checkpoint.
    The job requeued after that (auto again) ends at once with exit 0 (it wrote final/ again from step_3's checkpoint;
    with no checkpoint, save_steps null and a signal after the vote, it was refused: exit 2)."""
    args = base_args(assets.gpt2, assets.text, "--max_steps", "3", "--save_steps", "null", "--eval_fraction", "0")
    args += ["--resume_from_checkpoint", "auto"]
    out = tmp_path / "run"
    last = finetune(out, *args, expect_ok=False, extra_env={"FINETUNE_FAULT": "signal-before-step:3"})
    assert last.returncode == 143 and "Traceback" not in last.output, last.output[-3000:]
    assert f"stopped by SIGTERM (preemption) after step 3; checkpoint saved: {out / 'checkpoints' / 'step_3'}." in (
        last.output
    ), last.output[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_3" and not (out / "final").exists()
    ended = finetune(out, *args, expect_ok=False, extra_env={"FINETUNE_FAULT": "signal-in-export:0"})
    assert ended.returncode == 143 and "Traceback" not in ended.output, ended.output[-3000:]
    assert f"after the last step (3), once the run had finished: {out / 'final'} is complete." in ended.output
    assert (out / "final" / "model.safetensors").exists() and not (out / ".tmp_final").exists()
    # the scheduler requeues the preempted job, the same command: nothing left to run, exit 0, nothing written again
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    requeued = finetune(out, *args, expect_ok=False)  # (expect_ok also asks for the log of a run that started)
    assert requeued.returncode == 0 and "Traceback" not in requeued.output, requeued.output[-3000:]
    assert f"the run in {out} finished already ({out / 'final'} complete, step 3)" in requeued.output, requeued.output
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_a_complete_checkpoint_that_latest_does_not_name_is_resumed(assets, tmp_path):
    """A full disk while naming the first checkpoint (step_2 complete, no `latest`): `auto` resumes from step_2 and
    says why, instead of taking the directory for a fresh start and removing the checkpoint; `latest`, which the
    write error tells the user to pass, does the same."""
    args = base_args(assets.gpt2, assets.text, "--max_steps", "4", "--save_steps", "2", "--eval_fraction", "0")
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    full = finetune(
        out, *args, "--resume_from_checkpoint", "auto", expect_ok=False,
        extra_env={"FINETUNE_FAULT": "enospc-naming-checkpoint:2"},
    )  # fmt: skip
    assert full.returncode == 1 and "--resume_from_checkpoint latest" in full.output, full.output[-3000:]
    assert (ckpts / "step_2" / "trainer_state.json").exists() and not (ckpts / "latest").exists()
    shutil.copytree(out, tmp_path / "copy")
    for spec, where in (("auto", out), ("latest", tmp_path / "copy")):
        resumed = finetune(where, *args, "--resume_from_checkpoint", spec)
        assert f"resumed from {where / 'checkpoints' / 'step_2'}" in resumed.output, resumed.output[-3000:]
        assert "checkpoints/latest is missing" in resumed.output
        assert [r["step"] for r in resumed.train_rows] == [1, 2, 3, 4]


def test_a_stuck_rank_is_named_and_every_live_rank_leaves_its_stack(assets, tmp_path):
    """Rank 1 stops answering before step 3 (FINETUNE_FAULT=hang-...): rank 0's collective times out after
    ddp_timeout, the message names rank 1, and both ranks' Python stacks are in output_dir/logs/ (rank 1's
    shows where it is stuck)."""
    args = base_args(assets.llama, assets.instruction, "--max_steps", "6", "--eval_fraction", "0")
    res = finetune(
        tmp_path / "run",
        *args,
        "--ddp_timeout",
        "8",
        launcher="ddp",
        expect_ok=False,
        timeout=120,
        extra_env={"FINETUNE_FAULT": "hang-before-step:3:1"},
    )
    assert res.returncode != 0
    assert "finetune rank 0: a collective failed" in res.output, res.output[-3000:]
    assert "Rank(s) 1 did not answer" in res.output, res.output[-3000:]
    logs = tmp_path / "run" / "logs"
    stuck = (logs / "stacks_rank1.txt").read_text()
    waiting = (logs / "stacks_rank0.txt").read_text()
    assert "fault_point" in stuck and "train" in stuck, stuck
    assert "train_step" in waiting, waiting


def test_the_writer_alone_slow_then_failing_to_name_a_checkpoint(assets, tmp_path):
    """Rank 0 alone checksums step 2 for 3 x ddp_timeout (FINETUNE_FAULT slow-checksum: what hundreds of GB take):
    rank 1 waits on the host group (host_wait_timeout), not in a collective that gives up after ddp_timeout. Then
    rank 0 alone fails to name step 4 `latest` (a full disk): every rank stops with the one message (exit 1, no
    traceback), `latest` still names step 2. The start log shows the waits torch holds."""
    args = base_args(assets.llama, assets.instruction, "--max_steps", "4", "--save_steps", "2", "--eval_fraction", "0")
    res = finetune(
        tmp_path / "run",
        *args,
        "--ddp_timeout",
        "8",
        launcher="ddp",
        timeout=180,
        expect_ok=False,
        extra_env={"FINETUNE_FAULT": "slow-checksum:2:0:24,enospc-naming-checkpoint:4:0"},
    )
    assert "collectives wait 8 s for a rank (ddp_timeout)" in res.output, res.output[-3000:]
    assert "the host waits for one process's work 14400 s" in res.output, res.output[-3000:]
    assert [r["step"] for r in res.train_rows] == [1, 2, 3, 4]
    assert res.returncode == 1 and "Traceback" not in res.output, res.output[-3000:]
    assert "a collective failed" not in res.output, res.output[-3000:]
    assert "could not write checkpoint step_4 (rank 0: " in res.output and "No space left" in res.output
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_2"
    assert (ckpts / "step_2" / "manifest.json").exists() and not (tmp_path / "run" / "final").exists()


def test_a_write_error_before_a_sharded_save_stops_every_rank_at_once(assets, tmp_path):
    """FSDP2's save_state and the portable copy's gathers are collectives: the writer's error making the
    checkpoint's folder (FINETUNE_FAULT enospc-making-checkpoint) keeps every rank out of them, and all stop with
    the one message; rank 1 entering them alone would wait out ddp_timeout (600 s) instead."""
    args = base_args(assets.llama, assets.instruction, "--max_steps", "2", "--save_steps", "2", "--eval_fraction", "0")
    res = finetune(
        tmp_path / "run",
        *args,
        launcher="fsdp2",
        timeout=120,
        expect_ok=False,
        extra_env={"FINETUNE_FAULT": "enospc-making-checkpoint:2:0"},
    )
    assert res.returncode == 1 and "Traceback" not in res.output, res.output[-3000:]
    assert "could not write checkpoint step_2 (rank 0: " in res.output, res.output[-3000:]
    assert "a collective failed" not in res.output, res.output[-3000:]
    assert not (tmp_path / "run" / "checkpoints" / ".tmp_step_2").exists()


def test_accelerate_still_drops_a_timeout_equal_to_its_default():
    """The reason for finetune.parallel.base.start_process_group starting the process group itself:
    accelerate's InitProcessGroupKwargs passes on only values that differ from its class defaults (nccl's 600 s),
    so gloo with 600 s (finetune's CPU default) reached torch without a timeout (torch's 1800 s). When this fails,
    accelerate passes it: InitProcessGroupKwargs can serve again."""
    import datetime

    from accelerate.utils import InitProcessGroupKwargs

    passed = InitProcessGroupKwargs(backend="gloo", timeout=datetime.timedelta(seconds=600)).to_kwargs()
    assert passed == {"backend": "gloo"}, passed


def test_full_disk_while_saving_then_a_damaged_checkpoint(assets, tmp_path):
    """A write error while saving step 4 (what a full disk raises): one message, exit 1, the half-written
    checkpoint removed, `latest` still step 2, which resumes to the end, where writing final/ fails: one message
    naming step 6 to continue from. Then step 6 gets damaged on disk: `latest` skips it (and says so) for step 4;
    naming it explicitly is refused with exit 2."""
    args = base_args(assets.gpt2, assets.text, "--max_steps", "6", "--save_steps", "2", "--eval_fraction", "0")
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    full = finetune(
        out, *args, launcher="python", expect_ok=False, extra_env={"FINETUNE_FAULT": "enospc-in-checkpoint:4"}
    )
    assert full.returncode == 1 and "Traceback" not in full.output, full.output[-3000:]
    assert full.output.count("finetune: could not write checkpoint step_4") == 1
    assert "No space left on device" in full.output and "save_total_limit" in full.output
    assert (ckpts / "latest").read_text().strip() == "step_2"
    assert not (ckpts / ".tmp_step_4").exists() and not (out / "final").exists()
    # the size it names is step_2's, in a unit that shows it (a small checkpoint is not "0.00 GB")
    said = re.search(r"takes about ([\d.]+) (GB|MB|KB|bytes); ", full.output)
    size = sum(f.stat().st_size for f in (ckpts / "step_2").rglob("*") if f.is_file())
    assert said and 1 <= float(said.group(1)) < 1000, full.output[-2000:]
    scale = {"GB": 1e9, "MB": 1e6, "KB": 1e3, "bytes": 1}[said.group(2)]
    assert abs(float(said.group(1)) * scale / size - 1) < 0.01
    # the resume trains to the end, checkpoints step 6, and the disk fills while final/ is written
    ended = finetune(
        out,
        *args,
        "--resume_from_checkpoint",
        "latest",
        launcher="python",
        expect_ok=False,
        extra_env={"FINETUNE_FAULT": "enospc-in-export:0"},
    )
    assert ended.returncode == 1 and "Traceback" not in ended.output, ended.output[-3000:]
    assert f"finetune: could not write {out / 'final'} (" in ended.output and "No space left" in ended.output
    assert f"Last complete checkpoint: {ckpts / 'step_6'}" in ended.output
    assert not (out / "final").exists() and not (out / ".tmp_final").exists()
    assert json.loads((ckpts / "step_6" / "manifest.json").read_text())["model.safetensors"][0] > 0
    weights = ckpts / "step_6" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, wrong checksum
    weights.write_bytes(bytes(data))
    named = finetune(out, *args, "--resume_from_checkpoint", str(ckpts / "step_6"), launcher="python", expect_ok=False)
    assert named.returncode == 2 and "Traceback" not in named.output
    assert "resume_from_checkpoint:" in named.output and "is damaged" in named.output
    again = finetune(out, *args, "--resume_from_checkpoint", "latest", launcher="python")
    assert (
        "skipped checkpoint" in again.output and "step_6: model.safetensors does not match its checksum" in again.output
    )
    assert f"resumed from {ckpts / 'step_4'}" in again.output
    assert (out / "final" / "model.safetensors").exists()


# The sharded layouts by default; ddp and tp2 (the same vote, whole tensors) with FINETUNE_FAULT_GRID=1 (suite time)
@pytest.mark.parametrize(
    "launcher", ["zero3", "fsdp2", *(grid_param(n, default=False, grid="FINETUNE_FAULT_GRID") for n in ("ddp", "tp2"))]
)
def test_divergence_stops_at_the_non_finite_step_and_exports_nothing(assets, tmp_path, launcher):
    """Every rank stops at the step whose gradient norm is not finite (each layout computes that norm its own way:
    DDP's local one, as one process does, DeepSpeed's engine, FSDP2's and TP's DTensors), says so once, and exports
    nothing."""
    args = base_args(assets.llama, assets.instruction, "--max_steps", "30", "--eval_fraction", "0")
    res = finetune(tmp_path / "run", *args, "--learning_rate", "1e30", launcher=launcher, expect_ok=False)
    assert res.returncode == 1 and "Traceback" not in res.output, res.output[-3000:]
    match = re.search(r"the gradient norm of step (\d+) is (nan|inf)", res.output)
    assert match and "training diverged" in res.output, res.output[-3000:]
    assert not (tmp_path / "run" / "final").exists()
    logged = [r["step"] for r in res.train_rows] if (tmp_path / "run" / "metrics.jsonl").exists() else []
    assert all(step < int(match.group(1)) for step in logged)


def damage(checkpoint) -> str:
    """Flip one byte in the middle of the checkpoint's largest file (same size, wrong checksum); its name."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest, checkpoint
    name = max(manifest, key=lambda n: manifest[n][0])
    path = checkpoint / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return name


# By default the two sharded checkpoint writers: DeepSpeed's own (zero3) and torch distributed checkpoint (fsdp2).
# The whole-tensor writer, gathered from DTensors (tp2, about 80 s of a 2-core machine) or not (ddp, 50 s), runs with
# FINETUNE_FAULT_GRID=1 (its resume across layouts: test_resume_layouts' tensor-parallel window; suite time).
STORAGE_FAULT_LAYOUTS = [
    "zero3",
    "fsdp2",
    *(grid_param(n, default=False, grid="FINETUNE_FAULT_GRID") for n in ("tp2", "ddp")),
]


@pytest.mark.parametrize("launcher", STORAGE_FAULT_LAYOUTS)
def test_storage_faults_and_a_preemption_in_one_run(assets, tmp_path, launcher, straight):
    """One run's life under 2 ranks of each layout (each saves its own checkpoint format): rank 1's disk fills
    while step 10 is saved (every rank stops, one message naming rank 1, exit 1, the half-written checkpoint
    removed, `latest` still step 5; under ZeRO-3 in the middle of DeepSpeed's save_checkpoint, whose collectives
    after its writes had left rank 0 waiting for ddp_timeout); the resume has rank 1 killed (-9) in the middle of writing step 15 (the
    others stop, `latest` still step 10, the half-written one hidden); step 10 is then damaged on disk, so the
    next resume skips it for step 5, and is preempted (SIGTERM to the launcher: preempt) at a step after it; the
    last resume finishes equal to the uninterrupted run (weights and losses)."""
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    full = finetune(
        out,
        *run_args(assets),
        launcher=launcher,
        expect_ok=False,
        extra_env={
            "FINETUNE_FAULT": "enospc-deepspeed-write:10:1" if launcher == "zero3" else "enospc-in-checkpoint:10:1"
        },
    )
    assert full.returncode == 1 and "Traceback" not in full.output, full.output[-3000:]
    assert "could not write checkpoint step_10 (rank 1: " in full.output, full.output[-3000:]
    assert "rank 0:" not in full.output.split("could not write checkpoint step_10 (", 1)[1].split(")")[0]
    assert (ckpts / "latest").read_text().strip() == "step_5"
    assert not (ckpts / ".tmp_step_10").exists() and not (out / "final").exists()

    killed = finetune(
        out,
        *run_args(assets),
        "--resume_from_checkpoint",
        "latest",
        launcher=launcher,
        expect_ok=False,
        extra_env={"FINETUNE_FAULT": "in-checkpoint:15:1"},
    )
    assert killed.returncode != 0 and "Traceback" not in killed.output, killed.output[-3000:]
    assert "rank 1 exit code -9" in killed.output, killed.output[-3000:]
    assert (ckpts / "latest").read_text().strip() == "step_10"
    assert (ckpts / ".tmp_step_15").exists() and not (ckpts / "step_15").exists()

    damaged = damage(ckpts / "step_10")
    preempted = preempt(out, assets, launcher, more=("--resume_from_checkpoint", "latest"))
    assert f"step_10: {damaged} does not match its checksum" in preempted, preempted[-3000:]
    assert f"resumed from {ckpts / 'step_5'}" in preempted
    assert not (ckpts / ".tmp_step_15").exists()
    assert_resume_finishes(out, launcher, straight(launcher), assets)


def test_resume_with_a_changed_run_config(assets, tmp_path):
    """What a resume cannot change (here the seed: another data order; the prompt template: other rows) is refused,
    naming each key; the rest (learning rate, schedule, logging) is listed and applied from the resumed step."""
    args = base_args(assets.gpt2, assets.text, "--max_steps", "4", "--save_steps", "2", "--eval_fraction", "0")
    out = tmp_path / "run"
    finetune(out, *args, launcher="python")
    crash_after(out, 2)
    refused = finetune(
        out, *args, "--resume_from_checkpoint", "latest", "--seed", "7", "--prompt_template", "Q: {prompt}",
        launcher="python", expect_ok=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.output
    assert "seed: is 7 but" in refused.output and "was trained with 42" in refused.output
    assert "prompt_template: is 'Q: {prompt}' but" in refused.output, refused.output[-2000:]
    changed = ("--learning_rate", "3e-3", "--lr_scheduler_type", "constant")
    resumed = finetune(out, *args, "--resume_from_checkpoint", "latest", *changed, launcher="python")
    assert "resume: learning_rate changed from 0.001 to 0.003 (applied)" in resumed.output, resumed.output[-2000:]
    assert "resume: lr_scheduler_type changed from 'linear' to 'constant' (applied)" in resumed.output
    rates = {r["step"]: r["learning_rate"] for r in resumed.train_rows}
    assert rates[3] == pytest.approx(3e-3) and rates[4] == pytest.approx(3e-3)


def test_a_resume_refuses_every_field_that_shapes_the_rows(tmp_path):
    """The saved data position counts rows: a data field that shapes them (config.ROW_FIELDS, those prepared data
    checks too; prompt_template was applied and moved the position onto other rows), the chat template or the method
    changed on resume is refused, naming the key; a field that only batches or locates the rows is applied."""
    import yaml

    from finetune.checkpoint import CONFIG_FILE, config_changes
    from finetune.config import NOT_IN_ROWS, ROW_FIELDS, ConfigError, RunConfig

    saved = RunConfig().to_flat()
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(saved))
    for key in (*ROW_FIELDS, "chat_template", "method"):
        changed = {"bot": "assistant"} if key == "role_map" else "changed"
        with pytest.raises(ConfigError) as info:
            config_changes(str(tmp_path), {**saved, key: changed})
        assert [k for k, _ in info.value.problems] == [key]
        assert "a resume continues the same run" in info.value.problems[0][1]
    for key in NOT_IN_ROWS:
        assert [k for k, *_ in config_changes(str(tmp_path), {**saved, key: 3})] == [key]


def test_a_dead_model_is_reported(assets, tmp_path):
    """A learning rate far too high but finite kills the model (gradient norm exactly 0, loss constant): the
    run says nothing is learning."""
    args = base_args(assets.llama, assets.instruction, "--max_steps", "6", "--eval_fraction", "0")
    res = finetune(tmp_path / "run", *args, "--learning_rate", "1e6", launcher="python")
    norms = [r["grad_norm"] for r in res.train_rows]
    assert norms[-3:] == [0.0, 0.0, 0.0], norms
    assert res.output.count("the gradient norm has been exactly 0 for 3 steps in a row") == 1, res.output[-2000:]


def test_a_full_disk_under_safetensors_is_a_write_error():
    """safetensors' writer reports a full disk as its own SafetensorError, not an OSError: the checkpointer must
    still see a write error (one message, `latest` kept), not crash with a traceback (seen on a 369M-parameter
    ZeRO-3 run that filled the disk)."""
    from safetensors import SafetensorError

    from finetune import checkpoint

    def full(*_):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    error = checkpoint.attempt_write(full)
    assert isinstance(error, OSError) and error.errno == 28 and "No space left" in error.strerror

    def bug(*_):
        raise SafetensorError("Error while serializing: a tensor is not contiguous")

    with pytest.raises(SafetensorError):  # not a write error: surfaces as itself
        checkpoint.attempt_write(bug)


@pytest.mark.skipif(not Path("/dev/full").is_char_device(), reason="needs /dev/full (every write: ENOSPC)")
def test_a_full_disk_under_torch_save_is_a_write_error():
    """torch.save's zip writer reports a full disk as a RuntimeError without the errno ("unexpected pos ..."): the
    checkpointer must see a write error, not crash (a DDP or TP checkpoint's optimizer.bin on a full disk did, rank 0
    with a traceback and the other ranks blaming it for not answering). /dev/full fails every write with ENOSPC."""
    import torch

    from finetune import checkpoint

    with pytest.raises(RuntimeError) as raised:  # what torch does, unrecognised
        torch.save({"w": torch.zeros(100_000)}, "/dev/full")
    assert not isinstance(raised.value, OSError)
    error = checkpoint.attempt_write(torch.save, {"w": torch.zeros(100_000)}, "/dev/full")
    assert isinstance(error, OSError) and "torch.save could not write" in str(error), error
    with pytest.raises(RuntimeError):  # another RuntimeError is not taken for a write error
        checkpoint.attempt_write(torch.save, {"w": torch.zeros(1)}, "/dev/full/not-a-directory/x.pt")
    with pytest.raises(RuntimeError):  # where a collective follows the write (Megatron-LM's save): the rank ends
        checkpoint.attempt_write(torch.save, {"w": torch.zeros(100_000)}, "/dev/full", torch_save_errors=False)
    try:  # nor one raised from an OSError: parallel/tensor.py ends a rank whose export others wait for so
        raise RuntimeError("writing final/ failed inside transformers' save_pretrained") from OSError(28, "full")
    except RuntimeError as e:
        assert checkpoint.as_os_error(e) is None


def test_a_write_error_under_a_distributed_checkpoint_writer_names_the_rank_that_failed():
    """FSDP's checkpoints go through torch distributed checkpoint and Megatron-LM's through its own on top of it; both
    raise one CheckpointException (a BaseException, not an Exception) on every rank for any rank's failed write:
    torch's holding every failed rank's error on every rank, Megatron's on its coordinator only (wrapped in "Worker
    failure" RuntimeErrors raised from the OSError). The rank whose write failed reports its own error; a rank
    told of another's reports that rank's; a rank told nothing says so; anything but a write error stays a crash.
    The message names the failed rank (a rank 1 whose disk was full had ended both ranks with tracebacks)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from finetune import checkpoint

    error = checkpoint.attempt_write(dcp.save, {"w": torch.zeros(10)}, checkpoint_id="/dev/null/step_1")  # real
    assert isinstance(error, OSError) and error.errno == errno.ENOTDIR, error

    def failing(failures: dict):
        def save():
            wrapped = {}
            for rank, exc in failures.items():
                try:
                    raise exc
                except BaseException as e:
                    wrapped[rank] = _wrap_exception(e)
            raise CheckpointException("write", wrapped)

        return save

    full = OSError(errno.ENOSPC, "No space left on device")
    worker = RuntimeError("Worker failure: [Errno 28] No space left on device")  # (gathered: its cause is lost)
    mine = checkpoint.attempt_write(failing({0: full}))  # (this process is rank 0)
    told = checkpoint.attempt_write(failing({1: worker}))
    untold = checkpoint.attempt_write(failing({}))
    assert mine is full and isinstance(told, checkpoint.WriteFailedElsewhere) and told.rank == 1, (mine, told)
    assert isinstance(untold, checkpoint.WriteFailedElsewhere) and untold.rank is None, untold
    with pytest.raises(CheckpointException):
        checkpoint.attempt_write(failing({0: ValueError("a bug, not the disk")}))

    def reports(*errors):
        return [checkpoint.report(rank, e) for rank, e in enumerate(errors)]

    assert checkpoint.which_failed(reports(None, None)) == ""
    assert checkpoint.which_failed(reports(told, full)) == "rank 1: [Errno 28] No space left on device"  # torch's
    assert checkpoint.which_failed(reports(told, untold)) == "rank 1: [Errno 28] No space left on device"  # Megatron's
    assert checkpoint.which_failed(reports(untold, untold)).startswith("a checkpoint write failed on another rank")


def run_cli_script(script, setup: str) -> tuple[subprocess.CompletedProcess, str]:
    """A process that runs `setup` (patching finetune.cli to stage a race), then finetune's run_cli as a rank
    would; its result and a summary for assertion messages."""
    script.write_text(setup + "sys.exit(cli.run_cli(['--config', 'unused.yaml']))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    return proc, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"


def test_stop_signal_while_the_handler_is_installed(tmp_path):
    """The launcher's SIGTERM landing just as a rank installs its stop handler (seen once: rank 0 exited with a
    config error and the launcher stopped rank 1 inside signal.signal): one line and exit 143, no traceback."""
    proc, shown = run_cli_script(
        tmp_path / "stop_at_install.py",
        "import os, signal, sys\n"
        "import finetune.cli as cli\n"
        "real = signal.signal\n"
        "def install_then_signal(signum, handler):\n"
        "    previous = real(signum, handler)\n"
        "    os.kill(os.getpid(), signum)  # the handler runs here, before signal.signal returns\n"
        "    return previous\n"
        "signal.signal = install_then_signal\n",
    )
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, shown
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("finetune rank 0: stopped by SIGTERM before training started")
    ), shown


def test_a_forked_worker_stopped_with_its_parent_exits_quietly(tmp_path):
    """torchrun's killpg reaches datasets' tokenising workers too (preprocessing_num_workers: forked, so they inherit
    the stop handler), and each raised Stopped and printed its traceback. A process that did not install the handler
    exits at once with 128 + N and says nothing: its parent says what happened."""
    script = tmp_path / "forked.py"
    script.write_text(
        "import os, signal, time\n"
        "from finetune.stop import STOP\n"
        "STOP.install()\n"
        "ready, started = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:  # a pool worker\n"
        "    os.write(started, b'1')\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "os.read(ready, 1)  # a signal before the child's Python is set up would be dropped\n"
        "os.kill(pid, signal.SIGTERM)\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert (proc.stdout.strip(), proc.stderr) == ("143", ""), proc


def test_stop_signal_while_a_rank_reports_its_own_error(tmp_path):
    """Both ranks of a bad-input run fail their checks; the first to exit makes the launcher SIGTERM the other while
    it prints its message and writes torchrun's error file (seen in the suite: a traceback, and once an empty error
    file that crashed the launcher's json.load). The signal is only noted: exit 2, the message, a whole file."""
    error_file = tmp_path / "error.json"
    proc, shown = run_cli_script(
        tmp_path / "stop_while_reporting.py",
        "import json, os, signal, sys\n"
        "import finetune.cli as cli\n"
        "from finetune.config import ConfigError\n"
        "def parse(argv):\n"
        "    raise ConfigError([('model', 'not found')])\n"
        "real = cli.write_error_file\n"
        "def signal_then_write(message):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM, as this rank reports\n"
        "    real(message)\n"
        "cli.parse, cli.write_error_file = parse, signal_then_write\n"
        f"os.environ['TORCHELASTIC_ERROR_FILE'] = {str(error_file)!r}\n",
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, shown
    assert proc.stderr.strip().splitlines()[-1] == "  - model: not found", shown
    assert json.loads(error_file.read_text())["message"]["message"].endswith("model: not found"), shown
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("error.json")] == ["error.json"]


def test_a_ranks_message_reaches_stderr_in_one_write(monkeypatch):
    """print() writes a text and its newline apart; the launcher's log line (it stops the other ranks as soon as
    one exits) was seen between them, in the middle of a rank's message. One write, the newline included."""
    from finetune import cli
    from finetune.config import ConfigError

    writes = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "stderr", Recorder())
    message = ConfigError([("model", "not found"), ("dataset", "empty")]).render()
    cli._stop_with(message)
    assert writes == [message + "\n"]


def test_stop_signal_wrapped_by_python_and_taken_for_bad_input_still_stops(tmp_path):
    """The launcher's SIGTERM landing while a module imports, in a class body's __set_name__ (seen: rank 1 of a
    refused launch importing scipy inside datasets.load_dataset): Python 3.11 wraps Stopped in a RuntimeError
    ("Error calling __set_name__"), an `except Exception` around the data loading took that for a damaged file,
    and the rank reported "could not read ... as json". The rank must stop with its one line and exit 143."""
    proc, shown = run_cli_script(
        tmp_path / "stop_in_set_name.py",
        "import os, signal, sys, time\n"
        "import finetune.cli as cli\n"
        "from finetune.config import ConfigError\n"
        "class Landing:\n"
        "    def __set_name__(self, owner, name):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        for _ in range(100): time.sleep(0.001)  # the handler runs here, inside __set_name__\n"
        "def parse(argv):\n"
        "    try:\n"
        "        type('Imported', (), {'field': Landing()})\n"
        "    except Exception as e:  # as finetune.data._load reads a file\n"
        "        raise ConfigError([('dataset', f'could not read it as json: {e}')]) from None\n"
        "    raise SystemExit(0)\n"
        "cli.parse = parse\n",
    )
    assert proc.returncode == 143, shown
    assert "could not read" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr, shown
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("finetune rank 0: stopped by SIGTERM before training started")
    ), shown


def test_stop_signal_inside_a_callback_still_stops(tmp_path):
    """The launcher's SIGTERM landing while the main thread runs a weakref callback (seen once in the import
    system's module-lock callback): Stopped cannot be raised out of it, and Python would only print "Exception
    ignored ... Traceback" and go on. The rank must stop there with its one line and exit 143."""
    proc, shown = run_cli_script(
        tmp_path / "stop_in_callback.py",
        "import os, signal, sys, time, weakref\n"
        "import finetune.cli as cli\n"
        "def parse(argv):\n"
        "    class Thing: pass\n"
        "    def callback(_):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        for _ in range(100): time.sleep(0.001)  # the handler runs here, inside the callback\n"
        "    thing = Thing(); ref = weakref.ref(thing, callback); del thing\n"
        "    print('went on after the stop signal', flush=True)\n"
        "    raise SystemExit(0)\n"
        "cli.parse = parse\n",
    )
    assert proc.returncode == 143, shown
    assert "went on" not in proc.stdout and "Traceback" not in proc.stderr, shown
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("finetune rank 0: stopped by SIGTERM before training started")
    ), shown
