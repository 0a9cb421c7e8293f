"""bf16 as GPU users run it, on CPU processes: every layout against one process in bf16, the exported dtype, fp16's
refusal on a CPU, bf16 weights, LoRA on a bf16 base.

Tolerances in bf16 (docs/precision.md says why): per-step losses within 3e-3 relative of one bf16 process (below
bf16's unit roundoff 2^-8 = 3.9e-3), and the training update (final weights minus the base's) within 6% in L2 of
one bf16 process's (one process in bf16 against the same in fp32 moves it by 24% on this model, 4.5% on a 7.5M one).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import EXPECTED, ROOT, Result, assert_layout, base_args, finetune, max_rel_diff, run_killing_the_group
from safetensors.torch import load_file

pytestmark = pytest.mark.xdist_group("precision")  # one worker: the bf16 layouts fixture (about 3 minutes) runs once

LOSS_RTOL = 3e-3
UPDATE_RTOL = 0.06
# Every layout of the promise, with the distributed type and world size each must come up as. By default not ZeRO-1
# (ZeRO-2's bf16 path without gradient partitioning), ZeRO-2 and FSDP2 with offload (ZeRO-3 offload's CPU optimizer
# runs): FINETUNE_CONFIG_GRID=1 runs them too (about a minute of a 2-core machine; suite time).
LAYOUTS = {name: facts[:2] for name, facts in EXPECTED.items()}
if not os.environ.get("FINETUNE_CONFIG_GRID"):
    LAYOUTS = {
        name: facts for name, facts in LAYOUTS.items() if name not in ("zero1", "zero2_offload", "fsdp2_offload")
    }


def train_rows(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "loss" in r]


def assert_ran_in(rows: list[dict], dtype: str) -> None:
    """The run computed in `dtype`, as observed from its model (a Linear layer's output in the first forward)."""
    assert rows, "no train rows"
    seen = {r.get("compute_dtype") for r in rows}
    assert seen == {dtype}, f"compute dtype observed {seen}, expected {dtype}"


def update_distance(final: dict, reference: dict, base: dict) -> float:
    """|| final - reference || / || reference - base ||: how much two runs' training updates differ (L2)."""
    assert final and set(final) == set(reference), set(final) ^ set(reference)
    num = sum(((final[k].float() - reference[k].float()) ** 2).sum() for k in final) ** 0.5
    den = sum(((reference[k].float() - base[k].float()) ** 2).sum() for k in final) ** 0.5
    assert den > 0, "the reference did not train"
    return float(num / den)


@pytest.fixture(scope="module")
def bf16_runs(assets, tmp_path_factory):
    """`finetune parity --mixed_precision bf16` over every single-machine layout, 6 steps, global batch 8 (and
    one fp32 process of the same run: how far bf16 itself moves a run)."""
    tmp = tmp_path_factory.mktemp("bf16")
    run = tmp / "run.yaml"
    values = {
        "model": assets.llama,
        "dataset": assets.instruction,
        "max_seq_length": 64,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "eval_fraction": 0,
        "curves": False,
    }
    run.write_text(json.dumps(values))
    out = tmp / "parity"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "finetune", "parity", "--config", str(run), "--steps", "6", "--output_dir", str(out)]
    proc = run_killing_the_group(
        [
            *cmd,
            "--mixed_precision",
            "bf16",
            "--configs",
            ",".join(LAYOUTS),
            "--loss_rtol",
            "1",
            "--weight_atol",
            "1",
            "--update_rtol",
            "1",
        ],
        env,
        1200,
    )
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    fp32 = run_killing_the_group([*cmd, "--configs", "single", "--output_dir", str(tmp / "fp32")], env, 300)
    assert fp32.returncode == 0, fp32.stdout[-3000:] + fp32.stderr[-3000:]
    return out, tmp / "fp32" / "single"


