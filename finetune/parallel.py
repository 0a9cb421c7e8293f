"""The one place that knows backends and layouts differ.

Everything else (the loop, the builders) is written once for all Accelerate configs. What is
here, and why:

- `prepare_environment`: the same Accelerate config file must run on a GPU node (nccl) and on a
  CPU-only machine (gloo). accelerate's MULTI_CPU launcher needs MPI, so our configs use the
  torchrun launcher (`distributed_type: MULTI_GPU`); on a machine without a GPU each rank is then
  told to come up on the CPU.
- `make_accelerator`: gradient accumulation owned by accelerate with an exact boundary every
  `gradient_accumulation_steps` micro batches (never "whenever the data loader ends"), gloo when
  there is no CUDA (DeepSpeed otherwise believes every rank is alone), DDP options.
- `Plan`: all step arithmetic (steps per epoch, total steps, warmup, scheduler length) in one
  function, so nothing multiplies by `num_processes` anywhere else.
- `global_batch_index`: which micro batch of the global order a rank is holding, so dropout can
  be seeded by data position and not by rank layout.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.config import ConfigError, TrainArgs

logger = logging.getLogger("finetune")


def has_accelerator_device() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def is_distributed_launch() -> bool:
    """Started by a launcher that runs several processes (torchrun, deepspeed, MPI)."""
    world = next((os.environ[k] for k in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE") if k in os.environ), "1")
    return int(world) > 1 or int(os.environ.get("LOCAL_RANK", -1)) != -1


def prepare_environment(train: TrainArgs) -> None:
    """Environment a rank needs before accelerate reads it. Idempotent; call before Accelerator()."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        check_deepspeed_config(train)
        # accelerate fills the JSON's "gradient_clipping": "auto" from this (else it would use 1.0).
        os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(train.max_grad_norm)
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_project_cache() / "torch_extensions"))
        announce_op_builds()
    # DeepSpeed runs on the CPU through its own init path (with gloo, below); forcing accelerate's
    # CPU mode would silently turn a DeepSpeed config into plain MULTI_CPU.
    if not has_accelerator_device() and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _project_cache() -> Path:
    """`.cache/` of the source checkout finetune runs from, else ~/.cache/finetune."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").exists() and os.access(checkout, os.W_OK):
        return checkout / ".cache"
    return Path.home() / ".cache" / "finetune"


# DeepSpeed JSON keys that must agree with the run config (accelerate fills them when "auto").
def _ds_expected(train: TrainArgs) -> dict[str, float]:
    return {
        "train_micro_batch_size_per_gpu": train.per_device_train_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "gradient_clipping": train.max_grad_norm,
    }


def fill_deepspeed_micro_batch(accelerator, micro_batch_size: int) -> None:
    """accelerate fills DeepSpeed's "auto" train_micro_batch_size_per_gpu from the loaders' batch_size,
    and refuses a loader without one: length_aware_batching's micro batches vary in rows. Fill it
    with the run's micro batch (what DeepSpeed's batch arithmetic and logging use)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu"):
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size


