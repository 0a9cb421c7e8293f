"""Dataset mixtures: the config (every bad source reported with its key), the epoch order (proportions, the
same rows per optimizer step under every layout, `dataset:` alone unchanged), and one real run under DDP and
one process with eval per source."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
import yaml
from conftest import finetune

from finetune.config import ConfigError, build_config, sources_of
from finetune.data import EpochSampler
from finetune.mixture import MixtureSampler, quotas


def problems_of(values: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        build_config(values)
    keys = [k for k, _ in info.value.problems]
    assert len(keys) == len(set(keys)), info.value.problems
    return dict(info.value.problems)


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = {"model": str(model), "output_dir": str(tmp_path / "out")}
    for name in ("chat", "alpaca", "cls"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps({"text": "t", "label": 1}) + "\n")
        out[name] = str(path)
    return out


# ---------------------------------------------------------------- config


def test_sources_inherit_the_top_level_and_get_names(files):
    cfg = build_config(
        {
            "model": files["model"],
            "output_dir": files["output_dir"],
            "eval_fraction": 0.2,
            "datasets": [
                {"dataset": files["chat"], "weight": 0.6, "format": "chat"},
                {"dataset": files["alpaca"], "weight": 0.4, "eval_fraction": 0.0, "name": "alp"},
            ],
        }
    )
    chat, alp = sources_of(cfg.data)
    assert (chat.name, chat.weight, chat.args.format, chat.args.eval_fraction) == ("chat", 0.6, "chat", 0.2)
    assert (alp.name, alp.weight, alp.args.format, alp.args.eval_fraction) == ("alp", 0.4, "auto", 0.0)
    assert alp.args.dataset == files["alpaca"] and alp.args.datasets is None
    one = sources_of(build_config({"model": files["model"], "dataset": files["chat"], "output_dir": "o"}).data)
    assert [(s.name, s.weight) for s in one] == [("chat", 1.0)]


def test_eval_data_of_a_source_counts_for_generation_and_eval_steps(files):
    """Eval data given only inside a source (top-level eval_fraction 0) is eval data for every check."""
    cfg = build_config(
        {
            "model": files["model"],
            "output_dir": files["output_dir"],
            "eval_fraction": 0,
            "eval_steps": 5,
            "generation_max_new_tokens": 8,
            "datasets": [{"dataset": files["alpaca"], "format": "instruction", "eval_fraction": 0.1}],
        }
    )
    assert cfg.train.generation_max_new_tokens == 8
    no_eval = problems_of(
        {
            "model": files["model"],
            "output_dir": files["output_dir"],
            "eval_fraction": 0,
            "generation_max_new_tokens": 8,
            "datasets": [{"dataset": files["alpaca"], "format": "instruction"}],
        }
    )
    assert "no eval data" in no_eval["generation_max_new_tokens"]


def test_every_bad_source_is_reported_with_its_key(files):
    found = problems_of(
        {
            "model": files["model"],
            "output_dir": files["output_dir"],
            "eval_dataset": files["chat"],
            "datasets": [
                {"dataset": files["chat"], "weight": 0, "format": "chat"},
                {"dataset": files["cls"], "wieght": 1, "format": "classification"},
                {"dataset": files["alpaca"], "weight": -1.5, "max_seq_length": 8},
                {"dataset": files["chat"].replace("chat", "nowhere"), "name": "x y"},
                {"dataset": files["alpaca"]},
                {"dataset": files["alpaca"], "name": "six", "weight": "heavy", "eval_fraction": "most"},
            ],
        }
    )
    assert "> 0" in found["datasets[0].weight"]
    assert "did you mean 'weight'" in found["datasets[1].wieght"]
    assert "cannot mix with datasets[0]'s 'chat'" in found["datasets[1].format"]
    assert "> 0" in found["datasets[2].weight"]
    assert "set it at the top level" in found["datasets[2].max_seq_length"]
    assert "nowhere" in found["datasets[3].dataset"]
    assert "letters, digits" in found["datasets[3].name"]
    assert "also datasets[2]'s name" in found["datasets[4].name"]
    assert "inside a source" in found["eval_dataset"]
    assert set(found) == {
        "datasets[0].weight",
        "datasets[1].wieght",
        "datasets[1].format",
        "datasets[2].weight",
        "datasets[2].max_seq_length",
        "datasets[3].dataset",
        "datasets[3].name",
        "datasets[4].name",
        "datasets[5].weight",
        "datasets[5].eval_fraction",
        "eval_dataset",
    }


def test_dataset_and_datasets_together_or_an_empty_list(files):
    both = problems_of({"model": files["model"], "dataset": files["chat"], "datasets": [{"dataset": files["chat"]}]})
    assert "give one" in both["datasets"]
    assert "is empty" in problems_of({"model": files["model"], "datasets": []})["datasets"]


def test_datasets_on_the_command_line_is_yaml(files, tmp_path):
    from finetune.config import parse

    text = f"[{{dataset: {files['chat']}, weight: 2}}, {{dataset: {files['alpaca']}}}]"
    cfg = parse(["--model", files["model"], "--datasets", text, "--output_dir", str(tmp_path / "o")])
    assert [(s.name, s.weight) for s in sources_of(cfg.data)] == [("chat", 2.0), ("alpaca", 1.0)]


# ---------------------------------------------------------------- the order


def test_mixture_proportions_within_one_percent_over_10000_draws():
    weights = [0.6, 0.3, 0.1]
    sizes = [900, 250, 850]  # one source upsampled, one downsampled
    sampler = MixtureSampler(sizes, weights, seed=7)
    offsets = [0, 900, 1150]
    draws: list[int] = []
    epoch = 0
    while len(draws) < 10_000:
        sampler.set_epoch(epoch)
        draws += list(sampler)
        epoch += 1
    draws = draws[:10_000]
    source = [max(i for i in range(3) if row >= offsets[i]) for row in draws]
    counts = Counter(source)
    for i, w in enumerate(weights):
        assert abs(counts[i] / 10_000 - w) <= 0.01, (i, counts)
    # Mixed, not in blocks: the first 10% of an epoch already holds every source near its share.
    head = Counter(source[:200])
    assert all(abs(head[i] / 200 - w) < 0.1 for i, w in enumerate(weights)), head
    # Within a source, rows go through a whole shuffle before any repeats, across epochs too.
    for i in range(3):
        rows = [r - offsets[i] for r, s in zip(draws, source) if s == i]
        for k in range(len(rows) // sizes[i]):
            assert sorted(rows[k * sizes[i] : (k + 1) * sizes[i]]) == list(range(sizes[i]))


def test_quotas_are_exact_to_one_row():
    assert quotas(10, [1, 1, 1]) == [4, 3, 3]
    assert quotas(7, [0.5, 0.5]) == [4, 3]
    for n, weights in [(1000, [0.6, 0.3, 0.1]), (999, [3, 1]), (5, [0.01, 0.99])]:
        q = quotas(n, weights)
        assert sum(q) == n and all(abs(c - n * w / sum(weights)) < 1 for c, w in zip(q, weights))


def test_one_source_is_todays_epoch_order():
    """`dataset:` alone is a one-source mixture whose order is EpochSampler's, epoch by epoch (the order every
    earlier run and parity test used)."""
    mix, old = MixtureSampler([97], [1.0], seed=42), EpochSampler(97, seed=42)
    for epoch in range(4):
        mix.set_epoch(epoch)
        old.set_epoch(epoch)
        assert list(mix) == list(old)


def test_order_depends_only_on_seed_and_epoch():
    a, b = MixtureSampler([30, 20], [1, 3], seed=1), MixtureSampler([30, 20], [1, 3], seed=1)
    assert list(a) == list(b) and sorted(set(a)) != list(range(50))  # source 1 upsampled: repeats
    b.set_epoch(1)
    assert list(b) != list(a)
    assert list(MixtureSampler([30, 20], [1, 3], seed=2)) != list(a)


def test_every_valid_seed_orders_a_mixture():
    """A seed up to 2**32 - 1 (a `date +%s` one: 1.7e9) crashed a mixture at its first batch (the derived seeds
    passed 64 bits: "Overflow when unpacking long long"); each one orders the rows."""
    for seed in (1_700_000_000, 2**32 - 1):
        order = list(MixtureSampler([30, 20], [1, 3], seed=seed))
        assert len(order) == 50 and set(order) <= set(range(50)) and set(range(30, 50)) <= set(order)


def rows_per_step(order: list[int], world: int, ga: int, micro: int) -> list[set[int]]:
    """The rows each optimizer step trains on under `world` processes x `ga` accumulation: what each rank's
    loader yields, through accelerate's own data-loader sharding of the same sampler."""
    from accelerate.data_loader import prepare_data_loader

    class Fixed(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(order)

        def __len__(self):
            return len(order)

    loaders = [
        list(
            prepare_data_loader(
                torch.utils.data.DataLoader(range(len(order)), batch_size=micro, sampler=Fixed(), drop_last=True),
                num_processes=world,
                process_index=rank,
                put_on_device=False,
            )
        )
        for rank in range(world)
    ]
    steps = len(order) // (micro * ga * world)
    return [
        {int(r) for rank in range(world) for m in range(ga) for r in loaders[rank][s * ga + m]} for s in range(steps)
    ]


def test_same_rows_per_step_under_1x2_and_2x1():
    """The global order is decided before sharding: 1 process x GA 2 and 2 processes x GA 1 train on the same
    rows at every optimizer step, in every epoch."""
    sampler = MixtureSampler([40, 13, 27], [0.5, 0.2, 0.3], seed=5)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        order = list(sampler)
        one, two = rows_per_step(order, 1, 2, 4), rows_per_step(order, 2, 1, 4)
        assert len(one) == 10 and one == two
        assert [s for step in one for s in sorted(step)] != sorted(s for step in one for s in step)  # shuffled


# ---------------------------------------------------------------- a real run


@pytest.mark.slow
def test_mixture_run_equal_under_ddp_and_one_process_with_eval_per_source(assets, tmp_path):
    """Chat + instruction + text, packed: 2 processes x GA 1 and 1 process x GA 2 give the same losses and eval;
    eval is reported per source, and the overall eval_loss is the supervised-count-weighted mean of the
    sources' (counts computed here from each source's own eval split)."""
    import contextlib

    from transformers import AutoTokenizer

    from finetune.data import build_datasets

    sources = [
        {"dataset": assets.chat, "weight": 0.5, "eval_fraction": 0.1},
        {"dataset": assets.instruction, "weight": 0.3, "name": "instr"},
        {"dataset": assets.text, "weight": 0.2, "eval_fraction": 0.15},
    ]
    run = {
        "model": assets.llama,
        "datasets": sources,
        "eval_fraction": 0.05,
        "max_seq_length": 64,
        "per_device_train_batch_size": 4,
        "max_steps": 6,
        "eval_steps": 3,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "save_steps": None,
        "packing": True,
    }
    config = tmp_path / "mix.yaml"
    config.write_text(yaml.safe_dump(run))
    ddp = finetune(tmp_path / "ddp", "--config", str(config), launcher="ddp")
    one = finetune(tmp_path / "one", "--config", str(config), "--gradient_accumulation_steps", "2")
    assert len(ddp.losses()) == 6
    assert max(abs(a - b) / b for a, b in zip(ddp.losses(), one.losses(), strict=True)) <= 1e-5
    assert [r["tokens_seen"] for r in ddp.train_rows] == [r["tokens_seen"] for r in one.train_rows]
    names = ["chat", "instr", "text"]
    tokenizer = AutoTokenizer.from_pretrained(assets.llama)
    counts = {}
    for name, cfg in zip(names, build_config({**run, "output_dir": str(tmp_path / "x")}).data.datasets):
        data = build_config({**run, "datasets": [cfg], "output_dir": str(tmp_path / "x")}).data
        ds = build_datasets(sources_of(data)[0].args, "causal_lm", tokenizer, 42, contextlib.nullcontext)
        counts[name] = sum(sum(1 for t in lab[1:] if t != -100) for lab in ds.eval["labels"])
    assert all(counts.values())
    assert ddp.eval_rows, "no eval rows"
    for a, b in zip(ddp.eval_rows, one.eval_rows, strict=True):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
        losses = {n: a[f"eval_{n}_loss"] for n in names}
        assert all(math.isfinite(v) for v in losses.values())
        mean = sum(losses[n] * counts[n] for n in names) / sum(counts.values())
        assert a["eval_loss"] == pytest.approx(mean, rel=1e-6)
        assert a[f"eval_{names[0]}_perplexity"] == pytest.approx(math.exp(losses[names[0]]), rel=1e-6)
    assert "source chat:" in ddp.output and "per epoch (weight 0.5)" in ddp.output


def test_generation_eval_takes_a_mixture_of_sources_with_answers(assets, tmp_path):
    """Chat and instruction sources both have prompts and answers: generation eval runs on their mix (it was refused:
    'the data is in the mixed format'); a text source with eval rows is named, and one without any is no matter."""
    import contextlib

    from transformers import AutoTokenizer

    from finetune.generate import build_generation
    from finetune.mixture import build_mixture_datasets

    tokenizer = AutoTokenizer.from_pretrained(assets.llama)
    base = {"model": assets.llama, "output_dir": str(tmp_path / "x"), "eval_fraction": 0, "max_seq_length": 64}
    chat = {"dataset": assets.chat, "eval_fraction": 0.1, "name": "chat"}
    instruction = {"dataset": assets.instruction, "eval_fraction": 0.05, "name": "instr"}

    def generation(*sources):
        cfg = build_config({**base, "datasets": list(sources), "generation_max_new_tokens": 4})
        ds = build_mixture_datasets(cfg.data, "causal_lm", tokenizer, 42, contextlib.nullcontext)
        assert ds.format == "mixed"  # sources of two formats
        return build_generation(cfg, ds, tokenizer)

    mixed = generation(chat, instruction)
    assert mixed is not None and mixed.examples
    assert generation(chat, {"dataset": assets.text, "eval_fraction": 0, "name": "notes"}) is not None
    with pytest.raises(ConfigError) as refused:
        generation(chat, {"dataset": assets.text, "eval_fraction": 0.1, "name": "notes"})
    assert refused.value.problems[0][0] == "generation_max_new_tokens"
    assert "source 'notes' (text format)" in refused.value.problems[0][1], refused.value.problems


@pytest.mark.parametrize("task", ["seq2seq", "preference"])
def test_a_source_reads_its_own_columns(assets, tmp_path, task):
    """Every *_column field can be set per source, as docs/data.md says (source_column, target_column, chosen_column
    and rejected_column were refused: 'unknown field; it applies to every source'), and each source's rows are
    read from its own columns: a seq2seq mixture and a preference mixture of two column namings, eval per source."""
    import contextlib
    import dataclasses

    from transformers import AutoTokenizer

    from finetune.config import SOURCE_FIELDS, DataArgs
    from finetune.mixture import SOURCE, build_mixture_datasets

    assert {f.name for f in dataclasses.fields(DataArgs) if f.name.endswith("_column")} <= set(SOURCE_FIELDS)
    columns = {"seq2seq": ("source_column", "target_column"), "preference": ("chosen_column", "rejected_column")}[task]
    sources = []
    for name, (a, b) in {"one": ("src", "tgt"), "two": ("question", "answer")}.items():
        rows = [{"prompt": f"{name} {i}", a: f"{name} input {i}", b: f"{name} output {i}"} for i in range(20)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sources.append({"dataset": str(path), "name": name, columns[0]: a, columns[1]: b, "eval_fraction": 0.2})
    run = {"datasets": sources, "max_seq_length": 32, "output_dir": str(tmp_path / "out")}
    if task == "seq2seq":
        run |= {"model": assets.t5, "task": "seq2seq", "format": "source_target"}
    else:
        run |= {"model": assets.llama, "method": "dpo", "format": "preference"}
    cfg = build_config(run)
    tokenizer = AutoTokenizer.from_pretrained(run["model"])
    ds = build_mixture_datasets(cfg.data, cfg.model.task, tokenizer, 42, contextlib.nullcontext)
    assert ds.mixture.names == ["one", "two"] and sorted(set(ds.eval[SOURCE])) == [0, 1]
    for i, name in enumerate(["one", "two"]):
        first = ds.mixture.sizes[0] if i else 0
        row = ds.train[first]
        read = row["input_ids"] + row["labels"] if task == "seq2seq" else row["chosen_ids"] + row["rejected_ids"]
        text = tokenizer.decode([t for t in read if t >= 0])
        assert f"{name} input" in text and f"{name} output" in text, (name, text)
