"""FSDP2 (torch's fully_shard) through accelerate: full shard, CPU offload, and TP x FSDP2.

  accelerate_configs/fsdp2.yaml          parameters, gradients and optimizer states sharded over every rank
  accelerate_configs/fsdp2_offload.yaml  the same, kept on the CPU between uses (CPUOffloadPolicy)
  accelerate_configs/tp2_fsdp2.yaml      tensor parallel 2 x FSDP 2 on 4 processes (accelerate's ParallelismConfig)

What differs from DDP, and why:
- accelerate 1.15 turns ACCELERATE_USE_FSDP into DistributedType.FSDP only for ranks that came up on an
  accelerator (AcceleratorState.__init__: MULTI_GPU/NPU/...); a CPU rank stays MULTI_CPU, or NO, and the run
  would silently be DDP or one process. `come_up_on_cpu` is the one workaround (tests/test_fsdp.py::
  test_accelerate_still_refuses_fsdp_on_cpu fails once accelerate accepts FSDP on CPU).
- Parameters are DTensors: full weights and AdamW state by name go through torch.distributed.checkpoint's
  full state dicts (finetune/parallel/tensor.py); accelerate's own checkpoint holds shards, so portable/ adds
  the full tensors for a resume under another layout.
- TP x FSDP2: the model is split by its tp_plan on accelerate's "tp" mesh (`tensor_parallel_on`, a workaround of
  transformers building its own mesh); accelerate shards every parameter outside the model's tp_plan (the norms) as a Replicate DTensor
  through transformers' ReplicateParallel, which transformers 5 no longer has: `replicate_parallel_shim`
  (tests/test_fsdp.py::test_transformers_still_lacks_replicate_parallel fails once it is back). A head tied to
  the input embeddings is untied while the plan splits the model, then tied to the split embeddings
  (`untied_while_split`, a workaround of transformers failing on the tied name). Eval statistics are gathered
  one copy per TP group (`gathered_once_per_tp_group`, a workaround of accelerate's gather_for_metrics counting
  every TP rank's copy of a batch; tests/test_fsdp.py::test_accelerate_still_counts_every_tp_copy_of_an_eval_row
  fails once accelerate counts each row once).
- The units: each class of the model's _no_split_modules, less any that holds the input embeddings
  (`wrap_classes`, a workaround of accelerate 1.15: BERT, RoBERTa, ModernBERT and about 40 more list their
  *Embeddings there, and prepare failed).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Mapping

from finetune.config import ConfigError, RunConfig
from finetune.parallel import base, ddp, tensor
from finetune.parallel.topology import Launcher, Topology, fsdp_offloads

logger = logging.getLogger("finetune")


def environment(cfg: RunConfig) -> None:
    base.unwrap_without_deepspeed()
    if not base.has_accelerator_device() and Launcher.read().distributed:  # one process under torchrun too
        come_up_on_cpu(cfg.train)


def come_up_on_cpu(train) -> None:
    """Workaround (accelerate 1.15): start this rank's PartialState on the CPU (gloo, torchrun's world size),
    then label it MULTI_GPU, the only thing AcceleratorState's FSDP branch reads; Accelerator() then comes up
    as DistributedType.FSDP with gloo and the CPU device. Must run before Accelerator()."""
    from accelerate.utils import DistributedType

    state = base.start_process_group(train, cpu=True)  # train: TrainArgs (ddp_timeout)
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.MULTI_GPU


def problems(cfg: RunConfig, env: Mapping[str, str] = os.environ, here: bool = True) -> list[tuple[str, str]]:
    launcher = Launcher.read(env)
    tp = launcher.tp_size
    p = tensor.model_problems(cfg, tp) if tp > 1 else []
    if launcher.fsdp_version != 2:
        p.append(
            (
                "fsdp_version",
                f"the Accelerate config asks for FSDP{launcher.fsdp_version} (its fsdp_config has no `fsdp_version: "
                "2`), and finetune runs FSDP2 only (torch's fully_shard: its mixed precision, checkpoints and full "
                "weights by name); add `fsdp_version: 2` under fsdp_config, or start from accelerate_configs/fsdp2.yaml",
            )
        )
    p += mesh_problems(launcher) + base.parallelism_size_problems(launcher) + base.sequence_split_problems(launcher)
    blocker = chunked_loss_blocker()
    if cfg.model.chunked_loss == "true" and blocker:
        p.append(("chunked_loss", f"is true, but {blocker}: upgrade torch to 2.13 or newer, or set chunked_loss: auto"))
    if cfg.peft.load_in_4bit:
        why = (
            "accelerate 1.15 leaves bitsandbytes' packed 4-bit weights unsharded on every rank, and the full state "
            "dict of checkpoints and export cannot gather them"
        )
        p.append(base.qlora_refused("FSDP2", why))
    if cfg.model.task == "seq2seq":
        p.append(
            (
                "task",
                "seq2seq models do not run under FSDP2 here: T5 and BART share one embedding between the encoder, "
                "the decoder and the head, accelerate 1.15's fully_shard wrapping puts its copies in two FSDP groups, "
                "and torch refuses that ('shared with a parameter already managed by another FSDP group'); use "
                "accelerate_configs/zero3.yaml (parameters, gradients and optimizer states sharded the same way) "
                "or ddp.yaml",
            )
        )
    return p


def mesh_problems(launcher: Launcher) -> list[tuple[str, str]]:
    """The parallelism_config mesh accelerate 1.15 refuses under FSDP2 at Accelerator() (parallelism_config.py),
    said before it with the fix: a mesh of another size than the launch (_validate_accelerator: total_size), and a
    mesh with no dp_shard ranks for FSDP2 to shard over, such as tp_size equal to the processes or
    dp_replicate_size alone (_validate_accelerator: "no dimension for FSDP to shard across"; beside tp,
    __post_init__: "cannot be used with pure data parallelism"). Context parallelism would give FSDP2 its cp ranks
    to shard over, but is refused itself (base.sequence_split_problems); sizes under 1 are
    base.parallelism_size_problems'."""
    sizes = launcher.parallelism_sizes
    if not launcher.use_parallelism_config or min(sizes.values()) < 1:
        return []
    p = []
    mesh = math.prod(sizes.values())
    said = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1)
    if mesh != launcher.world_size:
        p.append(
            (
                tensor.KEY,
                f"the config's parallelism_config ({said}) makes a mesh of {mesh} processes and the launch has "
                f"{launcher.world_size}; launch {mesh} processes (--num_processes {mesh}), or change the "
                "parallelism_config sizes (for one process: accelerate_configs/fsdp2.yaml or fsdp2_offload.yaml)",
            )
        )
    if mesh > 1 and sizes["dp_shard"] == 1 and sizes["cp"] == 1:
        p.append(("parallelism_config_dp_shard_size", nothing_to_shard(said, sizes)))
    return p


