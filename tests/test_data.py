"""What the loss sees: label masking per format, truncation, packing, collation, data order and step arithmetic.

Datasets go through the real builder (`build_datasets`) with the offline tokenizer and files from conftest.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from finetune.config import ConfigError, DataArgs, TrainArgs
from finetune.data import (
    IGNORE,
    Collator,
    EpochSampler,
    LengthAwareBatchSampler,
    balanced_split,
    build_datasets,
    pack,
)
from finetune.demo import write_jsonl
from finetune.parallel import Topology, global_batch_index, make_plan


def supervised_count(labels: list[int], task: str) -> int:
    """The test's own count of what the loss learns from a causal-LM row: every label after the one-token shift
    that is not IGNORE (the product counts it from spans while tokenizing)."""
    assert task == "causal_lm"
    return sum(1 for t in labels[1:] if t != IGNORE)


def build(dataset: str, tokenizer, task: str = "causal_lm", eval_dataset: str | None = None, base_labels=None, **kw):
    """The real builder, with no held-out eval (so train keeps the file's order) unless asked."""
    data = DataArgs(dataset=dataset, eval_dataset=eval_dataset, **{"eval_fraction": 0.0, **kw})
    return build_datasets(data, task, tokenizer, 0, contextlib.nullcontext, base_labels=base_labels)


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def config_error_keys(excinfo) -> list[str]:
    return [k for k, _ in excinfo.value.problems]


def spans(labels: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of supervised positions."""
    out, start = [], None
    for i, t in enumerate([*labels, IGNORE]):
        if t != IGNORE and start is None:
            start = i
        elif t == IGNORE and start is not None:
            out.append((start, i))
            start = None
    return out


# ---------------------------------------------------------------- instruction


def test_instruction_supervises_exactly_response_and_eos(assets):
    tok = assets.tokenizer
    data = DataArgs(dataset=assets.instruction)
    ds = build(assets.instruction, tok)
    raw = read_jsonl(assets.instruction)
    assert ds.format == "instruction" and len(ds.train) == len(raw) and ds.eval is None
    for row, ex in zip(ds.train, raw):
        prompt = tok(data.prompt_template.format(prompt=ex["prompt"]), add_special_tokens=True)["input_ids"]
        response = tok(ex["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert row["input_ids"] == prompt + response
        assert row["labels"] == [IGNORE] * len(prompt) + response
        supervised = [t for t, lab in zip(row["input_ids"], row["labels"]) if lab != IGNORE]
        assert tok.decode(supervised) == ex["response"] + tok.eos_token
    assert ds.supervised_tokens == sum(supervised_count(r, "causal_lm") for r in ds.train["labels"])


def test_alpaca_columns_are_accepted(assets):
    tok = assets.tokenizer
    template = DataArgs().prompt_template
    ds = build(assets.alpaca, tok)
    raw = read_jsonl(assets.alpaca)
    assert ds.format == "instruction" and len(ds.train) == len(raw)
    for row, ex in zip(ds.train, raw):
        cut = next(i for i, t in enumerate(row["labels"]) if t != IGNORE)
        prompt = template.format(prompt=f"{ex['instruction']}\n\n{ex['input']}")
        assert tok.decode(row["input_ids"][:cut]) == prompt
        assert tok.decode(row["input_ids"][cut:]) == ex["output"] + tok.eos_token
        assert row["labels"][cut:] == row["input_ids"][cut:]


# ---------------------------------------------------------------- chat


def test_chat_supervises_only_assistant_turns(assets):
    tok = assets.tokenizer
    ds = build(assets.chat, tok)
    raw = read_jsonl(assets.chat)
    assert ds.format == "chat" and len(ds.train) == len(raw)
    for row, ex in zip(ds.train, raw):
        messages = ex["messages"]
        text = tok.apply_chat_template(messages, tokenize=False)
        assert row["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
        supervised = [tok.decode(row["input_ids"][a:b]) for a, b in spans(row["labels"])]
        # ChatML closes each turn with <|im_end|> and a newline; both are what the model must learn to emit.
        assert supervised == [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        for a, b in spans(row["labels"]):
            assert row["labels"][a:b] == row["input_ids"][a:b]
        unsupervised = tok.decode([t for t, lab in zip(row["input_ids"], row["labels"]) if lab == IGNORE])
        for m in messages:
            if m["role"] != "assistant":
                assert f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" in unsupervised


def test_chat_without_template_is_a_config_error(assets):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
    tok.chat_template = None
    with pytest.raises(ConfigError) as info:
        build(assets.chat, tok)
    assert config_error_keys(info) == ["chat_template"]


# ---------------------------------------------------------------- classification


def test_classification_string_labels_map_to_sorted_ids(assets):
    tok = assets.tokenizer
    ds = build(assets.classification, tok, task="classification", eval_dataset=assets.classification_eval)
    raw, raw_eval = read_jsonl(assets.classification), read_jsonl(assets.classification_eval)
    names = sorted({r["label"] for r in raw})
    assert ds.format == "classification" and ds.label_names == names == ["food", "sports", "tech", "weather"]
    assert ds.train["labels"] == [names.index(r["label"]) for r in raw]
    assert ds.eval["labels"] == [names.index(r["label"]) for r in raw_eval]
    assert ds.train[0]["input_ids"] == tok(raw[0]["text"])["input_ids"]
    assert ds.supervised_tokens == len(raw)


def test_classification_int_labels_are_kept(assets, tmp_path):
    rows = [{"text": f"sample {i}", "label": i % 3} for i in range(12)]
    ds = build(write_jsonl(rows, tmp_path / "ints.jsonl"), assets.tokenizer, task="classification")
    assert ds.label_names == ["0", "1", "2"]
    assert ds.train["labels"] == [r["label"] for r in rows]


def test_classification_labels_take_the_base_models_ids_where_it_names_the_same_labels(assets, tmp_path):
    """A base classifier whose head names the data's labels keeps its ids (as HF run_glue), whatever the labels'
    sorted order: its rows keep their meaning (sorted ids re-mapped them: a fine-tuned weather/sports/tech/food
    classifier labelled food as weather). Strings, ints (named "0".."N-1") and ClassLabel names alike; a base
    naming other labels leaves the data's order."""
    base = ["weather", "sports", "tech", "food"]
    raw, raw_eval = read_jsonl(assets.classification), read_jsonl(assets.classification_eval)
    ds = build(assets.classification, assets.tokenizer, "classification", assets.classification_eval, base_labels=base)
    assert ds.label_names == base
    assert ds.train["labels"] == [base.index(r["label"]) for r in raw]
    assert ds.eval["labels"] == [base.index(r["label"]) for r in raw_eval]
    rows = [{"text": f"sample {i}", "label": i % 3} for i in range(12)]
    ints = write_jsonl(rows, tmp_path / "ints.jsonl")
    ds = build(ints, assets.tokenizer, "classification", base_labels=["2", "0", "1"])
    assert ds.label_names == ["2", "0", "1"] and ds.train["labels"] == [(r["label"] + 1) % 3 for r in rows]
    other = build(assets.classification, assets.tokenizer, "classification", base_labels=["negative", "positive"])
    assert other.label_names == sorted(base)


def test_classification_labels_of_a_classlabel_column_keep_their_names(assets, tmp_path):
    """datasets' ClassLabel (every Hub classification set): the ints are ids of its names, in its order (they were
    named "0".."3"); eval values must be ids of those names."""
    import datasets

    names = ["weather", "sports", "tech", "food"]
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)})

    def parquet(rows: list[dict], name: str) -> str:
        rows = [{"text": r["text"], "label": names.index(r["label"])} for r in rows]
        datasets.Dataset.from_list(rows, features=features).to_parquet(tmp_path / name)
        return str(tmp_path / name)

    raw = read_jsonl(assets.classification)[:40]
    train, evalset = parquet(raw, "train.parquet"), parquet(raw[:8], "eval.parquet")
    ds = build(train, assets.tokenizer, "classification", eval_dataset=evalset)
    assert ds.label_names == names
    assert ds.train["labels"] == [names.index(r["label"]) for r in raw]
    ds = build(train, assets.tokenizer, "classification", eval_dataset=evalset, base_labels=sorted(names))
    assert ds.label_names == sorted(names) and ds.train["labels"] == [sorted(names).index(r["label"]) for r in raw]
    beyond = write_jsonl([{"text": "a", "label": 4}], tmp_path / "beyond.jsonl")
    with pytest.raises(ConfigError) as info:
        build(train, assets.tokenizer, "classification", eval_dataset=beyond)
    assert config_error_keys(info) == ["label_column"] and "['4']" in info.value.problems[0][1]


