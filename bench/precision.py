"""bf16 as GPU users run it, on CPU processes: every layout against one process in bf16, and what bf16 costs or
saves against fp32 under the same layout; then full fine-tuning of bf16 weights against fp32 master weights.

    .venv/bin/python bench/precision.py [--parts layouts,reduce,weights] [--configs single,ddp,...] [--steps 8]

layouts: `finetune parity` twice over the same configs and run config (a 7.5M Llama, hidden 256, 4 layers,
seq 128, global batch 8, lr 1e-3): once `--mixed_precision bf16`, once fp32. Per layout: per-step loss max
relative difference, the training update's L2 difference (|w - w_single| / |w_single - w_base|) and the max
absolute weight difference against the single bf16 process; the exported dtype; the observed compute dtype;
median step time and training-phase peak RSS per rank in bf16 and in fp32 (the same layout, run side by side in
this invocation).
reduce: DeepSpeed in bf16, GA 2, ZeRO-1/2/3 three ways, each against one bf16 process (losses, step time, peak
RSS): as shipped (autocast over fp32 weights, fp32 reduction and accumulation); DeepSpeed's bf16 mode (the JSON
enables bf16) with communication_data_type and grad_accum_dtype fp32; DeepSpeed's bf16 mode with its defaults.
weights: one process, 300 steps, the same data: fp32 master weights with bf16 compute (torch_dtype float32,
mixed_precision bf16) against bf16 weights updated in place (torch_dtype bfloat16, no mixed precision), at two
learning rates; the mean loss of the last 50 steps and the share of weights the run never changed.
Writes bench/results/precision.json. Numbers are indicative (one run each, not interleaved).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = "single,ddp,zero1,zero2,zero2_offload,zero3,zero3_offload,fsdp2,fsdp2_offload,tp2,tp2_fsdp2"


def build(work: Path) -> tuple[str, str]:
    """A 7.5M-parameter Llama and instruction data, built offline once under work/."""
    from finetune import demo

    work.mkdir(parents=True, exist_ok=True)
    model = work / "llama7m"
    if not (model / "config.json").exists():
        tok = demo.build_tokenizer(work / "tokenizer")
        demo.build_model(
            "llama",
            model,
            tok,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
        )
    data = work / "instruction.jsonl"
    if not data.exists():
        demo.write_jsonl(demo.instruction_examples(2000, seed=3), data)
    return str(model), str(data)


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_facts(out: Path) -> dict:
    rows = rows_of(out)
    train = [r for r in rows if "loss" in r]
    memory = next((r["peak_memory"] for r in rows if "peak_memory" in r), [])
    return {
        "losses": [r["loss"] for r in train],
        "step_time_s": statistics.median([r["step_time_s"] for r in train[1:]] or [train[0]["step_time_s"]]),
        "peak_rss_gb": max((m["train_peak_rss_gb"] for m in memory), default=float("nan")),
        "compute_dtype": train[-1].get("compute_dtype"),
        "weights_dtype": train[-1].get("weights_dtype"),
    }


def parity(run_yaml: Path, out: Path, configs: str, steps: int, mixed: str | None) -> None:
    cmd = [sys.executable, "-m", "finetune", "parity", "--config", str(run_yaml), "--configs", configs]
    cmd += ["--steps", str(steps), "--output_dir", str(out), "--loss_rtol", "1", "--weight_atol", "1"]
    cmd += ["--mixed_precision", mixed] if mixed else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def layouts(work: Path, configs: str, steps: int) -> list[dict]:
    from safetensors.torch import load_file

    model, data = build(work)
    run_yaml = work / "run.yaml"
    values = {"model": model, "dataset": data, "max_seq_length": 128, "per_device_train_batch_size": 4}
    run_yaml.write_text(json.dumps({**values, "learning_rate": 1e-3, "eval_fraction": 0}))
    for mixed in ("bf16", None):
        parity(run_yaml, work / (mixed or "fp32"), configs, steps, mixed)
    base = load_file(os.path.join(model, "model.safetensors"))

    def weights(out: Path) -> dict:
        return load_file(str(out / "final" / "model.safetensors"))

    ref_dir = work / "bf16" / "single"
    ref, ref_losses = weights(ref_dir), run_facts(ref_dir)["losses"]
    den = sum(((ref[k].float() - base[k].float()) ** 2).sum() for k in ref) ** 0.5
    table = []
    for name in configs.split(","):
        bf16, fp32 = run_facts(work / "bf16" / name), run_facts(work / "fp32" / name)
        w = weights(work / "bf16" / name)
        num = sum(((w[k].float() - ref[k].float()) ** 2).sum() for k in ref) ** 0.5
        table.append(
            {
                "layout": name,
                "loss_max_rel": max(abs(a - b) / abs(a) for a, b in zip(ref_losses, bf16["losses"])),
                "update_rel_l2": float(num / den),
                "weight_max_abs": max(float((w[k].float() - ref[k].float()).abs().max()) for k in ref),
                "export_dtype": sorted({str(v.dtype).removeprefix("torch.") for v in w.values()}),
                "compute_dtype": bf16["compute_dtype"],
                "weights_dtype": bf16["weights_dtype"],
                "step_s_bf16": bf16["step_time_s"],
                "step_s_fp32": fp32["step_time_s"],
                "peak_gb_bf16": bf16["peak_rss_gb"],
                "peak_gb_fp32": fp32["peak_rss_gb"],
            }
        )
    fp32_ref = weights(work / "fp32" / "single")
    num = sum(((fp32_ref[k].float() - ref[k].float()) ** 2).sum() for k in ref) ** 0.5
    table.append(
        {
            "layout": "single fp32 vs single bf16",
            "update_rel_l2": float(num / den),
            "loss_max_rel": max(
                abs(a - b) / abs(a) for a, b in zip(ref_losses, run_facts(work / "fp32" / "single")["losses"])
            ),
        }
    )
    return table


def reduce_cost(work: Path, steps: int) -> list[dict]:
    """ZeRO-1/2/3 in bf16, GA 2, three ways: as shipped (autocast over fp32 weights, fp32 reduction), DeepSpeed's bf16
    mode with fp32 reduction and accumulation (the JSON enables bf16), and DeepSpeed's bf16 mode with its defaults."""
    import yaml

    model, data = build(work)
    run_yaml = work / "run_ga2.yaml"
    values = {"model": model, "dataset": data, "max_seq_length": 128, "per_device_train_batch_size": 4}
    run_yaml.write_text(
        json.dumps({**values, "learning_rate": 1e-3, "eval_fraction": 0, "gradient_accumulation_steps": 2})
    )
    configs = ["single"]
    for stage in ("zero1", "zero2", "zero3"):
        configs.append(stage)
        for variant in ("bf16_mode_fp32_reduce", "bf16_mode_defaults"):
            ds = json.loads((ROOT / "ds_configs" / f"{stage}.json").read_text())
            ds["bf16"] = {"enabled": True}
            if variant == "bf16_mode_defaults":
                ds.pop("communication_data_type"), ds.pop("data_types")
            (work / f"{stage}_{variant}.json").write_text(json.dumps(ds, indent=1))
            acc = yaml.safe_load((ROOT / "accelerate_configs" / f"{stage}.yaml").read_text())
            acc["deepspeed_config"]["deepspeed_config_file"] = str(work / f"{stage}_{variant}.json")
            (work / f"{stage}_{variant}.yaml").write_text(yaml.safe_dump(acc))
            configs.append(str(work / f"{stage}_{variant}.yaml"))
    parity(run_yaml, work / "reduce", ",".join(configs), steps, "bf16")
    ref = run_facts(work / "reduce" / "single")["losses"]
    out = []
    for name in configs[1:]:
        facts = run_facts(work / "reduce" / Path(name).stem)
        out.append(
            {
                "config": Path(name).stem,
                "loss_max_rel": max(abs(a - b) / abs(a) for a, b in zip(ref, facts["losses"])),
                "weights_dtype": facts["weights_dtype"],
                "step_time_s": facts["step_time_s"],
                "peak_rss_gb": facts["peak_rss_gb"],
            }
        )
    return out


