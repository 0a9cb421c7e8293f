"""Resume under another backend or world size, into and out of DeepSpeed and FSDP2:
ZeRO-3 -> FSDP2 -> DDP -> one process -> ZeRO-2 (2 ranks each but the one process)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import (
    Result,
    base_args,
    crash_after,
    finetune,
    generation_settings,
    max_rel_diff,
    max_tensor_diff,
    with_generation_settings,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def chain(tmp_path, args: list[str], legs: list[tuple[str, ...]], every: int):
    """The same run straight (under the first leg's layout) and as a chain of layouts: leg i (launcher, extra
    args...) resumes from the checkpoint at step i x `every`, as if the previous leg had died right after it. The
    first leg is the straight run itself up to its first checkpoint (a copy of its output directory).
    Returns the straight run and every leg's result."""
    first, *first_extra = legs[0]
    straight = finetune(tmp_path / "straight", *args, *first_extra, launcher=first)
    run = tmp_path / "chain"
    shutil.copytree(straight.output_dir, run)
    results = [Result(straight.returncode, straight.output, run)]
    for i, (launcher, *extra) in enumerate(legs[1:], start=1):
        crash_after(run, i * every)
        results.append(finetune(run, *args, *extra, "--resume_from_checkpoint", "latest", launcher=launcher))
    return straight, results


def assert_continues(straight, last) -> None:
    """The chained run's losses and final eval loss are the uninterrupted run's (1e-5 relative), and so are its
    exported weights (the whole model, or the adapter with what PEFT trains beside it: 1e-5 absolute)."""
    assert straight.losses(), "the uninterrupted run logged no losses"
    assert max_rel_diff(straight.losses(), last.losses()) <= 1e-5, (straight.losses(), last.losses())
    assert last.eval_rows[-1]["eval_loss"] == pytest.approx(straight.eval_rows[-1]["eval_loss"], rel=1e-5)
    want, got = final_weights(straight.output_dir), final_weights(last.output_dir)
    assert max_tensor_diff(want, got) <= 1e-5


def final_weights(out) -> dict:
    final = out / "final"
    adapter = final / "adapter_model.safetensors"
    return load_file(str(adapter if adapter.exists() else final / "model.safetensors"))


def test_chain_through_every_sharded_layout_continues_the_run(assets, tmp_path):
    """ZeRO-3 -> FSDP2 -> DDP -> one process -> ZeRO-2, 2 steps each, every leg resuming from the previous one's
    checkpoint: out of DeepSpeed into FSDP2 (DTensor shards set from full tensors by name), out of FSDP2 into DDP
    and into one process with the same global batch, and into ZeRO-2 (Adam's moments and step land in ZeRO's
    partitions, which DeepSpeed creates lazily; without them the next update would be far off and the losses
    would part at the first resumed step)."""
    args = base_args(
        assets.llama,
        assets.instruction,
        "--max_steps",
        "10",
        "--save_steps",
        "2",
        "--eval_fraction",
        "0.1",
        "--lr_scheduler_type",
        "cosine",
        "--warmup_steps",
        "2",
    )
    legs = [("zero3",), ("fsdp2",), ("ddp",), ("python", "--gradient_accumulation_steps", "2"), ("zero2",)]
    straight, results = chain(tmp_path, args, legs, every=2)
    written_by = [
        "DEEPSPEED ZeRO-3 on 2 process(es)",
        "FSDP FSDP2 on 2 process(es)",
        "MULTI_CPU on 2 process(es)",
        "NO on 1 process(es)",
    ]
    for leg, writer in zip(results[1:], written_by, strict=True):
        assert f"written by {writer}, converted" in leg.output, leg.output[-3000:]
    last = results[-1]
    rows = last.train_rows
    assert [r["step"] for r in rows] == list(range(1, 11))
    kinds = ["DEEPSPEED", "FSDP", "MULTI_CPU", "NO", "DEEPSPEED"]
    assert [r["distributed_type"] for r in rows] == [k for k in kinds for _ in range(2)]
    assert [r.get("zero_stage") for r in rows] == [3, 3] + [None] * 6 + [2, 2]
    assert_continues(straight, last)
    assert [r["learning_rate"] for r in rows] == pytest.approx([r["learning_rate"] for r in straight.train_rows])


def test_into_offloaded_zero_with_uneven_partitions(assets, tmp_path):
    """DDP -> FSDP2 -> ZeRO-3 offload on a 3-class BERT classifier: the head's bias has 3 elements, so 2 ranks hold
    shards and partitions of unequal length, and offload steps DeepSpeedCPUAdam. (BERT lists BertEmbeddings among
    its _no_split_modules: FSDP2's units leave it out, fsdp.wrap_classes.)"""
    rows = [json.loads(line) for line in open(assets.classification)]
    keep = sorted({r["label"] for r in rows})[:3]
    data = tmp_path / "three_classes.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows if r["label"] in keep))
    args = base_args(
        assets.bert,
        str(data),
        "--task",
        "classification",
        "--max_steps",
        "6",
        "--save_steps",
        "2",
        "--eval_fraction",
        "0.1",
    )
    straight, (_, fsdp, last) = chain(tmp_path, args, [("ddp",), ("fsdp2",), ("zero3_offload",)], every=2)
    assert "written by MULTI_CPU on 2 process(es), converted" in fsdp.output
    assert "written by FSDP FSDP2 on 2 process(es), converted" in last.output
    kinds = ["MULTI_CPU", "FSDP", "DEEPSPEED"]
    assert [r["distributed_type"] for r in last.train_rows] == [k for k in kinds for _ in range(2)]
    assert_continues(straight, last)


