"""Data: load (Hub id or local files), format, tokenize (cached, once), pack, collate, order.

The formats, their shapes and what the loss sees of each: finetune/formats.py.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from finetune import chunked_loss, formats
from finetune.cluster import usable_cores
from finetune.config import DATA_EXTENSIONS, ConfigError, DataArgs, data_files, looks_local
from finetune.formats import IGNORE, Layout

logger = logging.getLogger("finetune")
# What the collator tells the loop of each batch (popped before the forward; Collator._padded says what each is).
BATCH_FACTS = ("num_tokens", "num_positions", "num_supervised", "num_learned")
PAIR_INDEX = "pair_index"  # preference pairs: each pair's row in its split (its reference log-probs: preference.py)


@dataclass
class Datasets:
    """What the data builder hands the run: tokenized splits plus facts the model builder needs."""

    train: Any
    eval: Any | None
    format: str
    label_names: list[str] | None  # classification: id -> name
    supervised_tokens: int | None  # in train, after truncation (None: streamed, not counted ahead)
    mixture: Any = None  # finetune.mixture.Mixture: the sources of the train rows (mixture.build_mixture_datasets)

    @property
    def streamed(self) -> bool:
        return isinstance(self.train, StreamedRows)

    def content(self) -> dict[str, object]:
        """What two machines that built these datasets from the same data agree on, and machines holding different
        files (same names, other contents or lengths) do not: row counts and a hash of sampled rows (content_hash).
        A stream's train rows are not counted ahead: its first row (shuffled, tokenized) stands for them."""
        train = self.train.first if self.streamed else self.train
        facts = {
            "train rows": "streamed" if self.streamed else len(self.train),
            "train content" + (" (first streamed row)" if self.streamed else ""): content_hash(train),
            "supervised tokens": self.supervised_tokens,
            "eval rows": len(self.eval) if self.eval is not None else 0,
            "eval content": content_hash(self.eval),
        }
        if self.mixture is not None and len(self.mixture.names) > 1:
            facts["rows per source"] = self.mixture.sizes
        return facts


HASHED_ROWS = 32  # content_hash reads this many rows of a split, whatever its size


