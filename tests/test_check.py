"""`finetune check`, the preflight: the judging logic on hand-made rows (in this process), the arrival
protocol on a real TCP store (threads), and three real launches: two CPU ranks that pass, two "machines"
on loopback where one sees another transformers version, and a rank that hangs before it arrives.

Every launch asserts from the printed table that two distinct ranks really ran (no silent fallback to
one process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from importlib import metadata
from types import SimpleNamespace

from conftest import ROOT, run_killing_the_group, two_machines

from finetune.commands import check
from finetune.launching import finetune_command

REAL_TRANSFORMERS = metadata.version("transformers")
VERSIONS = {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.23.0", "finetune": "0.1.0"}


def row(rank: int, **kw) -> dict:
    """One rank's gathered facts and results, as all_gather_object hands them to rank 0."""
    base = {
        "rank": rank,
        "local_rank": rank,
        "node": 0,
        "world_size": 2,
        "host": "node-a",
        "device": "cpu",
        "gpu": None,
        "gpu_bus": None,
        "cuda_visible_devices": None,
        "device_error": None,
        "versions": dict(VERSIONS),
        "config_hash": "abc123",
        "config_error": None,
        "output_dir": "/out",
        "finished": None,
        "seed": 7,
        "broadcast_ok": True,
        "allreduce_ok": True,
        "bandwidth": None,
        "output": {"error": None, "created": False, "sees": [0]} if rank == 0 else None,
    }
    return {**base, **kw}


