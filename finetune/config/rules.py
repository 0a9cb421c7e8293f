"""The pure rules of a run config: every check that needs nothing but the config's values, composed by
`validate` (with the checks of disk and environment from preflight.py) into one list of problems."""

from __future__ import annotations

import os
import typing

from finetune.config.schema import DEFAULT_METRICS, GENERATION_METRICS, RunConfig, TrainArgs, shipped_metrics
from finetune.config.sources import has_eval_data, sources_of


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


def task_problems(cfg: RunConfig, given: typing.Iterable[str]) -> list[tuple[str, str]]:
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


# ---------------------------------------------------------------- the best checkpoint and early stopping (best.py)

LOSS_LIKE = ("loss", "perplexity")


def metric_key(name: str) -> str:
    """transformers' rule: a metric name without the eval_ prefix gets it."""
    return name if name.startswith("eval_") else f"eval_{name}"


def effective_metric(t: TrainArgs) -> str | None:
    if t.metric_for_best_model:
        return metric_key(t.metric_for_best_model)
    return "eval_loss" if t.load_best_model_at_end else None


def greater_is_better(t: TrainArgs, metric: str) -> bool:
    if t.greater_is_better is not None:
        return t.greater_is_better
    return not metric.endswith(LOSS_LIKE)


def computed_metrics(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(the eval keys this run reports, prefixes of the keys of metric modules whose keys only they know).
    Per source too (eval_<name>_...) for a mixture."""
    names = cfg.train.metrics if cfg.train.metrics is not None else DEFAULT_METRICS[cfg.model.task]
    shipped = set(shipped_metrics())
    keys = ["loss"] + (["perplexity"] if cfg.model.task != "classification" else [])
    keys += [n for n in names if n in shipped]  # accuracy, f1, exact_match report their own name
    prefixes = [os.path.basename(n.rstrip("/")) for n in names if n not in shipped]  # e.g. rouge -> rougeL
    scopes = [""]
    if cfg.data.datasets and all(isinstance(e, dict) for e in cfg.data.datasets):
        scopes += [f"{s.name}_" for s in sources_of(cfg.data)]
    keys = [f"eval_{s}{k}" for s in scopes for k in keys]
    prefixes = [f"eval_{s}{k}" for s in scopes for k in prefixes]
    if cfg.train.generation_max_new_tokens:  # scored on the whole eval set only: eval_exact_match, eval_rougeL, ...
        prefixes += [f"eval_{m}" for m in cfg.train.generation_metrics]
    return keys, prefixes


def best_problems(cfg: RunConfig, has_eval: bool | None = None) -> list[tuple[str, str]]:
    """What keeps the best-checkpoint and early-stopping settings from working, each with its fix."""
    t = cfg.train
    has_eval = has_eval_data(cfg.data) if has_eval is None else has_eval
    p: list[tuple[str, str]] = []
    metric = effective_metric(t)
    if t.metric_for_best_model is not None:
        keys, prefixes = computed_metrics(cfg)
        if not has_eval:
            p.append(
                (
                    "metric_for_best_model",
                    "is set but there is no eval data; give eval_dataset, eval_split or eval_fraction > 0",
                )
            )
        elif metric not in keys and not metric.startswith(tuple(prefixes)):
            p.append(
                (
                    "metric_for_best_model",
                    f"{t.metric_for_best_model!r} is never computed: this run's eval reports {', '.join(keys)}"
                    f"{' and the keys of ' + ', '.join(prefixes) if prefixes else ''}; set one of them",
                )
            )
    if t.load_best_model_at_end:
        if not has_eval:
            p.append(("load_best_model_at_end", "needs eval data: give eval_dataset, eval_split or eval_fraction > 0"))
        elif not t.eval_steps:
            p.append(("load_best_model_at_end", "needs evaluations during training: set eval_steps"))
        elif not t.save_steps:
            p.append(
                (
                    "load_best_model_at_end",
                    "needs checkpoints to load the best from: set save_steps (a multiple of eval_steps)",
                )
            )
        elif t.save_steps % t.eval_steps:
            up = -(-t.save_steps // t.eval_steps) * t.eval_steps
            p.append(
                (
                    "save_steps",
                    f"must be a multiple of eval_steps ({t.eval_steps}) with load_best_model_at_end (as in transformers: "
                    f"every regular checkpoint is an evaluated one), got {t.save_steps}; set save_steps: {up}",
                )
            )
    if t.early_stopping_patience is not None:
        if t.early_stopping_patience < 1:
            p.append(("early_stopping_patience", f"must be >= 1 or null (off), got {t.early_stopping_patience}"))
        elif metric is None:
            p.append(
                (
                    "early_stopping_patience",
                    "needs the metric that must keep improving: set metric_for_best_model (e.g. eval_loss)",
                )
            )
        elif not has_eval or not t.eval_steps:
            p.append(("early_stopping_patience", "needs evaluations during training: set eval_steps (and eval data)"))
    if t.early_stopping_threshold < 0:
        p.append(("early_stopping_threshold", f"must be >= 0, got {t.early_stopping_threshold}"))
    elif t.early_stopping_threshold and t.early_stopping_patience is None:
        p.append(("early_stopping_threshold", "has no effect without early_stopping_patience; set it, or drop this"))
    return p
