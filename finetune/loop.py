"""The training loop: one loop for every backend, speaking only accelerate.

A reader can follow a run from here to `optimizer.step()`: `train` walks epochs and optimizer
steps; `train_step` runs the micro batches of one optimizer step; `evaluate` runs the eval set.
Backend and layout differences live in finetune/parallel/ (the `backend` object), never here.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from finetune.best import BestRule
from finetune.checkpoint import Checkpointer, checkpoints_dir
from finetune.cluster import from_main, host_gather
from finetune.config import TrainArgs
from finetune.data import BATCH_FACTS, StreamedRows
from finetune.faults import fault_point
from finetune.generate import GenerationEval
from finetune.metrics import MetricsLog, PrecisionProbe
from finetune.mixture import MixtureSampler, summarize_by_source
from finetune.model import ModelFacts
from finetune.parallel import Plan, global_batch_index
from finetune.parallel.surface import Backend
from finetune.preference import Objective, model_inputs
from finetune.profiling import StepProfiler
from finetune.report import CURVES_EVERY_S, write_curves
from finetune.stop import STOP, Diverged, Preempted, StopVote
from finetune.watchdog import Watchdog

logger = logging.getLogger("finetune")


@dataclass
class TrainState:
    """What a checkpoint must restore besides accelerate's state: where we are in the data."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # non-padding input tokens, all ranks
    supervised_seen: int = 0  # tokens (or examples) the loss was taken over, all ranks
    best_step: int | None = None  # finetune.best: the best evaluation so far (metric_for_best_model)
    best_metric: float | None = None
    best_checkpoint: str | None = None  # best_step's checkpoint where it is not in checkpoints/: another run's
    evals_without_improvement: int = 0  # early stopping's patience count
    skipped_steps: int = 0  # fp16: optimizer steps the loss scaler skipped (an overflow in the gradients)
    window: dict[str, Any] | None = None  # a checkpoint between two log rows: the open window's sums (_Window)
    eval_pending: bool = False  # preempted before this step's evaluation: the resumed run evaluates it first


@dataclass
class Run:
    """The prepared objects and settings the loop needs, built by run.py. The model, optimizer, scheduler and
    loaders are what backend.prepare returned (accelerate's wrappers, or the backend's own)."""

    accelerator: Accelerator
    backend: Backend  # finetune.parallel: the named differences between backends
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # accelerate's AcceleratedScheduler (or the backend's): .step() once per optimizer step
    train_loader: torch.utils.data.DataLoader
    sampler: MixtureSampler | StreamedRows  # the order of an epoch depends only on (seed, epoch)
    eval_loader: torch.utils.data.DataLoader | None
    plan: Plan
    args: TrainArgs
    task: str
    metrics: dict[str, Any]  # evaluate modules by name (metrics.load_metrics)
    n_labels: int | None
    log: MetricsLog
    checkpointer: Checkpointer
    watchdog: Watchdog  # hang forensics
    extra: dict[str, Any] = field(default_factory=dict)  # constant facts added to every log row
    facts: ModelFacts | None = None  # the model's sizes: its FLOPs (MFU); None: MFU not reported
    peak_flops: float | None = None  # all devices together; None: MFU not reported
    sources: list[str] | None = None  # a mixture's source names: eval is also reported per source
    best: BestRule | None = None  # best checkpoint and early stopping (None: off)
    generation: GenerationEval | None = None  # scores what the model writes
    precision: PrecisionProbe | None = None  # the dtypes the model really trains in
    objective: Objective | None = None  # a preference method's loss (None: the model's own, SFT)
    compiled: bool = False  # torch_compile: the first step compiles the repeated blocks (its time is logged)


