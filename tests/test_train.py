"""Integration: real runs of tiny models through the user's entry points, asserting equivalences."""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    ROOT,
    base_args,
    classification_args,
    crash_after,
    finetune,
    max_rel_diff,
    max_weight_diff,
    reevaluate,
)

pytestmark = pytest.mark.slow


def test_length_aware_batching_changes_speed_not_the_run(assets, tmp_path):
    """length_aware_batching reshapes each global batch's micro batches (less padding) but keeps its
    examples: the losses equal fixed-size batching's to rounding; 2x1 equals 1x2 and ZeRO-2; resume is exact.
    (Fixed-size batching runs as 1x2: 2x1 gives it the same micro batches, test_two_ranks_equal_one_rank_...)"""
    import random

    rng = random.Random(0)
    words = "the cat sat on a mat while rain fell over green hills and quiet towns".split()
    rows = [
        {"prompt": f"tell me {k}", "response": " ".join(rng.choices(words, k=rng.randint(0, 24)))} for k in range(80)
    ]
    data = tmp_path / "varied.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = base_args(assets.llama, str(data), "--max_steps", "6", "--eval_fraction", "0", "--save_steps", "3")
    fixed = finetune(tmp_path / "fixed", *args, "--gradient_accumulation_steps", "2")
    aware = [*args, "--length_aware_batching", "true"]
    ddp = finetune(tmp_path / "ddp", *aware, launcher="ddp")
    assert "length-aware batching: each global batch of 8 rows split into 2 micro batches" in ddp.output
    one = finetune(tmp_path / "one", *aware, "--gradient_accumulation_steps", "2")
    assert [r["tokens_seen"] for r in ddp.train_rows] == [r["tokens_seen"] for r in fixed.train_rows]
    assert max_rel_diff(fixed.losses(), ddp.losses()) <= 1e-5
    assert max_rel_diff(ddp.losses(), one.losses()) <= 1e-5
    zero2 = finetune(tmp_path / "zero2", *aware, launcher="zero2")  # DeepSpeed wants a fixed micro batch size
    assert max_rel_diff(ddp.losses(), zero2.losses()) <= 1e-5
    pad = [sum(r["padding_fraction"] for r in run.train_rows) for run in (fixed, ddp)]
    assert pad[1] < pad[0], pad
    crash_after(ddp.output_dir, 3)
    resumed = finetune(ddp.output_dir, *aware, "--resume_from_checkpoint", "latest", launcher="ddp")
    assert resumed.losses() == ddp.losses()


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (10, 10), (4, 7)])
def test_schedules_equal_transformers(kind, warmup, total):
    """finetune's schedules (no transformers.optimization import at start-up) are transformers' own."""
    from transformers import get_scheduler

    from finetune.optim import build_scheduler

    def lrs(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = make(opt)
        out = []
        for _ in range(total + 2):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    ours = lrs(lambda opt: build_scheduler(opt, kind, warmup, total))
    theirs = lrs(lambda opt: get_scheduler(kind, opt, num_warmup_steps=warmup, num_training_steps=total))
    assert ours == pytest.approx(theirs, abs=1e-12)


def test_two_ranks_equal_one_rank_with_accumulation_dropout_on(assets, tmp_path):
    """2 processes x GA 1 == 1 process x GA 2: same data, same per-step loss, same update, same eval, even
    with dropout on (masks are seeded by the data position, not the rank layout)."""
    from finetune import demo

    model = demo.build_model("gpt2", tmp_path / "gpt2_dropout", assets.tokenizer, resid_pdrop=0.1, embd_pdrop=0.1)
    args = base_args(model, assets.text, "--max_steps", "8", "--eval_fraction", "0.1")
    ddp = finetune(tmp_path / "ddp", *args, "--gradient_accumulation_steps", "1", launcher="ddp")
    one = finetune(tmp_path / "one", *args, "--gradient_accumulation_steps", "2")
    assert len(ddp.losses()) == 8
    assert "Setting accelerator to CPU" not in ddp.output  # no DeepSpeed import outside DeepSpeed runs
    assert max_rel_diff(ddp.losses(), one.losses()) <= 1e-5
    assert max_rel_diff([r["grad_norm"] for r in ddp.train_rows], [r["grad_norm"] for r in one.train_rows]) <= 1e-4
    assert [r["tokens_seen"] for r in ddp.train_rows] == [r["tokens_seen"] for r in one.train_rows]
    assert max_weight_diff(ddp.output_dir / "final", one.output_dir / "final") <= 1e-5
    assert ddp.eval_rows[-1]["eval_loss"] == pytest.approx(one.eval_rows[-1]["eval_loss"], rel=1e-5)


def test_resume_equals_uninterrupted(assets, tmp_path):
    """4 steps straight == 2 steps + resume + 2 steps, losses and final weights (CPU, fp32)."""
    args = base_args(
        assets.llama,
        assets.chat,
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--eval_fraction",
        "0.1",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--num_train_epochs",
        "1",
        "--lr_scheduler_type",
        "cosine",
        "--warmup_steps",
        "1",
    )
    straight = finetune(tmp_path / "straight", *args)
    part = tmp_path / "resumed"
    # The same run, "crashed" right after its step-2 checkpoint (a shorter max_steps would change the schedule).
    shutil.copytree(straight.output_dir, part)
    crash_after(part, 2)
    resumed = finetune(part, *args, "--resume_from_checkpoint", "latest")
    assert "resumed from" in resumed.output
    assert [r["step"] for r in resumed.train_rows] == [1, 2, 3, 4]  # log continued, not duplicated
    assert max_rel_diff(resumed.losses(), straight.losses()) <= 1e-6
    assert max_weight_diff(straight.output_dir / "final", part / "final") <= 1e-6


def test_resume_between_two_log_rows_continues_the_open_window(assets, tmp_path):
    """A checkpoint between two log rows (save_steps 2, logging_steps 3): each checkpoint counts the tokens of every
    step up to it, and the resumed run's rows are the uninterrupted run's, the first one over its whole window
    (the steps before the checkpoint too): loss, tokens_seen, padding_fraction, grad_norm."""
    args = base_args(
        assets.llama, assets.instruction, "--max_steps", "6", "--logging_steps", "3", "--save_steps", "2",
        "--eval_fraction", "0",
    )  # fmt: skip
    straight = finetune(tmp_path / "straight", *args)
    every_step = finetune(tmp_path / "every_step", *args, "--logging_steps", "1", "--save_steps", "null")
    seen = {r["step"]: r["tokens_seen"] for r in every_step.train_rows}
    states = {
        step: json.loads((straight.output_dir / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())
        for step in (2, 4, 6)
    }
    assert {step: s["tokens_seen"] for step, s in states.items()} == {step: seen[step] for step in (2, 4, 6)}
    assert 0 < states[2]["supervised_seen"] < states[4]["supervised_seen"] < states[6]["supervised_seen"]
    part = tmp_path / "part"
    shutil.copytree(straight.output_dir, part)
    crash_after(part, 2)
    resumed = finetune(part, *args, "--resume_from_checkpoint", "latest")
    same = ("step", "loss", "grad_norm", "learning_rate", "tokens_seen", "padding_fraction", "skipped_steps")
    rows = [[{k: r[k] for k in same} for r in run.train_rows] for run in (straight, resumed)]
    assert rows[0] == rows[1] and [r["step"] for r in rows[0]] == [3, 6]
    end = json.loads((part / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert (end["tokens_seen"], end["supervised_seen"]) == (states[6]["tokens_seen"], states[6]["supervised_seen"])


def test_resume_across_epoch_boundary_under_ddp(assets, tmp_path):
    """Resume in the middle of epoch 1 of 3 under DDP: the data position (epoch, batch) is exact, also across the
    two epoch boundaries after it, which the resumed run reads in worker processes kept from epoch to epoch."""
    args = base_args(
        assets.llama,
        assets.instruction,
        "--max_train_samples",
        "48",
        "--num_train_epochs",
        "3",
        "--eval_fraction",
        "0",
        "--save_steps",
        "4",
    )
    straight = finetune(tmp_path / "straight", *args, launcher="ddp")
    assert len(straight.losses()) == 18  # 48 rows / (4 x 2 ranks) = 6 steps per epoch
    part = tmp_path / "part"
    shutil.copytree(straight.output_dir, part)
    crash_after(part, 4)
    # The resume reads its batches in 2 worker processes per rank, the same ones for epochs 2 and 3
    # (persistent_workers): the same data in the same order as the straight run's main-process loading.
    resumed = finetune(
        part, *args, "--resume_from_checkpoint", "latest", "--dataloader_num_workers", "2", launcher="ddp"
    )
    assert max_rel_diff(resumed.losses(), straight.losses()) <= 1e-6
    rows = [r for run in (straight, resumed) for r in run.train_rows]
    assert rows and all(0 <= r["data_wait_s"] < r["step_time_s"] for r in rows), rows  # part of the step's time


def test_final_model_reloads_and_reproduces_eval_loss(assets, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res = finetune(
        tmp_path / "run",
        *base_args(
            assets.gpt2,
            assets.instruction,
            "--max_steps",
            "6",
            "--eval_fraction",
            "0.1",
            "--per_device_eval_batch_size",
            "5",
        ),
        launcher="ddp",
    )
    final = res.output_dir / "final"
    assert (final / "run_config.yaml").exists() and (final / "tokenizer.json").exists()
    assert "checkpoints: none (save_steps null)" in res.output and not (res.output_dir / "checkpoints").exists()
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    again = reevaluate(model, tok, assets.instruction, "causal_lm")
    assert again["eval_loss"] == pytest.approx(res.eval_rows[-1]["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("fmt", ["text", "alpaca", "chat"])
def test_causal_lm_formats_learn(assets, tmp_path, fmt):
    dataset = {"text": assets.text, "alpaca": assets.alpaca, "chat": assets.chat}[fmt]
    model = {"text": assets.gpt2, "alpaca": assets.llama, "chat": assets.gpt2}[fmt]
    res = finetune(
        tmp_path / fmt,
        *base_args(model, dataset, "--max_steps", "15", "--eval_fraction", "0.1", "--learning_rate", "3e-3"),
    )
    losses = res.losses()
    assert losses[-1] < losses[0] * 0.8, losses
    assert "eval_perplexity" in res.eval_rows[-1]
    assert res.train_rows[-1]["tokens_seen"] > 0 and res.train_rows[-1]["tokens_per_s"] > 0
    # MFU's FLOPs (mfu x the logged peak / tokens_per_s: per token): the body's for every token (6 x the parameters
    # other than the embeddings and the LM head, counted here, + attention's 12 x layers x hidden x 64), the LM
    # head's (6 x vocabulary x hidden) on the learned positions only. Alpaca learns its answers alone: a small share.
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model)
    cfg = net.config
    body = 6.0 * sum(p.numel() for n, p in net.named_parameters() if not any(k in n for k in ("wte", "embed", "head")))
    body += 12.0 * cfg.num_hidden_layers * cfg.hidden_size * 64
    head = 6.0 * cfg.vocab_size * cfg.hidden_size
    peak = float(re.search(r"MFU reference: peak (\S+) GFLOP/s", res.output)[1]) * 1e9
    per_token = [r["mfu"] * peak / r["tokens_per_s"] for r in res.train_rows]
    share = {"text": (0.9, 1.0), "alpaca": (0.03, 0.5), "chat": (0.03, 0.9)}[fmt]
    assert per_token and all(body + share[0] * head < f < body + share[1] * head for f in per_token), (
        per_token,
        body,
        head,
    )


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_classification_reaches_high_accuracy(assets, tmp_path, arch):
    model = {"bert": assets.bert, "llama": assets.llama}[arch]
    res = finetune(
        tmp_path / arch,
        *classification_args(model, assets),
        "--max_steps",
        "60",
        "--learning_rate",
        "3e-3",
        "--per_device_train_batch_size",
        "8",
        "--eval_on_start",
        "true",
        "--eval_steps",
        "30",
        "--max_seq_length",
        "32",
        "--save_steps",
        "60",
        launcher="ddp",
    )
    first, last = res.eval_rows[0], res.eval_rows[-1]
    assert first["step"] == 0 and first["eval_accuracy"] < 0.5
    assert last["eval_accuracy"] >= 0.9 and last["eval_f1"] >= 0.9
    config = json.loads((res.output_dir / "final" / "config.json").read_text())
    assert config["id2label"] == {"0": "food", "1": "sports", "2": "tech", "3": "weather"}
    # the checkpoint's tokenizer as final/'s: none of the truncation to max_seq_length the run's calls left set
    saved = json.loads((res.output_dir / "checkpoints" / "step_60" / "tokenizer.json").read_text())
    assert saved["truncation"] is None and saved["padding"] is None, (saved["truncation"], saved["padding"])


BASE_LABELS = ["weather", "tech", "food", "sports"]  # a base classifier's head, in an order no label sorts to


def read_rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def base_classifier(assets, path: Path, problem_type: str | None) -> str:
    """The tiny llama as a 4-class classifier whose head names BASE_LABELS (a random head, seeded)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(assets.llama)
    config.update(
        {
            "num_labels": len(BASE_LABELS),
            "id2label": dict(enumerate(BASE_LABELS)),
            "label2id": {n: i for i, n in enumerate(BASE_LABELS)},
            "problem_type": problem_type,
            "pad_token_id": assets.tokenizer.pad_token_id,
        }
    )
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(assets.llama, config=config).save_pretrained(path)
    assets.tokenizer.save_pretrained(path)
    return str(path)


def test_a_base_classifier_keeps_its_labels_from_classlabel_data(assets, tmp_path):
    """Fine-tuning a classifier on the labels its head names: its ids are kept (sorting them re-mapped its rows:
    step 0 already scored by the wrong rows), from a ClassLabel column (whose names were lost: "0".."3"), and a
    multi-label base trains as single-label (BCE over 4 outputs crashed at step 1). The eval labels are the base's
    own predictions, so at step 0 (and after one step at lr 1e-12) the run must score them all correct, and final/
    must name what the base predicted."""
    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    model = base_classifier(assets, tmp_path / "base", "multi_label_classification")
    names = sorted(BASE_LABELS)
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)})
    texts = [r["text"] for r in read_rows(assets.classification_eval)[:24]]
    base, tok = AutoModelForSequenceClassification.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    with torch.no_grad():
        predicted = [BASE_LABELS[base(**tok(t, truncation=True, max_length=32, return_tensors="pt")).logits.argmax()]
                     for t in texts]  # fmt: skip
    train_rows = [{"text": r["text"], "label": names.index(r["label"])} for r in read_rows(assets.classification)]
    datasets.Dataset.from_list(train_rows[:64], features=features).to_parquet(tmp_path / "train.parquet")
    eval_rows = [{"text": t, "label": names.index(p)} for t, p in zip(texts, predicted)]
    datasets.Dataset.from_list(eval_rows, features=features).to_parquet(tmp_path / "eval.parquet")
    res = finetune(
        tmp_path / "run",
        *base_args(model, str(tmp_path / "train.parquet"), "--task", "classification", "--max_seq_length", "32"),
        *("--eval_dataset", str(tmp_path / "eval.parquet"), "--learning_rate", "1e-12", "--max_steps", "1"),
        *("--eval_on_start", "true", "--eval_steps", "1"),
    )
    assert [r["eval_accuracy"] for r in res.eval_rows] == [1.0, 1.0]
    assert "problem_type" in res.output and "in the base model's order" in res.output
    config = json.loads((res.output_dir / "final" / "config.json").read_text())
    assert config["id2label"] == {str(i): n for i, n in enumerate(BASE_LABELS)}
    assert config["problem_type"] == "single_label_classification"
    classify = pipeline("text-classification", model=str(res.output_dir / "final"))
    assert [p["label"] for p in classify(texts)] == predicted


@pytest.mark.parametrize("problem_type", ["regression", "multi_label_classification"])
def test_a_base_classifier_of_another_problem_type_learns_one_label_per_example(assets, tmp_path, caplog, problem_type):
    """A regression (cross-encoder/stsb-*) or multi-label (unitary/toxic-bert) base: transformers picks the loss by
    problem_type, so class ids met MSE or BCE over 4 outputs and the run crashed at step 1. Now it is loaded (and
    exported) as single-label classification, and the log says so. A head named for other labels is kept (same
    count: the log says each row's new label) or re-initialised (another count), never silently."""
    from finetune.config import ModelArgs
    from finetune.model import build_model

    model = base_classifier(assets, tmp_path / "base", problem_type)
    args = ModelArgs(model=model, task="classification")
    with caplog.at_level("WARNING", logger="finetune"):
        net = build_model(args, assets.tokenizer, BASE_LABELS, 32)
    batch = assets.tokenizer(["rain all day", "a late goal"], padding=True, return_tensors="pt")
    loss = net(**batch, labels=torch.tensor([0, 3])).loss
    assert net.config.problem_type == "single_label_classification" and loss.ndim == 0 and loss > 0
    assert f"says {problem_type}" in caplog.text and "labels:" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="finetune"):
        build_model(args, assets.tokenizer, ["a", "b", "c", "d"], 32)
        assert "weather -> a, tech -> b" in caplog.text
        build_model(args, assets.tokenizer, ["a", "b"], 32)
        assert "re-initialised for the data's 2 labels" in caplog.text


def test_packing_trains_and_counts_supervised_tokens(assets, tmp_path):
    args = base_args(
        assets.llama, assets.instruction, "--max_steps", "5", "--eval_fraction", "0.1", "--max_seq_length", "128"
    )
    padded = finetune(tmp_path / "padded", *args)
    packed = finetune(tmp_path / "packed", *args, "--packing", "true")
    assert "train rows" in packed.output
    rows_padded = int(padded.output.split(" train rows")[0].rsplit(", ", 1)[-1])
    rows_packed = int(packed.output.split(" train rows")[0].rsplit(", ", 1)[-1])
    assert rows_packed < rows_padded * 0.6  # ~2 examples of ~50 tokens per 128-token row
    assert all(r["loss"] > 0 for r in packed.train_rows)


def test_python_m_and_script_entry_points(assets, tmp_path):
    """`python -m finetune`, and `accelerate launch finetune` (the directory as a script)."""
    args = base_args(assets.gpt2, assets.text, "--max_steps", "2", "--eval_fraction", "0")
    finetune(tmp_path / "m", *args, launcher="python")
    import os
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / "single.yaml"),
        "finetune",
        "--output_dir",
        str(tmp_path / "s"),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "s" / "final" / "model.safetensors").exists()


def test_previous_run_is_never_overwritten_unless_asked(assets, tmp_path):
    args = base_args(assets.gpt2, assets.text, "--max_steps", "2", "--eval_fraction", "0")
    first = finetune(tmp_path / "run", *args)
    before = (first.output_dir / "final" / "model.safetensors").read_bytes()
    again = finetune(tmp_path / "run", *args, "--seed", "7", expect_ok=False, launcher="python")
    assert again.returncode == 2 and "overwrite_output_dir" in again.output and "Traceback" not in again.output
    assert (first.output_dir / "final" / "model.safetensors").read_bytes() == before
    finetune(tmp_path / "run", *args, "--seed", "7", "--overwrite_output_dir", "true")
    assert (first.output_dir / "final" / "model.safetensors").read_bytes() != before


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


def test_a_run_from_another_runs_checkpoint_never_touches_a_previous_run(assets, tmp_path):
    """--resume_from_checkpoint naming another run's checkpoint. Into an output_dir that holds a run: refused as a fresh
    start is (exit 2, not a byte changed), or with --overwrite_output_dir a start over. Into a new output_dir: a run of
    its own from that checkpoint (its run_config.yaml, rows from the next step, its own checkpoints), equal to the
    source run's continuation; load_best_model_at_end takes the source run's best checkpoint (before the step
    resumed from), and the source run is left as it was."""
    args = base_args(
        assets.gpt2, assets.text, "--max_steps", "6", "--save_steps", "2", "--eval_fraction", "0.1",
        "--eval_steps", "1", "--learning_rate", "0.03", "--lr_scheduler_type", "constant",
        "--load_best_model_at_end", "true",
    )  # fmt: skip
    source = finetune(tmp_path / "source", *args)
    losses = [r["eval_loss"] for r in source.eval_rows]
    best = losses.index(min(losses)) + 1
    assert best < 4, losses  # the scenario: the best checkpoint is the source run's alone
    ckpt = source.output_dir / "checkpoints" / "step_4"
    victim = finetune(tmp_path / "victim", *args, "--max_steps", "2")
    kept = {d: files_of(d) for d in (source.output_dir, victim.output_dir)}
    refused = finetune(victim.output_dir, *args, "--resume_from_checkpoint", str(ckpt), expect_ok=False)
    assert refused.returncode == 2 and "Traceback" not in refused.output, refused.output[-3000:]
    assert "output_dir: " in refused.output and "--overwrite_output_dir" in refused.output
    assert files_of(victim.output_dir) == kept[victim.output_dir]

    new = finetune(tmp_path / "new", *args, "--resume_from_checkpoint", str(ckpt))
    assert yaml.safe_load((new.output_dir / "run_config.yaml").read_text())["resume_from_checkpoint"] == str(ckpt)
    assert [r["step"] for r in new.train_rows] == [5, 6] and [r["step"] for r in new.eval_rows] == [5, 6]
    assert max_rel_diff(new.losses(), source.losses()[4:]) <= 1e-6
    assert [r["eval_loss"] for r in new.eval_rows] == pytest.approx(losses[4:], rel=1e-6)
    assert sorted(p.name for p in (new.output_dir / "checkpoints").iterdir()) == ["latest", "step_6"]
    assert f"{source.output_dir / 'checkpoints' / f'step_{best}'}" in new.output, new.output[-3000:]
    assert max_weight_diff(source.output_dir / "final", new.output_dir / "final") == 0.0
    state = json.loads((new.output_dir / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert state["best_step"] == best and state["best_checkpoint"] == str(
        source.output_dir / "checkpoints" / f"step_{best}"
    )

    # the same command again (a launcher's restart, a requeued job): that run continues from its own newest
    # checkpoint; one that died before its first checkpoint starts over from the other run's
    first = new.losses()  # (read now: a Result reads the output_dir's metrics.jsonl when asked)
    again = finetune(new.output_dir, *args, "--resume_from_checkpoint", str(ckpt))
    assert f"resumed from {new.output_dir / 'checkpoints' / 'step_6'}" in again.output, again.output[-3000:]
    assert [r["step"] for r in again.train_rows] == [5, 6]  # its rows, none again
    shutil.rmtree(new.output_dir / "checkpoints")
    shutil.rmtree(new.output_dir / "final")
    over_again = finetune(new.output_dir, *args, "--resume_from_checkpoint", str(ckpt))
    assert [r["step"] for r in over_again.train_rows] == [5, 6] and max_rel_diff(first, over_again.losses()) == 0
    assert max_weight_diff(source.output_dir / "final", new.output_dir / "final") == 0.0

    alone = tmp_path / "copied" / "step_4"  # without the best checkpoint beside it: refused before training
    shutil.copytree(ckpt, alone)
    lost = finetune(tmp_path / "lost", *args, "--resume_from_checkpoint", str(alone), expect_ok=False)
    assert lost.returncode == 2 and "Traceback" not in lost.output
    assert (
        not (tmp_path / "lost" / "metrics.jsonl").exists()
        and "load_best_model_at_end: " in lost.output
        and f"{alone.parent / f'step_{best}'}" in lost.output
    )

    over = finetune(victim.output_dir, *args, "--resume_from_checkpoint", str(ckpt), "--overwrite_output_dir", "true")
    assert [r["step"] for r in over.train_rows] == [5, 6]  # the previous run's rows are gone, not mixed in
    assert max_weight_diff(source.output_dir / "final", victim.output_dir / "final") == 0.0
    assert files_of(source.output_dir) == kept[source.output_dir]


def test_save_total_limit_keeps_newest(assets, tmp_path):
    res = finetune(
        tmp_path / "run",
        *base_args(assets.gpt2, assets.text, "--max_steps", "5", "--eval_fraction", "0"),
        "--save_steps",
        "1",
        "--save_total_limit",
        "2",
    )
    ckpts = sorted(p.name for p in (res.output_dir / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_4", "step_5"]
    assert (res.output_dir / "checkpoints" / "latest").read_text().strip() == "step_5"


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_model_flops_count_the_experts_a_token_goes_through(arch):
    """A mixture of experts (4 experts, 2 per token; hidden 32, 2 layers): per token 6 x the weights a token goes
    through, counted here by hand from the sizes: attention, norms, the router, 2 of the 4 routed experts, and
    Qwen2-MoE's shared expert and its gate in full; every expert counts among the parameters (total)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model import ModelFacts

    h, layers, vocab = 32, 2, 300
    sizes = dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    if arch == "mixtral":
        config = AutoConfig.for_model(arch, **sizes, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
        expert, always = 3 * h * 64, 0  # gate, up, down
    else:
        config = AutoConfig.for_model(
            arch, **sizes, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4
        )
        config.num_experts_per_tok = 2
        expert, always = 3 * h * 32, 3 * h * 32 + h + (32 + 16 + 16)  # shared expert, its gate; q, k, v biases
    config.vocab_size, config.tie_word_embeddings = vocab, False
    net = AutoModelForCausalLM.from_config(config)
    attention = 2 * h * h + 2 * h * 16  # q, o; k, v of 2 heads of 8
    per_layer = attention + 2 * h + 4 * h + always  # + the two norms, the router
    active = layers * (per_layer + 2 * expert) + h  # + the final norm
    facts = ModelFacts.of(net, lambda p: p.numel(), seq_len=128)
    assert (
        facts.total == layers * (per_layer + 4 * expert) + h + 2 * vocab * h == sum(p.numel() for p in net.parameters())
    )
    assert facts.flops_per_token == pytest.approx(6.0 * active + 12.0 * layers * h * 128)


def test_model_flops_read_the_sizes_of_a_model_of_several_parts_from_its_text_config():
    """Gemma 3 (AutoModelForCausalLM loads Gemma3ForConditionalGeneration: a vision tower beside the language model)
    keeps its layers and hidden size in config.text_config: attention's FLOPs come from there (they were 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model import ModelFacts

    text = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28)
    config = AutoConfig.for_model(
        "gemma3",
        text_config={**text, "intermediate_size": 64, "vocab_size": 300},
        vision_config={**vision, "patch_size": 14},
        mm_tokens_per_image=4,
    )
    net = AutoModelForCausalLM.from_config(config)
    assert not hasattr(net.config, "hidden_size") or net.config.hidden_size != 32  # the sizes are not at the top
    facts = ModelFacts.of(net, lambda p: p.numel(), seq_len=128)
    assert (facts.layers, facts.hidden) == (2, 32)
    assert facts.attention_flops_per_token == 12.0 * 2 * 32 * 128


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_count_the_lm_head_once_on_the_learned_positions(tied):
    """model.ModelFacts (MFU's FLOPs), against parameters counted here by name: per token 6 x the parameters other
    than the embeddings and the LM head, + attention's 12 x layers x hidden x sequence; per learned position
    6 x vocabulary x hidden for the head, tied to the input embeddings (a matmul all the same, once missed) or not.
    Under LoRA a frozen weight costs 4 (no gradient of its own), an adapter's 6. A classifier has no LM head."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from finetune.demo import llama_config
    from finetune.model import ModelFacts

    cfg = llama_config(32, 2, heads=4, kv_heads=2, intermediate=64, vocab=1000, num_labels=3)
    cfg.tie_word_embeddings = tied
    attention = 12.0 * 2 * 32 * 128
    head = 1000 * 32

    def body(net, trainable: bool) -> int:
        named = dict(net.named_parameters())  # a tied head's weight once, as the embeddings'
        assert len(named) == len(list(net.parameters()))
        return sum(
            p.numel()
            for n, p in named.items()
            if "embed_tokens" not in n and "lm_head" not in n and p.requires_grad == trainable
        )

    lm = AutoModelForCausalLM.from_config(cfg)
    assert (lm.get_output_embeddings().weight is lm.get_input_embeddings().weight) == tied
    assert body(lm, True) > 0 and body(lm, False) == 0
    facts = ModelFacts.of(lm, lambda p: p.numel(), seq_len=128)
    assert facts.flops(tokens=500, learned=0) == pytest.approx((6.0 * body(lm, True) + attention) * 500)
    assert facts.flops(500, 200) - facts.flops(500, 0) == pytest.approx(6.0 * head * 200)
    # preference tuning's live reference: a forward of the frozen model over the same tokens (2 per weight, a
    # third of attention's, the head on the learned positions)
    reference = (2.0 * body(lm, True) + attention / 3) * 500 + 2.0 * head * 200
    assert facts.flops(500, 200, reference=True) - facts.flops(500, 200) == pytest.approx(reference)

    lora = get_peft_model(lm, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    facts = ModelFacts.of(lora, lambda p: p.numel(), seq_len=128)
    frozen, adapters = body(lora, False), body(lora, True)
    assert adapters == 2 * 4 * (32 + 32) + 2 * 4 * (32 + 16) and frozen > 10 * adapters  # 2 layers: q, v
    assert facts.flops(500, 0) == pytest.approx((4.0 * frozen + 6.0 * adapters + attention) * 500)
    assert facts.flops(500, 200) - facts.flops(500, 0) == pytest.approx(4.0 * head * 200)  # the head is frozen

    # QLoRA: bitsandbytes packs two 4-bit weights per byte (Params4bit: half the elements, as uint8) and keeps the
    # weight's shape in its quant_state; the weights count, not the bytes.
    up = lora.base_model.model.model.layers[0].mlp.up_proj
    packed = torch.nn.Parameter(torch.zeros(up.weight.numel() // 2, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = types.SimpleNamespace(shape=up.weight.shape)
    up.weight = packed
    assert ModelFacts.of(lora, lambda p: p.numel(), seq_len=128) == facts

    classifier = AutoModelForSequenceClassification.from_config(cfg)
    facts = ModelFacts.of(classifier, lambda p: p.numel(), seq_len=128)
    assert facts.head == 0 and facts.flops(500, 200) == facts.flops(500, 0)
