"""DeepSpeed ZeRO-1/2/3 and offload, by swapping the Accelerate config: proven equal to DDP."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    assert_layout,
    base_args,
    classification_args,
    finetune,
    max_rel_diff,
    max_tensor_diff,
    run_killing_the_group,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
ZERO = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
# fp32 without offload: the fp32 master weights are the weights' own partition (share_fp32_master_weights); with
# offload the master lives on the CPU apart from the weights
MASTER_COPY = {"zero1": False, "zero2": False, "zero2_offload": True, "zero3": False, "zero3_offload": True}
PARITY = ["single", "ddp", *ZERO, "fsdp2", "fsdp2_offload"]  # finetune parity's default configs
# By default the parity run leaves out the layouts other fp32 tests already prove equal to one process, weights and
# all (suite time: about 50 s): DDP (test_train's two ranks), ZeRO-2 (test_resume_layouts' chain ends in it), ZeRO-3
# (test_chunked_loss, test_best, test_peft) and FSDP2 (test_fsdp). FINETUNE_CONFIG_GRID=1 runs all nine, through
# finetune parity's own default list.
PARITY_RUN = (
    PARITY
    if os.environ.get("FINETUNE_CONFIG_GRID")
    else ["single", "zero1", "zero2_offload", "zero3_offload", "fsdp2_offload"]
)


def test_ds_configs_leave_run_config_values_to_auto():
    for path in sorted((ROOT / "ds_configs").glob("*.json")):
        ds = json.loads(path.read_text())
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
            assert ds[key] == "auto", (path.name, key)
        assert "optimizer" not in ds and "scheduler" not in ds
    for name in ZERO:
        text = (ROOT / "accelerate_configs" / f"{name}.yaml").read_text()
        assert f"ds_configs/{name}.json" in text


def test_parity_over_every_single_node_backend(assets, tmp_path):
    """`finetune parity` over its 9 default configs (by default the 5 of PARITY_RUN), fp32, 6 steps, GA 2. The
    differences are computed here from each run's metrics.jsonl and final/model.safetensors (losses <= 1e-5
    relative, weights <= 1e-5 absolute to the single process), and every run shows the backend it really used
    (stage, offload, FSDP, sharding). Every final/ is the complete trained model; ZeRO-3 offload's and ZeRO-2
    offload's reload through from_pretrained."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run.yaml"
    run.write_text(
        json.dumps(
            {
                "model": assets.llama,
                "dataset": assets.instruction,
                "max_seq_length": 64,
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 2,
                "learning_rate": 1e-3,
                "eval_fraction": 0.1,
                "curves": False,
            }
        )
    )
    out = tmp_path / "parity"
    configs = [] if PARITY_RUN == PARITY else ["--configs", ",".join(PARITY_RUN)]
    proc = run_killing_the_group(
        [sys.executable, "-m", "finetune", "parity", "--config", str(run), "--steps", "6", "--output_dir", str(out)]
        + configs,
        {**os.environ, "OMP_NUM_THREADS": "1"},
        1500,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    print(proc.stdout)
    reference = None
    for name in PARITY_RUN:
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "loss" in r]
        assert len(train) == 6
        assert_layout(train, name, every_row=True)
        if name in MASTER_COPY:
            assert train[-1]["fp32_master_copy"] == MASTER_COPY[name], name
        weights = load_file(str(out / name / "final" / "model.safetensors"))
        losses = [r["loss"] for r in train]
        if reference is None:
            reference = losses, weights
            continue
        assert max_rel_diff(reference[0], losses) <= 1e-5, name
        # final/ is the whole model (ZeRO-3 and FSDP gather it; not an empty shell), and it is the trained one
        assert max_tensor_diff(reference[1], weights) <= 1e-5, name
    base = load_file(os.path.join(assets.llama, "model.safetensors"))
    assert any(not torch.equal(reference[1][k], base[k]) for k in base)  # trained, not the base
    for name in ("zero3_offload", "zero2_offload"):  # reloads through from_pretrained
        model = AutoModelForCausalLM.from_pretrained(out / name / "final")
        assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for v in base.values())


