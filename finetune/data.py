"""Data: load (Hub id or local files), format, tokenize (cached, once), pack, collate, order.

Formats and what the loss sees (labels = -100 are not supervised):
  text            raw text, tokenized, joined with EOS and cut into max_seq_length blocks; every token
  instruction     prompt (through prompt_template) + response + EOS; only response and EOS
  chat            `messages` through the tokenizer's chat template; only assistant turns
  classification text (+ optional pair) and one label per example
Task seq2seq (encoder-decoder): the encoder reads the prompt (instruction format; prompt_template is the
causal LM's way of showing it and is not used) or the source column (source_target format); the labels are
the response or target + EOS, every one supervised (no shift: decoder logits align with the labels).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.config import DATA_EXTENSIONS, TASK_FORMATS, ConfigError, DataArgs, data_files, looks_local

IGNORE = -100
logger = logging.getLogger("finetune")


@dataclass
class Datasets:
    """What the data builder hands the run: tokenized splits plus facts the model builder needs."""

    train: Any
    eval: Any | None
    format: str
    label_names: list[str] | None  # classification: id -> name
    supervised_tokens: int  # in train, after truncation
    mixture: Any = None  # finetune.mixture.Mixture: the sources of the train rows (mixture.build_mixture_datasets)


# ---------------------------------------------------------------- loading


def _load(spec: str, data: DataArgs, split: str | None) -> Any:
    """Load one split from a Hub id or local files. Errors are ConfigErrors naming the key."""
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
            return datasets.load_dataset(kind, data_files=files, split="train")
        except Exception as e:  # datasets raises many types for malformed files
            raise ConfigError(
                [(key, f"could not read {spec!r} as {kind}: {_first_line(_cause(e))}; fix the file (or leave it out)")]
            ) from None
    try:
        return datasets.load_dataset(spec, data.dataset_config, split=split or data.train_split)
    except Exception as e:
        raise ConfigError(
            [
                (
                    key,
                    f"could not load Hub dataset {spec!r} (split {split or data.train_split!r}): "
                    f"{_first_line(e)}. Check the id and split, or give local files",
                )
            ]
        ) from None


def _cause(e: BaseException) -> BaseException:
    """The error under datasets' generic DatasetGenerationError (which says only that one happened)."""
    while type(e).__name__ == "DatasetGenerationError" and (e.__cause__ or e.__context__):
        e = e.__cause__ or e.__context__
    return e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def load_splits(data: DataArgs, seed: int) -> tuple[Any, Any | None]:
    """(train, eval or None) raw datasets, eval from a file, a split, or a seeded held-out fraction."""
    train = _load(data.dataset, data, None if looks_local(data.dataset) else data.train_split)
    if len(train) == 0:
        raise ConfigError([("dataset", f"{data.dataset!r} has no examples")])
    if data.eval_dataset:
        evalset = _load(data.eval_dataset, data, data.eval_split)
    elif data.eval_split:
        if looks_local(data.dataset):
            raise ConfigError(
                [("eval_split", "local files have one split; give eval_dataset or eval_fraction instead")]
            )
        evalset = _load(data.dataset, data, data.eval_split)
    elif data.eval_fraction > 0:
        n_eval = max(1, round(len(train) * data.eval_fraction))
        if n_eval >= len(train):
            raise ConfigError([("eval_fraction", f"leaves no training data out of {len(train)} examples; lower it")])
        parts = train.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
        train, evalset = parts["train"], parts["test"]
    else:
        evalset = None
    if data.max_train_samples:
        train = train.select(range(min(data.max_train_samples, len(train))))
    return train, evalset


# ---------------------------------------------------------------- formats


def detect_format(columns: list[str], data: DataArgs, task: str) -> str:
    """The format named in config, or the one the columns imply."""
    if data.format != "auto":
        return data.format
    present = {  # in the order auto tries them, among the task's formats (TASK_FORMATS)
        "classification": True,
        "source_target": data.source_column in columns and data.target_column in columns,
        "chat": data.messages_column in columns,
        "instruction": data.prompt_column in columns or "instruction" in columns,
        "text": data.text_column in columns,
    }
    for fmt, found in present.items():
        if found and fmt in TASK_FORMATS[task]:
            return fmt
    raise ConfigError(
        [
            (
                "format",
                f"cannot find input -> target pairs for task seq2seq in columns {columns}; set source_column and "
                "target_column (format source_target) or prompt_column and response_column (format instruction)",
            )
            if task == "seq2seq"
            else (
                "format",
                f"cannot tell the format from columns {columns}; set format "
                "(text/instruction/chat) and the matching *_column fields",
            )
        ]
    )


