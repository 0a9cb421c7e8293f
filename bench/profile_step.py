"""Where a training step's time goes (issue 18): finetune and HF Trainer under py-spy, on the same shape.

Each system trains the grid's model (bench/grid.py: 32k vocabulary, fixed-length text, fp32, 1 process x 2
threads) for --steps optimizer steps under `py-spy record --nonblocking` (--rate samples/s of the main thread;
sampling without stopping the process, so the step is not slowed). Only the samples inside the training loop
count (finetune.loop._train, Trainer._inner_training_loop), so start-up is left out; the first step is in, and
more steps dilute it. Each sample goes to the first phase its stack passes through, from the loop inwards:

  setup       Trainer's preparation inside its loop function (accelerate's prepare, free_memory): not per step
  forward     the model's forward (and the loss in it)
  backward    autograd's backward
  optimizer   torch.optim (AdamW's kernel) and the LR scheduler's step
  clip        the gradient norm and clipping
  zero_grad   setting the gradients to None
  data        the data loader: sampler, fetch, collate
  log         metrics rows, logging, callbacks
  other       everything else in the loop: accelerate's accumulate/sync machinery, seeding, the
              bookkeeping between calls (the table names its heaviest functions)

    .venv/bin/python bench/profile_step.py                     # 5M and 34M at seq 128, 12 steps each
    .venv/bin/python bench/profile_step.py --sizes 34M --seqs 512 --steps 6

Prints milliseconds per step per phase and writes bench/results/profile_step.json (with the raw stacks'
heaviest 'other' functions).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
from pathlib import Path

import grid
import harness

NAME = "profile_step"
TITLE = "issue 18: where a step's time goes"
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
LOOPS = {  # the frame under which a sample is in the training loop
    "finetune": "_train (finetune/loop.py)",
    "hf_trainer": "_inner_training_loop (transformers/trainer.py)",
}
# (phase, substrings of a frame "function (path)"), tried from the loop's frame inwards: the first frame
# that matches one of them names the phase.
PHASES = [
    (
        "setup",
        ("free_memory (accelerate/", "_prepare_for_training (transformers/", "prepare (accelerate/accelerator.py)"),
    ),
    (
        "forward",
        (
            "_call_impl (torch/nn/modules/module.py)",
            "forward_loss (finetune/parallel/",
            "compute_loss (transformers/trainer.py)",
        ),
    ),
    ("backward", ("backward (torch/_tensor.py)", "backward (accelerate/accelerator.py)", "backward (torch/autograd/")),
    ("clip", ("clip_grad_norm", "_get_total_norm")),
    (
        "optimizer",
        (
            "step (torch/optim/",
            "wrapper (torch/optim/",
            "step (accelerate/optimizer.py)",
            "step (accelerate/scheduler.py)",
            "step (torch/optim/lr_scheduler.py)",
        ),
    ),
    ("zero_grad", ("zero_grad (",)),
    (
        "data",
        (
            "__next__ (torch/utils/data/",
            "__iter__ (accelerate/data_loader.py)",
            "__next__ (accelerate/",
            "__iter__ (torch/utils/data/",
            "<listcomp> (finetune/loop.py)",
            "next (",
        ),
    ),
    (
        "log",
        (
            "_log_train (finetune/",
            "log (transformers/trainer.py)",
            "_maybe_log_save_evaluate",
            "on_step_end (",
            "call_event (transformers/trainer_callback.py)",
            "on_log",
        ),
    ),
]
ORDER = ["setup", "forward", "backward", "optimizer", "clip", "zero_grad", "data", "log", "other"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="5M,34M", help="grid sizes (bench/grid.py)")
    parser.add_argument("--seqs", default="128", help="sequence lengths")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")


def classify(stack: list[str], loop: str) -> str | None:
    """The phase of one sample (frames outermost first); None when it is not inside the loop."""
    inside = next((i for i, frame in enumerate(stack) if loop in frame), None)
    if inside is None:
        return None
    for frame in stack[inside + 1 :]:
        for phase, marks in PHASES:
            if any(m in frame for m in marks):
                return phase
    return "other"


def read_profile(path: Path, loop: str) -> tuple[collections.Counter, collections.Counter]:
    """py-spy's raw (collapsed) output -> samples per phase, and per innermost Python frame of 'other'."""
    phases: collections.Counter = collections.Counter()
    other: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stacks, _, count = line.rpartition(" ")
        stack = [
            frame.split(" (", 1)[0] + " (" + _short(frame) + ")" if " (" in frame else frame
            for frame in stacks.split(";")
        ]
        phase = classify(stack, loop)
        if phase is None:
            continue
        phases[phase] += int(count)
        if phase == "other":
            inside = next(i for i, frame in enumerate(stack) if loop in frame)
            other[" > ".join(stack[inside + 1 :][:3]) or "(the loop's own lines)"] += int(count)
    return phases, other


