"""GPU verification of tensor/pipeline parallelism: Megatron-LM and torch TP configs against DDP, plus `finetune parity`.

Run on a machine with >= 2 NVIDIA GPUs (4 for the TP 2 x PP 2 row), from the project root:

    .venv/bin/python bench/gpu_verify.py [--steps 10] [--work outputs/gpu_verify] [--skip_parity]

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
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Row:
    name: str
    config: str
    gpus: int
    micro: int
    ga: int
    hf_export: bool = True  # Megatron's checkpoint is not an HF model
    status: str = "ok"
    distributed_type: str = "?"
    world_size: int = 0
    losses: list[float] = field(default_factory=list)
    weights: dict | None = None
    step_time_s: float = float("nan")


# Global batch 8 everywhere: rows per data-parallel rank per step x data-parallel size.
ROWS = [
    Row("ddp", "ddp", 2, micro=4, ga=1),  # 2 replicas x 4
    Row("tp2", "tp2", 2, micro=4, ga=2),  # 1 replica (TP 2) x 4 x GA 2
    Row("megatron_tp2", "megatron_tp2", 2, micro=8, ga=1, hf_export=False),  # 1 replica x 8 x 1 micro batch
    Row("megatron_tp2_pp2", "megatron_tp2_pp2", 4, micro=2, ga=1, hf_export=False),  # 1 replica x 2 x 4 micro
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


def train(row: Row, run: Path, steps: int, out: Path, timeout: int) -> Row:
    from safetensors.torch import load_file

    from finetune.metrics import read_metrics

    target = out / row.name
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / f"{row.config}.yaml"),
        "-m",
        "finetune",
        "--config",
        str(run),
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        str(row.micro),
        "--per_device_eval_batch_size",
        str(row.micro),
        "--gradient_accumulation_steps",
        str(row.ga),
        "--logging_steps",
        "1",
        "--save_steps",
        "null",
        "--disable_tqdm",
        "true",
        "--output_dir",
        str(target),
        "--overwrite_output_dir",
        "true",
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        (out / f"{row.name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-2:])[:300]
            row.status = f"exit {proc.returncode} after {time.perf_counter() - t0:.0f} s: {tail}"
    except subprocess.TimeoutExpired:
        row.status = f"timed out after {timeout} s"
    try:
        train_rows = [r for r in read_metrics(str(target)) if "loss" in r]
    except OSError:
        return row
    if train_rows:
        row.losses = [r["loss"] for r in train_rows]
        row.distributed_type, row.world_size = train_rows[0]["distributed_type"], train_rows[0]["world_size"]
        times = [r["step_time_s"] for r in train_rows[1:]] or [r["step_time_s"] for r in train_rows]
        row.step_time_s = statistics.median(times)
    weights = target / "final" / "model.safetensors"
    if row.hf_export and weights.exists():
        row.weights = load_file(str(weights))
    return row


def compare(ref: Row, row: Row) -> tuple[float, float | None]:
    if not ref.losses or len(ref.losses) != len(row.losses):
        return float("inf"), None
    loss = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.losses, row.losses))
    if ref.weights is None or row.weights is None:
        return loss, None
    if set(ref.weights) != set(row.weights):
        return loss, float("inf")
    return loss, max(float((ref.weights[k].float() - row.weights[k].float()).abs().max()) for k in ref.weights)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--work", default="outputs/gpu_verify")
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
        print(f"gpu_verify: needs at least 2 CUDA GPUs, found {gpus}", file=sys.stderr)
        return 2
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run = build(work)
    model = json.loads(run.read_text())["model"]
    skip_megatron = megatron_skip_reason(model)
    if skip_megatron:
        print(
            f"[gpu_verify] Megatron rows skipped: {skip_megatron}. To convert (Megatron-LM checkout at $MLM):\n"
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
            print(f"[gpu_verify] {row.name}: {row.gpus} GPUs, micro {row.micro} x GA {row.ga} ...", flush=True)
            row = train(row, run, args.steps, work, args.timeout)
        rows.append(row)

    ref = rows[0]
    head = (
        f"{'config':<18} {'distributed':<12} {'world':>5} {'micro x GA':>10} {'max rel loss diff':>17} "
        f"{'max abs weight diff':>19} {'step s':>7}  status"
    )
    print("\n" + head + "\n" + "-" * len(head))
    failed = False
    for row in rows:
        skipped = row.status.startswith("SKIPPED")
        loss, weight = compare(ref, row) if row.losses else (float("nan"), None)
        bad = not skipped and (
            row.status != "ok" or not loss <= args.loss_rtol or (weight is not None and weight > args.weight_atol)
        )
        failed |= bad
        weight_text = f"{weight:.2e}" if weight is not None else "n/a"
        print(
            f"{row.name:<18} {row.distributed_type:<12} {row.world_size:>5} {f'{row.micro} x {row.ga}':>10} "
            f"{loss:>17.2e} {weight_text:>19} {row.step_time_s:>7.3f}  {row.status}{'  <-- FAIL' if bad else ''}"
        )
    print(
        f"\nreference: ddp; tolerances: loss {args.loss_rtol:g} relative, weights {args.weight_atol:g} absolute; "
        f"global batch 8 rows everywhere; logs under {work}"
    )
    if not args.skip_parity:
        print("\n[gpu_verify] finetune parity over single, ddp, zero2, zero3:", flush=True)
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
