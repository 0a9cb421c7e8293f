"""`finetune parity`: prove that swapping the Accelerate config changes nothing but speed and memory.

Runs the user's run config for K optimizer steps under each of several Accelerate configs, with
the same global batch (a config with fewer processes gets proportionally more gradient
accumulation), then prints one table: per-step loss and exported-weight differences to the first
config, step time and peak memory per rank. Exits 1 when a difference is above tolerance.

    finetune parity --config examples/sft.yaml --steps 10 [--configs single,ddp,zero3] [-- --seed 3 --packing]

The runs start in the current folder (the config and its paths mean what they mean to `finetune` there); the
overrides after `--` are read as `finetune` reads them. Each run goes to OUTPUT_DIR/NAME, replacing an earlier
parity's run there; an OUTPUT_DIR holding anything but parity's runs is refused.
    finetune parity --config examples/sft.yaml --mixed_precision bf16     # every run in bf16

Tolerances. fp32: per-step losses 1e-4 relative, exported weights 1e-5 absolute. bf16 (docs/precision.md):
losses 3e-3 relative (below bf16's unit roundoff, 2^-8 = 3.9e-3: a layout may not move a loss by as much as one
bf16 rounding of it), and the training update (exported weights minus the base model's) within 6% in L2 of the
reference's: layouts differ in where they round (FSDP2 computes with bf16 copies of its parameters, DDP under
autocast), and Adam turns those roundings into whole-size steps for near-zero gradients, so the largest single
weight difference says little; measured, layouts move the update about as much as bf16 itself does against fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune import launching
from finetune.config import ConfigError
from finetune.config.load import parse
from finetune.parallel.topology import accelerate_config_path, deepspeed_json, describe_observed, read_config_file

MARKER = "finetune_parity.json"  # in parity's output_dir: the runs there are parity's, replaced by the next parity
SINGLE_NODE = ["single", "ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "fsdp2", "fsdp2_offload"]


@dataclass
class Outcome:
    name: str
    ok: bool
    world_size: int = 0
    distributed_type: str = "?"
    sharding: str = ""  # how the run really spread the model (from its metrics rows)
    gradient_accumulation_steps: int = 0
    losses: list[float] = field(default_factory=list)
    weights: dict | None = None
    step_time_s: float = float("nan")
    peak_rss_gb: list[float] = field(default_factory=list)
    peak_gpu_gb: list[float] = field(default_factory=list)  # on GPUs: torch's allocated peak per rank
    error: str = ""


def run_one(name: str, path: Path, ga: int, args: argparse.Namespace, overrides: list[str], out: Path) -> Outcome:
    """One run of the config under the Accelerate config at `path`, K steps, GA `ga`; its log goes to out/NAME.log.
    An Outcome with weights None when the run exported no Hugging Face weights (a Megatron-LM checkpoint)."""
    from safetensors.torch import load_file

    from finetune.metrics import read_metrics

    run_args = [
        "--config",
        args.config,
        *overrides,
        "--max_steps",
        str(args.steps),
        "--gradient_accumulation_steps",
        str(ga),
        "--logging_steps",
        "1",
        "--save_steps",
        "null",
        "--disable_tqdm",
        "true",
        "--output_dir",
        str(out / name),
        "--overwrite_output_dir",
        "true",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = out / f"{name}.log"
    launch_args = ("--mixed_precision", args.mixed_precision) if args.mixed_precision else ()
    json_file = deepspeed_json(path)  # read where parity read it, whatever folder the runs start in
    launch_args += ("--deepspeed_config_file", str(json_file)) if json_file else ()
    # The runs start in the user's folder: the run config, the paths in it and the overrides mean what they mean
    # to `finetune` started there.
    cmd = launching.finetune_command(run_args, path, launch_args)
    r = launching.launch(cmd, timeout=args.timeout, env=env, log=log, cwd=Path.cwd())
    if r.timed_out:
        return Outcome(name, False, error=f"timed out after {args.timeout} s (log: {log})")
    if r.rc != 0:
        tail = r.output.strip().splitlines()[-3:]
        return Outcome(name, False, error=f"exit {r.rc} after {r.wall_s:.0f} s: " + " | ".join(tail) + f" (log: {log})")
    rows = read_metrics(str(out / name))
    train = [r for r in rows if "loss" in r]
    memory = next((r["peak_memory"] for r in rows if "peak_memory" in r), [])
    times = [r["step_time_s"] for r in train[1:]] or [r["step_time_s"] for r in train]
    weights = exported_weights(out / name / "final")
    return Outcome(
        name,
        True,
        world_size=train[0]["world_size"],
        distributed_type=train[0]["distributed_type"],
        sharding=describe_observed(train[-1]),
        gradient_accumulation_steps=ga,
        losses=[r["loss"] for r in train],
        weights=load_file(str(weights)) if weights.exists() else None,
        step_time_s=statistics.median(times),
        peak_rss_gb=[m["train_peak_rss_gb"] for m in memory],
        peak_gpu_gb=[m["train_peak_gpu_allocated_gb"] for m in memory if "train_peak_gpu_allocated_gb" in m],
    )


def exported_weights(final: Path) -> Path:
    """final/'s weights file: the full model, or the adapter of a PEFT run."""
    full = final / "model.safetensors"
    return full if full.exists() else final / "adapter_model.safetensors"


