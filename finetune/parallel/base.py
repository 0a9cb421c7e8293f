"""What several backend families share: helpers of the default (ddp.py) that the others use too.

A family module imports this module and, where it extends the default Backend, ddp.py; this module imports no
family. (The surface every family offers is typed in surface.py.)
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from collections.abc import Iterable

import torch

from finetune.config import ConfigError
from finetune.parallel.topology import PARALLELISM_DIMS, Launcher


def has_accelerator_device() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def unwrap_without_deepspeed() -> None:
    """Workaround (accelerate 1.15): `unwrap_model` imports deepspeed whenever it is installed, only to recognise
    a DeepSpeedEngine: about 0.7 s per process, and DeepSpeed's "Setting accelerator to CPU" warning on every
    rank of runs that do not use it. Outside a DeepSpeed run there is no engine to recognise, so that function
    is told DeepSpeed is absent. tests/test_parallel.py::test_accelerate_still_imports_deepspeed_to_unwrap
    fails once accelerate no longer does it: then delete this."""
    import accelerate.utils.other

    accelerate.utils.other.is_deepspeed_available = lambda: False


RESTART_SCHEME = "finetune-attempt"


def restart_init_method() -> str | None:
    """Workaround (torch 2.13's elastic agent, pytorch/pytorch#135712): the process group's rendezvous in a store of
    this attempt's own (None, env:// as usual, outside torchrun).

    torchrun's agent hosts the TCP store every worker rendezvouses in (TORCHELASTIC_USE_AGENT_STORE), and with
    `--max_restarts` keeps that one store for every attempt: the restarted workers find the previous attempt's
    keys, gloo's address of every rank among them, and a rank that reads its peer's key before the peer rewrites it
    connects to a dead port ("connectFullMesh failed ... Connection refused"; every restart failed so, here). The
    scheme below is env:// with the store behind a prefix of the attempt (TORCHELASTIC_RESTART_COUNT), so every group
    of an attempt, the default one and those made by new_group, is found only by that attempt's ranks. (On several
    machines each agent counts its own restarts; they agree when a failure restarts every machine's ranks, as it
    does when a rank dies and its peers' collectives fail.)
    tests/test_faults.py::test_torchrun_still_shares_one_store_across_restarts fails once torch separates attempts
    itself, and then the prefix can go; the join (await_join), which this rendezvous also holds, stays."""
    if not Launcher.read().agent_store:
        return None
    from torch.distributed.rendezvous import register_rendezvous_handler

    try:
        register_rendezvous_handler(RESTART_SCHEME, _attempt_rendezvous)
    except RuntimeError:  # registered already (a second Accelerator in this process)
        pass
    return f"{RESTART_SCHEME}://"


def collective_timeout(train) -> int:
    """Seconds a collective waits for the other ranks (ddp_timeout; 1800 on GPU, 600 on CPU by default)."""
    return train.ddp_timeout or (1800 if has_accelerator_device() else 600)


def start_process_group(train, cpu: bool | None = None):
    """Start the ranks' process group as the Accelerator would, with every value passed: gloo without a GPU,
    collectives that wait collective_timeout, each launcher restart's own rendezvous keys (restart_init_method).
    The Accelerator made next finds it started (accelerate's state is shared).

    Workaround (accelerate 1.15): given as InitProcessGroupKwargs, the timeout was dropped where it equals the
    class's default, which is nccl's (KwargsHandler.to_kwargs keeps only what differs from it): gloo's 600 s, the
    CPU default, never reached torch and the ranks waited torch's 1800 s; DeepSpeed on GPUs got its own 30 minutes
    for ddp_timeout 600. tests/test_faults.py::test_accelerate_still_drops_a_timeout_equal_to_its_default fails
    once accelerate compares with the backend's own default. cpu: PartialState's (default: as the Accelerator
    reads it, ACCELERATE_USE_CPU). Returns the PartialState."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    kwargs = {"timeout": datetime.timedelta(seconds=collective_timeout(train))}
    if not has_accelerator_device():
        kwargs["backend"] = "gloo"
    init_method = restart_init_method()
    if init_method is not None:
        kwargs["init_method"] = init_method
    return PartialState(parse_flag_from_env("ACCELERATE_USE_CPU") if cpu is None else cpu, **kwargs)


def _attempt_rendezvous(url: str, **kwargs):
    """env:// (rank, world size and the store from torchrun's environment), the store behind the attempt's prefix;
    it returns once every rank has joined (await_join)."""
    from urllib.parse import urlparse

    store, rank, world_size = _attempt_store(f"env://?{urlparse(url).query}", **kwargs)
    await_join(store, rank, world_size, kwargs.get("timeout") or datetime.timedelta(seconds=600))
    yield store, rank, world_size


def _attempt_store(url: str = "env://", **kwargs):
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous(url, **kwargs))
    return dist.PrefixStore(f"finetune/attempt_{Launcher.read().restart}", store), rank, world_size


class NeverJoined(Exception):
    """Ranks that never came to start the process group within ddp_timeout."""


JOIN_POLL_S = 0.5


def await_join(store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """Every rank announces itself in the rendezvous store and waits there for the others, before the process
    group (whose own wait, in gloo's or nccl's setup, ends after the same timeout in a store error per rank that
    names a key, not a rank). torchrun starts every machine's ranks together, so a rank that is missing has stopped
    or is stuck before its start: a rank that refused its run config (on its machine only: a data file missing
    there) says so in the store (tell_waiting_ranks), and the others stop at once with its problems (ConfigError);
    a rank that never comes is named after `timeout` (ddp_timeout; NeverJoined)."""
    if world_size <= 1:
        return
    store.set(f"joined/{rank}", f"machine {Launcher.read().node} ({socket.gethostname()})")
    store.add("joined", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add("joined", 0) < world_size:
        if store.check(["refused"]):
            refusal = json.loads(store.get("refused"))
            where = f"on machine {refusal['machine']} ({refusal['host']}), rank {refusal['rank']}"
            raise ConfigError([(key, f"{where}: {message}") for key, message in refusal["problems"]])
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
            ranks = ", ".join(map(str, missing))
            raise NeverJoined(
                f"rank{'s' * (len(missing) > 1)} {ranks} of {world_size} never came to start the run within "
                f"{timeout.total_seconds():.0f} s (ddp_timeout): {'they' if len(missing) > 1 else 'it'} stopped or "
                "hung before its start; see the output of the launch on "
                f"{'their machines' if len(missing) > 1 else 'its machine'} (every machine's launcher prints its "
                "ranks' messages)"
            )
        time.sleep(JOIN_POLL_S)


def tell_waiting_ranks(error: ConfigError) -> None:
    """A rank that refuses its run config before the process group started: its problems into the rendezvous
    store, where the ranks of the other machines, which may have accepted theirs, wait to join (await_join) and
    would otherwise wait ddp_timeout for it. Best effort, under torchrun only (its agent hosts the store); the
    refusal itself is already said."""
    import torch.distributed as dist

    launcher = Launcher.read()
    if not launcher.agent_store or launcher.world_size <= 1 or dist.is_initialized():
        return
    try:
        store, rank, _ = _attempt_store(timeout=datetime.timedelta(seconds=10))
        refusal = {"rank": rank, "machine": launcher.node, "host": socket.gethostname(), "problems": error.problems}
        store.compare_set("refused", "", json.dumps(refusal))  # the first refusal stays (a waiting rank's repeats it)
    except Exception:  # the store is gone (its host stopped too): no one is waiting there
        pass


def save_from_this_process(net, directory: str, **kwargs) -> None:
    """net.save_pretrained(directory, **kwargs), written by the process that calls it.

    Workaround (transformers 5.23): save_pretrained writes only on torch.distributed's rank 0
    (distributed/mixin.py should_save_on_this_rank), whatever its is_main_process says. accelerate's main process
    is the last rank under Megatron-LM, so its final/ got the tokenizer and no weights or config.
    tests/test_megatron.py::test_transformers_still_saves_on_rank_0_only fails once transformers leaves the
    choice to the caller."""
    net.should_save_on_this_rank = lambda is_main_process: is_main_process  # on this instance, for this call
    try:
        net.save_pretrained(directory, **kwargs)
    finally:
        del net.should_save_on_this_rank


def unwrap(accelerator, model):
    """The model inside accelerate's wrappers (DDP, DeepSpeed's engine, FSDP, torch_compile's compiled regions):
    the transformers (or PEFT) model whose parameters, config and save_pretrained are the run's. Not accelerate's
    default (keep_torch_compile=True), which under regional compilation hands back the compiled copy of the
    outermost wrapper: the DDP object itself under DDP."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def no_checkpoints_per_machine(why: str) -> ConfigError:
    """The refusal of a backend whose checkpoints cannot be kept complete on each machine."""
    return ConfigError(
        [
            (
                "output_dir",
                f"is not shared between the machines, and {why}; put output_dir on a filesystem every machine "
                "mounts (NFS, Lustre, a cluster share), or use a DDP or DeepSpeed config (multinode_ddp.yaml, "
                "multinode_zero3.yaml), which keep a complete checkpoint on every machine",
            )
        ]
    )


def qlora_refused(layout: str, why: str) -> tuple[str, str]:
    """peft.load_in_4bit refused under a layout that shards the base weights: why, and the layouts that run it."""
    return (
        "peft.load_in_4bit",
        f"QLoRA does not run under {layout} here: {why}; use accelerate_configs/ddp.yaml or zero2.yaml (the 4-bit "
        "base is small: an adapter's optimizer state is what shards), or set peft.load_in_4bit: false",
    )


def parallelism_size_problems(launcher: Launcher) -> list[tuple[str, str]]:
    """A parallelism_config size under 1, refused under every family: accelerate 1.15 builds a ParallelismConfig
    whenever the launch has a parallelism_config (Accelerator.__init__: ACCELERATE_USE_PARALLELISM_CONFIG), and its
    __post_init__ raises for such a size (parallelism_config.py: "must be at least 1"); accelerate's launcher passes
    any integer on (utils/launch.py prepare_extend_env_parallelism_config)."""
    return [
        (
            f"parallelism_config_{dim}_size",
            f"is {size}; a parallelism_config size must be a whole number >= 1 (accelerate refuses it at "
            "Accelerator()): set the size you mean, or leave the key out (1: that dimension is not used)",
        )
        for dim in PARALLELISM_DIMS
        if (size := launcher.parallelism(dim)) < 1
    ]


def sequence_split_problems(launcher: Launcher) -> list[tuple[str, str]]:
    """Context and sequence parallelism in the Accelerate config's parallelism_config, refused under every family:
    accelerate 1.15 gives the ranks of such a group one batch (cp: outside DeepSpeed), split along the sequence only
    where the training script asks, and finetune counts ranks as data parallel (each its own batch) or as
    tensor-parallel copies (each the whole batch), so its losses, token counts and eval would count each batch
    several times over, or in part.
    - cp_size: prepare_data_loader gives the cp ranks one batch (data_loader.py: process_index // (tp x cp); not
      under DeepSpeed, whose loaders shard by "tp" only); the split is Accelerator.maybe_context_parallel's, a
      context finetune's loop never enters, and _prepare_cp's hooks drop every self_attn's attention mask for
      is_causal (big_modeling._attach_context_parallel_hooks), under every backend.
    - sp_size: under DeepSpeed, Ulysses (Accelerator._prepare_deepspeed) wraps each loader in DeepSpeed's
      UlyssesSPDataLoaderAdapter, which deals the group one batch, a slice of its sequence to each rank; elsewhere
      accelerate builds no device mesh for it (ParallelismConfig.build_device_mesh) and it does nothing."""
    out = []
    cp, sp = launcher.parallelism("cp"), launcher.parallelism("sp")
    if cp > 1:
        why = (
            f"is {cp}: context parallelism, which finetune does not run. accelerate 1.15 splits a batch's sequence "
            "over the cp ranks only inside accelerator.maybe_context_parallel, which finetune's loop does not enter, "
            "yet its hooks drop the attention masks of every self_attn (is_causal instead), and its loaders (all but "
            f"DeepSpeed's) give the {cp} ranks of a group the same batches, which finetune would count as batches of "
            "their own (losses, token counts and eval miscounted)"
        )
        fix = (
            "set parallelism_config_cp_size: 1 (or leave it out), with its ranks in parallelism_config_dp_shard_size "
            "or not launched; for long sequences use gradient_checkpointing: true, or tensor parallelism "
            "(accelerate_configs/tp2_fsdp2.yaml)"
        )
        out.append(("parallelism_config_cp_size", f"{why}; {fix}"))
    if sp > 1:
        why = (
            f"is {sp}: sequence parallelism (DeepSpeed's Ulysses), which finetune does not run. Under DeepSpeed "
            f"accelerate 1.15 deals each batch to the {sp} ranks of a group, a slice of its sequence to each, which "
            "finetune's losses, token counts and eval do not know; under the other backends it does nothing"
        )
        fix = "set parallelism_config_sp_size: 1 (or leave it out); for long sequences use gradient_checkpointing: true"
        out.append(("parallelism_config_sp_size", f"{why}; {fix}"))
    return out


def prepare_all(accelerator, model, optimizer, train_loader, eval_loader, scheduler) -> tuple:
    """One accelerate.prepare call for everything (Megatron-LM needs that); eval_loader may be None."""
    objects = [model, optimizer, train_loader, scheduler] + ([eval_loader] if eval_loader is not None else [])
    prepared = accelerator.prepare(*objects)
    model, optimizer, train_loader, scheduler = prepared[:4]
    return model, optimizer, train_loader, prepared[4] if eval_loader is not None else None, scheduler


def for_export(net, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights final/ holds: every floating-point tensor in dtype (integer buffers stay as they are), and a tied
    weight once, under the name from_pretrained ties the others to (transformers' all_tied_weights_keys, target ->
    source: lm_head.weight -> model.embed_tokens.weight under tie_word_embeddings). save_pretrained drops a tied
    copy only where it shares the source's storage, which a cast or a gather of full tensors (FSDP2's, TP's)
    undoes: final/ got a second lm_head.weight that a one-process fp32 export has not. (An adapter's state dict has
    its names under base_model.model.: none is a target here, and PEFT keeps only the adapter's tensors.)"""
    tied = getattr(net, "all_tied_weights_keys", None) or {}
    copies = {target for target, source in tied.items() if target in weights and source in weights}
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items() if k not in copies}


def trainable_parameters(net) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in net.named_parameters() if p.requires_grad}


def copy_by_name(named: dict, weights: dict) -> None:
    with torch.no_grad():
        for n, w in weights.items():
            named[n].copy_(w.to(named[n].dtype))


def local_fraction(params: Iterable[torch.nn.Parameter], numel) -> float:
    """Share of the model's parameters this rank holds in memory (1.0: a whole copy)."""
    total = local = 0
    for p in params:
        total += numel(p)
        local += local_numel(p)
    return round(local / max(total, 1), 4)


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank really stores: a DTensor's local shard, a ZeRO-3 partition, or the tensor."""
    if hasattr(p, "to_local"):
        return p.to_local().numel()
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel()
    return p.numel()
