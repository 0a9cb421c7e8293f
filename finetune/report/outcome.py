"""What the run did, read back from metrics.jsonl: steps, tokens, speed, final eval, peak memory per rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def outcome(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Final eval metrics, tokens, training time, mean tokens/s and MFU, peak memory per rank, planner estimates."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    seconds = tokens = busy = 0.0
    previous = 0
    mfu_time = waited = 0.0
    for r in train:
        window = r["tokens_seen"] - previous
        previous = r["tokens_seen"]
        if r.get("tokens_per_s"):
            spent = window / r["tokens_per_s"]
            seconds += spent
            tokens += window
            if r.get("mfu") is not None:
                mfu_time += r["mfu"] * spent
                busy += spent
            if r.get("step_time_s"):  # the share of the window's time its steps waited for batches
                waited += spent * r.get("data_wait_s", 0.0) / r["step_time_s"]
    memory = next((r["peak_memory"] for r in reversed(rows) if "peak_memory" in r), [])
    return {
        "steps": train[-1]["step"] if train else 0,
        "final_eval": {k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("eval_")},
        "final_eval_s": evals[-1].get("runtime_s") if evals else None,  # what the last evaluation took
        "final_loss": train[-1]["loss"] if train else None,
        "tokens_seen": train[-1]["tokens_seen"] if train else 0,
        "train_seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else None,
        "mfu": mfu_time / busy if busy else None,
        "data_wait_fraction": waited / seconds if seconds else None,  # rank 0's share of step time waiting for data
        "world_size": train[-1].get("world_size") if train else None,
        "distributed_type": train[-1].get("distributed_type") if train else None,
        "skipped_steps": train[-1].get("skipped_steps", 0) if train else 0,
        "compute_dtype": train[-1].get("compute_dtype") if train else None,
        "peak_memory": {m["rank"]: {k: v for k, v in m.items() if k != "rank"} for m in memory},
        "estimates": {
            k: v for m in memory[:1] for k, v in m.items() if k.startswith("estimate_")
        },  # per rank: the same
    }


def peak_per_rank(memory: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """rank -> {host RSS, GPU allocated/reserved}: the highest over the run's phases, in GB."""
    out = {}
    for rank, phases in sorted(memory.items()):
        peaks: dict[str, float] = {}
        for key, value in phases.items():
            if key.startswith("estimate_"):  # the planner's (summary: its own line)
                continue
            kind = key.split("_peak_")[-1].removesuffix("_gb")  # rss, gpu_allocated, gpu_reserved
            peaks[kind] = max(peaks.get(kind, 0.0), value)
        out[rank] = peaks
    return out


def allocator_note(cfg, memory: dict[int, dict[str, float]]) -> str:
    """On a CPU the estimate is the live set (cpu_allocator: release); keep and glibc's defaults peak higher."""
    on_cpu = not any("gpu" in k for peaks in peak_per_rank(memory).values() for k in peaks)
    return (
        f"; on a CPU it assumes cpu_allocator release (this run: {cfg.train.cpu_allocator})"
        if on_cpu and cfg.train.cpu_allocator != "release"
        else ""
    )


def memory_text(memory: dict[int, dict[str, float]]) -> str:
    names = {"rss": "host RSS", "gpu_allocated": "GPU allocated", "gpu_reserved": "GPU reserved"}
    return "; ".join(
        f"rank {rank} " + ", ".join(f"{names.get(k, k)} {v:.2f} GB" for k, v in peaks.items())
        for rank, peaks in peak_per_rank(memory).items()
    )


@dataclass
class RunFacts:
    """What run.py knows of a run that metrics.jsonl does not say, for the model card and the summary. The
    defaults are what the card says of a fact nobody set (a card written from metrics alone)."""

    data_format: str | None = None  # the format the data was read in (auto resolved)
    train_rows: int | None = None
    eval_rows: int = 0
    label_names: list[str] | None = None  # a classifier's classes
    estimate: dict[str, float] = field(default_factory=dict)  # the planner's training peak (estimate_*_gb)
    best: str | None = None  # load_best_model_at_end: the card's section on the best checkpoint
    best_line: str | None = None  # load_best_model_at_end: the summary's line on it (best.summary_line)
    save_dtype: str | None = None  # the dtype final/ was written in
    parallelism: str | None = None  # Topology.summary()
    world_size: int | None = None
    distributed_type: str | None = None
    mixed_precision: str = "no"
    global_batch_size: int | None = None
    precision: dict = field(default_factory=dict)  # metrics.PrecisionProbe.row(): dtypes observed in training
    wall_time_s: float = 0.0
    final_dir: str | None = None  # where final/ is (the card names no local path: how-to-load uses the Hub id)
