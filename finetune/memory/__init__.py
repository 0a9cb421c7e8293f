"""Memory planning: what a run needs per rank under each Accelerate config, before anything runs.

estimate.py   the model's shape from its config, and the per-rank peak of one config on some machines
recommend.py  the fastest shipped config that fits, and its micro batch (`finetune plan`, commands/plan.py)
"""

from finetune.memory.estimate import (
    GPU_HEADROOM,
    HOST_HEADROOM,
    PREFERENCE,
    Estimate,
    Machines,
    ModelShape,
    default_precision,
    estimate,
    plan,
    plan_config,
    run_estimate,
    shape_from_config,
    shipped_configs,
    train_peak_estimate,
)
from finetune.memory.recommend import Recommendation, recommend

__all__ = [
    "GPU_HEADROOM",
    "HOST_HEADROOM",
    "PREFERENCE",
    "Estimate",
    "Machines",
    "ModelShape",
    "Recommendation",
    "default_precision",
    "estimate",
    "plan",
    "plan_config",
    "recommend",
    "run_estimate",
    "shape_from_config",
    "shipped_configs",
    "train_peak_estimate",
]
