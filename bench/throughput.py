"""Throughput: finetune vs a bare PyTorch loop vs HF Trainer on full 256-token blocks of text (no padding).

34M Llama (hidden 512, 8 layers, vocab 8192), micro batch 8, fp32, 1 process x 2 threads; on fixed-length
data the matmuls are the same for all three, so the difference is what each does around them.

    .venv/bin/python bench/throughput.py [--quick] [--repeats 4] [--steps 4]
"""

from __future__ import annotations

import sys

import harness

NAME = "throughput"
TITLE = "1. throughput (34M, seq 256, batch 8)"
TARGETS = {"bare_loop": 0.97, "hf_trainer": 1.0}


def run(ctx: harness.Context) -> dict:
    a = harness.assets(ctx)
    o = ctx.opts
    config = harness.write_run_config(
        ctx, "throughput", model=a["model"], dataset=a["text"], format="text", max_seq_length=256
    )
    spec = {"config": config, "steps": o.steps, "threads": 2, "collator": "default", "warmup": o.warmup}
    systems = {
        "finetune": lambda rep: harness.run_finetune(ctx, f"tp_finetune_{rep}", config, o.steps, 2),
        "bare_loop": lambda rep: harness.run_worker(ctx, "baselines.py", "bare", spec, f"tp_bare_{rep}", 2),
        "hf_trainer": lambda rep: harness.run_worker(ctx, "baselines.py", "trainer", spec, f"tp_trainer_{rep}", 2),
    }
    runs = harness.interleaved(systems, o.repeats)
    harness.same_batches(runs, tuple(systems))
    out = {name: harness.summary(r) for name, r in runs.items()}
    for other in TARGETS:
        harness.ratio(out, runs, "finetune", other, f"finetune_x_{other}")
    out["losses_first_steps"] = {n: r[0].get("losses", [])[:3] for n, r in runs.items()}
    out["setup"] = "34M Llama (hidden 512, 8 layers, vocab 8192), seq 256, micro batch 8, fp32, 1 process x 2 threads"
    return out


def rows(r: dict) -> list[harness.Row]:
    out = [harness.Row("1 throughput", n, r[n]["tokens_per_s"], "tokens/s") for n in ("finetune", *TARGETS)]
    for other, target in TARGETS.items():
        out.append(harness.ratio_row("1 throughput", f"finetune / {other}", r, f"finetune_x_{other}", target))
    return out


def plot(ax, r: dict) -> None:
    harness.bars(ax, r, ["finetune", *TARGETS])


if __name__ == "__main__":
    harness.main(sys.modules[__name__])