def test_bf16_every_layout_equals_one_bf16_process(assets, bf16_runs):
    out, fp32 = bf16_runs
    base = load_file(os.path.join(assets.llama, "model.safetensors"))
    ref_rows = train_rows(out / "single")
    ref = load_file(str(out / "single" / "final" / "model.safetensors"))
    assert_ran_in(ref_rows, "bfloat16")
    bf16_vs_fp32 = update_distance(ref, load_file(str(fp32 / "final" / "model.safetensors")), base)
    assert bf16_vs_fp32 > 3 * UPDATE_RTOL  # bf16 really changed the run: the tolerance is well below its effect
    table = []
    for name, (dist_type, world) in LAYOUTS.items():
        rows = train_rows(out / name)
        assert len(rows) == 6, name
        assert {(r["distributed_type"], r["world_size"]) for r in rows} == {(dist_type, world)}, name
        if name in EXPECTED:  # its ZeRO stage, offload, FSDP version and parameter share too
            assert_layout(rows, name)
        assert_ran_in(rows, "bfloat16")
        # the start line says it too (under DeepSpeed accelerate's own answer is "no" once bf16 runs through autocast)
        assert "mixed precision bf16, devices" in (out / name / "logs" / "rank0.log").read_text(), name
        final = out / name / "final"
        weights = load_file(str(final / "model.safetensors"))
        # one export dtype under every layout: the base model's (float32 here), in the file and in config.json
        assert {v.dtype for v in weights.values()} == {torch.float32}, name
        assert json.loads((final / "config.json").read_text())["dtype"] == "float32", name
        loss = max_rel_diff([r["loss"] for r in ref_rows], [r["loss"] for r in rows])
        update = update_distance(weights, ref, base)
        table.append((name, loss, update))
        assert loss <= LOSS_RTOL, (name, loss)
        assert update <= UPDATE_RTOL, (name, update)
    print("\n".join(f"{n:<14} loss {loss:.2e}  update {u:.3f}" for n, loss, u in table))
    # fp32 weights everywhere: autocast (DeepSpeed's torch_autocast too) or FSDP2's bf16 copies for compute
    for name in LAYOUTS:
        held = train_rows(out / name)[-1]["weights_dtype"]
        assert held == "float32", (name, held)


def test_an_fp32_fallback_fails_the_bf16_check(bf16_runs):
    """The check the layouts pass must catch a run that silently trained in fp32."""
    _, fp32 = bf16_runs
    rows = train_rows(fp32)
    assert {r["compute_dtype"] for r in rows} == {"float32"}
    with pytest.raises(AssertionError, match="compute dtype observed"):
        assert_ran_in(rows, "bfloat16")


def test_two_loopback_machines_in_bf16_equal_one_process(assets, tmp_path, bf16_runs):
    """mixed_precision from the run config (the launcher says nothing): two machines x 1 process on 127.0.0.1."""
    import conftest

    out, _ = bf16_runs
    args = base_args(assets.llama, assets.instruction, "--max_steps", "6", "--eval_fraction", "0")
    args += ["--mixed_precision", "bf16", "--gradient_accumulation_steps", "1", "--save_steps", "null"]
    shared = tmp_path / "run"
    ran = conftest.two_machines(
        "multinode_ddp", lambda m: ["--output_dir", str(shared), "--disable_tqdm", "true", *args], timeout=300
    )
    assert all(code == 0 for code, _ in ran), "\n\n".join(o[-3000:] for _, o in ran)
    assert "distributed: MULTI_CPU, world size 2," in ran[0][1]
    rows = Result(0, ran[0][1], shared).train_rows
    assert_ran_in(rows, "bfloat16")
    assert max_rel_diff([r["loss"] for r in train_rows(out / "single")], [r["loss"] for r in rows]) <= LOSS_RTOL
    base = load_file(os.path.join(assets.llama, "model.safetensors"))
    ref = load_file(str(out / "single" / "final" / "model.safetensors"))
    assert update_distance(load_file(str(shared / "final" / "model.safetensors")), ref, base) <= UPDATE_RTOL


