"""`finetune plan`: memory per rank under each Accelerate config, and which one to use, before anything runs.

    finetune plan --config run.yaml [--num_gpus 16 --gpus_per_node 8 --gpu_memory 80GB --host_memory 1TB]

The estimates are finetune.memory's (its docstring says what they add up)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from finetune.config import ConfigError, RunConfig
from finetune.memory.estimate import GB, Estimate, Machines, ModelShape, plan, shape_from_config, shipped_configs
from finetune.memory.recommend import Recommendation, recommend
from finetune.model import peft_missing
from finetune.parallel import topology

PLAN_DESCRIPTION = """\
Plan memory: for every shipped Accelerate config, what one rank needs to train this model (parameters,
gradients, optimizer states, master copies, activations, logits, buffers, overhead), on the device and on
the host, whether it fits, and the config and micro batch x accumulation to use. Reads only the model's
config: no weights, no GPU needed.

  finetune plan --config examples/sft.yaml
  finetune plan --model meta-llama/Llama-3.1-8B --max_seq_length 4096 --per_device_train_batch_size 2 \\
      --num_gpus 16 --gpus_per_node 8 --gpu_memory 80GB --host_memory 1TB --global_batch_size 64
  finetune plan --model ./my_model --peft.method lora --num_gpus 1 --gpu_memory 24GB

Without --num_gpus on a machine without a GPU it plans for this machine: 2 processes sharing its memory.
Every run config field works as a flag (see finetune --help); dataset is not needed."""


def build_parser() -> argparse.ArgumentParser:
    from finetune.config import build_parser as run_parser

    parser = run_parser()
    parser.prog = "finetune plan"
    parser.description = PLAN_DESCRIPTION
    parser.epilog = (
        "Sizes take a unit (80GB, 80GiB, 1TB; a bare number is GB). Exit code 2 means bad input. "
        "The estimate formulas and their sources: finetune/memory/ and finetune/parallel/sharding.py."
    )
    group = parser.add_argument_group("plan (the machines to plan for)")
    group.add_argument("--num_gpus", type=str, help="GPUs in the job (default: this machine's; none: CPU processes)")
    group.add_argument("--gpus_per_node", type=str, help="GPUs per machine (default: min(num_gpus, 8))")
    group.add_argument("--gpu_memory", help="memory of one GPU, e.g. 80GB (required with --num_gpus)")
    group.add_argument(
        "--host_memory",
        help="memory of one machine, e.g. 512GB (default: this machine's MemTotal for CPU processes; unchecked for GPUs)",
    )
    group.add_argument("--num_processes", type=str, help="CPU processes when planning without GPUs (default: 2)")
    group.add_argument(
        "--global_batch_size", type=str, help="target rows per optimizer step (default: the run config's batch)"
    )
    group.add_argument(
        "--configs",
        help="comma-separated Accelerate configs (names or files) to plan, the preferred first (default: every shipped one, fastest first)",
    )
    return parser


def parse_size_gb(key: str, text: str) -> float:
    """'80GB', '80GiB', '1TB', '80' (GB) -> GB."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?[bB]?)?\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise ConfigError([(key, f"{text!r} is not a memory size; write it like 80GB, 80GiB or 1TB")])
    value, unit = float(m.group(1)), (m.group(2) or "GB").upper().rstrip("B")
    scale = {"K": 1e-6, "M": 1e-3, "G": 1.0, "T": 1e3, "KI": 2**10 / GB, "MI": 2**20 / GB, "GI": 2**30 / GB}
    scale["TI"] = 2**40 / GB
    return value * scale[unit]


