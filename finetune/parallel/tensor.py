"""torch-native tensor parallelism (DTensor, the model's tp_plan) through accelerate's ParallelismConfig.

accelerate_configs/tp2.yaml: TP 2 on 2 processes (GPU, or CPU on gloo). TP with data parallelism goes
through FSDP2 (accelerate_configs/tp2_fsdp2.yaml, finetune/parallel/fsdp.py).

What differs from DDP, and why:
- accelerate 1.15's ParallelismConfig refuses MULTI_CPU, although the sharded model trains on gloo with
  the losses of one process: `CpuTensorParallelConfig` is the one workaround
  (tests/test_megatron.py::test_accelerate_still_refuses_tp_on_cpu fails once accelerate accepts it).
- The model is sharded at load by transformers (`tp_plan="auto"` over accelerate's "tp" mesh). Its
  "replicated_with_grad_allreduce" style sums the accumulated gradient again at every micro batch:
  `per_backward_grad_all_reduce` is the one workaround (registered by TP x FSDP2 too; measured under tp2 only).
- The ranks of one TP group hold the same batch (Topology.dp, Topology.replicas).
- `save_state` cannot write DTensors (safetensors reads each tensor's storage pointer), and a pickled
  DTensor optimizer state would hold rank 0's shards only: checkpoints hold full tensors through
  torch.distributed.checkpoint's full state dicts instead (also what export and portable resume use).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from finetune.config import RunConfig
from finetune.parallel import base, ddp
from finetune.parallel.topology import Launcher

KEY = "accelerate config"  # the problem is in the Accelerate config, not in the run config


def environment(cfg: RunConfig) -> None:
    ddp.environment(cfg)  # CPU ranks on a machine without a GPU


def problems(cfg: RunConfig, env: Mapping[str, str] = os.environ, here: bool = True) -> list[tuple[str, str]]:
    """Everything that keeps this run from starting under torch-native TP without data parallelism."""
    p: list[tuple[str, str]] = []
    launcher = Launcher.read(env)
    tp, n = launcher.tp_size, launcher.world_size
    sizes = {k: launcher.parallelism_sizes[k] for k in ("dp_replicate", "dp_shard", "cp")}
    if any(v > 1 for v in sizes.values()) or tp != n:
        p.append(
            (
                KEY,
                f"tensor parallelism without FSDP needs tp_size equal to the number of processes (tp_size {tp}, "
                f"{n} processes, {sizes}); set num_processes: {tp}, or use accelerate_configs/tp2_fsdp2.yaml "
                "for tensor x data parallelism",
            )
        )
    p += base.parallelism_size_problems(launcher) + base.sequence_split_problems(launcher)
    return p + model_problems(cfg, tp)


def model_problems(cfg: RunConfig, tp: int) -> list[tuple[str, str]]:
    """What a model and run config need for tensor parallelism of degree tp (also under FSDP2)."""
    from finetune.model import model_config

    p: list[tuple[str, str]] = []
    if cfg.peft.method != "none":
        p.append(("peft.method", "adapters are not supported with tensor parallelism; set peft.method: none"))
    if cfg.train.method != "sft":
        p.append(("method", f"{cfg.train.method} is not supported with tensor parallelism yet (its log-probs need the "
                            "whole vocabulary's logits); use a DDP/DeepSpeed/FSDP2 config"))  # fmt: skip
    if cfg.model.task != "causal_lm":
        p.append(
            (
                "task",
                f"{cfg.model.task} is not supported with tensor parallelism (transformers has no tensor-parallel plan "
                "for a classifier head, nor for encoder-decoders such as T5 and BART); use task: causal_lm, or a "
                "DDP/DeepSpeed config",
            )
        )
    config = model_config(cfg.model)
    if config is None:
        return p
    if not getattr(config, "base_model_tp_plan", None):
        p.append(
            (
                "model",
                f"model type {config.model_type!r} has no tensor-parallel plan in transformers (base_model_tp_plan); "
                "use a model that has one (e.g. llama, mistral, qwen2), or a DDP/DeepSpeed/FSDP2 config",
            )
        )
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    for name, count in (("attention heads", heads), ("key/value heads", kv)):
        if count and count % tp:
            p.append((KEY, f"tp_size {tp} must divide the model's {count} {name}"))
    return p


def _cpu_tp_config_class():
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    class CpuTensorParallelConfig(ParallelismConfig):
        """accelerate's ParallelismConfig, accepted on MULTI_CPU (gloo) too.

        accelerate 1.15 `ParallelismConfig._validate_accelerator` accepts only FSDP2, MULTI_<device> and
        DeepSpeed, and MULTI_CPU is not a MULTI_<device> (Accelerator.multi_device). Everything TP needs works
        on CPU: the device mesh (init_device_mesh("cpu")), transformers' tp_plan, the prepared loaders (one
        batch per TP group), and the model is not wrapped in DDP. Only the size check is kept.
        """

        def _validate_accelerator(self, accelerator):
            if accelerator.distributed_type != DistributedType.MULTI_CPU:
                return super()._validate_accelerator(accelerator)
            if self.total_size != accelerator.num_processes:
                raise ValueError(
                    f"ParallelismConfig total_size ({self.total_size}) does not match num_processes "
                    f"({accelerator.num_processes})"
                )

    return CpuTensorParallelConfig


def accelerator_kwargs(cfg: RunConfig) -> dict:
    """The CPU-accepting parallelism config on a machine without CUDA; else accelerate builds its own."""
    per_backward_grad_all_reduce()
    if torch.cuda.is_available():
        return {}
    return {"parallelism_config": _cpu_tp_config_class()()}  # sizes from PARALLELISM_CONFIG_*, as accelerate's


def per_backward_grad_all_reduce() -> None:
    """Workaround (transformers 5.23, distributed/tensor_parallel.py ReplicatedWithGradAllReduce, the one style with a
    gradient hook): a parameter under "replicated_with_grad_allreduce" (Qwen3's and Gemma 3's q_norm/k_norm, ...) sees
    only its rank's heads, and its gradient must be summed over the TP group. transformers all-reduces param.grad in a
    post-accumulate hook, i.e. the gradient accumulated so far: with gradient accumulation each micro batch's reduced
    gradient is summed again at every later one (GA 2, TP 2: 2 x G1 + G2), a silently wrong update. This style
    all-reduces each backward's own gradient as it arrives (a tensor hook), before it is accumulated; the sum is
    linear, so that is the same at every accumulation boundary (accelerate's no_sync does not reach a TP hook).
    Registered over transformers' own before any model loads; the hooks go on at the first forward, as transformers'
    (loading replaces the parameters). tests/test_megatron.py::test_transformers_still_reduces_the_accumulated_gradient
    fails once transformers reduces each backward's own gradient: then this goes."""
    import torch.distributed as dist
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, ReplicatedWithGradAllReduce

    class PerBackwardGradAllReduce(ReplicatedWithGradAllReduce):
        def install_forward(self, module, mesh):
            original_forward, hooked = module.forward, {}

            def reduced(grad):
                grad = grad.clone()  # autograd may hand the same tensor to another input
                dist.all_reduce(grad, group=mesh.get_group())
                return grad

            def tp_forward(*args, **kwargs):
                if torch.is_grad_enabled():
                    for name, param in module.named_parameters(recurse=False):
                        if param.requires_grad and hooked.get(name) is not param:
                            param.register_hook(reduced)
                            hooked[name] = param
                return original_forward(*args, **kwargs)

            module.forward = tp_forward
            return module

    ALL_PARALLEL_STYLES.register("replicated_with_grad_allreduce", PerBackwardGradAllReduce())


class Backend(ddp.Backend):
    """torch-native TP: only what differs from the DDP backend."""

    checkpoint_format = "full"  # save_state goes through full state dicts (enable_full_checkpoints)

    def keep_checkpoints_per_machine(self) -> None:
        raise base.no_checkpoints_per_machine(
            "tensor-parallel checkpoints (torch.distributed.checkpoint) are not verified to be complete per machine"
        )

    def model_kwargs(self) -> dict:
        """Shard the model by its tp_plan over accelerate's "tp" mesh as it loads."""
        return {"tp_plan": "auto", "device_mesh": self.acc.torch_device_mesh["tp"]}

    def prepare(self, model, optimizer, train_loader, eval_loader, scheduler, plan):
        prepared = base.prepare_all(self.acc, model, optimizer, train_loader, eval_loader, scheduler)
        enable_full_checkpoints(self.acc, prepared[0], prepared[1])
        return prepared

    def full_state_dict(self, model):
        return full_state_dict(base.unwrap(self.acc, model))

    def save_pretrained(self, model, directory: str, dtype: torch.dtype) -> None:
        """Every rank takes part in gathering the DTensors, one tensor at a time, each cast to dtype shard by shard
        first; the main process alone keeps them (transformers' own gather for a model loaded with a tp_plan keeps
        a whole CPU copy on every rank: tp_size copies of the model in one machine's memory), then writes them
        while the others wait in transformers' barrier."""
        from torch.distributed.tensor import DTensor

        net = base.unwrap(self.acc, model)
        main = self.acc.is_main_process
        weights = {}
        for name, tensor in base.for_export(net, net.state_dict(), dtype).items():  # each rank casts its shards
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if main:
                weights[name] = whole.detach().cpu()
        try:
            net.save_pretrained(directory, state_dict=weights, is_main_process=main, safe_serialization=True)
        except OSError as e:  # the main process's write; the others wait in transformers' barrier after it
            raise RuntimeError(f"writing {directory} failed inside transformers' save_pretrained: {e}") from e

    def full_adam_moments(self, model, optimizer):
        return full_adam_moments(base.unwrap(self.acc, model), optimizer)

    def set_full_optimizer_state(self, model, optimizer, state, step: int) -> None:
        set_full_optimizer_state(base.unwrap(self.acc, model), optimizer, state, step)


# ---------------------------------------------------------------- full state dicts of DTensor models (TP, FSDP2)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state_dict(net) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain CPU tensors on rank 0 (empty on the other ranks). A collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(net, options=_options(cpu_offload=True))


def full_adam_moments(net, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {exp_avg, exp_avg_sq}} of the trainable parameters, full tensors on rank 0. A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> the torch optimizer
    state = get_optimizer_state_dict(net, inner, options=_options(cpu_offload=True)).get("state", {})  # rank 0 only
    return {n: {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]} for n, s in state.items()}