@pytest.mark.parametrize(
    "labels,words",
    [
        (["x"] * 6, ["one label ('x')", "at least 2 labels"]),
        ([0.5, 1.5, 2.5] * 2, ["floats", "regression is not supported", "whole-number floats as ints"]),
        ([0, 1.0, 2] * 2, ["floats", "whole-number floats as ints"]),
        ([["a"], ["b", "c"]] * 3, ["lists", "multi-label classification is not supported"]),
        ([True, False] * 3, ["booleans", "write them as ints or strings"]),
        ([0, "food"] * 3, ["several types", "give them one type"]),
    ],
    ids=["one_label", "floats", "whole_floats", "lists", "bools", "mixed"],
)
def test_classification_labels_a_classifier_cannot_learn_are_refused_each_with_its_own_fix(
    assets, tmp_path, labels, words
):
    """One label would build a 1-output head, which transformers trains as regression (MSE); floats, lists and
    bools each say what is not supported and what to give (they were all told to "make them one type")."""
    rows = [{"text": f"sample {i}", "label": lab} for i, lab in enumerate(labels)]
    with pytest.raises(ConfigError) as info:
        build(write_jsonl(rows, tmp_path / "labels.jsonl"), assets.tokenizer, task="classification")
    assert config_error_keys(info) == ["label_column"]
    assert all(w in info.value.problems[0][1] for w in words), info.value.problems


def test_classification_missing_label_column(assets):
    with pytest.raises(ConfigError) as info:
        build(assets.classification, assets.tokenizer, task="classification", label_column="topic")
    assert config_error_keys(info) == ["label_column"]
    assert "'topic'" in info.value.problems[0][1]


def test_classification_eval_label_unseen_in_train(assets, tmp_path):
    evalset = write_jsonl(
        [{"text": "a song", "label": "music"}, {"text": "a goal", "label": "sports"}], tmp_path / "eval.jsonl"
    )
    with pytest.raises(ConfigError) as info:
        build(assets.classification, assets.tokenizer, task="classification", eval_dataset=evalset)
    assert config_error_keys(info) == ["label_column"]
    assert "music" in info.value.problems[0][1]


