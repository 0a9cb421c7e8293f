"""One training run, start to finish, as a short sequence of builders.

run(cfg)
  start          the Accelerator (the parallelism comes from `accelerate launch`), its Topology and backend
  data           tokenizer -> datasets -> Plan (all step arithmetic) -> the generation eval (if asked)
  model          the model (from the checkpoint's full weights when resuming under another layout)
  optimization   AdamW + LR schedule, data loaders, backend.prepare
  restore        resume (exact, or converted from another layout) | a fresh output_dir
  loop.train     -> the end-of-run checkpoint -> export.export -> final/
Backend differences are in finetune/parallel/, never here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from accelerate.utils import set_seed

from finetune import (
    best,
    checkpoint,
    chunked_loss,
    cluster,
    console,
    data,
    export,
    generate,
    loop,
    memory,
    metrics,
    mixture,
    model,
    optim,
    parallel,
    preference,
    prepared,
    report,
    watchdog,
)
from finetune.config import RUN_MARKERS, ConfigError, RunConfig
from finetune.config.preflight import LATEST, latest_missing, restarts_its_start, resumes_elsewhere
from finetune.stop import Preempted, agreed_signal

logger = logging.getLogger("finetune")
# why checkpoint.remove_half_written removed a path: what the resume (or --overwrite_output_dir) logs
LEFT_BY_A_STOPPED_RUN = (
    "a checkpoint the stopped run did not finish writing (or the old copy of a checkpoint or of final/ it was removing)"
)


def run(cfg: RunConfig) -> dict:
    """Train as the config says; return the final eval metrics (empty without eval data)."""
    acc, backend, storage = start(cfg)
    try:
        return _run(cfg, acc, backend, storage)
    finally:
        backend.close()  # what the backend started beside this rank ends with the run, finished or failed


def _run(cfg: RunConfig, acc, backend, storage) -> dict:
    cluster.fetch_model(acc, cfg.model.model)
    tokenizer = model.load_tokenizer(cfg.model)
    ds, plan, eval_metrics = build_data(cfg, acc, backend.topology, tokenizer)
    generation = generate.build_generation(cfg, ds, tokenizer)  # before the model: bad input fails fast
    layout = backend.layout(plan)
    resume = find_resume(cfg, acc, storage, layout)
    net, facts = build_model(cfg, backend, tokenizer, ds, resume)
    estimate = memory.run_estimate(cfg, acc, backend, net)  # logged; compared at the end
    parts = build_optimization(cfg, acc, backend, net, ds, plan, tokenizer)
    state = restore_or_start(cfg, acc, backend, parts, plan, resume, storage)
    with_references(cfg, acc, backend, parts, ds, tokenizer, state.step, storage)
    console.attach(cfg.train.output_dir)  # output_dir is this run's now: the rank's log goes there
    run_config = cfg.to_flat()
    t = cfg.train
    ckpt = checkpoint.Checkpointer(
        acc,
        backend,
        parts.model,
        parts.optimizer,
        t.output_dir,
        run_config,
        layout,
        t.save_total_limit,
        storage.writes,
        tokenizer,
    )
    r = build_loop(cfg, acc, backend, parts, ds, plan, facts, ckpt, eval_metrics, generation)
    facts = report.RunFacts(
        data_format=ds.format,
        train_rows=None if ds.streamed else len(ds.train),
        eval_rows=len(ds.eval) if ds.eval is not None else 0,
        label_names=ds.label_names,
        estimate=memory.train_peak_estimate(estimate, acc.device),
    )
    return train_and_export(cfg, r, state, tokenizer, run_config, facts)


def start(cfg: RunConfig):
    """The Accelerator, logging, the backend that knows how this run is spread, and where its files go."""
    console.setup(progress_bars=not cfg.train.disable_tqdm)  # before the Accelerator: DeepSpeed's import already logs
    model.check_peft_support(cfg.peft)
    problems = report.tracker_problems(cfg.train.report_to) + model.packing_problems(cfg.model, cfg.data.packing)
    if os.environ.get("RANK", "0") == "0":  # one question to the Hub per job
        problems += report.hub_preflight(cfg)
    if problems:
        raise ConfigError(problems)
    acc = parallel.make_accelerator(cfg)
    cluster.start_host_group(acc.num_processes, cfg.train.host_wait_timeout)
    console.set_main(acc.is_main_process)
    backend = parallel.make_backend(acc, cfg)
    facts = parallel.describe(acc, backend.mixed_precision)
    logger.info(
        "distributed: %s, world size %d, backend %s, mixed precision %s, devices %s",
        facts["distributed_type"],
        facts["world_size"],
        facts["backend"],
        facts["mixed_precision"],
        ", ".join(facts["devices"]),
    )
    if facts["world_size"] > 1:
        logger.info(
            "collectives wait %s s for a rank (ddp_timeout), the host waits for one process's work %s s "
            "(host_wait_timeout)",
            facts["collective_timeout_s"] or "torch's default",
            facts["host_wait_timeout_s"],
        )
    if facts["restart"]:
        logger.info(
            "restart %d of at most %d of this launch (--max_restarts): the previous attempt failed (its message is "
            "above)",
            facts["restart"],
            facts["max_restarts"],
        )
    topo = backend.topology
    logger.info("parallelism: %s", topo.summary())
    if acc.device.type == "cpu":
        logger.info("CPU allocator: %s (cpu_allocator)", parallel.set_cpu_allocator(cfg.train.cpu_allocator))
    if topo.num_machines > 1:
        logger.info(cluster.describe(acc, topo.num_machines))
    storage = cluster.probe_storage(acc, cfg.train.output_dir, topo.num_machines)
    if storage.node_local:
        backend.keep_checkpoints_per_machine()
    if topo.num_machines > 1:
        logger.info(cluster.describe_storage(storage, cfg.train.output_dir, topo.num_machines))
    return acc, backend, storage


def find_resume(cfg: RunConfig, acc, storage, layout) -> checkpoint.Resume | None:
    """The checkpoint to continue from: the newest intact one (each copy checksummed once, by the process that
    writes it), the same on every machine, and a run config that may continue it (changes said)."""
    t = cfg.train
    path, skipped = cluster.from_writer(acc, storage, lambda: checkpoint.choose(t.output_dir, t.resume_from_checkpoint))
    for bad, why in skipped:
        logger.warning("skipped checkpoint %s: %s", bad, why)
    if path and t.resume_from_checkpoint in (LATEST, "auto") and latest_missing(t.output_dir):
        logger.warning(
            "%s is missing (the run stopped after completing a checkpoint and before naming it): resuming from the "
            "newest intact checkpoint",
            os.path.join(checkpoint.checkpoints_dir(t.output_dir), LATEST),
        )
    cluster.agree_on_resume(acc, path)
    resume = checkpoint.find_resume(path, layout, cfg.to_flat())
    if resume:
        best.locate_best(resume.saved, resume.path, t, resumes_elsewhere(t))
    for key, was, now in resume.changes if resume else []:
        logger.info("resume: %s changed from %r to %r (applied)", key, was, now)
    return resume


def build_data(cfg: RunConfig, acc, topology: parallel.Topology, tokenizer):
    """Tokenized datasets (each machine's local main first, the others from the cache), the Plan, the eval metrics."""
    t = cfg.train
    node_first = functools.partial(cluster.node_first, acc)
    if cfg.data.prepared_data:
        ds = prepared.load(cfg, tokenizer)
    elif cfg.data.streaming:
        ds = data.build_stream(cfg.data, cfg.model.task, tokenizer, t.seed, node_first)
    else:
        base_labels = model.base_label_names(cfg.model)
        ds = mixture.build_mixture_datasets(cfg.data, cfg.model.task, tokenizer, t.seed, node_first, base_labels)
    if (ds.format == "preference") != (t.method != "sft"):
        fix = "set method: dpo (or ipo, orpo, simpo)" if t.method == "sft" else "give {prompt, chosen, rejected} data"
        raise ConfigError([("method", f"method {t.method} cannot train {ds.format} data; {fix}")])
    eval_metrics = metrics.load_metrics(t.metrics, cfg.model.task) if ds.eval is not None else {}
    plan = parallel.make_plan(t, None if ds.streamed else len(ds.train), topology)
    data_key = "prepared_data" if cfg.data.prepared_data else "dataset"
    cluster.agree_on_data(topology.num_machines, {**ds.content(), "optimizer steps": plan.total_steps}, data_key)
    if t.profile_window and t.profile_window[1] > plan.total_steps:
        fix = f"the run takes {plan.total_steps} optimizer steps; profile steps within them, or raise max_steps"
        raise ConfigError([("profile_steps", f"{t.profile_steps} ends after the last step: {fix}")])
    eval_rows = len(ds.eval) if ds.eval is not None else "no"
    if ds.streamed:
        logger.info("data: %s format, train rows streamed, %s eval rows", ds.format, eval_rows)
    else:
        logger.info(
            "data: %s format, %d train rows (%d supervised %s), %s eval rows",
            ds.format,
            len(ds.train),
            ds.supervised_tokens,
            "pairs" if ds.format == "preference" else "examples" if cfg.model.task == "classification" else "tokens",
            eval_rows,
        )
    logger.info("batch: %s", plan.describe())
    if not t.save_steps:
        logger.info("checkpoints: none (save_steps null), but where a stop signal asks for one; final/ is written")
    return ds, plan, eval_metrics


def build_model(cfg: RunConfig, backend, tokenizer, ds: data.Datasets, resume: checkpoint.Resume | None):
    """The model for the task (weights from the checkpoint's full copy when converting a resume) and its facts."""
    peft_on = cfg.peft.method != "none"
    model_args = cfg.model
    if resume and resume.portable and not peft_on:  # through from_pretrained: every backend's loading path
        model_args = dataclasses.replace(cfg.model, model=resume.model_dir())
    blocker = backend.chunked_loss_blocker()
    if blocker and model_args.chunked_loss == "auto":
        logger.info("chunked loss off (chunked_loss auto): %s", blocker)
        model_args = dataclasses.replace(model_args, chunked_loss="false")
    set_seed(cfg.train.seed)  # same initial weights (e.g. a new classifier head) on every layout
    net = model.build_model(
        model_args,
        tokenizer,
        ds.label_names,
        cfg.data.max_seq_length,
        cfg.peft,
        reentrant_checkpointing=backend.reentrant_checkpointing(peft_on),
        extra_kwargs=backend.model_kwargs(),
        load_weights=backend.needs_hf_weights,
        micro_batch_tokens=_batch_tokens(cfg, cfg.train.per_device_train_batch_size),
        eval_batch_tokens=_batch_tokens(cfg, cfg.train.per_device_eval_batch_size),
        numel=backend.numel,
        mixed_precision=backend.mixed_precision,
    )
    if resume and resume.portable and peft_on:  # the run's own base model; the adapter's weights by name
        checkpoint.restore_adapter(backend, net, resume)
    net = backend.place_model(net)
    half = {str(p.dtype).removeprefix("torch.") for p in net.parameters() if p.requires_grad and p.element_size() == 2}
    if half and not backend.fp32_master_weights():
        logger.warning(
            "updating %s weights in place, with no fp32 master weights: AdamW updates smaller than the weights' "
            "resolution (1/256 of their size in bfloat16) are lost. Measured on a 7.5M Llama at learning rate 2e-5 "
            "(docs/precision.md): %s. Load the weights in float32 (torch_dtype: float32; the compute stays 16-bit "
            "with mixed_precision), or train an adapter (peft.method: lora), which keeps its own weights in fp32",
            "/".join(sorted(half)),
            model.BF16_WEIGHTS_EVIDENCE,
        )
    facts = model.ModelFacts.of(net, backend.numel, cfg.data.max_seq_length)
    logger.info(
        "model: %s (%s), %s parameters, %s trainable (%.2f%%), %.3g FLOPs per token%s",
        cfg.model.model,
        type(net).__name__,
        f"{facts.total:,}",
        f"{facts.trainable:,}",
        100 * facts.trainable / max(facts.total, 1),
        facts.flops_per_token,
        f" + {facts.flops_per_learned:.3g} per learned position (the LM head)" if facts.head else "",
    )
    return net, facts


@dataclass
class Prepared:
    """What backend.prepare returned, plus the eval loader and the sampler that orders every epoch."""

    model: Any
    optimizer: Any
    train_loader: Any
    scheduler: Any
    eval_loader: Any | None
    sampler: mixture.MixtureSampler | data.StreamedRows  # set_epoch(epoch): the order of every epoch
    references: preference.References  # preference pairs: the reference log-probs the collators add
    live_reference: Any = None  # reference: live: a batch's reference log-probs (preference.live_reference)


def build_optimization(cfg: RunConfig, acc, backend, net, ds: data.Datasets, plan, tokenizer) -> Prepared:
    """AdamW, the LR schedule, the data loaders, all through backend.prepare."""
    t = cfg.train
    optimizer = optim.build_optimizer(net, t, backend.mixed_precision)
    warmup, length = plan.scheduler_steps
    scheduler = optim.build_scheduler(optimizer, t.lr_scheduler_type, warmup, length)
    references = preference.References()  # preference pairs: filled before training (with_references)
    positions = chunked_loss.installed(backend.hf_model(net))  # its LM head runs on the supervised positions only

    def collate(split: str) -> data.Collator:
        lookup = functools.partial(references.lookup, split) if ds.format == "preference" else None
        return data.Collator(
            tokenizer.pad_token_id, encoder_decoder=cfg.model.task == "seq2seq", references=lookup, positions=positions
        )

    # The epoch's order: the stream's own seeded one (accelerate keeps each rank's micro batches: StreamedRows), or
    # the sources' (one source: EpochSampler's).
    sampler = ds.train if ds.streamed else mixture.MixtureSampler.of(ds, t.seed)
    if ds.streamed:
        batches = {"batch_size": plan.loader_batch_size, "drop_last": True}
    elif cfg.data.length_aware_batching:
        batches = {"batch_sampler": _length_aware_batches(ds.train, sampler, plan, net)}
    else:
        batches = {"batch_size": plan.loader_batch_size, "sampler": sampler, "drop_last": True}
    gpu = acc.device.type == "cuda"
    workers = (2 if gpu and not ds.streamed else 0) if t.dataloader_num_workers is None else t.dataloader_num_workers
    loading = {
        "num_workers": workers,
        "pin_memory": gpu,  # host-to-device copies from pinned memory
        "persistent_workers": workers > 0,  # the same workers every epoch and every evaluation: no restart cost
    }
    generator = torch.Generator().manual_seed(t.seed)
    train_loader = torch.utils.data.DataLoader(
        ds.train, **batches, **loading, collate_fn=collate("train"), generator=generator
    )
    eval_loader = None
    if ds.eval is not None:
        eval_loader = torch.utils.data.DataLoader(
            ds.eval, batch_size=t.per_device_eval_batch_size, shuffle=False, **loading, collate_fn=collate("eval")
        )
    net, optimizer, train_loader, eval_loader, scheduler = backend.prepare(
        net, optimizer, train_loader, eval_loader, scheduler, plan
    )
    return Prepared(net, optimizer, train_loader, scheduler, eval_loader, sampler, references)


def with_references(cfg: RunConfig, acc, backend, p: Prepared, ds: data.Datasets, tokenizer, step: int, storage):
    """dpo/ipo: the starting model's log-probs of every pair, computed once by the prepared model (read back on a
    resume) and handed to the collators: training holds one model."""
    objective = preference.Objective.of(cfg.train)
    if objective is None or not objective.needs_reference:
        return
    if cfg.train.reference == "live":
        p.live_reference = live_reference(cfg, backend, p, tokenizer)
        return
    collate = data.Collator(tokenizer.pad_token_id, positions=chunked_loss.installed(backend.hf_model(p.model)))
    tables = preference.load_or_compute_references(
        acc, backend, p.model, ds, collate, cfg.train.per_device_eval_batch_size,
        cfg.train.output_dir, step, storage.writes, preference.references_made_from(ds, cfg.model.model),
    )  # fmt: skip
    p.references.train, p.references.eval = tables["train"], tables.get("eval")


def live_reference(cfg: RunConfig, backend, p: Prepared, tokenizer):
    """reference: live. With a new adapter: the policy itself with the adapter disabled (a continued one,
    peft.adapter, is refused at start: disabled, it is not the starting model). Without: a frozen copy of the
    starting model, loaded as the policy was and placed by the backend as it places the policy (sharded under ZeRO-3
    and FSDP2, on each device under DDP)."""
    if cfg.peft.method != "none":
        assert not cfg.peft.adapter, "config.rules refuses reference: live with peft.adapter"
        logger.info("reference log-probs: live, the base model with the adapter disabled, in each micro batch")
        return preference.live_reference(backend, p.model, adapter=True)
    # the policy's chunked loss too: the frozen copy's answer log-probs a chunk at a time, per training micro batch
    chunked = "true" if chunked_loss.chunks(backend.hf_model(p.model)) else "false"
    forward_only = dataclasses.replace(cfg.model, chunked_loss=chunked, gradient_checkpointing=False)
    frozen = model.build_model(
        forward_only,
        tokenizer,
        None,
        cfg.data.max_seq_length,
        extra_kwargs=backend.model_kwargs(),
        eval_batch_tokens=_batch_tokens(cfg, cfg.train.per_device_train_batch_size),
        numel=backend.numel,
    )
    frozen = backend.prepare_frozen(frozen)
    logger.info("reference log-probs: live, a frozen copy of the starting model, in each micro batch")
    return preference.live_reference(backend, frozen, adapter=False)


def _batch_tokens(cfg: RunConfig, batch_size: int) -> int:
    """The most tokens a batch of `batch_size` examples holds (a preference pair is two rows: chosen, rejected)."""
    return cfg.train.rows_per_example * batch_size * cfg.data.max_seq_length


def _length_aware_batches(train, sampler, plan: parallel.Plan, net) -> data.LengthAwareBatchSampler:
    """length_aware_batching: every global batch split into its GA x data-parallel micro batches of
    similar cost. Per token, attention costs about width / (6 x hidden size) of the linear layers."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(data.arrow_column(train, "input_ids")).to_pylist()
    hidden = getattr(model.text_config(net), "hidden_size", None)
    parts = plan.gradient_accumulation_steps * plan.data_parallel_size
    logger.info(
        "length-aware batching: each global batch of %d rows split into %d micro batches of similar cost",
        plan.global_batch_size,
        parts,
    )
    return data.LengthAwareBatchSampler(
        sampler, lengths, plan.global_batch_size, parts, 1 / (6 * hidden) if hidden else 0.0
    )


def restore_or_start(cfg: RunConfig, acc, backend, p: Prepared, plan, resume, storage) -> loop.TrainState:
    """Continue from the checkpoint (exactly, or converted from another layout), or start in a clean output_dir
    (on each machine, when output_dir is not shared): fresh, or from another run's checkpoint, whose run is left as
    it is."""
    t = cfg.train
    own = resume is not None and not resumes_elsewhere(t)
    if not own:
        _start_output_dir(cfg, storage)
    if resume is None:
        return loop.TrainState()
    saved = checkpoint.restore(acc, backend, p.model, p.optimizer, p.scheduler, plan, resume, t.learning_rate)
    state = loop.TrainState(**{f.name: saved.get(f.name, f.default) for f in dataclasses.fields(loop.TrainState)})
    logger.info("resumed from %s at step %d", resume.describe(), state.step)
    if not own:
        logger.info("%s starts from it: a new run, its checkpoints and rows from step %d on", t.output_dir, state.step)
        return state
    metrics.MetricsLog(t.output_dir, enabled=acc.is_main_process).truncate_after(state.step)
    for path in checkpoint.remove_half_written(t.output_dir) if storage.writes else ():
        logger.info("removed %s: %s", path, LEFT_BY_A_STOPPED_RUN)
    return state


def _start_output_dir(cfg: RunConfig, storage) -> None:
    """A clean output_dir holding this run's config (preflight refused one holding a previous run, unless replaced)."""
    t = cfg.train
    if storage.writes:
        again = resumes_elsewhere(t) and restarts_its_start(t.output_dir, t.resume_from_checkpoint)
        if t.overwrite_output_dir or t.resume_from_checkpoint == "auto" or again:  # (the last two: no checkpoint yet)
            _clear_previous_run(t.output_dir)
        os.makedirs(t.output_dir, exist_ok=True)
        with open(os.path.join(t.output_dir, checkpoint.CONFIG_FILE), "w") as f:
            yaml.safe_dump(cfg.to_flat(), f, sort_keys=False)
    cluster.host_wait()


def _clear_previous_run(output_dir: str) -> None:
    """--overwrite_output_dir: remove what a previous run left (only the files a run writes)."""
    checkpoint.remove_half_written(output_dir)  # final.replaced<pid> (while its final/ is beside it: before final/)
    for name in (*RUN_MARKERS, ".tmp_final"):
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def build_loop(
    cfg: RunConfig, acc, backend, p: Prepared, ds, plan, facts, ckpt, eval_metrics, generation=None
) -> loop.Run:
    """Everything the loop needs, with the facts every metrics row repeats (how the run is really spread)."""
    t = cfg.train
    if t.report_to:
        report.init_trackers(acc, cfg, {**backend.topology.spread(), "mixed_precision": backend.mixed_precision})
    observed = backend.observed(p.model)
    logger.info("prepared: %s", ", ".join(f"{k} {v}" for k, v in observed.items()))
    peak = metrics.peak_flops(acc.device, backend.mixed_precision)
    peak = peak * acc.num_processes if peak else None
    if peak:
        logger.info("MFU reference: peak %.5g GFLOP/s over %d device(s)", peak / 1e9, acc.num_processes)
    topo = backend.topology
    return loop.Run(
        accelerator=acc,
        backend=backend,
        model=p.model,
        optimizer=p.optimizer,
        scheduler=p.scheduler,
        train_loader=p.train_loader,
        sampler=p.sampler,
        eval_loader=p.eval_loader,
        plan=plan,
        args=t,
        task=cfg.model.task,
        metrics=eval_metrics,
        n_labels=len(ds.label_names) if ds.label_names else None,
        log=metrics.MetricsLog(t.output_dir, enabled=acc.is_main_process),
        checkpointer=ckpt,
        watchdog=watchdog.start_watchdog(acc, t.output_dir, parallel.collective_timeout(t)),
        extra={**topo.spread(), **observed},
        facts=facts,
        peak_flops=peak,
        sources=ds.mixture.names if ds.mixture and ds.mixture.per_source_eval else None,
        best=best.BestRule.of(t),
        generation=generation,
        precision=metrics.PrecisionProbe(backend.hf_model(p.model)),
        objective=preference.Objective.of(t, p.live_reference),
        compiled=cfg.model.torch_compile,
    )


def train_and_export(
    cfg: RunConfig, r: loop.Run, state: loop.TrainState, tokenizer, run_config: dict, facts: report.RunFacts
) -> dict:
    """The loop, the end-of-run checkpoint, final/ (and merged/; the best checkpoint's weights with
    load_best_model_at_end), the memory report (next to the run's estimate), and report.finish: curves, model
    card, Hub, summary."""
    acc, backend = r.accelerator, r.backend
    startup = metrics.peak_memory(acc.device)  # loading and preparing
    metrics.reset_peak_memory(acc.device)
    try:
        final_eval = loop.train(r, state)
    except RuntimeError as e:
        fix = backend.explain_error(e)
        if fix:
            raise ConfigError([fix]) from None
        raise
    training = metrics.peak_memory(acc.device)
    metrics.reset_peak_memory(acc.device)
    end_checkpoint = None  # the end-of-run checkpoint (a resume of a finished run); save_steps null: none
    if cfg.train.save_steps:
        end_checkpoint = r.checkpointer.save(loop.state_dict_of(state))
    weights_from = None
    dtype = model.save_dtype(cfg.model)  # of final/ and merged/, whatever the layout
    if cfg.train.load_best_model_at_end and state.best_step is not None:
        path = best.best_checkpoint(cfg.train.output_dir, state.best_step, state.best_checkpoint)
        weights_from = best.weights_writer(cfg, tokenizer, facts.label_names, path, dtype)
        facts.best, facts.best_line = best.card_section(r.best, state, state.step), best.summary_line(r.best, state)
        logger.info("load_best_model_at_end: final/ gets the best checkpoint, %s: %s", r.best.describe(state), path)
    final = export.export(acc, backend, r.model, tokenizer, run_config, cfg.train.output_dir, dtype, weights_from)
    logger.info("final/ written in %s (save_dtype %s)", dtype, cfg.model.save_dtype)
    facts.save_dtype = dtype
    if cfg.peft.merge:
        if acc.is_main_process:
            with backend.one_process_loading():
                merged = export.merge_adapter(final, os.path.join(final, "merged"), dtype)
            logger.info("merged model saved to %s (%s)", os.path.abspath(merged), dtype)
        cluster.host_wait()
    metrics.report_memory(acc, r.log, state.step, startup, training, facts.estimate)
    topo = backend.topology
    facts.parallelism, facts.world_size, facts.distributed_type = (
        topo.summary(),
        topo.num_processes,
        topo.distributed_type,
    )
    facts.mixed_precision, facts.global_batch_size = backend.mixed_precision, r.plan.global_batch_size
    facts.precision, facts.wall_time_s = r.precision.row(), console.wall_time()
    for tracker in acc.trackers:  # accelerate's end_training, but for destroying the process group (see cli.main)
        tracker.finish()
    report.finish(acc, cfg, final, facts)
    signum = agreed_signal()  # a stop signal since the last step's vote was noted: final/ first, then stop by it
    if signum:
        raise Preempted(signum, state.step, end_checkpoint, final)
    return final_eval