def train_step(run: Run, micro_batches: list[dict], epoch: int, step_in_epoch: int):
    """One optimizer step over this rank's micro batches.

    The loss is the mean over the supervised tokens of the whole global batch (every micro batch
    on every rank): each micro batch's mean loss is turned back into a sum and divided by the
    global count (Plan.loss_weight). Hence 2 ranks x GA 1 and 1 rank x GA 2 give the same update.

    Under Megatron-LM, accelerate's engine runs the whole step inside forward_loss (forward and backward over the
    pipeline's micro batches, clipping, the optimizer and scheduler step), and backward, clip_grad_norm and the
    steps below are accelerate's no-ops there: the same loop, with the work in one call (parallel/megatron.py).
    """
    acc, backend = run.accelerator, run.backend
    counts = [b.pop("num_supervised") for b in micro_batches]
    tokens = sum(b.pop("num_tokens") for b in micro_batches)
    positions = sum(b.pop("num_positions") for b in micro_batches)
    learned = sum(b.pop("num_learned") for b in micro_batches)
    # The global supervised count: an all-reduce whose result stays on the device (never read here: no host sync).
    global_count = acc.reduce(torch.stack(counts).sum().float(), "sum")
    scale = run.plan.loss_weight(global_count)
    nll_sum, grad_norm, skipped = 0.0, None, False
    for i, (batch, n) in enumerate(zip(micro_batches, counts)):
        # Dropout is seeded by the micro batch's place in the global data order, not by the rank
        # layout: any world size / accumulation split of the same global batch draws the same masks.
        torch.manual_seed(
            hash((run.args.seed, epoch, global_batch_index(run.plan, step_in_epoch, i, backend.topology.dp_rank)))
            & (2**63 - 1)
        )
        with acc.accumulate(run.model):
            if run.objective is None:
                loss = backend.forward_loss(run.model, batch)  # Megatron-LM: the whole step runs in here
            else:  # preference pairs: the method's loss from the answers' log-probs (finetune.preference)
                batch = run.objective.with_reference(batch)
                loss = run.objective.loss(backend.answer_logps(run.model, model_inputs(batch), batch["labels"]), batch)
            acc.backward(loss * (n * scale))  # Megatron-LM: returns at once (the step already ran)
            if acc.sync_gradients:  # true on the last micro batch only
                grad_norm = backend.clip_grad_norm(run.model, run.args.max_grad_norm)
            run.optimizer.step()  # Megatron-LM: OptimizerStepRunsInForward, nothing left (parallel/megatron.py)
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            if acc.sync_gradients:
                skipped = acc.optimizer_step_was_skipped  # fp16 loss scaling: inf/nan gradients, no update
        nll_sum = nll_sum + loss.detach().float() * n
    if skipped and backend.mixed_precision != "fp16":
        # DeepSpeed's ZeRO optimizers skip a step with non-finite gradients in fp32 and bf16 too, where no loss scaler
        # backs off and tries again: that is divergence (the run went on with NaN losses to the end and exported).
        grad_norm, skipped = torch.full((), float("nan"), device=acc.device), False
    return nll_sum, global_count, tokens, positions, learned, grad_norm, skipped


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Eval loss (mean over supervised tokens or examples) and metrics, over the whole eval set."""
    backend = run.backend
    run.model.eval()
    parts: dict[str, list] = defaultdict(list)
    dtypes: dict[str, torch.dtype] = {}
    for batch in run.eval_loader:
        for fact in BATCH_FACTS:
            batch.pop(fact)
        source = batch.pop("source", None)  # a mixture's eval rows: which source each comes from
        if run.objective is not None:
            batch = run.objective.with_reference(batch)
            stats = run.objective.per_pair(backend.answer_logps(run.model, model_inputs(batch), batch["labels"]), batch)
        else:
            labels = batch.pop("labels")
            stats = backend.eval_stats(run.model, batch, labels, run.task)
        if source is not None:
            stats = {**stats, "source": source}
        for k, v in backend.gather_for_metrics(stats).items():  # drops the padding of an uneven last batch
            # Kept as Python numbers, not as small tensors: a small tensor kept from every batch lands between the
            # batch's large freed buffers in the heap and keeps the next (wider) batch from reusing them; measured,
            # a streamed run's 2,000-row eval grew the process from 1.1 to 3.4 GB that way.
            parts[k].extend(v.tolist())
            dtypes[k] = v.dtype
    run.model.train()
    stats = {k: torch.tensor(v, dtype=dtypes[k]) for k, v in parts.items()}
    if run.objective is not None:
        return run.objective.summarize(stats)
    return summarize_by_source(stats, run.metrics, run.n_labels, run.sources)


class _Window:
    """Running sums between two log rows (kept as tensors: no host sync per step), and the last step's gradient norm.

    A checkpoint between two rows saves the window's sums over every rank (TrainState.window, read where the
    checkpoint syncs anyway), and the resumed run's window starts from them: its next row is the one the
    uninterrupted run writes. The main process carries them into the all-reduce (every rank: the global count);
    the throughput figures count this process's own steps only (`carried`: what came from the checkpoint)."""

    SUMMED = ("nll", "tokens", "positions", "learned")  # this rank's share: all-reduced for a row

    def __init__(self, saved: dict[str, Any] | None = None, main: bool = True, device=None) -> None:
        self.nll, self.count, self.tokens, self.positions, self.learned, self.steps = 0.0, 0.0, 0, 0, 0, 0
        self.grad_norm = None
        self.carried = {"tokens": 0, "learned": 0, "steps": 0}
        self.t0 = time.perf_counter()
        self.data_wait = 0.0  # seconds this rank's steps waited for their batches
        if saved:
            self.count = torch.tensor(saved["count"], dtype=torch.float32, device=device)  # the sums kept their dtypes
            self.steps, self.grad_norm = saved["steps"], saved["grad_norm"]
            if main:
                self.nll = torch.tensor(saved["nll"], dtype=torch.float32, device=device)
                self.tokens, self.positions, self.learned = (int(saved[k]) for k in ("tokens", "positions", "learned"))
            self.carried = {"tokens": saved["tokens"], "learned": saved["learned"], "steps": saved["steps"]}

    def add(self, nll, count, tokens: int, positions: int, learned: int, grad_norm) -> None:
        self.nll, self.count, self.tokens = self.nll + nll, self.count + count, self.tokens + tokens
        self.positions, self.learned, self.steps = self.positions + positions, self.learned + learned, self.steps + 1
        self.grad_norm = grad_norm

    def sums(self, run: Run) -> dict[str, Any]:
        """Over every rank (an all-reduce, read on the host), as counted: tensor-parallel replicas each hold the
        same batch, so `nll`, `tokens`, `positions`, `learned` and `count` come `replicas` times."""
        acc = run.accelerator
        local = torch.stack([torch.as_tensor(getattr(self, k), device=acc.device).float() for k in self.SUMMED])
        summed = dict(zip(self.SUMMED, acc.reduce(local, reduction="sum").tolist()))
        norm = None if self.grad_norm is None else float(self.grad_norm)
        return {**summed, "count": float(self.count), "steps": self.steps, "grad_norm": norm}


