"""Several machines, on loopback: two launches of the same command with `--num_machines 2`, `--machine_rank 0`
and `1`, main address 127.0.0.1 and one process each, as two machines run it. Only 127.0.0.1 is ever used.

The one-machine two-process run of the same config is the reference: the two "machines" must reproduce its
per-step losses (1e-6 relative), with one shared output_dir and with one output_dir per machine (a node-local
disk), and resume in both. multinode_fsdp2 with a shared output_dir trains DPO (issue 32: preference tuning on
two machines)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import conftest
import pytest
import torch
import yaml
from conftest import ROOT, Result, assert_layout, base_args, crash_after, finetune, max_rel_diff, max_weight_diff

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multinode")]  # one worker: references run once
SHIPPED = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def launch(outs: tuple[Path, Path], config: str, *args: str, timeout: int = 300) -> list[Result]:
    """The finetune run on machine 0 and machine 1 of `accelerate_configs/<config>.yaml`, one process each."""
    ran = conftest.two_machines(
        config, lambda m: ["--output_dir", str(outs[m]), "--disable_tqdm", "true", *args], timeout=timeout
    )
    return [Result(code, output, out) for (code, output), out in zip(ran, outs)]


SINGLE_NODE = {"multinode_ddp": "ddp", "multinode_zero3": "zero3", "multinode_fsdp2": "fsdp2"}


def assert_two_machines(results: list[Result], config: str) -> None:
    """Both launches succeeded as one job of 2 processes on 2 machines, in the layout of the config's one-machine
    counterpart (distributed type, ZeRO stage, FSDP version, parameter share: conftest.EXPECTED)."""
    machine0 = results[0]
    assert all(r.returncode == 0 for r in results), "\n\n".join(r.output[-4000:] for r in results)
    dist_type = conftest.EXPECTED[SINGLE_NODE[config]][0]
    assert f"distributed: {dist_type}, world size 2," in machine0.output, machine0.output[-3000:]
    assert "machines: 2 x 1 process(es) per machine = 2" in machine0.output, machine0.output[-3000:]
    # the waits torch holds: ddp_timeout's CPU default (accelerate dropped it: 1800), host_wait_timeout's
    assert "collectives wait 600 s for a rank (ddp_timeout), the host waits for one process's work 14400 s" in (
        machine0.output
    ), machine0.output[-3000:]
    assert re.search(r"rendezvous (127\.0\.0\.1|localhost):\d+", machine0.output), machine0.output[-3000:]
    assert_layout(machine0.train_rows, SINGLE_NODE[config])


def same_run(a: Result, b: Result) -> None:
    """The same per-step losses (1e-6 relative) and the same exported weights (1e-6 absolute)."""
    assert max_rel_diff(a.losses(), b.losses()) <= 1e-6, (a.losses(), b.losses())
    assert max_weight_diff(a.output_dir / "final", b.output_dir / "final") <= 1e-6


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The one-machine, two-process run of each config (computed once per config)."""
    cache: dict[str, Result] = {}

    def get(config: str) -> Result:
        if config not in cache:
            run = tmp_path_factory.mktemp(config) / "run"
            cache[config] = finetune(run, *run_args(assets, config), launcher=SINGLE_NODE[config])
        return cache[config]

    return get


def run_args(assets, config: str = "") -> list[str]:
    """SFT on instruction rows; under multinode_fsdp2, DPO on preference pairs (its reference log-probs computed by
    the two machines together before training, written once to the shared output_dir)."""
    more = ("--max_steps", "4", "--save_steps", "2", "--eval_fraction", "0")
    if config == "multinode_fsdp2":
        from test_preference import pairs

        data = pairs(Path(assets.llama).parent / "multinode_pairs.jsonl")
        return base_args(assets.llama, data, "--method", "dpo", "--beta", "0.5", *more)
    return base_args(assets.llama, assets.instruction, *more)


