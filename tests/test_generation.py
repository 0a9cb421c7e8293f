"""Generation eval: the shipped text metrics, how eval rows become prompts and references, and a real run in
which a tiny model learns a task: eval_exact_match climbs from 0 to >= 0.9, equal under DDP and ZeRO-3."""

from __future__ import annotations

import contextlib
import random

import pytest
from conftest import base_args, finetune

from finetune.config import SHIPPED_METRICS, DataArgs, RunConfig
from finetune.data import build_datasets
from finetune.demo import TOPICS, write_jsonl
from finetune.generate import GenerationEval, examples_of


def shipped(name: str):
    import evaluate

    return evaluate.load(str(SHIPPED_METRICS / name))


def test_shipped_text_metrics_load_offline_and_score():
    preds = ["the cat sat on the mat today", "a quick brown fox jumps", "hello there general kenobi"]
    refs = ["the cat sat on a mat today", "the quick brown fox jumps over", "hello there general kenobi"]
    assert shipped("exact_match").compute(predictions=preds, references=refs) == {"exact_match": pytest.approx(1 / 3)}
    em = shipped("exact_match").compute(
        predictions=["Yes."], references=["yes"], ignore_case=True, ignore_punctuation=True
    )
    assert em["exact_match"] == 1.0
    rouge = shipped("rouge").compute(predictions=preds, references=refs)
    assert set(rouge) == {"rouge1", "rouge2", "rougeL", "rougeLsum"}
    # rouge1 F of example 1: 6 of 7 unigrams shared (6/7); example 2: 4 shared of 5 and 6 (8/11); example 3: 1
    assert rouge["rouge1"] == pytest.approx((6 / 7 + 8 / 11 + 1) / 3)
    assert shipped("rouge").compute(predictions=["abc"], references=["xyz"])["rougeL"] == 0.0


def test_shipped_bleu_equals_nltk_corpus_bleu():
    """BLEU is corpus-level: nltk's independent implementation over the same 13a tokens gives the same number."""
    import importlib.util

    from nltk.translate.bleu_score import corpus_bleu

    spec = importlib.util.spec_from_file_location("shipped_bleu", SHIPPED_METRICS / "bleu" / "bleu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenize = module.tokenize_13a
    assert tokenize("Hello, world. It costs 3.50 (really)!") == [
        "Hello", ",", "world", ".", "It", "costs", "3.50", "(", "really", ")", "!"
    ]  # fmt: skip
    preds = ["the cat sat on the mat today.", "a quick brown fox jumps", "hello there, general kenobi"]
    refs = ["the cat sat on a mat today.", "the quick brown fox jumps over", "hello there, general kenobi"]
    ours = shipped("bleu").compute(predictions=preds, references=refs)
    theirs = corpus_bleu([[tokenize(r)] for r in refs], [tokenize(p) for p in preds])
    assert ours["bleu"] == pytest.approx(theirs, rel=1e-12) and 0 < ours["bleu"] < 1
    assert shipped("bleu").compute(predictions=refs, references=refs)["bleu"] == pytest.approx(1.0)


def test_prompts_are_eval_rows_without_their_answer(assets):
    """Instruction: the prompt is everything before the response; chat: everything before the first assistant
    turn, whose end-of-turn token stops generation; seq2seq: the encoder input. The reference is the answer."""
    tok = assets.tokenizer
    for path, task, fmt in ((assets.instruction, "causal_lm", "instruction"), (assets.chat, "causal_lm", "chat")):
        ds = build_datasets(DataArgs(dataset=path, eval_fraction=0.1), task, tok, 0, contextlib.nullcontext)
        examples = examples_of(ds.eval, task, 5, tok)
        assert len(examples) == 5 and ds.format == fmt
        row = ds.eval[0]
        n = len(examples[0].prompt)
        assert row["input_ids"][:n] == examples[0].prompt and set(row["labels"][:n]) == {-100}
        assert row["labels"][n] != -100
    # chat: the reference is the first assistant turn (the topic name); <|im_end|> ends it
    assert examples[0].reference in TOPICS
    assert examples[0].prompt[-3:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]
    cfg = RunConfig()
    cfg.train.generation_max_new_tokens = 8
    stop = GenerationEval(examples, {}, cfg, tok).stop_ids
    assert stop == sorted([tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")])
    ds = build_datasets(DataArgs(dataset=assets.alpaca, eval_fraction=0.1), "seq2seq", tok, 0, contextlib.nullcontext)
    first = examples_of(ds.eval, "seq2seq", None, tok)
    assert len(first) == len(ds.eval)
    assert first[0].prompt == ds.eval[0]["input_ids"] and first[0].reference in TOPICS


def topic_words(path, n: int = 320) -> str:
    """A task a tiny model learns in a few dozen steps: "Name the topic." of one topic word (the prompt's last
    token) -> the topic's name (several tokens, then EOS)."""
    rng = random.Random(7)
    rows = []
    for _ in range(n):
        label = rng.choice(sorted(TOPICS))
        rows.append({"instruction": "Name the topic.", "input": rng.choice(TOPICS[label].split()), "output": label})
    return write_jsonl(rows, path)


@pytest.mark.slow
def test_exact_match_climbs_and_does_not_depend_on_the_layout(assets, tmp_path):
    """A tiny llama learns topic-word -> topic: eval_exact_match from ~0 at the start to >= 0.9, with the same
    generated texts and scores under DDP and ZeRO-3 (11 batches of 3 prompts over 2 ranks: ZeRO-3's ranks step in
    lockstep, the odd one generating a repeat)."""
    data = topic_words(tmp_path / "topics.jsonl")
    args = base_args(
        assets.llama,
        data,
        "--prompt_template",
        "{prompt}",
        "--max_steps",
        "60",
        "--learning_rate",
        "5e-3",
        "--logging_steps",
        "20",
        "--eval_fraction",
        "0.1",
        "--eval_on_start",
        "true",
        "--generation_max_new_tokens",
        "8",
        "--per_device_eval_batch_size",
        "3",
    )
    runs = {name: finetune(tmp_path / name, *args, launcher=name) for name in ("ddp", "zero3")}
    for name, run in runs.items():
        assert "generation eval: 32 eval prompts, up to 8 new tokens" in run.output, name
        start, end = run.eval_rows[0], run.eval_rows[-1]
        assert (start["step"], end["step"]) == (0, 60), name
        assert start["eval_exact_match"] <= 0.1, (name, start)
        assert end["eval_exact_match"] >= 0.9, (name, end)
        assert {"eval_rougeL", "eval_bleu"} <= set(end), name
        samples = [r["eval_samples"] for r in run.rows if "eval_samples" in r]
        assert len(samples) == 2 and all(set(s) == {"prompt", "generated", "reference"} for s in samples[-1])
        assert sum(s["generated"] == s["reference"] for s in samples[-1]) >= 2, samples[-1]
    ddp, zero3 = runs["ddp"], runs["zero3"]
    assert zero3.train_rows[-1]["parameter_shard"] == pytest.approx(0.5, abs=0.05)
    keys = ("eval_exact_match", "eval_rouge1", "eval_rougeL", "eval_bleu")
    assert [[r[k] for k in keys] for r in ddp.eval_rows] == [[r[k] for k in keys] for r in zero3.eval_rows]
    assert [r for r in ddp.rows if "eval_samples" in r] == [r for r in zero3.rows if "eval_samples" in r]
