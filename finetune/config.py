"""The run config: what to train. Typed, documented, parsed and validated once at the edge.

A run config is a flat YAML mapping (``model: ...``, ``dataset: ...``, ``learning_rate: ...``).
Every field below can also be given on the command line as ``--<field> <value>``, which wins
over the file. Field names follow transformers' ``TrainingArguments`` where one exists.

The parallelism is *not* here: it is in the Accelerate config file given to ``accelerate launch``.

This module imports no torch: a bad file fails in well under a second, before any model loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TASKS = ("causal_lm", "classification", "seq2seq")
FORMATS = ("auto", "text", "instruction", "chat", "classification", "source_target")
GENERATION_METRICS = ("exact_match", "rouge", "bleu")  # scored on generated text (generation_metrics)
DTYPES = ("float32", "bfloat16", "float16", "auto")
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
PREEMPTION_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGTERM")
CPU_ALLOCATORS = ("keep", "release", "system")
DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
SHIPPED_METRICS = Path(__file__).parent / "metric_modules"  # evaluate modules that load offline
DEFAULT_METRICS = {"causal_lm": [], "classification": ["accuracy", "f1"], "seq2seq": []}  # eval metrics by task
# Files whose presence in output_dir means "a previous run lives here".
RUN_MARKERS = ("metrics.jsonl", "checkpoints", "final", "run_config.yaml", "logs", "curves.png", "runs")


def shipped_metrics() -> list[str]:
    """The names of the evaluate modules shipped in SHIPPED_METRICS (they load offline)."""
    return sorted(p.name for p in SHIPPED_METRICS.iterdir() if p.is_dir())


class ConfigError(Exception):
    """One or more problems with the user's input. Each is (key, message) and names the fix."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.problems)
        lines = [f"finetune: {n} problem{'s' if n > 1 else ''} in the run config:"]
        lines += [f"  - {key}: {msg}" for key, msg in self.problems]
        return "\n".join(lines)


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelArgs:
    """Which model to fine-tune and how to load it."""

    model: str = _f("", "Hub id or local directory of the base model.")
    task: str = _f(
        "causal_lm",
        f"What to train: one of {', '.join(TASKS)}. seq2seq: an encoder-decoder (T5, BART; AutoModelForSeq2SeqLM) "
        "reads the prompt (or source) and learns to write the response (or target).",
    )
    torch_dtype: str = _f(
        "float32",
        "dtype the weights are loaded in and the optimizer updates: float32 (recommended: fp32 master weights, "
        "the compute precision is mixed_precision's), bfloat16, float16 or auto (the checkpoint's own). Full "
        "fine-tuning of 16-bit weights loses the updates below their resolution where nothing keeps fp32 master "
        "weights (single, DDP, TP; DeepSpeed and FSDP2 keep them under mixed precision): warned at start, with the "
        "measurement (docs/precision.md). LoRA on a 16-bit base is fine.",
    )
    mixed_precision: str = _f(
        "auto",
        "Compute precision when `accelerate launch` names none (its --mixed_precision, or a mixed_precision line in "
        "the Accelerate config, wins whenever it is there): auto = bf16 on GPUs that support it (Ampere and newer), "
        "fp32 on a CPU or an older GPU; no = fp32; bf16; fp16 (GPUs only, with loss scaling; refused on a CPU). "
        "The precision that really ran is observed from the model and logged in every metrics row.",
    )
    save_dtype: str = _f(
        "auto",
        "dtype of the exported model (final/, merged/, the best checkpoint's export): float32, bfloat16, float16, "
        "or auto = the base model's own (its config.json dtype; float32 when it names none). Written from the "
        "full-precision weights the optimizer updates, cast once, the same under every Accelerate config.",
    )
    trust_remote_code: bool = _f(False, "Run model/tokenizer code shipped with the checkpoint. Off unless asked.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    attn_implementation: str | None = _f(
        None, "Attention kernel (eager, sdpa, flash_attention_2); default: transformers' choice."
    )
    chat_template: str | None = _f(None, "Jinja chat template (text or a file path) for tokenizers without one.")


