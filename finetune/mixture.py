"""Dataset mixtures: several weighted sources, one epoch order, eval per source.

A run's training data is a list of sources (`datasets:`; `dataset:` alone is a one-source mixture). Each
source is loaded, formatted, tokenized, filtered and packed on its own by data.build_datasets (so each is
cached by datasets' fingerprints, main process first, exactly like a single dataset), and the sources'
rows are concatenated. What mixes them is the order (MixtureSampler):

  epoch size   N = the rows of all sources together (so steps per epoch are counted as for one dataset)
  draws        source i gets round(N x weight_i / sum of weights) of the epoch's N draws (largest
               remainder: the shares are exact to one row every epoch), in a seeded random order
  rows         a source's rows come in a seeded shuffle, taken on from where the previous epoch stopped:
               a source drawn more often than it has rows is reshuffled and repeated (upsampling), one
               drawn less often shows its other rows in later epochs (downsampling)

Everything depends only on (seed, epoch, the sources' sizes and weights): the global order of rows is
decided before accelerate shards it, so it does not depend on the number of processes or on gradient
accumulation (the parity promise). With one source the order is EpochSampler's, unchanged.

Packing happens per source, at tokenization: a packed row holds examples of one source only, and the
weights apply to (packed) rows.

Eval: each source's eval rows carry their source's index (a `source` column the collator passes on); the
loop gathers it with the per-example statistics, and `summarize` reports eval_<name>_<metric> per source
next to the overall eval_loss (over all eval rows: the supervised-count-weighted mean of the sources').
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from finetune.config import SOURCE_FIELDS, ConfigError, DataArgs, Source, sources_of
from finetune.data import PAIR_INDEX, Datasets, EpochSampler, build_datasets, in_chunks, seeded
from finetune.metrics import summarize

logger = logging.getLogger("finetune")
SOURCE = "source"  # the eval rows' column (and batch key) holding the source's index


@dataclass(frozen=True)
class Mixture:
    """The sources of the training rows: train rows [offsets[i], offsets[i] + sizes[i]) are source i's."""

    names: list[str]
    weights: list[float]
    sizes: list[int]
    per_source_eval: bool = False  # eval rows carry their source (several sources, or `datasets:`)
    formats: list[str] = dataclasses.field(default_factory=list)  # each source's (empty: prepared before they were)


def build_mixture_datasets(
    data: DataArgs,
    task: str,
    tokenizer,
    seed: int,
    main_first: Callable[[], AbstractContextManager],
    base_labels: list[str] | None = None,
) -> Datasets:
    """Every source through data.build_datasets (cached, packed), then concatenated. `dataset:` alone goes
    through it unchanged. base_labels: the base model's label names (data.label_names_of)."""
    sources = sources_of(data)
    if not data.datasets:
        ds = build_datasets(data, task, tokenizer, seed, main_first, base_labels=base_labels)
        return dataclasses.replace(ds, mixture=Mixture([sources[0].name], [1.0], [len(ds.train)], formats=[ds.format]))
    parts = [_build_source(i, s, task, tokenizer, seed, main_first, base_labels) for i, s in enumerate(sources)]
    _check_same_labels(parts)
    import datasets

    train = datasets.concatenate_datasets([p.train for p in parts])
    evals = [
        p.eval.add_column(SOURCE, [i] * len(p.eval)) for i, p in enumerate(parts) if p.eval is not None and len(p.eval)
    ]
    evalset = datasets.concatenate_datasets(evals) if evals else None
    if evalset is None and any(p.eval is not None for p in parts):  # the first eval would fail, perhaps hours in
        raise ConfigError(
            [
                (
                    "datasets",
                    "no source has an eval row left to evaluate: every eval row has nothing to learn (the log says "
                    "why, per source); fix those rows, or give a source eval data (eval_dataset) that has",
                )
            ]
        )
    if PAIR_INDEX in train.column_names:  # preference pairs: each pair's place in the concatenation
        train, evalset = (_reindexed(x) for x in (train, evalset))
    sizes, formats = [len(p.train) for p in parts], [p.format for p in parts]
    mixture = Mixture([s.name for s in sources], [s.weight for s in sources], sizes, True, formats)
    for s, p, share in zip(sources, parts, quotas(len(train), mixture.weights)):
        logger.info(
            "source %s: %d train rows (%s format), %d per epoch (weight %g), %s eval rows",
            s.name,
            len(p.train),
            p.format,
            share,
            s.weight,
            len(p.eval) if p.eval is not None else "no",
        )
    return Datasets(
        train=train,
        eval=evalset,
        format=parts[0].format if len({p.format for p in parts}) == 1 else "mixed",
        label_names=parts[0].label_names,
        supervised_tokens=sum(p.supervised_tokens for p in parts),
        mixture=mixture,
    )