def set_full_optimizer_state(net, optimizer, state: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    """Scatter full weights and AdamW state (every rank holds the full tensors) to each rank's shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    inner = getattr(optimizer, "optimizer", optimizer)
    set_model_state_dict(net, {n: s["param"] for n, s in state.items()}, options=_options(strict=False))
    # The groups (parameter names, lr, betas...) from the rank's own shards: a full state dict would gather every
    # moment onto every rank's device only to read them (8 bytes per parameter on each GPU).
    groups = get_optimizer_state_dict(net, inner, options=StateDictOptions())["param_groups"]
    # On the CPU the shards can be views of the full tensors, which are the checkpoint file's mapped pages
    # (Resume.full_state): copies, so that the run holds no file of the checkpoint open (one a later save replaces)
    own = (lambda t: t.clone()) if next(net.parameters()).device.type == "cpu" else (lambda t: t)
    full = {
        "state": {
            n: {"step": torch.tensor(float(step)), "exp_avg": own(s["exp_avg"]), "exp_avg_sq": own(s["exp_avg_sq"])}
            for n, s in state.items()
        },
        "param_groups": groups,
    }
    set_optimizer_state_dict(net, inner, full, options=_options())


def enable_full_checkpoints(accelerator, model, optimizer) -> None:
    """Make save_state/load_state write and read full tensors for a DTensor model (call once, after prepare):
    model.safetensors is the whole model (HF names), optimizer.bin the whole AdamW state keyed by parameter
    name; loading scatters them back to each rank's shards. Scheduler, RNG and sampler states are accelerate's."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    net = base.unwrap(accelerator, model)
    inner = optimizer.optimizer  # the torch optimizer inside accelerate's AcceleratedOptimizer

    def save_model(models, weights, output_dir):
        for i, m in enumerate(models):
            if m is model:
                weights[i] = full_state_dict(net)  # every rank takes part; accelerate writes rank 0's

    def load_model(models, input_dir):
        if model in models:
            set_model_state_dict(net, load_file(os.path.join(input_dir, "model.safetensors")), options=_options())
            models.remove(model)  # loaded: accelerate must not load it again

    accelerator.register_save_state_pre_hook(save_model)
    accelerator.register_load_state_pre_hook(load_model)
    optimizer.state_dict = lambda: get_optimizer_state_dict(net, inner, options=_options(cpu_offload=True))
    optimizer.load_state_dict = lambda state: set_optimizer_state_dict(net, inner, state, options=_options())
