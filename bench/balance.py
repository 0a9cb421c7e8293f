"""Rank balance under DDP with variable-length data: the seconds per step a rank waits for the other at the
gradient all-reduce, with finetune's round-robin batches and with length-aware batches (the same global batch,
split by cost: finetune.data.balanced_split). Simulated over a whole epoch (exact token counts), measured for a
few steps in a two-rank torchrun harness (this file's --worker), and then the app itself: finetune under
accelerate_configs/ddp.yaml with `length_aware_batching` false and true, interleaved.

    .venv/bin/python bench/balance.py [--quick] [--repeats 4] [--steps 4]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import harness
import packing

NAME = "balance"
TITLE = "5. rank balance (2 ranks, padding)"


def rank_batches(lengths: list[int], world: int, micro: int, seed: int, mode: str, quad: float, epoch: int = 0):
    """Per optimizer step, the example indices each rank holds (GA 1).

    round_robin: finetune's default: EpochSampler order, batches of `micro`, accelerate deals batch
    j*world + r to rank r. balanced: `length_aware_batching`: the same global batch (same examples,
    same step) split across ranks by finetune.data.balanced_split (the app's own function)."""
    from finetune.data import balanced_split

    order = harness.epoch_order(len(lengths), seed, epoch)
    per_step = world * micro
    steps = []
    for s in range(len(order) // per_step):
        chunk = order[s * per_step : (s + 1) * per_step]
        if mode == "round_robin":
            steps.append([chunk[r * micro : (r + 1) * micro] for r in range(world)])
        else:
            groups = balanced_split([lengths[i] for i in chunk], world, quad)
            steps.append([[chunk[i] for i in g] for g in groups])
    return steps


def simulate_balance(lengths: list[int], world: int, micro: int, quad: float) -> dict:
    """A whole epoch, both splits, exact token counts. Two cost models for a rank's micro batch:
    padded (rows x width, as here: CPU/eager kernels compute the padding) and real (sum of lengths, as
    unpadded/varlen GPU kernels do); each with attention's quadratic term. A step lasts as long as its
    most expensive rank; the others wait (idle_fraction: share of rank-time spent waiting)."""

    def costs_of(ranks: list[list[int]]) -> tuple[list[float], list[float]]:
        padded, real = [], []
        for idx in ranks:
            w = -(-max(lengths[i] for i in idx) // 8) * 8
            padded.append(len(idx) * w * (1 + quad * w))
            real.append(sum(lengths[i] * (1 + quad * lengths[i]) for i in idx))
        return padded, real

    per_mode = {m: rank_batches(lengths, world, micro, 42, m, quad) for m in ("round_robin", "balanced")}
    out: dict = {}
    for mode, steps in per_mode.items():
        stats: dict[str, list[float]] = {k: [] for k in ("padded_idle", "real_idle", "padded_max", "real_max", "pad")}
        for ranks in steps:
            padded, real = costs_of(ranks)
            stats["padded_idle"].append(1 - statistics.mean(padded) / max(padded))
            stats["real_idle"].append(1 - statistics.mean(real) / max(real))
            stats["padded_max"].append(max(padded))
            stats["real_max"].append(max(real))
            n_real = sum(lengths[i] for idx in ranks for i in idx)
            n_padded = sum(len(idx) * (-(-max(lengths[i] for i in idx) // 8) * 8) for idx in ranks)
            stats["pad"].append(1 - n_real / n_padded)
        out[mode] = {
            "idle_fraction": statistics.mean(stats["padded_idle"]),
            "idle_fraction_real_cost": statistics.mean(stats["real_idle"]),
            "padding_fraction": statistics.mean(stats["pad"]),
            "step_cost": sum(stats["padded_max"]),
            "step_cost_real": sum(stats["real_max"]),
            "steps": len(steps),
        }
    rr, bal = out["round_robin"], out["balanced"]
    out["predicted_step_time_x"] = bal["step_cost"] / rr["step_cost"]  # < 1: balanced is faster
    out["predicted_step_time_x_real_cost"] = bal["step_cost_real"] / rr["step_cost_real"]
    return out


def run(ctx: harness.Context) -> dict:
    a = harness.assets(ctx)
    o = ctx.opts
    common = {"model": a["small_model"], "dataset": a["instr"], "format": "instruction", "max_seq_length": 512}
    config = harness.write_run_config(ctx, "balance", **common)
    packed = harness.write_run_config(ctx, "balance_packed", **common, packing=True)
    aware = harness.write_run_config(ctx, "balance_aware", **common, length_aware_batching=True)
    quad = 1 / (6 * harness.LLAMA_7M["hidden_size"])  # attention FLOPs / linear FLOPs per token and unit of width
    lengths = packing.tokenized_lengths(config)
    out = {
        "simulated_padding": simulate_balance(lengths, 2, 8, quad),
        "simulated_packing": simulate_balance(packing.tokenized_lengths(packed), 2, 8, quad),
    }
    spec = {"config": config, "steps": ctx.option("balance_steps", 6, 2), "micro": 8, "quad": quad, "warmup": 1}
    torchrun = harness.torchrun(2)
    m = out["measured"] = harness.run_worker(ctx, "balance.py", "balance", spec, "balance", 1, launcher=torchrun)
    out["measured_step_x"] = m["round_robin"]["step_time_s"] / m["balanced"]["step_time_s"]
    # The app itself: DDP on 2 ranks, with and without length_aware_batching, interleaved.
    systems = {
        "finetune_fixed": lambda rep: harness.run_finetune(ctx, f"bal_fixed_{rep}", config, o.steps, 1, "ddp"),
        "finetune_length_aware": lambda rep: harness.run_finetune(ctx, f"bal_aware_{rep}", aware, o.steps, 1, "ddp"),
    }
    runs = harness.interleaved(systems, o.repeats)
    app = {
        name: {**harness.summary(r), "padding_fraction": statistics.median(x["padding_fraction"] for x in r)}
        for name, r in runs.items()
    }
    harness.ratio(app, runs, "finetune_length_aware", "finetune_fixed", "aware_x_fixed")
    out["app"] = app
    out["setup"] = (
        "7M Llama (hidden 256, 4 layers), instruction data 16..512 tokens, padding, 2 ranks x micro 8 x 1 thread"
    )
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--balance_steps", type=int, default=None, help="steps of the torchrun harness (6, quick 2)")


def worker_balance(spec: dict) -> dict:
    """Two ranks (torchrun, gloo): the same global batches split round-robin or balanced, interleaved
    step by step. Each step: forward+backward (timed: compute), a 1-element all_reduce right after
    (timed: the wait for the slower rank), the gradient all_reduce (comm), AdamW. Loss normalised by the
    global supervised-token count, as finetune does, so both splits compute the same update."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from finetune.data import Collator

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ds, tok = harness.finetune_datasets(spec["config"])
    train = ds.train
    lengths = [len(x) for x in train["input_ids"]]
    cfg = json.loads(Path(spec["config"]).read_text())
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    collate = Collator(tok.pad_token_id)
    plans = {m: rank_batches(lengths, world, spec["micro"], 42, m, spec["quad"]) for m in ("round_robin", "balanced")}
    rec = {m: {"compute": [], "wait": [], "comm": [], "step": [], "real": []} for m in plans}
    for step in range(spec["steps"] + spec["warmup"]):
        for mode in ("round_robin", "balanced") if step % 2 == 0 else ("balanced", "round_robin"):
            dist.barrier()
            t0 = time.perf_counter()
            batch = collate([train[i] for i in plans[mode][step][rank]])
            real = batch.pop("num_tokens").float()
            batch.pop("num_positions"), batch.pop("num_learned")
            n = batch.pop("num_supervised").float()
            count = n.clone()
            dist.all_reduce(count)
            loss = model(**batch).loss * n / count * world
            loss.backward()
            t1 = time.perf_counter()
            dist.all_reduce(torch.zeros(1))  # returns when the slowest rank is done computing
            t2 = time.perf_counter()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            t3 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            dist.all_reduce(real)
            if step >= spec["warmup"]:
                r = rec[mode]
                r["compute"].append(t1 - t0)
                r["wait"].append(t2 - t1)
                r["comm"].append(t3 - t2)
                r["step"].append(t4 - t0)
                r["real"].append(float(real))
    gathered = [None] * world
    dist.all_gather_object(gathered, rec)
    dist.destroy_process_group()
    if rank != 0:
        return {}
    out = {}
    for mode in plans:
        waits = [statistics.mean(g[mode]["wait"]) for g in gathered]
        step_time = statistics.mean(gathered[0][mode]["step"])
        out[mode] = {
            "wait_s_per_rank": waits,
            "compute_s_per_rank": [statistics.mean(g[mode]["compute"]) for g in gathered],
            "wait_s_mean": statistics.mean(waits),
            "comm_s": statistics.mean(gathered[0][mode]["comm"]),
            "step_time_s": step_time,
            "idle_fraction": statistics.mean(waits) / step_time,
            "real_tokens_per_s": sum(gathered[0][mode]["real"]) / sum(gathered[0][mode]["step"]),
            "steps": len(gathered[0][mode]["step"]),
        }
    return out


def rows(r: dict) -> list[harness.Row]:
    sim = r["simulated_padding"]
    out = []
    for mode, label in (("round_robin", "now (round robin)"), ("balanced", "length-aware")):
        m = r["measured"][mode]
        note = f"idle {m['idle_fraction']:.0%} of step {m['step_time_s']:.2f} s (sim {sim[mode]['idle_fraction']:.0%})"
        out.append(harness.Row("5 balance", f"wait/step, {label}", m["wait_s_mean"], "s", note))
    note = f"sim {1 / sim['predicted_step_time_x']:.2f}x (padding {sim['round_robin']['padding_fraction']:.0%}"
    note += f" -> {sim['balanced']['padding_fraction']:.0%})"
    out.append(harness.Row("5 balance", "step: now / length-aware", r["measured_step_x"], "x", note))
    app = r["app"]
    for name, label in (
        ("finetune_fixed", "finetune ddp, fixed"),
        ("finetune_length_aware", "finetune ddp, length-aware"),
    ):
        note = f"padding {app[name]['padding_fraction']:.0%}, step {app[name]['step_time_s']:.2f} s"
        out.append(harness.Row("5 balance", label, app[name]["tokens_per_s"], "real tok/s", note))
    out.append(harness.ratio_row("5 balance", "length-aware / fixed", app, "aware_x_fixed"))
    sp = r["simulated_packing"]
    note = f"length-aware: sim {1 / sp['predicted_step_time_x']:.2f}x faster"
    out.append(harness.Row("5 balance", "packed rows: idle (sim)", sp["round_robin"]["idle_fraction"], "frac", note))
    return out


def plot(ax, r: dict) -> None:
    modes = ["round_robin", "balanced"]
    ax.bar(modes, [r["measured"][m]["step_time_s"] for m in modes], color="tab:blue", label="step")
    ax.bar(modes, [r["measured"][m]["wait_s_mean"] for m in modes], color="tab:red", label="wait (mean rank)")
    ax.legend(fontsize=7)
    ax.set_ylabel("s per step")


if __name__ == "__main__":
    if not harness.worker_main({"balance": worker_balance}):
        harness.main(sys.modules[__name__])