@dataclass
class DataArgs:
    """Where the examples come from and how they become token ids."""

    dataset: str = _f("", "Hub dataset id, or a local .json/.jsonl/.csv/.parquet/.txt file, glob or directory.")
    datasets: list[dict] | None = _f(
        None,
        "A weighted mixture instead of `dataset` (YAML list, or YAML text on the command line): each source a "
        "mapping of the per-source data fields (dataset, format, *_column, eval_dataset/eval_split/eval_fraction, "
        "...; left out: the top-level value) plus weight (> 0) and name (default: the file stem). Each epoch "
        "draws as many rows as all sources hold, weight / sum of weights of them from each source; eval is "
        "reported per source (eval_<name>_loss) and overall. See README, 'Dataset mixtures'.",
    )
    dataset_config: str | None = _f(None, "Hub dataset configuration name.")
    train_split: str = _f("train", "Split used for training.")
    eval_dataset: str | None = _f(None, "Separate eval data (same forms as `dataset`).")
    eval_split: str | None = _f(None, "Split of `dataset` (or `eval_dataset`) used for eval.")
    eval_fraction: float = _f(
        0.05,
        "When no eval data/split is given: fraction of train held out for eval (deterministic from seed); 0 disables eval.",
    )
    format: str = _f("auto", f"Example format: one of {', '.join(FORMATS)}; auto picks from the columns.")
    text_column: str = _f("text", "Column with raw text (text and classification formats).")
    text_pair_column: str | None = _f(None, "Optional second text column (classification of sentence pairs).")
    prompt_column: str = _f("prompt", "Instruction format: prompt column (alpaca's instruction/input also accepted).")
    prompt_template: str = _f(
        "### Instruction:\n{prompt}\n\n### Response:\n",
        "Instruction format: how a prompt is shown to the model; must contain {prompt}.",
    )
    response_column: str = _f("response", "Instruction format: response column (alpaca's output also accepted).")
    messages_column: str = _f("messages", "Chat format: column of [{role, content}] lists.")
    source_column: str = _f("source", "source_target format (task seq2seq): column the encoder reads.")
    target_column: str = _f("target", "source_target format (task seq2seq): column the decoder learns to write.")
    label_column: str = _f("label", "Classification format: label column (int ids or strings).")
    max_seq_length: int = _f(512, "Tokens per example; longer examples are truncated, raw text is chunked to it.")
    packing: bool = _f(False, "Pack several short examples into each row (causal LM), attention kept per example.")
    length_aware_batching: bool = _f(
        False,
        "Split each global batch into micro batches of similar token cost (long examples in smaller micro "
        "batches, short ones in larger): less padding, and ranks wait less for each other. The examples of "
        "each optimizer step stay the same; per_device_train_batch_size becomes the average rows per micro batch.",
    )
    max_train_samples: int | None = _f(None, "Use only the first N training examples (debugging).")
    preprocessing_num_workers: int | None = _f(None, "Processes for tokenization (datasets.map num_proc).")


@dataclass
class TrainArgs:
    """The optimisation: schedule, batch sizes, logging, checkpoints."""

    output_dir: str = _f("outputs/run", "Where metrics.jsonl, checkpoints/ and final/ are written.")
    overwrite_output_dir: bool = _f(False, "Replace a previous run in output_dir (refused otherwise).")
    max_steps: int = _f(-1, "Optimizer steps to run; -1 uses num_train_epochs.")
    num_train_epochs: float = _f(1.0, "Epochs to run when max_steps is -1.")
    per_device_train_batch_size: int = _f(8, "Micro batch per process.")
    per_device_eval_batch_size: int = _f(8, "Eval batch per process.")
    gradient_accumulation_steps: int = _f(1, "Micro batches per optimizer step on each process.")
    learning_rate: float = _f(5e-5, "Peak learning rate (AdamW).")
    weight_decay: float = _f(0.0, "AdamW weight decay (not applied to biases and norm weights).")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    lr_scheduler_type: str = _f("linear", f"One of {', '.join(SCHEDULERS)}.")
    warmup_steps: int = _f(0, "Linear warmup steps (wins over warmup_ratio when > 0).")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total steps.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    logging_steps: int = _f(10, "Log a metrics.jsonl row every N optimizer steps.")
    eval_steps: int | None = _f(None, "Evaluate every N optimizer steps (always at the end when there is eval data).")
    eval_on_start: bool = _f(False, "Evaluate once before training (shows the starting point).")
    save_steps: int | None = _f(500, "Checkpoint every N optimizer steps (always at the end).")
    save_total_limit: int | None = _f(None, "Keep only the newest N checkpoints.")
    metric_for_best_model: str | None = _f(
        None,
        "The eval metric that picks the best checkpoint (eval_loss, eval_perplexity, eval_accuracy, "
        "eval_<source>_loss ...; `loss` means eval_loss, as in transformers). Default with "
        "load_best_model_at_end: eval_loss.",
    )
    greater_is_better: bool | None = _f(
        None, "Whether a larger metric_for_best_model is better; default: false for loss and perplexity, else true."
    )
    load_best_model_at_end: bool = _f(
        False,
        "Export the best checkpoint's weights (by metric_for_best_model) to final/ instead of the last step's; "
        "needs eval_steps and save_steps a multiple of it. A new best is checkpointed when it is evaluated, "
        "and save_total_limit never prunes it.",
    )
    early_stopping_patience: int | None = _f(
        None,
        "Stop when metric_for_best_model has not improved (by more than early_stopping_threshold) for this many "
        "evaluations in a row; every rank stops at the same step, with a checkpoint.",
    )
    early_stopping_threshold: float = _f(
        0.0, "How much metric_for_best_model must improve on the best so far to reset early_stopping_patience."
    )
    seed: int = _f(42, "Seed for init, data order and dropout; results do not depend on the world size.")
    resume_from_checkpoint: str | None = _f(
        None,
        "'latest', a checkpoint directory, or 'auto' (resume when output_dir has a checkpoint, else start fresh: "
        "for launchers that restart failed jobs).",
    )
    metrics: list[str] | None = _f(
        None, "Eval metrics: names shipped with finetune (accuracy, f1) or any evaluate.load name; default by task."
    )
    generation_max_new_tokens: int | None = _f(
        None,
        "Generation eval: at every eval, greedily generate up to this many tokens for eval prompts (an eval "
        "example without its answer) and score them against the answers with generation_metrics; null or 0: off.",
    )
    generation_num_examples: int | None = _f(
        64, "Generation eval: how many eval examples to generate for (the first N of the eval set); null: all."
    )
    generation_metrics: list[str] = _f(
        list(GENERATION_METRICS),
        f"Generation eval: metrics of the generated text against the answers ({', '.join(GENERATION_METRICS)}, "
        "shipped with finetune; or an evaluate module taking text predictions and references). Eval rows get "
        "eval_exact_match, eval_rougeL, eval_bleu, ...; a few samples go to metrics.jsonl.",
    )
    preemption_signal: str = _f(
        "SIGUSR1",
        "Besides SIGTERM, the signal that asks the run to stop for preemption (SLURM: --signal=USR1@300): every "
        "rank finishes the optimizer step in progress, a checkpoint is written, and the run exits; "
        "--resume_from_checkpoint auto continues from it.",
    )
    ddp_timeout: int | None = _f(
        None,
        "Seconds a collective may wait for the other ranks before the run fails (a dead or stuck rank); "
        "default 600 on CPU, 1800 on GPU. Raise it when rank 0 tokenizes a very large dataset.",
    )
    cpu_allocator: str = _f(
        "keep",
        "CPU runs on Linux (glibc): what happens to the large buffers a step frees. keep: kept for the next step "
        "(no mmap, no trim below 2 GB): no page faults to refill them, steps up to ~1.5x faster on small models, "
        "a somewhat higher resident peak; release: returned at once (mmap above 64 KB, trim at 0): the lowest "
        "resident peak (what `finetune plan` estimates), slower steps; system: glibc's own thresholds. MALLOC_* "
        "variables in the environment win over it. Ignored on GPUs.",
    )
    ddp_find_unused_parameters: bool = _f(
        False, "DDP: detect parameters that get no gradient (slower; needed by some models)."
    )
    sync_batchnorm: bool = _f(False, "DDP: convert BatchNorm layers to SyncBatchNorm.")
    dataloader_num_workers: int | None = _f(
        None,
        "Worker processes per data loader; default: 2 on a GPU (the next batches are collated while the GPU "
        "computes; batches are also put in pinned memory there), 0 on a CPU (the cores are busy training).",
    )
    report_to: list[str] = _f(
        [],
        "Trackers that get every metrics row and the run config, through accelerate: tensorboard (files in "
        "output_dir/runs), wandb, mlflow, trackio, comet_ml, aim, clearml, dvclive, swanlab, or all (every one "
        "installed); metrics.jsonl and curves.png are always written.",
    )
    run_name: str | None = _f(
        None, "Name of the run in the trackers, the model card and `finetune plot` (default: output_dir's name)."
    )
    tracker_project: str = _f(
        "finetune",
        "Project (wandb, trackio, comet_ml), experiment (mlflow) or run folder (tensorboard) the trackers log to.",
    )
    push_to_hub: bool = _f(
        False,
        "At the end, the main process uploads final/ (model or adapter, tokenizer, model card; merged/ too) to the "
        "Hugging Face Hub. Needs a token (`hf auth login` or HF_TOKEN; never saved or logged), checked before "
        "training starts.",
    )
    hub_model_id: str | None = _f(
        None, "Hub repository (namespace/name, or name under your account); default: output_dir's name."
    )
    hub_private_repo: bool | None = _f(
        None, "Create the Hub repository as private (default: the Hub's default, public)."
    )
    disable_tqdm: bool = _f(False, "No progress bar (a log line every logging_steps instead).")


