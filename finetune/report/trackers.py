"""Trackers (report_to) through accelerate: the whole effective run config, flattened, as the tracked config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from finetune.config import RunConfig, TrainArgs


def run_name(train: TrainArgs) -> str:
    return train.run_name or Path(os.path.abspath(train.output_dir)).name


def tracker_problems(report_to: list[str]) -> list[tuple[str, str]]:
    """A tracker asked for but not installed: said before training starts (accelerate would only warn)."""
    import accelerate.utils

    out = []
    for name in report_to:
        available = getattr(accelerate.utils, f"is_{name}_available", None)
        if available is not None and not available():
            package = {"tensorboard": "tensorboard", "comet_ml": "comet-ml"}.get(name, name)
            out.append(
                (
                    "report_to",
                    f"{name} is not installed here; install it (pip install {package}) or remove it from report_to",
                )
            )
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A run config as scalars only (what every tracker accepts): nested sections as `peft.r`, lists joined with
    commas, None as "null"."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(str(v) for v in value)
        elif value is None:
            out[name] = "null"
        else:
            out[name] = value
    return out


def tracked_config(cfg: RunConfig, facts: dict[str, Any]) -> dict[str, Any]:
    """The whole effective run config, flattened, plus how the run is spread (world size, backend, precision).
    The Hub token is never part of it: it is not a run-config field, and is read only by huggingface_hub."""
    return {**flatten(cfg.to_flat()), **{k: v for k, v in facts.items() if isinstance(v, (int, float, str, bool))}}


def init_trackers(accelerator, cfg: RunConfig, facts: dict[str, Any]) -> None:
    t = cfg.train
    name = run_name(t)
    accelerator.init_trackers(
        t.tracker_project,
        config=tracked_config(cfg, facts),
        init_kwargs={
            "wandb": {"name": name},
            "mlflow": {"run_name": name},
            "trackio": {"name": name},
            "comet_ml": {"experiment_name": name},
            "aim": {"experiment": name},
            "swanlab": {"experiment_name": name},
        },
    )
