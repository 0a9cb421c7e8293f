"""Launch to first step: seconds from the launch command to the end of optimizer step 1, with fresh caches
(cold) and again with the caches the cold run filled (warm); single process and ZeRO-2. Also the seconds a
fresh interpreter spends importing what a run imports.

    .venv/bin/python bench/launch.py [--quick]
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

NAME = "launch"
TITLE = "4. launch to first step"
KEYS = ("single_cold", "single_warm", "zero2_cold", "zero2_warm")
PARTS = {"startup_s": "tab:gray", "data_s": "tab:blue", "model_s": "tab:orange", "prepare_and_step_s": "tab:green"}


def phases(marks: dict[str, float]) -> dict[str, float]:
    """A run's launch split at finetune's log lines (harness.PHASES)."""
    return {
        "to_first_step_s": marks["first_step"],
        "startup_s": marks["ready"],  # interpreter, imports, Accelerator (process group, DeepSpeed ops)
        "data_s": marks["data"] - marks["ready"],  # load + tokenize (datasets cache)
        "model_s": marks["model"] - marks["data"],  # from_pretrained
        "prepare_and_step_s": marks["first_step"] - marks["model"],  # optimizer, prepare, step 1
    }


def first_step(ctx: harness.Context, tag: str, config: str, accelerate_config: str | None, threads: int, **env) -> dict:
    """One finetune launch, stopped at the end of its step 1; its phases."""
    cmd = harness.finetune_cmd(config, ctx.runs / tag, accelerate_config, "--max_steps", "2")
    r = harness.launch(ctx, tag, cmd, threads, stop_at="] step 1/", **env)
    if "first_step" not in r.marks:
        raise RuntimeError(f"{tag}: no step 1 line; see {ctx.runs / f'{tag}.log'}")
    return phases(r.marks)


def run(ctx: harness.Context) -> dict:
    a = harness.assets(ctx)
    # Micro batch 1: step 1 itself is short, the time is what comes before it.
    config = harness.write_run_config(
        ctx,
        "launch",
        model=a["model"],
        dataset=a["instr"],
        format="instruction",
        max_seq_length=512,
        per_device_train_batch_size=1,
    )
    out: dict = {"imports": import_times()}
    only_given = "--only" in sys.argv or Path(sys.argv[0]).stem == NAME
    for name, acc_config, threads in (("single", None, 2), ("zero2", "zero2", 1)):
        if ctx.quick and name == "zero2" and not only_given:
            continue
        caches = Path(tempfile.mkdtemp(prefix=f"launch_{name}_", dir=ctx.work))
        env = {"HF_DATASETS_CACHE": str(caches / "datasets"), "TORCH_EXTENSIONS_DIR": str(caches / "torch_ext")}
        for state in ("cold", "warm"):
            tag = f"launch_{name}_{state}"
            out[f"{name}_{state}"] = p = first_step(ctx, tag, config, acc_config, threads, **env)
            harness.log(f"  {tag:<20} {p['to_first_step_s']:6.1f} s to step 1  {p}")
        shutil.rmtree(caches, ignore_errors=True)
    return out


def import_times() -> dict:
    """Seconds to import what a run imports (warm page cache), the largest imports by cumulative time, and
    the same with `transformers.get_scheduler` added, as finetune imported it before its own schedules
    (it imports transformers.trainer_utils, and that imports peft whenever peft is installed)."""
    # What a run imports before its first step (run.py imports some of it inside run()).
    code = "import finetune.cli, finetune.run, accelerate, datasets; from transformers import AutoModelForCausalLM"
    t0 = time.perf_counter()
    subprocess.run([harness.PY, "-c", code], cwd=harness.ROOT, env=harness.env(2), check=True)
    wall = time.perf_counter() - t0
    total, found = _importtime(code)
    with_scheduler, _ = _importtime(code + ", get_scheduler")
    top = sorted((r for r in found if "." not in r[2]), reverse=True)[:8]  # packages, where first imported
    return {
        "import_s": wall,
        "importtime_total_s": total,
        "importtime_total_s_with_get_scheduler": with_scheduler,
        "peft_imported": any(name == "peft" for _, _, name in found),
        "top_packages_s": {name: round(c, 2) for c, _, name in top},
    }


def _importtime(code: str) -> tuple[float, list[tuple[float, int, str]]]:
    """python -X importtime: (total seconds, [(cumulative s, depth, module)])."""
    r = subprocess.run(
        [harness.PY, "-X", "importtime", "-c", code],
        cwd=harness.ROOT,
        env=harness.env(2),
        capture_output=True,
        text=True,
        check=True,
    )
    found = []
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            found.append((int(m.group(2)) / 1e6, len(m.group(3)), m.group(4)))
    return sum(c for c, depth, _ in found if depth == 1), found


def rows(r: dict) -> list[harness.Row]:
    i = r["imports"]
    note = f"importtime {i['importtime_total_s']:.1f} s ({i['importtime_total_s_with_get_scheduler']:.1f} s"
    note += " with transformers.get_scheduler)"
    out = [harness.Row("4 launch", "import what a run imports", i["import_s"], "s", note)]
    for key in (k for k in KEYS if k in r):
        p = r[key]
        detail = (
            f"start {p['startup_s']:.1f} data {p['data_s']:.1f} model {p['model_s']:.1f} "
            f"step {p['prepare_and_step_s']:.1f}"
        )
        out.append(harness.Row("4 launch", key.replace("_", " "), p["to_first_step_s"], "s", detail))
    return out


def plot(ax, r: dict) -> None:
    keys = [k for k in KEYS if k in r]
    bottom = [0.0] * len(keys)
    for part, color in PARTS.items():
        vals = [r[k][part] for k in keys]
        labels = [k.replace("_", "\n") for k in keys]
        ax.bar(labels, vals, bottom=bottom, color=color, label=part.removesuffix("_s"))
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.legend(fontsize=7)
    ax.set_ylabel("s to end of step 1")


if __name__ == "__main__":
    harness.main(sys.modules[__name__])
