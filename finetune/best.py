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

Its config rules (metric_for_best_model, patience, ...) are in finetune.config.rules.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from finetune.config import ConfigError, RunConfig, TrainArgs
from finetune.config.preflight import STATE_FILE, checkpoints_dir
from finetune.config.rules import effective_metric, greater_is_better

logger = logging.getLogger("finetune")


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
        """Record one evaluation's value at state.step in the trainer state; the verdict. A NaN is never the best
        (transformers' Trainer starts from an infinite best): once best, nothing would have beaten it."""
        best = state.best_metric
        new_best = not math.isnan(value) and (best is None or self.better(value, best))
        if self.patience is not None:
            improved = best is None or (new_best and abs(value - best) > self.threshold)
            state.evals_without_improvement = 0 if improved else state.evals_without_improvement + 1
        if new_best:
            state.best_metric, state.best_step, state.best_checkpoint = value, state.step, None
        stop = self.patience is not None and state.evals_without_improvement >= self.patience
        return Verdict(new_best, stop)

    def value_of(self, metrics: dict[str, float]) -> float:
        if self.metric not in metrics:  # validated at start; a metric module may still not report the key
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


def best_checkpoint(output_dir: str, best_step: int, elsewhere: str | None) -> str:
    """The checkpoint of best_step: this run's, or `elsewhere` (the trainer state's best_checkpoint)."""
    return elsewhere or os.path.join(checkpoints_dir(output_dir), f"step_{best_step}")


def locate_best(saved: dict[str, Any], path: str, t: TrainArgs, elsewhere: bool) -> None:
    """The trainer state of the checkpoint at `path`, which a run continues: a run started from another run's
    checkpoint keeps tracking that run's best evaluation, whose checkpoint stays in that run's checkpoints/
    (best_checkpoint says where from then on). With load_best_model_at_end that checkpoint must be there: refused
    before anything loads otherwise, not after training."""
    step = saved.get("best_step")
    if step is None:
        return
    if elsewhere and not saved.get("best_checkpoint"):
        saved["best_checkpoint"] = os.path.join(
            os.path.dirname(os.path.abspath(os.path.normpath(path))), f"step_{step}"
        )
    where = best_checkpoint(t.output_dir, step, saved.get("best_checkpoint"))
    if t.load_best_model_at_end and not os.path.isfile(os.path.join(where, STATE_FILE)):
        why = (
            f"the best evaluation so far (step {step}, in {path}'s trainer state) has no complete checkpoint at "
            f"{where}, so final/ could not get its weights; resume from a checkpoint of the run that holds it, or set "
            "load_best_model_at_end false"
        )
        raise ConfigError([("load_best_model_at_end", why)])


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
        from finetune.parallel.base import copy_by_name, trainable_parameters

        resume = Resume(path, read_trainer_state(path), portable=True)
        if cfg.peft.method == "none":  # the whole model, as the checkpoint holds it
            args = dataclasses.replace(cfg.model, model=resume.model_dir(), gradient_checkpointing=False)
            net = model.build_model(args, tokenizer, label_names, cfg.data.max_seq_length)
        else:  # the run's base model and the adapter's trained weights by name
            args = dataclasses.replace(cfg.model, gradient_checkpointing=False)
            # The base as the adapter's carrier, never in 4 bits (QLoRA): bitsandbytes' weights cannot be cast.
            pe = dataclasses.replace(cfg.peft, load_in_4bit=False)
            net = model.build_model(args, tokenizer, label_names, cfg.data.max_seq_length, pe)
            copy_by_name(trainable_parameters(net), {n: s["param"] for n, s in resume.full_state().items()})
        with torch.no_grad():
            net.to(model.DTYPES[dtype]).save_pretrained(directory, safe_serialization=True)

    return write


def summary_line(rule: BestRule, state: Any) -> str:
    """The run summary's word on the weights final/ holds (load_best_model_at_end)."""
    return f"step {state.best_step}: {rule.metric} {state.best_metric:.4f} (final/ holds its weights)"


def card_section(rule: BestRule, state: Any, last_step: int) -> str:
    """The model card's word on which weights final/ holds (finetune.report adds it under Results)."""
    where = state.best_checkpoint or f"checkpoints/step_{state.best_step}"  # another run's, or this run's
    return (
        f"These are the weights of step {state.best_step} ({where}), the best "
        f"evaluation by `{rule.metric}` = {state.best_metric:.6g} "
        f"({'greater' if rule.greater_is_better else 'lower'} is better)"
        + (f", not those of the last step ({last_step})" if last_step != state.best_step else ", also the last step")
        + ": the run config set `load_best_model_at_end: true`. See metrics.jsonl for every evaluation."
    )