def train(run: Run, state: TrainState) -> dict[str, float]:
    """Run optimizer steps from state.step to plan.total_steps; log, evaluate and checkpoint. A stop signal
    (stop.STOP) ends it at the next step boundary with a checkpoint, the last step's too; a non-finite step ends it
    at once. STOP stays armed when it returns: a signal after the last step's vote is noted, and the run ends
    with it once final/ is written (run.train_and_export)."""
    STOP.armed = True
    try:
        return _train(run, state)
    finally:
        run.watchdog.stop()


def _train(run: Run, state: TrainState) -> dict[str, float]:
    p = _Progress(run, state)
    last_eval: dict[str, float] = {}
    if run.args.eval_on_start and state.step == 0 and run.eval_loader is not None:
        last_eval = _log_eval(run, state, p.bar)
    run.model.train()
    plan, args = run.plan, run.args
    stopped = False  # early stopping
    pending, state.eval_pending = state.eval_pending, False
    if pending and run.eval_loader is not None:  # its checkpoint was written, it was not evaluated
        last_eval, best_needs_it, stopped = _eval_in_training(run, state, p, save=False)
        own = os.path.join(checkpoints_dir(run.checkpointer.output_dir), f"step_{state.step}")
        # started from another run's: the best must be this run's (stopped: run.py's end-of-run checkpoint); the
        # ranks decide together (machines with their own output_dir each look at their own)
        if best_needs_it and not stopped and any(host_gather(not os.path.isdir(own))):
            run.checkpointer.save(_saved_state(run, state, p.win))
    while state.step < plan.total_steps and not stopped:
        epoch, start = divmod(state.step, plan.steps_per_epoch)
        batches = _epoch_batches(run, epoch, start)
        for step_in_epoch in range(start, plan.steps_per_epoch):
            with p.profiler.step(state.step + 1):  # profile_steps (nothing otherwise)
                _optimizer_step(run, state, p, batches, epoch, step_in_epoch)
            done = state.step == plan.total_steps
            p.bar.update(1)
            preempted = p.stop.agreed()  # the signal (0: none); every rank reads the same vote
            log = state.step % args.logging_steps == 0 or done
            save = bool(args.save_steps and state.step % args.save_steps == 0)
            evaluate_now = run.eval_loader is not None and (
                done or bool(args.eval_steps and state.step % args.eval_steps == 0)
            )
            if log or save or evaluate_now or preempted:  # the steps' gradient norms are read here (no sync per step)
                p.health.check(run.checkpointer.output_dir)  # before anything is saved: never a non-finite step
            if log:
                _log_train(run, state, p.win, p.bar)
                p.win = _Window()
            if preempted:  # all ranks checkpoint this step and stop (no evaluation: the grace period is short)
                state.eval_pending = evaluate_now  # the resumed run evaluates this step first
                run.watchdog.beat()
                raise Preempted(preempted, state.step, run.checkpointer.save(_saved_state(run, state, p.win)))
            if evaluate_now:
                last_eval, save, stopped = _eval_in_training(run, state, p, save)
            if not done and not stopped and save:
                run.watchdog.beat()
                run.checkpointer.save(_saved_state(run, state, p.win))  # the last step's checkpoint is run.py's
            if done or stopped:
                break
    p.profiler.stop()  # early stopping inside profile_steps: the steps profiled so far
    p.bar.close()
    return last_eval