def test_a_label_only_the_held_out_rows_have_is_kept_and_warned_of(assets, tmp_path, caplog):
    """eval_fraction held out the one 'rare' row: the user gave no eval data to fix, so this is no refusal. The label
    set is all rows' (as before the split), and a warning says the label has no training rows. Given eval data
    with a label train lacks is still refused (test_classification_eval_label_unseen_in_train)."""
    from finetune.data import load_splits

    rows = [{"text": f"sample {i}", "label": "common"} for i in range(39)] + [{"text": "odd one", "label": "rare"}]
    data = DataArgs(dataset=write_jsonl(rows, tmp_path / "rare.jsonl"), eval_fraction=0.05)
    assert "rare" in load_splits(data, 10)[1]["label"]  # seed 10 holds it out
    with caplog.at_level("WARNING", logger="finetune"):
        ds = build_datasets(data, "classification", assets.tokenizer, 10, contextlib.nullcontext)
    assert ds.label_names == ["common", "rare"]
    assert set(ds.train["labels"]) == {0} and 1 in ds.eval["labels"]
    assert "['rare']" in caplog.text and "no training row" in caplog.text and "eval_fraction" in caplog.text


# ---------------------------------------------------------------- text


def test_text_is_cut_into_full_blocks_of_max_seq_length(assets):
    tok = assets.tokenizer
    ds = build(assets.text, tok, max_seq_length=64)
    assert ds.format == "text"
    assert len(ds.train) > 10
    assert all(len(ids) == 64 for ids in ds.train["input_ids"])
    assert ds.train["labels"] == ds.train["input_ids"]
    # The blocks are the token stream of the file (each text + EOS) in order; only the tail is cut off.
    stream = [t for r in read_jsonl(assets.text) for t in tok(r["text"])["input_ids"] + [tok.eos_token_id]]
    blocks = [t for ids in ds.train["input_ids"] for t in ids]
    assert blocks == stream[: len(blocks)] and len(stream) - len(blocks) < 64


def test_a_dropped_text_block_is_shown_as_the_row_it_starts_in(assets, tmp_path, caplog):
    """Text rows are joined and cut into blocks, more blocks than rows here: the one-token block of the last batch
    (an empty text's EOS alone) is dropped and shown as the empty row it comes from, not as the row at the block's
    index (past the end of the data: an IndexError once)."""
    tok = assets.tokenizer
    long = " ".join(["the match was good and the team won the league"] * 12)
    rows = [{"text": f"{i} {long}"} for i in range(1000)] + [{"text": ""}]  # the empty row: a batch of its own
    with caplog.at_level("WARNING", logger="finetune"):
        ds = build(write_jsonl(rows, tmp_path / "texts.jsonl"), tok, max_seq_length=64)
    assert len(ds.train) > len(rows) and all(len(ids) == 64 for ids in ds.train["input_ids"])
    said = "1 with a single token (nothing to predict) (e.g. train row 1000: {'text': ''})"
    assert said in caplog.text, caplog.text


# ---------------------------------------------------------------- truncation


def test_examples_truncated_to_no_response_are_dropped(assets, tmp_path):
    tok = assets.tokenizer
    template = DataArgs().prompt_template
    short, long = "Which topic?", "Which topic is this about? " + "the match was good " * 20
    max_len = len(tok(template.format(prompt=short))["input_ids"]) + 3
    assert len(tok(template.format(prompt=long))["input_ids"]) >= max_len
    rows = [
        {"prompt": short, "response": "sports"},
        {"prompt": long, "response": "sports"},
        {"prompt": short, "response": "It is about the weather, rain and snow, cold."},  # kept, response cut
        {"prompt": long, "response": "tech"},
    ]
    ds = build(write_jsonl(rows, tmp_path / "mixed.jsonl"), tok, max_seq_length=max_len)
    assert len(ds.train) == 2
    kept = [tok.decode(ids) for ids in ds.train["input_ids"]]
    assert all(short in text and "the match" not in text for text in kept)
    assert all(len(ids) <= max_len for ids in ds.train["input_ids"])
    assert len(ds.train[1]["input_ids"]) == max_len
    assert ds.supervised_tokens == sum(supervised_count(r, "causal_lm") for r in ds.train["labels"]) > 0

    only_long = write_jsonl([rows[1], rows[3]], tmp_path / "long.jsonl")
    with pytest.raises(ConfigError) as info:
        build(only_long, tok, max_seq_length=max_len)
    assert config_error_keys(info) == ["dataset"]


def test_null_answers_are_named_not_blamed_on_truncation(assets, tmp_path, caplog):
    """Rows whose response is null have nothing to learn: the warning counts them apart from truncated rows, and
    when every row is null the problem names the null column, not max_seq_length."""
    tok = assets.tokenizer
    rows = [{"prompt": f"Which topic? {i}", "response": None if i % 2 else "sports"} for i in range(6)]
    with caplog.at_level("WARNING", logger="finetune"):
        ds = build(write_jsonl(rows, tmp_path / "some_null.jsonl"), tok)
    assert len(ds.train) == 3
    said = "dropped 3 of 6 training rows with nothing to learn: 3 with a null 'response' (e.g. train row 1: "
    assert said in caplog.text and "truncated" not in caplog.text
    nothing = [{**r, "response": None} for r in rows]
    with pytest.raises(ConfigError) as info:
        build(write_jsonl(nothing, tmp_path / "all_null.jsonl"), tok)
    assert config_error_keys(info) == ["response_column"]
    assert "null 'response'" in str(info.value) and "max_seq_length" not in str(info.value)


