"""Topology: how a run is spread over processes and machines, read once, and read here only.

The three sources of layout facts are read in this module and nowhere else:
  the launcher's environment   `Launcher.read` (before the Accelerator exists: `accelerate launch` turns the
                               Accelerate config into ACCELERATE_USE_* / PARALLELISM_CONFIG_* / MEGATRON_LM_*
                               variables; torchrun adds the ranks); `requested_family` is its family
  the started Accelerator      `Topology.read`: the sizes the run really has
  an Accelerate config file    `read_config_file` and `launch_size` (finetune plan, finetune parity), without
                               launching anything
Every other module asks the Topology (`dp`, `tp`, `replicas`, `zero_stage`, ...) or the Launcher instead of
accelerate's `distributed_type` or the environment. A Topology checks itself when it is made (`__post_init__`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from finetune.config.schema import ConfigError

# The backend families, one module each under finetune/parallel/.
FAMILIES = ("ddp", "deepspeed", "fsdp", "tensor", "megatron")


def _true(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    """An integer the launcher set; `default` when it set none (or an empty string)."""
    value = env.get(key)
    return default if value is None or value == "" else int(value)


def _first(env: Mapping[str, str], keys: tuple[str, ...], default: int | None = None) -> int | None:
    """The first of keys the launcher set, as an integer (launchers name the same fact differently)."""
    return next((v for v in (_int(env, k) for k in keys) if v is not None), default)


# Each fact as each launcher names it: torchrun (accelerate's multi-GPU and DeepSpeed `standard` launchers),
# DeepSpeed's launch.py (run on each node by its pdsh and nossh launchers; its mpich and impi runners set LOCAL_SIZE
# too), then MPI's own (DeepSpeed's openmpi, mvapich and mpich launchers; accelerate reads the same names in
# utils/environment.py get_cpu_distributed_information).
RANK_KEYS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
LOCAL_SIZE_KEYS = (
    "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"
)  # fmt: skip
# The Accelerate config's DeepSpeed keys (inline, or `accelerate launch --<key>`) as accelerate's launcher passes them
DEEPSPEED_KEYS = {
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
}
# The sizes of accelerate 1.15's ParallelismConfig (parallelism_config_<dim>_size in an Accelerate config): data
# parallel replicated (HSDP) and sharded (FSDP), tensor, context and sequence parallel (DeepSpeed's Ulysses)
PARALLELISM_DIMS = ("tp", "dp_replicate", "dp_shard", "cp", "sp")
NODE_KEYS = ("GROUP_RANK", "CROSS_RANK")  # torchrun's, DeepSpeed launch.py's index of this machine
MACHINES_KEYS = ("ACCELERATE_NUM_MACHINES", "CROSS_SIZE")


def deepspeed_offload_devices(zero: Mapping) -> tuple[str, str]:
    """Where (optimizer states, parameters) are offloaded ("none", "cpu", "nvme"), from a DeepSpeed config's
    zero_optimization section."""
    return tuple(
        str((zero.get(key) or {}).get("device") or "none").lower() for key in ("offload_optimizer", "offload_param")
    )


def deepspeed_offloads(zero: Mapping) -> tuple[bool, bool]:
    """(optimizer states, parameters) offloaded, from a DeepSpeed config's zero_optimization section."""
    return tuple(device != "none" for device in deepspeed_offload_devices(zero))


# ---------------------------------------------------------------- the launcher's environment, before the Accelerator


