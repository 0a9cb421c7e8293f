"""Step arithmetic: every count of steps, micro batches and processes, in one place.

`step` always means an optimizer step; `micro` one micro batch. Nothing outside this module multiplies
by the number of processes or the data-parallel size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.config import ConfigError, TrainArgs
from finetune.parallel.topology import Topology


@dataclass(frozen=True)
class Plan:
    """How a run's optimizer steps are made of micro batches, and how many there are."""

    micro_batch_size: int  # rows one rank holds in one micro batch (what its prepared loader yields)
    loader_batch_size: int  # the batch size of the loader built before prepare (per_device_train_batch_size)
    gradient_accumulation_steps: int  # micro batches per optimizer step on each rank
    data_parallel_size: int  # ranks that hold different batches
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    num_processes: int  # accelerate steps a prepared scheduler once per process per optimizer step
    streamed: bool = False  # the data is a stream of unknown length: the run is one "epoch" of max_steps
    rows_left_out: int = 0  # rows of each epoch's order past its last whole global batch (not trained that epoch)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size

    @property
    def scheduler_steps(self) -> tuple[int, int]:
        """(warmup, total) to build the LR scheduler with (AcceleratedScheduler, split_batches=False)."""
        return self.warmup_steps * self.num_processes, self.total_steps * self.num_processes

    def scheduler_position(self, step: int) -> int:
        """How many times the prepared scheduler has been stepped after `step` optimizer steps."""
        return step * self.num_processes

    def describe(self) -> str:
        """The start log's line on batches and steps."""
        left = (
            f"; {self.rows_left_out} rows left out each epoch: the last partial global batch"
            if self.rows_left_out
            else ""
        )
        return (
            f"micro {self.micro_batch_size} x gradient accumulation {self.gradient_accumulation_steps} x data parallel "
            f"{self.data_parallel_size} = global batch {self.global_batch_size}; {self.total_steps} steps "
            f"({self.steps_per_epoch} per epoch{left}), warmup {self.warmup_steps}"
        )

    def loss_weight(self, global_count):
        """Factor turning a micro batch's summed loss into its share of the global-batch mean.

        accelerate divides each micro batch's loss by the accumulation steps and the gradient
        reduction averages over processes, so both are multiplied back in; `global_count` is the
        supervised count summed over every process (tensor-parallel replicas count their shared
        batch once each, which the average over all processes cancels).
        """
        return self.num_processes * self.gradient_accumulation_steps / global_count


def make_plan(train: TrainArgs, n_train_rows: int | None, topology: Topology) -> Plan:
    """How many optimizer steps, from the data size, the batch layout and max_steps/epochs.

    An epoch is the largest whole number of global batches in the data; the rest of an epoch's
    shuffle (rows_left_out, fewer than a global batch: said in the start log) is not used that epoch, so every
    layout of the same global batch sees the same examples.
    Streamed data (n_train_rows None) has no size: the run is one epoch of max_steps (config rules).
    Under Megatron-LM a rank's "micro batch" (what its loader yields per optimizer step) is the
    pipeline's micro batch x num_micro_batches (Topology.rows_per_micro_batch).
    """
    micro = topology.rows_per_micro_batch(train.per_device_train_batch_size)
    ga, dp = train.gradient_accumulation_steps, topology.dp
    steps_per_epoch = train.max_steps if n_train_rows is None else (n_train_rows // micro) // (dp * ga)
    if steps_per_epoch == 0:
        raise ConfigError(
            [
                (
                    "per_device_train_batch_size",
                    f"one global batch needs {micro * ga * dp} rows (micro {micro} x accumulation {ga} x "
                    f"{dp} data-parallel ranks) but the training data has {n_train_rows}; use smaller batches "
                    "or more data",
                )
            ]
        )
    if train.max_steps > 0:
        total = train.max_steps
    else:
        total = max(1, math.ceil(train.num_train_epochs * steps_per_epoch))
    warmup = train.warmup_steps if train.warmup_steps > 0 else math.ceil(train.warmup_ratio * total)
    return Plan(
        micro,
        train.per_device_train_batch_size,
        ga,
        dp,
        steps_per_epoch,
        total,
        warmup,
        topology.num_processes,
        streamed=n_train_rows is None,
        rows_left_out=0 if n_train_rows is None else n_train_rows - steps_per_epoch * micro * ga * dp,
    )


def global_batch_index(plan: Plan, step_in_epoch: int, micro: int, dp_rank: int) -> int:
    """Position, in the epoch's batch order, of the micro batch a data-parallel rank is holding.

    accelerate's BatchSamplerShard deals batches round-robin: rank r's j-th batch is batch
    j * data_parallel_size + r. So 2 ranks x GA 1 and 1 rank x GA 2 hold the same batches at the same step.
    """
    j = step_in_epoch * plan.gradient_accumulation_steps + micro
    return j * plan.data_parallel_size + dp_rank