def check_deepspeed_config(train: TrainArgs) -> None:
    """Refuse a DeepSpeed JSON whose batch/accumulation/clipping contradict the run config, and one that
    defines its own optimizer or scheduler (finetune's AdamW and schedule are the run config's)."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path:
        return
    try:
        with open(path) as f:
            ds = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            [
                (
                    "deepspeed_config_file",
                    f"cannot read {path}: {e}; fix the JSON, or point the "
                    "Accelerate config's deepspeed_config_file at a valid file",
                )
            ]
        ) from None
    problems = []
    for key, ours in _ds_expected(train).items():
        value = ds.get(key, "auto")
        if value != "auto" and float(value) != float(ours):
            field = {
                "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
                "gradient_clipping": "max_grad_norm",
            }.get(key, key)
            problems.append(
                (
                    field,
                    f"the DeepSpeed config {path} sets {key}={value} but the run config has "
                    f'{field}={ours}; set it to "auto" in the JSON (finetune fills it)',
                )
            )
    for key in ("optimizer", "scheduler"):
        if key in ds:
            problems.append(
                (
                    key,
                    f"the DeepSpeed config {path} defines its own {key}; remove it: the run config's "
                    "AdamW and lr_scheduler_type are used on every backend",
                )
            )
    if problems:
        raise ConfigError(problems)


def announce_op_builds() -> None:
    """DeepSpeed compiles C++ ops on first use (a minute or so, silently). Say so, once, on rank 0."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    cache = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    needed = [] if has_accelerator_device() else ["deepspeed_shm_comm"]
    try:
        with open(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")) as f:
            if "offload_optimizer" in json.dumps(json.load(f).get("zero_optimization", {})):
                needed.append("cpu_adam")
    except (OSError, json.JSONDecodeError):
        pass
    missing = [op for op in needed if not any(cache.glob(f"**/{op}*.so"))]
    if missing:
        print(
            f"[finetune] DeepSpeed compiles {', '.join(missing)} on first use (about a minute each); "
            f"cached in {cache} for later runs",
            flush=True,
        )


def make_accelerator(train: TrainArgs, megatron_lm_plugin=None, parallelism_config=None):
    """The Accelerator for a run. The parallelism itself comes from `accelerate launch`'s config."""
    from accelerate import DistributedDataParallelKwargs
    from accelerate.utils import InitProcessGroupKwargs

    # Gradients as views of DDP's communication buckets: one copy of the gradients instead of two.
    handlers = [
        DistributedDataParallelKwargs(
            find_unused_parameters=train.ddp_find_unused_parameters, gradient_as_bucket_view=True
        )
    ]
    if is_distributed_launch():
        gpu = has_accelerator_device()
        timeout = datetime.timedelta(seconds=train.ddp_timeout or (1800 if gpu else 600))
        # gloo when there is no GPU: DeepSpeed would otherwise pick nccl and every rank believe it is alone.
        handlers.append(InitProcessGroupKwargs(timeout=timeout, **({} if gpu else {"backend": "gloo"})))
    try:
        return _accelerator(train, handlers, megatron_lm_plugin, parallelism_config)
    except ValueError as e:
        if "logging capability" in str(e) or "report_to" in str(e):  # an unknown tracker name
            raise ConfigError(
                [
                    (
                        "report_to",
                        f"{str(e).splitlines()[0]}; set report_to to some of those names, or [] for metrics.jsonl only",
                    )
                ]
            ) from None
        raise


def _accelerator(train: TrainArgs, handlers: list, megatron_lm_plugin, parallelism_config):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import GradientAccumulationPlugin

    return Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=train.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        # Our sampler is already identical on every rank; accelerate only shards its batches.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=False, even_batches=True),
        kwargs_handlers=handlers,
        log_with=train.report_to or None,
        megatron_lm_plugin=megatron_lm_plugin,
        parallelism_config=parallelism_config,
        project_dir=train.output_dir,
    )


def describe(accelerator) -> dict:
    """Facts every run logs at start (and tests assert): no silent fallback to one process."""
    from accelerate.utils import gather_object

    state = accelerator.state
    devices = gather_object([f"rank{accelerator.process_index}:{accelerator.device}"])
    return {
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "world_size": accelerator.num_processes,
        "backend": state.backend or "none",
        "mixed_precision": accelerator.mixed_precision,
        "devices": devices,
    }


def layout(accelerator, global_batch_size: int) -> dict:
    """How a run is spread: recorded in every checkpoint; a resume under another layout converts."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return {
        "distributed_type": str(accelerator.state.distributed_type).split(".")[-1],
        "world_size": accelerator.num_processes,
        "zero_stage": int(plugin.zero_stage) if plugin is not None else 0,
        "tensor_parallel": replicas(accelerator),
        "global_batch_size": global_batch_size,
    }


@dataclass(frozen=True)
class Plan:
    """Step arithmetic for a run. `step` always means optimizer step; `micro` means one micro batch."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int  # data-parallel size: ranks that hold different batches
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    num_processes: int  # accelerate steps a prepared scheduler once per process

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def scheduler_steps(self) -> tuple[int, int]:
        """(warmup, total) to build the LR scheduler with. A prepared scheduler is stepped once per
        process per optimizer step by accelerate (AcceleratedScheduler, split_batches=False)."""
        return self.warmup_steps * self.num_processes, self.total_steps * self.num_processes


