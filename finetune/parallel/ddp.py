"""One process, or DDP (accelerate's NO / MULTI_CPU / MULTI_GPU): the default backend.

Every rank holds the whole model and the whole optimizer, so accelerate's own checkpoint
(model.safetensors, optimizer.bin) is already in full tensors: it doubles as the portable format.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from finetune import chunked_loss
from finetune.config import RunConfig
from finetune.parallel.base import (
    copy_by_name,
    for_export,
    has_accelerator_device,
    local_fraction,
    parallelism_size_problems,
    prepare_all,
    save_from_this_process,
    sequence_split_problems,
    trainable_parameters,
    unwrap,
    unwrap_without_deepspeed,
)
from finetune.parallel.topology import Launcher, Topology

logger = logging.getLogger("finetune")


def environment(cfg: RunConfig) -> None:
    """The same Accelerate config runs on a GPU node (nccl) and on a CPU-only machine (gloo). accelerate's
    MULTI_CPU launcher needs MPI, so our configs use the torchrun launcher (`distributed_type: MULTI_GPU`);
    on a machine without a GPU each rank is told here to come up on the CPU."""
    if not has_accelerator_device():
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    unwrap_without_deepspeed()


def problems(cfg: RunConfig, env: Mapping[str, str] = os.environ, here: bool = True) -> list[tuple[str, str]]:
    """A parallelism_config beside a DDP config (accelerate's MULTI_GPU) that splits the sequence, asks for data
    parallel sizes, or has a size under 1."""
    launcher = Launcher.read(env)
    return (
        parallelism_size_problems(launcher) + sequence_split_problems(launcher) + data_parallel_mesh_problems(launcher)
    )


def data_parallel_mesh_problems(launcher: Launcher) -> list[tuple[str, str]]:
    """parallelism_config_dp_shard_size or _dp_replicate_size > 1 beside a DDP (or one-process) config. accelerate
    1.15 launches it (utils/launch.py prepare_extend_env_parallelism_config) and builds a ParallelismConfig from it
    (accelerator.py:459), then:
    - without a GPU the ranks come up MULTI_CPU (environment() above), which is no Accelerator.multi_device
      (accelerator.py:659), and ParallelismConfig._validate_accelerator raises on every rank at Accelerator()
      (parallelism_config.py:390: "only compatible DistributedType.FSDP (version 2) or ..."; seen on 2 CPU
      processes, for either size); one process raises too (parallelism_config.py:372: total_size != num_processes);
    - on GPUs (MULTI_GPU) it passes, and prepare_model wraps the whole model in DDP on every rank all the same
      (accelerator.py:1883: multi_device without tp), the loaders dealing each dp_replicate x dp_shard rank its own
      batches (data_loader.py:1160-1164): plain DDP, so dp_shard shards nothing, and the same file fails on CPUs."""
    fixes = {
        "dp_shard": (
            "sharding, which accelerate 1.15 does only under FSDP: beside a DDP config it shards nothing (on GPUs every "
            "rank holds the whole model in DDP all the same)",
            "use accelerate_configs/fsdp2.yaml (distributed_type FSDP) to shard the model over the processes, or drop "
            "the parallelism_config for DDP",
        ),
        "dp_replicate": (
            "replicas, which DDP already makes of every process (on GPUs it adds nothing)",
            "drop the parallelism_config for DDP, or use accelerate_configs/fsdp2.yaml with it and "
            "parallelism_config_dp_shard_size for HSDP (replicas of a sharded model)",
        ),
    }
    out = []
    for dim, (what, fix) in fixes.items():
        if (size := launcher.parallelism(dim)) > 1:
            why = (
                f"is {size} beside a DDP config (distributed_type MULTI_GPU, or one process): {what}; and accelerate "
                "1.15 refuses it at Accelerator() without GPUs (MULTI_CPU) or in one process, in a traceback on "
                "every rank"
            )
            out.append((f"parallelism_config_{dim}_size", f"{why}; {fix}"))
    return out


def accelerator_kwargs(cfg: RunConfig) -> dict:
    return {}


UNUSED_PARAMETER_HINTS = ("find_unused_parameters", "Expected to have finished reduction in the prior iteration")


def explain_error(err: BaseException) -> tuple[str, str] | None:
    """(run-config key, fix) for a DDP error that a run-config option solves, or None."""
    if any(h in str(err) for h in UNUSED_PARAMETER_HINTS):
        return (
            "ddp_find_unused_parameters",
            "DDP found parameters that received no gradient in this step (a branch of the model that the data "
            "did not use). Set `ddp_find_unused_parameters: true` in the run config (or pass "
            "--ddp_find_unused_parameters true).",
        )
    return None


class Backend:
    """Single process and DDP. The methods every backend has (see finetune/parallel/__init__.py)."""

    # What a checkpoint holds for a resume under another layout (finetune/checkpoint.py):
    # "full": accelerate's save_state already writes whole tensors (model.safetensors, optimizer.bin);
    # "portable": the backend's own files hold shards, so portable/ adds the full tensors;
    # "native": only the backend's own format (no resume under another layout).
    checkpoint_format = "full"
    needs_hf_weights = True  # False: the backend loads its own weights (the HF model is built empty)

    def __init__(self, accelerator, topology: Topology, cfg: RunConfig):
        self.acc, self.topology, self.cfg = accelerator, topology, cfg
        # no, bf16 or fp16, as chosen at start (environment.set_mixed_precision); accelerate's own answer under
        # DeepSpeed is read from the DeepSpeed config, which says "no" once bf16 runs through autocast
        self.mixed_precision = accelerator.mixed_precision

    # -- building
    def model_kwargs(self) -> dict:
        return {}

    def reentrant_checkpointing(self, peft_on: bool) -> bool:
        return False

    def prepare_frozen(self, model):
        """A model that only runs forwards (dpo's live reference), placed as this layout places the trained one:
        here whole on this process's device, its forwards in the run's mixed precision (accelerate's autocast, which
        prepare gives the trained model); no DDP wrapper (it has no gradients to average) and not registered with
        the Accelerator (checkpoints hold the trained model only)."""
        model.requires_grad_(False)
        model.to(self.acc.device).eval()
        forward = model.forward

        def autocast_forward(*args, **kwargs):
            with self.acc.autocast():
                return forward(*args, **kwargs)

        model.forward = autocast_forward
        return model

    def chunked_loss_blocker(self) -> str | None:
        """Why this layout cannot run the chunked loss (chunked_loss auto is then off; true is refused earlier,
        in problems()); None when it can."""
        return None

    def numel(self, p: torch.nn.Parameter) -> int:
        return p.numel()

    def fp32_master_weights(self) -> bool:
        """Whether the optimizer updates fp32 copies of the weights whatever dtype they were loaded in (DeepSpeed
        and FSDP2 under mixed precision); here AdamW updates the parameters as loaded."""
        return False

    def set_weights_by_name(self, named: dict[str, torch.nn.Parameter], weights: dict[str, torch.Tensor]) -> None:
        """Copy full tensors into the (not yet prepared) model's parameters."""
        copy_by_name(named, weights)

    def place_model(self, model):
        """What the backend does to the loaded model before the optimizer is built over its parameters.
        DDP: the sync_batchnorm option (torch implements SyncBatchNorm for GPU/XPU only; on CPU: said)."""
        if not self.cfg.train.sync_batchnorm or self.topology.num_processes == 1:
            return model
        if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            logger.warning("sync_batchnorm: the model has no BatchNorm layer; nothing to convert")
            return model
        if self.acc.device.type == "cpu":
            logger.warning("sync_batchnorm: torch supports SyncBatchNorm on GPU/XPU only; BatchNorm stays per-rank")
            return model
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)

    def prepare(self, model, optimizer, train_loader, eval_loader, scheduler, plan):
        """accelerate.prepare of everything at once; returns (model, optimizer, train, eval, scheduler)."""
        return prepare_all(self.acc, model, optimizer, train_loader, eval_loader, scheduler)

    def layout(self, plan) -> dict:
        """What a checkpoint records about the run that writes it (a resume under another layout converts)."""
        return {
            **self.topology.layout(),
            "checkpoint_format": self.checkpoint_format,
            "global_batch_size": plan.global_batch_size,
        }

    def observed(self, model) -> dict:
        """What the prepared model shows about how it is spread (logged, and in every metrics row)."""
        return {"parameter_shard": local_fraction(unwrap(self.acc, model).parameters(), self.numel)}

    # -- the step
    def forward_loss(self, model, batch: dict) -> torch.Tensor:
        return model(**batch, **self.no_kv_cache(model)).loss

    def end_inference(self, model) -> None:
        """Forward passes without a backward are over (reference log-probs, an evaluation with its generation):
        what they left gathered goes back to where training keeps it. Nothing here (see fsdp.Backend)."""

    def answer_logps(self, model, inputs: dict, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's summed log-prob of its labelled tokens and their count (preference pairs: the answers',
        preference.sequence_logps), from a forward over `inputs`; under the chunked loss chunk by chunk, never the
        batch's whole logits, with gradients too."""
        from finetune.preference import answer_counts, sequence_logps

        if chunked_loss.installed(self.hf_model(model)):
            ask = {chunked_loss.ROW_NLL: True, **self.no_kv_cache(model)}
            return -model(**inputs, labels=labels, **ask)["nll"], answer_counts(labels)
        return sequence_logps(model(**inputs, **self.no_kv_cache(model)).logits, labels)

    def no_kv_cache(self, model) -> dict:
        """use_cache=False where the model's forward takes it (as Trainer sets it): a training or eval forward needs
        no KV cache, and one built per forward keeps every layer's keys and values until the output is dropped.
        The model's config is left alone, so the exported model keeps the base model's setting for generation."""
        if getattr(self, "_no_kv_cache", None) is None:
            import inspect

            net = self.hf_model(model)
            net = net.get_base_model() if hasattr(net, "get_base_model") else net  # PEFT passes it on
            takes = "use_cache" in inspect.signature(net.forward).parameters
            self._no_kv_cache = {"use_cache": False} if takes else {}
        return self._no_kv_cache

    def clip_grad_norm(self, model, max_norm: float | None):
        return self.acc.clip_grad_norm_(model.parameters(), max_norm or float("inf"))

    def learning_rate(self, optimizer, scheduler) -> float:
        return scheduler.get_last_lr()[0]

    def eval_stats(self, model, batch: dict, labels: torch.Tensor, task: str) -> dict[str, torch.Tensor]:
        """Per-example eval statistics of one batch (metrics.per_example_stats); under the chunked loss each row's
        NLL comes from the model chunk by chunk, never the batch's whole logits."""
        from finetune.metrics import per_example_stats

        if task == "causal_lm" and chunked_loss.installed(self.hf_model(model)):
            ask = {chunked_loss.ROW_NLL: True, **self.no_kv_cache(model)}
            return per_example_stats(None, labels, task, nll=model(**batch, labels=labels, **ask)["nll"])
        inputs = {**batch, "labels": labels} if task == "seq2seq" else batch  # the decoder reads the shifted labels
        return per_example_stats(model(**inputs, **self.no_kv_cache(model)).logits, labels, task)

    def generate(self, model, **kwargs) -> torch.Tensor:
        """transformers' generate on the (PEFT or) transformers model. Where the parameters are sharded (ZeRO-3,
        FSDP, TP) every forward is a collective: synced_gpus keeps every rank stepping until all are done (the
        caller gives every rank the same number of calls)."""
        synced = self.topology.shards_parameters and self.topology.num_processes > 1
        return self.hf_model(model).generate(**kwargs, synced_gpus=synced)

    def gather_for_metrics(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Eval statistics of the whole eval set: accelerate's gather (which drops the duplicates of an uneven
        last batch), unless every rank already holds every batch (TP with one data-parallel replica)."""
        if self.topology.replicas == self.topology.num_processes > 1:
            return stats
        return self.acc.gather_for_metrics(stats)

    # -- full state by parameter name (export, portable resume)
    def hf_model(self, model):
        """The transformers (or PEFT) model object whose config and save_pretrained describe the model."""
        return unwrap(self.acc, model)

    def save_pretrained(self, model, directory: str, dtype: torch.dtype) -> None:
        """The whole trained model (or adapter) as a from_pretrained directory, written by the main process, every
        floating tensor cast once to dtype. A collective: every rank calls it (the weights are gathered). A write
        error is an OSError only where no collective follows the write (export.export gathers those; a backend
        whose ranks still wait in a collective raises another error, which ends the rank and so the job)."""
        weights = self.full_state_dict(model)
        if self.acc.is_main_process:
            net = self.hf_model(model)
            save_from_this_process(net, directory, state_dict=for_export(net, weights, dtype), safe_serialization=True)

    def full_state_dict(self, model) -> dict[str, torch.Tensor]:
        """The whole model's weights (main process; a collective on every backend), in full precision: the
        weights the optimizer updates (fp32 masters under mixed precision), not a 16-bit compute copy. Taken from
        the model without its wrappers, compiled regions included: accelerate's get_state_dict keeps those
        (keep_torch_compile), whose names gain `_orig_mod.` (and DDP's `module.`), which from_pretrained cannot
        load."""
        return unwrap(self.acc, model).state_dict()

    def full_adam_moments(self, model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """{parameter name: {exp_avg, exp_avg_sq}} of the trainable parameters, full tensors (main process). A
        collective where the state is spread. The fp32 masters are full_state_dict's weights by the same names."""
        net = unwrap(self.acc, model)
        inner = getattr(optimizer, "optimizer", optimizer)
        out = {}
        for name, p in net.named_parameters():
            if p.requires_grad and p in inner.state:
                s = inner.state[p]
                out[name] = {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}
        return out

    def set_full_optimizer_state(self, model, optimizer, state: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Set AdamW's step, moments and the weights (fp32 masters) of every trainable parameter by name. The step
        where torch keeps it: on the parameter's device for the fused kernel (which reads it there: a GPU's would
        read a host address), on the host for the foreach one (which reads it as a number)."""
        named = trainable_parameters(unwrap(self.acc, model))
        copy_by_name(named, {n: s["param"] for n, s in state.items()})
        inner = getattr(optimizer, "optimizer", optimizer)
        on_device = inner.defaults.get("fused") or inner.defaults.get("capturable")
        for n, s in state.items():
            p = named[n]
            inner.state[p] = {
                "step": torch.tensor(float(step), dtype=torch.float32, device=p.device if on_device else "cpu"),
                # copies: on the CPU .to would keep the checkpoint file's mapped pages (Resume.full_state) as the state
                "exp_avg": s["exp_avg"].to(p.device, p.dtype, copy=True),
                "exp_avg_sq": s["exp_avg_sq"].to(p.device, p.dtype, copy=True),
            }

    def one_process_loading(self):
        """A context in which one process alone may build or load a model (e.g. merging the adapter)."""
        import contextlib

        return contextlib.nullcontext()

    def writes_after_its_collectives(self) -> bool:
        """Whether accelerate's save_state writes with torch.save only after its last collective under this backend:
        then a rank whose torch.save fails (a full disk) reports it with the others (checkpoint.attempt_write); if a
        collective followed, the others would wait in it, and the rank must end instead (the launcher ends the job).
        DDP and TP gather (DTensors) before the main process writes."""
        return True

    def load_state(self, path: str) -> None:
        """Resume under the same layout: accelerate's load_state (model, optimizer, scheduler, RNG)."""
        self.acc.load_state(path)

    def explain_error(self, err: BaseException) -> tuple[str, str] | None:
        return explain_error(err)

    def close(self) -> None:
        """At the end of the run, whether it finished or failed: stop what the backend started beside the rank
        (ranks end with os._exit, which runs no finalizers)."""

    def keep_checkpoints_per_machine(self) -> None:
        """output_dir is not shared between the machines (finetune.cluster.probe_storage): make each machine's
        copy of every checkpoint complete. accelerate writes model, optimizer, scheduler and sampler states on
        the global main process only, unless save_on_each_node; RNG states are per process anyway."""
        self.acc.project_configuration.save_on_each_node = True