def test_contradicting_deepspeed_json_is_refused(assets, tmp_path):
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["gradient_accumulation_steps"] = 4
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(ds))
    res = finetune(
        tmp_path / "run",
        *base_args(assets.llama, assets.instruction, "--max_steps", "2"),
        launcher="python",
        expect_ok=False,
        extra_env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)},
    )
    assert res.returncode == 2, res.output[-3000:]
    assert "gradient_accumulation_steps=4" in res.output and "defines its own optimizer" in res.output
    assert "Traceback" not in res.output


def test_deepspeed_still_needs_the_relink(assets, tmp_path):
    """finetune.checkpoint.relink_deepspeed_optimizer_states works around DeepSpeed leaving the Adam-state
    views of all but the first parameter group empty. Without it, a ZeRO-2 checkpoint cannot read the
    moments. When this test fails, DeepSpeed has fixed it: delete the workaround and this test."""
    args = base_args(assets.llama, assets.text, "--max_steps", "1", "--save_steps", "1", "--eval_fraction", "0")
    broken = finetune(
        tmp_path / "without", *args, launcher="zero2", expect_ok=False, extra_env={"FINETUNE_NO_DS_RELINK": "1"}
    )
    assert broken.returncode != 0 and "exp_avg not found in optimizer state fragment" in broken.output
    # with it, the same run passes: every ZeRO-1/2 run in this suite saves its checkpoint through it


MASTER_COPY_SCRIPT = """
import os, sys, torch, deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from finetune.parallel.deepspeed import _master_and_weights, share_fp32_master_weights, skip_inference_shm_op
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
skip_inference_shm_op()  # as finetune's ranks do (its build is a minute on a fresh machine)
deepspeed.init_distributed(dist_backend="gloo")
for stage in (1, 2, 3):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    before = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    pairs = _master_and_weights(engine.optimizer)
    print(stage, "copies", sum(a.data_ptr() != b.data_ptr() for a, b in pairs), "of", len(pairs))
    share_fp32_master_weights(engine.optimizer)
    pairs = _master_and_weights(engine.optimizer)
    print(stage, "shared", sum(a.numel() for a, b in pairs if a.data_ptr() == b.data_ptr()))
    assert all(a.data_ptr() == b.data_ptr() for a, b in pairs)
    for _ in range(2):
        loss = engine(torch.randn(2, 16)).square().mean()
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    masters = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    assert all(torch.equal(w, m) for w, m in zip(weights, masters)), "master and weights differ"
    assert all(not torch.equal(w, b) for w, b in zip(weights, before)), "not trained"
    state = engine.optimizer.state_dict()
    if "single_partition_of_fp32_groups" in state:  # ZeRO-1/2: written as its own partition, not the whole flat
        saved = state["single_partition_of_fp32_groups"]
        assert all(t.untyped_storage().nbytes() == t.numel() * 4 for t in saved), "a view of the whole model"
print("ok")
"""


