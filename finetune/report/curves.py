"""output_dir/curves.png from metrics.jsonl: redrawn at evals during training and at the end; `finetune plot`
overlays several runs (commands/plot.py)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import yaml

from finetune.checkpoint import CONFIG_FILE
from finetune.metrics import read_metrics

CURVES = "curves.png"


def read_rows(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """metrics.read_metrics, or no rows when there is no metrics.jsonl yet."""
    if not (Path(output_dir) / "metrics.jsonl").is_file():
        return []
    return read_metrics(output_dir)


def run_label(output_dir: str | os.PathLike) -> str:
    """A run's name on a plot: its run_name when it has one, else its directory's name."""
    path = Path(output_dir) / CONFIG_FILE
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        saved = {}
    return saved.get("run_name") or Path(os.path.abspath(output_dir)).name


def series(rows: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (steps, values): train rows (loss, learning_rate, tokens_per_s) and eval rows (eval_*)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key in ("loss", "learning_rate", "tokens_per_s") or key.startswith("eval_"):
                if isinstance(value, (int, float)) and math.isfinite(value):
                    steps, values = out.setdefault(key, ([], []))
                    steps.append(row["step"])
                    values.append(value)
    return out


PANELS = (
    ("loss", "loss (train, and eval dashed)"),
    ("metrics", "eval metrics"),
    ("learning_rate", "learning rate"),
    ("tokens_per_s", "tokens/s (all ranks)"),
)


def build_figure(runs: list[tuple[str, list[dict[str, Any]]]]):
    """One figure, four panels, every run overlaid in its own colour: train and eval loss, the other eval
    metrics, the learning rate, throughput. Built without pyplot (no display, no global state)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 7.5), dpi=100)  # laid out by hand: a layout engine doubles the drawing time
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.07, top=0.91, hspace=0.35, wspace=0.18)
    axes = dict(zip((p for p, _ in PANELS), fig.subplots(2, 2).flat))
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for (label, rows), color in zip(runs, colors):
        s = series(rows)
        if "loss" in s:
            axes["loss"].plot(*s["loss"], color=color, label=f"{label} train")
        if "eval_loss" in s:
            axes["loss"].plot(*s["eval_loss"], color=color, ls="--", marker="o", ms=4, label=f"{label} eval")
        metrics = sorted(k for k in s if k.startswith("eval_") and k != "eval_loss")
        for i, key in enumerate(metrics):
            axes["metrics"].plot(
                *s[key], color=color, ls=("-", "--", ":", "-.")[i % 4], marker="o", ms=4, label=f"{label} {key[5:]}"
            )
        for key in ("learning_rate", "tokens_per_s"):
            if key in s:
                axes[key].plot(*s[key], color=color, label=label)
    for name, title in PANELS:
        ax = axes[name]
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    if any("perplexity" in line.get_label() for line in axes["metrics"].lines):
        axes["metrics"].set_yscale("log")
    axes["learning_rate"].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    title = runs[0][0] if len(runs) == 1 else f"{len(runs)} runs"
    fig.suptitle(title)
    return fig


DRAWN_BY = "finetune"  # the PNG's Software text: tells a picture finetune drew (and may redraw) from a user's file


def save_figure(fig, path: str | os.PathLike) -> str:
    """PNG, written to a temporary file and renamed (a reader never sees half a picture)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, format="png", metadata={"Software": DRAWN_BY})
    os.replace(tmp, path)
    return str(path)


def drawn_by_finetune(path: str | os.PathLike) -> bool:
    """Whether the file at path is a picture finetune drew: a PNG saying so, or a run's own curves.png."""
    from PIL import Image

    if Path(path).name == CURVES and (Path(path).parent / "metrics.jsonl").is_file():
        return True
    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.info.get("Software") == DRAWN_BY
    except OSError:  # not there, unreadable, not a picture
        return False


_last_drawn: dict[str, float] = {}  # output_dir -> when its curves were last drawn
_started = time.monotonic()  # the process's start, near enough (this module is imported as a run starts)
# During training, curves.png is redrawn at an eval at most this often, counted from the start: a run shorter than
# this draws it once, at the end (each drawing costs about 1 s of CPU).
CURVES_EVERY_S = 30.0


def write_curves(output_dir: str, min_interval: float = 0.0, rows: list[dict[str, Any]] | None = None) -> str | None:
    """output_dir/curves.png from its metrics.jsonl (main process; rows: already read): at evals, if the last
    picture (or the start) is older than min_interval seconds, and at the end."""
    now = time.monotonic()
    if now - _last_drawn.get(output_dir, _started) < min_interval:
        return None
    rows = read_rows(output_dir) if rows is None else rows
    if not rows:
        return None
    _last_drawn[output_dir] = now
    return save_figure(build_figure([(run_label(output_dir), rows)]), os.path.join(output_dir, CURVES))