def content_hash(rows) -> str | None:
    """12 hex digits of sha256 over a tokenized split's length and HASHED_ROWS of its rows at fixed positions spread
    over it (every column), or over one row (a dict). Reads those rows only: as cheap at 10M rows as at 100. Not
    datasets' _fingerprint, which hashes the source files' paths and modification times: machines holding the same
    data at other paths or copied at other times differ there."""
    if rows is None:
        return None
    if not isinstance(rows, dict):
        n = len(rows)
        picks = sorted({i * n // HASHED_ROWS for i in range(HASHED_ROWS)}) if n else []
        rows = [n, rows.with_format(None)[picks] if picks else {}]
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:12]


# ---------------------------------------------------------------- loading


def _load(spec: str, data: DataArgs, split: str | None, streaming: bool = False) -> Any:
    """Load one split from a Hub id or local files (a datasets.IterableDataset when streaming). Errors are
    ConfigErrors naming the key."""
    import datasets

    key = "dataset" if spec == data.dataset else "eval_dataset"
    if looks_local(spec):
        files = data_files(spec)
        kinds = {DATA_EXTENSIONS.get(Path(f).suffix.lower()) for f in files}
        if not files or None in kinds or len(kinds) != 1:
            raise ConfigError(
                [(key, f"{spec!r} must name files of one kind ({', '.join(DATA_EXTENSIONS)}); give such files")]
            )
        kind = kinds.pop()
        try:
            return datasets.load_dataset(kind, data_files=files, split="train", streaming=streaming)
        except Exception as e:  # datasets raises many types for malformed files
            why = f"could not read {spec!r} as {kind}: {formats.first_line(_cause(e))}"
            raise ConfigError([(key, f"{why}; fix the file (or leave it out)")]) from None
    try:
        return datasets.load_dataset(spec, data.dataset_config, split=split or data.train_split, streaming=streaming)
    except Exception as e:
        raise ConfigError(
            [
                (
                    key,
                    f"could not load Hub dataset {spec!r} (split {split or data.train_split!r}): "
                    f"{formats.first_line(e)}. Check the id and split, or give local files",
                )
            ]
        ) from None


def _cause(e: BaseException) -> BaseException:
    """The error under datasets' generic DatasetGenerationError (which says only that one happened)."""
    while type(e).__name__ == "DatasetGenerationError" and (e.__cause__ or e.__context__):
        e = e.__cause__ or e.__context__
    return e


def load_splits(data: DataArgs, seed: int) -> tuple[Any, Any | None]:
    """(train, eval or None) raw datasets, eval from a file, a split, or a seeded held-out fraction."""
    train = _load(data.dataset, data, _train_split(data))
    if len(train) == 0:
        raise ConfigError([("dataset", f"{data.dataset!r} has no examples")])
    evalset = _given_eval(data)
    if evalset is None and data.eval_fraction > 0:
        n_eval = max(1, round(len(train) * data.eval_fraction))
        if n_eval >= len(train):
            raise ConfigError([("eval_fraction", f"leaves no training data out of {len(train)} examples; lower it")])
        if data.eval_fraction_max_rows and n_eval > data.eval_fraction_max_rows:
            logger.info(
                "eval: %d rows held out of %d (eval_fraction %g would be %d; eval_fraction_max_rows caps it, the "
                "rest trains)", data.eval_fraction_max_rows, len(train), data.eval_fraction, n_eval,
            )  # fmt: skip
            n_eval = data.eval_fraction_max_rows
        parts = train.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
        train, evalset = parts["train"], parts["test"]
    if data.max_train_samples:
        train = train.select(range(min(data.max_train_samples, len(train))))
    return train, evalset


ONE_SPLIT = "local files have one split"


def _train_split(data: DataArgs) -> str | None:
    """The split of a Hub dataset to train on; local files have one (None): another train_split is refused, not
    ignored."""
    if not looks_local(data.dataset):
        return data.train_split
    if data.train_split != "train":
        why = f"{ONE_SPLIT}, and {data.dataset!r} trains whole; remove train_split (or give that split's files as dataset)"
        raise ConfigError([("train_split", why)])
    return None


def _given_eval(data: DataArgs) -> Any | None:
    """The eval data an eval_dataset or eval_split names, else None."""
    if data.eval_dataset:
        if data.eval_split and looks_local(data.eval_dataset):
            why = f"{ONE_SPLIT}, and eval_dataset {data.eval_dataset!r} is evaluated whole; remove eval_split"
            raise ConfigError([("eval_split", why)])
        return _load(data.eval_dataset, data, data.eval_split)
    if data.eval_split:
        if looks_local(data.dataset):
            raise ConfigError([("eval_split", f"{ONE_SPLIT}; give eval_dataset or eval_fraction instead")])
        return _load(data.dataset, data, data.eval_split)
    return None


# ---------------------------------------------------------------- labels


def _unique(ds, column: str) -> list:
    try:
        return ds.unique(column)
    except (NotImplementedError, TypeError):  # pyarrow cannot hash a column of mixed types (JSON)
        return list({repr(v): v for v in ds[column]}.values())


def label_names_of(
    train, data: DataArgs, held_out=None, base_labels: list[str] | None = None
) -> tuple[list[str], dict | None]:
    """The one place that decides a classifier's label order: the names of the classes in id order, and the raw
    label -> id map (None: the raw labels are the ids). Strings sort (stable across runs); ints are their own ids
    (names "0".."N-1"); a datasets ClassLabel column keeps its names. base_labels (base_label_names: the label
    names of the base model's head, in its id order): where they are the data's label set, their order and ids
    win (as HF run_glue), so the head's rows keep their meaning. With held_out (the eval rows eval_fraction took
    out of train), all the rows' classes."""
    column = data.label_column
    values = _unique(train, column)
    if held_out is not None:
        values = list({repr(v): v for v in [*values, *_unique(held_out, column)]}.values())
    _check_label_values(values, column)
    classes = getattr(train.features.get(column), "names", None) if train.features else None
    if classes is not None:  # a datasets ClassLabel: ints 0..num_classes-1, with names
        names, ids = [str(n) for n in classes], None
        if max(values) >= len(names):
            why = f"has label {max(values)} beyond its ClassLabel's {len(names)} names {names[:5]}; fix the data"
            raise ConfigError([("label_column", f"column {column!r} {why}")])
    elif isinstance(values[0], str):
        names = sorted(values)
        ids = {n: i for i, n in enumerate(names)}
    else:
        names, ids = [str(i) for i in range(max(values) + 1)], None
    if base_labels is None or base_labels == names or sorted(base_labels) != sorted(names):
        return names, ids
    logger.info(
        "labels: in the base model's order (its config's id2label), so its classifier head keeps its meaning: %s",
        base_labels,
    )
    place = {n: i for i, n in enumerate(base_labels)}
    if ids is not None:
        return list(base_labels), {v: place[n] for v, n in zip(ids, names)}
    return list(base_labels), {i: place[n] for i, n in enumerate(names)}


def _check_label_values(values: list, column: str) -> None:
    """Labels a single-label classifier can learn: all strings or all non-negative ints, at least two of them.
    Each refusal says what the labels are and what to give instead."""

    def refuse(why: str) -> None:
        raise ConfigError([("label_column", f"column {column!r} {why}")])

    shown = ", ".join(sorted(map(repr, values))[:5]) + (", ..." if len(values) > 5 else "")
    if any(v is None for v in values):
        refuse("has empty labels; fill or drop those rows")
    if all(isinstance(v, bool) for v in values):
        refuse(f"holds booleans ({shown}); write them as ints or strings (use 0 and 1, or 'no' and 'yes')")
    if all(isinstance(v, float) or isinstance(v, int) and not isinstance(v, bool) for v in values):
        if any(isinstance(v, float) for v in values):
            refuse(
                f"holds floats ({shown}): regression is not supported (a classifier needs classes); write "
                "whole-number floats as ints (1.0 -> 1) or give string labels"
            )
    elif any(isinstance(v, (list, tuple)) for v in values):
        refuse(f"holds lists ({shown}): multi-label classification is not supported; give each row one label")
    elif not all(isinstance(v, str) for v in values):
        refuse(f"holds labels of several types ({shown}); give them one type: all ints or all strings")
    if isinstance(values[0], int) and min(values) < 0:
        refuse(f"has label {min(values)}, which is negative; labels must be 0..N-1 or strings")
    if len(values) < 2:
        refuse(
            f"holds one label ({values[0]!r}) in every row: a classifier needs at least 2 labels; give rows of "
            "another label too"
        )


# ---------------------------------------------------------------- packing and collation


def first_fit_decreasing(lengths: np.ndarray, max_len: int) -> list[list[int]]:
    """Example indices per row: longest first, each into the first row with room (deterministic:
    equal lengths keep their order)."""
    members: list[list[int]] = []
    room = np.empty(len(lengths), dtype=np.int64)  # room[r]: tokens row r can still take
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        fits = np.flatnonzero(room[: len(members)] >= n)
        if len(fits):
            row = int(fits[0])
        else:
            row = len(members)
            members.append([])
            room[row] = max_len
        members[row].append(i)
        room[row] -= n
    return members


def pack(batch: pa.Table, max_len: int) -> pa.Table:
    """First-fit-decreasing packing into rows of at most max_len tokens (deterministic).

    Longest examples first, each into the first row with room: rows come out nearly full, so the
    collator pads little (greedy in-order packing left ~20% padding on instruction data of lengths
    16..512; this leaves ~2%). Each example keeps its own position_ids (0..n-1); transformers turns
    position_ids that restart into a block-diagonal causal mask, so packed examples never attend to
    each other. Arrow in, Arrow out: the tokens are moved by numpy, never as Python lists.
    """
    ids = batch.column("input_ids").combine_chunks()
    labels = batch.column("labels").combine_chunks()
    if not len(ids):
        return pa.table({"input_ids": ids, "labels": labels, "position_ids": pa.array([], pa.list_(pa.int64()))})
    lengths = pc.list_value_length(ids).to_numpy()
    members = first_fit_decreasing(lengths, max_len)
    order = np.fromiter(itertools.chain.from_iterable(members), dtype=np.int64, count=len(lengths))
    sizes = lengths[order]  # each example's length, in packed order
    starts = np.concatenate([[0], np.cumsum(sizes)])  # each example's first token in the packed tokens
    row_ends = np.cumsum([len(row) for row in members])  # each row's end, counted in examples
    row_offsets = pa.array(starts[np.concatenate([[0], row_ends])], pa.int32())
    taken = pa.array(order)
    flat_ids = ids.take(taken).flatten()
    flat_labels = labels.take(taken).flatten().to_numpy(zero_copy_only=False).copy()
    # The first token of a later example would be "predicted" from the previous example: mask it.
    later = np.ones(len(order), dtype=bool)
    later[np.concatenate([[0], row_ends[:-1]])] = False
    flat_labels[starts[:-1][later]] = IGNORE
    positions = np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], sizes)
    return pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(row_offsets, flat_ids),
            "labels": pa.ListArray.from_arrays(row_offsets, pa.array(flat_labels, labels.type.value_type)),
            "position_ids": pa.ListArray.from_arrays(row_offsets, pa.array(positions)),
        }
    )