@pytest.mark.parametrize("config", ["multinode_ddp", "multinode_fsdp2"])
def test_two_machines_sharing_output_dir_equal_one_machine(assets, tmp_path, reference, config):
    """multinode_fsdp2 trains DPO (run_args). (ZeRO-3 on two machines: with an output_dir each, below.)"""
    out = tmp_path / "shared"
    results = launch((out, out), config, *run_args(assets, config))
    assert_two_machines(results, config)
    assert f"storage: {out} is shared by the 2 machines" in results[0].output
    same_run(reference(config), results[0])
    assert (out / "final").is_dir() and (out / "checkpoints" / "step_4").is_dir()
    if config == "multinode_fsdp2":  # DPO: the policy starts as its reference; the log-probs written once
        assert abs(results[0].losses()[0] - math.log(2)) <= 1e-5 and (out / "reference_logps.pt").is_file()
    if config == "multinode_ddp":  # resume: both machines continue from the shared checkpoint
        crash_after(out, 2)
        resumed = launch((out, out), config, *run_args(assets), "--resume_from_checkpoint", "latest")
        assert_two_machines(resumed, config)
        assert "resumed from" in resumed[0].output
        assert [r["step"] for r in resumed[0].train_rows] == [1, 2, 3, 4]
        same_run(reference(config), resumed[0])


@pytest.mark.parametrize("config", ["multinode_zero3"])  # (DDP's per-machine copy: save_on_each_node, the same path)
def test_two_machines_each_with_its_own_output_dir_equal_one_machine_and_resume(assets, tmp_path, reference, config):
    """No shared filesystem (one output_dir per machine): every machine keeps a complete checkpoint and resumes
    from its own copy; final/ and metrics.jsonl are written once, on machine 0. The resume runs under DeepSpeed's
    pdsh launcher (`deepspeed_multinode_launcher: pdsh`, docs/cluster.md), whose launch.py names the machine and
    the processes per machine otherwise than torchrun (CROSS_RANK, CROSS_SIZE, LOCAL_SIZE): there the run took
    itself for one machine, left machine 1's shards of every checkpoint in .tmp_step_N and could not resume."""
    outs = (tmp_path / "machine0", tmp_path / "machine1")
    results = launch(outs, config, *run_args(assets))
    assert_two_machines(results, config)
    assert "is NOT shared between the 2 machines" in results[0].output
    same_run(reference(config), results[0])
    assert (outs[0] / "final").is_dir() and not (outs[1] / "final").exists()
    assert not (outs[1] / "metrics.jsonl").exists()
    _assert_complete_copies(outs, "step_2", config)
    crash_after(outs[0], 2)
    _crash_copy(outs[1], 2)
    ran = conftest.pdsh_machines(
        config,
        lambda m: ["--output_dir", str(outs[m]), "--disable_tqdm", "true", *run_args(assets), "--resume_from_checkpoint", "latest"],
        tmp_path / "hostfile",
    )  # fmt: skip
    resumed = [Result(code, output, out) for (code, output), out in zip(ran, outs)]
    assert_two_machines(resumed, config)
    assert [r["step"] for r in resumed[0].train_rows] == [1, 2, 3, 4]
    same_run(reference(config), resumed[0])
    _assert_complete_copies(outs, "step_4", config)  # written under pdsh
    assert not list(outs[1].glob("checkpoints/.tmp_*"))


def _assert_complete_copies(outs: tuple[Path, Path], step: str, config: str) -> None:
    """Each machine holds its own complete copy of the checkpoint, named by its `latest`."""
    for rank, out in enumerate(outs):
        ckpt = out / "checkpoints" / step
        assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"
        names = {p.name for p in ckpt.rglob("*")}
        if config == "multinode_zero3":  # this rank's ZeRO partition and model states
            own = {f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for kind in ("model", "optim")}
        else:  # what accelerate writes on the global main only, unless save_on_each_node
            own = {"model.safetensors", "optimizer.bin"}
        assert own | {f"random_states_{rank}.pkl", "scheduler.bin", "trainer_state.json"} <= names, sorted(names)


