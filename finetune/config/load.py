"""argv + YAML -> a validated RunConfig: the one parser that training, `finetune plan` and `finetune check` share."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from finetune.config.preflight import (
    check_data_path,
    check_hub,
    check_metrics,
    check_model_config,
    looks_local,
    previous_run_in,
)
from finetune.config.rules import best_problems, task_problems
from finetune.config.schema import (
    CPU_ALLOCATORS,
    DTYPES,
    FORMATS,
    MIXED_PRECISIONS,
    NESTED,
    PEFT_METHODS,
    PREEMPTION_SIGNALS,
    SCHEDULERS,
    SECTIONS,
    TASKS,
    ConfigError,
    RunConfig,
    all_fields,
    choice,
    coerce,
    field_type,
)
from finetune.config.sources import has_eval_data, source_problems


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
        coerced, err = coerce(section, key, value)
        if err:
            problems.append((key, err))
        else:
            sections[section][key.removeprefix(f"{section}.")] = coerced
    cfg = RunConfig(**{s: cls(**sections[s]) for s, cls in SECTIONS.items()})
    problems += validate(cfg, values.keys(), check_filesystem=check_filesystem)
    if problems:
        raise ConfigError(problems)
    return cfg


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
    p += source_problems(d, m.task, check_data_path if check_filesystem else None)
    choice(p, "task", m.task, TASKS)
    choice(p, "torch_dtype", m.torch_dtype, DTYPES)
    choice(p, "mixed_precision", m.mixed_precision, MIXED_PRECISIONS)
    choice(p, "save_dtype", m.save_dtype, DTYPES)
    choice(p, "format", d.format, FORMATS)
    choice(p, "lr_scheduler_type", t.lr_scheduler_type, SCHEDULERS)
    choice(p, "cpu_allocator", t.cpu_allocator, CPU_ALLOCATORS)
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
    p += task_problems(cfg, given)
    pe = cfg.peft
    choice(p, "peft.method", pe.method, PEFT_METHODS)
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
    p += best_problems(cfg, has_eval)
    if not t.output_dir:
        p.append(("output_dir", "is required"))
    check_hub(p, t)
    if not check_filesystem:
        return p
    if m.model and looks_local(m.model) and not os.path.isdir(os.path.expanduser(m.model)):
        p.append(
            ("model", f"directory {m.model!r} does not exist; give a model directory (with config.json) or a Hub id")
        )
    elif m.model and os.path.isdir(m.model) and not os.path.isfile(os.path.join(m.model, "config.json")):
        p.append(("model", f"{m.model!r} has no config.json; point at a directory saved with save_pretrained"))
    elif m.model and os.path.isdir(m.model):
        check_model_config(p, m.model, d.max_seq_length, m.task)
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
        check_data_path(p, "dataset", d.dataset)
    if d.eval_dataset and not d.datasets:
        check_data_path(p, "eval_dataset", d.eval_dataset)
    if t.metrics:
        check_metrics(p, t.metrics)
    if t.generation_max_new_tokens and t.generation_metrics:
        check_metrics(p, t.generation_metrics, "generation_metrics")
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


# ---------------------------------------------------------------- the command line (`finetune --help`)

DESCRIPTION = """\
Fine-tune a Hugging Face model. The run config (YAML, --config) says what to train; every field
can be overridden on the command line. The parallelism is chosen by the Accelerate config:

  finetune --config examples/sft.yaml                                      # one process
  finetune parity --config examples/sft.yaml --steps 10                    # same losses under every backend?
  finetune merge outputs/sft/final                                         # adapter + base -> one model
  finetune check --config examples/sft.yaml                                # preflight: launch it like the run
  finetune plan --config examples/sft.yaml --num_gpus 8 --gpu_memory 80GB  # memory per rank, which config fits
  finetune plot outputs/ddp outputs/zero3 -o parity.png                    # several runs' curves in one PNG
  accelerate launch --config_file accelerate_configs/ddp.yaml finetune --config examples/sft.yaml --max_steps 50
"""


EPILOG = """\
Outputs (under output_dir): metrics.jsonl (one JSON row per logged step and per eval), curves.png,
checkpoints/step_N (resumable; checkpoints/latest names the newest), final/ (a standard HF model
directory with tokenizer, the effective run config and a model card, README.md), logs/rank<N>.log
(every rank's log, with the third-party warnings kept off the screen), runs/ (TensorBoard, with
report_to: [tensorboard]). Exit code 2 means bad input."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune",
        description=DESCRIPTION,
        epilog=EPILOG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE.yaml", help="Run config (YAML mapping of the fields below).")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} ({cls.__doc__.strip()})")
        for f in dataclasses.fields(cls):
            base, optional, item = field_type(section, f.name)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = "required" if default == "" else f"default: {default!r}"
            kw: dict = {"metavar": (item or base).__name__.upper() + ("[,...]" if item else "")}
            if item is dict:  # a list of mappings (datasets): YAML text
                kw = {"metavar": "YAML"}
            if base is bool:
                kw = {"nargs": "?", "const": "true", "metavar": "BOOL"}
            name = f"{section}.{f.name}" if section in NESTED else f.name
            group.add_argument(f"--{name}", default=argparse.SUPPRESS, help=f"{f.metadata['help']} ({shown})", **kw)
    return parser


def parse(argv: list[str]):
    """argv -> RunConfig. Raises ConfigError listing every problem (file, unknown flags, values)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    problems = unknown_option_problems(unknown)
    values = {}
    if args.config:
        values = load_yaml(args.config)
    elif not problems:
        problems.append(("--config", "missing: pass a run-config YAML (see examples/), or give --model and --dataset"))
        if "model" in vars(args) and ("dataset" in vars(args) or "datasets" in vars(args)):
            problems.pop()
    overrides = {k: parse_cli_value(k, v) for k, v in vars(args).items() if k != "config"}
    if not args.config and not overrides:  # nothing given at all: the one thing to say is how to start
        raise ConfigError(problems)
    try:
        cfg = build_config({**values, **overrides})
    except ConfigError as e:
        raise ConfigError(problems + e.problems) from None
    if problems:
        raise ConfigError(problems)
    return cfg


def unknown_option_problems(unknown: list[str], extra_flags: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """What argparse left over: unknown options (with the closest known one) and stray arguments."""
    problems: list[tuple[str, str]] = []
    flags = [f"--{name}" for name in all_fields()] + list(extra_flags)
    for i, token in enumerate(unknown):
        if token.startswith("-"):
            close = difflib.get_close_matches(token.split("=")[0], flags, n=1, cutoff=0.6)
            problems.append(
                (token, "unknown option" + (f"; did you mean {close[0]}?" if close else "; see finetune --help"))
            )
        elif not (i and unknown[i - 1].startswith("-")):  # not the value of an unknown option
            problems.append((token, "unexpected argument; options take the form --field value"))
    return problems