def bf16_weights(work: Path, steps: int) -> list[dict]:
    import torch
    from safetensors.torch import load_file

    model, data = build(work)
    base = load_file(os.path.join(model, "model.safetensors"))
    out = []
    for lr in ("2e-5", "2e-4"):
        for label, extra in (
            ("fp32 masters, bf16 compute", ["--torch_dtype", "float32", "--mixed_precision", "bf16"]),
            ("bf16 weights, no mixed precision", ["--torch_dtype", "bfloat16", "--mixed_precision", "no"]),
        ):
            run_dir = work / "weights" / f"{lr}_{extra[1]}"
            cmd = [sys.executable, "-m", "finetune", "--model", model, "--dataset", data, "--max_seq_length", "128"]
            cmd += ["--per_device_train_batch_size", "8", "--max_steps", str(steps), "--learning_rate", lr]
            cmd += ["--lr_scheduler_type", "constant", "--eval_fraction", "0", "--logging_steps", "1"]
            cmd += ["--save_steps", "null", "--disable_tqdm", "true", "--output_dir", str(run_dir)]
            cmd += ["--overwrite_output_dir", "true", "--save_dtype", "float32", *extra]
            subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "2"}, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            losses = run_facts(run_dir)["losses"]
            final = load_file(str(run_dir / "final" / "model.safetensors"))
            held = torch.bfloat16 if extra[1] == "bfloat16" else torch.float32  # the start, as the run held it
            same = sum(int((final[k] == base[k].to(held).to(final[k].dtype)).sum()) for k in base)
            total = sum(v.numel() for v in base.values())
            out.append(
                {
                    "learning_rate": float(lr),
                    "weights": label,
                    "first_loss": losses[0],
                    "mean_loss_last_50": statistics.mean(losses[-50:]),
                    "unchanged_weights": same / total,
                }
            )
    return out


