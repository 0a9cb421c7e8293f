"""profile_steps: where a training step's time goes, measured by torch's profiler on every rank.

Optimizer steps FIRST..LAST (1-based, as the logs count them) run under accelerate's profiler
(`ProfileKwargs`, `Accelerator.profile`), each inside a record named "optimizer step N", and nothing else does:
not the steps before or after, not logging, evaluation or checkpoints. Each rank writes to output_dir/profile/:

  profile_<rank>.json   the Chrome trace (accelerate's; open it in https://ui.perfetto.dev or chrome://tracing)
  ops_<rank>.txt        torch's table of the operators, by their own time on the device (on a CPU: the host)
  summary_<rank>.json   the window's wall time, how busy the device was, and the time by kind of work

and the main process logs its summary. The kinds come from the operator names (`KINDS`, first match): a kernel
counts for the operator that launched it, so nothing is counted twice. On a GPU, `idle_s` is the part of the
window the device ran no kernel (the host was late: Python, launches, data, syncs); on a CPU the part outside
the operators (Python and the loop between them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time

import torch
from accelerate import Accelerator
from accelerate.utils import ProfileKwargs

logger = logging.getLogger("finetune")

# (kind, pattern on the lower-cased operator name); the first that matches. Everything else: "other".
KINDS = (
    ("communication", r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|record_param_comms"),
    ("attention", r"scaled_dot_product|flash|efficient_attention|cudnn_attention|flex_attention"),
    ("matmul", r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addmv|mv|_scaled_mm)$"),
    ("loss", r"log_softmax|nll_loss|cross_entropy"),
    ("optimizer", r"adam|_foreach_|clip_grad"),
    ("copies and casts", r"^aten::(copy_|_to_copy|to|clone|contiguous)$|memcpy|memset"),
    ("compiled kernels", r"triton|compiled"),
)


def kind_of(op: str) -> str:
    name = op.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


class StepProfiler:
    """The profiler around optimizer steps first..last (None: profile nothing): `with profiler.step(n): ...`."""

    def __init__(self, acc: Accelerator, steps: tuple[int, int] | None, output_dir: str, done: int) -> None:
        self.acc, self.steps = acc, steps
        self.dir = os.path.join(output_dir, "profile")
        self.device = acc.device
        self.cuda = acc.device.type == "cuda"  # the device's kernels profiled too, and timed after a sync
        self.profiler = None  # torch's, while the window is open (and read when it closes)
        self._stack: contextlib.ExitStack | None = None
        self._t0 = 0.0
        if steps and acc.is_main_process:
            first, last = max(steps[0], done + 1), steps[1]
            logger.info(
                "profile_steps: %s",
                f"optimizer steps {first}-{last} run under torch's profiler (files in {self.dir})"
                if first <= last
                else f"nothing to profile: the run resumes after step {done}",
            )

    @contextlib.contextmanager
    def step(self, n: int):
        """Optimizer step n: the profiler starts before the first and stops after the last (its files written)."""
        if self.steps is None or not self.steps[0] <= n <= self.steps[1]:
            yield
            return
        if self._stack is None:
            self._start()
        with torch.profiler.record_function(f"optimizer step {n}"):
            yield
        if n == self.steps[1]:
            self.stop()

    def _start(self) -> None:
        handler = ProfileKwargs(activities=["cpu", "cuda"] if self.cuda else ["cpu"], output_trace_dir=self.dir)
        self._sync()  # the work queued before the window is not the window's
        self._stack = contextlib.ExitStack()
        self.profiler = self._stack.enter_context(self.acc.profile(handler))
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        """End the window (after its last step, or where the run ends inside it): the files and the summary."""
        if self._stack is None:
            return
        self._sync()
        wall = time.perf_counter() - self._t0
        stack, self._stack = self._stack, None
        stack.close()  # accelerate writes the trace, then waits for every rank
        averages = self.profiler.key_averages()  # once: a large model's steps hold many thousand events
        summary = self._summary(averages, wall)
        rank = self.acc.process_index
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        with open(os.path.join(self.dir, f"ops_{rank}.txt"), "w") as f:
            f.write(averages.table(sort_by=sort, row_limit=60) + "\n")
        with open(os.path.join(self.dir, f"summary_{rank}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        if self.acc.is_main_process:
            logger.info("%s", describe(summary, self.dir))

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _summary(self, averages, wall: float) -> dict:
        """The window's time by kind of work, from the operators' own (self) times: on a GPU the time of the
        kernels each launched, on a CPU their host time."""
        ops = [  # operators, not the records around them (the steps, a module's forward, the data loader)
            e for e in averages
            if e.device_type == torch.autograd.DeviceType.CPU and (not e.is_user_annotation or "triton" in e.key)
        ]  # fmt: skip
        own = (lambda e: e.self_device_time_total) if self.cuda else (lambda e: e.self_cpu_time_total)
        by_kind: dict[str, float] = {}
        top = []
        for e in ops:
            seconds = own(e) / 1e6
            if seconds > 0:
                kind = kind_of(e.key)
                by_kind[kind] = by_kind.get(kind, 0.0) + seconds
                top.append((seconds, e.key, e.count))
        busy = sum(by_kind.values())
        if self.cuda:  # kernels no operator launched (a CUDA graph's replay, say) are busy time too
            kernels = sum(
                e.self_device_time_total for e in averages if e.device_type == torch.autograd.DeviceType.CUDA
            ) / 1e6  # fmt: skip
            if kernels > busy:
                by_kind["kernels outside an operator"] = kernels - busy
                busy = kernels
        top.sort(reverse=True)
        return {
            "steps": list(self.steps),
            "rank": self.acc.process_index,
            "device": str(self.device.type),
            "wall_s": wall,
            "busy_s": busy,  # GPU: kernels running; CPU: in operators
            "idle_s": max(wall - busy, 0.0),
            "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top_ops": [{"op": key, "s": s, "calls": count} for s, key, count in top[:15]],
        }


def describe(summary: dict, where: str | None = None) -> str:
    """The log line of a summary: the window, how busy, the kinds' shares of the wall time, the top operators
    (and where the files are)."""
    first, last = summary["steps"]
    wall, busy = summary["wall_s"], summary["busy_s"]
    share = lambda s: f"{100 * s / wall:.0f}%" if wall > 0 else "-"  # noqa: E731
    kinds = ", ".join(f"{kind} {share(s)}" for kind, s in summary["by_kind_s"].items())
    where_busy = "the device ran kernels" if summary["device"] == "cuda" else "in operators"
    top = ", ".join(f"{t['op']} {share(t['s'])}" for t in summary["top_ops"][:5])
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    files = f". Trace, operator table and summary of every rank in {where}" if where else ""
    return (
        f"profile of {steps} (rank {summary['rank']}): {wall:.3f} s, {where_busy} {share(busy)} of it "
        f"({kinds}); top operators: {top}{files}"
    )