def _short(frame: str) -> str:
    """'f (/x/site-packages/torch/optim/adamw.py)' -> 'torch/optim/adamw.py'; our files from the package root."""
    path = frame.rsplit(" (", 1)[1].rstrip(")")
    for root in ("site-packages/", "/bench/", "/main/"):
        if root in path:
            return path.split(root, 1)[1] if root != "/bench/" else "bench/" + path.split(root, 1)[1]
    return path


def profile(ctx: harness.Context, tag: str, system: str, config: str, steps: int, rate: int) -> dict:
    raw = ctx.runs / f"{tag}.txt"
    spy = [
        PY_SPY,
        "record",
        "--rate",
        str(rate),
        "--nonblocking",
        "--nolineno",
        "--format",
        "raw",
        "--output",
        str(raw),
        "--",
    ]
    if system == "finetune":
        cmd = harness.finetune_cmd(config, ctx.runs / tag, None, "--max_steps", str(steps))
        cmd += ["--logging_steps", str(steps)]  # as a user would log: not every step
    else:
        spec = {"config": config, "steps": steps, "threads": 2, "collator": "default", "warmup": 1}
        result = ctx.runs / f"{tag}.json"
        cmd = [harness.PY, str(harness.BENCH / "baselines.py"), "--worker", "trainer"]
        cmd += ["--spec", json.dumps(spec), "--result", str(result)]
    harness.launch(ctx, tag, [*spy, *cmd], 2)
    phases, other = read_profile(raw, LOOPS[system])
    per_step = {p: 1000 * phases[p] / rate / steps for p in ORDER}
    return {
        "ms_per_step": per_step,
        "total_ms_per_step": sum(v for p, v in per_step.items() if p != "setup"),
        "samples": sum(phases.values()),
        "other_top": [(k, round(1000 * v / rate / steps, 2)) for k, v in other.most_common(8)],
    }


def run(ctx: harness.Context) -> dict:
    o = ctx.opts
    sizes = {n: grid.SIZES[n] for n in o.sizes.split(",")}
    a = grid.build_assets(ctx, sizes)
    out: dict = {"rate": o.rate}
    for name, (_, tokens, _) in sizes.items():
        for seq in (int(s) for s in o.seqs.split(",")):
            point = f"{name}_s{seq}"
            steps = o.steps_given or (4 if ctx.quick else 12)
            config = harness.write_run_config(
                ctx,
                f"profile_{point}",
                model=a["models"][name],
                dataset=a["train"],
                format="text",
                max_seq_length=seq,
                per_device_train_batch_size=tokens // seq,
            )
            out[point] = {"steps": steps, "micro": tokens // seq}
            for system in LOOPS:
                harness.log(f"  profile {point}: {system}, {steps} steps")
                out[point][system] = profile(ctx, f"profile_{point}_{system}", system, config, steps, o.rate)
    return out


def rows(result: dict) -> list[harness.Row]:
    out = []
    for point, r in result.items():
        if not isinstance(r, dict) or "finetune" not in r:
            continue
        for system in LOOPS:
            ms = r[system]["ms_per_step"]
            outside = sum(ms[p] for p in ("zero_grad", "data", "log", "other"))
            note = f"outside {outside:.1f}: " + " ".join(f"{p} {ms[p]:.1f}" for p in ORDER if ms[p] >= 0.05)
            out.append(harness.Row(f"profile {point}", system, r[system]["total_ms_per_step"], "ms/step", note))
    return out


if __name__ == "__main__":
    harness.main(sys.modules[__name__])
