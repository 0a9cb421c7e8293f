"""The one benchmark harness: every script under bench/ launches, measures, compares and reports through it.

    launching   a finetune run (the real app: `python -m finetune` or `accelerate launch -m finetune`) or a
                worker (bench/baselines.py, a benchmark's own --worker) as a fresh process group with a
                timeout, the same thread settings for everyone; a run stops after its last step's log line
    measuring   finetune's numbers from <output_dir>/metrics.jsonl; tokens/s over the steps after warm-up
    comparing   interleaved repeats in rotating order, medians, paired per-repeat ratios, the verdict
    reporting   one table, the results JSON (command, load average, versions), the chart

A benchmark is a module with NAME, TITLE, `run(ctx) -> dict`, `rows(result) -> list[Row]` and optionally
`plot(ax, result)` and `add_arguments(parser)`; `harness.main(module)` runs one on its own, bench/perf.py
runs several and prints one table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # this checkout's finetune, also when another one is installed
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from finetune import launching  # noqa: E402

PY = sys.executable
ASSETS_VERSION = 3  # bump when the shared models or data below change
RUN_TIMEOUT_S = 900

# The 34M-parameter Llama of the throughput benchmark. head_dim must be given: demo.build_model sets attributes
# on a config that computed head_dim = 64 // 4 = 16 at construction, and would keep that.
LLAMA_34M = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=8192,
)
# A smaller one (~7M) for the two-rank harnesses (one thread per rank) and --quick.
LLAMA_7M = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=8192,
)
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"  # finetune's default


# ---------------------------------------------------------------- options and context


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: small models, 1 repeat, few steps; checks that everything runs, its numbers are not the targets'",
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats per comparison (default 4, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the numbers")
    parser.add_argument("--work", default=str(ROOT / ".cache" / "bench_perf"), help="models, data and run outputs")
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"), help="where the JSON and chart go")


@dataclass
class Context:
    """What a benchmark gets: its options, the shared work directory and this invocation's run directory."""

    opts: argparse.Namespace
    work: Path
    runs: Path  # this invocation's run outputs and logs (never shared with a concurrent invocation)

    @property
    def quick(self) -> bool:
        return self.opts.quick

    def option(self, name: str, default: int, quick: int) -> int:
        """An integer option: as given on the command line, else its quick or full default."""
        value = getattr(self.opts, name, None)
        return value if value is not None else quick if self.quick else default


def make_context(opts: argparse.Namespace) -> Context:
    opts.repeats_given, opts.steps_given = opts.repeats, opts.steps  # None unless given: some have other defaults
    opts.repeats = opts.repeats or (1 if opts.quick else 4)  # run_suite sets it per benchmark
    opts.steps = opts.steps or 4
    opts.warmup = min(opts.warmup, opts.steps - 1)
    work = Path(opts.work)
    # One datasets cache for every run that does not ask for a fresh one (children inherit it).
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
    runs = work / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    runs.mkdir(parents=True)
    for old in sorted((work / "runs").glob("2*"))[:-5]:  # keep the newest 5 invocations' logs
        shutil.rmtree(old, ignore_errors=True)
    return Context(opts, work, runs)


def log(message: str) -> None:
    print(f"[bench] {message}", flush=True)


# ---------------------------------------------------------------- shared assets (built once, offline)


def assets(ctx: Context) -> dict[str, str]:
    """Tokenizer, the 34M and 7M models, a text set and an instruction set under work/ (reused while
    ASSETS_VERSION matches). Under --quick, "model" is the 7M one."""
    from finetune import demo

    marker = ctx.work / "assets.json"
    paths = None
    if marker.exists():
        saved = json.loads(marker.read_text())
        paths = saved["paths"] if saved.get("version") == ASSETS_VERSION else None
    if paths is None:
        log(f"building models and data under {ctx.work} (once)")
        with contextlib.redirect_stderr(open(os.devnull, "w")):  # progress bars
            tok = demo.build_tokenizer(ctx.work / "tokenizer")
            paths = {
                "model": demo.build_model("llama", ctx.work / "llama34m", tok, **LLAMA_34M),
                "small_model": demo.build_model("llama", ctx.work / "llama7m", tok, **LLAMA_7M),
            }
        # Plain text, cut by finetune into full 256-token blocks: no padding anywhere (throughput, ddp).
        text = [{"text": " ".join(e["text"] for e in demo.topic_examples(40, seed=i))} for i in range(400)]
        paths["text"] = demo.write_jsonl(text, ctx.work / "text.jsonl")
        paths["instr"] = demo.write_jsonl(instruction_rows(3000, 1, tok), ctx.work / "instr.jsonl")
        marker.write_text(json.dumps({"version": ASSETS_VERSION, "paths": paths}, indent=1))
    return {**paths, "model": paths["small_model"]} if ctx.quick else paths


