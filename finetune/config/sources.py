"""Several weighted data sources (`datasets:`): each source's own data fields, its name and its problems."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from finetune.config.schema import DATA_EXTENSIONS, FORMATS, TASK_FORMATS, DataArgs, choice, coerce, format_misfits

# The data fields a source of a mixture may set for itself; the others (max_seq_length, packing, ...) hold for all.
SOURCE_FIELDS = (
    "dataset",
    "dataset_config",
    "train_split",
    "eval_dataset",
    "eval_split",
    "eval_fraction",
    "eval_fraction_max_rows",
    "format",
    "text_column",
    "text_pair_column",
    "prompt_column",
    "prompt_template",
    "response_column",
    "messages_column",
    "role_key",
    "content_key",
    "role_map",
    "tools_column",
    "chosen_column",
    "rejected_column",
    "source_column",
    "target_column",
    "label_column",
    "max_train_samples",
)


SOURCE_KEYS = (*SOURCE_FIELDS, "weight", "name")


# What each format tokenizes to: sources mix when their rows have the same schema (a label, or tokens).
ROW_SCHEMA = {fmt: "label" if fmt in TASK_FORMATS["classification"] else "tokens" for fmt in FORMATS if fmt != "auto"}
# format_misfits' reasons, as a source's `datasets[i].format` says them
SOURCE_FORMAT_FIXES = {
    "needs_label": "{fmt!r} is a causal-LM format; task classification needs format classification: set it (or auto)",
    "is_label": "classification data needs task classification: set task: classification",
    "needs_pairs": "{fmt!r} has no input -> target pairs for task seq2seq; use instruction or source_target sources",
    "is_pairs": "source_target is the encoder-decoder format; set task: seq2seq",
}


@dataclass(frozen=True)
class Source:
    """One source of the training data: its own data fields (the top-level ones where it sets none)."""

    name: str  # eval_<name>_loss
    weight: float
    args: DataArgs


def default_source_name(spec: str) -> str:
    """A source's name when it gives none: its file (or directory, or Hub dataset) name without extension."""
    base = Path(spec.rstrip("/")).name
    base = base.split("*")[0].split("?")[0] or Path(spec.rstrip("/")).parent.name
    stem = base[: -len(Path(base).suffix)] if Path(base).suffix.lower() in DATA_EXTENSIONS else base
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in stem).strip("_") or "source"


def sources_of(d: DataArgs) -> list[Source]:
    """The run's training sources: the `datasets:` list, or `dataset:` alone as a one-source mixture. (Values
    that do not validate are left at the top-level ones: source_problems reports them.)"""
    if not d.datasets:
        return [Source(default_source_name(d.dataset), 1.0, d)]
    out = []
    for entry in d.datasets:
        coerced = {k: coerce("data", k, v) for k, v in entry.items() if k in SOURCE_FIELDS}
        args = dataclasses.replace(d, datasets=None, **{k: v for k, (v, err) in coerced.items() if err is None})
        weight = entry.get("weight", 1.0)
        weight = float(weight) if isinstance(weight, (int, float)) and not isinstance(weight, bool) else 1.0
        out.append(Source(str(entry.get("name") or default_source_name(args.dataset)), weight, args))
    return out


def has_eval_data(d: DataArgs) -> bool:
    """Whether some source has eval data (its own eval set or split, or a held-out fraction)."""
    if d.datasets and not all(isinstance(e, dict) for e in d.datasets):
        return True  # reported elsewhere
    sources = sources_of(d) if d.datasets else [Source("", 1.0, d)]
    return any(s.args.eval_dataset or s.args.eval_split or s.args.eval_fraction > 0 for s in sources)


