"""Benchmark: step time and training-phase peak memory per rank, DDP vs ZeRO-1/2/3 (+offload).

A ~110M-parameter Llama (fp32, 2 ranks, 1 thread each), the same run under each Accelerate
config through `finetune parity` (so the losses are checked equal too), then one table with
ratios to DDP. Prints the table and writes bench/results/zero_memory.json.

    .venv/bin/python bench/zero_memory.py [--steps 8] [--configs ddp,zero1,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def build(work: Path) -> Path:
    from finetune import demo

    tok = demo.build_tokenizer(work / "tokenizer")
    model = demo.build_model(
        "llama",
        work / "model",
        tok,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=16000,
    )
    rows = [{"text": " ".join(e["text"] for e in demo.topic_examples(40, seed=i))} for i in range(300)]
    data = demo.write_jsonl(rows, work / "text.jsonl")
    run = work / "run.yaml"
    run.write_text(
        json.dumps(
            {
                "model": model,
                "dataset": data,
                "format": "text",
                "max_seq_length": 256,
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 1,
                "learning_rate": 1e-4,
                "eval_fraction": 0,
            }
        )
    )
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--configs", default="ddp,zero1,zero2,zero2_offload,zero3,zero3_offload")
    parser.add_argument("--work", default=str(ROOT / ".cache" / "bench_zero"))
    args = parser.parse_args()
    from finetune import parity

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    run = build(work)
    ns = argparse.Namespace(
        config=str(run), steps=args.steps, timeout=1800, loss_rtol=1e-4, weight_atol=1e-5, output_dir=str(work / "runs")
    )
    outcomes = []
    for name in args.configs.split(","):
        print(f"[bench] {name} ...", flush=True)
        outcomes.append(parity.run_one(name, parity.accelerate_config_path(name), 1, ns, [], work / "runs"))
    parity.report(outcomes, ns)
    ref = next(o for o in outcomes if o.name == "ddp" and o.ok)
    print(f"\n{'config':<15} {'step s':>7} {'x DDP':>6} {'train peak GB/rank':>19} {'x DDP':>6}")
    table = []
    for o in outcomes:
        if not o.ok:
            continue
        mem, ref_mem = max(o.peak_rss_gb), max(ref.peak_rss_gb)
        table.append(
            {
                "config": o.name,
                "step_s": o.step_time_s,
                "step_x_ddp": o.step_time_s / ref.step_time_s,
                "train_peak_gb": o.peak_rss_gb,
                "mem_x_ddp": mem / ref_mem,
            }
        )
        print(
            f"{o.name:<15} {o.step_time_s:>7.2f} {o.step_time_s / ref.step_time_s:>6.2f} {mem:>19.2f} "
            f"{mem / ref_mem:>6.2f}"
        )
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "zero_memory.json").write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
