"""`finetune prepare`: a run config's data tokenized, filtered and packed once (finetune/prepared.py).

    finetune prepare --config run.yaml --prepared_data /shared/prepared/run1

Then every machine of the job reads the rows from there (`--prepared_data /shared/prepared/run1`, a shared path, or
run prepare on each machine into its own) without the raw data. One process; `preprocessing_num_workers` is used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

from finetune.config import ConfigError
from finetune.config.load import parse

# Problems of the run config that do not concern preparing its data (prepared_data: checked here, the other way).
NOT_FOR_PREPARE = ("output_dir", "overwrite_output_dir", "resume_from_checkpoint", "prepared_data")


def main(argv: list[str]) -> int:
    """Parse the run config (the same fields as a run), prepare its data into --prepared_data; exit 2 on bad input."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\nIt takes the run's own options (finetune --help); --prepared_data is required.")
        return 0
    try:
        cfg = _config(argv)
        start = time.perf_counter()
        ds = _prepare(cfg)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    eval_rows = len(ds.eval) if ds.eval is not None else 0
    print(
        f"prepared {len(ds.train)} train rows ({ds.supervised_tokens} supervised tokens), {eval_rows} eval rows in "
        f"{time.perf_counter() - start:.1f} s into {os.path.abspath(cfg.data.prepared_data)}\n"
        f"train with them: finetune --config <this config> --prepared_data {cfg.data.prepared_data}"
    )
    return 0


def _config(argv: list[str]):
    cfg = parse(argv, ignore=NOT_FOR_PREPARE)
    target = cfg.data.prepared_data
    if not target:
        raise ConfigError([("prepared_data", "is required: the directory to write the prepared data into")])
    if cfg.data.streaming:
        raise ConfigError(
            [
                (
                    "streaming",
                    "prepare writes the whole data, tokenized, to disk, and a stream is read as training goes: "
                    "set streaming: false to prepare, or train with streaming: true and no prepare",
                )
            ]
        )
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ConfigError(
            [
                (
                    "prepared_data",
                    f"{target!r} exists and is not empty; give a new directory (prepared data is never overwritten), "
                    "or delete it first",
                )
            ]
        )
    return cfg


def _prepare(cfg):
    """The run config's data, built as a run builds it (finetune.mixture), saved into prepared_data."""
    from finetune import mixture, prepared
    from finetune.model import base_label_names, load_tokenizer

    logging.basicConfig(level=logging.INFO, format="[finetune] %(message)s", stream=sys.stdout)
    tokenizer = load_tokenizer(cfg.model)
    ds = mixture.build_mixture_datasets(
        cfg.data, cfg.model.task, tokenizer, cfg.train.seed, contextlib.nullcontext, base_label_names(cfg.model)
    )
    prepared.save(ds, cfg, tokenizer, cfg.data.prepared_data)
    return ds
