"""`streaming: true`: the rows read, shuffled, tokenized and packed as training goes. The same rows and losses for
2 ranks x GA 1 and 1 rank x GA 2 (supervised rows and DPO's pairs), a resumed run that continues as the
uninterrupted one did, a stream that runs out restarting reshuffled, and what a stream cannot do refused by key."""

from __future__ import annotations

import contextlib
import itertools
import json

import pytest
from conftest import base_args, crash_after, finetune, max_rel_diff, max_weight_diff

from finetune.config import ConfigError, DataArgs, RunConfig
from finetune.config.rules import preference_problems, streaming_problems
from finetune.data import build_stream


def _stream(assets, **data) -> tuple[list[list[int]], object]:
    """The first 60 training rows a stream yields (input_ids), and its Datasets."""
    args = DataArgs(dataset=assets.instruction, max_seq_length=64, **{"eval_fraction_max_rows": 40, **data})
    ds = build_stream(args, "causal_lm", assets.tokenizer, 7, contextlib.nullcontext)
    return [r["input_ids"] for r in itertools.islice(ds.train, 60)], ds


def test_a_stream_is_seeded_holds_out_its_first_rows_and_restarts_reshuffled(assets):
    rows, ds = _stream(assets)
    again, _ = _stream(assets)
    assert rows and rows == again  # the same seeded order on every read (every rank reads it)
    assert ds.streamed and len(ds.eval) == 40 and ds.supervised_tokens is None
    held_out = {tuple(r["input_ids"]) for r in ds.eval}
    assert held_out and not held_out & {tuple(r) for r in rows}  # eval's rows never train
    source = [json.loads(line) for line in open(assets.instruction)]
    unshuffled = [r["input_ids"] for r in itertools.islice(_stream(assets, shuffle_buffer_size=1)[1].train, 60)]
    assert unshuffled != rows  # the buffer shuffles (a buffer of 1 keeps the file's order)
    assert len(source) == 400
    # 30 rows, read 3 times: each pass is the same 30 rows, reshuffled
    short = list(itertools.islice(_stream(assets, max_train_samples=30)[1].train, 90))
    passes = [[tuple(r["input_ids"]) for r in short[i : i + 30]] for i in (0, 30, 60)]
    assert set(passes[0]) == set(passes[1]) == set(passes[2]) and len(set(passes[0])) == 30
    assert passes[0] != passes[1] != passes[2]


def test_two_ranks_and_accumulation_train_the_same_streamed_rows_and_a_resume_continues_them(assets, tmp_path):
    args = base_args(
        assets.llama,
        assets.instruction,
        "--streaming",
        "true",
        "--packing",
        "true",
        "--max_steps",
        "8",
        "--eval_fraction_max_rows",
        "40",
        "--max_train_samples",
        "120",
        "--shuffle_buffer_size",
        "50",
        "--per_device_train_batch_size",
        "2",
    )  # fmt: skip  (120 rows packed into rows of 64 tokens: the stream runs out and restarts within 8 steps)
    one = finetune(tmp_path / "one", *args, "--gradient_accumulation_steps", "2", "--save_steps", "3")
    two = finetune(tmp_path / "two", *args, launcher="ddp")
    assert "train rows streamed" in one.output and "tokenized and packed as training reads" in two.output
    a, b = one.train_rows, two.train_rows
    assert len(a) == len(b) == 8
    assert [r["tokens_seen"] for r in a] == [r["tokens_seen"] for r in b]  # the same rows in every step
    assert max_rel_diff(one.losses(), two.losses()) <= 1e-5
    assert a[-1]["tokens_seen"] > 0 and all(r["epoch"] is None for r in a)
    assert one.eval_rows and abs(one.eval_rows[-1]["eval_loss"] / two.eval_rows[-1]["eval_loss"] - 1) <= 1e-5
    assert max_weight_diff(one.output_dir / "final", two.output_dir / "final") <= 1e-5

    crash_after(one.output_dir, 3)
    resumed = finetune(
        one.output_dir, *args, "--gradient_accumulation_steps", "2", "--save_steps", "3",
        "--resume_from_checkpoint", "auto",
    )  # fmt: skip
    assert "resumed from" in resumed.output and "at step 3" in resumed.output
    after = [r for r in resumed.train_rows if r["step"] > 3]
    assert [r["step"] for r in after] == [4, 5, 6, 7, 8]
    assert [r["tokens_seen"] for r in after] == [r["tokens_seen"] for r in a[3:]]
    assert max_rel_diff([r["loss"] for r in a[3:]], [r["loss"] for r in after]) <= 1e-5
    assert max_weight_diff(two.output_dir / "final", resumed.output_dir / "final") <= 1e-5


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"train": {"max_steps": -1}}, "max_steps"),
        ({"data": {"length_aware_batching": True}}, "length_aware_batching"),
        ({"data": {"datasets": [{"dataset": "a.jsonl"}, {"dataset": "b.jsonl"}]}}, "datasets"),
        ({"model": {"task": "classification"}}, "task"),
        ({"data": {"prepared_data": "prepared"}}, "prepared_data"),
        ({"train": {"dataloader_num_workers": 2}}, "dataloader_num_workers"),
        ({"data": {"eval_fraction_max_rows": None}}, "eval_fraction_max_rows"),
    ],
)
def test_what_a_stream_cannot_do_is_refused_by_key(changes, key):
    cfg = RunConfig()
    cfg.data.streaming, cfg.train.max_steps = True, 10
    for section, values in changes.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    keys = [k for k, _ in streaming_problems(cfg)]
    assert keys == [key]
    cfg.data.streaming = False
    assert streaming_problems(cfg) == []