def test_fsdp2_policy_keeps_the_loss_in_fp32(assets, tmp_path):
    """FSDP2 in bf16: the loss a forward returns is fp32 with finetune's policy; accelerate's own policy casts it to
    bf16 (the quantized losses the issue saw). One process, a real fully_shard on a gloo group of 1."""
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from finetune.parallel.fsdp import mixed_precision_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # one rank: its store binds a port the OS picks
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        plugin.set_mixed_precision("bf16")  # what accelerate does under --mixed_precision bf16
        ids = torch.randint(3, 500, (2, 16))
        losses = {}
        for name, policy in (
            ("accelerate", plugin.mixed_precision_policy),
            ("finetune", mixed_precision_policy("bf16")),
        ):
            net = AutoModelForCausalLM.from_pretrained(assets.llama)
            fully_shard(net, mp_policy=policy)
            losses[name] = net(input_ids=ids, labels=ids).loss
        assert losses["accelerate"].dtype == torch.bfloat16  # why the policy is ours
        assert losses["finetune"].dtype == torch.float32
        assert abs(losses["finetune"].item() - losses["accelerate"].item()) < 0.05
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["launcher", "run_config"])
def test_fp16_is_refused_on_a_cpu(assets, tmp_path, how):
    args = base_args(assets.llama, assets.instruction, "--max_steps", "2")
    if how == "launcher":
        # (ddp: one process under accelerate launch ends in the launcher's own traceback, issue 34)
        res = finetune(
            tmp_path / "out", *args, launcher="ddp", launch_args=("--mixed_precision", "fp16"), expect_ok=False
        )
    else:
        res = finetune(tmp_path / "out", *args, "--mixed_precision", "fp16", launcher="python", expect_ok=False)
    assert res.returncode == 2, res.output[-3000:]
    assert "mixed_precision: fp16 needs a GPU" in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def bf16_base(assets, tmp_path, source: str | None = None):
    """The tiny Llama (or source) saved in bfloat16, as most Hub models ship."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "llama_bf16"
    AutoModelForCausalLM.from_pretrained(source or assets.llama, dtype=torch.bfloat16).save_pretrained(path)
    assets.tokenizer.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    return str(path)


def test_save_dtype_auto_is_the_base_models_and_can_be_set(assets, tmp_path):
    """save_dtype auto: a bf16 base trained with fp32 master weights (torch_dtype float32) exports bf16; set, it
    wins; the file, config.json and the model card agree. The base ties its LM head to its input embeddings: the
    cast keeps them one tensor (before, the bf16 export held a second copy as lm_head.weight)."""
    base = bf16_base(assets, tmp_path, assets.llama_tied)
    args = base_args(base, assets.instruction, "--max_steps", "2", "--eval_fraction", "0")
    auto = finetune(tmp_path / "auto", *args, launcher="python")
    fp32 = finetune(tmp_path / "fp32", *args, "--save_dtype", "float32", launcher="python")
    for res, want in ((auto, torch.bfloat16), (fp32, torch.float32)):
        final = res.output_dir / "final"
        assert {v.dtype for v in load_file(str(final / "model.safetensors")).values()} == {want}
        name = str(want).removeprefix("torch.")
        assert json.loads((final / "config.json").read_text())["dtype"] == name
        assert f"saved in: {name}" in (final / "README.md").read_text()
    a, b = (load_file(str(r.output_dir / "final" / "model.safetensors")) for r in (auto, fp32))
    assert set(a) == set(b) == set(load_file(os.path.join(base, "model.safetensors")))  # no lm_head.weight
    assert all(torch.equal(a[k], b[k].to(torch.bfloat16)) for k in a)  # one cast of the same fp32 weights


def test_lora_on_a_bf16_base_without_mixed_precision(assets, tmp_path):
    """The common memory saver: a bf16 base (torch_dtype bfloat16), LoRA, no mixed precision. merged/ is written in
    the run's save_dtype (float32 here), in the run and by a later `finetune merge` (which wrote the base's bf16:
    it ignored the run's save_dtype); `finetune merge --dtype auto` writes the base's own dtype."""
    from finetune.commands import merge

    base = bf16_base(assets, tmp_path)
    args = base_args(base, assets.instruction, "--max_steps", "4", "--eval_fraction", "0", "--learning_rate", "1e-2")
    args += ["--torch_dtype", "bfloat16", "--peft.method", "lora", "--peft.merge", "true", "--save_dtype", "float32"]
    res = finetune(tmp_path / "out", *args)
    rows = res.train_rows
    assert_ran_in(rows, "bfloat16")
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "weights in place" not in res.output  # LoRA keeps its adapter weights in fp32: no warning
    final = res.output_dir / "final"
    assert merge.main([str(final), "--output", str(tmp_path / "later")]) == 0
    assert merge.main([str(final), "--output", str(tmp_path / "base_dtype"), "--dtype", "auto"]) == 0
    original = load_file(os.path.join(base, "model.safetensors"))
    for merged_dir, want in ((final / "merged", torch.float32), (tmp_path / "later", torch.float32)):
        merged = load_file(str(merged_dir / "model.safetensors"))
        assert {v.dtype for v in merged.values()} == {want}, merged_dir
    as_base = load_file(str(tmp_path / "base_dtype" / "model.safetensors"))
    assert {v.dtype for v in as_base.values()} == {torch.bfloat16}
    assert all(torch.equal(as_base[k], merged[k].to(torch.bfloat16)) for k in as_base)  # one merge, two casts
    assert any(not torch.equal(as_base[k], original[k]) for k in original if k in as_base)


def test_full_fine_tuning_of_bf16_weights_is_warned(assets, tmp_path):
    args = base_args(assets.llama, assets.instruction, "--max_steps", "1", "--eval_fraction", "0")
    res = finetune(tmp_path / "out", *args, "--torch_dtype", "bfloat16", launcher="python")
    assert "updating bfloat16 weights in place, with no fp32 master weights" in res.output
    assert_ran_in(res.train_rows, "bfloat16")


def test_shipped_configs_leave_precision_to_finetune():
    """No shipped Accelerate config pins mixed_precision: accelerate passes 'no' for both 'no' and nothing, so a
    pinned 'no' would hide the run config's auto (bf16 on a GPU) from GPU users."""
    import yaml

    for path in sorted((ROOT / "accelerate_configs").glob("*.yaml")):
        assert "mixed_precision" not in (yaml.safe_load(path.read_text()) or {}), path.name