def test_deepspeed_still_copies_fp32_master_weights(tmp_path):
    """finetune.parallel.deepspeed.share_fp32_master_weights: with fp32 weights DeepSpeed keeps its fp32 master
    partition as a second copy of the weights' partition under ZeRO-1, 2 and 3 (ZeRO-3 means not to, but its
    device check compares a torch.device with a str). Shared, two steps train, the master read by name
    (safe_get_full_fp32_param) is the weights, and a ZeRO-1/2 checkpoint still writes the partition alone. When
    DeepSpeed shares them itself, the 'copies' lines read 0: delete the workaround and this test."""
    script = tmp_path / "master_copy.py"
    script.write_text(MASTER_COPY_SCRIPT)
    proc = run_killing_the_group([sys.executable, str(script)], {**os.environ, "OMP_NUM_THREADS": "1"}, 300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in (1, 2, 3):
        assert f"{stage} copies 1 of 1" in proc.stdout or f"{stage} copies 2 of 2" in proc.stdout, proc.stdout
        shared = int(next(line.split()[-1] for line in proc.stdout.splitlines() if line.startswith(f"{stage} shared")))
        assert shared >= 16 * 32 + 32 + 32 * 4 + 4, proc.stdout  # every trainable element (ZeRO pads, never less)


COMPILE_SCRIPT = """
import os, sys, torch, deepspeed
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
from finetune.parallel.deepspeed import skip_inference_shm_op
skip_inference_shm_op()  # as finetune's ranks do (its build is a minute on a fresh machine)
if sys.argv[1] == "finetune":
    from finetune.parallel.deepspeed import compile_on_first_call
    compile_on_first_call()
deepspeed.init_distributed(dist_backend="gloo")
before = set(sys.modules)
net = torch.nn.Linear(8, 8)
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters()), config=config)
new = set(sys.modules) - before
print("muon imported", "deepspeed.runtime.zero.muon.muon_optimizer" in new)
print("compiler loaded", "torch._functorch.aot_autograd" in new)  # what torch.compile(fn) loads
if sys.argv[1] == "finetune":  # the decorated function still works, compiled at its first call only
    from deepspeed.runtime.zero.muon import original_muon
    compiled = []
    torch.compile = lambda fn, **options: compiled.append(fn) or fn
    x = torch.randn(4, 3)
    results = [original_muon.zeropower_via_newtonschulz5(x, 2) for _ in range(2)]
    eager = original_muon.zeropower_via_newtonschulz5.__wrapped__(x, 2)
    assert len(compiled) == 1 and all(torch.equal(r, eager) for r in results), compiled
print("ok")
"""


def test_deepspeed_still_compiles_at_import(tmp_path):
    """finetune.parallel.deepspeed.compile_on_first_call: building a ZeRO-3 engine imports DeepSpeed's Muon module
    (to ask whether the optimizer is Muon), which applies torch.compile at import and so loads the compiler stack
    (+41 MB per rank). With the workaround the module is still imported, the compiler is not, and the decorated
    function gives the eager result, compiled once at its first call. When DeepSpeed stops importing Muon or
    compiling at import, the first assertion fails: delete the workaround and this test."""
    script = tmp_path / "compile_at_import.py"
    script.write_text(COMPILE_SCRIPT)
    out = {}
    for mode in ("deepspeed", "finetune"):
        cmd = [sys.executable, str(script), mode]
        proc = run_killing_the_group(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, 300)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
        out[mode] = proc.stdout
    assert "muon imported True" in out["deepspeed"] and "compiler loaded True" in out["deepspeed"], out
    assert "muon imported True" in out["finetune"] and "compiler loaded False" in out["finetune"], out


SHM_SCRIPT = """
import os, sys, deepspeed
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
built = []
class Op:  # what the built op answers, without building it
    def initialize(self, *args): pass
    def vector_kernel_level(self): return 0
ShareMemCommBuilder.load = lambda self, *a, **k: built.append(self.NAME) or Op()
if sys.argv[1] == "finetune":
    from finetune.parallel.deepspeed import skip_inference_shm_op
    skip_inference_shm_op()
deepspeed.init_distributed(dist_backend="gloo")  # what accelerate's DeepSpeed path calls in every rank
print("built", built)
print("ok")
"""


def test_deepspeed_still_builds_its_inference_shm_op(tmp_path):
    """finetune.parallel.deepspeed.skip_inference_shm_op: on CPU processes, starting DeepSpeed's communication
    backend builds (a minute's C++ build on a machine's first run) and loads its shared-memory all-reduce op, which
    only DeepSpeed's inference path calls. With the workaround it is not built. When DeepSpeed stops building it
    for every start, the first assertion fails: delete the workaround and this test."""
    script = tmp_path / "shm_op.py"
    script.write_text(SHM_SCRIPT)
    out = {}
    for mode in ("deepspeed", "finetune"):
        proc = run_killing_the_group([sys.executable, str(script), mode], {**os.environ, "OMP_NUM_THREADS": "1"}, 300)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
        out[mode] = proc.stdout
    assert "built ['deepspeed_shm_comm']" in out["deepspeed"], out
    assert "built []" in out["finetune"], out


WRITE_ERROR_SCRIPT = """
import datetime, errno, os, sys, time, torch, torch.distributed as dist

def main(rank, mode, rendezvous, save_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    from finetune.parallel.deepspeed import finish_collectives_after_a_write_error, skip_inference_shm_op
    skip_inference_shm_op()  # as finetune's ranks do (its build is a minute on a fresh machine)
    import deepspeed
    timeout = datetime.timedelta(seconds=8)  # ddp_timeout
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2, timeout=timeout)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters()), config=config)
    if rank == 1:  # its disk is full
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        engine.checkpoint_engine.save = full
    if mode == "finetune":
        finish_collectives_after_a_write_error(engine)
    start = time.monotonic()
    try:
        engine.save_checkpoint(save_dir, "tag")
        outcome = "returned"
    except Exception as e:
        outcome = type(e).__name__
    with open(os.path.join(save_dir + f"_rank{rank}.txt"), "w") as f:  # (stdout interleaves DeepSpeed's lines)
        f.write(f"{outcome} {time.monotonic() - start:.0f}")
    if mode == "deepspeed" and rank == 1:
        time.sleep(12)  # alive: rank 0 meets its timeout, not a closed connection
    os._exit(0)

if __name__ == "__main__":
    torch.multiprocessing.spawn(main, args=tuple(sys.argv[1:]), nprocs=2)
"""


def test_deepspeed_still_leaves_ranks_waiting_after_a_write_error(tmp_path):
    """finetune.parallel.deepspeed.finish_collectives_after_a_write_error: under ZeRO-3, a rank whose checkpoint
    write fails (a full disk) raises out of DeepSpeed's save_checkpoint before the collectives that follow its
    writes, and the other rank waits in them until the collective timeout. With the workaround both come out at
    once: the failing rank with its write error, the other normally. When DeepSpeed stops leaving the other rank
    waiting, the first assertion fails: delete the workaround and this test."""
    script = tmp_path / "write_error.py"
    script.write_text(WRITE_ERROR_SCRIPT)
    out = {}
    for mode in ("deepspeed", "finetune"):
        rendezvous = f"file://{tmp_path / mode}"
        cmd = [sys.executable, str(script), mode, rendezvous, str(tmp_path / f"ckpt_{mode}")]
        proc = run_killing_the_group(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, 120)
        said = {r: tmp_path / f"ckpt_{mode}_rank{r}.txt" for r in (0, 1)}
        assert proc.returncode == 0 and all(p.exists() for p in said.values()), (
            proc.stdout[-3000:] + proc.stderr[-3000:]
        )
        out[mode] = {r: p.read_text().split() for r, p in said.items()}  # {rank: [outcome, seconds]}
    assert out["deepspeed"][1][0] == "OSError", out
    assert out["deepspeed"][0][0] == "RuntimeError" and int(out["deepspeed"][0][1]) >= 7, out  # the timeout
    assert out["finetune"][1][0] == "OSError" and out["finetune"][0][0] == "returned", out
    assert int(out["finetune"][0][1]) < 7, out


GLOO_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from deepspeed.runtime.comm import coalesced_collectives
from deepspeed.runtime.zero import partition_parameters
from finetune.parallel.deepspeed import gloo_collectives_by_all_reduce
from finetune.parallel.environment import set_cpu_allocator

N = 25_000_000  # elements per rank: 100 MB

def peak_growth(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident size
    status = lambda key: int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key)))
    start = status("VmRSS:")
    fn()
    return (status("VmHWM:") - start) * 1024 / (4 * N)  # in units of one rank's buffer

