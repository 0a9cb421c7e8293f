"""DDP on CPU: finetune with 2 processes x 1 thread (accelerate_configs/ddp.yaml, gloo) against 1 process x
2 threads, the same global batch (8 x 256 tokens): micro 4 per rank vs micro 8. Target >= 0.95x.

    .venv/bin/python bench/ddp.py [--quick] [--repeats 4] [--steps 4]
"""

from __future__ import annotations

import sys

import harness

NAME = "ddp"
TITLE = "3. DDP: 2x1 thread vs 1x2 threads"
TARGET = 0.95


def measure(
    ctx: harness.Context, name: str, model: str, dataset: str, seq: int, micro: int, steps: int, repeats: int
) -> dict:
    """finetune under single (micro, 2 threads) and ddp.yaml (micro / 2 per rank, 1 thread each), interleaved;
    also used by the grid benchmark on its own model."""
    common = dict(model=model, dataset=dataset, format="text", max_seq_length=seq)
    single = harness.write_run_config(ctx, name, per_device_train_batch_size=micro, **common)
    ddp = harness.write_run_config(ctx, f"{name}_2", per_device_train_batch_size=micro // 2, **common)
    systems = {
        "1proc_x_2threads": lambda rep: harness.run_finetune(ctx, f"{name}_single_{rep}", single, steps, 2),
        "2proc_x_1thread": lambda rep: harness.run_finetune(ctx, f"{name}_two_{rep}", ddp, steps, 1, "ddp"),
    }
    runs = harness.interleaved(systems, repeats)
    harness.same_batches(runs, tuple(systems))
    out = {n: harness.summary(r) for n, r in runs.items()}
    harness.ratio(out, runs, "2proc_x_1thread", "1proc_x_2threads", "ddp_x_single")
    one, two = runs["1proc_x_2threads"][0]["losses"], runs["2proc_x_1thread"][0]["losses"]
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(one, two))
    return out


def run(ctx: harness.Context) -> dict:
    a = harness.assets(ctx)
    out = measure(ctx, "ddp", a["model"], a["text"], 256, 8, ctx.opts.steps, ctx.opts.repeats)
    out["setup"] = "34M Llama, seq 256, global batch 8, fp32 (finetune under single and accelerate_configs/ddp.yaml)"
    return out


def rows(r: dict, bench: str = "3 ddp") -> list[harness.Row]:
    note = f"max loss diff {r['max_loss_diff']:.1e}"
    return [
        harness.Row(bench, "1 proc x 2 threads", r["1proc_x_2threads"]["tokens_per_s"], "tokens/s"),
        harness.Row(bench, "2 procs x 1 thread", r["2proc_x_1thread"]["tokens_per_s"], "tokens/s"),
        harness.ratio_row(bench, "ddp / single", r, "ddp_x_single", TARGET, note),
    ]


def plot(ax, r: dict) -> None:
    harness.bars(ax, r, ["1proc_x_2threads", "2proc_x_1thread"])


if __name__ == "__main__":
    harness.main(sys.modules[__name__])