def test_adapter_run_ddp_to_zero3_to_single(assets, tmp_path):
    """A LoRA classifier (adapter + the head PEFT trains in full): the base model is the run's own, the
    adapter's weights and moments come by name; under ZeRO-3 the head's copy is partitioned."""
    args = [
        "--model", assets.llama, "--task", "classification", "--dataset", assets.classification,
        "--eval_fraction", "0.1", "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1",
        "--per_device_train_batch_size", "4", "--max_seq_length", "32", "--learning_rate", "1e-2",
        "--peft.method", "lora", "--peft.r", "4", "--peft.alpha", "8",
    ]  # fmt: skip
    straight, (*_, last) = chain(
        tmp_path, args, [("ddp",), ("zero3",), ("python", "--gradient_accumulation_steps", "2")], every=2
    )
    assert "written by DEEPSPEED ZeRO-3 on 2 process(es), converted" in last.output
    assert [r["distributed_type"] for r in last.train_rows] == ["MULTI_CPU"] * 2 + ["DEEPSPEED"] * 2 + ["NO"] * 2
    assert_continues(straight, last)


def test_a_window_open_at_a_tensor_parallel_checkpoint_continues_in_one_process(assets, tmp_path):
    """A TP 2 checkpoint between two log rows (rows every 3 steps, a checkpoint at step 2) resumed by one process:
    the open window's sums, which count each batch once per tensor-parallel replica, are counted as this run
    counts them, so the step-3 row (two steps of TP 2, one of one process) is the uninterrupted run's: its loss, and
    tokens_seen exactly (they had counted the carried steps twice). The model rebuilt from the checkpoint's
    config.json keeps the base model's generation settings: final/ has them. The model is a Qwen2 (examples/sft.yaml's
    family, tied as Qwen2.5-0.5B): its sharded q/k/v biases and plain norms are in AdamW groups of their own under TP
    (optim.build_optimizer), one no-decay group in one process; the moments go over by name."""
    from finetune import demo

    qwen2 = demo.build_model("qwen2", tmp_path / "qwen2", assets.tokenizer, tie_word_embeddings=True)
    base = with_generation_settings(qwen2, tmp_path / "base")
    args = base_args(base, assets.instruction, "--max_steps", "4", "--save_steps", "2", "--eval_fraction", "0")
    args += ["--logging_steps", "3"]
    straight, (_, resumed) = chain(tmp_path, args, [("tp2",), ("python",)], every=2)
    assert json.loads((straight.output_dir / "checkpoints" / "step_2" / "trainer_state.json").read_text())["window"]
    want, got = ({r["step"]: r for r in run.train_rows} for run in (straight, resumed))
    assert list(want) == list(got) == [3, 4], (want, got)
    assert got[3]["tokens_seen"] == want[3]["tokens_seen"] and got[4]["tokens_seen"] == want[4]["tokens_seen"]
    assert max_rel_diff([want[3]["loss"], want[4]["loss"]], [got[3]["loss"], got[4]["loss"]]) <= 1e-4, (want, got)
    assert generation_settings(resumed.output_dir / "final") == generation_settings(base)


def test_resume_with_another_global_batch_is_refused(assets, tmp_path):
    args = base_args(assets.gpt2, assets.text, "--max_steps", "2", "--save_steps", "1", "--eval_fraction", "0")
    finetune(tmp_path / "run", *args, launcher="ddp")
    crash_after(tmp_path / "run", 1)
    res = finetune(tmp_path / "run", *args, "--resume_from_checkpoint", "latest", launcher="python", expect_ok=False)
    assert res.returncode == 2 and "global batch of 8" in res.output and "Traceback" not in res.output
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "trainer_state.json").read_text())
    assert state["layout"] == {
        "family": "ddp",
        "distributed_type": "MULTI_CPU",
        "world_size": 2,
        "num_machines": 1,
        "dp": 2,
        "tp": 1,
        "pp": 1,
        "num_micro_batches": 1,
        "zero_stage": 0,
        "fsdp_version": 0,
        "offload_optimizer": False,
        "offload_params": False,
        "checkpoint_format": "full",
        "global_batch_size": 8,
    }


@pytest.mark.parametrize("portable", [True, False])
def test_rebuilt_adamw_step_and_schedule_leave_out_the_skipped_fp16_steps(monkeypatch, portable):
    """fp16: a step the loss scaler skipped steps neither AdamW nor the LR schedule (accelerate's scheduler does not
    step after a skipped optimizer step). Where a resume sets them by position (another layout; the same layout
    with a changed schedule), that position is the updates applied, step - skipped_steps, not the step."""
    from types import SimpleNamespace

    import torch

    from finetune import checkpoint

    net = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda position: position / 100)
    steps = []
    backend = SimpleNamespace(
        set_full_optimizer_state=lambda model, opt, state, step: steps.append(step), load_state=lambda path: None
    )
    accelerator = SimpleNamespace(unwrap_model=lambda model, keep_torch_compile=False: model)
    monkeypatch.setattr(
        checkpoint.Resume, "full_state", lambda self: {n: {"param": p.detach()} for n, p in net.named_parameters()}
    )
    saved = {"step": 10, "skipped_steps": 3, "layout": {}}
    changes = [] if portable else [("learning_rate", 0.5, 1.0)]
    resume = checkpoint.Resume("step_10", saved, portable=portable, changes=changes)
    plan = SimpleNamespace(scheduler_position=lambda step: step)  # one process: one scheduler step per update
    checkpoint.restore(accelerator, backend, net, optimizer, scheduler, plan, resume, learning_rate=1.0)
    assert steps == ([7] if portable else [])
    assert scheduler.last_epoch == 7 and scheduler.get_last_lr() == [pytest.approx(0.07)]