def main(rank):
    assert set_cpu_allocator("release") == "release"  # freed buffers go back at once: growth is what a call keeps
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=rank, world_size=2)
    torch.manual_seed(rank)
    mine, full, out = torch.randn(N), torch.zeros(2 * N), torch.zeros(2 * N)  # outputs resident before
    grads = torch.randn(2 * N)
    results = {}
    results["gloo_gather"] = peak_growth(lambda: dist.all_gather_into_tensor(full, mine))
    gloo_full = full.clone()
    gloo_sum = grads.clone()
    part = torch.zeros(N)
    results["gloo_scatter"] = peak_growth(lambda: dist.reduce_scatter_tensor(part, gloo_sum))
    gloo_part = part.clone()
    gloo_collectives_by_all_reduce()
    gather, scatter = partition_parameters._dist_allgather_fn, coalesced_collectives._torch_reduce_scatter_fn
    results["ours_gather"] = peak_growth(lambda: gather(mine, out, None).wait())
    assert torch.equal(out, gloo_full), "gathered weights differ"
    ours = grads.clone()
    results["ours_scatter"] = peak_growth(lambda: scatter(ours, ours.chunk(2)[rank]))
    assert torch.equal(ours.chunk(2)[rank], gloo_part), "reduced gradients differ"
    if rank == 0:
        print(" ".join(f"{k}={v:.2f}" for k, v in results.items()), flush=True)
    dist.barrier()

