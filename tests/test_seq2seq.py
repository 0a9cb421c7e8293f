"""Encoder-decoders (task seq2seq: T5, BART through AutoModelForSeq2SeqLM): data, collation, the loss over
target tokens, and real runs proven equal across layouts (single, DDP, ZeRO-3), exported and reloaded."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from conftest import base_args, finetune, max_rel_diff, max_weight_diff
from safetensors.torch import load_file

from finetune.config import DataArgs
from finetune.data import IGNORE, Collator, build_datasets
from finetune.demo import write_jsonl
from finetune.metrics import per_example_stats


def pairs_file(path, n: int = 120) -> str:
    """Two-column data (source -> target): a sentence and its topic."""
    from finetune.demo import topic_examples

    return write_jsonl([{"source": e["text"], "target": e["label"]} for e in topic_examples(n, seed=9)], path)


def test_seq2seq_data_encoder_input_and_target_labels(assets, tmp_path):
    """Instruction data: the encoder reads the prompt (alpaca: instruction + input), the labels are the response +
    EOS, all supervised. Two-column data is found by its source/target columns (or the configured ones)."""
    tok = assets.tokenizer
    data = DataArgs(dataset=assets.alpaca, eval_fraction=0.0, max_seq_length=64)
    ds = build_datasets(data, "seq2seq", tok, 0, contextlib.nullcontext)
    assert ds.format == "instruction"
    row = json.loads(open(assets.alpaca).readline())
    first = ds.train[0]
    assert first["input_ids"] == tok(f"{row['instruction']}\n\n{row['input']}")["input_ids"]
    assert first["labels"] == tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ds.supervised_tokens == sum(len(x) for x in ds.train["labels"])  # no shift: every target token

    renamed = write_jsonl([{"q": "rain and snow", "a": "weather"}] * 4, tmp_path / "qa.jsonl")
    data = DataArgs(dataset=renamed, eval_fraction=0.0, source_column="q", target_column="a")
    ds = build_datasets(data, "seq2seq", tok, 0, contextlib.nullcontext)
    assert ds.format == "source_target"
    assert ds.train[0]["input_ids"] == tok("rain and snow")["input_ids"]
    assert ds.train[0]["labels"] == tok("weather", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_seq2seq_collation_and_loss_normalisation(assets, arch):
    """Encoder inputs and labels are padded separately; the supervised count is the number of target tokens;
    the per-example eval sums (no shift) add up to the model's own mean loss times that count."""
    from transformers import AutoModelForSeq2SeqLM

    examples = [
        {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13], "labels": [20, 21, 2]},
        {"input_ids": [5, 6], "labels": [22, 23, 24, 25, 26, 2]},
    ]
    batch = Collator(0, encoder_decoder=True)(examples)
    assert batch["input_ids"].shape == (2, 16) and batch["labels"].shape == (2, 8)
    assert batch["attention_mask"].sum(-1).tolist() == [9, 2]
    assert batch["labels"][0].tolist() == [20, 21, 2] + [IGNORE] * 5
    assert batch.pop("num_supervised").item() == 9
    assert batch.pop("num_tokens").item() == 9 + 2 + 3 + 6
    assert batch.pop("num_positions").item() == 2 * (16 + 8)
    assert batch.pop("num_learned").item() == 9  # every target token: the LM head runs on each
    model = AutoModelForSeq2SeqLM.from_pretrained(getattr(assets, arch)).eval()
    with torch.no_grad():
        out = model(**batch)
    stats = per_example_stats(out.logits, batch["labels"], "seq2seq")
    assert stats["count"].tolist() == [3, 6]
    assert stats["nll"].sum().item() == pytest.approx(out.loss.item() * 9, rel=1e-5)
    # a mixture's eval rows keep their source through the encoder-decoder collation too (eval per source)
    mixed = Collator(0, encoder_decoder=True)([{**e, "source": i} for i, e in enumerate(examples)])
    assert mixed["source"].tolist() == [0, 1]


