"""Eval metrics (through `evaluate`), per-example eval statistics, memory and the metrics log."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
from typing import Any

import torch

from finetune.config import DEFAULT_METRICS, SHIPPED_METRICS, ConfigError, shipped_metrics


def load_metrics(names: list[str] | None, task: str, key: str = "metrics") -> dict[str, Any]:
    """name -> evaluate module. Shipped names load from the package; others via evaluate.load.
    (`evaluate` takes about a second to import: only when a metric is asked for.)"""
    wanted = DEFAULT_METRICS[task] if names is None else names
    if not wanted:
        return {}
    import evaluate

    out = {}
    for name in wanted:
        path = SHIPPED_METRICS / name
        try:
            out[name] = evaluate.load(str(path) if path.is_dir() else name)
        except Exception as e:
            raise ConfigError(
                [
                    (
                        key,
                        f"could not load metric {name!r} ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0]}); use one of the metrics shipped for offline use: "
                        f"{', '.join(shipped_metrics())}, or a "
                        "local evaluate module directory",
                    )
                ]
            ) from None
    return out


def per_example_stats(
    logits: torch.Tensor | None, labels: torch.Tensor, task: str, nll: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Per-example sums, so that `gather_for_metrics` can drop the duplicates of an uneven last batch.

    causal LM: summed next-token NLL and supervised-token count per row (nll: those sums, computed by the chunked
    loss, in place of the logits), one row's fp32 copy of the logits at a time.
    seq2seq: the same over the target tokens; decoder logits already align with the labels (no shift).
    classification: NLL, prediction and reference per example.
    """
    if task == "classification":
        logits = logits.float()
        nll = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        return {"nll": nll, "count": torch.ones_like(nll), "pred": logits.argmax(-1), "ref": labels}
    # causal LM: the logit at position t predicts the label at t + 1 (the last position predicts nothing)
    targets = labels if task == "seq2seq" else torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    count = (targets != -100).sum(-1).float()
    if nll is None:  # a row at a time: its fp32 logits and log-softmax, never the batch's
        nll = torch.stack(
            [
                torch.nn.functional.cross_entropy(row.float(), target, ignore_index=-100, reduction="sum")
                for row, target in zip(logits, targets, strict=True)
            ]
        )
    return {"nll": nll, "count": count}


