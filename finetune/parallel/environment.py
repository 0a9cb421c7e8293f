"""Before and at Accelerator(): the environment a rank needs, refusals, and the Accelerator itself.

The launcher (`accelerate launch --config_file X`) has already put the Accelerate config in the
environment; `requested_family` reads which backend family that is, and its module says what the
rank needs before accelerate reads the environment (`environment`), what cannot run (`problems`,
all reported at once before any model loads) and what Accelerator() needs (`accelerator_kwargs`).
"""

from __future__ import annotations

import logging

from finetune import console
from finetune.config import ConfigError, RunConfig
from finetune.parallel.base import start_process_group
from finetune.parallel.surface import FamilyModule
from finetune.parallel.topology import (
    FAMILIES,
    Launcher,
    distributed_type_name,
    launch_environment,
    launched_json_precision,
    requested_family,
)


def family_module(family: str | None = None) -> FamilyModule:
    """The module of a backend family (topology.FAMILIES; default: the one this process was launched with): the
    registry of the families, each imported by name when first asked for (deepspeed.py and megatron.py import their
    libraries, which a DDP run never loads). A new family is a module here, a line below and a name in FAMILIES."""
    family = family or requested_family()
    if family == "ddp":
        from finetune.parallel import ddp as module
    elif family == "deepspeed":
        from finetune.parallel import deepspeed as module
    elif family == "fsdp":
        from finetune.parallel import fsdp as module
    elif family == "tensor":
        from finetune.parallel import tensor as module
    elif family == "megatron":
        from finetune.parallel import megatron as module
    else:
        raise ValueError(f"unknown backend family {family!r}; one of {', '.join(FAMILIES)}")
    return module


def launch_problems(cfg: RunConfig, path, num_processes: int) -> list[tuple[str, str]]:
    """What the run would refuse at start under the Accelerate config `path` launched with num_processes, from the
    run config and the layout alone (not what this machine lacks: finetune plan plans for other machines): the
    family's own problems(), given the environment accelerate's launcher would give each rank."""
    env = launch_environment(path, num_processes)
    return family_module(Launcher.read(env).family).problems(cfg, env, here=False)


def make_accelerator(cfg: RunConfig):
    """Prepare the environment, refuse what cannot run here, and start the Accelerator.

    Gradient accumulation is owned by accelerate with an exact boundary every
    `gradient_accumulation_steps` micro batches (never "whenever the data loader ends"); gloo when
    there is no GPU (DeepSpeed otherwise picks nccl and every rank believes it is alone).
    """
    import os

    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

    family = family_module()
    family.environment(cfg)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    problems = precision_problems(set_mixed_precision(cfg.model.mixed_precision)) + family.problems(cfg)
    if problems:
        raise ConfigError(problems)
    t = cfg.train
    # Gradients as views of DDP's communication buckets: one copy of the gradients instead of two.
    handlers = [
        DistributedDataParallelKwargs(find_unused_parameters=t.ddp_find_unused_parameters, gradient_as_bucket_view=True)
    ]
    try:
        with console.printed_to_log():  # what DeepSpeed prints as it starts (an op it builds: "... built successfully")
            if Launcher.read().distributed:
                start_process_group(t)
            return Accelerator(
                gradient_accumulation_plugin=GradientAccumulationPlugin(
                    num_steps=t.gradient_accumulation_steps, sync_with_dataloader=False
                ),
                dataloader_config=loader_config(),
                kwargs_handlers=handlers,
                # torch_compile: accelerate compiles each repeated block at prepare (compile_regions, its FSDP2 and
                # DeepSpeed variants), after FSDP2's sharding and activation checkpointing.
                **({"dynamo_plugin": regional_compile()} if cfg.model.torch_compile else {}),
                log_with=t.report_to or None,
                # TensorBoard (report_to) writes under output_dir/runs/<tracker_project>.
                project_config=ProjectConfiguration(
                    project_dir=t.output_dir, logging_dir=os.path.join(t.output_dir, "runs")
                ),
                **family.accelerator_kwargs(cfg),
            )
    except ValueError as e:
        if "logging capability" in str(e) or "report_to" in str(e):  # an unknown tracker name
            first = str(e).splitlines()[0]
            fix = "set report_to to some of those names, or [] for metrics.jsonl only"
            raise ConfigError([("report_to", f"{first}; {fix}")]) from None
        raise