def nothing_to_shard(said: str, sizes: Mapping[str, int]) -> str:
    """Why a mesh without dp_shard ranks cannot run under FSDP2, and what to launch instead."""
    instead = []
    if sizes["tp"] > 1 and sizes["dp_replicate"] == 1:
        instead.append("for tensor parallelism over every process without FSDP use accelerate_configs/tp2.yaml")
    if sizes["dp_replicate"] > 1 and sizes["tp"] == 1:
        instead.append("for whole copies of the model on every rank (DDP) use accelerate_configs/ddp.yaml")
    return (
        f"is 1 in an FSDP2 parallelism_config ({said}), which leaves FSDP2 no ranks to shard the model over: "
        "accelerate 1.15 refuses it at Accelerator(). Set parallelism_config_dp_shard_size to 2 or more with "
        "dp_replicate x dp_shard x tp = the processes (TP x FSDP2: tp 2 x dp_shard 2 on 4, as "
        "accelerate_configs/tp2_fsdp2.yaml; HSDP: dp_replicate 2 x dp_shard 2 on 4)"
        + "".join(f"; or, {alternative}" for alternative in instead)
    )


def chunked_loss_blocker(torch_version: str | None = None) -> str | None:
    """Why FSDP2 cannot run the chunked loss with this torch (None: it can). Before 2.13, FSDP2 skips the unshard
    when backward recomputes a checkpointed module and, its unit resharded by the previous chunk's backward, the
    head ran on its sharded weight: `aten.mm.default got mixed torch.Tensor and DTensor` on the first step of every
    such run (seen on an H100, torch 2.11, accelerate 1.15, bench/gpu_verify.py). torch 2.13 unshards there
    ("params might have been resharded by a previous post_backward"), which tests/test_chunked_loss.py's FSDP2 runs
    prove; 2.12 is unproven and counted with the older ones."""
    import torch
    from packaging.version import Version

    version = Version(torch_version or torch.__version__)
    if version.release >= (2, 13):
        return None
    return (
        f"FSDP2 in torch {version} (before 2.13) reshards the LM head between the chunks' recomputations in backward "
        "and the step fails (mixed torch.Tensor and DTensor)"
    )