@dataclass(frozen=True)
class Launcher:
    """What the launcher put in this process's environment, read here and nowhere else: `accelerate launch` turns
    the Accelerate config into ACCELERATE_USE_* / PARALLELISM_CONFIG_* / MEGATRON_LM_* variables (accelerate's
    utils/launch.py), torchrun adds the ranks (RANK, LOCAL_RANK, GROUP_RANK, ...), DeepSpeed's launch.py and MPI
    name some of them otherwise (RANK_KEYS, LOCAL_SIZE_KEYS, NODE_KEYS, MACHINES_KEYS). Read afresh
    at each call (`read`): a family's `environment` may set variables (ACCELERATE_USE_CPU) before others read them."""

    torchrun_world_size: int | None  # WORLD_SIZE
    mpi_world_size: int | None  # OMPI_COMM_WORLD_SIZE, else PMI_SIZE
    rank: int  # RANK_KEYS (0 without a launcher)
    local_rank: int | None  # LOCAL_RANK
    local_world_size: int | None  # LOCAL_SIZE_KEYS: processes on this machine
    group_rank: int | None  # NODE_KEYS: the launcher's index of this machine
    num_machines: int  # MACHINES_KEYS (0: not said)
    use_cpu: bool  # ACCELERATE_USE_CPU: `accelerate launch --cpu`, or a CPU rank (ddp.environment)
    use_deepspeed: bool  # ACCELERATE_USE_DEEPSPEED
    deepspeed_config_file: str | None  # ACCELERATE_DEEPSPEED_CONFIG_FILE: the DeepSpeed JSON
    # ACCELERATE_DEEPSPEED_<ZERO_STAGE|OFFLOAD_OPTIMIZER_DEVICE|OFFLOAD_PARAM_DEVICE|ZERO3_SAVE_16BIT_MODEL> and
    # ACCELERATE_GRADIENT_<ACCUMULATION_STEPS|CLIPPING>, by the Accelerate config's key (the inline `deepspeed_config`
    # keys of `accelerate config`, or `accelerate launch` flags): what accelerate's DeepSpeedPlugin fills the JSON from
    deepspeed_keys: Mapping[str, str]
    use_fsdp: bool  # ACCELERATE_USE_FSDP
    fsdp_version: int  # FSDP_VERSION (1 where unset, as accelerate's FSDP plugin reads it)
    use_parallelism_config: bool  # ACCELERATE_USE_PARALLELISM_CONFIG
    parallelism_sizes: Mapping[str, int]  # PARALLELISM_CONFIG_<TP|DP_REPLICATE|DP_SHARD|CP|SP>_SIZE (1: not said)
    use_megatron: bool  # ACCELERATE_USE_MEGATRON_LM
    megatron_tp: int  # MEGATRON_LM_TP_DEGREE (the defaults are MegatronLMPlugin.__post_init__'s)
    megatron_pp: int  # MEGATRON_LM_PP_DEGREE
    megatron_micro_batches: int  # MEGATRON_LM_NUM_MICRO_BATCHES
    megatron_sequence_parallel: bool  # MEGATRON_LM_SEQUENCE_PARALLELISM
    megatron_distributed_optimizer: bool  # MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER
    megatron_uneven_last_stage: bool  # MEGATRON_LM_DECODER_LAST_PIPELINE_NUM_LAYERS is set
    agent_store: bool  # TORCHELASTIC_USE_AGENT_STORE: torchrun's agent hosts the store the ranks rendezvous in
    restart: int  # TORCHELASTIC_RESTART_COUNT: the times torchrun restarted this machine's ranks (--max_restarts)
    max_restarts: int  # TORCHELASTIC_MAX_RESTARTS
    run_id: str | None  # TORCHELASTIC_RUN_ID: the job's rendezvous id (--rdzv_id; "none" where not given)

    @classmethod
    def read(cls, env: Mapping[str, str] = os.environ) -> Launcher:
        mpi = _int(env, "OMPI_COMM_WORLD_SIZE")
        return cls(
            torchrun_world_size=_int(env, "WORLD_SIZE"),
            mpi_world_size=mpi if mpi is not None else _int(env, "PMI_SIZE"),
            rank=_first(env, RANK_KEYS, 0),
            local_rank=_int(env, "LOCAL_RANK"),
            local_world_size=_first(env, LOCAL_SIZE_KEYS),
            group_rank=_first(env, NODE_KEYS),
            num_machines=_first(env, MACHINES_KEYS, 0),
            use_cpu=_true(env.get("ACCELERATE_USE_CPU", "")),
            use_deepspeed=_true(env.get("ACCELERATE_USE_DEEPSPEED")),
            deepspeed_config_file=env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
            deepspeed_keys={k: env[v] for k, v in DEEPSPEED_KEYS.items() if v in env},
            use_fsdp=_true(env.get("ACCELERATE_USE_FSDP")),
            fsdp_version=_int(env, "FSDP_VERSION", 1),
            use_parallelism_config=_true(env.get("ACCELERATE_USE_PARALLELISM_CONFIG")),
            parallelism_sizes={k: _int(env, f"PARALLELISM_CONFIG_{k.upper()}_SIZE", 1) for k in PARALLELISM_DIMS},
            use_megatron=_true(env.get("ACCELERATE_USE_MEGATRON_LM")),
            megatron_tp=_int(env, "MEGATRON_LM_TP_DEGREE", 1),
            megatron_pp=_int(env, "MEGATRON_LM_PP_DEGREE", 1),
            megatron_micro_batches=_int(env, "MEGATRON_LM_NUM_MICRO_BATCHES", 1),
            megatron_sequence_parallel=_true(env.get("MEGATRON_LM_SEQUENCE_PARALLELISM", "False")),
            megatron_distributed_optimizer=_true(env.get("MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER")),
            megatron_uneven_last_stage="MEGATRON_LM_DECODER_LAST_PIPELINE_NUM_LAYERS" in env,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
            run_id=env.get("TORCHELASTIC_RUN_ID"),
        )

    @property
    def world_size(self) -> int:
        """Processes in the job, as the launcher says (torchrun, deepspeed, MPI); 1 without a launcher."""
        if self.torchrun_world_size is not None:
            return self.torchrun_world_size
        return self.mpi_world_size if self.mpi_world_size is not None else 1

    @property
    def distributed(self) -> bool:
        """Started by a launcher that runs several processes (or sets a local rank)."""
        return self.world_size > 1 or (self.local_rank if self.local_rank is not None else -1) != -1

    def parallelism(self, dim: str) -> int:
        """A size of the Accelerate config's parallelism_config (one of PARALLELISM_DIMS), as accelerate's
        ParallelismConfig reads it from the environment; 1 where the launch has no parallelism_config (accelerate
        then builds none: Accelerator.__init__ reads ACCELERATE_USE_PARALLELISM_CONFIG)."""
        return self.parallelism_sizes[dim] if self.use_parallelism_config else 1

    @property
    def tp_size(self) -> int:
        """torch-native tensor-parallel degree from the Accelerate config's parallelism_config."""
        return self.parallelism("tp")

    @property
    def family(self) -> str:
        """Which backend family the launcher asked for (one of FAMILIES)."""
        if self.use_megatron:
            return "megatron"
        if self.use_deepspeed:
            return "deepspeed"
        if self.use_fsdp:
            return "fsdp"
        if self.tp_size > 1:
            return "tensor"
        return "ddp"  # one process or DDP: accelerate's NO / MULTI_CPU / MULTI_GPU

    @property
    def node(self) -> int:
        """This process's machine: as the launcher says; else from the ranks (MPI places consecutive ranks on a
        machine); 0 where nothing says how many run on a machine (then machines() is 1)."""
        if self.group_rank is not None:
            return self.group_rank
        return self.rank // self.local_world_size if self.local_world_size else 0

    def machines(self, num_processes: int) -> int:
        """Machines of a job of num_processes: as the launcher says, else from the processes per machine."""
        local = self.local_world_size if self.local_world_size is not None else num_processes
        return self.num_machines or max(1, num_processes // max(1, local))


def requested_family(env: Mapping[str, str] = os.environ) -> str:
    """Which backend family the launcher asked for (before the Accelerator exists)."""
    return Launcher.read(env).family


@dataclass(frozen=True)
class Topology:
    """The sizes and sharding of a run. `dp` x `tp` x `pp` = `num_processes`."""

    family: str  # one of FAMILIES
    distributed_type: str  # accelerate's name for it (NO, MULTI_CPU, MULTI_GPU, DEEPSPEED, FSDP, MEGATRON_LM)
    num_processes: int
    num_machines: int
    process_index: int
    dp: int = 1  # data-parallel size: ranks that hold different batches
    dp_rank: int = 0
    # HSDP (FSDP2 with parallelism_config_dp_replicate_size): of the dp ranks, how many groups each hold a whole
    # copy of the model, sharded over the group's dp_shard ranks (dp = dp_replicate x dp_shard)
    dp_replicate: int = 1
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    num_micro_batches: int = 1  # Megatron-LM: pipeline micro batches per optimizer step
    zero_stage: int = 0  # DeepSpeed ZeRO stage (0: not DeepSpeed)
    fsdp_version: int = 0  # 0: not FSDP
    offload_optimizer: bool = False  # optimizer states (and step) on the CPU
    offload_params: bool = False  # parameters on the CPU between uses
    distributed_optimizer: bool = False  # Megatron-LM: optimizer states sharded over the data-parallel ranks
    offload_to: tuple[str, str] = ("cpu", "cpu")  # where offloaded (optimizer states, parameters) live: cpu or nvme

    @property
    def replicas(self) -> int:
        """Ranks that hold each batch (a TP x PP group): a sum over all ranks counts every batch this often."""
        return self.num_processes // self.dp

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks that split one copy of the model between them (FSDP2's dp_shard): dp, less HSDP's
        replicas. accelerate 1.15 shards over the mesh's ("dp_replicate", "dp_shard_cp") dimensions
        (utils/fsdp_utils.py fsdp2_prepare_model: parallelism_config.fsdp_dim_names), which fully_shard reads as
        replicate over the first, shard over the second."""
        return self.dp // self.dp_replicate

    @property
    def shards_parameters(self) -> bool:
        """Parameters are split over ranks (ZeRO-3, FSDP, TP, Megatron)."""
        return self.zero_stage == 3 or self.fsdp_version > 0 or self.tp > 1 or self.pp > 1

    @property
    def transformers_forward(self) -> bool:
        """The model trains and evaluates through its transformers forward (finetune's loss forward where it is a
        plain-head causal LM: chunked_loss); Megatron-LM runs its own GPT and loss."""
        return self.family != "megatron"

    def rows_per_micro_batch(self, per_device_train_batch_size: int) -> int:
        """Rows a data-parallel rank's loader yields per micro batch (Megatron: x num_micro_batches)."""
        return per_device_train_batch_size * self.num_micro_batches

    def layout(self) -> dict:
        """What a checkpoint records about the run that wrote it (a resume under another layout converts)."""
        out = asdict(self)
        out.pop("process_index"), out.pop("dp_rank"), out.pop("offload_to")  # (where offloaded state lives: not)
        out["world_size"] = out.pop("num_processes")
        if self.family != "fsdp":  # (HSDP is FSDP2's; other families' layouts, and their checkpoints, never had it)
            out.pop("dp_replicate")
        if self.family != "megatron":  # (the layouts of other families, and their checkpoints, never had it)
            out.pop("distributed_optimizer")
        return out

    @property
    def needs_gpu(self) -> bool:
        """Megatron-LM runs on NVIDIA GPUs only (megatron.core calls CUDA throughout; tests use a stand-in)."""
        return self.family == "megatron"

    def spread(self) -> dict:
        """How the run is spread, as the start log, every metrics row and the trackers say it."""
        return {"world_size": self.num_processes, "distributed_type": self.distributed_type}

    def summary(self) -> str:
        """One line for the start log."""
        parts = [f"{self.family}"]
        if self.zero_stage:
            parts.append(f"ZeRO-{self.zero_stage}")
        if self.fsdp_version:
            parts.append(f"FSDP{self.fsdp_version}")
        offloaded = zip(("optimizer", "parameters"), (self.offload_optimizer, self.offload_params), self.offload_to)
        to: dict[str, list[str]] = {}
        for what, on, device in offloaded:
            if on:
                to.setdefault("NVMe" if device == "nvme" else "CPU", []).append(what)
        if to:
            parts.append("offload " + ", ".join(f"{'+'.join(what)} to {device}" for device, what in to.items()))
        hsdp = f" ({self.dp_replicate} replicas x {self.dp_shard} shards)" if self.dp_replicate > 1 else ""
        sizes = f"data parallel {self.dp}{hsdp} x tensor {self.tp} x pipeline {self.pp}"
        return f"{', '.join(parts)}; {sizes} on {self.num_machines} machine(s)"

    def __post_init__(self) -> None:
        """What holds for every topology, read from a started run or from an Accelerate config file."""
        sizes = {"num_processes": self.num_processes, "num_machines": self.num_machines, "dp": self.dp}
        sizes |= {"tp": self.tp, "pp": self.pp, "num_micro_batches": self.num_micro_batches}
        sizes |= {"dp_replicate": self.dp_replicate}
        wrong = [f"{k} {v}" for k, v in sizes.items() if v < 1]
        if self.dp_replicate > 1 and (self.family != "fsdp" or self.dp % self.dp_replicate):
            wrong.append(f"dp_replicate {self.dp_replicate} of data parallel {self.dp} under {self.family}")
        if self.family not in FAMILIES:
            wrong.append(f"family {self.family!r} (one of {', '.join(FAMILIES)})")
        if not 0 <= self.process_index < self.num_processes or not 0 <= self.dp_rank < self.dp:
            wrong.append(f"process {self.process_index} of {self.num_processes}, data-parallel rank {self.dp_rank}")
        if self.zero_stage not in (0, 1, 2, 3) or (self.zero_stage and self.family != "deepspeed"):
            wrong.append(f"ZeRO stage {self.zero_stage} under {self.family}")
        if self.fsdp_version and self.family != "fsdp":
            wrong.append(f"FSDP{self.fsdp_version} under {self.family}")
        if self.distributed_optimizer and self.family != "megatron":
            wrong.append(f"Megatron-LM's distributed optimizer under {self.family}")
        if wrong:
            raise ValueError(f"not a topology: {'; '.join(wrong)}")

    @classmethod
    def read(cls, accelerator, env: Mapping[str, str] = os.environ) -> Topology:
        """The topology of a started Accelerator (reads accelerate's state and plugins, and the launcher's
        environment for Megatron-LM's layout; not config files). Its sizes multiply to the processes."""
        state, launcher = accelerator.state, Launcher.read(env)
        family = launcher.family
        n, rank = accelerator.num_processes, accelerator.process_index
        kw: dict = {}
        if family == "deepspeed":
            plugin = state.deepspeed_plugin
            zero = plugin.deepspeed_config.get("zero_optimization", {})
            optimizer, params = deepspeed_offloads(zero)
            kw.update(zero_stage=int(plugin.zero_stage), offload_optimizer=optimizer, offload_params=params)
            kw.update(offload_to=deepspeed_offload_devices(zero))
        elif family == "fsdp":
            plugin = state.fsdp_plugin
            offload = fsdp_offloads(plugin)  # FSDP's CPU offload moves parameters, gradients and optimizer states
            kw.update(fsdp_version=int(plugin.fsdp_version), offload_params=offload, offload_optimizer=offload)
        if family == "megatron":
            tp, pp = launcher.megatron_tp, launcher.megatron_pp
            # Megatron's rank order tp-cp-ep-dp-pp: rank = tp_rank + tp * (dp_rank + dp * pp_rank)
            dp = n // (tp * pp)
            kw.update(tp=tp, pp=pp, num_micro_batches=launcher.megatron_micro_batches, dp=dp, dp_rank=(rank // tp) % dp)
            kw.update(distributed_optimizer=launcher.megatron_distributed_optimizer)
        else:
            pc = getattr(accelerator, "parallelism_config", None)
            tp = pc.tp_size if pc is not None and pc.tp_enabled else 1
            if pc is not None and pc.non_data_parallel_size != tp:  # the families' problems() refuse cp and sp first
                raise ValueError(f"cp_size {pc.cp_size}, sp_size {pc.sp_size}: ranks splitting one batch, not counted")
            # accelerate's mesh: dp_replicate, dp_shard, tp (innermost); its loaders give rank r the batches of
            # r // tp among dp_replicate x dp_shard = n / tp data-parallel ranks (HSDP included)
            kw.update(tp=tp, dp=n // tp, dp_rank=rank // tp)
            if family == "fsdp" and pc is not None:  # HSDP: fsdp.problems refused a mesh without dp_shard ranks
                kw.update(dp_replicate=pc.dp_replicate_size)
        topology = cls(
            family=family,
            distributed_type=distributed_type_name(state),
            num_processes=n,
            num_machines=launcher.machines(n),
            process_index=rank,
            **kw,
        )
        if topology.dp * topology.tp * topology.pp != n:
            raise ValueError(
                f"{n} processes are not data parallel {topology.dp} x tensor {topology.tp} x pipeline "
                f"{topology.pp} ({topology.summary()})"
            )
        return topology


def fsdp_offloads(plugin) -> bool:
    """Whether accelerate's FSDP plugin keeps parameters on the CPU (FSDP2: a CPUOffloadPolicy; FSDP1:
    CPUOffload(offload_params=True)); its default is an OffloadPolicy that offloads nothing."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = plugin.cpu_offload
    return isinstance(policy, CPUOffloadPolicy) or bool(getattr(policy, "offload_params", False))


def distributed_type_name(state) -> str:
    """accelerate's DistributedType of a started AcceleratorState, by name (NO, MULTI_CPU, DEEPSPEED, ...)."""
    return str(state.distributed_type).split(".")[-1]


def describe_layout(layout: dict) -> str:
    """A checkpoint's recorded layout in words: "DEEPSPEED ZeRO-3 on 2 process(es)", "MEGATRON_LM TP 2 x PP 1 x DP 1,
    distributed optimizer, mixed precision bf16 on 2 process(es)", "FSDP FSDP2 HSDP (2 replicas x 2 shards) on 4
    process(es)" (HSDP named: a resume from it under fsdp2.yaml on as many processes converts, and the words must say
    from what)."""
    detail = [f"ZeRO-{layout['zero_stage']}" if layout.get("zero_stage") else ""]
    detail += [f"FSDP{layout['fsdp_version']}" if layout.get("fsdp_version") else ""]
    if layout.get("family") == "megatron":
        detail += [f"TP {layout['tp']} x PP {layout['pp']} x DP {layout['dp']}"]
        detail += [", distributed optimizer" if layout.get("distributed_optimizer") else ""]
        detail += [f", mixed precision {layout['mixed_precision']}" if "mixed_precision" in layout else ""]
    else:
        detail += [f"TP {layout['tp']}" if layout.get("tp", 1) > 1 else ""]
        replicas = layout.get("dp_replicate", 1)
        detail += [f"HSDP ({replicas} replicas x {layout['dp'] // replicas} shards)" if replicas > 1 else ""]
    what = " ".join([layout["distributed_type"], *[d for d in detail if d]]).replace(" ,", ",")
    return f"{what} on {layout['world_size']} process(es)"


# A recorded layout's entries, by the Accelerate config key (or `accelerate launch` flag) that sets them.
ACCELERATE_KEYS = {
    "world_size": "num_processes",
    "tp": "megatron_lm_tp_degree",
    "pp": "megatron_lm_pp_degree",
    "dp": "the data-parallel size (num_processes / (TP x PP))",
    "num_micro_batches": "megatron_lm_num_micro_batches",
    "distributed_optimizer": "megatron_lm_use_distributed_optimizer",
}


def native_layout_changes(was: Mapping, here: Mapping) -> list[str]:
    """What differs between the layout a checkpoint in a backend's own format (Megatron-LM's) was written under and
    this run's, each named by the Accelerate config key that sets it: "megatron_lm_use_distributed_optimizer is True
    in the checkpoint, False now"."""
    keys = [k for k in dict.fromkeys([*was, *here]) if k not in ("checkpoint_format", "global_batch_size")]
    return [
        f"{ACCELERATE_KEYS.get(k, k)} is {was.get(k)} in the checkpoint, {here.get(k)} now"
        for k in keys
        if was.get(k) != here.get(k)
    ]


def describe_observed(row: dict) -> str:
    """What a metrics row says the backend really did, e.g. "ZeRO-3 offload 0.50" (0.50: the share of the
    model's parameters a rank holds)."""
    parts = [f"ZeRO-{row['zero_stage']}" if row.get("zero_stage") else ""]
    parts += [f"FSDP{row['fsdp_version']}" if row.get("fsdp_version") else ""]
    parts += ["offload" if row.get("offload_optimizer") or row.get("offload_params") else ""]
    parts += [f"{row['parameter_shard']:.2f}" if "parameter_shard" in row else ""]
    return " ".join(p for p in parts if p)


# ---------------------------------------------------------------- Accelerate config files, without launching

# The shipped Accelerate configs: the repository's accelerate_configs/ (and ds_configs/, the DeepSpeed JSON they
# name), reached through finetune/'s links to them in a checkout or an editable install, and copied into the package
# by a regular install (package data in pyproject.toml): the same path either way.
SHIPPED = Path(__file__).resolve().parents[1] / "accelerate_configs"


def shipped_by_name() -> dict[str, Path]:
    """Every shipped Accelerate config: name (ddp) -> file."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.yaml"))}


def accelerate_config_path(name: str, key: str = "--configs") -> Path:
    """A shipped config's name (ddp) or the path of an Accelerate config file; a ConfigError on `key` otherwise."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    shipped = shipped_by_name()
    if name not in shipped:
        names = ", ".join(shipped) or f"none found in {SHIPPED}: pass {key} FILE.yaml,..."
        raise ConfigError([(key, f"{name!r} is neither a file nor a shipped config ({names})")])
    return shipped[name]


def _config_yaml(path: Path) -> dict:
    """An Accelerate config file's keys, as `accelerate launch --config_file` reads them (an empty file: none)."""
    return yaml.safe_load(path.read_text()) or {}


def read_config_file(
    path: str | os.PathLike, num_processes: int | None = None, num_machines: int | None = None
) -> tuple[Topology, dict, str | None]:
    """(Topology, DeepSpeed JSON or {}, mixed precision) an Accelerate config file asks for, read like
    `accelerate launch` would (num_processes/num_machines as its flags override the file's). The mixed precision
    is None when the file says nothing (then the run config's mixed_precision decides)."""
    p = Path(path)
    raw = _config_yaml(p)
    n = int(num_processes or raw.get("num_processes", 1) or 1)
    machines = int(num_machines or raw.get("num_machines", 1) or 1)
    kind = str(raw.get("distributed_type", "NO"))
    mixed = str(raw["mixed_precision"]) if raw.get("mixed_precision") else None
    ds: dict = {}
    kw: dict = {}
    family = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp", "MEGATRON_LM": "megatron"}.get(kind, "ddp")
    if family == "deepspeed":
        ds, mixed = _deepspeed_file(raw, p, mixed, kw)
    elif family == "fsdp":
        fcfg = raw.get("fsdp_config") or {}
        offload = str(fcfg.get("fsdp_offload_params", False)).lower() == "true"
        kw.update(fsdp_version=int(fcfg.get("fsdp_version", 1)), offload_params=offload, offload_optimizer=offload)
    elif family == "megatron":
        mcfg = raw.get("megatron_lm_config") or {}
        tp, pp = int(mcfg.get("megatron_lm_tp_degree", 1)), int(mcfg.get("megatron_lm_pp_degree", 1))
        kw.update(tp=tp, pp=pp, num_micro_batches=int(mcfg.get("megatron_lm_num_micro_batches", 1)))
        distributed_optimizer = _true(mcfg.get("megatron_lm_use_distributed_optimizer", False))
        kw.update(distributed_optimizer=distributed_optimizer)
        ds = {"megatron_distributed_optimizer": distributed_optimizer}
    pc = raw.get("parallelism_config") or {}
    tp_size = int(pc.get("parallelism_config_tp_size", 1))
    if family in ("ddp", "fsdp") and tp_size > 1:
        family = family if family == "fsdp" else "tensor"
        kw["tp"] = tp_size
    dp = max(1, n // (kw.get("tp", 1) * kw.get("pp", 1)))
    replicas = int(pc.get("parallelism_config_dp_replicate_size", 1) or 1)
    if family == "fsdp" and replicas > 1 and dp % replicas == 0:  # HSDP (a layout fsdp.problems refuses: not here)
        kw["dp_replicate"] = replicas
    topo = Topology(
        family=family, distributed_type=kind, num_processes=n, num_machines=machines, process_index=0, dp=dp, **kw
    )
    return topo, ds, mixed


def deepspeed_json(path: str | os.PathLike) -> Path | None:
    """The DeepSpeed JSON an Accelerate config file names (None: none, or inline keys). A relative path is read from
    the folder above the config's (the shipped configs' accelerate_configs/ -> ds_configs/), not from wherever the
    command runs."""
    file = (_config_yaml(Path(path)).get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not file:
        return None
    return Path(file) if Path(file).is_absolute() else Path(path).resolve().parents[1] / file


def _deepspeed_file(raw: dict, path: Path, mixed: str | None, kw: dict) -> tuple[dict, str | None]:
    """A DeepSpeed config's JSON (its file, or the inline keys of `accelerate config`), its ZeRO stage and
    offloads (into kw), and the mixed precision its JSON enables when the YAML says none."""
    file_path = deepspeed_json(path)
    if file_path:
        ds = json.loads(file_path.read_text())
    else:  # inline keys of `accelerate config`
        dcfg = raw.get("deepspeed_config") or {}
        ds = {
            "zero_optimization": {
                "stage": dcfg.get("zero_stage", 2),
                "offload_optimizer": {"device": dcfg.get("offload_optimizer_device", "none")},
                "offload_param": {"device": dcfg.get("offload_param_device", "none")},
            }
        }
    zero = ds.get("zero_optimization", {})
    optimizer, params = deepspeed_offloads(zero)
    kw.update(zero_stage=int(zero.get("stage", 0)), offload_optimizer=optimizer, offload_params=params)
    kw.update(offload_to=deepspeed_offload_devices(zero))
    return ds, deepspeed_json_precision(ds) or mixed


def deepspeed_json_precision(ds: Mapping) -> str | None:
    """The 16-bit mode a DeepSpeed JSON enables itself ("enabled": true; "auto" is accelerate's to fill from the
    run's precision): bf16, fp16, or None. Such a JSON decides the run's precision (environment.set_mixed_precision):
    accelerate fills only "auto" values, and DeepSpeed then trains in that mode whatever else was said."""
    for key in ("bf16", "fp16"):
        if str((ds.get(key) or {}).get("enabled")).lower() == "true":
            return key
    return None


def launched_json_precision(launcher: Launcher) -> tuple[str | None, str | None]:
    """(deepspeed_json_precision, the JSON's path) of the DeepSpeed JSON this process was launched with; (None,
    None) without one, or where it cannot be read (deepspeed.problems says why)."""
    path = launcher.deepspeed_config_file if launcher.family == "deepspeed" else None
    try:
        with open(path or "") as f:
            return deepspeed_json_precision(json.load(f)), path
    except (OSError, json.JSONDecodeError, AttributeError):
        return None, None


def launch_size(path: str | os.PathLike, wanted: int) -> tuple[int, str]:
    """How many processes to launch an Accelerate config with on `wanted` devices, and why when it is not all of
    them; (0, why) when it cannot run there. A parallelism_config (TP alone, TP x FSDP2) makes a mesh of fixed size,
    which the launch must equal (fsdp.problems, tensor.problems); Megatron-LM needs a multiple of TP x PP; one
    process stays one."""
    raw = _config_yaml(Path(path))
    if int(raw.get("num_processes", 1) or 1) == 1 and str(raw.get("distributed_type", "NO")) == "NO":
        return 1, "1 process"
    pc = raw.get("parallelism_config") or {}
    mcfg = raw.get("megatron_lm_config") or {}
    if pc:
        sizes = {k: int(pc.get(f"parallelism_config_{k}_size", 1) or 1) for k in PARALLELISM_DIMS}
        mesh = math.prod(sizes.values())
        said = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1)
        return (mesh, f"{mesh} processes ({said})") if wanted >= mesh else (0, f"needs {mesh} processes ({said})")
    group = int(mcfg.get("megatron_lm_tp_degree", 1)) * int(mcfg.get("megatron_lm_pp_degree", 1))
    if wanted < group or wanted % group:
        return 0, f"needs a multiple of {group} processes"
    return wanted, ""


LAUNCH_KEYS = ("ACCELERATE_", "MEGATRON_LM_", "PARALLELISM_CONFIG_", "FSDP_")  # what `accelerate launch` tells a rank


def launch_environment(path: str | os.PathLike, num_processes: int) -> dict[str, str]:
    """The environment `accelerate launch --config_file path --num_processes N` gives each rank (what Launcher.read
    reads), computed by accelerate's own launcher code without launching anything, plus torchrun's WORLD_SIZE: for
    finetune plan, to ask a layout's family what it refuses (environment.launch_problems)."""
    import logging
    from unittest import mock

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    argv = ["--config_file", str(path), "--num_processes", str(num_processes), "--num_machines", "1"]
    args = launch_command_parser().parse_args([*argv, "--main_process_port", "0", "-m", "finetune"])
    quiet = logging.getLogger("accelerate.commands.launch")
    mine = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_KEYS)}  # none of this process's own
    with mock.patch.dict(os.environ, mine, clear=True), mock.patch.object(quiet, "disabled", True):
        args, defaults, mixed_from_flag = _validate_launch_command(args)
        if args.use_deepspeed:  # as accelerate.commands.launch.launch_command does before its deepspeed_launcher
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(
                fields + (["mixed_precision"] if mixed_from_flag else [])
            )
            env = prepare_deepspeed_cmd_env(args)[1]
        elif args.multi_gpu or args.use_fsdp or args.use_megatron_lm:
            env = prepare_multi_gpu_env(args)
        else:
            env = prepare_simple_launcher_cmd_env(args)[1]
    out = {k: v for k, v in env.items() if k.startswith(LAUNCH_KEYS)}
    ds = out.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if ds and not Path(ds).is_absolute():  # relative to the checkout the config ships in, as read_config_file reads it
        out["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(Path(path).resolve().parents[1] / ds)
    return {**out, "WORLD_SIZE": str(num_processes)}


# ---------------------------------------------------------------- what a checkpoint of a layout holds (checkpoint.py)
# A layout's checkpoint_format (Backend.checkpoint_format, recorded in every checkpoint's layout):
#   "full": accelerate's save_state already writes whole tensors (model.safetensors, optimizer.bin);
#   "portable": the backend's own files hold shards, so portable/ adds the full tensors;
#   "native": only the backend's own format (no resume under another layout).


def writes_whole_tensors(layout: Mapping) -> bool:
    """Whether the backend's own checkpoint files already hold whole tensors (a from_pretrained directory)."""
    return layout.get("checkpoint_format") == "full"


def has_portable_copy(layout: Mapping) -> bool:
    """Whether a checkpoint of this layout keeps a copy of its full tensors in portable/."""
    return layout.get("checkpoint_format") == "portable"


def resumes_across_layouts(layout: Mapping) -> bool:
    """Whether a checkpoint of this layout can resume under another layout, and another layout's under this one."""
    return layout.get("checkpoint_format") != "native"