def table_ranks(output: str) -> list[int]:
    """The ranks listed in the check's table (the rows under the "rank  node ..." header)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank  node"))
    ranks = []
    for line in lines[start + 1 :]:
        m = re.match(r"(\d+)\s+\d+\s", line)
        if not m:
            break
        ranks.append(int(m.group(1)))
    return ranks


# ---------------------------------------------------------------- pure logic


def test_clean_rows_pass_with_one_versions_line():
    rows = [row(0, bandwidth={"mb": 16, "iterations": 5, "seconds": 0.01, "algbw": 1.68, "busbw": 1.68}), row(1)]
    report, code = check.render_report(rows, "heading")
    assert code == 0 and report.endswith("check passed"), report
    assert "versions: python 3.11.7, torch 2.13.0+cpu, transformers 5.23.0, finetune 0.1.0" in report
    assert "all-reduce bandwidth (16 MB float32, 5 iterations, 10.0 ms each): algbw 1.68 GB/s" in report
    assert "output_dir /out: writable" in report
    assert table_ranks(report) == [0, 1]


def test_version_mismatch_names_package_ranks_and_versions():
    rows = [row(0), row(1, versions={**VERSIONS, "transformers": "99.0.0"}), row(2)]
    problems = check.find_problems(rows)
    assert len(problems) == 1, problems
    assert problems[0][0] == "transformers differs between ranks: 5.23.0 on ranks 0, 2; 99.0.0 on rank 1"
    table = check.render_table(rows)
    assert "transformers" not in table.splitlines()[0]  # the agreeing versions line leaves it out
    assert table.splitlines()[1].split() == ["rank", "node", "host", "local", "device", "transformers", "config"]
    assert table.splitlines()[3].split()[-2:] == ["99.0.0", "abc123"]


def test_config_hash_mismatch():
    problems = check.find_problems([row(0), row(1, config_hash="def456")])
    assert [p[0] for p in problems] == [
        "the effective run config differs between ranks: hash abc123 on rank 0; def456 on rank 1"
    ]


def test_two_ranks_on_one_gpu_only_on_the_same_host():
    gpu = {"device": "cuda:0", "gpu": "GPU-1234", "gpu_bus": "0000:1a:00"}
    same_host = check.find_problems([row(0, **gpu), row(1, **gpu)])
    assert [p[0] for p in same_host] == ["ranks 0, 1 on node-a share one GPU (GPU-1234)"]
    assert "CUDA_VISIBLE_DEVICES" in same_host[0][1]
    assert check.find_problems([row(0, **gpu), row(1, host="node-b", **gpu)]) == []
    assert "cuda:0 GPU-1234 (bus 0000:1a:00)" in check.render_table([row(0, **gpu)])


def test_device_error_and_wrong_collective_results():
    rows = [row(0, device_error="local rank 0 but only 0 GPU(s) visible"), row(1, allreduce_ok=False)]
    what = [p[0] for p in check.find_problems(rows)]
    assert what == [
        "rank 0 on node-a: local rank 0 but only 0 GPU(s) visible",
        "an all-reduce (sum of ranks) gave wrong values on rank 1 (seed 7)",
    ]
    report, code = check.render_report(rows, "heading")
    assert code == 1 and "check failed: 2 problems\n  1. rank 0" in report and "     what to do:" in report


def test_output_dir_shared_node_local_and_not_writable():
    def two_nodes(sees0, sees1, error=None):
        out0 = {"error": None, "created": True, "sees": sees0}
        out1 = {"error": error, "created": False, "sees": sees1}
        return [row(0, output=out0), row(1, node=1, local_rank=0, host="node-b", output=out1)]

    assert (
        check.output_summary(two_nodes([0, 1], [0, 1])) == "output_dir /out: writable (created), shared by nodes 0, 1"
    )
    assert "node-local (checkpoints are kept per machine" in check.output_summary(two_nodes([0], [1]))
    rows = two_nodes([0], [], error="PermissionError: [Errno 13] Permission denied: '/out'")
    assert [p[0] for p in check.find_problems(rows)] == [
        "output_dir /out is not writable on node 1 (node-b): PermissionError: [Errno 13] Permission denied: '/out'"
    ]
    assert check.output_summary([row(0, output_dir=None, output=None)]).startswith("output_dir: not checked")


def test_config_hash_follows_the_effective_config():
    args = check.build_parser().parse_args(["--config", str(ROOT / "examples" / "sft.yaml")])
    plain, changed = check.config_facts(args, []), check.config_facts(args, ["--learning_rate", "0.5"])
    assert plain == check.config_facts(args, []) and len(plain["config_hash"]) == 12
    assert changed["config_hash"] != plain["config_hash"] and changed["output_dir"] == plain["output_dir"]
    args.output_dir = "elsewhere"  # --output_dir is the real run's output_dir too: it is checked and hashed
    moved = check.config_facts(args, [])
    assert moved["output_dir"] == "elsewhere" and moved["config_hash"] != plain["config_hash"]


def test_ranks_are_what_the_launcher_says():
    """torchrun's variables (through topology.Launcher); the node from GROUP_RANK, else derived from the ranks;
    the world size is torchrun's WORLD_SIZE (the store and ranks check uses are torchrun's)."""
    torchrun = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert check.env_ranks(torchrun) == {"rank": 3, "local_rank": 1, "node": 1, "world_size": 4}
    assert check.env_ranks({**torchrun, "GROUP_RANK": ""})["node"] == 1  # 3 // 2
    assert check.env_ranks({}) == {"rank": 0, "local_rank": 0, "node": 0, "world_size": 1}
    assert check.env_ranks({"OMPI_COMM_WORLD_SIZE": "3"})["world_size"] == 1


def test_gpu_facts_name_the_physical_gpu(monkeypatch):
    """The mapping from local rank to physical GPU, with torch.cuda answering as on a one-GPU node."""
    import torch

    props = SimpleNamespace(
        uuid="58a6fa5f-1111-2222-3333-444455556666", pci_domain_id=0, pci_bus_id=26, pci_device_id=0
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    facts = check.device_facts(0)
    assert (facts["device"], facts["gpu"], facts["gpu_bus"]) == (
        "cuda:0",
        "GPU-58a6fa5f-1111-2222-3333-444455556666",
        "0000:1a:00",
    )
    assert check.device_facts(1)["device_error"].startswith("local rank 1 but only 1 GPU(s) visible")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # the Accelerate config's use_cpu
    assert check.device_facts(0)["device"] == "cpu"


def test_arrival_names_the_rank_that_never_came():
    """Rank 0's side of the arrival protocol on a real TCP store; rank 2 never registers."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    prefix = "finetune_check/test/0"
    facts = {r: row(r, world_size=3) for r in range(3)}
    verdicts = {}
    late = threading.Thread(target=lambda: verdicts.update({1: check.arrive(store, prefix, facts[1], 5)}))
    late.start()
    start = time.monotonic()
    code = check.arrive(store, prefix, facts[0], timeout=1)
    late.join(timeout=20)
    assert code == 1 and 1 <= time.monotonic() - start < 5
    assert verdicts == {1: 1}  # the rank that arrived stops too, on rank 0's verdict
    assert store.get(f"{prefix}/verdict") == b"stop:1"
    arrived, waited = check.await_arrivals(store, prefix, 3, timeout=0.1)
    report = check.arrival_report(arrived, 3, waited=1)
    assert table_ranks(report) == [0, 1] and "rank 2 never arrived (waited 1 s): likely" in report


