"""The end of a run: curves, model card, Hub push, and the summary block in the log."""

from __future__ import annotations

import dataclasses
import logging
import os

from finetune.config import AUTO_CLASSES, RunConfig
from finetune.report.card import write_card
from finetune.report.curves import read_rows, write_curves
from finetune.report.hub import push
from finetune.report.outcome import RunFacts, allocator_note, memory_text, outcome

logger = logging.getLogger("finetune")


def finish(accelerator, cfg: RunConfig, final_dir: str, facts: RunFacts) -> None:
    """Main process, after export and the memory report: curves, model card, Hub, and the summary block."""
    if not accelerator.is_main_process:
        return
    out = cfg.train.output_dir
    rows = read_rows(out)
    curves = write_curves(out, rows=rows) if cfg.train.curves else None
    card = write_card(final_dir, cfg, rows, dataclasses.replace(facts, final_dir=os.path.abspath(final_dir)))
    url = push(cfg, final_dir) if cfg.train.push_to_hub else None
    for line in summary(cfg, rows, facts, final_dir, card, curves, url):
        logger.info(line)


def summary(cfg: RunConfig, rows, facts: RunFacts, final_dir: str, card: str, curves, url) -> list[str]:
    res = outcome(rows)
    peft_on = cfg.peft.method != "none"
    how = "PeftModel/AutoPeft*.from_pretrained" if peft_on else f"{AUTO_CLASSES[cfg.model.task]}.from_pretrained"
    lines = ["-" * 24 + " run summary " + "-" * 24]
    lines.append(f"model        {os.path.abspath(final_dir)} (load with {how})")
    if peft_on and cfg.peft.merge:
        lines.append(f"merged       {os.path.abspath(os.path.join(final_dir, 'merged'))}")
    lines.append(f"model card   {os.path.abspath(card)}")
    if curves:
        lines.append(f"curves       {os.path.abspath(curves)}")
    elif not cfg.train.curves:
        out = os.path.abspath(cfg.train.output_dir)
        lines.append(f"curves       not drawn (curves: false); `finetune plot {out}` draws them")
    if res["final_eval"]:
        took = f"  ({res['final_eval_s']:.1f} s)" if res["final_eval_s"] is not None else ""
        label = "last eval    " if facts.best_line else "final eval   "  # final/ is the best's with load_best
        lines.append(label + "  ".join(f"{k} {v:.4f}" for k, v in res["final_eval"].items()) + took)
    if facts.best_line:
        lines.append(f"best eval    {facts.best_line}")
    speed = f"{res['tokens_per_s']:.0f} tokens/s" if res["tokens_per_s"] else "tokens/s ?"
    mfu = f", MFU {100 * res['mfu']:.1f}%" if res["mfu"] is not None else ""
    wait = f", {100 * res['data_wait_fraction']:.1f}% of it waiting for data" if res["data_wait_fraction"] else ""
    lines.append(
        f"training     {res['steps']} steps, {res['tokens_seen']:,} tokens, wall time {facts.wall_time_s:.1f} s "
        f"(steps {res['train_seconds']:.1f} s{wait}), {speed}{mfu}"
    )
    precision = f"precision    compute {res['compute_dtype'] or '?'}, final/ saved in {facts.save_dtype or '?'}"
    if res["skipped_steps"]:
        precision += f"; {res['skipped_steps']} step(s) skipped by the fp16 loss scaler (overflow)"
    lines.append(precision)
    if res["peak_memory"]:
        lines.append(f"peak memory  {memory_text(res['peak_memory'])}")
    if res["estimates"]:
        lines.append(
            "planner      "
            + ", ".join(
                f"{k.removeprefix('estimate_').removesuffix('_gb')} {v:.2f} GB" for k, v in res["estimates"].items()
            )
            + " per rank (finetune plan)"
            + allocator_note(cfg, res["peak_memory"])
        )
    lines.append(f"logs         {os.path.abspath(os.path.join(cfg.train.output_dir, 'logs'))} (every rank)")
    if cfg.train.report_to:
        lines.append(
            f"trackers     {', '.join(cfg.train.report_to)}"
            + (
                f" (tensorboard --logdir {os.path.abspath(os.path.join(cfg.train.output_dir, 'runs'))})"
                if "tensorboard" in cfg.train.report_to or "all" in cfg.train.report_to
                else ""
            )
        )
    if url:
        lines.append(f"hub          {url}")
    return lines
