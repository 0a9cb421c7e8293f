"""The best checkpoint and early stopping, with transformers' names and rules.

  metric_for_best_model    an eval metric (`loss` means eval_loss, as in transformers); default eval_loss
                           when load_best_model_at_end is on
  greater_is_better        default: false for loss and perplexity (eval_<source>_loss too), else true
  load_best_model_at_end   final/ holds the best checkpoint's weights; its README.md and the log say which step
  early_stopping_patience  stop after this many evaluations in a row without an improvement of more than
  early_stopping_threshold the best so far (EarlyStoppingCallback's rule)

Every evaluation during training (not the eval_on_start one: there is no checkpoint of step 0) is compared
with the best so far. A strictly better value is the new best (and with load_best_model_at_end it is
checkpointed at once, between save_steps too), whatever the threshold; only an improvement of more than
early_stopping_threshold resets the patience count. The eval metrics are gathered over every rank, so every
rank takes the same decision (the main process's value is broadcast all the same) and stops at the same step.

The best step, its value and the patience count live in the trainer state of every checkpoint (a resume keeps
tracking them); checkpoint pruning (save_total_limit) never removes the best checkpoint. At the end, the best
checkpoint's full weights (the same files a resume under another layout reads: checkpoint.Resume) are loaded in
one process and written to final/ like any export, under every backend that writes them (Megatron-LM's own
checkpoints do not: refused there at start).

No torch import at module level: config validation calls best_problems.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.config import DEFAULT_METRICS, RunConfig, TrainArgs, has_eval_data, shipped_metrics, sources_of

logger = logging.getLogger("finetune")
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


@dataclass(frozen=True)
class Verdict:
    new_best: bool  # this evaluation is the best so far
    stop: bool  # early stopping: no improvement for `patience` evaluations


@dataclass(frozen=True)
class BestRule:
    """Decides, at each evaluation, whether it is the new best and whether to stop (state: loop.TrainState)."""

    metric: str
    greater_is_better: bool
    patience: int | None
    threshold: float
    load_best: bool

    @classmethod
    def of(cls, t: TrainArgs) -> BestRule | None:
        metric = effective_metric(t)
        if metric is None:
            return None
        return cls(
            metric,
            greater_is_better(t, metric),
            t.early_stopping_patience,
            t.early_stopping_threshold,
            t.load_best_model_at_end,
        )

    def better(self, value: float, than: float) -> bool:
        return value > than if self.greater_is_better else value < than

    def update(self, state: Any, value: float) -> Verdict:
        """Record one evaluation's value at state.step in the trainer state; the verdict."""
        best = state.best_metric
        new_best = best is None or self.better(value, best)
        if self.patience is not None:
            improved = best is None or (new_best and abs(value - best) > self.threshold)
            state.evals_without_improvement = 0 if improved else state.evals_without_improvement + 1
        if new_best:
            state.best_metric, state.best_step = value, state.step
        stop = self.patience is not None and state.evals_without_improvement >= self.patience
        return Verdict(new_best, stop)

    def value_of(self, metrics: dict[str, float]) -> float:
        if self.metric not in metrics:  # validated at start; a metric module may still not report the key
            from finetune.config import ConfigError

            raise ConfigError(
                [
                    (
                        "metric_for_best_model",
                        f"{self.metric!r} is not among the eval metrics ({', '.join(metrics)}); set one of them",
                    )
                ]
            )
        return float(metrics[self.metric])

    def describe(self, state: Any) -> str:
        return f"step {state.best_step} ({self.metric} {state.best_metric:.6g})"


# ---------------------------------------------------------------- final/ from the best checkpoint


def best_checkpoint(output_dir: str, state: Any) -> str:
    from finetune.checkpoint import checkpoints_dir

    return os.path.join(checkpoints_dir(output_dir), f"step_{state.best_step}")


def weights_writer(
    cfg: RunConfig, tokenizer, label_names: list[str] | None, path: str, dtype: str
) -> Callable[[str], None]:
    """A function writing the checkpoint at `path` as a from_pretrained directory (or, for an adapter run, the
    adapter), run by one process: the checkpoint's full weights (checkpoint.Resume, the portable-resume path)
    loaded into the run's model class, then save_pretrained in dtype (final/'s, model.save_dtype)."""

    def write(directory: str) -> None:
        import torch

        from finetune import model
        from finetune.checkpoint import Resume, read_trainer_state
        from finetune.parallel.ddp import copy_by_name, trainable_parameters

        resume = Resume(path, read_trainer_state(path), portable=True)
        if cfg.peft.method == "none":  # the whole model, as the checkpoint holds it
            args = dataclasses.replace(cfg.model, model=resume.model_dir(), gradient_checkpointing=False)
            net = model.build_model(args, tokenizer, label_names, cfg.data.max_seq_length)
        else:  # the run's base model and the adapter's trained weights by name
            args = dataclasses.replace(cfg.model, gradient_checkpointing=False)
            net = model.build_model(args, tokenizer, label_names, cfg.data.max_seq_length, cfg.peft)
            copy_by_name(trainable_parameters(net), {n: s["param"] for n, s in resume.full_state().items()})
        with torch.no_grad():
            net.to(model.DTYPES[dtype]).save_pretrained(directory, safe_serialization=True)

    return write


def card_section(rule: BestRule, state: Any, last_step: int) -> str:
    """The model card's word on which weights final/ holds (finetune.report adds it under Results)."""
    return (
        f"These are the weights of step {state.best_step} (checkpoints/step_{state.best_step}), the best "
        f"evaluation by `{rule.metric}` = {state.best_metric:.6g} "
        f"({'greater' if rule.greater_is_better else 'lower'} is better)"
        + (f", not those of the last step ({last_step})" if last_step != state.best_step else ", also the last step")
        + ": the run config set `load_best_model_at_end: true`. See metrics.jsonl for every evaluation."
    )