def accelerator_kwargs(cfg: RunConfig) -> dict:
    if Launcher.read().tp_size > 1:
        replicate_parallel_shim()
        tensor.per_backward_grad_all_reduce()
    return {}


def replicate_parallel_shim() -> bool:
    """accelerate 1.15's Accelerator._prepare_tp (FSDP2 branch) imports transformers' ReplicateParallel and
    calls ReplicateParallel().prepare_module_tp(module, tp_mesh) for every parameter outside the tp_plan, after
    making it a Replicate DTensor on the TP mesh; transformers 5 removed the class. This one makes the owning
    module run its forward on the local view of its (replicated) parameters. Returns True when it was needed."""
    import transformers.integrations.tensor_parallel as compat

    if getattr(compat, "ReplicateParallel", None) is not None:
        return False
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    class ReplicateParallel(TensorParallelLayer):
        def should_use_local_tensors(self, module):
            return True

        def prepare_module_tp(self, module, device_mesh):
            if "forward" in vars(module):  # already wrapped (a tp_plan style, or a second parameter)
                return module
            return self.install_forward(module, device_mesh)

    compat.ReplicateParallel = ReplicateParallel
    return True


def mixed_precision_policy(mixed_precision: str):
    """FSDP2 under bf16/fp16: compute with 16-bit copies of the fp32 sharded parameters, as autocast does under DDP,
    but reduce-scatter the gradients in fp32 and leave the outputs as the forward returns them. accelerate's own
    policy (FullyShardedDataParallelPlugin.set_mixed_precision) reduces in 16 bits (the error grows with the
    number of ranks) and casts the outputs to 16 bits: the loss came back bf16-quantized (5.875, 5.859375)
    although it is computed in fp32 from the logits."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    half = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32, output_dtype=None)


def tensor_parallel_on(model, tp_mesh) -> None:
    """Workaround (transformers 5.23): from_pretrained(tp_plan=..., device_mesh=...) ignores device_mesh and
    builds its own mesh over every rank (modeling_utils: `device_mesh = mesh_manager.get_mesh(...)`), so
    its DTensors cannot be combined with accelerate's dp_shard mesh ("Cannot concatenate overlapping
    meshes"). Apply transformers' own TP plan to the loaded model on accelerate's "tp" mesh instead
    (tests/test_fsdp.py::test_transformers_still_replaces_the_device_mesh fails once it is honoured).
    A tied LM head goes through `untied_while_split`."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    with untied_while_split(model):
        apply_tensor_parallelism(model, tp_mesh, model._expand_parallel_plan(dict(model.tp_plan)))
    model._tp_size = tp_mesh.size()


@contextlib.contextmanager
def untied_while_split(model):
    """Workaround (transformers 5.23): apply_tensor_parallelism (distributed/tensor_parallel.py) takes each plan
    entry missing from dict(model.named_parameters()) for a module (`module = modules[name]`); named_parameters()
    lists a tied parameter once, under its first name (model.embed_tokens.weight), so the head's entry fails:
    KeyError 'lm_head.weight'. Its own from_pretrained never meets this: it builds the model untied
    (init.no_tie_weights), splits it, loads, then ties. So here too: each tied name gets a Parameter of its own
    while the plan splits the model, then is tied again to its source as split, when the plan split both alike
    (the vocabulary: embedding_rowwise and colwise_gather_output are both Shard(0)); else the model is refused,
    naming both. tests/test_fsdp.py::test_transformers_still_fails_on_a_tied_head fails once that lookup works."""
    import torch

    first = {id(p): name for name, p in model.named_parameters()}  # a tied parameter under its first name
    # alias -> source, e.g. lm_head.weight -> model.embed_tokens.weight
    tied = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if first[id(p)] != n}
    for name in tied:
        module, _, attr = name.rpartition(".")
        param = model.get_parameter(name)
        model.get_submodule(module)._parameters[attr] = torch.nn.Parameter(param.detach(), param.requires_grad)
    yield
    for name, source in tied.items():
        split, kept = (_placements(model.get_parameter(n)) for n in (name, source))
        if split != kept:
            raise ConfigError([("model", tied_split_differently(name, split, source, kept))])
        module, _, attr = name.rpartition(".")
        model.get_submodule(module)._parameters[attr] = model.get_parameter(source)