def required_columns(fmt: str, columns: list[str], data: DataArgs) -> list[tuple[str, str]]:
    """Problems with the columns a format needs, each naming the config key to fix."""
    need: list[tuple[str, str]] = []
    if fmt in ("text", "classification"):
        need.append(("text_column", data.text_column))
    if fmt == "classification":
        need.append(("label_column", data.label_column))
        if data.text_pair_column:
            need.append(("text_pair_column", data.text_pair_column))
    if fmt == "chat":
        need.append(("messages_column", data.messages_column))
    if fmt == "instruction":
        alpaca = "instruction" in columns and "output" in columns
        if not alpaca:
            need += [("prompt_column", data.prompt_column), ("response_column", data.response_column)]
    if fmt == "source_target":
        need += [("source_column", data.source_column), ("target_column", data.target_column)]
    return [
        (key, f"column {col!r} not in the data (columns: {columns}); set {key}, or a format that fits the data")
        for key, col in need
        if col not in columns
    ]


CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates know


class BadExample(ValueError):
    """An example the format cannot use; `key` is the config field that points at the wrong data."""

    def __init__(self, key: str, message: str):
        super().__init__(key, message)
        self.key, self.message = key, message


def _prompt_response(ex: dict, data: DataArgs) -> tuple:
    """An instruction example's (prompt, response); alpaca's instruction + input is the prompt."""
    if data.prompt_column in ex and ex[data.prompt_column] is not None:
        return ex[data.prompt_column], ex[data.response_column]
    return ex["instruction"] + (f"\n\n{ex['input']}" if ex.get("input") else ""), ex["output"]


def _instruction(tokenizer, data: DataArgs, max_len: int) -> Callable:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def fn(ex: dict) -> dict:
        prompt, response = _prompt_response(ex, data)
        if response is None or prompt is None:  # nothing to learn: dropped (and counted) by the filter
            return {"input_ids": [], "labels": []}
        p = tokenizer(data.prompt_template.format(prompt=prompt), add_special_tokens=True)["input_ids"]
        r = tokenizer(str(response), add_special_tokens=False)["input_ids"] + eos
        ids = (p + r)[:max_len]
        labels = ([IGNORE] * len(p) + r)[:max_len]
        return {"input_ids": ids, "labels": labels}

    return fn


