"""ZeRO's memory savings and capacity on this machine: what ZeRO is for, measured with the planner's help.

savings   one Llama-shaped model large enough that model states dominate (default hidden 1024 x 24 layers,
          369M parameters, fp32), trained a few steps on 2 ranks under DDP, ZeRO-2 and ZeRO-3: the training-phase
          peak per rank of each, and ZeRO's as a fraction of DDP's (targets: ZeRO-2 <= 0.8x, ZeRO-3 <= 0.6x).
capacity  for a memory budget per rank, the most layers (at a fixed width) each config can train according to
          `finetune plan` (bench/sizing.py: largest_llama), then a real run at that size whose measured peak must
          stay within the budget (target: ZeRO-3's largest model >= 1.8x DDP's parameter count).

Both parts ask the planner first and never start a run it says will not fit, or whose two ranks together
would not fit in the memory this machine has available now: an out-of-memory kill on a shared machine takes
other processes with it. `--malloc` runs everything with `cpu_allocator: release` (glibc told to return freed
memory at once; without it, glibc's own thresholds: `cpu_allocator: system`); `--plan_only` prints the planner's
numbers only.

    .venv/bin/python bench/capacity.py [--parts savings,capacity] [--budget_gb 6] [--malloc] [--plan_only]
"""

from __future__ import annotations

import argparse
import shutil
import sys

import harness
import sizing