def saved_llama(ctx: Context, name: str, config) -> str:
    """A randomly initialised Llama of `config` (a transformers config) with the shared tokenizer, saved once under
    work/<name>."""
    path = ctx.work / name
    if not (path / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log(f"  building {name} under {path}")
        assets(ctx)  # the tokenizer, under work/
        tok = AutoTokenizer.from_pretrained(ctx.work / "tokenizer")
        config.pad_token_id, config.bos_token_id, config.eos_token_id = (
            tok.pad_token_id,
            tok.bos_token_id,
            tok.eos_token_id,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        tok.save_pretrained(path)
    return str(path)


def instruction_rows(n: int, seed: int, tokenizer, lo: int = 16, hi: int = 512) -> list[dict]:
    """prompt/response pairs whose tokenized length (template, response and EOS included) is spread
    uniformly over lo..hi tokens: ~40% prompt, ~60% response."""
    import random

    from finetune import demo

    rng = random.Random(seed)
    words = sorted({w for text in demo.TOPICS.values() for w in text.split()} | set(demo.FILLER))
    overhead = len(tokenizer(PROMPT_TEMPLATE.format(prompt=""))["input_ids"]) + 1  # + EOS
    sample = " ".join(rng.choice(words) for _ in range(2000))
    per_word = len(tokenizer(sample, verbose=False)["input_ids"]) / 2000
    rows = []
    for _ in range(n):
        content = max(2, round((rng.randint(lo, hi) - overhead) / per_word))
        n_prompt = max(1, round(content * 0.4))
        rows.append(
            {
                "prompt": " ".join(rng.choice(words) for _ in range(n_prompt)),
                "response": " ".join(rng.choice(words) for _ in range(max(1, content - n_prompt))),
            }
        )
    return rows


def write_run_config(ctx: Context, name: str, **values: Any) -> str:
    """A finetune run config (YAML is a superset of JSON): fp32, no eval, log every step, no checkpoints."""
    base = {
        "task": "causal_lm",
        "torch_dtype": "float32",
        "eval_fraction": 0,
        "learning_rate": 1e-4,
        "lr_scheduler_type": "linear",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "logging_steps": 1,
        "save_steps": None,
        "disable_tqdm": True,
        "seed": 42,
    }
    path = ctx.work / f"{name}.yaml"
    path.write_text(json.dumps({**base, **values}, indent=1))
    return str(path)


# ---------------------------------------------------------------- launching


def env(threads: int, **extra: str) -> dict[str, str]:
    """The environment of every measured process: the same thread count for torch and its libraries."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        **extra,
    }


# Lines finetune logs at the end of each startup phase (run.py), in order.
PHASES = {"ready": "] distributed: ", "data": "] data: ", "model": "] model: ", "first_step": "] step 1/"}


def launch(
    ctx: Context,
    tag: str,
    cmd: list[str],
    threads: int,
    stop_at: str | None = None,
    marks: dict[str, str] | None = None,
    **extra_env: str,
) -> launching.Launched:
    """Run cmd (its log: runs/<tag>.log, each line time-stamped from launch); raise with the log's tail on failure."""
    log_path = ctx.runs / f"{tag}.log"
    r = launching.launch(cmd, RUN_TIMEOUT_S, env(threads, **extra_env), log_path, stop_at, {**PHASES, **(marks or {})})
    if r.rc != 0:
        why = f"timed out after {RUN_TIMEOUT_S} s" if r.timed_out else f"exit {r.rc}"
        raise RuntimeError(f"{tag}: {why}; see {log_path}\n{r.output[-2000:]}")
    return r


def finetune_cmd(config: str, out: Path, accelerate_config: str | None = None, *overrides: str) -> list[str]:
    """A finetune run of a run config into out/, under a shipped Accelerate config or as one plain process."""
    args = ["--config", config, "--output_dir", str(out), "--overwrite_output_dir", "true", *overrides]
    path = ROOT / "accelerate_configs" / f"{accelerate_config}.yaml" if accelerate_config else None
    return launching.finetune_command(args, path)


def run_finetune(
    ctx: Context, tag: str, config: str, steps: int, threads: int, accelerate_config: str | None = None, **extra_env
) -> dict:
    """finetune for `steps` optimizer steps, stopped after the last step's log line (its metrics row is written
    before that line); tokens/s and step time from metrics.jsonl, without the first --warmup steps."""
    out = ctx.runs / tag
    cmd = finetune_cmd(config, out, accelerate_config, "--max_steps", str(steps))
    r = launch(ctx, tag, cmd, threads, stop_at=f"] step {steps}/{steps}", **extra_env)
    train = [row for row in read_rows(out) if "loss" in row]
    per_step = [(row["tokens_per_s"] * row["step_time_s"], row["step_time_s"]) for row in train]
    padding = [row["padding_fraction"] for row in train[ctx.opts.warmup :]]
    return {
        **steady(per_step, ctx.opts.warmup),
        "losses": [row["loss"] for row in train],
        "padding_fraction": statistics.mean(padding) if padding else None,
        "wall_s": r.wall_s,
    }


def read_rows(out: Path) -> list[dict]:
    from finetune.metrics import read_metrics

    return read_metrics(str(out))


def torchrun(ranks: int) -> list[str]:
    """A launcher for run_worker: `ranks` processes on this machine under torchrun, on 127.0.0.1 only."""
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--local_addr",
        "127.0.0.1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "127.0.0.1:0",  # the agent binds a port the OS picks and tells its ranks: no port to race for
    ]


def run_worker(
    ctx: Context,
    script: str,
    kind: str,
    spec: dict,
    tag: str,
    threads: int,
    launcher: list[str] | None = None,
    stop_at: str | None = None,
    marks: dict[str, str] | None = None,
) -> dict:
    """A worker (`bench/<script> --worker KIND`) in a fresh process (or under `launcher`, e.g. torchrun); returns
    what it wrote to its result file, plus wall_s and the marks of its output lines."""
    result = ctx.runs / f"{tag}.json"
    result.unlink(missing_ok=True)
    cmd = [
        *(launcher or [PY]),
        str(BENCH / script),
        "--worker",
        kind,
        "--spec",
        json.dumps(spec),
        "--result",
        str(result),
    ]
    r = launch(ctx, tag, cmd, threads, stop_at=stop_at, marks=marks, **spec.get("env", {}))
    out = json.loads(result.read_text()) if result.exists() else {}
    if not out and not r.stopped:
        raise RuntimeError(f"{tag}: no result; see {ctx.runs / f'{tag}.log'}")
    return {**out, "wall_s": r.wall_s, "marks": r.marks}


def worker_main(workers: dict[str, Callable[[dict], dict]]) -> bool:
    """In a worker process (--worker KIND --spec JSON --result PATH): run it, write its result; False otherwise."""
    if "--worker" not in sys.argv:
        return False
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=sorted(workers), required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--result", required=True)
    o = parser.parse_args()
    result = workers[o.worker](json.loads(o.spec))
    if result:
        Path(o.result).write_text(json.dumps(result, indent=1))
    return True


# ---------------------------------------------------------------- measuring and comparing


def steady(steps: list[tuple[float, float]], warmup: int) -> dict:
    """(tokens, seconds) per optimizer step -> tokens/s and step time over the steps after warm-up."""
    kept = steps[warmup:] or steps[-1:]
    tokens, seconds = sum(t for t, _ in kept), sum(s for _, s in kept)
    return {
        "tokens_per_s": tokens / seconds,
        "step_time_s": statistics.median(s for _, s in kept),
        "tokens_per_step": tokens / len(kept),
        "steps_measured": len(kept),
        "per_step": [(t, round(s, 3)) for t, s in steps],  # all steps, warm-up included
    }


def interleaved(systems: dict[str, Callable[[int], dict]], repeats: int, key: str = "tokens_per_s") -> dict:
    """Run every system once per repeat, rotating the order each repeat (A B C, B C A, C A B, ...)."""
    names = list(systems)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            r = systems[name](rep)
            results[name].append(r)
            step = f"  (step {r['step_time_s']:.2f} s)" if "step_time_s" in r else ""
            log(f"  repeat {rep + 1}/{repeats} {name:<20} {r[key]:9.2f} {key}{step}")
    return results


def summary(runs: list[dict], key: str = "tokens_per_s") -> dict:
    """Medians over repeats (and every repeat's value of `key`)."""
    out = {key: statistics.median(r[key] for r in runs), f"{key}_runs": [r[key] for r in runs]}
    for k in ("step_time_s", "tokens_per_step"):
        if all(k in r for r in runs):
            out[k] = statistics.median(r[k] for r in runs)
    return out


def same_batches(runs: dict[str, list[dict]], names: tuple[str, ...]) -> None:
    """Systems compared batch for batch must have measured the same steps: equal real tokens per step
    (a different warm-up cut, or another data order, would compare different batches)."""
    per_step = {n: [round(r["tokens_per_step"], 3) for r in runs[n]] for n in names}
    if len({tuple(v) for v in per_step.values()}) > 1:
        raise RuntimeError(f"the compared runs measured different batches (tokens per step): {per_step}")


def ratio(out: dict, runs: dict, ours: str, other: str, name: str, key: str = "tokens_per_s", lower=False) -> None:
    """out[name]: ours / other of the medians of `key`; out[name + "_paired"]: the same per repeat (each repeat's
    two runs ran side by side). lower: smaller is better (seconds), so the ratio is other / ours (> 1: ours wins)."""
    a, b = (out[other][key], out[ours][key]) if lower else (out[ours][key], out[other][key])
    out[name] = a / b
    pairs = zip(runs[other], runs[ours]) if lower else zip(runs[ours], runs[other])
    out[f"{name}_paired"] = [x[key] / y[key] for x, y in pairs]


def verdict(value: float, paired: list[float], target: float) -> bool | str:
    """True when the median ratio and every repeat's paired ratio meet the target, False when none do;
    "tie" when they disagree: the difference is within this machine's run-to-run noise."""
    hits = [p >= target for p in paired] + [value >= target]
    return True if all(hits) else False if not any(hits) else "tie"


def spread(values: list[float]) -> str:
    return f"runs {min(values):.2f}..{max(values):.2f}" if values else ""


# ---------------------------------------------------------------- reporting


class Row(NamedTuple):
    bench: str
    what: str
    value: float
    unit: str
    note: str = ""
    target: str = ""
    met: bool | str | None = None


def ratio_row(bench: str, what: str, result: dict, key: str, target: float | None = None, note: str = "") -> Row:
    """A row for result[key] (a ratio) with its per-repeat range and, given a target, the verdict."""
    paired = result.get(f"{key}_paired", [])
    text = "; ".join(t for t in (spread(paired), note) if t)
    if target is None:
        return Row(bench, what, result[key], "x", text)
    return Row(bench, what, result[key], "x", text, f">= {target}", verdict(result[key], paired, target))


def table(rows: list[Row], command: str, context: str) -> str:
    lines = [f"$ {command}", context, ""]
    lines.append(f"{'benchmark':<12} {'what':<30} {'value':>10} {'unit':<11} {'':<46} {'target':<7} met")
    lines.append("-" * 126)
    for r in rows:
        mark = r.met if isinstance(r.met, str) else "" if r.met is None else ("yes" if r.met else "NO")
        lines.append(f"{r.bench:<12} {r.what:<30} {r.value:>10.2f} {r.unit:<11} {r.note:<46} {r.target:<7} {mark}")
    return "\n".join(lines)


def bars(ax, result: dict, systems: list[str], key: str = "tokens_per_s", ylabel: str = "tokens/s") -> None:
    """One bar per system (its median) with every repeat's value as a dot."""
    bar = ax.bar(systems, [result[s][key] for s in systems], color=["tab:blue", "tab:gray", "tab:orange", "tab:green"])
    ax.bar_label(bar, fmt="%.0f" if result[systems[0]][key] > 100 else "%.2f")
    for i, s in enumerate(systems):
        runs = result[s][f"{key}_runs"]
        ax.plot([i] * len(runs), runs, "k.", ms=4)
    ax.set_ylabel(ylabel)
    ax.set_xticks(range(len(systems)), [s.replace("_", "\n", 1) for s in systems], fontsize=7)


def plot(modules: list, results: dict, path: Path) -> None:
    """One panel per benchmark that draws one (its `plot(ax, result)`); needs matplotlib."""
    try:
        import matplotlib
    except ImportError:
        log("matplotlib not installed (the `bench` extra): no chart")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [m for m in modules if hasattr(m, "plot") and m.NAME in results]
    if not panels:
        return
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, m in zip(axes.flat, panels):
        ax.set_title(m.TITLE, fontsize=10)  # a benchmark's plot may name its panel more precisely
        m.plot(ax, results[m.NAME])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("torch", "transformers", "accelerate", "datasets", "deepspeed"):
        with contextlib.suppress(PackageNotFoundError):
            out[p] = version(p)
    return out


def run_suite(modules: list, opts: argparse.Namespace, stem: str) -> dict:
    """Run the benchmarks, print one table, write <results>/<stem>.json and <stem>.png."""
    ctx = make_context(opts)
    command = f"bench/{Path(sys.argv[0]).name} " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results: dict = {}
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    repeats = {}
    for m in modules:
        log(f"{m.NAME} ...")
        t = time.perf_counter()
        # A benchmark may set its own default (REPEATS), e.g. to keep a long grid within its time budget.
        opts.repeats = repeats[m.NAME] = opts.repeats_given or (1 if opts.quick else getattr(m, "REPEATS", 4))
        results[m.NAME] = m.run(ctx)
        results[m.NAME]["bench_wall_s"] = time.perf_counter() - t
    wall = time.perf_counter() - t0
    load_end = os.getloadavg()
    counts = sorted(set(repeats.values()))
    each = ", ".join(f"{n} {r}" for n, r in repeats.items()) if len(counts) > 1 else str(counts[0])
    context = (
        f"repeats: {each}; {opts.steps} steps per run unless a benchmark says otherwise (first {opts.warmup} dropped), "
        f"medians; {wall / 60:.1f} min; "
        f"{os.cpu_count()} CPUs, load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at end"
        + ("; --quick: a smoke run, not the targets' numbers" if opts.quick else "")
    )
    # the settings each side ran with, from the benchmarks that compare against other programs
    context += "".join(f"\n{m.NAME} settings: {m.settings(results[m.NAME])}" for m in modules if hasattr(m, "settings"))
    text = table([row for m in modules for row in m.rows(results[m.NAME])], command, context)
    print("\n" + text, flush=True)
    out = Path(opts.results)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": command,
        "table": text,
        "wall_s": wall,
        "repeats": repeats,
        "steps": opts.steps,
        "warmup_steps_dropped": opts.warmup,
        "quick": opts.quick,
        "machine": {"cpus": os.cpu_count(), "load_avg_1_5_15_start": load_start, "load_avg_1_5_15_end": load_end},
        "versions": versions(),
    }
    (out / f"{stem}.json").write_text(json.dumps({**meta, "results": results}, indent=1, default=float))
    plot(modules, results, out / f"{stem}.png")
    log(f"wrote {out / f'{stem}.json'}" + (f" and {out / f'{stem}.png'}" if (out / f"{stem}.png").exists() else ""))
    return results