def _seq2seq(tokenizer, data: DataArgs, max_len: int, fmt: str) -> Callable:
    """Encoder input: the prompt (or source) with the tokenizer's special tokens (T5 appends EOS, BART wraps in
    BOS/EOS); labels: the response (or target) + EOS, each truncated to max_len on its own."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def fn(ex: dict) -> dict:
        if fmt == "source_target":
            source, target = ex[data.source_column], ex[data.target_column]
        else:
            source, target = _prompt_response(ex, data)
        if source is None or target is None:  # nothing to learn: dropped (and counted) by the filter
            return {"input_ids": [], "labels": []}
        ids = tokenizer(str(source), add_special_tokens=True)["input_ids"][:max_len]
        labels = (tokenizer(str(target), add_special_tokens=False)["input_ids"] + eos)[:max_len]
        return {"input_ids": ids, "labels": labels}

    return fn


def _chat(tokenizer, data: DataArgs, max_len: int) -> Callable:
    """Render with the chat template; supervise exactly the tokens each assistant turn adds.

    Works with any template whose rendering of a conversation prefix is a token prefix of the
    whole rendering (true of the usual ChatML/Llama/Mistral templates); others are refused.
    """

    def render(messages: list[dict], gen: bool = False) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def fn(ex: dict) -> dict:
        messages = ex[data.messages_column]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise BadExample(
                "messages_column",
                f"column {data.messages_column!r} must hold lists of {{role, content}} messages, got "
                f"{str(messages)[:60]!r}; set messages_column to such a column, or a format that fits the data",
            )
        roles = {m["role"] for m in messages}
        if "assistant" not in roles and roles - set(CHAT_ROLES):
            raise BadExample(
                "messages_column",
                f"a conversation in {data.messages_column!r} has the role(s) "
                f"{', '.join(map(repr, sorted(roles - set(CHAT_ROLES), key=str)))} and no 'assistant' turn, so nothing "
                f"to learn (finetune learns the assistant's turns; roles: {', '.join(CHAT_ROLES)}); fix the data: "
                "name the model's turns 'assistant' (e.g. bot -> assistant)",
            )
        ids: list[int] = []
        labels: list[int] = []
        for k, msg in enumerate(messages):
            steps = [(render(messages[:k], gen=True), False)] if msg["role"] == "assistant" and k else []
            steps.append((render(messages[: k + 1]), msg["role"] == "assistant"))
            for new, supervised in steps:
                if new[: len(ids)] != ids:
                    raise ValueError(
                        "the chat template does not render a conversation prefix as a token prefix; "
                        "set chat_template to one that does"
                    )
                labels += new[len(ids) :] if supervised else [IGNORE] * (len(new) - len(ids))
                ids = new
        return {"input_ids": ids[:max_len], "labels": labels[:max_len]}

    return fn


def _classification(tokenizer, data: DataArgs, max_len: int, label_ids: dict | None) -> Callable:
    def fn(batch: dict) -> dict:
        pair = batch[data.text_pair_column] if data.text_pair_column else None
        enc = tokenizer(batch[data.text_column], pair, truncation=True, max_length=max_len)
        labels = batch[data.label_column]
        return {"input_ids": enc["input_ids"], "labels": [label_ids[v] if label_ids else v for v in labels]}

    return fn


def _text(tokenizer, data: DataArgs, max_len: int) -> Callable:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def fn(batch: dict) -> dict:
        stream = [t for ids in tokenizer(batch[data.text_column])["input_ids"] for t in ids + eos]
        n = max(len(stream) // max_len, 1)  # a short batch still yields one (shorter) block
        blocks = [stream[i * max_len : (i + 1) * max_len] for i in range(n)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    return fn


def _unique(ds, column: str) -> list:
    try:
        return ds.unique(column)
    except (NotImplementedError, TypeError):  # pyarrow cannot hash a column of mixed types (JSON)
        return list({repr(v): v for v in ds[column]}.values())


def label_names_of(train, data: DataArgs) -> tuple[list[str], dict | None]:
    """Names of the classes and, for string labels, the name -> id map (sorted, so stable)."""
    values = _unique(train, data.label_column)
    if any(v is None for v in values):
        raise ConfigError([("label_column", f"column {data.label_column!r} has empty labels; fill or drop those rows")])
    if all(isinstance(v, str) for v in values):
        names = sorted(values)
        return names, {n: i for i, n in enumerate(names)}
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise ConfigError([("label_column", f"label {min(values)} is negative; labels must be 0..N-1 or strings")])
        return [str(i) for i in range(max(values) + 1)], None
    raise ConfigError(
        [
            (
                "label_column",
                f"labels must be all ints or all strings, got {sorted(map(repr, values))[:5]}; make them one type",
            )
        ]
    )


def supervised_count(labels: list[int], task: str) -> int:
    """Tokens (causal LM: after the one-token shift; seq2seq: every target token) or examples the loss is taken
    over."""
    if task == "classification":
        return 1
    if task == "seq2seq":
        return sum(1 for t in labels if t != IGNORE)
    return sum(1 for t in labels[1:] if t != IGNORE)


# ---------------------------------------------------------------- packing and collation


def pack(batch: dict, max_len: int) -> dict:
    """First-fit-decreasing packing into rows of at most max_len tokens (deterministic).

    Longest examples first, each into the first row with room: rows come out nearly full, so the
    collator pads little (greedy in-order packing left ~20% padding on instruction data of lengths
    16..512; this leaves ~2%). Each example keeps its own position_ids (0..n-1); transformers turns
    position_ids that restart into a block-diagonal causal mask, so packed examples never attend to
    each other.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    members: list[list[int]] = []  # example indices per row
    room: list[int] = []
    for i in sorted(range(len(ids)), key=lambda i: -len(ids[i])):
        n = len(ids[i])
        row = next((r for r, free in enumerate(room) if n <= free), None)
        if row is None:
            members.append([])
            room.append(max_len)
            row = len(room) - 1
        members[row].append(i)
        room[row] -= n
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for row in members:
        rows["input_ids"].append([t for i in row for t in ids[i]])
        # The first token of a later example would be "predicted" from the previous example: mask it.
        rows["labels"].append(
            [t for k, i in enumerate(row) for t in (labels[i] if k == 0 else [IGNORE, *labels[i][1:]])]
        )
        rows["position_ids"].append([p for i in row for p in range(len(ids[i]))])
    return rows