NAME = "capacity"
TITLE = "ZeRO: memory per rank vs DDP, and the largest model in a budget"
CONFIGS = ("ddp", "zero2", "zero3")
TARGETS = {"zero2": 0.8, "zero3": 0.6}  # savings: peak per rank / DDP's
CAPACITY_TARGET = 1.8  # ZeRO-3's largest model / DDP's, parameters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="savings,capacity", help="savings, capacity, or both (default)")
    parser.add_argument("--hidden", type=int, default=None, help="model width (default 1024; quick 256)")
    parser.add_argument("--layers", type=int, default=None, help="savings: layers (default 24; quick 2)")
    parser.add_argument("--budget_gb", type=float, default=None, help="capacity: GB per rank (default 6; quick 1.2)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per row (default 128)")
    parser.add_argument("--batch", type=int, default=1, help="micro batch per rank (default 1)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="savings: which of ddp,zero2,zero3 to run")
    parser.add_argument("--malloc", action="store_true", help="cpu_allocator: release (see above)")
    parser.add_argument("--plan_only", action="store_true", help="the planner's numbers, no runs")


def planner_config(ctx: harness.Context):
    from finetune.config import build_config

    values = {"model": "planned", "dataset": "planned.jsonl", "output_dir": str(ctx.runs / "plan")}
    values |= {"max_seq_length": ctx.opts.seq, "per_device_train_batch_size": ctx.opts.batch}
    return build_config(values, check_filesystem=False)


def estimate(ctx: harness.Context, hidden: int, layers: int) -> dict[str, tuple[float, int]]:
    """config -> (planned training peak per rank in GB, parameters) on 2 CPU ranks."""
    from finetune import memory

    cfg = planner_config(ctx)
    shape = memory.shape_from_config(cfg, config=sizing.llama_config(hidden, layers))
    machines = memory.Machines(num_gpus=0, cpu_processes=2)
    out = {}
    for name in CONFIGS:
        est = memory.plan_config(shape, cfg, harness.ROOT / "accelerate_configs" / f"{name}.yaml", machines)
        out[name] = (est.host_gb, shape.total)
    return out


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 1e6


def refuse_unless_it_fits(what: str, planned_gb: float) -> None:
    """Two ranks of planned_gb (plus 20%) must fit in what the machine has available now."""
    need, have = 2 * planned_gb * 1.2, available_gb()
    if need > have:
        raise RuntimeError(
            f"{what}: 2 ranks x {planned_gb:.1f} GB planned (+20%) = {need:.1f} GB > {have:.1f} GB available"
        )


def build_llama(ctx: harness.Context, hidden: int, layers: int) -> str:
    """The planner's Llama shape (bench/sizing.py: llama_config, 32k vocabulary), randomly initialised, saved once."""
    return harness.saved_llama(ctx, f"llama_h{hidden}_l{layers}", sizing.llama_config(hidden, layers))


def measure(ctx: harness.Context, tag: str, model: str, config: str, steps: int) -> dict:
    """One full run (its peak memory row is written at the end); the largest rank's training-phase peak."""
    run_config = harness.write_run_config(
        ctx,
        f"capacity_{tag}",
        model=model,
        dataset=harness.assets(ctx)["text"],
        format="text",
        max_seq_length=ctx.opts.seq,
        per_device_train_batch_size=ctx.opts.batch,
        cpu_allocator="release" if ctx.opts.malloc else "system",
    )
    out = ctx.runs / tag
    cmd = harness.finetune_cmd(run_config, out, config, "--max_steps", str(steps))
    r = harness.launch(ctx, tag, cmd, 1)
    rows = harness.read_rows(out)
    shutil.rmtree(out)  # checkpoint and export of a model this size: several GB each
    peaks = next(row["peak_memory"] for row in rows if "peak_memory" in row)
    train = [row for row in rows if "loss" in row]
    return {
        "train_peak_gb": max(m["train_peak_rss_gb"] for m in peaks),
        "estimate_gb": peaks[0].get("estimate_train_peak_gb"),
        "step_s": sorted(row["step_time_s"] for row in train[1:] or train)[len(train[1:] or train) // 2],
        "wall_s": r.wall_s,
    }


def savings(ctx: harness.Context) -> dict:
    hidden, layers = ctx.option("hidden", 1024, 256), ctx.option("layers", 24, 2)
    planned = estimate(ctx, hidden, layers)
    result = {"hidden": hidden, "layers": layers, "parameters": planned["ddp"][1], "configs": {}}
    for name in CONFIGS:
        result["configs"][name] = {"planned_gb": planned[name][0]}
    if ctx.opts.plan_only:
        return result
    model = build_llama(ctx, hidden, layers)
    for name in ctx.opts.configs.split(","):
        refuse_unless_it_fits(f"savings {name}", planned[name][0])
        harness.log(f"  savings: {name} ({planned[name][1] / 1e6:.0f}M parameters, planned {planned[name][0]:.2f} GB)")
        result["configs"][name] |= measure(ctx, f"savings_{name}", model, name, ctx.option("steps_given", 3, 2))
    return result


def capacity(ctx: harness.Context) -> dict:
    from finetune import memory

    hidden, budget = ctx.option("hidden", 1024, 256), ctx.opts.budget_gb or (1.2 if ctx.quick else 6.0)
    cfg, machines = planner_config(ctx), memory.Machines(num_gpus=0, cpu_processes=2)
    result = {"hidden": hidden, "budget_gb": budget, "configs": {}}
    for name in CONFIGS:
        found = sizing.largest_llama(
            hidden, budget, cfg, harness.ROOT / "accelerate_configs" / f"{name}.yaml", machines
        )
        if found is None:
            result["configs"][name] = {"layers": 0, "parameters": 0}
            continue
        layers, shape, est = found
        result["configs"][name] = {"layers": layers, "parameters": shape.total, "planned_gb": est.host_gb}
    if ctx.opts.plan_only:
        return result
    for name, c in result["configs"].items():
        if not c["layers"]:
            continue
        refuse_unless_it_fits(f"capacity {name}", c["planned_gb"])
        harness.log(f"  capacity: {name}, {c['layers']} layers ({c['parameters'] / 1e6:.0f}M parameters)")
        model = build_llama(ctx, hidden, c["layers"])
        c |= measure(ctx, f"capacity_{name}", model, name, ctx.option("steps_given", 2, 2))
    return result


def run(ctx: harness.Context) -> dict:
    parts = ctx.opts.parts.split(",")
    out = {"malloc": ctx.opts.malloc, "seq": ctx.opts.seq, "batch": ctx.opts.batch}
    if "savings" in parts:
        out["savings"] = savings(ctx)
    if "capacity" in parts:
        out["capacity"] = capacity(ctx)
    return out


def rows(r: dict) -> list[harness.Row]:
    out = []
    if "savings" in r:
        s = r["savings"]
        ddp = s["configs"]["ddp"]
        for name, c in s["configs"].items():  # (a config not run: its planned value)
            measured = c.get("train_peak_gb")
            note = f"planned {c['planned_gb']:.2f} GB" + (f", step {c['step_s']:.1f} s" if measured else "")
            out.append(
                harness.Row(
                    "zero savings",
                    f"{name} peak/rank, {s['parameters'] / 1e6:.0f}M",
                    measured or c["planned_gb"],
                    "GB",
                    note,
                )
            )
            if name in TARGETS and measured and ddp.get("train_peak_gb"):
                ratio = measured / ddp["train_peak_gb"]
                target = TARGETS[name]
                out.append(
                    harness.Row("zero savings", f"{name} / ddp peak", ratio, "x", "", f"<= {target}", ratio <= target)
                )
    if "capacity" in r:
        c = r["capacity"]
        for name, x in c["configs"].items():
            measured = x.get("train_peak_gb")
            note = f"{x['layers']} layers; planned {x.get('planned_gb', 0):.2f}" + (
                f", measured {measured:.2f} GB ({'within' if measured <= c['budget_gb'] else 'OVER'} {c['budget_gb']} GB)"
                if measured
                else ""
            )
            out.append(harness.Row("capacity", f"{name}: largest model", x["parameters"] / 1e6, "M params", note))
        ddp, zero3 = c["configs"]["ddp"]["parameters"], c["configs"]["zero3"]["parameters"]
        if ddp:
            ratio = zero3 / ddp
            over = [n for n, x in c["configs"].items() if x.get("train_peak_gb", 0) > c["budget_gb"]]
            met = ratio >= CAPACITY_TARGET and not over  # a size whose run went over the budget is not confirmed
            out.append(harness.Row("capacity", "zero3 / ddp parameters", ratio, "x", "", f">= {CAPACITY_TARGET}", met))
    return out


if __name__ == "__main__":
    harness.main(sys.modules[__name__])