def loader_config():
    """How accelerate serves the loaders' batches. Our sampler is already identical on every rank; accelerate only
    shards its batches. A stream (data.StreamedRows) is read by every rank, which keeps its own micro batches
    (IterableDatasetShard), instead of accelerate's default for iterables: rank 0 reads and sends batches, which
    must then all have one width. On a GPU the loaders pin their batches (run.py) and the copies to the device leave
    the host running (non_blocking): a blocking copy made the host wait once per tensor, 5 times a step on an H100
    (bench/README.md, one GPU)."""
    from accelerate import DataLoaderConfiguration

    from finetune.parallel import base

    return DataLoaderConfiguration(
        use_seedable_sampler=False,
        even_batches=True,
        dispatch_batches=False,
        non_blocking=base.has_accelerator_device(),
    )


def group_timeout_s(device, group=None) -> int | None:
    """Seconds the process group's collectives on `device` wait (the default group's by default), as torch holds
    them: what the run really got, whatever was asked. None where torch does not say (one process, a backend
    without the option)."""
    import torch.distributed as dist

    try:
        pg = group or dist.distributed_c10d._get_default_group()
        return round(pg._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return None


def regional_compile():
    from accelerate.utils import TorchDynamoPlugin

    return TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)


def set_mixed_precision(asked: str) -> str:
    """The compute precision of this run (no, bf16 or fp16), put where accelerate and its DeepSpeed and FSDP plugins
    read it (ACCELERATE_MIXED_PRECISION) before Accelerator(), and logged with where it came from. A DeepSpeed JSON
    that enables bf16 or fp16 itself ("enabled": true) decides: DeepSpeed trains in that mode whatever else says (a
    launch asking for the other one is refused: deepspeed.problems). Else what the `accelerate launch` command says
    wins: its --mixed_precision, else its config file's mixed_precision. When it says nothing, the run config's
    mixed_precision decides (auto: bf16 on a GPU that supports it, else fp32). On a GPU, fp32 matmuls use TF32 (as
    Trainer's tf32 option and torchtitan do)."""
    import os

    import torch

    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    said = launched if launched in ("bf16", "fp16") else launcher_mixed_precision() if launched == "no" else None
    gpu = torch.cuda.is_available() and not Launcher.read().use_cpu  # `accelerate launch --cpu`, or a CPU rank
    in_json, path = launched_json_precision(Launcher.read())
    if in_json and said in (None, "no", in_json):
        chosen, why = in_json, f"the DeepSpeed config {path} enables {in_json}"
        if said == "no":
            why += '; accelerate launch\'s no does not turn it off: "enabled": "auto" in the JSON does'
    elif said is not None:
        chosen, why = said, "as accelerate launch says (--mixed_precision or its config file)"
    elif asked == "auto":
        chosen = "bf16" if gpu and torch.cuda.is_bf16_supported() else "no"
        why = "mixed_precision auto: " + ("a GPU with bf16" if chosen == "bf16" else "no GPU with bf16 here")
    else:
        chosen, why = asked, "the run config's mixed_precision"
    os.environ["ACCELERATE_MIXED_PRECISION"] = chosen
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        why += "; TF32 on for fp32 matmuls"
    logging.getLogger("finetune").info("precision: %s (%s)", chosen, why)
    return chosen


def launcher_mixed_precision() -> str | None:
    """What the `accelerate launch` command that started this process says about mixed precision: its
    --mixed_precision, else its config file's mixed_precision; None when it says nothing, or when no accelerate
    launcher is among this process's ancestors (torchrun alone, DeepSpeed's pdsh launcher).
    Workaround (accelerate 1.15): the launcher hands the ranks ACCELERATE_MIXED_PRECISION=no both when it was told
    no and when it was told nothing (commands/launch.py `_validate_launch_command`), so the ranks cannot tell an
    explicit fp32 from no preference. tests/test_precision.py::test_accelerate_still_says_no_for_nothing fails once
    the launcher tells them apart."""
    import psutil

    try:
        proc = psutil.Process().parent()
        while proc is not None:
            argv = proc.cmdline()
            start = _launch_args_start(argv)
            if start is not None:
                return mixed_precision_of_launch(argv[start:])
            proc = proc.parent()
    except psutil.Error:
        return None
    return None


def _launch_args_start(argv: list[str]) -> int | None:
    """Where the arguments of `accelerate launch ...` / `python -m accelerate.commands.launch ...` begin in argv."""
    import os

    for i, arg in enumerate(argv[:4]):
        if arg == "accelerate.commands.launch":
            return i + 1
        if os.path.basename(arg) == "accelerate" and argv[i + 1 : i + 2] == ["launch"]:
            return i + 2
    return None


