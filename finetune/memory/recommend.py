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
    path: Path | None = None  # the recommended Accelerate config file


def recommend(
    shape: ModelShape,
    cfg: RunConfig,
    machines: Machines,
    global_batch: int | None = None,
    configs: list[Path] | None = None,
) -> Recommendation:
    """The fastest config that fits (PREFERENCE: least sharding, no offload) and the largest micro batch that fits
    for the target global batch (micro x accumulation x data parallel); gradient checkpointing only when nothing
    fits without it. A config is tried only where it can run this job: the shipped one-process config is left out
    on several devices (named with --configs it is planned), a layout must split the global batch over its
    data-parallel ranks, and one the run would refuse is never recommended. Each config left out keeps its reason
    (`Recommendation.why`), and only those tried are said not to fit."""
    paths = configs or shipped_configs()
    t = cfg.train
    target = global_batch or t.per_device_train_batch_size * t.gradient_accumulation_steps * machines.processes
    smallest = None  # the last config's estimate at micro batch 1 with gradient checkpointing: what nothing beats
    skipped: dict[str, str] = {}  # config -> why it is not recommended
    for checkpointing in sorted({cfg.model.gradient_checkpointing, True}):
        run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, gradient_checkpointing=checkpointing))
        for path in paths:
            name = path.stem
            if configs is None and one_process(path) and machines.processes > 1:  # plan for every device the job has
                skipped[name] = f"runs one process of the {machines.processes}"
                continue
            first = plan_config(shape, run, path, machines, micro_batch=1)
            if first.topology is None or first.refused:
                skipped[name] = _refusal(first) if first.refused else first.note
                continue
            smallest = first
            dp = first.topology.dp
            if target % dp:
                skipped[name] = f"the global batch {target} does not split over its {dp} data-parallel ranks"
                continue
            per_rank = target // dp
            skipped[name] = "does not fit at this batch"
            for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
                est = plan_config(shape, run, path, machines, micro, per_rank // micro)
                if est.refused:
                    skipped[name] = f"{_refusal(est)} (at micro batch {micro} x accumulation {per_rank // micro})"
                elif est.fits:
                    faster = {p.stem: skipped[p.stem] for p in paths[: paths.index(path)] if p.stem in skipped}
                    why = _why(est, machines, faster)
                    return Recommendation(name, micro, per_rank // micro, checkpointing, est, why, path)
    return Recommendation("", 0, 0, True, None, _why_none(skipped, cfg, machines, smallest))


def _why_none(skipped: dict[str, str], cfg: RunConfig, machines: Machines, smallest: Estimate | None) -> str:
    """Why no config is recommended: those tried do not fit, the others are left out for their reasons."""
    tried = [n for n, why in skipped.items() if why == "does not fit at this batch"]
    left_out = _reasons({n: why for n, why in skipped.items() if n not in tried})
    if not tried:
        return f"no config given can run this job on {machines.describe()}: {left_out}"
    return (
        f"nothing fits on {machines.describe()}: {', '.join(tried)} "
        f"{'does' if len(tried) == 1 else 'do'} not fit even at micro batch 1 with gradient checkpointing"
        f"{'; ' + left_out if left_out else ''}: use more or larger devices, a shorter max_seq_length"
        + (", or LoRA (peft.method: lora)" if cfg.peft.method == "none" else "")
        + _eval_hint(smallest)
    )


def _refusal(est: Estimate) -> str:
    """What the run would say about this layout, in short: the keys it names."""
    return f"the run refuses it ({', '.join(dict.fromkeys(k for k, _ in est.refused))}: see its row)"


def _reasons(skipped: dict[str, str]) -> str:
    """'zero1, zero2 do not fit at this batch; tp2 the run refuses it (peft.method: ...)': configs grouped by why."""
    groups: dict[str, list[str]] = {}
    for name, why in skipped.items():
        groups.setdefault(why, []).append(name)
    out = []
    for why, names in groups.items():
        if why == "does not fit at this batch":
            out.append(f"{', '.join(names)} {'does' if len(names) == 1 else 'do'} not fit at this batch")
        else:
            out.append(f"{', '.join(names)}: {why}")
    return "; ".join(out)


def _eval_hint(est: Estimate | None) -> str:
    """Where evaluation's logits are what does not fit (its batch is the user's, not the recommender's to change)."""
    phases = est.by_phase() if est else {}
    if phases.get(sharding.EVAL, 0.0) <= max(phases.get(sharding.BACKWARD, 0.0), phases.get(sharding.STEP, 0.0)):
        return ""
    return (
        f"; evaluation is the largest part ({phases[sharding.EVAL]:.1f} GB of logits per rank): lower "
        "per_device_eval_batch_size (this model's evaluation holds an eval batch's whole logits)"
    )


def _why(est: Estimate, machines: Machines, faster: dict[str, str]) -> str:
    """Why this config: what it needs, what it leaves unused, and why each config ahead of it in the order was not
    chosen (only those tried are said not to fit)."""
    where = (
        f"{est.device_gb:.1f} GB of {machines.gpu_memory_gb:g} GB per GPU"
        if machines.on_gpu
        else f"{est.host_gb:.2f} GB per process"
    )
    reason = f"it needs {where}"
    n = est.topology.num_processes
    if n < machines.processes:
        reason += f"; it uses {n} of the {machines.processes} {'GPUs' if machines.on_gpu else 'processes'}"
    if faster:
        reason += f"; ahead of it, {_reasons(faster)}"
    if est.gradient_checkpointing:
        reason += "; only with gradient checkpointing (recomputes activations: ~30% more compute)"
    return reason