def test_accelerate_still_says_no_for_nothing():
    """Why finetune reads the launch command itself (environment.launcher_mixed_precision): accelerate's launcher
    turns 'nothing said' into ACCELERATE_MIXED_PRECISION=no, as if fp32 had been asked for. Fails once it does not."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    argv = ["--config_file", str(ROOT / "accelerate_configs" / "single.yaml"), "-m", "finetune"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    assert args.mixed_precision == "no"


def fp16_overflow_step(optimizer, params: list) -> tuple[bool, bool]:
    """One fp16 step through accelerate's optimizer wrapper and torch's loss scaler (on the CPU, as on a GPU) whose
    gradients overflow: (whether accelerate says it was skipped, whether the weights stayed as they were)."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState

    Accelerator(cpu=True)  # the state the wrapper reads (this process's singletons: reset below)
    try:
        scaler = torch.amp.GradScaler("cpu")
        wrapped = AcceleratedOptimizer(optimizer, device_placement=False, scaler=scaler)
        before = [p.detach().clone() for p in params]
        scaler.scale(sum(p.sum() for p in params) * float("inf")).backward()
        wrapped.step()
        return wrapped.step_was_skipped, all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerate_still_misses_a_fused_optimizers_skipped_step():
    """Why optim.build_optimizer takes the foreach AdamW under fp16 (huggingface/accelerate#4242): the loss scaler
    calls a fused optimizer's step even on an overflow (its kernel skips the update), and accelerate takes the call
    for a step: step_was_skipped is False though the weights did not move. Fails once accelerate sees the skip.
    finetune's optimizer under fp16 is seen skipping; under bf16 it is the fused one."""
    from finetune.config import TrainArgs
    from finetune.optim import build_optimizer

    net = torch.nn.Linear(4, 4)
    fused = torch.optim.AdamW(net.parameters(), fused=True)
    assert fp16_overflow_step(fused, list(net.parameters())) == (False, True)  # skipped, and not said
    assert build_optimizer(net, TrainArgs(), "bf16").defaults["fused"]
    finetunes = build_optimizer(net, TrainArgs(), "fp16")
    assert not finetunes.defaults["fused"]
    assert fp16_overflow_step(finetunes, list(net.parameters())) == (True, True)