class _Progress:
    """What the loop carries from step to step: the progress bar, the window of the next log row, the health
    checks, the profiler of profile_steps, and whether the observed precision was logged yet."""

    def __init__(self, run: Run, state: TrainState) -> None:
        self.bar = tqdm(
            total=run.plan.total_steps,
            initial=state.step,
            unit="step",
            dynamic_ncols=True,
            disable=not run.accelerator.is_main_process or run.args.disable_tqdm,
        )
        self.win = _Window()
        if state.window:  # resumed between two log rows: the row to come covers the steps before the checkpoint too
            saved, state.window = _in_replicas(state.window, run.backend.topology.replicas), None
            state.tokens_seen, state.supervised_seen = saved["tokens_seen"], saved["supervised_seen"]
            main, device = run.accelerator.process_index == 0, run.accelerator.device
            self.win = _Window(saved, main, device)
            if run.objective is not None and saved.get("objective"):
                run.objective.resume_window(saved["objective"], device, main)
        self.health = _Health()
        self.stop = StopVote()
        self.precision_logged = False
        self.compiling = run.compiled  # until the first step of this process has run
        self.profiler = StepProfiler(run.accelerator, run.args.profile_window, run.checkpointer.output_dir, state.step)


def _epoch_batches(run: Run, epoch: int, start: int):
    """The batches of an epoch from optimizer step `start` on (a resume inside an epoch skips the others)."""
    skip = start * run.plan.gradient_accumulation_steps
    loader = run.accelerator.skip_first_batches(run.train_loader, skip) if skip else run.train_loader
    # accelerate's loader re-applies its own epoch counter to the sampler at every iter(); it
    # only advances when an iteration runs to exhaustion (ours stop at the last whole global
    # batch) and starts at 0 in a skipping loader. Set it explicitly, on the loader itself.
    loader.set_epoch(epoch)
    run.sampler.set_epoch(epoch)
    return iter(loader)


def _optimizer_step(run: Run, state: TrainState, p: _Progress, batches, epoch: int, step_in_epoch: int) -> None:
    """One optimizer step and its bookkeeping (its grad norm, a device tensor, is read when the loop logs)."""
    run.watchdog.beat()
    fault_point("hang-before-step", state.step + 1)
    fault_point("signal-before-step", state.step + 1)
    started = time.perf_counter()
    micro = [next(batches) for _ in range(run.plan.gradient_accumulation_steps)]
    p.win.data_wait += time.perf_counter() - started
    p.stop.post()  # this rank's stop request, agreed on while the step runs
    nll, count, tokens, positions, learned, grad_norm, skipped = train_step(run, micro, epoch, step_in_epoch)
    state.step += 1
    if p.compiling:
        p.compiling = False
        logger.info(
            "torch_compile: the first step took %.1f s, compiling each repeated block (the next steps reuse the "
            "kernels; a batch of another width compiles once more, after which the shapes are dynamic)",
            time.perf_counter() - started,
        )
    if skipped:
        state.skipped_steps += 1
        logger.warning("step %d: the fp16 loss scaler skipped the update (gradient overflow)", state.step)
    if not p.precision_logged and run.precision is not None:
        p.precision_logged = True
        logger.info(
            "precision (observed in the first training forward): weights %s, compute %s",
            run.precision.weights,
            run.precision.compute,
        )
    p.health.note(state.step, grad_norm, skipped)
    p.win.add(nll, count, tokens, positions, learned, grad_norm)


