"""The baselines finetune is measured against, each written once: a bare PyTorch loop and HF Trainer.

Both run in a process of their own (`harness.run_worker(ctx, "baselines.py", "bare"|"trainer", spec, ...)`),
from the same saved model, on finetune's own tokenized rows in finetune's epoch order (EpochSampler, seed
42), with the run config's micro batch, learning rate and clipping, fp32 and the harness's thread count.

spec: {"config": run config path, "steps": N, "warmup": W, "threads": T, "collator": "default"|"seq2seq",
       "mode": "train" (default) | "eval" | "first_step", "env": {...} (the process's extra environment: the
       harness sets it), "compile": false (default) | true (Trainer: torch_compile=True; bare: torch.compile),
       "deepspeed": a DeepSpeed JSON path (Trainer only, under torchrun: gloo on CPU processes)}
  train       tokens/s per optimizer step (the first W steps dropped); Trainer: also its training-phase peak RSS
              (the largest rank's), the ranks and DeepSpeed's ZeRO stage as the engine reports it
  eval        Trainer only: `Trainer.evaluate()` twice on finetune's eval rows; prints "[baseline] eval N done"
              after each (the harness times the second from those lines)
  first_step  Trainer only: prints "[baseline] step 1 done" at the end of optimizer step 1 (the harness
              stops the process there and times it from launch)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import harness

EVAL_DONE = "[baseline] eval {} done"
FIRST_STEP_DONE = "[baseline] step 1 done"


def train_rows(spec: dict):
    """finetune's tokenized rows in finetune's epoch-0 order: what the baselines train on, batch by batch."""
    ds, tok = harness.finetune_datasets(spec["config"])
    return ds.train.select(harness.epoch_order(len(ds.train), 42)), ds.eval, tok


def worker_bare(spec: dict) -> dict:
    """A hand-written PyTorch loop: the same model, rows, batches, AdamW, linear schedule and clipping.
    `torch.optim.AdamW` with its defaults (the for-loop kernel on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.data import Collator

    torch.set_num_threads(spec["threads"])
    train, _, tok = train_rows(spec)
    cfg = json.loads(Path(spec["config"]).read_text())
    loader = torch.utils.data.DataLoader(
        train, batch_size=cfg["per_device_train_batch_size"], collate_fn=Collator(tok.pad_token_id)
    )
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["learning_rate"], weight_decay=0.0)
    if spec.get("compile"):
        model = torch.compile(model)  # after the optimizer took the parameters, as a bare loop would
    total = spec["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    per_step, losses = [], []
    t = time.perf_counter()
    for step, batch in enumerate(loader):
        tokens = int(batch.pop("num_tokens"))
        batch.pop("num_supervised"), batch.pop("num_positions"), batch.pop("num_learned")
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        now = time.perf_counter()
        per_step.append((tokens, now - t))
        t = now
        if step + 1 == total:
            break
    return {**harness.steady(per_step, spec["warmup"]), "losses": losses}


def worker_trainer(spec: dict) -> dict:
    """HF Trainer as a user writes it: TrainingArguments defaults (fused AdamW on torch >= 2.8), our rows in
    our order (`train_sampling_strategy="sequential"` over rows already in finetune's order)."""
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    from finetune.metrics import peak_memory, reset_peak_memory

    torch.set_num_threads(spec["threads"])
    mode = spec.get("mode", "train")
    train, evalset, tok = train_rows(spec)
    cfg = json.loads(Path(spec["config"]).read_text())
    keep = ("input_ids", "labels")
    train = train.remove_columns([c for c in train.column_names if c not in keep])
    if evalset is not None:
        evalset = evalset.remove_columns([c for c in evalset.column_names if c not in keep])
    micro = cfg["per_device_train_batch_size"]
    lengths = [len(x) for x in train["input_ids"]]
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            reset_peak_memory(torch.device("cpu"))  # the training phase's peak, as finetune reports its own
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())
            if state.global_step == 1:
                print(FIRST_STEP_DONE, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=micro,
            per_device_eval_batch_size=cfg.get("per_device_eval_batch_size", 8),
            max_steps=spec["steps"],
            learning_rate=cfg["learning_rate"],
            lr_scheduler_type="linear",
            weight_decay=0.0,
            max_grad_norm=cfg["max_grad_norm"],
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=42,
            use_cpu=not spec.get("deepspeed"),  # with it, accelerate would not start DeepSpeed's process group
            train_sampling_strategy="sequential",
            torch_compile=bool(spec.get("compile")),
            deepspeed=_deepspeed_config(spec.get("deepspeed")),
            ddp_backend="gloo" if spec.get("deepspeed") else None,  # DeepSpeed would pick nccl on CPU processes
        )
        # The process group before the model, as transformers' example scripts have it (they log args.device
        # first): under DeepSpeed ZeRO-3, from_pretrained partitions the weights as they load (zero.Init), which
        # needs the group's world size.
        args.device  # noqa: B018
        model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
        # "default": Trainer's own default collator (DataCollatorWithPadding; equal-length rows only).
        # "seq2seq": the usual choice for variable-length causal LM data (labels padded with -100);
        # DataCollatorWithPadding cannot pad the labels of such rows and raises.
        collator = DataCollatorForSeq2Seq(tok) if spec.get("collator") == "seq2seq" else None
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=evalset,
            processing_class=tok,
            data_collator=collator,
            callbacks=[Clock()],
        )
        if mode == "eval":
            for i in (1, 2):  # the first pays for lazy allocations; the harness times the second
                trainer.evaluate()
                print(EVAL_DONE.format(i), flush=True)
            return {"eval_tokens": sum(len(x) for x in evalset["input_ids"]), "eval_rows": len(evalset)}
        trainer.train()
        peaks = [peak_memory(torch.device("cpu"))["peak_rss_gb"]]
        engine = getattr(trainer, "deepspeed", None)
        stage = engine.zero_optimization_stage() if engine is not None else None
    if torch.distributed.is_initialized():
        peaks *= torch.distributed.get_world_size()
        torch.distributed.all_gather_object(peaks, peaks[torch.distributed.get_rank()])
        if torch.distributed.get_rank():
            return {}  # rank 0 writes the result
    times = [b - a for a, b in zip(marks, marks[1:])]
    tokens = [sum(lengths[i * micro : (i + 1) * micro]) for i in range(len(times))]
    return {
        **harness.steady(list(zip(tokens, times)), spec["warmup"]),
        "optim": str(args.optim),
        "train_peak_rss_gb": max(peaks),
        "ranks": len(peaks),
        "zero_stage": stage,
    }


def _deepspeed_config(path: str | None) -> dict | None:
    """A DeepSpeed JSON for Trainer on CPU processes, without train_batch_size: Trainer fills that "auto" with the
    world size it sees before the process group exists (1 or 2, as use_cpu goes), and DeepSpeed then refuses the
    batch; left out, DeepSpeed computes it from the micro batch, accumulation and the group's size."""
    if path is None:
        return None
    config = json.loads(Path(path).read_text())
    config.pop("train_batch_size", None)
    return config


WORKERS = {"bare": worker_bare, "trainer": worker_trainer}

if __name__ == "__main__":
    if not harness.worker_main(WORKERS):
        sys.exit("bench/baselines.py is run by the benchmarks (harness.run_worker), not on its own")