@pytest.mark.parametrize(
    "launch, file_line, want",
    [
        (("--mixed_precision", "no"), None, "float32"),  # an explicit no on the launch line wins
        ((), "mixed_precision: 'no'", "float32"),  # so does one in the Accelerate config file
    ],
)
def test_the_launch_command_wins_over_the_run_config(assets, tmp_path, launch, file_line, want):
    config = tmp_path / "single.yaml"
    config.write_text(
        (ROOT / "accelerate_configs" / "single.yaml").read_text() + (f"{file_line}\n" if file_line else "")
    )
    args = base_args(assets.llama, assets.instruction, "--max_steps", "1", "--eval_fraction", "0")
    res = finetune(tmp_path / "out", *args, "--mixed_precision", "bf16", launcher=str(config), launch_args=launch)
    assert_ran_in(res.train_rows, want)


def test_deepspeed_bf16_mode_exports_its_fp32_masters_and_resumes(assets, tmp_path):
    """A DeepSpeed JSON that enables bf16 itself keeps DeepSpeed's bf16 mode (bf16 weights, fp32 masters; ZeRO-1 then
    accumulates in fp32 through DeepSpeed's BF16_Optimizer): final/ is written from the fp32 masters (the same
    dtype as every layout's, within the tolerance of one bf16 process), and 4 steps == 2 + resume + 2, under ZeRO-1
    itself and converted into DDP (the masters and Adam state by name, portable/)."""
    import shutil

    from conftest import crash_after, edited_deepspeed_config

    config = edited_deepspeed_config(tmp_path, "zero1", lambda ds: ds.update(bf16={"enabled": True}))
    args = base_args(assets.llama, assets.instruction, "--max_steps", "4", "--save_steps", "2", "--eval_fraction", "0")
    args += ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2"]
    bf16 = ("--mixed_precision", "bf16")
    straight = finetune(tmp_path / "straight", *args, launcher=str(config), launch_args=bf16)
    assert "bf16_optimizer" in straight.output, straight.output[-3000:]  # DeepSpeed's own bf16 mode
    rows = straight.train_rows
    assert_ran_in(rows, "bfloat16")
    assert {r["weights_dtype"] for r in rows} == {"bfloat16"} and rows[-1]["distributed_type"] == "DEEPSPEED"
    single = finetune(tmp_path / "single", *args, launcher="single", launch_args=bf16)
    base = load_file(os.path.join(assets.llama, "model.safetensors"))
    final = load_file(str(straight.output_dir / "final" / "model.safetensors"))
    assert {v.dtype for v in final.values()} == {torch.float32}  # the masters, not the bf16 copy
    assert any((v.float() - v.bfloat16().float()).abs().max() > 0 for v in final.values())
    # DeepSpeed's bf16 mode (bf16 weights, norms and residual stream) moves this model's update about as far as bf16
    # moves it against fp32 (24%): why finetune runs DeepSpeed under autocast unless the JSON asks for this mode
    assert update_distance(final, load_file(str(single.output_dir / "final" / "model.safetensors")), base) <= 0.35
    for layout in (str(config), "ddp"):
        part = tmp_path / Path(layout).stem
        shutil.copytree(straight.output_dir, part)
        crash_after(part, 2)
        resumed = finetune(part, *args, "--resume_from_checkpoint", "latest", launcher=layout, launch_args=bf16)
        assert "resumed from" in resumed.output
        rows = resumed.train_rows
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        tol = 1e-6 if layout == str(config) else 2e-2  # DDP computes under autocast with fp32 weights
        assert max_rel_diff(straight.losses()[2:], [r["loss"] for r in rows[2:]]) <= tol, layout