def _eval_in_training(run: Run, state: TrainState, p: _Progress, save: bool):
    """An evaluation between steps, judged for the best checkpoint and early stopping: (metrics, save, stop)."""
    run.watchdog.beat()
    paused = time.perf_counter()
    result = _log_eval(run, state, p.bar)
    p.win.t0 += time.perf_counter() - paused  # eval and curves.png are not training time (tokens/s)
    stopped = False
    if run.best is not None:
        verdict = _judge(run, state, result)
        save = save or (verdict.new_best and run.best.load_best)  # the best always has a checkpoint
        stopped = verdict.stop
        if stopped and p.win.steps:  # the steps since the last train row
            _log_train(run, state, p.win, p.bar)
    return result, save, stopped


class _Health:
    """Divergence: a non-finite gradient norm (global: the same on every rank, NaN wherever any rank's loss
    was) stops the run. A norm of exactly zero for several steps in a row: nothing is learning.

    The norms stay on the device as each step noted them and are read together (one host sync) where the loop
    syncs anyway: at each log row, evaluation and checkpoint, and before a preemption's checkpoint. So a divergence
    is caught at most logging_steps - 1 steps after it happened (9 by default), always before anything is saved
    or exported, and reported with the step it happened at."""

    ZERO_STEPS = 3

    def __init__(self) -> None:
        self.zeros = 0
        self.unread: list[tuple[int, Any]] = []  # (step, its gradient norm) since the last check

    def note(self, step: int, grad_norm, skipped: bool) -> None:
        if grad_norm is not None and not skipped:  # a skipped fp16 step's norm is inf by design (the scaler backs off)
            self.unread.append((step, grad_norm))

    def check(self, output_dir: str) -> None:
        unread, self.unread = self.unread, []
        if not unread:
            return
        norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for _, n in unread]  # FSDP2's is a DTensor
        # On one device: a GPU's norms, a CPU-offloaded optimizer's, and DeepSpeed's Python floats (inf) side by side.
        devices = [n.device for n in norms if isinstance(n, torch.Tensor)]
        values = torch.stack(
            [torch.as_tensor(n, dtype=torch.float32, device=devices[0] if devices else None) for n in norms]
        ).tolist()  # one sync
        for (step, _), value in zip(unread, values, strict=True):
            self._check_one(step, value, output_dir)

    def _check_one(self, step: int, value: float, output_dir: str) -> None:
        if not math.isfinite(value):
            from finetune.checkpoint import latest_complete

            last = latest_complete(output_dir)
            raise Diverged(
                f"the gradient norm of step {step} is {value}: training diverged, and the weights are no longer "
                "usable, so nothing is exported. Usual causes: a learning rate far too high, fp16 overflow (use "
                "bf16), or bad data. "
                + (
                    f"Last good checkpoint: {last} (resume from it with a lower learning_rate)."
                    if last
                    else "No checkpoint was written before it."
                )
            )
        self.zeros = self.zeros + 1 if value == 0.0 else 0
        if self.zeros == self.ZERO_STEPS:
            logger.warning(
                "the gradient norm has been exactly 0 for %d steps in a row (up to step %d): nothing is learning. "
                "Usual causes: a learning rate so high that the model died (loss stuck), every label masked, or "
                "no trainable parameters reached by the loss",
                self.ZERO_STEPS,
                step,
            )


def _counted(run: Run, sums: dict[str, Any]) -> tuple[int, int]:
    """(tokens, supervised tokens or examples) a window's sums add to tokens_seen and supervised_seen."""
    rep = run.backend.topology.replicas  # ranks holding the same batch (tensor parallel) each counted it
    return int(sums["tokens"] / rep), int(sums["count"] / rep)


def _in_replicas(window: dict[str, Any], replicas: int) -> dict[str, Any]:
    """A saved window's sums as this run counts them: each tensor-parallel replica counts its batch (a checkpoint
    of TP 2 resumed under DDP: halved); the counters at the window's start are counts already."""
    scale = replicas / window.get("replicas", 1)
    if scale == 1:
        return window
    out = {**window, **{k: window[k] * scale for k in (*_Window.SUMMED, "count")}}
    if window.get("objective"):
        out["objective"] = {k: v * scale for k, v in window["objective"].items()}
    return out


def _saved_state(run: Run, state: TrainState, win: _Window) -> dict[str, Any]:
    """The trainer state a checkpoint of this step holds: tokens_seen and supervised_seen up to this step, and
    the open window's sums with the counters at its start (a resume's next row is then this run's)."""
    saved = asdict(state)
    if win.steps:  # the same on every rank: all take part in the window's all-reduce, or none
        window = {**win.sums(run), "tokens_seen": state.tokens_seen, "supervised_seen": state.supervised_seen}
        window["replicas"] = run.backend.topology.replicas  # the sums count each batch this many times
        if run.objective is not None:  # a preference method's reward statistics
            window["objective"] = run.objective.window_sums(run.accelerator)
        tokens, supervised = _counted(run, window)
        saved.update(tokens_seen=state.tokens_seen + tokens, supervised_seen=state.supervised_seen + supervised)
        saved["window"] = window
    return saved


