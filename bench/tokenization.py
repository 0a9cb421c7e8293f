"""Tokenization: finetune.data.build_datasets (load, tokenize, filter, pack) on 100k instruction examples with
an empty datasets cache, with 2 preprocessing workers (another empty cache), and again on the first run's cache
(a hit when no new cache file is written). Each in a fresh process (this file's --worker), timed after its
imports and the tokenizer load. (Not named tokenize.py: that would shadow the standard library's module.)

    .venv/bin/python bench/tokenization.py [--quick]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import harness

NAME = "tokenize"
TITLE = "6. tokenize"


def tokenize_set(ctx: harness.Context, n: int) -> str:
    """The instruction set of n examples (the packing benchmark's length distribution), built once per size."""
    from transformers import AutoTokenizer

    from finetune import demo

    path = ctx.work / f"instr_{n // 1000}k.jsonl"
    if not path.exists():
        tok = AutoTokenizer.from_pretrained(ctx.work / "tokenizer")
        demo.write_jsonl(harness.instruction_rows(n, 2, tok), str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
    return str(path)


def run(ctx: harness.Context) -> dict:
    a = harness.assets(ctx)
    n = ctx.option("n_tokenize", 100_000, 20_000)
    dataset = tokenize_set(ctx, n)
    config = harness.write_run_config(
        ctx, "tokenize", model=a["model"], dataset=dataset, format="instruction", max_seq_length=512, packing=True
    )
    out: dict = {}
    cache = Path(tempfile.mkdtemp(prefix="tokenize_cache_", dir=ctx.work))
    fresh = Path(tempfile.mkdtemp(prefix="tokenize_cache_", dir=ctx.work))
    runs = (
        ("first_run", cache, {}),
        ("second_run", cache, {}),  # same cache: every map/filter should be a cache hit
        ("first_run_2_workers", fresh, {"preprocessing_num_workers": 2}),
    )
    try:
        for state, where, overrides in runs:
            spec = {"config": config, "env": {"HF_DATASETS_CACHE": str(where)}, "overrides": overrides}
            before = cache_files(where)
            r = harness.run_worker(ctx, "tokenization.py", "tokenize", spec, f"tokenize_{state}", 2)
            r["new_cache_files"] = len(cache_files(where) - before)
            out[state] = r
            harness.log(
                f"  tokenize {state:<20} {r['build_s']:6.1f} s  ({r['new_cache_files']} new cache files; "
                f"supervised count {r['supervised_count_s']:.1f} s)"
            )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(fresh, ignore_errors=True)
    out["cache_hit"] = out["second_run"]["new_cache_files"] == 0
    out["second_x_first_time"] = out["second_run"]["build_s"] / out["first_run"]["build_s"]
    out["workers_2_x_1"] = out["first_run"]["build_s"] / out["first_run_2_workers"]["build_s"]
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--n_tokenize", type=int, default=None, help="examples to tokenize (100000, quick 20000)")


def cache_files(cache: Path) -> set[str]:
    return {str(p) for p in cache.rglob("*.arrow")}


def worker_tokenize(spec: dict) -> dict:
    """finetune.data.build_datasets, timed, in a process of its own (imports and tokenizer load not counted)."""
    import contextlib

    from finetune import data

    cfg, tok = harness.config_and_tokenizer(spec["config"], **spec.get("overrides", {}))
    t0 = time.perf_counter()
    ds = data.build_datasets(cfg.data, cfg.model.task, tok, cfg.train.seed, contextlib.nullcontext)
    build_s = time.perf_counter() - t0
    # What counting the supervised tokens with a Python loop over every label of every row costs (build_datasets
    # no longer does: it sums a per-row count in Arrow), for comparison.
    t0 = time.perf_counter()
    sum(sum(1 for t in labels[1:] if t != -100) for labels in ds.train["labels"])  # = data.supervised_count
    count_s = time.perf_counter() - t0
    n_raw = sum(1 for _ in open(json.loads(Path(spec["config"]).read_text())["dataset"]))
    return {
        "build_s": build_s,
        "supervised_count_s": count_s,
        "examples": n_raw,
        "examples_per_s": n_raw / build_s,
        "train_rows": len(ds.train),
        "supervised_tokens": ds.supervised_tokens,
    }


def rows(r: dict) -> list[harness.Row]:
    f, s, w = r["first_run"], r["second_run"], r["first_run_2_workers"]
    n = f"{f['examples'] // 1000}k ex"
    note = f"{'cache hit' if r['cache_hit'] else 'CACHE MISS'}; label count {s['supervised_count_s']:.1f} s"
    return [
        harness.Row("6 tokenize", f"first run ({n})", f["examples_per_s"], "examples/s", f"{f['build_s']:.1f} s"),
        harness.Row(
            "6 tokenize",
            "first run, 2 workers",
            w["examples_per_s"],
            "examples/s",
            f"{w['build_s']:.1f} s ({r['workers_2_x_1']:.2f}x)",
        ),
        harness.Row("6 tokenize", "second run", s["build_s"], "s", note, "hit", r["cache_hit"]),
    ]


def plot(ax, r: dict) -> None:
    ax.bar(["first run", "second run"], [r["first_run"]["build_s"], r["second_run"]["build_s"]], color="tab:blue")
    ax.set_ylabel("s to build the data")
    ax.set_title(f"6. tokenize {r['first_run']['examples'] // 1000}k examples")


if __name__ == "__main__":
    if not harness.worker_main({"tokenize": worker_tokenize}):
        harness.main(sys.modules[__name__])