GENERATION_PROBE = """
import json, os, sys
import torch
import finetune.generate as generate
from finetune.cli import run_cli

seen, inner = set(), generate.GenerationEval._generate

def probed(self, run, chunk):
    net = run.backend.hf_model(run.model)
    linear = next(m for m in net.modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_hook(lambda m, i, o: seen.add(str(o.dtype).removeprefix("torch.")))
    try:
        return inner(self, run, chunk)
    finally:
        hook.remove()

generate.GenerationEval._generate = probed
sys.argv[0] = "finetune"
code = run_cli()
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(sorted(seen), f)
os._exit(code)
"""


def test_a_mixed_precision_line_in_a_deepspeed_config_trains_and_generates_in_bf16(assets, tmp_path):
    """`mixed_precision: bf16` in a ZeRO-2 Accelerate config (its own comment says the line wins) crashed every rank in
    accelerate's DeepSpeedPlugin ("the following accelerate config variables will be ignored"); it trains in bf16 as
    `--mixed_precision bf16` does, the start line says bf16 (it said "no": accelerate's answer once bf16 runs through
    DeepSpeed's autocast), and generation eval computes in bf16 as training does (it ran the module outside the
    engine's autocast: fp32). A Linear layer's outputs during generate, seen by a probe on every rank."""
    config = tmp_path / "zero2_bf16.yaml"
    config.write_text((ROOT / "accelerate_configs" / "zero2.yaml").read_text() + "mixed_precision: bf16\n")
    probe, script = tmp_path / "probe", tmp_path / "generation_probe.py"
    probe.mkdir()
    script.write_text(GENERATION_PROBE)
    args = base_args(assets.llama, assets.instruction, "--max_steps", "1", "--eval_fraction", "0.05")
    args += ["--generation_max_new_tokens", "2", "--generation_num_examples", "2"]
    res = finetune(
        tmp_path / "out", *args, launcher=str(config), entry=(str(script),), extra_env={"PROBE_DIR": str(probe)}
    )
    assert "Traceback" not in res.output
    assert "distributed: DEEPSPEED, world size 2, backend gloo, mixed precision bf16," in res.output, res.output[-3000:]
    assert_ran_in(res.train_rows, "bfloat16")
    seen = {p.name: json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))}
    assert seen == {"rank0.json": ["bfloat16"], "rank1.json": ["bfloat16"]}, seen


def test_accelerate_still_refuses_a_mixed_precision_line_beside_a_deepspeed_json(monkeypatch):
    """Why finetune.parallel.deepspeed.precision_from_the_launcher_as_from_its_flag drops mixed_precision from the
    launcher's ACCELERATE_CONFIG_DS_FIELDS: accelerate's DeepSpeedPlugin refuses it beside a deepspeed_config_file.
    Fails once accelerate takes the line as it takes the flag."""
    from accelerate.utils import DeepSpeedPlugin

    from finetune.parallel.deepspeed import precision_from_the_launcher_as_from_its_flag

    # what `accelerate launch` gives the ranks for zero2.yaml with a mixed_precision line
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,zero3_init_flag,mixed_precision")
    json_file = str(ROOT / "ds_configs" / "zero2.json")
    with pytest.raises(ValueError, match="following accelerate config variables will be ignored"):
        DeepSpeedPlugin(hf_ds_config=json_file)
    precision_from_the_launcher_as_from_its_flag(os.environ)
    assert os.environ["ACCELERATE_CONFIG_DS_FIELDS"] == "deepspeed_config_file,zero3_init_flag"
    DeepSpeedPlugin(hf_ds_config=json_file)


