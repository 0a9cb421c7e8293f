"""Prepared data (`finetune prepare`): a run config's data tokenized, filtered and packed once, ahead of a (multi-node)
job, into a directory every rank then reads (memory-mapped) without touching the raw data.

    finetune prepare --config run.yaml --prepared_data /shared/prepared/run1
    accelerate launch ... finetune --config run.yaml --prepared_data /shared/prepared/run1

The directory holds train/ and eval/ (datasets' save_to_disk) and prepared.json: what the rows were made from (the
data fields that shape them, the task, the seed of the eval split, a fingerprint of the tokenizer and its chat
template). A run whose own values differ is refused, key by key, before any model loads.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import shutil

from finetune.config import ROW_FIELDS, ConfigError, RunConfig
from finetune.data import Datasets
from finetune.formats import at_rest
from finetune.mixture import Mixture
from finetune.model import base_label_names

logger = logging.getLogger("finetune")
MANIFEST = "prepared.json"
VERSION = 1
BASE_LABELS = "base model labels"  # made_from's key: the label names of the base model's head (model.base_label_names)


def made_from(cfg: RunConfig, tokenizer) -> dict:
    """What prepared rows depend on: every data field that shapes them, the task, the seed (the eval split and a
    mixture's order), the tokenizer (its vocabulary, special tokens and chat template), and for a classifier
    whose base names its labels, those names (their order is the label ids': data.label_names_of)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k in ROW_FIELDS}
    out = {**fields, "task": cfg.model.task, "seed": cfg.train.seed, "tokenizer": tokenizer_fingerprint(tokenizer)}
    base_labels = base_label_names(cfg.model)
    if base_labels is not None:  # absent otherwise, as in the manifests written before it was recorded
        out[BASE_LABELS] = base_labels
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer's behaviour, not its path: the whole tokenizer.json of a fast tokenizer (else the vocabulary),
    its special tokens and its chat template. Not the truncation a tokenizing call left set (formats.at_rest)."""
    backend = getattr(at_rest(tokenizer), "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [type(tokenizer).__name__, vocab, str(tokenizer.special_tokens_map), str(tokenizer.chat_template)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def save(ds: Datasets, cfg: RunConfig, tokenizer, directory: str) -> None:
    """Write train/, eval/ and prepared.json into a new directory (a temporary one renamed at the end: a directory
    with prepared.json is complete)."""
    tmp = directory.rstrip("/") + ".incomplete"
    shutil.rmtree(tmp, ignore_errors=True)
    ds.train.save_to_disk(os.path.join(tmp, "train"))
    if ds.eval is not None:
        ds.eval.save_to_disk(os.path.join(tmp, "eval"))
    manifest = {
        "version": VERSION,
        "made": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": cfg.model.model,
        "made_from": made_from(cfg, tokenizer),
        "format": ds.format,
        "label_names": ds.label_names,
        "supervised_tokens": ds.supervised_tokens,
        "mixture": dataclasses.asdict(ds.mixture) if ds.mixture is not None else None,
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, directory)


def load(cfg: RunConfig, tokenizer) -> Datasets:
    """The prepared rows, after checking they were made for this run; a ConfigError names each difference."""
    import datasets

    directory = cfg.data.prepared_data
    manifest = read_manifest(directory)
    problems = differences(manifest, made_from(cfg, tokenizer), directory)
    if problems:
        raise ConfigError(problems)
    train = datasets.load_from_disk(os.path.join(directory, "train"))
    has_eval = os.path.isdir(os.path.join(directory, "eval"))
    evalset = datasets.load_from_disk(os.path.join(directory, "eval")) if has_eval else None
    logger.info(
        "data: the rows prepared by `finetune prepare` in %s (%s, for %s): %d train rows, no raw data read",
        directory, manifest["made"], manifest["model"], len(train),
    )  # fmt: skip
    mixture = Mixture(**manifest["mixture"]) if manifest["mixture"] else None
    return Datasets(train, evalset, manifest["format"], manifest["label_names"], manifest["supervised_tokens"], mixture)


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            [
                (
                    "prepared_data",
                    f"{directory!r} holds no prepared data ({MANIFEST}: {type(e).__name__}); run `finetune prepare "
                    f"--config <this run's config> --prepared_data {directory}` first, or remove prepared_data to read the raw data",
                )
            ]
        ) from None
    if manifest.get("version") != VERSION:
        raise ConfigError(
            [
                (
                    "prepared_data",
                    f"{directory!r} was prepared by another version of finetune; run finetune prepare again",
                )
            ]
        )
    return manifest


def differences(manifest: dict, now: dict, directory: str) -> list[tuple[str, str]]:
    """Each value the prepared rows were made with that this run does not have, keyed by the field to fix."""
    was = manifest["made_from"]
    again = "run `finetune prepare` again with this run's config (into a new directory), or set {key}: {was!r}"
    out = []
    for key in sorted(set(was) | set(now)):
        if was.get(key) == now.get(key):
            continue
        if key == BASE_LABELS:
            out.append(
                (
                    "model",
                    f"the data in {directory!r} was prepared for a base model whose classifier labels are "
                    f"{was.get(key)} (in id order), this run's model has {now.get(key)}: the label ids differ; run "
                    "`finetune prepare` again for this model, or use that one",
                )
            )
        elif key == "tokenizer":
            out.append(
                (
                    "model",
                    f"the data in {directory!r} was prepared with another tokenizer or chat template (that of "
                    f"{manifest['model']!r}); run `finetune prepare` again for this model, or use that one",
                )
            )
        else:
            out.append((key, f"the data in {directory!r} was prepared with {key}={was.get(key)!r}, this run has "
                             f"{now.get(key)!r}; {again.format(key=key, was=was.get(key))}"))  # fmt: skip
    return out