PEFT_METHODS = ("none", "lora", "dora")


@dataclass
class PeftArgs:
    """Adapters (a `peft:` mapping in YAML; --peft.<field> on the command line). Off by default."""

    method: str = _f("none", f"One of {', '.join(PEFT_METHODS)}; none trains every weight.")
    r: int = _f(8, "Adapter rank.")
    alpha: float = _f(16.0, "Adapter scaling numerator (lora_alpha); the update is scaled by alpha / r.")
    dropout: float = _f(0.0, "Dropout on the adapter input.")
    target_modules: list[str] = _f(["all-linear"], "Module names to adapt, or [all-linear].")
    modules_to_save: list[str] | None = _f(
        None, "Modules trained in full and saved with the adapter; a classifier head is added automatically."
    )
    adapter: str | None = _f(None, "An existing adapter directory to continue training from.")
    merge: bool = _f(False, "Also write final/merged: the base model with the adapter merged in.")
    load_in_4bit: bool = _f(False, "QLoRA: load the base model in 4 bit (bitsandbytes; CUDA only).")


SECTIONS = {"model": ModelArgs, "data": DataArgs, "train": TrainArgs, "peft": PeftArgs}
NESTED = ("peft",)  # sections written as a mapping in YAML and as --<section>.<field> on the command line


@dataclass
class RunConfig:
    """The whole run config: one section per builder. Flat in YAML and on the command line."""

    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    peft: PeftArgs = field(default_factory=PeftArgs)

    def to_flat(self) -> dict[str, Any]:
        """The effective config as the YAML a user would write (what is saved next to every export)."""
        flat: dict[str, Any] = {}
        for name in SECTIONS:
            values = dataclasses.asdict(getattr(self, name))
            if name in NESTED:
                flat[name] = values
            else:
                flat.update(values)
        return flat