def _log_train(run: Run, state: TrainState, win: _Window, bar) -> None:
    acc = run.accelerator
    sums = win.sums(run)
    rep = run.backend.topology.replicas
    tokens, supervised = _counted(run, sums)
    state.tokens_seen += tokens
    state.supervised_seen += supervised
    # this process's own steps (not those a resume carried over): the throughput figures
    own_tokens, own_learned = ((sums[k] - win.carried[k]) / rep for k in ("tokens", "learned"))
    own_steps = win.steps - win.carried["steps"]  # 0: a resume's pending evaluation stopped it before any step
    seconds = time.perf_counter() - win.t0
    timed = own_steps > 0
    row = {
        "step": state.step,
        "loss": sums["nll"] / rep / (sums["count"] / rep),
        "learning_rate": run.backend.learning_rate(run.optimizer, run.scheduler),
        "grad_norm": sums["grad_norm"],
        "tokens_seen": state.tokens_seen,
        "tokens_per_s": own_tokens / seconds if timed else None,
        "padding_fraction": 1 - sums["tokens"] / sums["positions"],  # of the token positions computed (both x rep)
        "step_time_s": seconds / own_steps if timed else None,
        "data_wait_s": win.data_wait / own_steps if timed else None,  # of step_time_s, waiting for the batch
        "mfu": (
            run.facts.flops(own_tokens, own_learned, reference=bool(run.objective and run.objective.live))
            / seconds
            / run.peak_flops
            if run.peak_flops and run.facts and timed
            else None
        ),
        "epoch": None if run.plan.streamed else state.step / run.plan.steps_per_epoch,  # a stream's is unknown
        "skipped_steps": state.skipped_steps,
        **run.extra,
        **(run.precision.row() if run.precision is not None else {}),
        **(run.objective.window_row(acc) if run.objective is not None else {}),
    }
    run.log.write(row)
    if run.args.report_to:
        acc.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=state.step)
    postfix = {"loss": f"{row['loss']:.4f}", "lr": f"{row['learning_rate']:.2e}"}
    if timed:
        postfix["tok/s"] = f"{row['tokens_per_s']:.0f}"
    if row["mfu"] is not None:
        postfix["mfu"] = f"{100 * row['mfu']:.1f}%"
    if bar.disable:
        if acc.is_main_process:
            logger.info(
                "step %d/%d  %s", state.step, run.plan.total_steps, "  ".join(f"{k} {v}" for k, v in postfix.items())
            )
    else:
        bar.set_postfix(postfix, refresh=False)


def _log_eval(run: Run, state: TrainState, bar) -> dict[str, float]:
    start = time.perf_counter()
    result = evaluate(run)
    if run.generation is not None:
        result.update(run.generation.evaluate(run, state.step))
    run.backend.end_inference(run.model)
    runtime = time.perf_counter() - start  # what this evaluation cost (metrics.jsonl, the summary's final eval)
    run.log.write({"step": state.step, **result, "runtime_s": round(runtime, 3)})
    if run.log.enabled and run.args.curves:  # the main process: curves.png so far
        write_curves(os.path.dirname(run.log.path), min_interval=CURVES_EVERY_S)
    if run.args.report_to:
        run.accelerator.log(result, step=state.step)
    if run.accelerator.is_main_process:
        text = "  ".join(f"{k} {v:.4f}" for k, v in result.items())
        (bar.write if not bar.disable else logger.info)(f"eval @ step {state.step}: {text}  ({runtime:.1f} s)")
    return result


def _judge(run: Run, state: TrainState, result: dict[str, float]):
    """Best checkpoint and early stopping (finetune.best) on this evaluation. The gathered metrics are the same
    on every rank; the main process's value is broadcast all the same, so no rank can decide differently."""
    value = from_main(run.accelerator, run.best.value_of(result))
    verdict = run.best.update(state, value)
    if verdict.stop:
        logger.info(
            "early stopping at step %d: %s has not improved by more than %g for %d evaluations; best %s",
            state.step,
            run.best.metric,
            run.best.threshold,
            state.evals_without_improvement,
            run.best.describe(state),
        )
    return verdict


def state_dict_of(state: TrainState) -> dict[str, Any]:
    return asdict(state)