def print_table(columns: list[str], rows: list[list[str]]) -> None:
    """A markdown table (what docs/precision.md quotes); text columns left-aligned, numbers right."""
    numeric = [all(c[:1].isdigit() or c[:1] in "-." for c in col if c) for col in zip(*rows)] if rows else []
    print("\n| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---:" if n else "---" for n in numeric) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def layout_cells(r: dict) -> list[str]:
    if "export_dtype" not in r:  # the fp32-vs-bf16 row of one process: losses and update only
        return [r["layout"], f"{r['loss_max_rel']:.1e}", f"{r['update_rel_l2']:.3f}", *[""] * 6]
    ratio = r["step_s_bf16"] / r["step_s_fp32"]
    return [
        r["layout"],
        f"{r['loss_max_rel']:.1e}",
        f"{r['update_rel_l2']:.3f}",
        f"{r['weight_max_abs']:.1e}",
        "/".join(r["export_dtype"]),
        r["compute_dtype"],
        r["weights_dtype"],
        f"{r['step_s_bf16']:.3f} / {r['step_s_fp32']:.3f} ({ratio:.2f}x)",
        f"{r['peak_gb_bf16']:.2f} / {r['peak_gb_fp32']:.2f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="layouts,reduce,weights")
    parser.add_argument("--configs", default=CONFIGS)
    parser.add_argument("--steps", type=int, default=8, help="steps per layout run (default %(default)s)")
    parser.add_argument("--weight_steps", type=int, default=300, help="steps per weights run (default %(default)s)")
    parser.add_argument("--work", default=str(ROOT / ".cache" / "bench_precision"))
    opts = parser.parse_args()
    work, parts, result = Path(opts.work), opts.parts.split(","), {}
    t0 = time.time()
    if "layouts" in parts:
        result["layouts"] = layouts(work, opts.configs, opts.steps)
        print_table(
            ["layout", "loss max rel", "update rel L2", "weight max abs", "export", "compute", "weights held",
             "step s bf16 / fp32", "peak GB/rank bf16 / fp32"],
            [layout_cells(r) for r in result["layouts"]],
        )  # fmt: skip
    if "reduce" in parts:
        result["reduce"] = reduce_cost(work, opts.steps)
        print_table(
            ["config (bf16, GA 2)", "weights held", "loss max rel vs single", "step s", "peak GB/rank"],
            [[r["config"], r["weights_dtype"], f"{r['loss_max_rel']:.1e}", f"{r['step_time_s']:.3f}",
              f"{r['peak_rss_gb']:.2f}"] for r in result["reduce"]],
        )  # fmt: skip
    if "weights" in parts:
        result["weights"] = bf16_weights(work, opts.weight_steps)
        print_table(
            ["lr", "weights", "first loss", "mean loss, last 50 steps", "weights never changed"],
            [[f"{r['learning_rate']:g}", r["weights"], f"{r['first_loss']:.4f}", f"{r['mean_loss_last_50']:.4f}",
              f"{100 * r['unchanged_weights']:.1f}%"] for r in result["weights"]],
        )  # fmt: skip
    result["command"] = " ".join(sys.argv)
    result["minutes"] = (time.time() - t0) / 60
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "precision.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