@pytest.mark.slow
def test_t5_single_zero3_equal_and_export_reloads(assets, tmp_path):
    """T5 on instruction data: 1 process x GA 2 == 2 processes under ZeRO-3 (the sharded case; DDP's is the causal
    LMs'), fp32: losses and exported weights within 1e-5, the same eval loss and generation scores; final/ reloads
    with from_pretrained."""
    from transformers import AutoModelForSeq2SeqLM

    args = base_args(
        assets.t5,
        assets.alpaca,
        "--task",
        "seq2seq",
        "--max_steps",
        "4",
        "--eval_fraction",
        "0.1",
        "--eval_on_start",
        "true",
        "--generation_max_new_tokens",
        "4",
        "--per_device_eval_batch_size",
        "3",
    )
    one = finetune(tmp_path / "one", *args, "--gradient_accumulation_steps", "2")
    zero3 = finetune(tmp_path / "zero3", *args, launcher="zero3")
    assert len(zero3.losses()) == 4
    assert max_rel_diff(one.losses(), zero3.losses()) <= 1e-5
    assert [r["tokens_seen"] for r in zero3.train_rows] == [r["tokens_seen"] for r in one.train_rows]
    assert max_weight_diff(one.output_dir / "final", zero3.output_dir / "final") <= 1e-5
    assert zero3.eval_rows
    for mine, ref in zip(zero3.eval_rows, one.eval_rows, strict=True):
        assert mine["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
        scores = [k for k in ("eval_exact_match", "eval_rougeL", "eval_bleu") if k in ref]
        assert "eval_exact_match" in scores, sorted(ref)  # generation was scored (not {} == {})
        assert {k: mine.get(k) for k in scores} == {k: ref[k] for k in scores}
    assert zero3.train_rows[-1]["parameter_shard"] == pytest.approx(0.5, abs=0.05)  # ZeRO-3 really sharded
    base = load_file(f"{assets.t5}/model.safetensors")
    for path in (one.output_dir / "final", zero3.output_dir / "final"):
        model = AutoModelForSeq2SeqLM.from_pretrained(path)
        assert type(model).__name__ == "T5ForConditionalGeneration"
        trained = model.state_dict()
        assert all(trained[k].shape == v.shape for k, v in base.items())
        assert any(not torch.equal(trained[k], v) for k, v in base.items())  # trained, not the base (nor empty)
    assert one.eval_rows[-1]["eval_loss"] < one.eval_rows[0]["eval_loss"]


@pytest.mark.slow
def test_bart_lora_single_equals_zero3_adapter_trained_and_merged(assets, tmp_path):
    """BART with a LoRA adapter on two-column (source -> target) data: 1 process x GA 2 == ZeRO-3 (the frozen base
    sharded, the adapter gathered) within 1e-5 (losses and adapter weights); the adapter is not empty (every lora_B
    moved off zero); it loads onto the base model with PEFT, and the merged model loads with AutoModelForSeq2SeqLM."""
    from peft import PeftModel
    from transformers import AutoModelForSeq2SeqLM

    data = pairs_file(tmp_path / "pairs.jsonl")
    args = base_args(
        assets.bart,
        data,
        "--task",
        "seq2seq",
        "--max_steps",
        "4",
        "--eval_fraction",
        "0.1",
        "--peft.method",
        "lora",
        "--peft.merge",
        "true",
    )
    one = finetune(tmp_path / "one", *args, "--gradient_accumulation_steps", "2")
    zero3 = finetune(tmp_path / "zero3", *args, launcher="zero3")
    assert "data: source_target format" in zero3.output
    assert "prepared: zero_stage 3," in zero3.output, zero3.output[-3000:]
    name = "adapter_model.safetensors"
    assert max_rel_diff(one.losses(), zero3.losses()) <= 1e-5
    assert max_weight_diff(one.output_dir / "final", zero3.output_dir / "final", name) <= 1e-5
    adapter = load_file(str(zero3.output_dir / "final" / name))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.numel() > 0 and v.abs().max() > 0 for v in lora_b)  # initialised at 0, then trained
    assert json.loads((zero3.output_dir / "final" / "adapter_config.json").read_text())["task_type"] == "SEQ_2_SEQ_LM"
    model = PeftModel.from_pretrained(AutoModelForSeq2SeqLM.from_pretrained(assets.bart), zero3.output_dir / "final")
    assert type(model).__name__ == "PeftModelForSeq2SeqLM"
    merged = AutoModelForSeq2SeqLM.from_pretrained(zero3.output_dir / "final" / "merged")
    assert type(merged).__name__ == "BartForConditionalGeneration"