def test_dpo_with_an_output_dir_per_machine_resumes_on_each_machine(assets, tmp_path):
    """DPO's precomputed reference log-probs without a shared filesystem: every rank holds every pair's log-probs
    (gathered), and each machine's local main keeps them in its own output_dir, as it keeps its checkpoints, so a
    resume on each machine reads them from its own disk and goes on as the run did."""
    from test_preference import pairs

    outs = (tmp_path / "machine0", tmp_path / "machine1")
    data = pairs(tmp_path / "pairs.jsonl", n=48)
    more = ("--method", "dpo", "--beta", "0.5", "--max_steps", "3", "--save_steps", "2", "--eval_fraction", "0")
    args = base_args(assets.llama, data, *more)
    results = launch(outs, "multinode_ddp", *args)
    assert_two_machines(results, "multinode_ddp")
    assert "is NOT shared between the 2 machines" in results[0].output
    crash_after(outs[0], 2)
    _crash_copy(outs[1], 2)
    resumed = launch(outs, "multinode_ddp", *args, "--resume_from_checkpoint", "latest", timeout=150)
    assert_two_machines(resumed, "multinode_ddp")
    assert "reference log-probs: read from" in resumed[0].output
    assert [r["step"] for r in resumed[0].train_rows] == [1, 2, 3]
    assert max_rel_diff(results[0].losses(), resumed[0].losses()) <= 1e-6
    tables = [torch.load(out / "reference_logps.pt", weights_only=True) for out in outs]
    assert torch.equal(tables[0]["train"], tables[1]["train"]) and tables[0]["fingerprint"] == tables[1]["fingerprint"]
    (outs[1] / "reference_logps.pt").unlink()  # one machine's copy lost: refused on both, none goes on alone
    refused = launch(outs, "multinode_ddp", *args, "--resume_from_checkpoint", "latest", timeout=150)
    assert [r.returncode for r in refused] == [2, 2], refused[0].output[-3000:]
    says = "reference_logps.pt (the starting model's log-probs for this data) is missing or was made for other data"
    assert f"{says} on machine 1;" in refused[0].output, refused[0].output[-3000:]


