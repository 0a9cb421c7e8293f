"""THE one place that knows backends differ.

The Accelerate config file given to `accelerate launch` picks the backend family; each family is one
module here, and each exposes the same small surface, so the builders (run.py), the loop (loop.py),
checkpoints and export are written once for all of them:

  before the Accelerator (module functions, read from the launcher's environment)
    environment(cfg)         what a rank needs set before accelerate reads the environment
    problems(cfg)            what cannot run, as (key, fix) pairs, all reported before any model loads
    accelerator_kwargs(cfg)  what Accelerator() needs (Megatron-LM's plugin, a parallelism config)
  after it (a `Backend` object, see ddp.Backend for the defaults the others override)
    topology                 the Topology: dp / tp / pp sizes, ZeRO stage, FSDP, offload, processes, machines
    model_kwargs, reentrant_checkpointing, numel, set_weights_by_name, chunked_loss_blocker, prepare_frozen
                             building the model (prepare_frozen: a forward-only model, the live reference)
    prepare, observed        accelerate.prepare, and what the prepared objects show (logged, in metrics rows)
    forward_loss, clip_grad_norm, eval_stats, gather_for_metrics, generate the step and eval
    full_state_dict, full_adam_moments, set_full_optimizer_state, hf_model   by parameter name
    keep_checkpoints_per_machine   output_dir not shared between machines: complete copies, or a refusal

  ddp.py        one process and DDP (the defaults)
  deepspeed.py  DeepSpeed ZeRO-1/2/3, CPU offload
  fsdp.py       FSDP2 (full shard, CPU offload, TP x FSDP2)
  tensor.py     torch-native tensor parallelism (DTensor)
  megatron.py   Megatron-LM tensor/pipeline parallelism (GPU only)
  base.py       helpers several families share (prepare_all, copy_by_name, has_accelerator_device, ...)
  plan.py       step arithmetic (Plan); topology.py the Topology; environment.py the Accelerator
  surface.py    the typed surface above (FamilyModule, Backend), which ddp.Backend implements by default

No code outside this package branches on the distributed type, ZeRO stage, FSDP, TP or Megatron-LM
(tests/test_parallel.py::test_no_backend_branches_outside_parallel enforces it).
"""

from __future__ import annotations

from finetune.config import RunConfig
from finetune.parallel.base import collective_timeout
from finetune.parallel.environment import (
    describe,
    family_module,
    is_peer_failure,
    make_accelerator,
    set_cpu_allocator,
)
from finetune.parallel.plan import Plan, global_batch_index, make_plan
from finetune.parallel.surface import Backend
from finetune.parallel.topology import Topology

__all__ = [
    "Backend",
    "Plan",
    "Topology",
    "collective_timeout",
    "describe",
    "global_batch_index",
    "is_peer_failure",
    "make_accelerator",
    "make_backend",
    "make_plan",
    "set_cpu_allocator",
]


def make_backend(accelerator, cfg: RunConfig) -> Backend:
    """The Backend object of the family this run was launched with."""
    topology = Topology.read(accelerator)
    return family_module(topology.family).Backend(accelerator, topology, cfg)