def test_a_stream_with_no_training_rows_left_after_eval_is_refused(assets):
    with pytest.raises(ConfigError) as e:
        _stream(assets, eval_fraction_max_rows=400)
    assert e.value.problems[0][0] == "eval_fraction_max_rows"


def test_streamed_pairs_need_a_live_reference_for_dpo_and_ipo_only():
    cfg = RunConfig()
    cfg.data.streaming, cfg.train.max_steps = True, 10
    for method, reference, refused in [
        ("dpo", "precomputed", True), ("ipo", "precomputed", True), ("dpo", "live", False), ("ipo", "live", False),
        ("orpo", "precomputed", False), ("simpo", "precomputed", False),
    ]:  # fmt: skip
        cfg.train.method, cfg.train.reference = method, reference
        problems = dict(preference_problems(cfg))
        assert ("reference: live" in problems.get("streaming", "")) == refused, (method, reference, problems)
        assert streaming_problems(cfg) == [], method
    cfg.data.streaming, cfg.train.method, cfg.train.reference = False, "dpo", "precomputed"
    assert "streaming" not in dict(preference_problems(cfg))


def test_streamed_pairs_with_a_live_reference_train_the_same_under_two_ranks(assets, tmp_path):
    """DPO on a stream of pairs, reference: live (a frozen copy of the starting model): 2 ranks x GA 1 (DDP) and one
    process x GA 2 train the same pairs: losses, rewards, eval and exported weights within 1e-5; the policy starts as
    its reference (loss log 2), and no reference log-probs were precomputed."""
    import math

    from test_preference import pairs

    args = base_args(
        assets.llama, pairs(tmp_path / "pairs.jsonl"), "--method", "dpo", "--beta", "0.5", "--reference", "live",
        "--streaming", "true", "--max_steps", "4", "--per_device_train_batch_size", "2",
        "--eval_fraction_max_rows", "16", "--shuffle_buffer_size", "40",
    )  # fmt: skip
    one = finetune(tmp_path / "one", *args, "--gradient_accumulation_steps", "2")
    two = finetune(tmp_path / "two", *args, launcher="ddp")
    assert "preference format, train rows streamed" in two.output, two.output[-3000:]
    assert "reference log-probs: live, a frozen copy of the starting model" in two.output
    a, b = one.train_rows, two.train_rows
    assert len(a) == len(b) == 4
    assert [r["tokens_seen"] for r in a] == [r["tokens_seen"] for r in b]  # the same pairs in every step
    assert max_rel_diff(one.losses(), two.losses()) <= 1e-5
    assert one.losses()[0] == pytest.approx(math.log(2), abs=1e-5)
    for key in ("rewards_chosen", "rewards_rejected", "logps_chosen"):
        x, y = [r[key] for r in a], [r[key] for r in b]
        assert all(abs(p - q) <= 1e-5 * max(1.0, abs(p)) for p, q in zip(x, y, strict=True)), (key, x, y)
    assert one.eval_rows and abs(one.eval_rows[-1]["eval_loss"] / two.eval_rows[-1]["eval_loss"] - 1) <= 1e-5
    assert max_weight_diff(one.output_dir / "final", two.output_dir / "final") <= 1e-5
    assert not (one.output_dir / "reference_logps.pt").exists() and not (two.output_dir / "reference_logps.pt").exists()