def all_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """field name -> (section, dataclasses.Field), for every run-config field."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            name = f"{section}.{f.name}" if section in NESTED else f.name
            assert name not in out, f"duplicate field {name}"
            out[name] = (section, f)
    return out


def field_type(section: str, name: str) -> tuple[type, bool, type | None]:
    """(base type, optional?, list item type) of a field, from its annotation."""
    hint = typing.get_type_hints(SECTIONS[section])[name.removeprefix(f"{section}.")]
    optional = False
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        optional = type(None) in args
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is list:
        return list, optional, typing.get_args(hint)[0]
    return hint, optional, None


def _coerce(section: str, name: str, value: Any) -> tuple[Any, str | None]:
    """Check `value` against the field's type. Returns (value, error message or None)."""
    base, optional, item = field_type(section, name)
    if value is None:
        return (None, None) if optional else (value, f"must not be empty (expected {base.__name__})")
    if base is bool:
        if isinstance(value, bool):
            return value, None
        return value, f"expected true or false, got {value!r}"
    if base in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-3 (no dot) as a string; users write it anyway
            value = float(value)
        except ValueError:
            pass
    if base is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            return value, f"expected an integer, got {value!r}"
        return int(value), None
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, f"expected a number, got {value!r}"
        return float(value), None
    if base is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            return value, f"expected a list of {item.__name__}, got {value!r}"
        return value, None
    if base is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value), None
        if not isinstance(value, str):
            return value, f"expected a string, got {value!r}"
        return value, None
    raise AssertionError(f"unhandled type {base} for {name}")


def parse_cli_value(name: str, text: str) -> Any:
    """A command-line value for field `name`: `null`/`~` -> None; text fields stay text verbatim;
    others are typed as YAML would type them (`--max_steps 10` -> 10, `--packing true` -> True)."""
    if text in ("null", "~"):
        return None
    if name in all_fields() and field_type(all_fields()[name][0], name)[0] in (str, list):
        if field_type(all_fields()[name][0], name)[2] is dict:  # a list of mappings (datasets): YAML text
            try:
                return yaml.safe_load(text)
            except yaml.YAMLError:
                return text
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a run-config YAML file into a dict, with a clear error when it cannot be."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError([("--config", f"{str(p)!r} is a directory; pass the path of a run-config YAML file")])
    if not p.is_file():
        raise ConfigError([("--config", f"file {str(p)!r} does not exist; pass the path of a run-config YAML")])
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            [("--config", f"{p} is not valid YAML{where}: {getattr(e, 'problem', e)}; fix the syntax there")]
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError([("--config", f"cannot read {p}: {e}; save it as UTF-8 text")]) from None
    except OSError as e:
        raise ConfigError([("--config", f"cannot read {p}: {e}; check the path and its permissions")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("--config", f"{p} must hold a mapping of field: value, got a {type(data).__name__}")])
    return data


def build_config(values: dict[str, Any], *, check_filesystem: bool = True) -> RunConfig:
    """Turn a flat {field: value} dict (YAML merged with overrides) into a validated RunConfig.

    Every problem is collected and raised together as one ConfigError.
    """
    fields = all_fields()
    problems: list[tuple[str, str]] = []
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    flat: dict[str, Any] = {}
    for key, value in values.items():  # `peft: {r: 8}` -> `peft.r: 8`
        if key in NESTED and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        elif key in NESTED and value is not None:
            problems.append(
                (key, f"must be a mapping of its fields (e.g. {key}: {{method: lora, r: 8}}), got {value!r}")
            )
        elif key not in NESTED:
            flat[key] = value
    values = flat
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else "; see `finetune --help` for the fields"
            problems.append((str(key), f"unknown field{hint}"))
            continue
        section = fields[key][0]
        coerced, err = _coerce(section, key, value)
        if err:
            problems.append((key, err))
        else:
            sections[section][key.removeprefix(f"{section}.")] = coerced
    cfg = RunConfig(**{s: cls(**sections[s]) for s, cls in SECTIONS.items()})
    problems += validate(cfg, values.keys(), check_filesystem=check_filesystem)
    if problems:
        raise ConfigError(problems)
    return cfg


