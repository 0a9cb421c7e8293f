"""The recommender behind `finetune plan`: the fastest shipped Accelerate config that fits, and the largest micro
batch that fits under it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from finetune.config import RunConfig
from finetune.memory.estimate import Estimate, Machines, ModelShape, one_process, plan_config, shipped_configs
from finetune.parallel import sharding


@dataclass
class Recommendation:
    config: str
    micro_batch: int
    gradient_accumulation_steps: int
    gradient_checkpointing: bool
    estimate: Estimate | None
    why: str


def recommend(
    shape: ModelShape,
    cfg: RunConfig,
    machines: Machines,
    global_batch: int | None = None,
    configs: list[Path] | None = None,
) -> Recommendation:
    """The fastest config that fits (PREFERENCE: least sharding, no offload) and the largest micro batch that fits
    for the target global batch (micro x accumulation x data parallel); gradient checkpointing only when nothing
    fits without it."""
    paths = configs or shipped_configs()
    t = cfg.train
    target = global_batch or t.per_device_train_batch_size * t.gradient_accumulation_steps * machines.processes
    smallest = None  # the last config's estimate at micro batch 1 with gradient checkpointing: what nothing beats
    for checkpointing in sorted({cfg.model.gradient_checkpointing, True}):
        run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, gradient_checkpointing=checkpointing))
        for path in paths:
            if one_process(path) and machines.processes > 1:  # plan for every device the job has
                continue
            first = plan_config(shape, run, path, machines, micro_batch=1)
            if first.topology is None:
                continue
            smallest = first
            dp = first.topology.dp
            if target % dp:
                continue
            per_rank = target // dp
            for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
                est = plan_config(shape, run, path, machines, micro, per_rank // micro)
                if est.fits:
                    faster = [
                        p.stem for p in paths[: paths.index(path)] if not one_process(p) or machines.processes == 1
                    ]
                    why = _why(est, machines, faster)
                    return Recommendation(path.stem, micro, per_rank // micro, checkpointing, est, why)
    return Recommendation(
        "",
        0,
        0,
        True,
        None,
        f"nothing fits on {machines.describe()}, even at micro batch 1 with gradient checkpointing and offload: "
        "use more or larger devices, a shorter max_seq_length, or LoRA (peft.method: lora)" + _eval_hint(smallest),
    )


def _eval_hint(est: Estimate | None) -> str:
    """Where evaluation's logits are what does not fit (its batch is the user's, not the recommender's to change)."""
    phases = est.by_phase() if est else {}
    if phases.get(sharding.EVAL, 0.0) <= max(phases.get(sharding.BACKWARD, 0.0), phases.get(sharding.STEP, 0.0)):
        return ""
    return (
        f"; evaluation is the largest part ({phases[sharding.EVAL]:.1f} GB of logits per rank): lower "
        "per_device_eval_batch_size (this model's evaluation holds an eval batch's whole logits)"
    )


def _why(est: Estimate, machines: Machines, faster: list[str]) -> str:
    where = (
        f"{est.device_gb:.1f} GB of {machines.gpu_memory_gb:g} GB per GPU"
        if machines.on_gpu
        else f"{est.host_gb:.2f} GB per process"
    )
    reason = f"it needs {where}"
    if faster:
        reason += f"; the faster {', '.join(faster)} {'does' if len(faster) == 1 else 'do'} not fit at this batch"
    if est.gradient_checkpointing:
        reason += "; only with gradient checkpointing (recomputes activations: ~30% more compute)"
    return reason
