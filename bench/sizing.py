"""Sizing Llamas for capacity benchmarks: a Llama-shaped config of a given width and depth, and the deepest one that
fits a memory budget under an Accelerate config (finetune.memory's estimate, bisected over the layers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from finetune import demo
from finetune.config import RunConfig
from finetune.memory.estimate import Estimate, Machines, ModelShape, plan_config, shape_from_config


def llama_config(hidden: int, layers: int, vocab: int = 32000, head_dim: int = 64):
    """The planner's Llama of a width and depth (finetune.demo.llama_config): one head per 64 dims, 32k vocabulary."""
    return demo.llama_config(hidden, layers, heads=max(1, hidden // head_dim), vocab=vocab, max_positions=131072)


def with_layers(one: ModelShape, two: ModelShape, layers: int) -> ModelShape:
    """The shape of the same model with `layers` decoder layers, from its 1- and 2-layer shapes (everything but the
    root grows by one layer's worth per layer): no need to build a deep model to size it."""
    from collections import Counter

    per_layer = Counter(two.tensor_sizes) - Counter(one.tensor_sizes)
    root = Counter(one.tensor_sizes) - per_layer
    sizes = sorted(root.elements()) + sorted(n for n in per_layer.elements() for _ in range(layers))
    grow = layers - 1
    return dataclasses.replace(
        one,
        total=one.total + grow * one.layer_params,
        trainable=one.trainable + grow * (two.trainable - one.trainable),
        layers=layers,
        tp_splittable=one.tp_splittable + grow * (two.tp_splittable - one.tp_splittable),
        tensor_sizes=tuple(sorted(sizes)),
    )


def largest_llama(
    hidden: int,
    budget_gb: float,
    cfg: RunConfig,
    accelerate_config: Path,
    machines: Machines,
    vocab: int = 32000,
    max_layers: int = 1024,
) -> tuple[int, ModelShape, Estimate] | None:
    """The most layers a Llama of this width can have and still train within `budget_gb` per rank (device memory on
    GPUs, resident memory on CPUs) under this Accelerate config; None when even one layer does not fit. For
    capacity benchmarks: the peak memory grows with the layers, so a bisection finds the boundary."""

    one, two = (shape_from_config(cfg, config=llama_config(hidden, n, vocab)) for n in (1, 2))

    def trial(layers: int) -> tuple[ModelShape, Estimate]:
        shape = with_layers(one, two, layers)
        return shape, plan_config(shape, cfg, accelerate_config, machines)

    def within(est: Estimate) -> bool:
        return est.topology is not None and (est.device_gb if machines.on_gpu else est.host_gb) <= budget_gb

    lo, hi = 0, max_layers + 1  # within(lo) holds (0: nothing yet), within(hi) does not
    best = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        shape, est = trial(mid)
        if within(est):
            lo, best = mid, (mid, shape, est)
        else:
            hi = mid
    return best