class Collator:
    """Pad a list of examples to the longest one (rounded up to a multiple of 8), plus batch facts.

    Padded labels are -100. Unpacked batches get an attention_mask; packed ones get position_ids
    instead (padding becomes one more, unsupervised, segment). Encoder-decoder batches pad the encoder
    input and the labels each to their own longest (the model builds the decoder input from the labels).
    """

    def __init__(self, pad_token_id: int, multiple_of: int = 8, encoder_decoder: bool = False):
        self.pad = pad_token_id
        self.multiple_of = multiple_of
        self.encoder_decoder = encoder_decoder

    def _width(self, rows: list) -> int:
        return -(-max(len(r) for r in rows) // self.multiple_of) * self.multiple_of

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = self._encoder_decoder(examples) if self.encoder_decoder else self._padded(examples)
        if "source" in examples[0]:  # a mixture's eval rows name their source (finetune.mixture): eval per source
            batch["source"] = torch.tensor([e["source"] for e in examples])
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
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": labels_t,
            ("position_ids" if packed else "attention_mask"): torch.tensor(extra, dtype=torch.long),
            # Batch facts for the loop (popped before the forward): real input tokens, positions
            # computed (padding included), and what the model's mean loss is taken over (causal LM:
            # labels after the one-token shift).
            "num_tokens": torch.tensor(sum(len(e["input_ids"]) for e in examples)),
            "num_positions": torch.tensor(len(examples) * width),
            "num_supervised": (labels_t[:, 1:] != IGNORE).sum() if per_token else torch.tensor(len(examples)),
        }

    def _encoder_decoder(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        """Tokens and positions count both sides; the loss is over every target token (no shift)."""
        enc, dec = [e["input_ids"] for e in examples], [e["labels"] for e in examples]
        w_enc, w_dec = self._width(enc), self._width(dec)
        labels = torch.tensor([list(x) + [IGNORE] * (w_dec - len(x)) for x in dec], dtype=torch.long)
        return {
            "input_ids": torch.tensor([list(x) + [self.pad] * (w_enc - len(x)) for x in enc], dtype=torch.long),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (w_enc - len(x)) for x in enc], dtype=torch.long),
            "labels": labels,
            "num_tokens": torch.tensor(sum(len(x) for x in enc) + sum(len(x) for x in dec)),
            "num_positions": torch.tensor(len(examples) * (w_enc + w_dec)),
            "num_supervised": (labels != IGNORE).sum(),
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
        return iter(self.permutation().tolist())

    def permutation(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.n, generator=g)


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
    data: DataArgs, task: str, tokenizer, seed: int, main_first: Callable[[], AbstractContextManager]
) -> Datasets:
    """Load, format, tokenize (main process first, so the others hit the datasets cache), filter, pack."""
    with main_first():
        train_raw, eval_raw = load_splits(data, seed)
    fmt = _checked_format(train_raw, eval_raw, data, task, tokenizer)
    label_names, label_ids = _labels(train_raw, eval_raw, data) if fmt == "classification" else (None, None)
    max_len = data.max_seq_length
    if task == "seq2seq":  # validate() and detect_format() leave only instruction or source_target here
        fn, batched = _seq2seq(tokenizer, data, max_len, fmt), False
    else:
        fn, batched = {
            "text": (_text(tokenizer, data, max_len), True),
            "instruction": (_instruction(tokenizer, data, max_len), False),
            "chat": (_chat(tokenizer, data, max_len), False),
            "classification": (_classification(tokenizer, data, max_len, label_ids), True),
        }[fmt]
    with main_first():
        train = _tokenize(train_raw, "train", fn, batched, data, fmt, task)
        evalset = _tokenize(eval_raw, "eval", fn, batched, data, fmt, task) if eval_raw is not None else None
        dropped = len(train_raw) - len(train) if fmt != "text" else 0
        key, answer, nulls = _null_answers(train_raw, data, fmt)
        if len(train) == 0:
            raise ConfigError([_nothing_to_learn(len(train_raw), key, answer, nulls, max_len)])
        if dropped:
            why = f"{nulls} with a null {answer!r}, the others truncated away?" if nulls else "truncated away?"
            logger.warning(
                "dropped %d of %d training examples with no supervised token (%s)", dropped, len(train_raw), why
            )
        if data.packing:
            train = _packed(train, max_len)
    if fmt == "classification":
        n_super = len(train)
    else:
        n_super = sum(supervised_count(lab, task) for lab in train["labels"])
    return Datasets(train=train, eval=evalset, format=fmt, label_names=label_names, supervised_tokens=n_super)


