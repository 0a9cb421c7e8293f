"""ZeRO memory: step time and training-phase peak memory per rank, DDP vs ZeRO-1/2/3 (+offload).

A ~110M-parameter Llama (fp32, 2 ranks, 1 thread each), the same run under each Accelerate config through
`finetune parity`'s runner (so the losses are checked equal too: its table is printed first), then rows with
ratios to DDP. Runs one after another (not interleaved: each config is one run, the ratios are indicative).

    .venv/bin/python bench/zero_memory.py [--steps 8] [--configs ddp,zero1,...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import harness

from finetune.commands import parity

NAME = "zero_memory"
TITLE = "ZeRO: train peak per rank vs DDP"
CONFIGS = "ddp,zero1,zero2,zero2_offload,zero3,zero3_offload"
LLAMA_110M = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,  # given: demo.build_model sets attributes after the config derived head_dim (64 // 4 = 16)
    vocab_size=16000,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configs", default=None, help=f"Accelerate configs, DDP first (default {CONFIGS}; quick ddp,zero2)"
    )


def build(ctx: harness.Context) -> str:
    """The model (110M; the 7M one under --quick) and a run config on fixed-length text."""
    from finetune import demo

    a = harness.assets(ctx)
    if ctx.quick:
        model = a["small_model"]
    elif (ctx.work / "llama110m_hd64" / "config.json").exists():
        model = str(ctx.work / "llama110m_hd64")
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ctx.work / "tokenizer")
        model = demo.build_model("llama", ctx.work / "llama110m_hd64", tok, **LLAMA_110M)
    text = [{"text": " ".join(e["text"] for e in demo.topic_examples(40, seed=i))} for i in range(300)]
    return harness.write_run_config(
        ctx,
        "zero_memory",
        model=model,
        dataset=demo.write_jsonl(text, ctx.work / "zero_text.jsonl"),
        format="text",
        max_seq_length=256,
        per_device_train_batch_size=4,
    )


def run(ctx: harness.Context) -> dict:
    config = build(ctx)
    steps = ctx.opts.steps_given or (2 if ctx.quick else 8)
    names = (ctx.opts.configs or ("ddp,zero2" if ctx.quick else CONFIGS)).split(",")
    ns = argparse.Namespace(config=config, steps=steps, timeout=1800, loss_rtol=1e-4, weight_atol=1e-5)
    ns.output_dir = str(ctx.runs / "zero_memory")
    out_dir = ctx.runs / "zero_memory"
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    outcomes = []
    for name in names:
        harness.log(f"  {name} ...")
        outcomes.append(parity.run_one(name, parity.accelerate_config_path(name), 1, ns, [], out_dir))
    parity.report(outcomes, ns)
    ok = [o for o in outcomes if o.ok]
    ref = next((o for o in ok if o.name == "ddp"), None)
    if ref is None:
        raise RuntimeError("the DDP run failed; see " + ", ".join(o.error for o in outcomes if not o.ok))
    table = []
    for o in ok:
        table.append(
            {
                "config": o.name,
                "step_s": o.step_time_s,
                "step_x_ddp": o.step_time_s / ref.step_time_s,
                "train_peak_gb": o.peak_rss_gb,
                "mem_x_ddp": max(o.peak_rss_gb) / max(ref.peak_rss_gb),
                "max_rel_loss_diff": parity.compare(ref, o)[0],
            }
        )
    failed = [{"config": o.name, "error": o.error} for o in outcomes if not o.ok]
    return {"configs": table, "failed": failed, "steps": steps, "model": json.loads(open(config).read())["model"]}


def rows(r: dict) -> list[harness.Row]:
    out = []
    for c in r["configs"]:
        note = f"step {c['step_s']:.2f} s ({c['step_x_ddp']:.2f}x DDP); loss diff {c['max_rel_loss_diff']:.0e}"
        out.append(harness.Row("zero memory", f"{c['config']}: peak/rank", max(c["train_peak_gb"]), "GB", note))
        if c["config"] != "ddp":
            out.append(harness.Row("zero memory", f"{c['config']} / ddp peak", c["mem_x_ddp"], "x"))
    out += [
        harness.Row("zero memory", f"{f['config']}: FAILED", float("nan"), "", f["error"][:46]) for f in r["failed"]
    ]
    return out


def plot(ax, r: dict) -> None:
    names = [c["config"] for c in r["configs"]]
    ax.bar(names, [max(c["train_peak_gb"]) for c in r["configs"]], color="tab:blue")
    ax.set_ylabel("train peak RSS per rank, GB")
    ax.set_xticks(range(len(names)), names, fontsize=7, rotation=30)


if __name__ == "__main__":
    harness.main(sys.modules[__name__])