if __name__ == "__main__":
    torch.multiprocessing.spawn(main, nprocs=2)
"""


def test_gloo_collectives_still_copy(tmp_path):
    """finetune.parallel.deepspeed.gloo_collectives_by_all_reduce: torch's gloo all_gather_into_tensor and
    reduce_scatter_tensor grow a rank's resident memory by a whole buffer or more (ZeRO-3 gathers and reduces
    the 131 MB embedding and head with them); the in-place all_reduce that replaces them gives the same tensors,
    bit for bit, with almost no growth. When gloo stops copying, the first assertion fails: delete the workaround
    and this test."""
    script = tmp_path / "gloo.py"
    script.write_text(GLOO_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rendezvous = f"file://{tmp_path / 'rendezvous'}"  # a file, not a port: nothing to race for
    proc = run_killing_the_group([sys.executable, str(script), rendezvous], env, 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("gloo_gather="))
    growth = {k: float(v) for k, v in (item.split("=") for item in line.split())}
    print(growth)
    assert growth["gloo_gather"] >= 0.9 and growth["gloo_scatter"] >= 0.9, growth  # gloo still copies
    assert growth["ours_gather"] <= 0.2 and growth["ours_scatter"] <= 0.2, growth


def test_parity_exits_1_on_a_planted_difference(capsys):
    """`finetune parity`'s verdict (commands/parity.report), on outcomes with a planted difference: a loss 1e-4 off,
    one weight 1e-3 off, a missing export, a failed run: each exits 1 and is flagged; identical runs exit 0."""
    import argparse

    from finetune.commands.parity import Outcome, report

    args = argparse.Namespace(loss_rtol=1e-5, weight_atol=1e-5, update_rtol=float("inf"), output_dir="out")
    w = {"a": torch.ones(3), "b": torch.zeros(2)}

    def run(name, losses=(2.0, 1.5, 1.0), weights=w, ok=True):
        return Outcome(name, ok, 1, "NO", losses=list(losses), weights=weights, error="" if ok else "exit 1")

    assert report([run("single"), run("ddp")], args) == 0
    capsys.readouterr()
    on_gpus = [dataclasses.replace(run(n), peak_rss_gb=[3.0], peak_gpu_gb=[1.25]) for n in ("single", "ddp")]
    assert report(on_gpus, args) == 0  # GPU runs show torch's allocated peak, not the host's
    assert capsys.readouterr().out.count("  1.25 GPU\n") == 2
    planted = [
        run("ddp", losses=(2.0, 1.5, 1.0001)),
        run("ddp", weights={"a": torch.ones(3) + 1e-3, "b": torch.zeros(2)}),
        run("ddp", weights=None),
        run("ddp", losses=(2.0, 1.5)),
        run("ddp", ok=False),
    ]
    for other in planted:
        capsys.readouterr()
        assert report([run("single"), other], args) == 1, other
        shown = capsys.readouterr().out
        assert "<-- above tolerance" in shown or "FAILED" in shown, shown


def test_parity_runs_where_the_user_is_reads_overrides_as_finetune_and_replaces_only_its_own_runs(
    tmp_path, monkeypatch, capsys
):
    """What `finetune parity` launches (the launches recorded, not run): from the user's folder (the runs started in
    the project root, where a relative config or path meant nothing), with the shipped DeepSpeed JSON by its full
    path; overrides read by finetune's own parser (`-- --packing --seed=3` was paired two by two: exit 2); an
    output_dir holding anything but parity's runs refused (each run's --overwrite_output_dir replaced it)."""
    from finetune import launching
    from finetune.commands import parity

    launched = []

    def launch(cmd, timeout, env=None, log=None, cwd=launching.ROOT, **kw):
        launched.append((cmd, cwd))
        return launching.Launched(rc=1, wall_s=0.0, output="not run")

    monkeypatch.setattr(parity.launching, "launch", launch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    (tmp_path / "run.yaml").write_text(json.dumps({"model": "model", "dataset": "train.jsonl"}))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    base = ["--config", "run.yaml", "--configs", "single,zero1", "--steps", "1"]

    assert parity.main([*base, "--output_dir", "mine"]) == 2 and not launched
    assert "--output_dir" in capsys.readouterr().err and os.listdir("mine") == ["notes.txt"]
    assert parity.main([*base, "--output_dir", "par", "--", "--packin"]) == 2 and not launched
    assert "did you mean --packing?" in capsys.readouterr().err
    for _ in range(2):  # again: the directory holds parity's runs
        assert parity.main([*base, "--output_dir", "par", "--", "--packing", "--seed=3"]) == 1
    assert len(launched) == 4 and {cwd for _, cwd in launched} == {tmp_path}
    single, zero1 = (cmd for cmd, _ in launched[:2])
    assert single[single.index("--config") :][:4] == ["--config", "run.yaml", "--packing", "--seed=3"]
    ds = Path(zero1[zero1.index("--deepspeed_config_file") + 1])
    assert ds.is_absolute() and ds == ROOT / "ds_configs" / "zero1.json"


def test_transformers_still_keeps_unused_conversions_under_zero3():
    """The reason for finetune.parallel.deepspeed.keep_used_weight_conversions: transformers' ZeRO-3 loading path
    keeps its whole weight mapping as the conversions save_pretrained reverts, used or not. When this fails, it
    keeps only the used ones (as convert_and_load_state_dict_in_model does): delete the workaround."""
    import inspect

    from transformers.integrations import deepspeed

    assert "model_to_load._weight_conversions = weight_mapping\n" in inspect.getsource(
        deepspeed._load_state_dict_into_zero3_model
    )


def test_zero3_fp16_checkpoints_before_the_first_update_and_resumes(assets, tmp_path):
    """A DeepSpeed JSON with fp16 whose loss scale starts too high (the opening steps skipped by the loss scaler) and,
    as accelerate config's default answer writes, stage3_gather_16bit_weights_on_model_save false. The step-2
    checkpoint comes before any update (the step-6 one after): it holds no Adam moments, as DDP's (asking DeepSpeed for them raised
    KeyError 'exp_avg' on both ranks); the gather is set true (else a ValueError at the first checkpoint, nothing
    saved), so final/ is the trained model; and 2 + resume + 4 steps == 6 steps, the loss scale included (a reset
    scale would skip more steps)."""
    import shutil

    from conftest import crash_after, edited_deepspeed_config

    def edit(ds: dict) -> None:
        ds["fp16"] = {"enabled": True, "initial_scale_power": 21, "loss_scale_window": 1000, "hysteresis": 1}
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
        # "none" offload devices, as accelerate config writes them: nothing offloaded (reported as offload_params True)
        ds["zero_optimization"] |= {"offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}}

    config = edited_deepspeed_config(tmp_path, "zero3", edit)
    args = base_args(assets.llama, assets.instruction, "--max_steps", "6", "--save_steps", "2", "--eval_fraction", "0")
    args += ["--per_device_train_batch_size", "2", "--learning_rate", "1e-3"]
    straight = finetune(tmp_path / "straight", *args, launcher=str(config))
    # the JSON's fp16 decides, and the start says so (it said "precision: no (mixed_precision auto ...)"); DeepSpeed's
    # own fp16 mode runs on CPU processes, unlike accelerate's fp16 (refused there: test_fp16_is_refused_on_a_cpu)
    assert "precision: fp16 (the DeepSpeed config" in straight.output and "mixed precision fp16," in straight.output
    rows = straight.train_rows
    assert not rows[-1]["offload_params"] and not rows[-1]["offload_optimizer"], rows[-1]
    skipped = [r["skipped_steps"] for r in rows]
    assert skipped[:2] == [1, 2] and skipped[-1] == skipped[-2] < 5, skipped  # the first ones skipped, then updates
    assert "stage3_gather_16bit_weights_on_model_save set true" in straight.output
    moments = {
        step: {
            k.split("/")[0]
            for k in load_file(str(straight.output_dir / f"checkpoints/step_{step}/portable/optimizer.safetensors"))
        }
        for step in (2, 6)
    }
    assert moments == {2: set(), 6: {"param", "exp_avg", "exp_avg_sq"}}, moments
    base = load_file(os.path.join(assets.llama, "model.safetensors"))
    final = load_file(str(straight.output_dir / "final" / "model.safetensors"))
    assert set(final) == set(base) and max_tensor_diff(final, base) > 1e-4  # trained, whole
    part = tmp_path / "resumed"
    shutil.copytree(straight.output_dir, part)
    crash_after(part, 2)
    resumed = finetune(part, *args, "--resume_from_checkpoint", "latest", launcher=str(config))
    assert "resumed from" in resumed.output
    assert resumed.losses() == straight.losses()
    assert max_tensor_diff(load_file(str(part / "final" / "model.safetensors")), final) == 0


def test_transformers_zero3_loading_still_ignores_mismatched_sizes():
    """The reason for finetune.parallel.deepspeed.zero3_loads_only_fitting_weights: under ZeRO-3 transformers loads
    through _load_state_dict_into_zero3_model, which never looks at ignore_mismatched_sizes and reports no mismatched
    keys. When this fails, transformers honours it there: delete the workaround."""
    import inspect

    from transformers import modeling_utils
    from transformers.integrations import deepspeed

    assert "ignore_mismatched_sizes" not in inspect.getsource(deepspeed._load_state_dict_into_zero3_model)
    assert "mismatched_keys=set()," in inspect.getsource(modeling_utils.PreTrainedModel._load_pretrained_model)


def test_zero3_starts_a_classifier_head_of_another_size_anew_as_one_process_does(assets, tmp_path):
    """A 2-label classifier checkpoint fine-tuned on the 4 topics: one process starts the head anew
    (ignore_mismatched_sizes); under ZeRO-3 every rank failed with "size mismatch for classifier.weight". Now ZeRO-3
    trains it, and its losses and final/ equal one process's."""
    from transformers import AutoModelForSequenceClassification

    two = tmp_path / "bert_2_labels"
    AutoModelForSequenceClassification.from_pretrained(assets.bert, num_labels=2).save_pretrained(two)
    assets.tokenizer.save_pretrained(two)
    args = ["--per_device_train_batch_size", "4", "--logging_steps", "1", "--max_seq_length", "32"]
    args += ["--max_steps", "2", "--save_steps", "null", "--eval_steps", "2", *classification_args(str(two), assets)]
    single = finetune(tmp_path / "single", *args, "--gradient_accumulation_steps", "2")  # ZeRO-3's global batch
    zero3 = finetune(tmp_path / "zero3", *args, launcher="zero3")
    assert "Traceback" not in zero3.output
    assert max_rel_diff(single.losses(), zero3.losses()) <= 1e-5
    weights = [load_file(str(r.output_dir / "final" / "model.safetensors")) for r in (single, zero3)]
    assert weights[0]["classifier.weight"].shape == (4, 64)
    assert max_tensor_diff(*weights) <= 1e-5