def test_bad_config_exits_2_naming_the_file():
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "check", "--config", "/nonexistent.yaml"],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "'/nonexistent.yaml' does not exist" in out and "Traceback" not in out


# ---------------------------------------------------------------- real launches


def launch_cmd(*args: str) -> list[str]:
    """accelerate launch of `finetune check` on ddp.yaml, as the product builds launches (a free port)."""
    return finetune_command(["check", *args], ROOT / "accelerate_configs" / "ddp.yaml")


def env_with(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def test_two_ranks_pass(tmp_path):
    out_dir = tmp_path / "out"
    proc = run_killing_the_group(launch_cmd("--output_dir", str(out_dir), "--timeout", "30"), env_with(), 120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "finetune check: 2 ranks on 1 node(s), gloo" in out, out[-4000:]
    assert table_ranks(out) == [0, 1], out
    assert re.search(r"all-reduce bandwidth \(16 MB float32, 5 iterations, .*busbw \d+\.\d+ GB/s", out), out
    assert f"output_dir {out_dir}: writable (created)" in out and proc.stdout.rstrip().endswith("check passed"), out
    assert os.listdir(out_dir) == []  # the probe files are gone


def test_version_mismatch_between_two_machines(tmp_path):
    """Two launches of one process each, rendezvous over 127.0.0.1 (c10d): machine 1 sees a fake
    transformers 99.0.0 through PYTHONPATH, as a node with another environment would."""
    fake = tmp_path / "site"
    info = fake / "transformers-99.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 99.0.0\n")
    ran = two_machines(
        "ddp",
        lambda m: ["check", "--output_dir", str(tmp_path / "out")],
        env_of=lambda m: {"PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])} if m else {},
        timeout=120,
    )
    codes, outs = zip(*ran)
    out = "\n".join(outs)
    assert codes == (1, 1), (codes, out[-6000:])
    assert "finetune check: 2 ranks on 2 node(s), gloo" in out, out[-6000:]
    assert table_ranks(out) == [0, 1], out
    found = re.search(r"transformers differs between ranks: (.*)", out)
    assert found, out[-6000:]
    rank_of = dict(re.findall(r"(\S+) on rank (\d+)", found.group(1)))  # version -> the rank that has it
    assert set(rank_of) == {REAL_TRANSFORMERS, "99.0.0"} and set(rank_of.values()) == {"0", "1"}, found.group(1)
    assert f"output_dir {tmp_path / 'out'}: writable (created), shared by nodes 0, 1" in out, out
    for machine, said in enumerate(outs):  # each launcher ends with the problems, not with its traceback
        assert "Traceback" not in said, said[-4000:]
        end = said[said.rindex("[launcher]") :]
        assert re.match(rf"\[launcher\] finetune failed: rank {machine} stopped with the message below.*\n"
                        r"check failed: 1 problem\n  1\. transformers differs between ranks", end), said[-4000:]  # fmt: skip


def test_bad_input_under_accelerate_launch_exits_2_with_the_message(tmp_path):
    """Under accelerate launch (2 ranks) bad input is exit 2 and the message, as in a run: rank 0 says it and the
    launcher's report ends with it (the launcher ended in its traceback, exit 1: check left no error file)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\n  bad: [\n")
    proc = run_killing_the_group(launch_cmd("--config", str(bad), "--timeout", "30"), env_with(), 120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-4000:]
    message = f"finetune: 1 problem in the run config:\n  - --config: {bad} is not valid YAML at line 2"
    assert proc.stderr.startswith(message), out[-4000:]
    report = "[launcher] finetune failed: rank 0, rank 1 stopped with the message below"
    assert proc.stderr.count(message) == 2 and report in proc.stderr.split(message)[1], out[-4000:]


def test_rank_that_never_arrives_is_named(tmp_path):
    start = time.monotonic()
    proc = run_killing_the_group(
        launch_cmd("--output_dir", str(tmp_path / "out"), "--timeout", "8"),
        env_with(FINETUNE_FAULT="hang-check:0:1"),
        90,
    )
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and elapsed < 40, (elapsed, out[-4000:])
    assert "finetune check: 1 of 2 ranks arrived" in out and table_ranks(out) == [0], out[-4000:]
    assert "rank 1 never arrived (waited 8 s): likely the process is stuck before start" in out, out[-4000:]
