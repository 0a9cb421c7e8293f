"""argv + YAML -> a validated RunConfig: the one parser that training, `finetune plan` and `finetune check` share."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from finetune.config import preflight, rules
from finetune.config.schema import (
    NESTED,
    SECTIONS,
    ConfigError,
    RunConfig,
    all_fields,
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


def build_config(values: dict[str, Any], *, check_filesystem: bool = True, ignore: tuple[str, ...] = ()) -> RunConfig:
    """Turn a flat {field: value} dict (YAML merged with overrides) into a validated RunConfig.

    Every problem (but those keyed `ignore`: what a subcommand does not use) is collected and raised together as
    one ConfigError.
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
    if check_filesystem:  # read once, here: the output_dir check (validate) and the start (cli) both need it
        cfg.finished = preflight.finished_run(cfg)
    problems += validate(cfg, check_filesystem=check_filesystem)
    problems = [(key, message) for key, message in problems if key not in ignore]
    if problems:
        raise ConfigError(problems)
    return cfg


def validate(cfg: RunConfig, *, check_filesystem: bool = True) -> list[tuple[str, str]]:
    """Every problem with a typed config, as (key, message naming the fix): the pure rules (rules.py) and, unless
    check_filesystem is off (`finetune plan` reads no data), what the values say about the disk (preflight.py)."""
    has_eval = has_eval_data(cfg.data)
    p = rules.required_problems(cfg)
    reads_raw = check_filesystem and not cfg.data.prepared_data
    p += source_problems(cfg.data, cfg.model.task, preflight.check_data_path if reads_raw else None)
    p += rules.choice_problems(cfg) + rules.format_problems(cfg) + rules.task_problems(cfg)
    p += rules.peft_problems(cfg.peft)
    if check_filesystem:
        p += preflight.adapter_problems(cfg.peft)
    p += rules.data_problems(cfg) + rules.number_problems(cfg) + rules.eval_problems(cfg.train, has_eval)
    p += rules.best_problems(cfg, has_eval)
    if not cfg.train.output_dir:
        p.append(("output_dir", "is required"))
    preflight.check_hub(p, cfg.train)
    if check_filesystem:
        p += preflight.filesystem_problems(cfg)
    return p


# ---------------------------------------------------------------- the command line (`finetune --help`)

DESCRIPTION = """\
Fine-tune a Hugging Face model. The run config (YAML, --config) says what to train; every field
can be overridden on the command line. The parallelism is chosen by the Accelerate config:

  finetune --config examples/sft.yaml                                      # one process
  finetune parity --config examples/sft.yaml --steps 10                    # same losses under every backend?
  finetune merge outputs/sft/final                                         # adapter + base -> one model
  finetune check --config examples/sft.yaml                                # preflight: launch it like the run
  finetune prepare --config examples/sft.yaml --prepared_data data/sft     # tokenize and pack once, ahead of a job
  finetune plan --config examples/sft.yaml --num_gpus 8 --gpu_memory 80GB  # memory per rank, which config fits
  finetune plot outputs/ddp outputs/zero3 -o parity.png                    # several runs' curves in one PNG
  accelerate launch --config_file accelerate_configs/ddp.yaml finetune --config examples/sft.yaml --max_steps 50
"""


EPILOG = """\
Data formats (format: auto picks the format and its shape from the columns and says which;
docs/data.md). One row of each shape, and what the loss learns from it:
  text            {"text": "The match ended 2-1."}  -> every token
  instruction     {"prompt": "Topic?", "response": "weather"}  -> the response
                  {"prompt": "Topic?", "completion": "weather"}  (TRL's standard prompt-completion)
                  {"instruction": "Topic?", "input": "rain", "output": "weather"}  (alpaca)
  chat            {"messages": [{"role": "user", "content": "Topic?"},
                                {"role": "assistant", "content": "weather"}], "tools": [...]}  -> assistant turns
                  {"conversations": [{"from": "human", "value": "Topic?"}, {"from": "gpt", "value": "weather"}]}
                  {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]}
                    (TRL's conversational prompt-completion)  -> the completion's assistant turns
                  other keys and role names: role_key, content_key, role_map
  classification  {"text": "rain all day", "label": "weather"}  -> the label
  source_target   {"source": "rain all day", "target": "weather"}  (task seq2seq)  -> the target
  preference      {"prompt": "Topic?", "chosen": "weather", "rejected": "sports"}; chosen/rejected as
                  message lists too  (method dpo, ipo, orpo, simpo; docs/preference.md)  -> the two compared
  streaming: true reads the training data as a stream, tokenized as training goes (docs/data.md)

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
            if dict in (item, base):  # a mapping (role_map), or a list of them (datasets): YAML text
                kw = {"metavar": "YAML"}
            if base is bool:
                kw = {"nargs": "?", "const": "true", "metavar": "BOOL"}
            name = f"{section}.{f.name}" if section in NESTED else f.name
            group.add_argument(f"--{name}", default=argparse.SUPPRESS, help=f"{f.metadata['help']} ({shown})", **kw)
    return parser


def parse(argv: list[str], ignore: tuple[str, ...] = ()):
    """argv -> RunConfig. Raises ConfigError listing every problem (file, unknown flags, values) but those keyed
    `ignore`."""
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
        cfg = build_config({**values, **overrides}, ignore=ignore)
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