def test_the_cpu_adam_build_is_announced_when_deepspeeds_jit_will_compile_it(tmp_path, monkeypatch, capsys):
    """An offloaded optimizer's first step waits minutes for DeepSpeed to compile cpu_adam, saying nothing: rank 0
    says so, for an empty cache and for a build of other sources (torch's JIT rebuilds it: its build.ninja names them
    by path), not for a build of this DeepSpeed's, nor without offload."""
    import deepspeed

    from finetune.parallel.deepspeed import announce_op_builds

    cache = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    monkeypatch.setenv("LOCAL_RANK", "0")
    source = Path(deepspeed.__file__).parent / "ops" / "csrc" / "adam" / "cpu_adam.cpp"
    assert source.is_file(), source  # the path torch's build.ninja names (DeepSpeed's JIT builds from it)

    def said(config: str) -> bool:
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_configs" / config))
        capsys.readouterr()
        announce_op_builds()
        return "DeepSpeed compiles its CPU Adam" in capsys.readouterr().out

    assert said("zero3_offload.json") and said("zero2_offload.json")  # nothing built yet
    assert not said("zero3.json")
    build = cache / "cpu_adam"
    build.mkdir(parents=True)
    (build / "cpu_adam.so").write_bytes(b"")
    (build / "build.ninja").write_text(f"build cpu_adam.o: compile /elsewhere/venv/{source.name}\n")
    assert said("zero3_offload.json")  # another install's build: recompiled
    (build / "build.ninja").write_text(f"build cpu_adam.o: compile {source}\n")
    assert not said("zero3_offload.json")
    monkeypatch.setenv("LOCAL_RANK", "1")
    (build / "cpu_adam.so").unlink()
    assert not said("zero3_offload.json")  # rank 0 only