def summarize(stats: dict[str, torch.Tensor], metrics: dict[str, Any], n_labels: int | None) -> dict[str, float]:
    """eval_loss (mean over supervised tokens/examples), perplexity for LM, and each metric."""
    loss = (stats["nll"].double().sum() / stats["count"].double().sum()).item()
    out = {"eval_loss": loss}
    if "pred" not in stats:
        out["eval_perplexity"] = math.exp(min(loss, 50.0))
    for name, module in metrics.items():
        kwargs = {"average": "macro"} if name == "f1" and (n_labels or 2) > 2 else {}
        result = module.compute(predictions=stats["pred"].tolist(), references=stats["ref"].tolist(), **kwargs)
        out.update({f"eval_{k}": v for k, v in result.items() if isinstance(v, (int, float))})
    return out


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (Linux: /proc/self/clear_refs resets the RSS high-water mark)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the window then starts at process start
        pass
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, float]:
    """This process's peak host RSS since the last reset, and accelerator memory where there is one, in GB."""
    try:
        with open("/proc/self/status") as f:
            hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        hwm_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    out = {"peak_rss_gb": hwm_kb * 1024 / 1e9}
    if device.type == "cuda":
        out["peak_gpu_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        out["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 1e9
    return out


def report_memory(accelerator, log, step: int, startup: dict, training: dict, estimate: dict | None = None) -> None:
    """Every rank's peak memory per phase (loading/preparing, training, save and export): logged and in metrics.jsonl,
    with the run's own estimate of the training peak next to them (estimate_train_peak_gb, finetune/memory/)."""
    from finetune.cluster import host_gather

    phases = {"startup": startup, "train": training, "save_export": peak_memory(accelerator.device)}
    mine = {f"{phase}_{k}": v for phase, m in phases.items() for k, v in m.items()}
    mine.update(estimate or {})
    memories = host_gather({"rank": accelerator.process_index, **mine})
    log.write({"step": step, "peak_memory": memories})
    for m in memories:
        text = ", ".join(f"{k.removesuffix('_gb')} {v:.2f}" for k, v in m.items() if k != "rank")
        logging.getLogger("finetune").info("peak memory rank %d (GB): %s", m["rank"], text)


class MetricsLog:
    """`<output_dir>/metrics.jsonl`, written by the main process only; one JSON object per row."""

    def __init__(self, output_dir: str, enabled: bool):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows logged after the checkpoint, so the log continues without duplicates."""
        if not self.enabled or not os.path.exists(self.path):
            return
        rows = [row for row in read_metrics(os.path.dirname(self.path)) if row.get("step", 0) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(tmp, self.path)

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def read_metrics(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a run's metrics.jsonl (resume, curves, `finetune plot`, parity, users' scripts). A last line cut
    short (an append that did not finish: a full disk, a killed process) is left out with a warning; a line
    elsewhere that is not a JSON row is a ConfigError naming the file and the line."""
    path = os.path.join(output_dir, "metrics.jsonl")
    with open(path) as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    rows = []
    for number, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif number == lines[-1][0]:
            logging.getLogger("finetune").warning(
                "%s: its last line (%d) is not a whole JSON row (an append cut short, e.g. by a full disk); left out: "
                "%.80r",
                path,
                number,
                line.rstrip("\n"),
            )
        else:
            why = f"line {number} is not a JSON row ({line.strip()[:80]!r}); remove or repair that line"
            raise ConfigError([(path, why)])
    return rows


# ---------------------------------------------------------------- model FLOPs utilisation (MFU)
#
# MFU = model FLOPs per second (model.ModelFacts.flops) / peak FLOP/s of the devices. Peak FLOP/s: datasheet dense
# figures per GPU type (below); on CPU a 1024^3 fp32 matmul measured at start on every rank at once (so ranks sharing
# cores share the peak).

GPU_PEAK_TFLOPS = {  # dense; (bf16/fp16, tf32, fp32)
    "H200": (989, 494, 67),
    "H100": (989, 494, 67),
    "A100": (312, 156, 19.5),
    "L40S": (362, 183, 91.6),
    "L4": (121, 60, 30),
    "A10": (125, 62.5, 31.2),
    "A6000": (155, 77, 38.7),
    "V100": (125, 15.7, 15.7),
}


def peak_flops(device: torch.device, mixed_precision: str) -> float | None:
    """Peak dense FLOP/s of one device for this precision; None when unknown."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (half, tf32, fp32) in GPU_PEAK_TFLOPS.items():
            if key in name:
                if mixed_precision in ("bf16", "fp16"):
                    return half * 1e12
                return (tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32) * 1e12
        return None
    if device.type == "cpu":  # no spec sheet: the measured rate of a large fp32 matmul (about 0.1 s)
        import time

        n = 1024
        a = torch.randn(n, n)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t0)
        return 2 * n**3 / best
    return None


class PrecisionProbe:
    """The precision a run really trains in, observed from the model, not copied from a config: the dtype its
    parameters are held in, and the dtype a Linear layer's output has in the first training forward (where bf16
    autocast, DeepSpeed's 16-bit weights and FSDP2's param_dtype all show). A run that silently fell back to fp32
    shows float32 there."""

    def __init__(self, net) -> None:
        params = [p for p in net.parameters() if p.is_floating_point()]
        self.weights = _dtype_name(params[0].dtype) if params else None
        self.compute: str | None = None
        linear = next((m for m in net.modules() if isinstance(m, torch.nn.Linear)), None)
        self._hook = linear.register_forward_hook(self._seen) if linear is not None else None

    def _seen(self, module, inputs, output) -> None:
        if module.training and torch.is_tensor(output):
            self.compute = _dtype_name(output.dtype)
            self._hook.remove()

    def row(self) -> dict[str, str | None]:
        """The facts every metrics row carries (compute None until the first training forward)."""
        return {"weights_dtype": self.weights, "compute_dtype": self.compute}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