def test_an_eval_set_with_no_row_left_is_refused_before_training(assets, tmp_path, caplog):
    """Eval rows dropped like train's are counted in the log; an eval set left with none (it would fail at the first
    eval, perhaps hours in) is refused before training, naming where the eval rows came from and why they went."""
    from finetune.data import load_splits

    tok = assets.tokenizer
    rows = [{"prompt": f"Which topic? {i}", "response": "sports"} for i in range(20)]
    train = write_jsonl(rows, tmp_path / "train.jsonl")
    some_null = write_jsonl([{**r, "response": None if i == 1 else "food"} for i, r in enumerate(rows[:3])],
                            tmp_path / "some_null.jsonl")  # fmt: skip
    with caplog.at_level("WARNING", logger="finetune"):
        ds = build(train, tok, eval_dataset=some_null)
    assert len(ds.eval) == 2
    assert "dropped 1 of 3 eval rows with nothing to learn: 1 with a null 'response' (e.g. eval row 1: " in caplog.text

    all_null = write_jsonl([{**r, "response": None} for r in rows[:3]], tmp_path / "all_null.jsonl")
    with pytest.raises(ConfigError) as info:
        build(train, tok, eval_dataset=all_null)
    [(key, message)] = info.value.problems
    assert key == "eval_dataset" and "all_null.jsonl" in message and "3 with a null 'response'" in message, message

    # held out by eval_fraction: the rows the seeded split holds out (it depends on the row count only) made null
    _, held = load_splits(DataArgs(dataset=train, eval_fraction=0.1), 0)
    gone = set(held["prompt"])
    dropped = write_jsonl([{**r, "response": None} if r["prompt"] in gone else r for r in rows], tmp_path / "d.jsonl")
    with pytest.raises(ConfigError) as info:
        build(dropped, tok, eval_fraction=0.1)
    [(key, message)] = info.value.problems
    assert key == "eval_fraction" and "2 with a null 'response'" in message and "eval_fraction: 0" in message, message

    # a mixture: a source left with no eval row evaluates nothing of its own (the others' rows remain); none left
    from finetune.config import build_config
    from finetune.mixture import build_mixture_datasets

    def mixture(*evals):
        sources = [{"dataset": train, "eval_dataset": e, "name": f"s{i}"} for i, e in enumerate(evals)]
        run = {"model": assets.llama, "datasets": sources, "max_seq_length": 64, "output_dir": str(tmp_path / "x")}
        return build_mixture_datasets(build_config(run).data, "causal_lm", tok, 0, contextlib.nullcontext)

    assert len(mixture(all_null, some_null).eval) == 2
    with pytest.raises(ConfigError) as info:
        mixture(all_null, all_null)
    assert [key for key, _ in info.value.problems] == ["datasets"], info.value.problems


