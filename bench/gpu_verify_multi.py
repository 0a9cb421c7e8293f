"""GPU verification of tensor/pipeline parallelism: Megatron-LM and torch TP configs against DDP, plus `finetune parity`.

Run on a machine with >= 2 NVIDIA GPUs (4 for the TP 2 x PP 2 row), from the project root:

    .venv/bin/python bench/gpu_verify_multi.py [--steps 10] [--work outputs/gpu_verify] [--skip_parity]

What it does:
  1. builds a small Llama (8 heads, 4 layers: divisible by TP 2 and PP 2) and fixed-length text data, offline;
  2. trains it for --steps optimizer steps under each config below with the SAME global batch of 8 rows
     (the per-rank micro batch and accumulation are chosen per layout), and compares per-step losses
     (and, where the export is an HF model, the final weights) with the DDP run;
  3. runs `finetune parity` over single, ddp, zero2, zero3 (the standard cross-backend check);
  4. prints one table; exits 1 if a row is above tolerance or failed.

Megatron rows need Megatron-LM installed and the model converted to Megatron's layout at <model>/megatron
(docs/megatron.md); without them the row says SKIPPED and why (the conversion command is printed).
Text data in fixed-length blocks supervises every token, so Megatron's per-micro-batch loss averaging and
finetune's token-weighted mean are the same number: a difference is a real difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import harness

from finetune.commands import parity

ROOT = harness.ROOT


@dataclass
class Row:
    name: str
    config: str
    gpus: int
    micro: int
    ga: int
    status: str = "ok"
    outcome: parity.Outcome | None = None


# Global batch 8 everywhere: rows per data-parallel rank per step x data-parallel size.
ROWS = [
    Row("ddp", "ddp", 2, micro=4, ga=1),  # 2 replicas x 4
    Row("tp2", "tp2", 2, micro=4, ga=2),  # 1 replica (TP 2) x 4 x GA 2
    Row("megatron_tp2", "megatron_tp2", 2, micro=8, ga=1),  # 1 replica x 8 x 1 micro batch (no HF export)
    Row("megatron_tp2_pp2", "megatron_tp2_pp2", 4, micro=2, ga=1),  # 1 replica x 2 x 4 micro batches
]


def build(work: Path) -> Path:
    from finetune import demo

    tok = demo.build_tokenizer(work / "tokenizer")
    model = demo.build_model(
        "llama",
        work / "model",
        tok,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=32,  # given: demo.build_model sets attributes after the config derived head_dim
    )
    rows = [{"text": " ".join(e["text"] for e in demo.topic_examples(40, seed=i))} for i in range(200)]
    data = demo.write_jsonl(rows, work / "text.jsonl")
    run = work / "run.yaml"
    run.write_text(
        json.dumps(
            {
                "model": model,
                "dataset": data,
                "format": "text",
                "max_seq_length": 128,
                "learning_rate": 1e-4,
                "eval_fraction": 0.05,
            }
        )
    )
    return run


def megatron_skip_reason(model: str) -> str | None:
    from finetune.parallel import megatron

    missing = megatron.megatron_lm_missing()
    if missing:
        return f"Megatron-LM not installed ({missing})"
    if not os.path.isfile(os.path.join(megatron.converted_checkpoint(model), "latest_checkpointed_iteration.txt")):
        return f"no converted checkpoint at {megatron.converted_checkpoint(model)} (docs/megatron.md)"
    return None


def train(row: Row, args: argparse.Namespace, out: Path) -> Row:
    """The run under the row's layout, through `finetune parity`'s runner (same launch, metrics and weights)."""
    micro = ["--per_device_train_batch_size", str(row.micro), "--per_device_eval_batch_size", str(row.micro)]
    path = parity.accelerate_config_path(row.config)
    row.outcome = parity.run_one(row.name, path, row.ga, args, micro, out)
    if not row.outcome.ok:
        row.status = row.outcome.error
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--work", default="outputs/gpu_verify_multi")
    parser.add_argument(
        "--loss_rtol", type=float, default=1e-3, help="GPU kernels differ by layout; default %(default)s"
    )
    parser.add_argument("--weight_atol", type=float, default=1e-4)
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--skip_parity", action="store_true", help="do not run `finetune parity` afterwards")
    args = parser.parse_args()

    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"gpu_verify_multi: needs at least 2 CUDA GPUs, found {gpus}", file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run = build(work)
    args.config = str(run)
    model = json.loads(run.read_text())["model"]
    skip_megatron = megatron_skip_reason(model)
    if skip_megatron:
        print(
            f"[gpu_verify_multi] Megatron rows skipped: {skip_megatron}. To convert (Megatron-LM checkout at $MLM):\n"
            f"  python $MLM/tools/checkpoint/convert.py --model-type GPT --loader llama_mistral --saver mcore "
            f"--checkpoint-type hf --model-size llama3 --load-dir {model} --save-dir {model}/megatron "
            f"--tokenizer-model {model} --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1",
            flush=True,
        )
    rows = []
    for row in ROWS:
        if row.gpus > gpus:
            row.status = f"SKIPPED: needs {row.gpus} GPUs, found {gpus}"
        elif row.config.startswith("megatron") and skip_megatron:
            row.status = f"SKIPPED: {skip_megatron}"
        else:
            print(f"[gpu_verify_multi] {row.name}: {row.gpus} GPUs, micro {row.micro} x GA {row.ga} ...", flush=True)
            row = train(row, args, work)
        rows.append(row)

    ref = rows[0]
    head = (
        f"{'config':<18} {'distributed':<12} {'world':>5} {'micro x GA':>10} {'max rel loss diff':>17} "
        f"{'max abs weight diff':>19} {'step s':>7}  status"
    )
    print("\n" + head + "\n" + "-" * len(head))
    failed = False
    for row in rows:
        o = row.outcome if row.outcome and row.outcome.ok else parity.Outcome(row.name, False)
        ok_ref = ref.outcome if ref.outcome and ref.outcome.ok else None
        loss, weight = parity.compare(ok_ref, o) if ok_ref and o.ok else (float("nan"), None)
        bad = not row.status.startswith("SKIPPED") and (
            row.status != "ok" or not loss <= args.loss_rtol or (weight is not None and weight > args.weight_atol)
        )
        failed |= bad
        weight_text = f"{weight:.2e}" if weight is not None else "n/a"
        print(
            f"{row.name:<18} {o.distributed_type:<12} {o.world_size:>5} {f'{row.micro} x {row.ga}':>10} "
            f"{loss:>17.2e} {weight_text:>19} {o.step_time_s:>7.3f}  {row.status}{'  <-- FAIL' if bad else ''}"
        )
    print(
        f"\nreference: ddp; tolerances: loss {args.loss_rtol:g} relative, weights {args.weight_atol:g} absolute; "
        f"global batch 8 rows everywhere; logs under {work}"
    )
    if not args.skip_parity:
        print("\n[gpu_verify_multi] finetune parity over single, ddp, zero2, zero3:", flush=True)
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "finetune",
                "parity",
                "--config",
                str(run),
                "--steps",
                str(args.steps),
                "--configs",
                "single,ddp,zero2,zero3",
                "--output_dir",
                str(work / "parity"),
            ],
            cwd=ROOT,
        )
        failed |= code != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
