"""Resume under another backend or world size, into and out of DeepSpeed:
ZeRO-3 (2 ranks) -> DDP (2 ranks) -> single process, and single -> ZeRO-3 -> ZeRO-1."""

from __future__ import annotations

import json

import pytest
from conftest import base_args, crash_after, finetune

pytestmark = pytest.mark.slow


def test_zero3_to_ddp_to_single_chain_continues_the_run(assets, tmp_path):
    args = base_args(
        assets.llama,
        assets.instruction,
        "--max_steps",
        "9",
        "--save_steps",
        "3",
        "--eval_fraction",
        "0.1",
        "--lr_scheduler_type",
        "cosine",
        "--warmup_steps",
        "2",
    )
    straight = finetune(tmp_path / "straight", *args, launcher="ddp")
    run = tmp_path / "chain"
    finetune(run, *args, launcher="zero3")
    crash_after(run, 3)
    via_ddp = finetune(run, *args, "--resume_from_checkpoint", "latest", launcher="ddp")
    assert "written by DEEPSPEED ZeRO-3 on 2 process(es), converted" in via_ddp.output
    crash_after(run, 6)
    last = finetune(
        run, *args, "--resume_from_checkpoint", "latest", "--gradient_accumulation_steps", "2", launcher="single"
    )
    assert "written by MULTI_CPU ZeRO-0 on 2 process(es), converted" in last.output
    rows = last.train_rows
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [r["distributed_type"] for r in rows] == ["DEEPSPEED"] * 3 + ["MULTI_CPU"] * 3 + ["NO"] * 3
    for a, b in zip(straight.losses(), last.losses()):
        assert abs(a - b) / abs(a) <= 1e-5, (straight.losses(), last.losses())
    assert [r["learning_rate"] for r in rows] == pytest.approx([r["learning_rate"] for r in straight.train_rows])
    assert last.eval_rows[-1]["eval_loss"] == pytest.approx(straight.eval_rows[-1]["eval_loss"], rel=1e-5)


def test_single_to_zero3_to_zero1_chain_continues_the_run(assets, tmp_path):
    """Into DeepSpeed: Adam's moments and step land in ZeRO's partitions (lazily created there). Without
    them the next step's update would be far off and the losses would part at the first resumed step."""
    args = base_args(
        assets.llama,
        assets.instruction,
        "--max_steps",
        "9",
        "--save_steps",
        "3",
        "--eval_fraction",
        "0.1",
        "--lr_scheduler_type",
        "cosine",
        "--warmup_steps",
        "2",
    )
    straight = finetune(tmp_path / "straight", *args, launcher="ddp")
    run = tmp_path / "chain"
    finetune(run, *args, "--gradient_accumulation_steps", "2", launcher="single")
    crash_after(run, 3)
    via_zero3 = finetune(run, *args, "--resume_from_checkpoint", "latest", launcher="zero3")
    assert "written by NO ZeRO-0 on 1 process(es), converted" in via_zero3.output
    crash_after(run, 6)
    last = finetune(run, *args, "--resume_from_checkpoint", "latest", launcher="zero1")
    assert "written by DEEPSPEED ZeRO-3 on 2 process(es), converted" in last.output
    rows = last.train_rows
    assert [r["step"] for r in rows] == list(range(1, 10))
    assert [r["distributed_type"] for r in rows] == ["NO"] * 3 + ["DEEPSPEED"] * 6
    for a, b in zip(straight.losses(), last.losses()):
        assert abs(a - b) / abs(a) <= 1e-5, (straight.losses(), last.losses())
    assert [r["learning_rate"] for r in rows] == pytest.approx([r["learning_rate"] for r in straight.train_rows])
    assert last.eval_rows[-1]["eval_loss"] == pytest.approx(straight.eval_rows[-1]["eval_loss"], rel=1e-5)


def test_into_offloaded_zero_with_uneven_partitions(assets, tmp_path):
    """DDP -> ZeRO-3 offload -> ZeRO-2 offload on a 3-class BERT classifier: the head's bias has 3
    elements, so 2 ranks hold partitions of unequal length, and offload steps DeepSpeedCPUAdam."""
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
    straight = finetune(tmp_path / "straight", *args, launcher="ddp")
    run = tmp_path / "chain"
    finetune(run, *args, launcher="ddp")
    crash_after(run, 2)
    finetune(run, *args, "--resume_from_checkpoint", "latest", launcher="zero3_offload")
    crash_after(run, 4)
    last = finetune(run, *args, "--resume_from_checkpoint", "latest", launcher="zero2_offload")
    assert "written by DEEPSPEED ZeRO-3 on 2 process(es), converted" in last.output
    assert [r["distributed_type"] for r in last.train_rows] == ["MULTI_CPU"] * 2 + ["DEEPSPEED"] * 4
    for a, b in zip(straight.losses(), last.losses()):
        assert abs(a - b) / abs(a) <= 1e-5, (straight.losses(), last.losses())
    assert last.eval_rows[-1]["eval_loss"] == pytest.approx(straight.eval_rows[-1]["eval_loss"], rel=1e-5)


def test_adapter_run_ddp_to_zero3_to_single(assets, tmp_path):
    """A LoRA classifier (adapter + the head PEFT trains in full): the base model is the run's own, the
    adapter's weights and moments come by name; under ZeRO-3 the head's copy is partitioned."""
    args = [
        "--model", assets.llama, "--task", "classification", "--dataset", assets.classification,
        "--eval_fraction", "0.1", "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1",
        "--per_device_train_batch_size", "4", "--max_seq_length", "32", "--learning_rate", "1e-2",
        "--peft.method", "lora", "--peft.r", "4", "--peft.alpha", "8",
    ]  # fmt: skip
    straight = finetune(tmp_path / "straight", *args, launcher="ddp")
    run = tmp_path / "chain"
    finetune(run, *args, launcher="ddp")
    crash_after(run, 2)
    finetune(run, *args, "--resume_from_checkpoint", "latest", launcher="zero3")
    crash_after(run, 4)
    last = finetune(
        run, *args, "--resume_from_checkpoint", "latest", "--gradient_accumulation_steps", "2", launcher="single"
    )
    assert "written by DEEPSPEED ZeRO-3 on 2 process(es), converted" in last.output
    assert [r["distributed_type"] for r in last.train_rows] == ["MULTI_CPU"] * 2 + ["DEEPSPEED"] * 2 + ["NO"] * 2
    for a, b in zip(straight.losses(), last.losses()):
        assert abs(a - b) / abs(a) <= 1e-5, (straight.losses(), last.losses())
    assert last.eval_rows[-1]["eval_loss"] == pytest.approx(straight.eval_rows[-1]["eval_loss"], rel=1e-5)


def test_resume_with_another_global_batch_is_refused(assets, tmp_path):
    args = base_args(assets.gpt2, assets.text, "--max_steps", "2", "--save_steps", "1", "--eval_fraction", "0")
    finetune(tmp_path / "run", *args, launcher="ddp")
    crash_after(tmp_path / "run", 1)
    res = finetune(tmp_path / "run", *args, "--resume_from_checkpoint", "latest", launcher="python", expect_ok=False)
    assert res.returncode == 2 and "global batch of 8" in res.output and "Traceback" not in res.output
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "trainer_state.json").read_text())
    assert state["layout"] == {
        "distributed_type": "MULTI_CPU",
        "world_size": 2,
        "zero_stage": 0,
        "tensor_parallel": 1,
        "global_batch_size": 8,
    }