def _reindexed(ds):
    """The concatenation's pair indices: each source counted its own from 0 (its reference log-probs' rows)."""
    if ds is None:
        return None
    return ds.remove_columns(PAIR_INDEX).add_column(PAIR_INDEX, list(range(len(ds))))


def _build_source(i: int, source: Source, task: str, tokenizer, seed: int, main_first, base_labels) -> Datasets:
    """One source, its problems keyed datasets[i].<field> where the field is the source's own."""
    try:
        return build_datasets(source.args, task, tokenizer, seed, main_first, True, base_labels)
    except ConfigError as e:
        raise ConfigError(
            [
                (f"datasets[{i}].{k}", m) if k in SOURCE_FIELDS else (k, f"datasets[{i}] ({source.name}): {m}")
                for k, m in e.problems
            ]
        ) from None


def _check_same_labels(parts: list[Datasets]) -> None:
    first = parts[0].label_names
    for i, p in enumerate(parts[1:], start=1):
        if p.label_names != first:
            raise ConfigError(
                [
                    (
                        f"datasets[{i}].label_column",
                        f"its labels {p.label_names} differ from datasets[0]'s {first}: the sources of a "
                        "classification mixture share one head; give them the same label set",
                    )
                ]
            )


# ---------------------------------------------------------------- the epoch order


def quotas(n: int, weights: list[float]) -> list[int]:
    """n draws shared out by weight: floor(n x w / sum), the rest one each to the largest remainders (ties: the
    earlier source)."""
    total = sum(weights)
    exact = [n * w / total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


class MixtureSampler(torch.utils.data.Sampler):
    """The epoch's order over the concatenated sources: depends only on (seed, epoch), sizes and weights.

    Like EpochSampler (which it is, for one source): not a RandomSampler and without a `generator`
    attribute, so accelerate neither swaps nor synchronises it; every rank computes the same order.
    """

    def __init__(self, sizes: list[int], weights: list[float], seed: int):
        self.sizes, self.weights, self.seed, self.epoch = list(sizes), list(weights), seed, 0
        self.n = sum(self.sizes)
        self.counts = quotas(self.n, self.weights)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]

    @classmethod
    def of(cls, ds: Datasets, seed: int) -> MixtureSampler:
        m = ds.mixture or Mixture(["train"], [1.0], [len(ds.train)])
        return cls(m.sizes, m.weights, seed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return in_chunks(self.order(self.epoch))

    def order(self, epoch: int) -> torch.Tensor:
        """Row indices (into the concatenation) of epoch `epoch`, in training order."""
        if len(self.sizes) == 1:
            return self._rows(0, epoch)
        which = torch.repeat_interleave(torch.arange(len(self.sizes)), torch.tensor(self.counts))
        g = seeded((self.seed * 100_003 + epoch) * 7 + 3)  # apart from the rows' seeds
        which = which[torch.randperm(self.n, generator=g)]
        out = torch.empty(self.n, dtype=torch.long)
        for i in range(len(self.sizes)):
            out[which == i] = self._rows(i, epoch) + self.offsets[i]
        return out

    def _rows(self, i: int, epoch: int) -> torch.Tensor:
        """Source i's rows for the epoch: positions epoch x count .. (epoch + 1) x count - 1 of its endless
        stream of shuffles (shuffle k as EpochSampler's epoch k; source 0 with the run's seed itself)."""
        n, count = self.sizes[i], self.counts[i]
        if count == 0:
            return torch.empty(0, dtype=torch.long)
        start = epoch * count
        first, last = start // n, (start + count - 1) // n
        seed = self.seed if i == 0 else (self.seed * 1_000_003 + i) % 2**62
        stream = EpochSampler(n, seed)
        shuffles = []
        for k in range(first, last + 1):
            stream.set_epoch(k)
            shuffles.append(stream.permutation())
        return torch.cat(shuffles)[start - first * n : start - first * n + count]


# ---------------------------------------------------------------- eval per source


def summarize_by_source(
    stats: dict[str, torch.Tensor], metrics: dict[str, Any], n_labels: int | None, names: list[str] | None
) -> dict[str, float]:
    """metrics.summarize over all eval rows, then over each source's rows as eval_<name>_<metric>. A backend
    whose eval statistics are sums over the batch rather than per row (Megatron-LM) passes on no `source`
    (its gather_for_metrics): the overall values only."""
    out = summarize(stats, metrics, n_labels)
    source = stats.get(SOURCE)
    if names is None or source is None:
        return out
    assert len(source) == len(stats["nll"]), "a source for every eval row"
    for i, name in enumerate(names):
        rows = source == i
        if rows.any():
            part = summarize({k: v[rows] for k, v in stats.items()}, metrics, n_labels)
            out.update({f"eval_{name}_{k.removeprefix('eval_')}": v for k, v in part.items()})
    return out