@pytest.mark.parametrize("template", ["$A </s>", "<s> $A </s>"])  # T5's and BART's special tokens
def test_a_long_seq2seq_source_is_cut_as_the_tokenizer_cuts_it(assets, tmp_path, template):
    """An encoder input longer than max_seq_length keeps the special tokens the tokenizer adds (the EOS T5 and BART
    end it with): the rows are tokenizer(source, truncation=True, max_length=...)'s, as transformers' own
    seq2seq examples make them; a source that fits is as before."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.root / "tokenizer")
    specials = [("<s>", tok.bos_token_id), ("</s>", tok.eos_token_id)]
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    sources = ["the match was good and the team won " * 5, "rain and snow"]
    rows = [{"source": s, "target": "sports"} for s in sources]
    ds = build(write_jsonl(rows, tmp_path / "pairs.jsonl"), tok, task="seq2seq", max_seq_length=16)
    assert len(tok(sources[0])["input_ids"]) > 16
    assert ds.train["input_ids"] == [tok(s, truncation=True, max_length=16)["input_ids"] for s in sources]
    assert ds.train["input_ids"][0][-1] == tok.eos_token_id


# ---------------------------------------------------------------- packing


def test_pack_keeps_examples_apart():
    lengths = [5, 3, 7, 2, 6, 8]
    examples = [list(range(100 * k + 1, 100 * k + 1 + n)) for k, n in enumerate(lengths)]
    # Labels == input_ids: every token (also each example's first) is a candidate target.
    table = pa.table({"input_ids": examples, "labels": [list(e) for e in examples]})
    rows = pack(table, max_len=10).to_pydict()
    assert pack(table.slice(0, 0), max_len=10).to_pydict() == {"input_ids": [], "labels": [], "position_ids": []}
    assert [len(r) for r in rows["input_ids"]] == [10, 10, 6, 5]  # first-fit decreasing: 8+2, 7+3, 6, 5
    segments = []
    for ids, labels, pos in zip(rows["input_ids"], rows["labels"], rows["position_ids"]):
        assert len(ids) == len(labels) == len(pos) <= 10
        starts = [i for i, p in enumerate(pos) if p == 0]
        for n, (a, b) in enumerate(zip(starts, [*starts[1:], len(ids)])):
            assert pos[a:b] == list(range(b - a))
            seg = ids[a:b]
            segments.append(seg)
            # A later example's first token must not be learnt from the previous example.
            assert labels[a:b] == ([IGNORE] + seg[1:] if n else seg)
    assert sorted(segments) == sorted(examples)
    per_example = sum(supervised_count(e, "causal_lm") for e in examples)
    assert per_example == sum(n - 1 for n in lengths)
    rows_as_examples = [dict(zip(rows, values)) for values in zip(*rows.values())]
    assert len(rows_as_examples) == 4
    assert Collator(pad_token_id=0)(rows_as_examples)["num_supervised"].item() == per_example


def test_packing_through_the_builder(assets):
    tok = assets.tokenizer
    plain = build(assets.instruction, tok, max_seq_length=128)
    packed = build(assets.instruction, tok, max_seq_length=128, packing=True)
    assert len(packed.train) <= len(plain.train) // 2  # these examples fit at least two to a row
    examples = plain.train["input_ids"]
    segments = []
    for row in packed.train:
        assert len(row["input_ids"]) <= 128
        pos = row["position_ids"]
        starts = [i for i, p in enumerate(pos) if p == 0]
        for a, b in zip(starts, [*starts[1:], len(pos)]):
            assert pos[a:b] == list(range(b - a))
            segments.append(row["input_ids"][a:b])
    assert sorted(segments) == sorted(list(e) for e in examples)  # every example exactly once
    fill = sum(len(r) for r in packed.train["input_ids"]) / (len(packed.train) * 128)
    assert fill > 0.9, fill  # first-fit decreasing leaves little room in a row
    collate = Collator(tok.pad_token_id)
    rows = list(packed.train)
    reported = sum(collate(rows[i : i + 4])["num_supervised"].item() for i in range(0, len(rows), 4))
    counted = sum(supervised_count(lab, "causal_lm") for lab in plain.train["labels"])
    assert reported == counted == packed.supervised_tokens == plain.supervised_tokens


# Tiny configs of several architectures: (model_type, sizes, keeps the examples of a packed row apart).
PACKING_MODELS = [
    ("llama", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4), True),
    (
        "gemma2",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8),
        True,
    ),
    ("gpt2", dict(n_embd=32, n_layer=2, n_head=4), True),
    (
        "mixtral",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        True,
    ),
    (
        "opt",
        dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32),
        False,
    ),
    ("falcon", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4), False),
    ("bloom", dict(hidden_size=32, n_layer=2, n_head=4), False),
    ("biogpt", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4), False),
]


@pytest.mark.parametrize(("model_type", "sizes", "apart"), PACKING_MODELS, ids=[m[0] for m in PACKING_MODELS])
def test_packing_isolation_is_decided_per_model_type(model_type, sizes, apart):
    """model.packing_isolates (packing: true is refused where it is False) against a real forward: the second
    example of a packed row (position_ids restarting, no padding mask, as the collator gives them) gets the logits
    it gets alone where the model keeps examples apart, and other logits where it lets them attend to each other."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model import packing_isolates

    config = AutoConfig.for_model(model_type, vocab_size=300, **sizes)
    assert packing_isolates(config) is apart
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(config).eval()
    a, b = torch.randint(3, 300, (1, 7)), torch.randint(3, 300, (1, 9))
    positions = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    with torch.no_grad():
        packed = net(input_ids=torch.cat([a, b], 1), position_ids=positions, use_cache=False).logits[0, 7:]
        alone = net(input_ids=b, use_cache=False).logits[0]
    assert torch.allclose(packed, alone, atol=1e-5) is apart, (packed - alone).abs().max()


# ---------------------------------------------------------------- collation


@pytest.mark.parametrize(("lengths", "width"), [([3, 5], 8), ([8, 2], 8), ([9, 1], 16), ([15], 16)])
def test_collator_pads_unpacked_examples(lengths, width):
    examples = [
        {"input_ids": [10 + i for i in range(n)], "labels": [IGNORE] * (n // 2) + [10 + i for i in range(n // 2, n)]}
        for n in lengths
    ]
    batch = Collator(pad_token_id=7)(examples)
    assert "position_ids" not in batch
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (len(lengths), width)
    for k, (ex, n) in enumerate(zip(examples, lengths)):
        assert batch["input_ids"][k].tolist() == ex["input_ids"] + [7] * (width - n)
        assert batch["labels"][k].tolist() == ex["labels"] + [IGNORE] * (width - n)
        assert batch["attention_mask"][k].tolist() == [1] * n + [0] * (width - n)
    assert batch["num_tokens"].item() == sum(lengths)
    assert batch["num_positions"].item() == len(lengths) * width
    assert batch["num_supervised"].item() == sum(supervised_count(e["labels"], "causal_lm") for e in examples)
    assert batch["num_supervised"].item() == (batch["labels"][:, 1:] != IGNORE).sum().item()


def test_collator_packed_rows_get_position_ids_not_attention_mask():
    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, IGNORE, 4, 5], "position_ids": [0, 1, 0, 1, 2]},
        {"input_ids": [6, 7, 8, 9, 10, 11, 12, 13, 14], "labels": [6] * 9, "position_ids": [0, 1, 2, 3, 0, 1, 2, 3, 4]},
    ]
    batch = Collator(pad_token_id=0)(rows)
    assert "attention_mask" not in batch
    assert batch["position_ids"].shape == (2, 16)
    assert batch["position_ids"][0].tolist() == [0, 1, 0, 1, 2] + list(range(11))
    assert batch["position_ids"][1].tolist() == rows[1]["position_ids"] + list(range(7))
    assert batch["labels"][0, 5:].eq(IGNORE).all() and batch["labels"][1, 9:].eq(IGNORE).all()
    assert batch["input_ids"][0, 5:].eq(0).all()
    assert batch["num_tokens"].item() == 14
    assert batch["num_positions"].item() == 2 * 16
    assert batch["num_supervised"].item() == 3 + 8