def make_plan(train: TrainArgs, n_train_rows: int, world_size: int, num_processes: int | None = None) -> Plan:
    """How many optimizer steps, from the data size, batch layout and max_steps/epochs.

    An epoch is the largest whole number of global batches in the data; the rest of an epoch's
    shuffle is not used, so every layout of the same global batch sees the same examples.
    """
    micro, ga = train.per_device_train_batch_size, train.gradient_accumulation_steps
    steps_per_epoch = (n_train_rows // micro) // (world_size * ga)
    if steps_per_epoch == 0:
        raise ConfigError(
            [
                (
                    "per_device_train_batch_size",
                    f"one global batch needs {micro * ga * world_size} rows (micro {micro} x accumulation {ga} x "
                    f"{world_size} processes) but the training data has {n_train_rows}; use smaller batches or more data",
                )
            ]
        )
    if train.max_steps > 0:
        total = train.max_steps
    else:
        total = max(1, math.ceil(train.num_train_epochs * steps_per_epoch))
    warmup = train.warmup_steps if train.warmup_steps > 0 else math.ceil(train.warmup_ratio * total)
    return Plan(micro, ga, world_size, steps_per_epoch, total, warmup, num_processes or world_size)


def global_batch_index(plan: Plan, step_in_epoch: int, micro: int, process_index: int) -> int:
    """Position, in the epoch's batch order, of the micro batch a rank is holding.

    accelerate's BatchSamplerShard deals batches round-robin: rank r's j-th batch is batch
    j * world_size + r. So 2 ranks x GA 1 and 1 rank x GA 2 hold the same batches at the same step.
    """
    j = step_in_epoch * plan.gradient_accumulation_steps + micro
    return j * plan.world_size + process_index


def reentrant_checkpointing(accelerator, peft_on: bool) -> bool:
    """Gradient checkpointing mode. PEFT under ZeRO-3 needs reentrant checkpointing (the non-reentrant
    recompute meets parameters ZeRO-3 has already released); everything else uses the non-reentrant one."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return peft_on and plugin is not None and plugin.zero_stage == 3


def maybe_sync_batchnorm(model, train: TrainArgs, accelerator):
    """DDP option: SyncBatchNorm. torch implements it for GPU/XPU only; on CPU we say so and go on."""
    if not train.sync_batchnorm or accelerator.num_processes == 1:
        return model
    if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        logger.warning("sync_batchnorm: the model has no BatchNorm layer; nothing to convert")
        return model
    if accelerator.device.type == "cpu":
        logger.warning("sync_batchnorm: torch supports SyncBatchNorm on GPU/XPU only; BatchNorm stays per-rank on CPU")
        return model
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)


UNUSED_PARAMETER_HINTS = ("find_unused_parameters", "Expected to have finished reduction in the prior iteration")


def explain_ddp_error(err: RuntimeError) -> str | None:
    """A user-facing fix for DDP errors that a run-config option solves, or None."""
    text = str(err)
    if any(h in text for h in UNUSED_PARAMETER_HINTS):
        return (
            "DDP found parameters that received no gradient in this step (a branch of the model that the data "
            "did not use). Set `ddp_find_unused_parameters: true` in the run config (or pass "
            "--ddp_find_unused_parameters true)."
        )
    return None


def is_peer_failure(err: BaseException) -> bool:
    """True for the errors a collective raises when another rank died or stopped answering."""
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None)) if k)
    text = str(err)
    return isinstance(err, kinds) or (
        isinstance(err, RuntimeError)
        and any(
            s in text
            for s in (
                "Connection closed by peer",
                "Connection reset by peer",
                "Broken pipe",
                "timed out",
                "Timed out",
                "NCCL communicator was aborted",
                "ProcessGroupGloo",
            )
        )
    )


def data_parallel_rank(accelerator) -> int:
    """This rank's place among the ranks that hold different batches (a TP group's ranks hold the same)."""
    from finetune.megatron import data_parallel

    return data_parallel(accelerator)[0]


def replicas(accelerator) -> int:
    """How many ranks hold each batch (the TP size): a sum over all ranks counts every batch that often."""
    from finetune.megatron import data_parallel

    return accelerator.num_processes // data_parallel(accelerator)[1]


def gather_for_metrics(accelerator, stats):
    """Eval statistics of the whole eval set: accelerate's gather, unless every rank already holds every
    batch (TP with one data-parallel replica), where gathering would count each batch once per rank."""
    if replicas(accelerator) == accelerator.num_processes > 1:
        return stats
    return accelerator.gather_for_metrics(stats)