def main(module) -> None:
    """A benchmark run on its own: `python bench/<name>.py [--quick] [--repeats N] ...` -> results/<name>.json."""
    parser = argparse.ArgumentParser(description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    opts = parser.parse_args()
    # --quick and --plan_only (capacity.py) numbers are written beside the real ones, never over them
    stem = module.NAME + ("_quick" if opts.quick else "") + ("_plan" if getattr(opts, "plan_only", False) else "")
    run_suite([module], opts, stem)


# ---------------------------------------------------------------- finetune's data, in this process


def config_and_tokenizer(config: str, **overrides: Any):
    """A run config as finetune parses it, and the tokenizer finetune loads for it."""
    import datasets

    from finetune import model
    from finetune.config import build_config, load_yaml

    datasets.disable_progress_bars()
    cfg = build_config({**load_yaml(config), **overrides}, check_filesystem=False)
    return cfg, model.load_tokenizer(cfg.model)


def finetune_datasets(config: str, **overrides: Any):
    """finetune's tokenized datasets (finetune.data.build_datasets) and tokenizer for a run config."""
    from finetune import data

    cfg, tok = config_and_tokenizer(config, **overrides)
    return data.build_datasets(cfg.data, cfg.model.task, tok, cfg.train.seed, contextlib.nullcontext), tok


def epoch_order(n: int, seed: int, epoch: int = 0) -> list[int]:
    """The order finetune trains n rows in (its EpochSampler)."""
    from finetune.data import EpochSampler

    s = EpochSampler(n, seed)
    s.set_epoch(epoch)
    return list(s)