def _placements(param) -> tuple | None:
    return tuple(getattr(param, "placements", ())) or None  # None: not split (a plain tensor)


def tied_split_differently(name: str, split, source: str, kept) -> str:
    return (
        f"the model ties {name} to {source} (tie_word_embeddings), and its tensor-parallel plan splits the two "
        f"differently ({split} and {kept}), so no one tensor can serve both under tensor parallelism; use "
        "accelerate_configs/fsdp2.yaml or zero3.yaml (parameters sharded over every rank, no tensor parallelism)"
    )


def wrap_classes(plugin, model) -> None:
    """Workaround (accelerate 1.15): the classes FSDP2 shards as units, set on the plugin before prepare.

    accelerate shards every module of the listed classes (default: the model's _no_split_modules), then calls
    fully_shard on get_input_embeddings() unless that module itself is already a unit; when a listed class holds
    the embeddings (BertEmbeddings, ModernBertEmbeddings: about 40 transformers models list one), their weight is
    already a DTensor of that unit and prepare fails ("Invariant encountered: value was None"). Without a user's
    fsdp_transformer_layer_cls_to_wrap, such classes are left out of the default (the layers are still units; the
    embeddings get the unit accelerate carves for them); a user's list that names one is refused.
    tests/test_fsdp.py::test_accelerate_still_refuses_fsdp_on_cpu fails once accelerate shards such a model."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = plugin.auto_wrap_policy
    if getattr(policy, "func", policy) is not transformer_auto_wrap_policy:
        return
    holders = embedding_holders(model)
    given = plugin.transformer_cls_names_to_wrap
    if given is None:
        default = sorted(getattr(model, "_no_split_modules", None) or [])
        plugin.transformer_cls_names_to_wrap = [name for name in default if name not in holders]
        if left := [name for name in default if name in holders]:
            logger.info("fsdp: %s (holding the input embeddings) left out of the FSDP units", ", ".join(left))
        return
    if named := [name for name in given if name in holders]:
        key = "fsdp_transformer_layer_cls_to_wrap"
        layers = [name for name in sorted(getattr(model, "_no_split_modules", None) or []) if name not in holders]
        raise ConfigError(
            [
                (
                    key,
                    f"(the Accelerate config) names {', '.join(named)}, which holds the model's input embeddings: "
                    "accelerate 1.15 shards it as one unit, then shards the embeddings inside it again, and prepare "
                    f"fails; leave {', '.join(named)} out (e.g. {key}: {','.join(layers) or 'the decoder layer'}), "
                    "or remove the key and finetune wraps the model's layers",
                )
            ]
        )


def gathered_once_per_tp_group(accelerator, stats: dict, topology: Topology) -> dict:
    """Workaround (accelerate 1.15): the eval statistics of every row of the eval set, each once, under TP x FSDP2.

    accelerate shards the eval loader over the data-parallel groups only (the TP ranks of a group read the same
    batches; prepare_data_loader with the device mesh) and counts the last round's remainder in those batches, but
    gather_for_metrics gathers every rank and keeps the first `remainder` rows of that: every full batch TP times,
    and of the last round some rows TP times, some once, some not at all. Here: accelerate's gather, the first TP
    rank's copy of each batch (accelerate's mesh has "tp" innermost: ranks dp_rank * tp ... + tp - 1 hold one
    batch), then the remainder of the last round, as gather_for_metrics cuts it."""
    gathered = accelerator.gather(stats)
    state = accelerator.gradient_state
    keep = state.remainder if state.end_of_dataloader and state.remainder > 0 else None
    n, tp = topology.num_processes, topology.tp

    def once(rows):
        return rows.reshape(n, -1, *rows.shape[1:])[::tp].flatten(0, 1)[:keep]

    return {k: once(v) for k, v in gathered.items()}


def embedding_holders(model) -> set[str]:
    """Class names of the modules below the model that contain its input embeddings (not the embeddings' own)."""
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return set()
    if embed is None:
        return set()
    return {
        type(m).__name__
        for m in model.modules()
        if m is not model and m is not embed and any(s is embed for s in m.modules())
    }


class Backend(ddp.Backend):
    """FSDP2: only what differs from the DDP backend."""

    checkpoint_format = "portable"  # accelerate's FSDP checkpoint holds shards: portable/ adds full tensors

    def fp32_master_weights(self) -> bool:
        return self.mixed_precision in ("bf16", "fp16")  # its 16-bit compute copy is made from fp32 masters

    def chunked_loss_blocker(self) -> str | None:
        return chunked_loss_blocker()

    def prepare_frozen(self, model):
        """Sharded as the trained model is (accelerate's fully_shard wrapping, the run's mixed precision policy and
        offload), each rank holding its share; accelerate's prepare takes one model under FSDP2, so its wrapping
        function is called directly."""
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        model.requires_grad_(False)
        wrap_classes(self.acc.state.fsdp_plugin, model)
        return fsdp2_prepare_model(self.acc, model).eval()

    def keep_checkpoints_per_machine(self) -> None:
        raise base.no_checkpoints_per_machine(
            "FSDP's sharded checkpoint (torch.distributed.checkpoint) writes its metadata on rank 0 only and "
            "spreads entries every rank reads over the ranks, so no machine would hold a loadable copy"
        )

    def place_model(self, model):
        """TP x FSDP2: split the loaded model by its tp_plan over accelerate's own "tp" mesh, before the optimizer
        is built (FSDP2 then shards it over "dp_shard" of the same mesh)."""
        if self.topology.tp > 1:
            tensor_parallel_on(model, self.acc.torch_device_mesh["tp"])
        return model

    def prepare(self, model, optimizer, train_loader, eval_loader, scheduler, plan):
        plugin = self.acc.state.fsdp_plugin
        wrap_classes(plugin, model)
        if self.mixed_precision in ("bf16", "fp16"):
            plugin.mixed_precision_policy = mixed_precision_policy(self.mixed_precision)
        if fsdp_offloads(plugin) and not base.has_accelerator_device():
            # CPUOffloadPolicy pins host memory by default, which needs an accelerator (part of come_up_on_cpu's
            # workaround: there is no device to offload from on a CPU-only machine, so nothing is lost)
            from torch.distributed.fsdp import CPUOffloadPolicy

            plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
        return base.prepare_all(self.acc, model, optimizer, train_loader, eval_loader, scheduler)

    def gather_for_metrics(self, stats):
        """TP x FSDP2: one copy of each data-parallel group's rows (gathered_once_per_tp_group)."""
        if self.topology.tp > 1:
            return gathered_once_per_tp_group(self.acc, stats, self.topology)
        return super().gather_for_metrics(stats)

    def observed(self, model) -> dict:
        """From the prepared model itself: FSDP2 really applied (DTensor parameters), and how much of the model
        this rank holds."""
        from torch.distributed.tensor import DTensor

        net = base.unwrap(self.acc, model)
        params = list(net.parameters())
        return {
            "fsdp_version": 2 if all(isinstance(p, DTensor) for p in params) and self.acc.is_fsdp2 else 0,
            "offload_params": fsdp_offloads(self.acc.state.fsdp_plugin),
            "parameter_shard": base.local_fraction(params, self.numel),
        }

    def writes_after_its_collectives(self) -> bool:
        """Sharded state dicts go through torch distributed checkpoint, whose errors come after its collectives, on
        every rank; with a full state dict (a user's fsdp_state_dict_type) the main process torch.saves the model
        before the optimizer's gather."""
        return "SHARDED" in str(self.acc.state.fsdp_plugin.state_dict_type)

    def end_inference(self, model) -> None:
        """After a forward FSDP2 leaves the parameters of the modules that end it whole (the final norm and the LM
        head, each an FSDP module of its own here: the backward that follows needs them first); after passes with no
        backward they stayed whole until the next training step, and on the frozen live reference (prepare_frozen),
        which never runs a backward, for the whole run. Every FSDP module is resharded: the memory is
        freed, and the model is as training keeps it (the `observed` facts of a DPO run, read after its reference
        pass, said fsdp_version 0, parameter_shard 0.63)."""
        from torch.distributed.fsdp import FSDPModule

        for module in base.unwrap(self.acc, model).modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def full_state_dict(self, model):
        return tensor.full_state_dict(base.unwrap(self.acc, model))

    def full_adam_moments(self, model, optimizer):
        return tensor.full_adam_moments(base.unwrap(self.acc, model), optimizer)

    def set_full_optimizer_state(self, model, optimizer, state, step: int) -> None:
        tensor.set_full_optimizer_state(base.unwrap(self.acc, model), optimizer, state, step)