class Collator:
    """Pad a list of examples to the longest one (rounded up to a multiple of 8), plus batch facts.

    Padded labels are -100. Unpacked batches get an attention_mask; packed ones get position_ids
    instead (padding becomes one more, unsupervised, segment); a batch of unpadded single sequences gets
    neither. Encoder-decoder batches pad the encoder
    input and the labels each to their own longest (the model builds the decoder input from the labels).
    positions: causal LM batches also carry the flat indices of their supervised positions (chunked_loss.POSITIONS,
    for a model that runs finetune's loss forward: its LM head runs on those only), found here on the host.
    """

    def __init__(
        self,
        pad_token_id: int,
        multiple_of: int = 8,
        encoder_decoder: bool = False,
        references: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
        positions: bool = False,
    ):
        self.pad = pad_token_id
        self.positions = positions
        self.multiple_of = multiple_of
        self.encoder_decoder = encoder_decoder
        self.references = references  # preference pairs: pair index -> the reference log-probs (preference.py)

    def _width(self, rows: list) -> int:
        return -(-max(len(r) for r in rows) // self.multiple_of) * self.multiple_of

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        if "chosen_ids" in examples[0]:
            return self._with_positions(self._pairs(examples))
        batch = self._encoder_decoder(examples) if self.encoder_decoder else self._padded(examples)
        if "source" in examples[0]:  # a mixture's eval rows name their source (finetune.mixture): eval per source
            batch["source"] = torch.tensor([e["source"] for e in examples])
        return batch if self.encoder_decoder else self._with_positions(batch)

    def _with_positions(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.positions and batch["labels"].dim() == 2:  # per-token labels (a causal LM's), not a class each
            batch[chunked_loss.POSITIONS] = chunked_loss.supervised_positions(batch["labels"])
        return batch

    def _padded(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        width = self._width([e["input_ids"] for e in examples])
        per_token = isinstance(examples[0]["labels"], list)  # causal LM; classification has one int
        packed = "position_ids" in examples[0]
        ids, labels, extra = [], [], []
        for e in examples:
            n = len(e["input_ids"])
            gap = width - n
            ids.append(list(e["input_ids"]) + [self.pad] * gap)
            labels.append(list(e["labels"]) + [IGNORE] * gap if per_token else e["labels"])
            extra.append(list(e["position_ids"]) + list(range(gap)) if packed else [1] * n + [0] * gap)
        labels_t = torch.tensor(labels, dtype=torch.long)
        learned = (labels_t[:, 1:] != IGNORE).sum() if per_token else None
        # Rows of one sequence each and no padding need neither: the model then takes the plain causal path (no
        # mask built, and none read on the host: model.masks_without_host_sync).
        plain = (
            all(x == list(range(width)) for x in extra)
            if packed
            else all(len(e["input_ids"]) == width for e in examples)
        )
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": labels_t,
            **(
                {}
                if plain
                else {("position_ids" if packed else "attention_mask"): torch.tensor(extra, dtype=torch.long)}
            ),
            # Batch facts for the loop (BATCH_FACTS, popped before the forward): real input tokens, positions
            # computed (padding included), what the model's mean loss is taken over (causal LM: labels after the
            # one-token shift) and the positions the LM head is needed on (MFU: model.ModelFacts.flops).
            "num_tokens": torch.tensor(sum(len(e["input_ids"]) for e in examples)),
            "num_positions": torch.tensor(len(examples) * width),
            "num_supervised": learned if per_token else torch.tensor(len(examples)),
            "num_learned": learned if per_token else torch.tensor(0),  # a class per row: no LM head
        }

    def _pairs(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        """B preference pairs as 2B rows, the chosen answers first: prompt + answer, only the answer learned; the
        batch counts pairs (num_supervised), and carries each pair's index and reference log-probs (once known;
        a stream's pairs have no index: their references are live, or the method has none)."""
        answers = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
        prompts = [e["prompt_ids"] for e in examples] * 2
        width = self._width([p + a for p, a in zip(prompts, answers)])
        ids, labels, mask = [], [], []
        for p, a in zip(prompts, answers):
            gap = width - len(p) - len(a)
            ids.append(list(p) + list(a) + [self.pad] * gap)
            labels.append([IGNORE] * len(p) + list(a) + [IGNORE] * gap)
            mask.append([1] * (len(p) + len(a)) + [0] * gap)
        labels_t = torch.tensor(labels, dtype=torch.long)
        batch = {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "attention_mask": torch.tensor(mask, dtype=torch.long),
            "labels": labels_t,
            "num_tokens": torch.tensor(sum(map(sum, mask))),
            "num_positions": torch.tensor(len(ids) * width),
            "num_supervised": torch.tensor(len(examples)),
            "num_learned": (labels_t[:, 1:] != IGNORE).sum(),
        }
        if PAIR_INDEX in examples[0]:
            batch[PAIR_INDEX] = torch.tensor([e[PAIR_INDEX] for e in examples])
            reference = self.references(batch[PAIR_INDEX]) if self.references else None
            if reference is not None:
                batch["ref_logps"] = reference
        return batch

    def _encoder_decoder(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        """Tokens and positions count both sides; the loss is over every target token (no shift)."""
        enc, dec = [e["input_ids"] for e in examples], [e["labels"] for e in examples]
        w_enc, w_dec = self._width(enc), self._width(dec)
        labels = torch.tensor([list(x) + [IGNORE] * (w_dec - len(x)) for x in dec], dtype=torch.long)
        learned = (labels != IGNORE).sum()
        return {
            "input_ids": torch.tensor([list(x) + [self.pad] * (w_enc - len(x)) for x in enc], dtype=torch.long),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (w_enc - len(x)) for x in enc], dtype=torch.long),
            "labels": labels,
            "num_tokens": torch.tensor(sum(len(x) for x in enc) + sum(len(x) for x in dec)),
            "num_positions": torch.tensor(len(examples) * (w_enc + w_dec)),
            "num_supervised": learned,
            "num_learned": learned,
        }


class EpochSampler(torch.utils.data.Sampler):
    """A shuffle that depends only on (seed, epoch): identical on every rank and every world size.

    Deliberately not a RandomSampler (accelerate would swap it) and without a `generator`
    attribute (accelerate would broadcast it): there is nothing to synchronise.
    """

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return in_chunks(self.permutation())

    def permutation(self) -> torch.Tensor:
        return torch.randperm(self.n, generator=seeded(self.seed * 100_003 + self.epoch))


def seeded(seed: int) -> torch.Generator:
    """A generator for a seed derived from the run's (any size: torch takes 64 bits; a seed that fits is itself)."""
    return torch.Generator().manual_seed(seed % 2**64)


def in_chunks(order: torch.Tensor, size: int = 65_536):
    """An epoch's row order as Python ints, a chunk at a time: a list of all of them costs 36 bytes a row (38 MB
    at 1M rows, measured), for the whole epoch."""
    for chunk in order.split(size):
        yield from chunk.tolist()


class LengthAwareBatchSampler(torch.utils.data.Sampler):
    """Micro batches of similar cost: `length_aware_batching`.

    The epoch's order and its global batches are EpochSampler's, unchanged (the same examples in the
    same optimizer step under every layout). Only the split of one global batch into its
    `micro_batches` micro batches changes: longest first, cut into contiguous groups so that the most
    expensive group is as cheap as possible, cost = rows x padded width x (1 + attention_weight x width).
    Long examples end up in small micro batches and short ones in large ones, so ranks (and
    accumulation steps) do similar work and little padding is computed. The split depends only on
    the examples' lengths and the number of micro batches, so 2 ranks x GA 1 and 1 rank x GA 2 get
    the same micro batches. accelerate deals them to ranks round-robin, as with fixed-size batches.
    """

    def __init__(
        self, sampler: EpochSampler, lengths: list[int], global_batch: int, micro_batches: int, attention_weight: float
    ):
        self.sampler, self.lengths = sampler, lengths
        self.global_batch, self.micro_batches, self.attention_weight = global_batch, micro_batches, attention_weight
        self.batch_size = None  # accelerate: batches of varying size
        self.drop_last = True

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler) // self.global_batch * self.micro_batches

    def __iter__(self):
        order = list(self.sampler)
        for start in range(0, len(order) - self.global_batch + 1, self.global_batch):
            window = order[start : start + self.global_batch]
            for group in balanced_split([self.lengths[i] for i in window], self.micro_batches, self.attention_weight):
                yield [window[i] for i in group]


def balanced_split(lengths: list[int], parts: int, attention_weight: float, multiple_of: int = 8) -> list[list[int]]:
    """Positions 0..len(lengths)-1 in `parts` non-empty groups, longest first, minimising the largest
    group's cost (see LengthAwareBatchSampler). Bisection on that cost with greedy contiguous groups
    (optimal for contiguous groups of a sorted list), then the largest groups halved until there are
    exactly `parts`. Deterministic: ties keep their position order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    widths = [-(-lengths[i] // multiple_of) * multiple_of for i in order]

    def cost(a: int, b: int) -> float:  # the group order[a:b]; its width is its first (longest) one's
        return (b - a) * widths[a] * (1 + attention_weight * widths[a])

    def greedy(limit: float) -> list[tuple[int, int]]:
        groups, a = [], 0
        while a < len(order):
            b = a + 1
            while b < len(order) and cost(a, b + 1) <= limit:
                b += 1
            groups.append((a, b))
            a = b
        return groups

    groups = greedy(cost(0, 1))  # no group dearer than the longest example alone
    if len(groups) > parts:  # bisect: lo too tight, hi (one group) always fits
        lo, hi = cost(0, 1), cost(0, len(order))
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if len(greedy(mid)) <= parts else (mid, hi)
        groups = greedy(hi)
    while len(groups) < parts:  # fewer groups than micro batches: halve the one with most rows
        k = max(range(len(groups)), key=lambda g: (groups[g][1] - groups[g][0], -g))
        a, b = groups[k]
        groups[k : k + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return [order[a:b] for a, b in groups]


# ---------------------------------------------------------------- the builder


def build_datasets(
    data: DataArgs,
    task: str,
    tokenizer,
    seed: int,
    main_first: Callable[[], AbstractContextManager],
    one_of_several: bool = False,
    base_labels: list[str] | None = None,
) -> Datasets:
    """Load, read in the data's layout, tokenize (main process first, so the others hit the datasets cache),
    drop the rows with nothing to learn (saying why), pack. one_of_several: a mixture's source, whose eval may be
    left empty (the mixture refuses only an eval of no rows at all). base_labels: the label names of the base
    model's classifier head (model.base_label_names; label_names_of)."""
    with main_first():
        train_raw, eval_raw = load_splits(data, seed)
    layout = _checked_layout(train_raw, eval_raw, data, task, tokenizer)
    how = "detected from the columns" if data.format == "auto" else "as configured"
    logger.info("data %s: %s; %s %s", data.dataset, layout.describe(), how, train_raw.column_names)
    classification = layout.format == "classification"
    label_names, label_ids = _labels(train_raw, eval_raw, data, base_labels) if classification else (None, None)
    rows = _rows(layout, data, task, tokenizer, label_ids)
    with main_first():
        start = time.perf_counter()
        train, n_super = _tokenize(train_raw, "train", rows, data, layout)  # packing keeps what is learned
        evalset = _tokenize(eval_raw, "eval", rows, data, layout, one_of_several)[0] if eval_raw is not None else None
        if data.packing:
            train = _packed(train, data.max_seq_length)
        if layout.format == "preference":  # each pair's place in its split: its reference log-probs' row
            train, evalset = (x if x is None else x.add_column(PAIR_INDEX, np.arange(len(x))) for x in (train, evalset))
        took, n = time.perf_counter() - start, len(train_raw) + (len(eval_raw) if eval_raw is not None else 0)
        procs = preparing_processes(data.preprocessing_num_workers, len(train_raw), usable_cores()) or 1
        logger.info(
            "data prepared: %d rows in %.1f s (%.0f rows/s, %d process%s; the datasets cache makes a rerun's near 0)%s",
            n, took, n / max(took, 1e-9), procs, "es" if procs > 1 else "", ", packed" if data.packing else "",
        )  # fmt: skip
    return Datasets(train=train, eval=evalset, format=layout.format, label_names=label_names, supervised_tokens=n_super)


# ---------------------------------------------------------------- streaming


class StreamedRows(torch.utils.data.IterableDataset):
    """`streaming: true`: the training rows read, shuffled in a seeded buffer, tokenized and packed as training
    consumes them, never all at once.

    The stream is the whole run (one "epoch"): when it runs out it starts again, reshuffled (pass p shuffles with
    seed + p), and max_steps decides where it ends. Every rank reads the same stream; accelerate's
    IterableDatasetShard keeps each rank's micro batches (in every chunk of data-parallel x micro rows, rank r's
    are the r-th micro batch), as its batch sampler deals map-style batches: 2 ranks x GA 1 and 1 rank x GA 2
    train the same rows. A resume reads the stream again up to its step (accelerate's skip_first_batches) and
    trains from there: the same rows as the uninterrupted run, at the cost of tokenizing the skipped ones.
    """

    def __init__(self, rows: Any, empty: tuple[str, str]):
        self.rows = rows  # a datasets.IterableDataset of token rows
        self.empty = empty  # the problem when a pass yields no row
        self.first: dict | None = None  # the stream's first row (build_stream reads it at start)

    def set_epoch(self, epoch: int) -> None:
        """accelerate's loader calls it; a stream's run is one epoch (its passes are counted in __iter__)."""

    def __iter__(self):
        for p in itertools.count():
            self.rows.set_epoch(p)
            n = 0
            try:
                for row in self.rows:
                    n += 1
                    yield row
            except formats.BadExample as e:
                raise ConfigError([(e.key, e.message)]) from None
            if not n:
                raise ConfigError([self.empty])


def build_stream(
    data: DataArgs, task: str, tokenizer, seed: int, main_first: Callable[[], AbstractContextManager]
) -> Datasets:
    """streaming: the training rows as a StreamedRows, eval (small) tokenized as usual: from eval_dataset,
    eval_split, or the stream's first eval_fraction_max_rows rows (which training then skips)."""
    import datasets

    train_raw = _load(data.dataset, data, _train_split(data), streaming=True)
    with main_first():
        eval_raw = _given_eval(data)
    held_out = eval_raw is None and data.eval_fraction > 0
    if held_out:
        n = data.eval_fraction_max_rows
        eval_raw = datasets.Dataset.from_list(list(train_raw.take(n)), features=train_raw.features)
        train_raw = train_raw.skip(n)
        logger.info(
            "eval: the stream's first %d rows (eval_fraction_max_rows; a fraction of a stream of unknown length "
            "cannot be taken), skipped by training", len(eval_raw),
        )  # fmt: skip
    if data.max_train_samples:
        train_raw = train_raw.take(data.max_train_samples)
    if next(iter(train_raw), None) is None:
        key, fix = (
            ("eval_fraction_max_rows", f"lower it ({n}) or give more data") if held_out else ("dataset", "give data")
        )
        raise ConfigError([(key, f"{data.dataset!r} has no training rows left to stream; {fix}")])
    layout = _checked_layout(train_raw, eval_raw, data, task, tokenizer)
    how = "detected from the columns" if data.format == "auto" else "as configured"
    logger.info("data %s (streamed): %s; %s %s", data.dataset, layout.describe(), how, train_raw.column_names)
    rows = _rows(layout, data, task, tokenizer, None)
    with main_first():  # main process first, so the others hit the datasets cache (as build_datasets)
        evalset = _tokenize(eval_raw, "eval", rows, data, layout)[0] if eval_raw is not None else None
    train = (
        _rows_of(train_raw.shuffle(seed=seed, buffer_size=data.shuffle_buffer_size), rows("train"), layout, data)
        .filter(lambda skip: not skip, input_columns="skip")  # rows with nothing to learn
        .remove_columns(formats.row_facts(layout.format))
    )
    if data.packing:
        train = _packed(train, data.max_seq_length)
    empty = (
        f"no row of {data.dataset!r} has anything to learn (after formatting and truncation to max_seq_length="
        f"{data.max_seq_length}); check the data"
    )
    stream = StreamedRows(train, ("dataset", empty))
    stream.first = next(iter(stream))  # bad rows at the start, or none to learn, fail here rather than at step 1
    logger.info(
        "streaming: shuffled in a buffer of %d rows (shuffle_buffer_size), tokenized%s as training reads",
        data.shuffle_buffer_size, " and packed" if data.packing else "",
    )  # fmt: skip
    return Datasets(stream, evalset, layout.format, None, None)


def _rows(layout: Layout, data: DataArgs, task: str, tokenizer, label_ids) -> Callable:
    """The layout's batched rows -> tokens function, per split (chat names the row it cannot read)."""
    max_len = data.max_seq_length
    if task == "seq2seq":  # the layout is instruction or source_target here (TASK_FORMATS)
        return lambda split: formats.seq2seq_rows(tokenizer, data, layout, max_len)
    if layout.format == "chat":
        return lambda split: formats.chat_rows(tokenizer, data, layout, max_len, split)
    if layout.format == "instruction":
        return lambda split: formats.instruction_rows(tokenizer, data, layout, max_len)
    if layout.format == "text":
        return lambda split: formats.text_rows(tokenizer, data)
    if layout.format == "preference":
        return lambda split: formats.preference_rows(tokenizer, data, layout, max_len, split)
    return lambda split: formats.classification_rows(tokenizer, data, max_len, label_ids)


def _checked_layout(train_raw, eval_raw, data: DataArgs, task: str, tokenizer) -> Layout:
    """The data's layout (formats.layout_of), with its columns in eval too, and a chat template for chat data."""
    layout = formats.layout_of(train_raw, data, task)
    if eval_raw is not None:
        missing = formats.missing_columns(layout, list(eval_raw.column_names))
        if missing:
            raise ConfigError(
                [
                    (
                        "eval_dataset",
                        f"eval data: column(s) {missing} not in the data (columns: {eval_raw.column_names}); the "
                        f"training data is read as {layout.describe()}: give the eval data the same columns",
                    )
                ]
            )
    if (layout.format == "chat" or layout.conversational) and not tokenizer.chat_template:
        raise ConfigError(
            [
                (
                    "chat_template",
                    "chat data needs a chat template and this tokenizer has none; "
                    "set chat_template (Jinja text or a file)",
                )
            ]
        )
    problem = formats.tools_problem(layout, tokenizer)
    if problem:
        raise ConfigError([problem])
    return layout


def _labels(train_raw, eval_raw, data: DataArgs, base_labels: list[str] | None):
    """A classifier's label names and ids (label_names_of). Given eval data (eval_dataset, eval_split) may use no
    label that train lacks. Eval rows eval_fraction held out were train's: the label set is all the rows', and a
    label only they have stays in it, with a warning that no training row has it (the user has no eval data to fix;
    holding out by label would change every split)."""
    column = data.label_column
    given = bool(data.eval_dataset or data.eval_split)
    held_out = eval_raw if eval_raw is not None and not given else None
    label_names, label_ids = label_names_of(train_raw, data, held_out, base_labels)
    if eval_raw is None:
        return label_names, label_ids
    if not given:
        only_held_out = set(map(str, _unique(eval_raw, column))) - set(map(str, _unique(train_raw, column)))
        if only_held_out:
            logger.warning(
                "label_column: eval_fraction held out every row labelled %s: no training row has such a label, so "
                "the model cannot learn it (it stays in the label set, and its eval rows count against the metrics); "
                "add rows with it, or another seed holds out other rows",
                sorted(only_held_out)[:5],
            )
        return label_names, label_ids
    theirs, ours = (getattr(d.features.get(column), "names", None) for d in (eval_raw, train_raw))
    if theirs is not None and ours is not None and theirs != ours:
        raise ConfigError(
            [("label_column", f"eval labels are ClassLabel {theirs}, train's {ours}; give both the same label names")]
        )
    unknown = sorted(map(str, set(_unique(eval_raw, column)) - set(label_ids or range(len(label_names)))))
    if unknown:
        raise ConfigError(
            [("label_column", f"eval labels {unknown[:5]} never occur in train; fix the eval data or its labels")]
        )
    return label_names, label_ids


def _rows_of(ds, fn: Callable, layout: Layout, data: DataArgs, **how):
    """`fn` over the data's rows (batched; `how`: a map-style set's num_proc and desc); text's rows then joined and
    cut into blocks in this process, over the rows in order (formats.text_blocks)."""
    out = ds.map(fn, batched=True, with_indices=True, remove_columns=ds.column_names, **how)
    if layout.format != "text":
        return out
    cut = {"desc": "cutting text into blocks"} if "desc" in how else {}
    blocks = formats.text_blocks(data.max_seq_length)
    return out.map(
        blocks, batched=True, batch_size=formats.TEXT_BATCH, with_indices=True, remove_columns=["ids"], **cut
    )


def _tokenize(ds, split: str, rows: Callable, data: DataArgs, layout: Layout, may_empty: bool = False):
    """Rows -> tokens and labels; rows left with nothing to learn are dropped, and said why."""
    try:
        with _os_environ_kept(), _collector_frozen():
            num_proc = preparing_processes(data.preprocessing_num_workers, len(ds), usable_cores())
            out = _rows_of(ds, rows(split), layout, data, num_proc=num_proc, desc=f"tokenizing {split}")
    except formats.BadExample as e:
        raise ConfigError([(e.key, e.message)]) from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            [
                (
                    "dataset" if split == "train" else "eval_dataset",
                    f"{layout.format} formatting failed: {formats.first_line(e)}",
                )
            ]
        ) from None
    if layout.format == "chat" and len(out) > len(ds):  # turns a template renders otherwise, in rows of their own
        logger.info(
            "%s: %d rows from %d conversations: where the chat template renders an earlier answer otherwise once "
            "later turns follow, that answer is learned in a row of its own, rendered as the template renders it "
            "when it is the last message (docs/data.md)",
            split,
            len(out),
            len(ds),
        )
    why = _dropped(out, ds, split)
    if split == "train" and len(why) == 1 and sum(n for n, _ in why.values()) == len(out):
        raise ConfigError([_nothing_to_learn(next(iter(why)), len(out), layout, data)])
    kept = out.filter(lambda skip: not skip, input_columns="skip", desc=f"dropping {split} rows with nothing to learn")
    if split == "train" and not len(kept):
        raise ConfigError([("dataset", f"no training row has anything to learn: {_reasons(why)}")])
    if not len(kept) and not may_empty:  # the first eval would fail, perhaps hours in
        raise ConfigError([_no_eval_row(data, len(out), why)])
    if why:
        logger.warning(
            "dropped %d of %d %s rows with nothing to learn: %s",
            len(out) - len(kept),
            len(out),
            "training" if split == "train" else "eval",
            _reasons(why),
        )
    return kept.remove_columns(formats.row_facts(layout.format)), _column_sum(kept, "learned")