def _positive_int(problems: list, key: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        problems.append((key, f"must be a whole number >= 1, got {text!r}"))
        return None
    return value


def host_memory_gb() -> float | None:
    """This machine's MemTotal."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) * 1024 / GB
    except (OSError, StopIteration):
        return None


PLAN_KEYS = ("num_gpus", "gpus_per_node", "gpu_memory", "host_memory", "num_processes", "global_batch_size")


def parse(argv: list[str]) -> tuple[RunConfig, Machines, int | None, list[Path] | None]:
    """argv -> (run config, machines, target global batch, configs); every problem in one ConfigError."""
    from finetune.config import unknown_option_problems

    args, unknown = build_parser().parse_known_args(argv)
    problems = unknown_option_problems(unknown, tuple(f"--{k}" for k in (*PLAN_KEYS, "configs")))
    cfg = _run_config(args, problems)
    gpus, per_node, procs, target = (
        _positive_int(problems, f"--{k}", getattr(args, k))
        for k in ("num_gpus", "gpus_per_node", "num_processes", "global_batch_size")
    )
    sizes = {}
    for key in ("gpu_memory", "host_memory"):
        if getattr(args, key) is not None:
            try:
                sizes[key] = parse_size_gb(f"--{key}", getattr(args, key))
            except ConfigError as e:
                problems += e.problems
    if gpus is None and (per_node or "gpu_memory" in sizes):
        problems.append(("--num_gpus", "is required with --gpus_per_node/--gpu_memory: say how many GPUs to plan for"))
    # the run config's mixed_precision (--mixed_precision), as `accelerate launch --mixed_precision` would give it;
    # auto: each Accelerate config's own, else bf16 on GPUs and fp32 on CPUs (default_precision)
    mixed = cfg.model.mixed_precision if cfg is not None and cfg.model.mixed_precision != "auto" else None
    if cfg is not None and cfg.peft.method != "none" and not cfg.peft.adapter:  # the plan builds the adapter
        problems += peft_missing()
    configs = _configs(args, problems)
    machines = _machines(gpus, per_node, procs, sizes, problems, mixed)
    if cfg is not None and problems == [] and target is not None:
        dp_max = machines.processes
        if target % dp_max and target < dp_max:
            problems.append(
                ("--global_batch_size", f"{target} is smaller than the {dp_max} processes; give at least {dp_max}")
            )
    if problems:
        raise ConfigError(problems)
    return cfg, machines, target, configs


def _run_config(args: argparse.Namespace, problems: list) -> RunConfig | None:
    """The run config of the plan: --config and the run-config overrides; no dataset needed, nothing read from disk."""
    from finetune.config import build_config, load_yaml, parse_cli_value

    values = load_yaml(args.config) if args.config else {}
    overrides = {k: parse_cli_value(k, v) for k, v in vars(args).items() if k not in ("config", *PLAN_KEYS, "configs")}
    values = {**values, **overrides}
    if not values.get("datasets"):  # a mixture's sources name their own datasets
        values.setdefault("dataset", "(not needed to plan)")
    if not values.get("model"):
        problems.append(("model", "is required: give --model ID|PATH, or --config with a model"))
    try:
        return build_config(values, check_filesystem=False)
    except ConfigError as e:
        problems += e.problems
        return None


def _configs(args: argparse.Namespace, problems: list) -> list[Path] | None:
    """--configs: shipped names or paths (None: every shipped config)."""
    if not args.configs:
        if not shipped_configs():  # an install without its package data
            problems.append(
                ("--configs", f"no shipped Accelerate config found in {topology.SHIPPED}; pass --configs FILE.yaml,...")
            )
        return None
    try:
        return [topology.accelerate_config_path(n) for n in args.configs.split(",") if n]
    except ConfigError as e:
        problems += e.problems
        return None


def _machines(gpus, per_node, procs, sizes: dict, problems: list, mixed: str | None) -> Machines | None:
    """The machines to plan for: the GPUs given (else this machine's), or CPU processes."""
    if gpus is None:
        gpus, memory = _local_gpus()
        sizes.setdefault("gpu_memory", memory)
    if not gpus:
        return Machines(0, 0, 0.0, sizes.get("host_memory") or host_memory_gb(), procs or 2, mixed)
    if not sizes.get("gpu_memory"):
        problems.append(("--gpu_memory", "is required with --num_gpus: the memory of one GPU, e.g. 80GB"))
        return None
    return Machines(
        gpus, per_node or min(gpus, 8), sizes["gpu_memory"], sizes.get("host_memory"), mixed_precision=mixed
    )


def _local_gpus() -> tuple[int, float]:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return n, torch.cuda.get_device_properties(0).total_memory / GB
    except Exception:  # noqa: BLE001 -- no usable CUDA: plan for CPU processes
        pass
    return 0, 0.0


def render(shape: ModelShape, cfg: RunConfig, machines: Machines, rows: list[Estimate], rec: Recommendation) -> str:
    """The table (one row per config) and the recommendation."""
    gpu = machines.on_gpu
    lines = [
        f"model: {cfg.model.model}: {shape.total / 1e6:,.1f}M parameters, {shape.trainable / 1e6:,.1f}M trainable; "
        f"{shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}",
        f"batch: micro {cfg.train.per_device_train_batch_size} x seq {cfg.data.max_seq_length}"
        f"{', gradient checkpointing' if cfg.model.gradient_checkpointing else ''}"
        f"{', mixed precision ' + machines.mixed_precision if machines.mixed_precision else ''}; "
        f"on {machines.describe()}",
        "",
    ]
    kinds = ["parameters", "gradients", "optimizer", "master copy", "activations", "logits", "buffers", "overhead"]
    kinds += ["reference"] if any("reference" in e.by_kind() for e in rows) else []  # dpo's live reference copy
    kinds += ["eval"] if any("eval" in e.by_kind() for e in rows) else []  # evaluation's logits
    short = {"parameters": "params", "gradients": "grads", "optimizer": "optim", "master copy": "master"}
    head = f"{'config':<17} {'procs':>5} " + " ".join(f"{short.get(k, k)[:7]:>7}" for k in kinds)
    head += f" {'device GB' if gpu else '':>9} {'host GB':>8}  {'fits':<4}  notes"
    lines += [head, "-" * len(head)]
    for e in rows:
        if e.topology is None or e.refused:
            procs = e.topology.num_processes if e.topology is not None else "-"
            why = "refused: " + "; ".join(f"{k}: {m}" for k, m in e.refused) if e.refused else e.note
            blank = " ".join(f"{'':>7}" for _ in kinds)
            lines.append(f"{e.config:<17} {procs:>5} {blank} {'':>9} {'':>8}  no    {why}")
            continue
        k = e.by_kind()
        device = f"{e.device_gb:9.2f}" if gpu else f"{'':>9}"
        cells = " ".join(f"{k.get(kind, 0.0):7.2f}" for kind in kinds)
        lines.append(
            f"{e.config:<17} {e.topology.num_processes:>5} {cells} {device} {e.host_gb:8.2f}  {'yes' if e.fits else 'no':<4}  {e.note}"
        )
    lines.append("")
    lines.append(
        "(per rank, GB; total = the parts that always exist + the largest of the forward/backward parts (activations,"
        " logits, gathers), the optimizer-step parts (gradients freed after each step, their flat copies) and"
        " evaluation's logits)"
    )
    if rec.config:
        launch = launch_command(rec.path, machines)
        gc = " --gradient_checkpointing true" if rec.gradient_checkpointing else ""
        lines.append(
            f"recommended: {rec.config}, micro batch {rec.micro_batch} x gradient accumulation "
            f"{rec.gradient_accumulation_steps}{' with gradient checkpointing' if rec.gradient_checkpointing else ''}: "
            f"{rec.why}."
        )
        lines.append(
            f"  {launch} --num_processes {rec.estimate.topology.num_processes} -m finetune ... "
            f"--per_device_train_batch_size {rec.micro_batch} --gradient_accumulation_steps "
            f"{rec.gradient_accumulation_steps}{gc}"
        )
    else:
        lines.append(f"recommended: none: {rec.why}.")
    return "\n".join(lines)


def launch_command(path: Path, machines: Machines) -> str:
    """`accelerate launch` of this Accelerate config that works from the folder the user is in: a shipped config by
    its path from there (absolute outside a checkout), its multinode_ twin on several machines, and the DeepSpeed
    JSON it names (accelerate reads a relative one from the folder the launch starts in)."""
    shipped = path.parent == topology.SHIPPED
    twin = topology.shipped_by_name().get(f"multinode_{path.stem}") if shipped and machines.nodes > 1 else None
    config = twin or path
    launch = f"accelerate launch --config_file {_shown(config)}"
    json_file = topology.deepspeed_json(config)
    if shipped and json_file and os.path.isabs(_shown(config)):
        launch += f" --deepspeed_config_file {_shown(json_file)}"
    if twin:
        launch += f" --num_machines {machines.nodes} --machine_rank R --main_process_ip HOST"
    return launch


def _shown(path: Path) -> str:
    """A file as a command names it: from the current folder when it is below it, else absolute."""
    real = path.resolve()
    return str(real.relative_to(Path.cwd())) if real.is_relative_to(Path.cwd()) else str(real)


def main(argv: list[str]) -> int:
    """`finetune plan`: exit 0 with a plan, 1 when no config is recommended (none fits, or none can run this job), 2
    on bad input."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg, machines, target, configs = parse(argv)
        shape = shape_from_config(cfg)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    rows = plan(shape, cfg, machines, configs)
    rec = recommend(shape, cfg, machines, target, configs)
    print(render(shape, cfg, machines, rows, rec))
    return 0 if rec.config else 1