def test_a_deepspeed_json_contradicting_the_launch_precision_is_refused(assets, tmp_path):
    """A JSON enabling fp16 and a launch asking for bf16: accelerate's DeepSpeedPlugin raised a ValueError on every
    rank; refused before anything starts, naming both and the fix (finetune plan asks the same)."""
    from finetune.config import build_config
    from finetune.parallel import deepspeed

    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["fp16"] = {"enabled": True}
    (tmp_path / "fp16.json").write_text(json.dumps(ds))
    cfg = build_config({"model": assets.llama, "dataset": assets.instruction}, check_filesystem=False)
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(tmp_path / "fp16.json"),
        "WORLD_SIZE": "2",
    }
    assert not deepspeed.problems(cfg, {**env, "ACCELERATE_MIXED_PRECISION": "fp16"}, here=False)
    [(key, why)] = deepspeed.problems(cfg, {**env, "ACCELERATE_MIXED_PRECISION": "bf16"}, here=False)
    assert key == "mixed_precision" and "enables fp16 but the run asks for bf16" in why, why


def test_zero3_holds_16bit_weights_in_fp32_says_so_and_plans_for_it(assets):
    """Under ZeRO-3 zero.Init builds every parameter in the DeepSpeed config's dtype: fp32 outside DeepSpeed's own
    16-bit modes (bf16 runs through autocast), whatever torch_dtype says (a LoRA on a bf16 base held float32 under
    ZeRO-3 only). The start log says so (deepspeed.zero3_weights_dtype_note, from the partitions' dtype), and
    finetune plan counts 4 bytes per weight there (it counted 2), 2 in DeepSpeed's bf16 mode, and torch_dtype's
    under ZeRO-2."""
    from finetune import memory
    from finetune.parallel import sharding, topology
    from finetune.parallel.deepspeed import zero3_weights_dtype_note

    net = torch.nn.Linear(2, 2).requires_grad_(False)
    for p in net.parameters():
        p.ds_tensor = torch.zeros(1)  # a ZeRO-3 partition, in fp32
    assert "ZeRO-3 holds the weights in float32, not torch_dtype bfloat16" in zero3_weights_dtype_note(
        net, torch.bfloat16
    )
    assert zero3_weights_dtype_note(net, torch.float32) is None
    for p in net.parameters():
        p.ds_tensor = torch.zeros(1, dtype=torch.bfloat16)
    assert zero3_weights_dtype_note(net, torch.bfloat16) is None

    from finetune.config import build_config

    values = {"model": assets.llama, "dataset": "(unused)", "torch_dtype": "bfloat16"}
    shape = memory.shape_from_config(build_config(values, check_filesystem=False))
    assert shape.weight_bytes == 2
    for name, bf16_mode, want in (("zero3", False, 4), ("zero3", True, 2), ("zero2", False, 2)):
        topo, _, _ = topology.read_config_file(ROOT / "accelerate_configs" / f"{name}.yaml", num_processes=1)
        for mixed in ("no", "bf16"):
            parts = sharding.model_states(topo, shape, mixed, sharding.Buckets(bf16_weights=bf16_mode))
            held = sum(x.bytes for x in parts if x.name == "parameters")
            if mixed == "bf16" or not bf16_mode:
                assert held == pytest.approx(shape.total * want), (name, bf16_mode, mixed)