@contextmanager
def _collector_frozen():
    """Python's cyclic garbage collector leaves the objects alive before tokenizing (torch's, transformers', the
    tokenizer's: hundreds of thousands) out of its passes while the rows are tokenized. Tokenizing makes lists and
    dicts by the million, which start full passes over everything alive; those passes were 15% of the chat format's
    preparation (20k conversations: 4.6 s, 3.8 s frozen; bench/README.md). They rejoin afterwards (gc.unfreeze)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def _os_environ_kept():
    """Workaround (datasets 4.x, test_data.py::test_datasets_still_replaces_os_environ): Dataset.map with
    num_proc >= 1 ends with `os.environ = prev_env`, a deep copy taken before it started. Everything holding
    the original object (a default argument `env=os.environ`, as finetune.parallel's readers have) reads a
    frozen environment from then on, and the Accelerator and the refusals disagree about the launch. Put the
    original object back, holding what the copy holds."""
    original = os.environ
    try:
        yield
    finally:
        replaced = os.environ
        if replaced is not original:
            for key in set(original) - set(replaced):
                del original[key]
            for key, value in replaced.items():
                if original.get(key) != value:
                    original[key] = value
            os.environ = original  # noqa: B003 (the object itself is what is put back)


PARALLEL_FROM = (2, 50_000)  # preparing in several processes by default from this many cores and rows


def preparing_processes(asked: int | None, rows: int, cores: int) -> int | None:
    """How many processes tokenize (datasets.map num_proc; None: this one). preprocessing_num_workers when given;
    else one per usable core, up to 8, from 2 cores and 50,000 rows. Only a machine's local main process prepares
    (the other ranks wait, then read its cache), so its cores are free. On 2 cores, 100,000 rows: 2 processes made
    chat rows 1.40x and instruction rows 1.27x as fast as one (bench/README.md); a small set does not repay starting
    them."""
    if asked:  # 1 is this process: datasets would run one child process, whose tokenizer has no threads
        return asked if asked > 1 else None
    return min(cores, 8) if cores >= PARALLEL_FROM[0] and rows >= PARALLEL_FROM[1] else None


def _column_sum(ds, column: str) -> int:
    """A number column's sum, in Arrow (a small column: the rest of the rows is never read)."""
    import pyarrow.compute as pc

    return pc.sum(arrow_column(ds, column)).as_py() or 0


def arrow_column(ds, column: str):
    """One column of a map-style set as Arrow, in the set's row order.

    Workaround (datasets 4.x): `ds.with_format("arrow")[column]` on a set with an indices mapping (after filter,
    select, shuffle or a train/eval split) gathers the column one row at a time (Table.fast_gather: a Python list of
    the indices, then one Arrow slice object per row), about 0.5 GB held at 1M rows for a column of one number per
    row. One vectorized take of the mapped rows instead (8 bytes per row). tests/test_data.py::
    test_datasets_still_gathers_a_mapped_column_row_by_row fails once datasets takes the rows itself."""
    indices = getattr(ds, "_indices", None)
    if indices is None:
        return ds.with_format("arrow")[column]
    return ds.data.table.column(column).take(indices.column(0))


def _dropped(out, raw, split: str) -> dict[str, tuple[int, str]]:
    """Why rows were dropped: reason -> (how many, the first such row), read from the `skip` column in arrow."""
    import pyarrow.compute as pc

    table = out.with_format("arrow")
    skip = table["skip"]
    raw_row = table["raw_row"] if "raw_row" in out.column_names else None  # chat, text: rows are not raw rows
    why = {}
    for item in pc.value_counts(skip).to_pylist():
        reason, n = item["values"], item["counts"]
        if reason:
            first = pc.index(skip, reason).as_py()
            first = raw_row[first].as_py() if raw_row is not None else first
            why[reason] = (n, f"{split} row {first}: {str(raw[first])[:120]}")
    return why


def _reasons(why: dict[str, tuple[int, str]]) -> str:
    return "; ".join(f"{n} with {reason} (e.g. {first})" if not reason.startswith("truncated") else
                     f"{n} {reason} (e.g. {first})" for reason, (n, first) in why.items())  # fmt: skip


def _nothing_to_learn(reason: str, rows: int, layout: Layout, data: DataArgs) -> tuple[str, str]:
    """The problem when every training row was dropped for one reason: the answer's key, or max_seq_length."""
    if layout.format == "preference":
        return "rejected_column", (
            f"no training pair has anything to compare: all {rows} have {reason}; give pairs whose answers differ, or "
            "set chosen_column and rejected_column to the columns that hold them"
        )
    if reason.startswith("truncated"):
        return "dataset", (
            f"no training example has a supervised token left after truncation to max_seq_length="
            f"{data.max_seq_length}; raise max_seq_length or check the response columns"
        )
    if "assistant" in reason:
        return "messages_column", (
            f"no conversation has an assistant turn to learn ({rows} rows read as {layout.describe()}); name the "
            "model's turns assistant (role_map), or set messages_column to the conversations to learn"
        )
    key = "target_column" if layout.format == "source_target" else "response_column"
    return key, (
        f"every training example has {reason} (no answer to learn); fill in the answers, or set {key} to the column "
        "that holds them"
    )


def _no_eval_row(data: DataArgs, rows: int, why: dict[str, tuple[int, str]]) -> tuple[str, str]:
    """The problem when no eval row is left: keyed where the eval rows came from, with its fix."""
    gone = f"all {rows} have nothing to learn: {_reasons(why)}" if rows else "there are none"
    if data.eval_dataset:
        return "eval_dataset", (
            f"no eval row of {data.eval_dataset!r} is left to evaluate: {gone}; fix those rows, or give other eval data"
        )
    if data.eval_split:
        return "eval_split", (
            f"no eval row of split {data.eval_split!r} is left to evaluate: {gone}; fix those rows, or give another "
            "eval_split or an eval_dataset"
        )
    return "eval_fraction", (
        f"no eval row is left of the rows eval_fraction={data.eval_fraction:g} held out of {data.dataset!r}: {gone}; "
        "fix those rows, hold out more (eval_fraction), or set eval_fraction: 0 to train without eval"
    )


def _packed(train, max_len: int):
    """Rows packed into sequences of at most max_len tokens (first-fit decreasing per 1000 rows: pack),
    Arrow batches in and out; a map-style set's packed rows are cached, a stream's packed as it is read."""
    from datasets import Dataset
    from datasets.fingerprint import Hasher

    how: dict[str, Any] = {"batched": True, "batch_size": 1000, "fn_kwargs": {"max_len": max_len}}
    if isinstance(train, Dataset):
        # datasets hashes a module-level function by name, not code: put the code in the cache key,
        # so a changed packing algorithm never reuses rows packed by an older one.
        code = [inspect.getsource(f) for f in (pack, first_fit_decreasing)]
        how |= {"desc": "packing", "new_fingerprint": Hasher.hash([train._fingerprint, *code, max_len])}
    return train.with_format("arrow").map(pack, **how).with_format(None)
