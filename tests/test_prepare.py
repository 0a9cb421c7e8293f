"""`finetune prepare`: the data prepared once and read by the run (no raw data touched), the same training as from
the raw data, and a run whose tokenizer or data fields differ from the preparation's refused, key by key."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import base_args, finetune, max_rel_diff, max_weight_diff

from finetune import demo


def prepare(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "finetune", "prepare", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_prepared_run_trains_as_the_raw_data_does_and_differences_are_refused(assets, tmp_path):
    raw = tmp_path / "raw" / "instruction.jsonl"
    raw.parent.mkdir()
    shutil.copy(assets.instruction, raw)
    args = base_args(assets.llama, str(raw), "--max_steps", "4", "--packing", "true", "--eval_fraction", "0.1")
    where = tmp_path / "prepared"
    made = prepare(*args, "--output_dir", str(tmp_path / "unused"), "--prepared_data", str(where))
    assert made.returncode == 0, made.stdout + made.stderr
    manifest = json.loads((where / "prepared.json").read_text())
    assert manifest["made_from"]["max_seq_length"] == 64 and manifest["made_from"]["packing"] is True
    again = prepare(*args, "--prepared_data", str(where))  # never over an earlier preparation
    assert again.returncode == 2 and "prepared_data" in again.stderr and "not empty" in again.stderr

    from_raw = finetune(tmp_path / "from_raw", *args, "--gradient_accumulation_steps", "2")
    os.rename(raw, raw.with_suffix(".moved"))  # the prepared run must not need the raw data
    from_prepared = finetune(tmp_path / "from_prepared", *args, "--prepared_data", str(where), launcher="ddp")
    # (2 ranks x accumulation 1 against 1 x 2: the same global batches)
    assert f"the rows prepared by `finetune prepare` in {where}" in from_prepared.output
    assert "tokenizing" not in from_prepared.output
    assert len(from_raw.losses()) == 4 and max_rel_diff(from_raw.losses(), from_prepared.losses()) <= 1e-5
    assert from_raw.eval_rows
    assert abs(from_prepared.eval_rows[-1]["eval_loss"] / from_raw.eval_rows[-1]["eval_loss"] - 1) <= 1e-5
    assert max_weight_diff(from_raw.output_dir / "final", from_prepared.output_dir / "final") <= 1e-5

    other = tmp_path / "other_tokenizer"  # the same model with a tokenizer of another vocabulary
    shutil.copytree(assets.llama, other)
    for f in other.glob("*token*"):
        f.unlink()
    demo.build_tokenizer(other, vocab_size=500).save_pretrained(other)
    for changed, key in ((["--model", str(other)], "model"), (["--max_seq_length", "128"], "max_seq_length")):
        refused = finetune(
            tmp_path / f"refused_{key}", *args, *changed, "--prepared_data", str(where), launcher="python",
            expect_ok=False,
        )  # fmt: skip
        assert refused.returncode == 2 and f"  - {key}: the data in '{where}' was prepared with" in refused.output
        assert "Traceback" not in refused.output


@pytest.mark.parametrize("task", ["classification", "seq2seq"])
def test_rows_cut_by_the_tokenizer_leave_its_fingerprint_as_loaded(assets, tmp_path, task):
    """Classification rows and seq2seq sources longer than max_seq_length are cut by transformers' truncation, which
    stays set on the Rust tokenizer after the call: the tokenizer `finetune prepare` fingerprints after tokenizing
    must be the one a run loads (before, every such preparation was refused as made by another tokenizer)."""
    from finetune.config import DataArgs, ModelArgs
    from finetune.data import build_datasets
    from finetune.model import load_tokenizer
    from finetune.prepared import tokenizer_fingerprint

    source = {"classification": assets.classification, "seq2seq": assets.instruction}[task]
    data = tmp_path / "rows.jsonl"  # a path of its own: tokenized here, not read from the datasets cache
    shutil.copy(source, data)
    tokenizer = load_tokenizer(ModelArgs(model=assets.t5 if task == "seq2seq" else assets.llama))
    loaded = tokenizer_fingerprint(tokenizer)
    args = DataArgs(dataset=str(data), eval_fraction=0.1, max_seq_length=8)
    ds = build_datasets(args, task, tokenizer, 42, contextlib.nullcontext)
    assert max(len(ids) for ids in ds.train["input_ids"]) == 8  # the scenario: rows were cut
    assert tokenizer.backend_tokenizer.truncation is not None  # ... by transformers' truncation, left set
    assert tokenizer_fingerprint(tokenizer) == loaded


def test_prepared_classification_rows_record_the_base_models_label_names(assets, tmp_path):
    """A base classifier naming the data's labels gives them its ids (data.label_names_of): prepared rows made for
    one base carry those ids, so a run on a base naming them in another order is refused, keyed model."""
    from finetune.config import build_config
    from finetune.prepared import BASE_LABELS, differences, made_from

    def base(name: str, labels: list[str] | None) -> str:
        path = tmp_path / name
        shutil.copytree(assets.llama, path, ignore=shutil.ignore_patterns("*.safetensors"))
        config = json.loads((path / "config.json").read_text())
        config.update({"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}})
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    def made(model: str) -> dict:
        values = {"model": model, "task": "classification", "dataset": assets.classification}
        return made_from(build_config(values, check_filesystem=False), assets.tokenizer)

    named = made(base("named", ["weather", "tech", "food", "sports"]))
    assert named[BASE_LABELS] == ["weather", "tech", "food", "sports"]
    assert BASE_LABELS not in made(base("default", ["LABEL_0", "LABEL_1"])) and BASE_LABELS not in made(assets.llama)
    other = made(base("other", ["food", "sports", "tech", "weather"]))
    manifest = {"made_from": named, "model": "named"}
    [(key, why)] = differences(manifest, other, "prep")
    assert key == "model" and "['weather', 'tech', 'food', 'sports']" in why and "finetune prepare" in why