def compare(ref: Outcome, o: Outcome, base: dict | None = None) -> tuple[float, float | None, float | None]:
    """(max relative per-step loss difference, max absolute exported-weight difference, relative L2 difference of
    the training updates |w - w_ref| / |w_ref - w_base|) to ref; the weight differences are None when either run
    exported no Hugging Face weights, the update's also without the base model's weights."""
    if not ref.losses or len(ref.losses) != len(o.losses):
        return float("inf"), float("inf"), float("inf")
    loss = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.losses, o.losses))
    if ref.weights is None or o.weights is None:
        return loss, None, None
    if set(ref.weights) != set(o.weights):
        return loss, float("inf"), float("inf")
    weight = max(float((ref.weights[k].float() - o.weights[k].float()).abs().max()) for k in ref.weights)
    if base is None or not set(ref.weights) <= set(base):
        return loss, weight, None
    diff = sum(float(((ref.weights[k].float() - o.weights[k].float()) ** 2).sum()) for k in ref.weights)
    update = sum(float(((ref.weights[k].float() - base[k].float()) ** 2).sum()) for k in ref.weights)
    return loss, weight, (diff / update) ** 0.5 if update else float("inf")


def base_weights(model: str) -> dict | None:
    """The base model's weights when `model` is a local directory of safetensors files (else None)."""
    from safetensors.torch import load_file

    files = sorted(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []
    return {k: v for f in files for k, v in load_file(str(f)).items()} or None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune parity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="the run config (YAML) to check")
    parser.add_argument(
        "--configs",
        default=",".join(SINGLE_NODE),
        help="comma-separated Accelerate configs: shipped names or paths; the first is the reference "
        "(default: %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument(
        "--loss_rtol", type=float, default=None, help="max relative loss difference (default: 1e-4; bf16/fp16 3e-3)"
    )
    parser.add_argument(
        "--weight_atol", type=float, default=None, help="max abs weight difference (default: 1e-5; bf16/fp16: none)"
    )
    parser.add_argument(
        "--update_rtol",
        type=float,
        default=None,
        help="max relative L2 difference of the training updates (default: none; bf16/fp16: 0.06)",
    )
    parser.add_argument(
        "--mixed_precision",
        choices=("no", "bf16", "fp16"),
        default=None,
        help="as accelerate launch --mixed_precision, for every run (default: each Accelerate config's own)",
    )
    parser.add_argument(
        "--output_dir",
        default="outputs/parity",
        help="where each run writes: a new or empty directory, or a previous parity run's, whose runs are replaced "
        "(default: %(default)s)",
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per run (default: %(default)s)")
    return parser


def main(argv: list[str]) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    half = args.mixed_precision in ("bf16", "fp16")
    defaults = {"loss_rtol": 3e-3, "weight_atol": float("inf"), "update_rtol": 0.06} if half else {
        "loss_rtol": 1e-4, "weight_atol": 1e-5, "update_rtol": float("inf")}  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        check = ["--output_dir", os.path.join(args.output_dir, "_check"), "--overwrite_output_dir", "true"]
        cfg = parse(["--config", args.config, *overrides, *check])  # the overrides as `finetune` reads them
        paths = {Path(name).stem: accelerate_config_path(name) for name in args.configs.split(",") if name}
        if args.steps < 1:
            raise ConfigError([("--steps", f"must be >= 1, got {args.steps}")])
        output_dir_problem(Path(args.output_dir))
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    # Same global batch everywhere: fewer processes, more accumulation.
    worlds = {name: read_config_file(p)[0].dp for name, p in paths.items()}  # ranks holding different batches
    target = cfg.train.gradient_accumulation_steps * max(worlds.values())
    bad = [n for n, w in worlds.items() if target % w]
    if bad:
        print(f"finetune parity: {bad} cannot reach the global batch of {target} micro batches", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(json.dumps({"config": os.path.abspath(args.config), "configs": list(paths)}) + "\n")
    outcomes = []
    for name, path in paths.items():
        print(
            f"[parity] {name}: {worlds[name]} data-parallel rank(s) x GA {target // worlds[name]}, {args.steps} steps ...",
            flush=True,
        )
        outcomes.append(run_one(name, path, target // worlds[name], args, overrides, out))
        if not outcomes[-1].ok:
            print(f"[parity] {name} failed: {outcomes[-1].error}", flush=True)
    return report(outcomes, args, base_weights(cfg.model.model))


def output_dir_problem(out: Path) -> None:
    """Each run goes to OUTPUT_DIR/NAME with --overwrite_output_dir: only a directory that holds parity's runs alone
    (its MARKER), an empty one or a new one will do."""
    if out.exists() and not out.is_dir():
        raise ConfigError([("--output_dir", f"{str(out)!r} is a file; give a directory for the runs")])
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ConfigError(
            [("--output_dir", f"{str(out)!r} holds files that are not parity's runs (no {MARKER}), which the runs "
                              "would replace; give a new or empty directory")]
        )  # fmt: skip


def report(outcomes: list[Outcome], args: argparse.Namespace, base: dict | None = None) -> int:
    ok_runs = [o for o in outcomes if o.ok]
    ref = ok_runs[0] if ok_runs else None
    head = (
        f"{'config':<15} {'distributed':<11} {'world':>5} {'GA':>3} {'sharding':<20} {'max rel loss diff':>17} "
        f"{'max abs weight diff':>19} {'update diff':>11} {'step s':>7}  train peak GB/rank (GPU allocated, else RSS)"
    )
    print("\n" + head + "\n" + "-" * len(head))
    failed = False
    for o in outcomes:
        if not o.ok:
            failed = True
            print(f"{o.name:<15} FAILED: {o.error}")
            continue
        loss, weight, update = compare(ref, o, base)
        weight = float("inf") if weight is None else weight  # parity compares exported models: none is a failure
        within = loss <= args.loss_rtol and weight <= args.weight_atol
        within = within and (update <= args.update_rtol if update is not None else args.update_rtol == float("inf"))
        flag = "" if within else "  <-- above tolerance"
        failed |= bool(flag)
        print(
            f"{o.name:<15} {o.distributed_type:<11} {o.world_size:>5} {o.gradient_accumulation_steps:>3} "
            f"{o.sharding:<20} {loss:>17.2e} {weight:>19.2e} "
            f"{'n/a' if update is None else f'{update:.3f}':>11} {o.step_time_s:>7.3f}  "
            f"{', '.join(f'{m:.2f}' for m in (o.peak_gpu_gb or o.peak_rss_gb))}{' GPU' if o.peak_gpu_gb else ''}{flag}"
        )
    print(
        f"\ntolerances: loss {args.loss_rtol:g} relative, weights {args.weight_atol:g} absolute, update "
        f"{args.update_rtol:g} relative (L2, against the base model's weights); "
        f"reference: {ref.name if ref else 'none'}; logs and outputs under {args.output_dir}"
    )
    return 1 if failed else 0