def test_collator_rows_without_padding_or_packing_get_neither():
    """Nothing to mask: the model takes its plain causal path (no mask built, none read on the host)."""
    whole = [{"input_ids": list(range(1, 9)), "labels": list(range(1, 9))} for _ in range(2)]
    assert not {"attention_mask", "position_ids"} & Collator(pad_token_id=0)(whole).keys()
    one_each = [{**row, "position_ids": list(range(8))} for row in whole]
    assert not {"attention_mask", "position_ids"} & Collator(pad_token_id=0)(one_each).keys()
    two_in_one = [{**whole[0], "position_ids": [0, 1, 2, 0, 1, 2, 3, 4]}, one_each[1]]
    assert Collator(pad_token_id=0)(two_in_one)["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    padded = [whole[0], {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]
    assert Collator(pad_token_id=0)(padded)["attention_mask"].sum(1).tolist() == [8, 3]


def test_collator_classification_counts_examples():
    examples = [
        {"input_ids": [1, 2, 3], "labels": 2},
        {"input_ids": [4] * 11, "labels": 0},
        {"input_ids": [5], "labels": 1},
    ]
    batch = Collator(pad_token_id=0)(examples)
    assert batch["labels"].tolist() == [2, 0, 1]
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (3, 16)
    assert batch["attention_mask"].sum(1).tolist() == [3, 11, 1]
    assert batch["num_tokens"].item() == 15
    assert batch["num_supervised"].item() == 3


# ---------------------------------------------------------------- order


def test_epoch_sampler_depends_only_on_seed_and_epoch():
    a, b = EpochSampler(50, seed=3), EpochSampler(50, seed=3)
    first = list(a)
    assert sorted(first) == list(range(50)) and len(a) == 50
    assert list(b) == first
    a.set_epoch(1)
    b.set_epoch(1)
    second = list(a)
    assert list(b) == second and sorted(second) == list(range(50))
    assert second != first
    assert list(EpochSampler(50, seed=4)) != first
    a.set_epoch(0)
    assert list(a) == first


# ---------------------------------------------------------------- step arithmetic


def train_args(**kw) -> TrainArgs:
    return TrainArgs(**{"per_device_train_batch_size": 4, **kw})


def ranks(n: int, tp: int = 1) -> Topology:
    """n processes, data parallel unless tp > 1 (a TP group's ranks hold the same batch)."""
    return Topology("ddp", "MULTI_CPU", num_processes=n, num_machines=1, process_index=0, dp=n // tp, tp=tp)


@pytest.mark.parametrize("n_rows", [64, 67, 100, 9])
def test_steps_per_epoch_depend_on_the_global_batch_only(n_rows):
    one = make_plan(train_args(gradient_accumulation_steps=2), n_rows, ranks(1))
    two = make_plan(train_args(gradient_accumulation_steps=1), n_rows, ranks(2))
    assert one.global_batch_size == two.global_batch_size == 8
    assert one.steps_per_epoch == two.steps_per_epoch == n_rows // 8
    assert one.total_steps == two.total_steps == n_rows // 8  # num_train_epochs 1
    # the last partial global batch is left out of every epoch, identically: the start log says so
    assert one.rows_left_out == two.rows_left_out == n_rows % 8
    said = f"({n_rows // 8} per epoch; {n_rows % 8} rows left out each epoch: the last partial global batch)"
    assert (said in one.describe()) == (said in two.describe()) == (n_rows % 8 > 0), one.describe()
    assert "left out" not in one.describe() or n_rows % 8


def test_plan_totals_warmup_and_scheduler_steps():
    assert make_plan(train_args(num_train_epochs=3.0), 100, ranks(1)).total_steps == 3 * 25
    assert make_plan(train_args(num_train_epochs=1.4), 100, ranks(2)).total_steps == 17  # ceil(1.4 * 12)
    plan = make_plan(train_args(max_steps=7, num_train_epochs=100.0, warmup_ratio=0.1), 100, ranks(2))
    assert (plan.steps_per_epoch, plan.total_steps, plan.warmup_steps) == (12, 7, 1)  # ceil(0.7)
    assert plan.scheduler_steps == (2, 14)
    plan = make_plan(train_args(max_steps=10, warmup_ratio=0.25), 100, ranks(4))
    assert plan.warmup_steps == 3 and plan.scheduler_steps == (12, 40)
    plan = make_plan(train_args(max_steps=10, warmup_ratio=0.25, warmup_steps=5), 100, ranks(1))
    assert plan.warmup_steps == 5 and plan.scheduler_steps == (5, 10)
    # TP 2 x DP 2 on 4 processes: 2 batches per micro step, the scheduler stepped by all 4 processes
    plan = make_plan(train_args(max_steps=10, warmup_steps=2), 100, ranks(4, tp=2))
    assert plan.global_batch_size == 8 and plan.steps_per_epoch == 12 and plan.scheduler_steps == (8, 40)


def test_plan_refuses_data_smaller_than_one_global_batch():
    assert make_plan(train_args(), 8, ranks(2)).steps_per_epoch == 1
    with pytest.raises(ConfigError) as info:
        make_plan(train_args(), 7, ranks(2))
    assert config_error_keys(info) == ["per_device_train_batch_size"]
    assert "needs 8 rows" in info.value.problems[0][1] and "has 7" in info.value.problems[0][1]


@pytest.mark.parametrize("shuffled", [False, True])
def test_global_batch_index_matches_accelerate_sharding(shuffled):
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    n, micro = 70, 4  # 17 micro batches: the last, incomplete global batch is not used
    order = list(EpochSampler(n, seed=1)) if shuffled else range(n)
    batches = list(BatchSampler(order, batch_size=micro, drop_last=True))
    used: dict[tuple[int, int], list[set[int]]] = {}
    for world, ga in [(1, 2), (2, 1), (1, 4), (2, 2), (4, 1)]:
        plan = make_plan(train_args(gradient_accumulation_steps=ga), n, ranks(world))
        shards = [
            list(BatchSamplerShard(BatchSampler(order, batch_size=micro, drop_last=True), world, rank))
            for rank in range(world)
        ]
        assert all(len(s) >= plan.steps_per_epoch * ga for s in shards)
        steps = []
        for step in range(plan.steps_per_epoch):
            positions = set()
            for rank in range(world):
                for m in range(ga):
                    held = shards[rank][step * ga + m]  # what this rank's loader yields at this micro step
                    index = global_batch_index(plan, step, m, rank)
                    assert batches[index] == held, (world, ga, step, rank, m)
                    positions.add(index)
            assert len(positions) == world * ga
            steps.append(positions)
        used[(world, ga)] = steps
    assert used[(1, 2)] == used[(2, 1)] and len(used[(1, 2)]) == 8
    assert used[(1, 4)] == used[(2, 2)] == used[(4, 1)] and len(used[(1, 4)]) == 4
    assert all(torch.tensor(sorted(p)).diff().eq(1).all() for p in used[(2, 2)])


def test_null_responses_are_dropped_not_trained_as_none(assets, tmp_path):
    from finetune.demo import write_jsonl

    path = write_jsonl(
        [{"prompt": "p one", "response": None}, {"prompt": "p two", "response": "yes"}], tmp_path / "nulls.jsonl"
    )
    ds = build_datasets(
        DataArgs(dataset=path, eval_fraction=0.0), "causal_lm", assets.tokenizer, 0, contextlib.nullcontext
    )
    assert len(ds.train) == 1
    supervised = [t for t in ds.train[0]["labels"] if t != -100]
    assert assets.tokenizer.decode(supervised) == "yes</s>"


# ---------------------------------------------------------------- length-aware batching


def padded_cost(lengths: list[int], group: list[int], attention_weight: float) -> float:
    width = -(-max(lengths[i] for i in group) // 8) * 8
    return len(group) * width * (1 + attention_weight * width)


@pytest.mark.parametrize("n,parts", [(16, 2), (64, 16), (32, 32), (24, 3)])
def test_balanced_split_is_a_partition_no_worse_than_fixed_batches(n, parts):
    import random

    rng = random.Random(n * parts)
    w = 1 / (6 * 256)
    worse = 0
    for _ in range(50):
        lengths = [rng.randint(16, 512) for _ in range(n)]
        groups = balanced_split(lengths, parts, w)
        assert len(groups) == parts and all(groups)
        assert sorted(i for g in groups for i in g) == list(range(n))
        assert groups == balanced_split(lengths, parts, w)  # deterministic
        micro = n // parts
        fixed = max(padded_cost(lengths, list(range(k, k + micro)), w) for k in range(0, n, micro))
        ours = max(padded_cost(lengths, g, w) for g in groups)
        worse += ours > fixed
        # the most expensive micro batch is at most the longest example's width times the fixed row count
        assert ours <= padded_cost(lengths, [max(range(n), key=lambda i: lengths[i])] * micro, w)
    assert worse == 0


def test_length_aware_batches_keep_each_steps_examples():
    """Same examples per global batch as the fixed-size order, in GA x world micro batches; the
    split does not depend on how those micro batches are dealt to ranks."""
    import random

    rng = random.Random(0)
    lengths = [rng.randint(16, 512) for _ in range(100)]
    sampler = EpochSampler(100, seed=3)
    batches = LengthAwareBatchSampler(sampler, lengths, global_batch=16, micro_batches=4, attention_weight=0.001)
    for epoch in (0, 1):
        batches.set_epoch(epoch)
        order = list(sampler)
        got = list(batches)
        assert len(got) == len(batches) == 100 // 16 * 4
        for s in range(len(got) // 4):
            assert sorted(i for b in got[4 * s : 4 * s + 4] for i in b) == sorted(order[16 * s : 16 * s + 16])
        widths = [max(lengths[i] for i in b) for b in got]
        assert widths != sorted(widths) or len(set(len(b) for b in got)) > 1  # really reshaped


def test_held_out_eval_is_capped_and_the_rest_trains(assets, tmp_path):
    """eval_fraction_max_rows caps a held-out eval_fraction (the rows it leaves out train); null holds out the
    whole fraction; the split is the same seeded one either way (the capped eval rows are a held-out sample)."""
    rows = [{"prompt": f"Which topic? {i}", "response": "sports"} for i in range(100)]
    path = write_jsonl(rows, tmp_path / "hundred.jsonl")
    capped = build(path, assets.tokenizer, eval_fraction=0.3, eval_fraction_max_rows=7)
    whole = build(path, assets.tokenizer, eval_fraction=0.3, eval_fraction_max_rows=None)
    assert (len(capped.train), len(capped.eval)) == (93, 7)
    assert (len(whole.train), len(whole.eval)) == (70, 30)
    texts = {tuple(ids) for ids in capped.train["input_ids"]} | {tuple(ids) for ids in capped.eval["input_ids"]}
    assert len(texts) == 100  # every row once: in train or in eval


def test_a_second_build_reads_the_datasets_cache(assets, tmp_path):
    """The same data, tokenizer and row-shaping settings: the second build (a fresh tokenizer object, as in a new
    process; data fields that do not shape the rows changed, as between `finetune prepare` and a run) writes no
    cache file and reads the first one's, for train and eval."""
    from transformers import AutoTokenizer

    path = write_jsonl([{"prompt": f"Which topic? {i}", "response": "sports"} for i in range(40)], tmp_path / "d.jsonl")
    kw = {"eval_fraction": 0.25, "packing": True}
    first = build(path, AutoTokenizer.from_pretrained(assets.root / "tokenizer"), **kw)
    here = Path(first.train.cache_files[0]["filename"]).parent  # this file's cache (other tests write elsewhere)

    def files() -> set[str]:
        return {str(p) for p in here.rglob("*.arrow")}

    before = files()
    unrelated = {"length_aware_batching": True, "prepared_data": str(tmp_path / "elsewhere")}
    second = build(path, AutoTokenizer.from_pretrained(assets.root / "tokenizer"), **kw, **unrelated)
    assert files() == before
    for a, b in ((first.train, second.train), (first.eval, second.eval)):
        assert a.cache_files and [f["filename"] for f in a.cache_files] == [f["filename"] for f in b.cache_files]
    assert first.supervised_tokens == second.supervised_tokens > 0


def test_several_preparing_processes_make_the_same_rows(assets, tmp_path):
    """preparing_processes: the default from 2 cores and 50,000 rows (capped at 8), one process below that, the
    configured number always; and rows tokenized by 2 processes are the rows one process makes, in order: chat's,
    and text's blocks, which join rows (each process had cut its own half of the rows, 1,250 here: other blocks
    than one process's batches of 1,000, so a machine's cores chose the training data)."""
    from finetune.data import build_datasets, preparing_processes

    assert preparing_processes(None, 1_000_000, 1) is None and preparing_processes(None, 49_999, 16) is None
    assert preparing_processes(None, 50_000, 2) == 2 and preparing_processes(None, 10**6, 64) == 8
    assert preparing_processes(3, 10, 2) == 3 and preparing_processes(1, 10**6, 8) is None
    from finetune.demo import write_jsonl

    texts = write_jsonl([{"text": f"row {i} " + "word " * (i % 7)} for i in range(2500)], tmp_path / "text.jsonl")
    built = {}
    environ = os.environ
    for name, source in (("chat", assets.chat), ("text", texts)):
        for workers in (None, 2):  # each from its own copy of the file: neither reads the other's cache
            copy = tmp_path / f"{name}_{workers}.jsonl"
            copy.write_text(Path(source).read_text())
            data = DataArgs(dataset=str(copy), max_seq_length=64, eval_fraction=0, preprocessing_num_workers=workers)
            built[name, workers] = build_datasets(data, "causal_lm", assets.tokenizer, 1, contextlib.nullcontext)
    # datasets' os.environ swap is undone: what is set now reaches readers holding the original object
    assert os.environ is environ
    for name, rows in (("chat", 200), ("text", None)):
        one, two = built[name, None].train, built[name, 2].train
        assert len(one) == len(two) > 0 and (rows is None or len(one) == rows), (name, len(one), len(two))
        assert built[name, None].supervised_tokens == built[name, 2].supervised_tokens > 0, name
        assert one["input_ids"] == two["input_ids"] and one["labels"] == two["labels"], name


def test_datasets_still_replaces_os_environ(monkeypatch):
    """The library bug data._os_environ_kept works around: Dataset.map(num_proc=2) leaves os.environ a copy, so
    code holding the original object (default arguments env=os.environ) stops seeing what is set afterwards.
    When this fails, datasets is fixed: remove _os_environ_kept and this test."""
    from datasets import Dataset

    original = os.environ
    monkeypatch.setattr(os, "environ", original)  # put back whatever map leaves, whatever this test asserts
    Dataset.from_dict({"x": list(range(8))}).map(lambda b: b, batched=True, num_proc=2)
    assert os.environ is not original
    os.environ["FINETUNE_SEEN_BY_THE_ORIGINAL"] = "1"
    assert "FINETUNE_SEEN_BY_THE_ORIGINAL" not in original
    del os.environ["FINETUNE_SEEN_BY_THE_ORIGINAL"]


def test_datasets_still_gathers_a_mapped_column_row_by_row(monkeypatch):
    """The library behaviour data.arrow_column works around: reading one column of a set with an indices mapping
    (here after filter, as the tokenized rows are) goes through Table.fast_gather with every row's index, one
    Arrow slice per row. When this fails, datasets takes the rows itself: read the column with
    ds.with_format("arrow")[name] and remove arrow_column. arrow_column gives the same values without it."""
    from datasets import Dataset
    from datasets.table import Table

    from finetune.data import arrow_column

    ds = Dataset.from_dict({"n": list(range(100)), "keep": [i % 3 != 0 for i in range(100)]})
    kept = ds.filter(lambda keep: keep, input_columns="keep").shuffle(seed=1)
    gathered = []
    real = Table.fast_gather
    monkeypatch.setattr(Table, "fast_gather", lambda self, idx: gathered.append(len(idx)) or real(self, idx))
    want = kept.with_format("arrow")["n"].to_pylist()
    assert gathered == [len(kept)] and len(kept) == 66  # every row gathered one by one
    gathered.clear()
    assert arrow_column(kept, "n").to_pylist() == want and gathered == []
    assert want == [r["n"] for r in kept] and want != sorted(want)  # the set's own (shuffled) order
    assert arrow_column(ds, "n").to_pylist() == list(range(100))  # no mapping: the column as it is