def source_problems(
    d: DataArgs, task: str, check_path: Callable[[list, str, str], None] | None = None
) -> list[tuple[str, str]]:
    """Problems with `datasets:`, each keyed datasets[i].field: unknown or mistyped fields, weights, names,
    formats that cannot mix; and missing files when given `check_path` (preflight.check_data_path)."""
    if d.datasets is None:
        return []
    p: list[tuple[str, str]] = []
    if d.dataset:
        p.append(("datasets", "and dataset are both set; give one (a one-source list, or dataset: alone)"))
    for key in ("eval_dataset", "eval_split"):
        if getattr(d, key):
            p.append((key, f"applies to one source: with datasets:, set it inside a source (datasets[i].{key})"))
    if not d.datasets:
        p.append(("datasets", "is empty; list at least one source ({dataset: FILE, weight: 1}), or use dataset:"))
    names: dict[str, int] = {}
    kinds: dict[str, int] = {}  # row schema -> first source with it
    for i, entry in enumerate(d.datasets):
        at = f"datasets[{i}]"
        if not isinstance(entry, dict):
            p.append((at, f"must be a mapping like {{dataset: data/chat.jsonl, weight: 0.6}}, got {entry!r}"))
            continue
        ok = _entry_field_problems(p, at, entry)
        if not entry.get("dataset"):
            p.append((f"{at}.dataset", "is required: a Hub dataset id or local data files"))
            continue
        if ok:
            _source_problems(p, d, task, i, entry, names, kinds, check_path)
    return p


def _entry_field_problems(p: list, at: str, entry: dict) -> bool:
    """A source's own fields: known, typed, a positive weight, a usable name. False when a field is mistyped."""
    ok = True
    for key, value in entry.items():
        if key in SOURCE_FIELDS:
            value, err = coerce("data", key, value)
            if err:
                p.append((f"{at}.{key}", err))
                ok = False
        elif key not in ("weight", "name"):
            if key in {f.name for f in dataclasses.fields(DataArgs)}:
                hint = "; it applies to every source: set it at the top level"
            else:
                close = difflib.get_close_matches(str(key), SOURCE_KEYS, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else f"; a source takes {', '.join(SOURCE_KEYS)}"
            p.append((f"{at}.{key}", f"unknown field{hint}"))
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 or weight == float("inf"):
        p.append((f"{at}.weight", f"must be a number > 0 (its share is weight / sum of weights), got {weight!r}"))
    name = entry.get("name")
    if name is not None and (
        not isinstance(name, str) or not name or any(not (c.isalnum() or c in "_-") for c in name)
    ):
        p.append((f"{at}.name", f"must be letters, digits, _ or - (it names eval_<name>_loss), got {name!r}"))
    return ok


def _source_problems(p: list, d: DataArgs, task: str, i: int, entry: dict, names: dict, kinds: dict, check_path):
    """One well-typed source against the others and the task: a distinct name, a format that fits, its files."""
    at, name = f"datasets[{i}]", entry.get("name")
    source = sources_of(dataclasses.replace(d, datasets=[entry]))[0]
    s = source.args
    if name is None or isinstance(name, str):
        first = names.setdefault(source.name, i)
        if first != i:
            why = (
                f"{source.name!r} is also datasets[{first}]'s name (from the file name when not given); "
                "set name: to tell them apart"
            )
            p.append((f"{at}.name", why))
    if s.format not in FORMATS:
        choice(p, f"{at}.format", s.format, FORMATS)
    elif s.format != "auto":
        schema = ROW_SCHEMA[s.format]
        first = kinds.setdefault(schema, i)
        other = next((j for k, j in kinds.items() if k != schema), None)
        misfits = format_misfits(task, s.format)
        if other is not None and first == i:
            was = d.datasets[other].get("format") or d.format
            why = (
                f"{s.format!r} rows cannot mix with datasets[{other}]'s {was!r} rows: the sources of a mixture "
                "must tokenize to the same rows (causal_lm: text, instruction, chat; classification: "
                "classification); set a format of one kind, or train them in separate runs"
            )
            p.append((f"{at}.format", why))
        elif misfits:
            p.append((f"{at}.format", SOURCE_FORMAT_FIXES[misfits[0]].format(fmt=s.format)))
    if not 0 <= s.eval_fraction < 1:
        p.append((f"{at}.eval_fraction", f"must be in [0, 1), got {s.eval_fraction}"))
    for key in ("max_train_samples", "eval_fraction_max_rows"):
        if getattr(s, key) is not None and getattr(s, key) < 1:
            p.append((f"{at}.{key}", f"must be >= 1 or null (off), got {getattr(s, key)}"))
    if "{prompt}" not in s.prompt_template:
        p.append((f"{at}.prompt_template", "must contain the placeholder {prompt}"))
    if check_path:
        check_path(p, f"{at}.dataset", s.dataset)
        if s.eval_dataset:
            check_path(p, f"{at}.eval_dataset", s.eval_dataset)
