"""One training run, start to finish: build everything from the typed config, prepare, train, export.

run(cfg)
  Accelerator (parallel.make_accelerator; the parallelism comes from `accelerate launch`)
  tokenizer -> datasets (data.build_datasets) -> model (model.build_model)
  AdamW + LR schedule (lengths from parallel.make_plan) + data loaders
  accelerator.prepare(...)
  resume (checkpoint.load_checkpoint) | fresh start
  loop.train -> checkpoint.export -> final/
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import sys

import torch
import yaml

from finetune import checkpoint, data, loop, megatron, metrics, model, parallel
from finetune.config import RUN_MARKERS, ConfigError, RunConfig

logger = logging.getLogger("finetune")


def _setup_logging(accelerator) -> None:
    import warnings

    import datasets
    import transformers

    # Known-harmless third-party warnings that would otherwise print on every step:
    # DeepSpeed calls torch.distributed collectives that torch has renamed;
    # under DeepSpeed the engine steps the optimizer, so torch cannot see that it ran before the scheduler.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")

    main = accelerator.is_main_process
    logging.basicConfig(
        format="[finetune] %(message)s" if main else f"[finetune rank{accelerator.process_index}] %(message)s",
        stream=sys.stdout,
        force=True,
    )
    logger.setLevel(logging.INFO if main else logging.WARNING)
    transformers.utils.logging.set_verbosity_warning() if main else transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.set_verbosity_warning() if main else datasets.utils.logging.set_verbosity_error()
    if not main:
        datasets.disable_progress_bars()


def _optimizer(net, t) -> torch.optim.Optimizer:
    """AdamW (torch's fused kernel, as HF Trainer uses: ~8% faster steps on CPU too); no weight decay on
    biases and norm weights (every parameter with fewer than 2 dims)."""
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        fused=True,
    )


def _scheduler(optimizer, kind: str, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers.get_scheduler's linear / cosine / constant / constant_with_warmup schedules, the same
    formulas (tests/test_train.py::test_schedules_equal_transformers checks every step). Written here
    because importing transformers.optimization imports transformers.trainer_utils and through it all
    of peft: about 1.7 s of every launch (bench/perf.py --only launch)."""

    def factor(step: int) -> float:
        if kind == "constant":
            return 1.0
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant_with_warmup":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return max(0.0, (total - step) / max(1, total - warmup))  # linear

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _clear_previous_run(output_dir: str) -> None:
    """--overwrite_output_dir: remove what a previous run left (only the files a run writes)."""
    for name in (*RUN_MARKERS, ".tmp_final"):
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def _length_aware_batches(train, sampler, plan: parallel.Plan, net) -> data.LengthAwareBatchSampler:
    """length_aware_batching: every global batch split into its GA x data-parallel micro batches of
    similar cost. Per token, attention costs about width / (6 x hidden size) of the linear layers."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(train.with_format("arrow")["input_ids"]).to_pylist()
    hidden = getattr(getattr(net, "config", None), "hidden_size", None)
    parts = plan.gradient_accumulation_steps * plan.world_size
    logger.info(
        "length-aware batching: each global batch of %d rows split into %d micro batches of similar cost",
        plan.global_batch_size,
        parts,
    )
    return data.LengthAwareBatchSampler(
        sampler, lengths, plan.global_batch_size, parts, 1 / (6 * hidden) if hidden else 0.0
    )


def run(cfg: RunConfig) -> dict:
    """Train as the config says; return the final eval metrics (empty without eval data)."""
    from accelerate.utils import gather_object, set_seed

    parallel.prepare_environment(cfg.train)
    megatron.check_before_start(cfg)  # Megatron-LM / tensor parallelism: refuse what cannot run, before anything heavy
    acc = parallel.make_accelerator(cfg.train, megatron.make_plugin(cfg), megatron.parallelism_config())
    _setup_logging(acc)
    t = cfg.train
    facts = parallel.describe(acc)
    logger.info(
        "distributed: %s, world size %d, backend %s, mixed precision %s, devices %s",
        facts["distributed_type"],
        facts["world_size"],
        facts["backend"],
        facts["mixed_precision"],
        ", ".join(facts["devices"]),
    )

    sizes = megatron.describe_layout(acc)
    if sizes["tp"] > 1 or sizes["pp"] > 1:
        logger.info("model parallel: tensor %d x pipeline %d, data parallel %d", sizes["tp"], sizes["pp"], sizes["dp"])
    model.check_peft_support(cfg.peft)
    tokenizer = model.load_tokenizer(cfg.model)
    ds = data.build_datasets(cfg.data, cfg.model.task, tokenizer, t.seed, acc.main_process_first)
    eval_metrics = metrics.load_metrics(t.metrics, cfg.model.task) if ds.eval is not None else {}
    plan = parallel.make_plan(t, len(ds.train), megatron.data_parallel(acc)[1], acc.num_processes)
    logger.info(
        "data: %s format, %d train rows (%d supervised %s), %s eval rows",
        ds.format,
        len(ds.train),
        ds.supervised_tokens,
        "examples" if cfg.model.task == "classification" else "tokens",
        len(ds.eval) if ds.eval is not None else "no",
    )
    logger.info(
        "batch: micro %d x gradient accumulation %d x world size %d = global batch %d; "
        "%d steps (%d per epoch), warmup %d",
        plan.micro_batch_size,
        plan.gradient_accumulation_steps,
        plan.world_size,
        plan.global_batch_size,
        plan.total_steps,
        plan.steps_per_epoch,
        plan.warmup_steps,
    )

    peft_on = cfg.peft.method != "none"
    here = parallel.layout(acc, plan.global_batch_size)
    saved, portable = None, False
    resume_path = checkpoint.resolve_resume(t.output_dir, t.resume_from_checkpoint)
    if resume_path:
        saved = checkpoint.read_trainer_state(resume_path)
        portable = checkpoint.needs_portable_resume(saved, here)
        if portable:
            checkpoint.check_portable_resume(resume_path, saved, here, plan.global_batch_size)
    model_args = cfg.model
    if portable and not peft_on:  # weights from the checkpoint's full copy, through from_pretrained (ZeRO-3 aware)
        model_args = dataclasses.replace(cfg.model, model=checkpoint.portable_model_dir(resume_path, saved))

    set_seed(t.seed)  # same initial weights (e.g. a new classifier head) on every rank and world size
    net = model.build_model(
        model_args,
        tokenizer,
        ds.label_names,
        cfg.data.max_seq_length,
        cfg.peft,
        reentrant_checkpointing=parallel.reentrant_checkpointing(acc, peft_on),
        extra_kwargs=megatron.tp_model_kwargs(acc),
    )
    if portable and peft_on:  # the run's own base model; the adapter's weights from the checkpoint
        checkpoint.load_portable_adapter(net, resume_path, saved)
    net = parallel.maybe_sync_batchnorm(net, t, acc)
    trainable, total = model.count_parameters(net)
    logger.info(
        "model: %s (%s), %s parameters, %s trainable (%.2f%%)",
        cfg.model.model,
        type(net).__name__,
        f"{total:,}",
        f"{trainable:,}",
        100 * trainable / max(total, 1),
    )
    optimizer = _optimizer(net, t)
    warmup, length = plan.scheduler_steps
    scheduler = _scheduler(optimizer, t.lr_scheduler_type, warmup, length)

    collate = data.Collator(tokenizer.pad_token_id)
    sampler = data.EpochSampler(len(ds.train), t.seed)
    if cfg.data.length_aware_batching:
        batches = {"batch_sampler": _length_aware_batches(ds.train, sampler, plan, net)}
    else:
        batches = {"batch_size": plan.micro_batch_size, "sampler": sampler, "drop_last": True}
    train_loader = torch.utils.data.DataLoader(
        ds.train,
        **batches,
        collate_fn=collate,
        num_workers=t.dataloader_num_workers,
        generator=torch.Generator().manual_seed(t.seed),
    )
    eval_loader = None
    if ds.eval is not None:
        eval_loader = torch.utils.data.DataLoader(
            ds.eval,
            batch_size=t.per_device_eval_batch_size,
            shuffle=False,
            collate_fn=collate,
            num_workers=t.dataloader_num_workers,
        )
    parallel.fill_deepspeed_micro_batch(acc, plan.micro_batch_size)
    net, optimizer, train_loader, scheduler = acc.prepare(net, optimizer, train_loader, scheduler)
    if megatron.tp_enabled(acc):
        megatron.enable_tp_checkpointing(acc, net, optimizer)
    if eval_loader is not None:
        eval_loader = acc.prepare(eval_loader)

    run_config = cfg.to_flat()
    log = metrics.MetricsLog(t.output_dir, enabled=acc.is_main_process)
    state = loop.TrainState()
    if resume_path:
        if portable:
            checkpoint.load_portable_optimizer(acc, net, optimizer, resume_path, saved, here)
            checkpoint.set_scheduler_position(scheduler, saved["step"], acc.num_processes)
        else:
            saved = checkpoint.load_checkpoint(acc, resume_path)
        state = loop.TrainState(**{f.name: saved[f.name] for f in dataclasses.fields(loop.TrainState)})
        log.truncate_after(state.step)
        was = saved["layout"]
        logger.info(
            "resumed from %s at step %d%s",
            resume_path,
            state.step,
            f" (written by {was['distributed_type']} ZeRO-{was['zero_stage']} on {was['world_size']} "
            "process(es), converted)"
            if portable
            else "",
        )
    elif acc.is_main_process:
        if t.overwrite_output_dir or t.resume_from_checkpoint == "auto":  # auto: nothing checkpointed yet
            _clear_previous_run(t.output_dir)
        os.makedirs(t.output_dir, exist_ok=True)
        with open(os.path.join(t.output_dir, checkpoint.CONFIG_FILE), "w") as f:
            yaml.safe_dump(run_config, f, sort_keys=False)
    acc.wait_for_everyone()
    if t.report_to:
        acc.init_trackers(
            "finetune", config={k: v for k, v in run_config.items() if isinstance(v, (int, float, str, bool))}
        )

    def save(s: loop.TrainState) -> None:
        trainer_state = {**loop.state_dict_of(s), "layout": here}
        checkpoint.save_checkpoint(
            acc, net, optimizer, t.output_dir, s.step, trainer_state, run_config, t.save_total_limit
        )

    flops = metrics.flops_per_token(acc.unwrap_model(net), cfg.data.max_seq_length)
    peak = metrics.peak_flops(acc.device, acc.mixed_precision)
    peak = peak * acc.num_processes if peak else None
    if peak:
        logger.info(
            "MFU reference: %.3g model FLOPs per token; peak %.0f GFLOP/s over %d device(s)",
            flops,
            peak / 1e9,
            acc.num_processes,
        )
    r = loop.Run(
        accelerator=acc,
        model=net,
        optimizer=optimizer,
        scheduler=scheduler,
        train_loader=train_loader,
        sampler=sampler,
        eval_loader=eval_loader,
        plan=plan,
        args=t,
        task=cfg.model.task,
        metrics=eval_metrics,
        n_labels=len(ds.label_names) if ds.label_names else None,
        log=log,
        save=save,
        extra={"world_size": acc.num_processes, "distributed_type": facts["distributed_type"]},
        flops_per_token=flops,
        peak_flops=peak,
    )
    startup = metrics.peak_memory(acc.device)  # loading and preparing
    metrics.reset_peak_memory(acc.device)
    try:
        final_eval = loop.train(r, state)
    except RuntimeError as e:
        fix = parallel.explain_ddp_error(e)
        if fix:
            raise ConfigError([("ddp_find_unused_parameters", fix)]) from None
        raise
    training = metrics.peak_memory(acc.device)
    metrics.reset_peak_memory(acc.device)
    save(state)  # the end-of-run checkpoint (a resume of a finished run starts from here)
    final = checkpoint.export(acc, net, tokenizer, run_config, t.output_dir)
    if cfg.peft.merge:
        if acc.is_main_process:
            merged = checkpoint.merge_adapter(final, os.path.join(final, "merged"))
            logger.info("merged model saved to %s", os.path.abspath(merged))
        acc.wait_for_everyone()
    phases = {"startup": startup, "train": training, "save_export": metrics.peak_memory(acc.device)}
    mine = {f"{phase}_{k}": v for phase, m in phases.items() for k, v in m.items()}
    memories = gather_object([{"rank": acc.process_index, **mine}])
    log.write({"step": state.step, "peak_memory": memories})
    for m in memories:
        text = ", ".join(f"{k.removesuffix('_gb')} {v:.2f}" for k, v in m.items() if k != "rank")
        logger.info("peak memory rank %d (GB): %s", m["rank"], text)
    if final_eval:
        logger.info("final eval: %s", "  ".join(f"{k} {v:.4f}" for k, v in final_eval.items()))
    how = "PeftModel.from_pretrained on the base model" if peft_on else "from_pretrained"
    logger.info("model saved to %s (load it with %s)", os.path.abspath(final), how)
    acc.end_training()
    return final_eval
