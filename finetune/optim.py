"""The optimizer and the learning-rate schedule (the same on every backend)."""

from __future__ import annotations

import math

import torch

from finetune.config import TrainArgs


def build_optimizer(net: torch.nn.Module, t: TrainArgs, mixed_precision: str) -> torch.optim.Optimizer:
    """AdamW (torch's fused kernel, as HF Trainer uses: ~8% faster steps on CPU too; not under fp16, below); no
    weight decay on biases and norm weights (every parameter with fewer than 2 dims); DTensors (a tp_plan's sharded
    layers) in groups of their own.

    Workaround (accelerate 1.x, huggingface/accelerate#4242): under fp16 the loss scaler hands a fused optimizer its
    overflow flag and always calls its step (the kernel skips the update), and accelerate takes a called step for a
    taken one: optimizer_step_was_skipped stays False, the schedule moves on, and the overflow's infinite gradient
    norm reads as divergence (the run stops at the next log row, as scalers overflow by design). Under fp16 the
    foreach kernel, whose skipped step accelerate sees. tests/test_precision.py::
    test_accelerate_still_misses_a_fused_optimizers_skipped_step fails once accelerate sees it."""
    from torch.distributed.tensor import DTensor

    params = [p for p in net.parameters() if p.requires_grad]
    # A group is all DTensors or all plain tensors: torch's fused and foreach kernels refuse a mix ("got mixed
    # torch.Tensor and DTensor" at the first step), and under a tp_plan only the plan's layers are DTensors (Qwen2's
    # sharded q/k/v biases beside plain norms; a MoE router's plain gate beside sharded experts). Without DTensors
    # the groups are the two they always were: checkpoints keep their layout.
    groups = [
        {
            "params": [p for p in params if (p.ndim >= 2) == decays and isinstance(p, DTensor) == sharded],
            "weight_decay": wd,
        }
        for decays, wd in ((True, t.weight_decay), (False, 0.0))
        for sharded in (True, False)
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        weight_decay=t.weight_decay,  # also the default Megatron-LM's optimizer takes (its groups are its own)
        fused=mixed_precision != "fp16",
    )


def build_scheduler(optimizer, kind: str, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers.get_scheduler's linear / cosine / constant / constant_with_warmup schedules, the same
    formulas (tests/test_train.py::test_schedules_equal_transformers checks every step). Written here
    because importing transformers.optimization imports transformers.trainer_utils and through it all
    of peft: about 1.7 s of every launch (bench/perf.py --only launch)."""

    def factor(step: int) -> float:
        if kind == "constant":
            return 1.0
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant_with_warmup":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return max(0.0, (total - step) / max(1, total - warmup))  # linear

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def set_scheduler_position(scheduler, position: int) -> None:
    """Put a schedule where it is after `position` scheduler steps (Plan.scheduler_position)."""
    inner = getattr(scheduler, "scheduler", scheduler)
    inner.last_epoch = position - 1
    inner._step_count = position
    inner.step()


def reschedule(scheduler, learning_rate: float, position: int) -> None:
    """A resume with a changed learning rate or schedule (max_steps, warmup, type): the restored schedule
    continues from `position` with the run config's peak learning rate and formula (the restored state holds
    the old peak; the formula is always the current config's). Megatron-LM's own scheduler, which has no
    LambdaLR state, takes the run's values when its backend loads the checkpoint (megatron.Backend.load_state)."""
    inner = getattr(scheduler, "scheduler", scheduler)
    if not hasattr(inner, "base_lrs"):
        return
    inner.base_lrs = [learning_rate for _ in inner.base_lrs]
    set_scheduler_position(scheduler, position)