def _null_answers(rows, data: DataArgs, fmt: str) -> tuple[str, str, int]:
    """The answers to learn (instruction, source_target): (config key, column, how many rows have none)."""
    columns = rows.column_names
    if fmt == "source_target":
        key, answer = "target_column", data.target_column
    elif fmt == "instruction":
        key, answer = "response_column", data.response_column if data.prompt_column in columns else "output"
    else:
        return "", "", 0
    return key, answer, rows.with_format("arrow")[answer].null_count if answer in columns else 0


def _nothing_to_learn(rows: int, key: str, answer: str, nulls: int, max_len: int) -> tuple[str, str]:
    """The problem when no training example has a supervised token left: null answers, or truncation."""
    if nulls == rows:
        return key, (
            f"every training example has a null {answer!r} (no answer to learn); fill in the answers, or set "
            f"{key} to the column that holds them"
        )
    if nulls:
        return "dataset", (
            f"no training example has a supervised token left: {nulls} of {rows} have a null {answer!r} and the "
            f"others were truncated away at max_seq_length={max_len}; raise max_seq_length, or fill in the answers"
        )
    return "dataset", (
        f"no training example has a supervised token left after truncation to max_seq_length={max_len}; raise "
        "max_seq_length or check the response columns"
    )


def _checked_format(train_raw, eval_raw, data: DataArgs, task: str, tokenizer) -> str:
    """The data's format, with the columns it needs in train and eval, and a chat template for chat data."""
    columns = list(train_raw.column_names)
    fmt = detect_format(columns, data, task)
    problems = required_columns(fmt, columns, data)
    if eval_raw is not None:  # a column missing from both is one problem
        in_train = {k for k, _ in problems}
        eval_problems = required_columns(fmt, list(eval_raw.column_names), data)
        problems += [(k, f"eval data: {m}") for k, m in eval_problems if k not in in_train]
    if problems:
        raise ConfigError(problems)
    if fmt == "chat" and not tokenizer.chat_template:
        raise ConfigError(
            [
                (
                    "chat_template",
                    "chat data needs a chat template and this tokenizer has none; "
                    "set chat_template (Jinja text or a file)",
                )
            ]
        )
    return fmt


def _labels(train_raw, eval_raw, data: DataArgs):
    """A classifier's label names and ids, from train; eval may use no label that train lacks."""
    label_names, label_ids = label_names_of(train_raw, data)
    if label_names and eval_raw is not None:
        unknown = set(_unique(eval_raw, data.label_column)) - set(label_ids or range(len(label_names)))
        if unknown:
            raise ConfigError(
                [
                    (
                        "label_column",
                        f"eval labels {sorted(map(str, unknown))[:5]} never occur in train; "
                        "fix the eval data or its labels",
                    )
                ]
            )
    return label_names, label_ids


def _tokenize(ds, name: str, fn, batched: bool, data: DataArgs, fmt: str, task: str):
    """Rows -> tokens and labels; rows left with nothing to learn are dropped."""
    try:
        ds = ds.map(
            fn,
            batched=batched,
            remove_columns=ds.column_names,
            num_proc=data.preprocessing_num_workers,
            desc=f"tokenizing {name}",
        )
    except BadExample as e:
        raise ConfigError([(e.key, e.message)]) from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            [("dataset" if name == "train" else "eval_dataset", f"{fmt} formatting failed: {_first_line(e)}")]
        ) from None
    return ds.filter(
        lambda ex: supervised_count(ex["labels"], task) > 0, desc=f"dropping {name} examples with nothing to learn"
    )


def _packed(train, max_len: int):
    """Rows packed into sequences of max_len (greedy, in order: pack)."""
    from datasets.fingerprint import Hasher

    # datasets hashes a module-level function by name, not code: put the code in the cache key,
    # so a changed packing algorithm never reuses rows packed by an older one.
    fingerprint = Hasher.hash([train._fingerprint, inspect.getsource(pack), max_len])
    return train.map(
        pack,
        batched=True,
        batch_size=1000,
        fn_kwargs={"max_len": max_len},
        desc="packing",
        new_fingerprint=fingerprint,
    )