def mixed_precision_of_launch(launch_args: list[str]) -> str | None:
    """The mixed precision a launch command line asks for (read with accelerate's own parser and config loader):
    --mixed_precision, else the config file's (--config_file, or accelerate's default config); None: nothing."""
    import contextlib
    import io
    import os

    from accelerate.commands.config import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = launch_command_parser().parse_known_args(launch_args)
        if args.mixed_precision:
            return str(args.mixed_precision).lower()
        path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
        said = load_config_from_file(path).mixed_precision if path else None
    except (Exception, SystemExit):  # noqa: BLE001 -- an unreadable command line says nothing
        return None
    return str(said).lower() if said else None


def precision_problems(chosen: str) -> list[tuple[str, str]]:
    """fp16 on a machine without a GPU: accelerate ignores it there (no autocast, no loss scaling), so the run
    would silently be fp32. Not where a DeepSpeed JSON enables fp16 itself: DeepSpeed's own fp16 mode (16-bit
    weights, its dynamic loss scaling) runs on CPU processes too."""
    from finetune.parallel.base import has_accelerator_device

    if chosen == "fp16" and not has_accelerator_device() and launched_json_precision(Launcher.read())[0] != "fp16":
        return [
            (
                "mixed_precision",
                "fp16 needs a GPU: on a CPU accelerate ignores it (no autocast, no loss scaling) and the run would "
                "silently train in fp32; use bf16 (--mixed_precision bf16, which runs on CPUs too) or no",
            )
        ]
    return []


# glibc's mallopt parameters (malloc.h) and what each cpu_allocator mode sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
CPU_ALLOCATOR_SETTINGS = {
    # A step frees and re-allocates the same large buffers (logits, activations, gradients): above glibc's
    # 32 MiB mmap ceiling each is a fresh mapping whose pages are faulted in and zeroed again every step
    # (a 5M Llama with a 32k vocabulary: ~270k page faults and a third of the CPU time per step).
    "keep": ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)),
    "release": ((M_MMAP_THRESHOLD, 65536), (M_TRIM_THRESHOLD, 0)),
    "system": (),
}
# The environment variables glibc reads at start-up for the same parameters (mallopt(3)).
GLIBC_ENV_OF = {
    M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_",
    M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_",
    M_MMAP_MAX: "MALLOC_MMAP_MAX_",
}
GLIBC_ENV = (*GLIBC_ENV_OF.values(), "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def cpu_allocator_env(mode: str) -> dict[str, str]:
    """What a cpu_allocator mode sets, as glibc's environment variables: how another program (a baseline in
    bench/) runs with the same allocator settings as a finetune run, from its start."""
    return {GLIBC_ENV_OF[param]: str(value) for param, value in CPU_ALLOCATOR_SETTINGS[mode]}


def set_cpu_allocator(mode: str) -> str:
    """cpu_allocator on this process (a CPU run): glibc's mallopt, from now on. Returns what is in effect."""
    import ctypes
    import os
    import sys

    given = [k for k in GLIBC_ENV if k in os.environ]
    if given:
        return f"system (the environment sets {', '.join(given)})"
    if mode == "system" or not sys.platform.startswith("linux"):
        return "system"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "system (no glibc)"
    for param, value in CPU_ALLOCATOR_SETTINGS[mode]:
        mallopt(param, value)
    return mode


def describe(accelerator, mixed_precision: str) -> dict:
    """Facts every run logs at start (and tests assert): no silent fallback to one process, the waits torch holds.
    mixed_precision: the backend's (no, bf16, fp16: what it computes in); accelerate's own answer under DeepSpeed
    is "no" once bf16 runs through autocast (deepspeed.bf16_through_autocast)."""
    import torch

    from finetune.cluster import host_gather, host_group

    state = accelerator.state
    launcher = Launcher.read()
    return {
        "restart": launcher.restart,  # torchrun's restarts of this launch (--max_restarts), 0 on the first attempt
        "max_restarts": launcher.max_restarts,
        "distributed_type": distributed_type_name(state),
        "world_size": accelerator.num_processes,
        "backend": state.backend or "none",
        "mixed_precision": mixed_precision,
        "devices": host_gather(f"rank{accelerator.process_index}:{accelerator.device}"),
        "collective_timeout_s": group_timeout_s(accelerator.device),
        "host_wait_timeout_s": group_timeout_s(torch.device("cpu"), host_group()),
    }


def is_peer_failure(err: BaseException) -> bool:
    """True for the errors a collective raises when another rank died or stopped answering."""
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None)) if k)
    signs = (
        "Connection closed by peer",
        "Connection reset by peer",
        "Broken pipe",
        "timed out",
        "Timed out",
        "NCCL communicator was aborted",
        "ProcessGroupGloo",
    )
    return isinstance(err, kinds) or (isinstance(err, RuntimeError) and any(s in str(err) for s in signs))