def _crash_copy(out: Path, step: int) -> None:
    """crash_after for a machine that holds no final/ (it is written on machine 0 only)."""
    for ckpt in (out / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    (out / "checkpoints" / "latest").write_text(f"step_{step}\n")


def test_machines_holding_different_data_are_refused_before_training(assets, tmp_path):
    """Each machine prepares its data from its own disk: machine 1's file holds the same rows in another order (the
    same row count, token counts and step count: nothing else tells). Refused on both machines with one message
    naming what differs, before any model loads; before, they trained silently on different data."""
    rows = Path(assets.instruction).read_text().splitlines()
    (tmp_path / "machine1.jsonl").write_text("\n".join(reversed(rows)) + "\n")
    outs = (tmp_path / "machine0", tmp_path / "machine1")
    data = (assets.instruction, str(tmp_path / "machine1.jsonl"))
    more = ("--max_steps", "4", "--eval_fraction", "0")
    ran = conftest.two_machines(
        "multinode_ddp",
        lambda m: ["--output_dir", str(outs[m]), "--disable_tqdm", "true", *base_args(assets.llama, data[m], *more)],
        timeout=180,
    )
    assert [code for code, _ in ran] == [2, 2], ran[0][1][-3000:] + ran[1][1][-3000:]
    said = re.search(r"dataset: the machines prepared different data \(train content: (\w+) on machine 0 \([^)]*\), (\w+) "
                     r"on machine 1 \([^)]*\)\); give every machine the same files", ran[0][1])  # fmt: skip
    assert said and said[1] != said[2], ran[0][1][-3000:]
    assert said[0] in ran[1][1], ran[1][1][-3000:]  # machine 1's launcher ends with the same message
    assert "model:" not in ran[0][1] and not (outs[0] / "metrics.jsonl").exists()


def test_a_machine_that_refuses_its_config_stops_the_others_at_once(assets, tmp_path):
    """Machine 1 lacks the data file and refuses its run config before the ranks join; machine 0, whose config is
    good, stops too, at once, with machine 1's problem and where it was (exit 2). Before, it waited ddp_timeout in
    the process group's start and ended in two tracebacks naming a store key."""
    outs = (tmp_path / "machine0", tmp_path / "machine1")
    data = (assets.instruction, str(tmp_path / "missing.jsonl"))
    more = ("--max_steps", "4", "--eval_fraction", "0", "--ddp_timeout", "60")
    start = time.monotonic()
    ran = conftest.two_machines(
        "multinode_ddp",
        lambda m: ["--output_dir", str(outs[m]), "--disable_tqdm", "true", *base_args(assets.llama, data[m], *more)],
        timeout=180,
    )
    assert [code for code, _ in ran] == [2, 2], ran[0][1][-3000:] + ran[1][1][-3000:]
    assert time.monotonic() - start < 50  # not ddp_timeout's 60 s
    missing = f"no file or directory matches '{data[1]}'"
    assert re.search(rf"dataset: on machine 1 \([^)]*\), rank 1: {re.escape(missing)}", ran[0][1]), ran[0][1][-3000:]
    assert f"dataset: {missing}" in ran[1][1] and "Traceback" not in ran[0][1] + ran[1][1]


def test_fsdp2_without_a_shared_output_dir_is_refused_before_training(assets, tmp_path):
    outs = (tmp_path / "machine0", tmp_path / "machine1")
    results = launch(outs, "multinode_fsdp2", *run_args(assets), timeout=180)
    assert all(r.returncode != 0 for r in results), results[0].output[-3000:]
    assert results[0].returncode == 2, results[0].output[-3000:]  # finetune's bad-input code, through the launcher
    assert "output_dir: is not shared between the machines" in results[0].output
    assert not (outs[0] / "checkpoints").exists() and not (outs[0] / "metrics.jsonl").exists()


# ---------------------------------------------------------------- configs and the SLURM script (no launch)


def test_no_shipped_config_holds_an_address_that_routes():
    """Multi-machine configs hold a placeholder that cannot be taken for an address; others none at all."""
    for path in SHIPPED:
        raw = yaml.safe_load(path.read_text())
        ip = raw.get("main_process_ip")
        if raw.get("num_machines", 1) > 1:
            assert isinstance(ip, str) and ip.startswith("<EDIT"), path.name
            assert raw["rdzv_backend"] == "c10d", path.name
        else:
            assert ip in (None, "127.0.0.1", "localhost"), path.name
    names = {p.stem for p in SHIPPED}
    assert {"multinode_ddp", "multinode_zero3", "multinode_fsdp2"} <= names
    zero3 = yaml.safe_load((ROOT / "accelerate_configs" / "multinode_zero3.yaml").read_text())
    assert zero3["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"


def test_unedited_placeholder_stops_the_launch_at_once(tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / "multinode_ddp.yaml"),
            "-m",
            "finetune",
            "--output_dir",
            str(tmp_path / "out"),
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and time.monotonic() - start < 30
    last = proc.stderr.strip().splitlines()[-1]
    assert "<EDIT: address of machine 0, or pass --main_process_ip>" in last, proc.stderr[-2000:]


def test_slurm_script_gives_each_node_its_own_machine_rank(tmp_path):
    """srun runs the launch line on every node: SLURM_NODEID must expand there (fake srun/scontrol/accelerate
    record what each node would run)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "launched.jsonl"
    fakes = {
        # srun: run the command once per node, with that node's SLURM_NODEID
        "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do case "$1" in --output) shift 2;; *) shift;; esac; done\n'
        'for n in 0 1; do SLURM_NODEID=$n "$@"; done\n',
        "scontrol": "#!/bin/bash\necho gpu-node-a\necho gpu-node-b\n",
        "accelerate": f"#!/bin/bash\n{sys.executable} -c 'import json,sys; print(json.dumps(sys.argv[1:]))' "
        f'"$@" >> {log}\n',
    }
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-node-[a-b]",
        "SLURM_JOB_ID": "42",
        "SLURM_NODEID": "0",  # the batch host's own value: must not leak into the nodes' commands
        "GPUS_PER_NODE": "4",
    }
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "slurm.sbatch"),
            "accelerate_configs/multinode_zero3.yaml",
            "run.yaml",
            "--max_steps",
            "5",
        ],  # fmt: skip
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    launches = [json.loads(line) for line in log.read_text().splitlines()]

    def value(argv, flag):
        return argv[argv.index(flag) + 1]

    assert [value(a, "--machine_rank") for a in launches] == ["0", "1"]
    for argv in launches:
        assert value(argv, "--main_process_ip") == "gpu-node-a" and value(argv, "--num_processes") == "8"
        assert value(argv, "--num_machines") == "2" and value(argv, "--rdzv_backend") == "c10d"
        assert argv[argv.index("-m") :] == [
            "-m", "finetune", "--config", "run.yaml", "--resume_from_checkpoint", "auto", "--max_steps", "5"
        ]  # fmt: skip