def _choice(problems: list, key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append((key, f"{value!r} is not one of {', '.join(choices)}{hint}"))


def looks_local(spec: str) -> bool:
    """True when a model/dataset spec names a local path rather than a Hub id."""
    return (
        spec.startswith((".", "/", "~"))
        or Path(spec).suffix.lower() in DATA_EXTENSIONS
        or any(c in spec for c in "*?[")
        or spec.count("/") > 1
        or os.path.exists(spec)
    )


def data_files(spec: str) -> list[str]:
    """The files a local dataset spec names: the files its glob matches, and the data files under the
    directories it matches."""
    import glob

    files = []
    for p in sorted(glob.glob(os.path.expanduser(spec))):
        if os.path.isdir(p):
            files += sorted(str(f) for f in Path(p).rglob("*") if f.suffix.lower() in DATA_EXTENSIONS)
        elif os.path.isfile(p):
            files.append(p)
    return files


def _check_data_path(problems: list, key: str, spec: str) -> None:
    if not looks_local(spec):
        return
    import glob

    if not any(os.path.isfile(p) or os.path.isdir(p) for p in glob.glob(os.path.expanduser(spec))):
        problems.append((key, f"no file or directory matches {spec!r}; give an existing path or a Hub dataset id"))
        return
    files = data_files(spec)
    extensions = ", ".join(DATA_EXTENSIONS)
    unsupported = [f for f in files if Path(f).suffix.lower() not in DATA_EXTENSIONS]
    kinds = sorted({DATA_EXTENSIONS.get(Path(f).suffix.lower()) for f in files} - {None})
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    empty = [f for f in files if f not in unreadable and os.path.getsize(f) == 0]
    if unsupported:
        problems.append((key, f"{unsupported[0]!r} has an unsupported extension; use one of {extensions}"))
    elif not files:
        problems.append(
            (key, f"{spec!r} holds no data files; add {extensions} files to it, or give the files themselves")
        )
    elif len(kinds) > 1:
        problems.append(
            (key, f"{spec!r} names files of {len(kinds)} kinds ({', '.join(kinds)}); give files of one kind")
        )
    elif unreadable:
        problems.append((key, f"{unreadable[0]!r} is not readable; fix its permissions"))
    elif empty:
        problems.append((key, f"{empty[0]!r} is empty; give a file with examples (or leave it out)"))


def _check_model_config(problems: list, model_dir: str, max_seq_length: int, task: str = "causal_lm") -> None:
    """What the model directory's config.json alone tells: that it is readable, how many positions fit, and
    whether it is an encoder-decoder (task seq2seq) or not."""
    import json

    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        problems.append(("model", f"cannot read {path} ({e}); point at a directory saved with save_pretrained"))
        return
    if not isinstance(config, dict):
        config = {}
    problems += encoder_decoder_problems(
        task, bool(config.get("is_encoder_decoder")), model_dir, config.get("model_type")
    )
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    if isinstance(limit, int) and not isinstance(limit, bool) and max_seq_length > limit:
        problems.append(
            (
                "max_seq_length",
                f"{max_seq_length} is beyond what {model_dir!r} supports "
                f"(max_position_embeddings={limit}); set max_seq_length <= {limit}",
            )
        )


def encoder_decoder_problems(task: str, encoder_decoder: bool, model: str, model_type: str | None) -> list:
    """task seq2seq needs an encoder-decoder model, and an encoder-decoder needs task seq2seq (also checked
    at load for Hub models, whose config.json is not read here)."""
    if task == "seq2seq" and not encoder_decoder:
        return [
            (
                "task",
                f"seq2seq needs an encoder-decoder model (T5, BART, ...; AutoModelForSeq2SeqLM) and {model!r} is a "
                f"{model_type or 'decoder-only'} model (its config has no is_encoder_decoder: true); set task: "
                "causal_lm, or point model at an encoder-decoder",
            )
        ]
    if task == "causal_lm" and encoder_decoder:
        return [("task", f"{model!r} is an encoder-decoder model ({model_type}); set task: seq2seq")]
    return []


def _task_problems(cfg: RunConfig, given: typing.Iterable[str]) -> list[tuple[str, str]]:
    """Formats and generation eval that the task cannot use: seq2seq needs input -> target pairs, generation
    needs eval examples whose answer is text."""
    m, d, t = cfg.model, cfg.data, cfg.train
    p: list[tuple[str, str]] = []
    if m.task == "seq2seq" and d.format not in ("auto", "instruction", "source_target"):
        p.append(
            (
                "format",
                f"{d.format!r} has no input -> target pairs for task seq2seq; set format: instruction (prompt -> "
                "response) or source_target (source_column -> target_column), or task: causal_lm",
            )
        )
    if m.task != "seq2seq" and d.format == "source_target":
        p.append(
            (
                "format",
                "source_target is the encoder-decoder format; set task: seq2seq, or (causal LM) format: instruction "
                "with prompt_column and response_column",
            )
        )
    gen = t.generation_max_new_tokens
    has_eval = has_eval_data(d)  # a mixture's sources too
    if gen is not None and gen < 0:
        p.append(("generation_max_new_tokens", f"must be >= 1, or null/0 (off); got {gen}"))
    elif gen and m.task == "classification":
        p.append(
            (
                "generation_max_new_tokens",
                "a classifier predicts a label and generates no text; drop generation_max_new_tokens (eval reports "
                "accuracy and f1), or use task causal_lm or seq2seq with text answers",
            )
        )
    elif gen and d.format == "text":
        p.append(
            (
                "generation_max_new_tokens",
                "raw text data (format text) has no prompt/answer split to generate and score; use instruction, "
                "chat (or source_target) data, or drop generation_max_new_tokens",
            )
        )
    elif gen and not has_eval:
        p.append(
            (
                "generation_max_new_tokens",
                "is set but there is no eval data; give eval_dataset, eval_split or eval_fraction > 0",
            )
        )
    if t.generation_num_examples is not None and t.generation_num_examples < 1:
        p.append(("generation_num_examples", f"must be >= 1 or null (all), got {t.generation_num_examples}"))
    if "generation_metrics" in given and not gen:
        p.append(("generation_metrics", "is set but generation eval is off; set generation_max_new_tokens (e.g. 32)"))
    elif gen and not t.generation_metrics:
        p.append(("generation_metrics", f"must name at least one metric, e.g. [{', '.join(GENERATION_METRICS)}]"))
    for name in t.metrics or []:
        if name in GENERATION_METRICS and m.task == "classification":
            p.append(
                (
                    "metrics",
                    f"{name!r} scores generated text and a classifier generates none; use accuracy or f1 "
                    "(or task causal_lm/seq2seq with generation_max_new_tokens)",
                )
            )
        elif name in GENERATION_METRICS:
            p.append(
                (
                    "metrics",
                    f"{name!r} scores generated text; remove it from metrics and set generation_max_new_tokens "
                    f"(generation_metrics defaults to {', '.join(GENERATION_METRICS)})",
                )
            )
    return p


def _hub_offline() -> bool:
    return any(
        os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE")
    )


def _check_metrics(problems: list, names: list[str], key: str = "metrics") -> None:
    """Offline, only the metrics shipped with finetune and local metric directories can load."""
    if not _hub_offline():
        return
    shipped = shipped_metrics()
    missing = [n for n in names if n not in shipped and not os.path.exists(n)]
    if missing:
        problems.append(
            (
                key,
                f"{', '.join(map(repr, missing))} not shipped with finetune and the Hub is offline (HF_HUB_OFFLINE); "
                f"use {', '.join(shipped)} or the path of a local evaluate metric",
            )
        )


# ---------------------------------------------------------------- dataset mixtures (`datasets:`)

# The data fields a source of a mixture may set for itself; the others (max_seq_length, packing, ...) hold for all.
SOURCE_FIELDS = (
    "dataset",
    "dataset_config",
    "train_split",
    "eval_dataset",
    "eval_split",
    "eval_fraction",
    "format",
    "text_column",
    "text_pair_column",
    "prompt_column",
    "prompt_template",
    "response_column",
    "messages_column",
    "label_column",
    "max_train_samples",
)
SOURCE_KEYS = (*SOURCE_FIELDS, "weight", "name")
# What each format tokenizes to: sources mix when their rows have the same schema for the task.
ROW_SCHEMA = {
    "text": "tokens",
    "instruction": "tokens",
    "chat": "tokens",
    "classification": "label",
    "source_target": "tokens",
}
SEQ2SEQ_FORMATS = ("instruction", "source_target")  # the formats with input -> target pairs


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
        coerced = {k: _coerce("data", k, v) for k, v in entry.items() if k in SOURCE_FIELDS}
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


def source_problems(d: DataArgs, task: str, *, check_filesystem: bool = True) -> list[tuple[str, str]]:
    """Problems with `datasets:`, each keyed datasets[i].field: unknown or mistyped fields, weights, names,
    formats that cannot mix, missing files."""
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
        ok = True
        for key, value in entry.items():
            if key in SOURCE_FIELDS:
                value, err = _coerce("data", key, value)
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
        if not entry.get("dataset"):
            p.append((f"{at}.dataset", "is required: a Hub dataset id or local data files"))
            continue
        if not ok:
            continue
        source = sources_of(dataclasses.replace(d, datasets=[entry]))[0]
        s = source.args
        if name is None or isinstance(name, str):
            first = names.setdefault(source.name, i)
            if first != i:
                p.append(
                    (
                        f"{at}.name",
                        f"{source.name!r} is also datasets[{first}]'s name (from the file name when not given); "
                        "set name: to tell them apart",
                    )
                )
        if s.format not in FORMATS:
            _choice(p, f"{at}.format", s.format, FORMATS)
        elif s.format != "auto":
            schema = ROW_SCHEMA[s.format]
            first = kinds.setdefault(schema, i)
            other = next((j for k, j in kinds.items() if k != schema), None)
            if other is not None and first == i:
                was = d.datasets[other].get("format") or d.format
                p.append(
                    (
                        f"{at}.format",
                        f"{s.format!r} rows cannot mix with datasets[{other}]'s {was!r} rows: the sources of a mixture "
                        "must tokenize to the same rows (causal_lm: text, instruction, chat; classification: "
                        "classification); set a format of one kind, or train them in separate runs",
                    )
                )
            elif task == "classification" and schema != "label":
                p.append(
                    (
                        f"{at}.format",
                        f"{s.format!r} is a causal-LM format; task classification needs format "
                        "classification: set it (or auto)",
                    )
                )
            elif task == "causal_lm" and schema == "label":
                p.append((f"{at}.format", "classification data needs task classification: set task: classification"))
            elif task == "seq2seq" and s.format not in SEQ2SEQ_FORMATS:
                p.append(
                    (
                        f"{at}.format",
                        f"{s.format!r} has no input -> target pairs for task seq2seq; use instruction or "
                        "source_target sources",
                    )
                )
            elif task != "seq2seq" and s.format == "source_target":
                p.append((f"{at}.format", "source_target is the encoder-decoder format; set task: seq2seq"))
        if not 0 <= s.eval_fraction < 1:
            p.append((f"{at}.eval_fraction", f"must be in [0, 1), got {s.eval_fraction}"))
        if s.max_train_samples is not None and s.max_train_samples < 1:
            p.append((f"{at}.max_train_samples", f"must be >= 1 or null (off), got {s.max_train_samples}"))
        if "{prompt}" not in s.prompt_template:
            p.append((f"{at}.prompt_template", "must contain the placeholder {prompt}"))
        if check_filesystem:
            _check_data_path(p, f"{at}.dataset", s.dataset)
            if s.eval_dataset:
                _check_data_path(p, f"{at}.eval_dataset", s.eval_dataset)
    return p


HUB_REPO_ID = r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*"


def hub_repo_id(train: TrainArgs) -> str:
    """hub_model_id, or output_dir's name (as transformers' Trainer does)."""
    return train.hub_model_id or Path(os.path.abspath(train.output_dir)).name


def _check_hub(problems: list, t: TrainArgs) -> None:
    """push_to_hub: a valid repository name, the Hub reachable by configuration, and a token; said before
    anything loads (not after hours of training). The token itself is only looked up, never kept."""
    import re

    if not t.push_to_hub:
        return
    if not re.fullmatch(HUB_REPO_ID, hub_repo_id(t)) or ".." in hub_repo_id(t):
        problems.append(
            (
                "hub_model_id",
                f"{hub_repo_id(t)!r} is not a Hub repository name; give namespace/name or name "
                "(letters, digits, '-', '_', '.')",
            )
        )
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        problems.append(
            (
                "push_to_hub",
                "the Hub is offline here (HF_HUB_OFFLINE is set); unset HF_HUB_OFFLINE on a machine "
                "with network, or set push_to_hub: false and upload final/ later (`hf upload`)",
            )
        )
        return
    from huggingface_hub import get_token

    if not get_token():
        problems.append(
            (
                "push_to_hub",
                "no Hugging Face token found; run `hf auth login` or set HF_TOKEN, or set push_to_hub: false",
            )
        )


def previous_run_in(output_dir: str) -> list[str]:
    """The markers of a previous run found in output_dir (empty if none)."""
    return [m for m in RUN_MARKERS if os.path.exists(os.path.join(output_dir, m))]


def validate(
    cfg: RunConfig, given: typing.Iterable[str] = (), *, check_filesystem: bool = True
) -> list[tuple[str, str]]:
    """Every problem with a typed config, as (key, message naming the fix)."""
    m, d, t = cfg.model, cfg.data, cfg.train
    p: list[tuple[str, str]] = []
    if not m.model:
        p.append(("model", "is required: set it to a Hub model id or a local model directory"))
    if not d.dataset and d.datasets is None:
        p.append(("dataset", "is required: set it to a Hub dataset id or local data files (or give datasets:)"))
    p += source_problems(d, m.task, check_filesystem=check_filesystem)
    _choice(p, "task", m.task, TASKS)
    _choice(p, "torch_dtype", m.torch_dtype, DTYPES)
    _choice(p, "mixed_precision", m.mixed_precision, MIXED_PRECISIONS)
    _choice(p, "save_dtype", m.save_dtype, DTYPES)
    _choice(p, "format", d.format, FORMATS)
    _choice(p, "lr_scheduler_type", t.lr_scheduler_type, SCHEDULERS)
    _choice(p, "cpu_allocator", t.cpu_allocator, CPU_ALLOCATORS)
    if m.task == "classification" and d.format not in ("auto", "classification"):
        p.append(
            (
                "format",
                f"{d.format!r} is a causal-LM format; task classification needs format classification: "
                "set format: classification (or auto), or task: causal_lm",
            )
        )
    if m.task == "causal_lm" and d.format == "classification":
        p.append(("format", "classification data needs task classification: set task: classification"))
    p += _task_problems(cfg, given)
    pe = cfg.peft
    _choice(p, "peft.method", pe.method, PEFT_METHODS)
    if pe.method != "none":
        if pe.r < 1:
            p.append(("peft.r", f"must be >= 1, got {pe.r}"))
        if not 0 <= pe.dropout < 1:
            p.append(("peft.dropout", f"must be in [0, 1), got {pe.dropout}"))
        if not pe.target_modules:
            p.append(("peft.target_modules", "must name at least one module, or [all-linear]"))
    elif pe.adapter or pe.merge or pe.load_in_4bit:
        p.append(("peft.method", "is none but adapter/merge/load_in_4bit is set; set peft.method: lora (or dora)"))
    if check_filesystem and pe.adapter and not os.path.isfile(os.path.join(pe.adapter, "adapter_config.json")):
        p.append(("peft.adapter", f"{pe.adapter!r} has no adapter_config.json; give a directory saved by PEFT"))
    if "{prompt}" not in d.prompt_template:
        p.append(("prompt_template", "must contain the placeholder {prompt}"))
    if d.packing and m.task != "causal_lm":
        p.append(("packing", "packing applies to causal LM only; set packing: false"))
    for key in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "max_seq_length",
        "logging_steps",
    ):
        section = {**dataclasses.asdict(d), **dataclasses.asdict(t)}
        if section[key] < 1:
            p.append((key, f"must be >= 1, got {section[key]}"))
    for key, value in (
        ("ddp_timeout", t.ddp_timeout),
        ("eval_steps", t.eval_steps),
        ("save_steps", t.save_steps),
        ("save_total_limit", t.save_total_limit),
        ("max_train_samples", d.max_train_samples),
        ("preprocessing_num_workers", d.preprocessing_num_workers),
    ):
        if value is not None and value < 1:
            p.append((key, f"must be >= 1 or null (off), got {value}"))
    if t.preemption_signal not in PREEMPTION_SIGNALS:
        p.append(("preemption_signal", f"must be one of {', '.join(PREEMPTION_SIGNALS)}, got {t.preemption_signal!r}"))
    if t.max_steps == 0 or t.max_steps < -1:
        p.append(("max_steps", f"must be >= 1, or -1 to use num_train_epochs; got {t.max_steps}"))
    if t.max_steps == -1 and t.num_train_epochs <= 0:
        p.append(("num_train_epochs", f"must be > 0 when max_steps is -1; got {t.num_train_epochs}"))
    if not t.learning_rate > 0:
        p.append(("learning_rate", f"must be > 0, got {t.learning_rate}"))
    for key in ("weight_decay", "max_grad_norm", "warmup_steps", "adam_epsilon", "dataloader_num_workers"):
        if (getattr(t, key) or 0) < 0:
            p.append((key, f"must be >= 0, got {getattr(t, key)}"))
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(t, key) < 1:
            p.append((key, f"must be in [0, 1), got {getattr(t, key)}"))
    if not 0 <= t.warmup_ratio < 1:
        p.append(("warmup_ratio", f"must be in [0, 1), got {t.warmup_ratio}"))
    if not 0 <= d.eval_fraction < 1:
        p.append(("eval_fraction", f"must be in [0, 1), got {d.eval_fraction}"))
    has_eval = has_eval_data(d)
    if t.eval_steps and not has_eval:
        p.append(("eval_steps", "is set but there is no eval data; give eval_dataset, eval_split or eval_fraction > 0"))
    if t.eval_on_start and not has_eval:
        p.append(
            ("eval_on_start", "is set but there is no eval data; give eval_dataset, eval_split or eval_fraction > 0")
        )
    from finetune.best import best_problems

    p += best_problems(cfg, has_eval)
    if not t.output_dir:
        p.append(("output_dir", "is required"))
    _check_hub(p, t)
    if not check_filesystem:
        return p
    if m.model and looks_local(m.model) and not os.path.isdir(os.path.expanduser(m.model)):
        p.append(
            ("model", f"directory {m.model!r} does not exist; give a model directory (with config.json) or a Hub id")
        )
    elif m.model and os.path.isdir(m.model) and not os.path.isfile(os.path.join(m.model, "config.json")):
        p.append(("model", f"{m.model!r} has no config.json; point at a directory saved with save_pretrained"))
    elif m.model and os.path.isdir(m.model):
        _check_model_config(p, m.model, d.max_seq_length, m.task)
    if (
        m.chat_template
        and len(m.chat_template) < 256
        and "{" not in m.chat_template
        and not os.path.isfile(m.chat_template)
    ):
        p.append(
            (
                "chat_template",
                f"{m.chat_template!r} is neither a Jinja template nor an existing file; "
                "give the template text or the path of a template file",
            )
        )
    if d.dataset and not d.datasets:
        _check_data_path(p, "dataset", d.dataset)
    if d.eval_dataset and not d.datasets:
        _check_data_path(p, "eval_dataset", d.eval_dataset)
    if t.metrics:
        _check_metrics(p, t.metrics)
    if t.generation_max_new_tokens and t.generation_metrics:
        _check_metrics(p, t.generation_metrics, "generation_metrics")
    resume = t.resume_from_checkpoint
    latest = os.path.join(t.output_dir, "checkpoints", "latest")
    auto_fresh = resume == "auto" and not os.path.exists(latest)  # auto: resume if there is a checkpoint
    if resume == "auto":
        resume = None if auto_fresh else "latest"
    if resume and resume != "latest" and not os.path.isdir(resume):
        p.append(
            ("resume_from_checkpoint", f"{resume!r} is not a directory; give 'latest' or a checkpoints/step_N path")
        )
    if resume == "latest" and not os.path.exists(latest):
        p.append(
            (
                "resume_from_checkpoint",
                f"'latest' but {t.output_dir}/checkpoints has no complete checkpoint; "
                "drop resume_from_checkpoint to start fresh",
            )
        )
    elif resume == "latest":
        try:
            named = os.path.join(t.output_dir, "checkpoints", Path(latest).read_text().strip())
        except (OSError, UnicodeDecodeError) as e:
            named, why = None, f"cannot read {latest} ({e})"
        else:
            why = f"{latest} names {named}, which is not a directory"
        if named is None or not os.path.isdir(named):
            p.append(
                (
                    "resume_from_checkpoint",
                    f"'latest' but {why}; give a checkpoints/step_N directory, or drop resume_from_checkpoint "
                    "to start fresh",
                )
            )
    if t.output_dir and os.path.isfile(t.output_dir):
        p.append(("output_dir", f"{t.output_dir!r} is a file; give a directory"))
    elif t.output_dir and not resume and not t.overwrite_output_dir:
        found = previous_run_in(t.output_dir)
        if auto_fresh:  # a run that died before its first checkpoint left nothing worth keeping but final/
            found = [m for m in found if m == "final"]
        if found:
            p.append(
                (
                    "output_dir",
                    f"{t.output_dir!r} holds a previous run ({', '.join(found)}); pick a new output_dir, "
                    "resume it with --resume_from_checkpoint latest, or replace it with --overwrite_output_dir",
                )
            )
    return p
