"""Performance suite: finetune against a bare PyTorch loop and HF Trainer, and the costs around a run.

    .venv/bin/python bench/perf.py                                  # everything (~15 min on 2 CPU cores)
    .venv/bin/python bench/perf.py --only throughput,packing        # some benchmarks
    .venv/bin/python bench/perf.py --quick                          # smoke run: 1 repeat, few steps

Benchmarks (see bench/README.md for what each row means):
  throughput  tokens/s: finetune vs a bare PyTorch loop vs HF Trainer (34M Llama, seq 256, batch 8, fp32)
  packing     real tokens/s on instruction data of 16..512 tokens: our packing vs our padding vs HF Trainer
  ddp         2 processes x 1 thread vs 1 process x 2 threads (finetune, same global batch)
  launch      launch to first optimizer step, cold (fresh caches) and warm; single process and ZeRO-2
  balance     with variable-length data under DDP: the time ranks wait for each other per step, with our
              round-robin batches and with length-aware batches (same global batch, split by cost)
  tokenize    tokenization throughput on 100k examples, and the datasets cache on a second run

Every comparison runs side by side in this one invocation: the systems take turns (the order rotates
each repeat), each run in a fresh process, from the same saved model, the same tokenized data in the
same order and the same batch size, fp32, with the same thread count. Reported values are medians
over repeats. finetune is always the real app (`python -m finetune`, `accelerate launch -m finetune`);
its numbers come from <output_dir>/metrics.jsonl (tokens_per_s, step_time_s) without the first
`--warmup` steps. Prints one table; writes bench/results/perf.json and bench/results/perf.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
PY = sys.executable
BENCHMARKS = ("throughput", "packing", "ddp", "launch", "balance", "tokenize")
ASSETS_VERSION = 3  # bump when the models or data below change

# The 34M-parameter Llama of the issue. head_dim must be given: demo.build_model sets attributes on a
# config that computed head_dim = 64 // 4 = 16 at construction, and would keep that.
LLAMA_34M = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=8192,
)
# A smaller one (~7M) for the two-rank balance harness, where each rank has one thread.
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


# ---------------------------------------------------------------- assets (built once, offline)


def _words() -> list[str]:
    from finetune import demo

    return sorted({w for text in demo.TOPICS.values() for w in text.split()} | set(demo.FILLER))


def instruction_rows(n: int, seed: int, tokenizer, lo: int = 16, hi: int = 512) -> list[dict]:
    """prompt/response pairs whose tokenized length (template, response and EOS included) is spread
    uniformly over lo..hi tokens: ~40% prompt, ~60% response."""
    rng = random.Random(seed)
    words = _words()
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


def build_assets(work: Path) -> dict[str, str]:
    """Tokenizer, the two models and the data sets, under work/ (reused while ASSETS_VERSION matches)."""
    from finetune import demo

    marker = work / "assets.json"
    if marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("version") == ASSETS_VERSION:
            return saved["paths"]
    print(f"[perf] building models and data under {work} (once)", flush=True)
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stderr(open(os.devnull, "w")):  # progress bars
        tok = demo.build_tokenizer(work / "tokenizer")
        paths = {
            "model": demo.build_model("llama", work / "llama34m", tok, **LLAMA_34M),
            "small_model": demo.build_model("llama", work / "llama7m", tok, **LLAMA_7M),
        }
    # Plain text, cut by finetune into full 256-token blocks: no padding anywhere (throughput, ddp).
    text = [{"text": " ".join(e["text"] for e in demo.topic_examples(40, seed=i))} for i in range(400)]
    paths["text"] = demo.write_jsonl(text, work / "text.jsonl")
    paths["instr"] = demo.write_jsonl(instruction_rows(3000, 1, tok), work / "instr.jsonl")
    marker.write_text(json.dumps({"version": ASSETS_VERSION, "paths": paths}, indent=1))
    return paths


def tokenize_set(work: Path, n: int) -> str:
    """The tokenization benchmark's instruction set of n examples (built once per size)."""
    from transformers import AutoTokenizer

    from finetune import demo

    path = work / f"instr_{n // 1000}k.jsonl"
    if not path.exists():
        tok = AutoTokenizer.from_pretrained(work / "tokenizer")
        demo.write_jsonl(instruction_rows(n, 2, tok), str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
    return str(path)


def write_run_config(work: Path, name: str, **values) -> str:
    """A finetune run config (YAML is a superset of JSON)."""
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
    path = work / f"{name}.yaml"
    path.write_text(json.dumps({**base, **values}, indent=1))
    return str(path)


# ---------------------------------------------------------------- running things


# This invocation's run outputs and logs: a directory of its own, so that two invocations never mix.
RUN_ID = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def runs_dir(work: Path) -> Path:
    return work / "runs" / RUN_ID


def free_port() -> int:
    """A free TCP port for a launcher's rendezvous (the default 29500 may be another job's on a shared machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_env(threads: int, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }
    env.update(extra)
    return env


# Lines finetune logs at the end of each startup phase (run.py), in order.
PHASES = (("ready", "] distributed: "), ("data", "] data: "), ("model", "] model: "), ("first_step", "] step 1/"))


def launch(cmd: list[str], env: dict[str, str], log: Path, timeout: float, stop_at: str | None = None) -> dict:
    """Run a command, time-stamping each output line; returns exit code, wall time and phase times.

    stop_at: once a line contains it, the whole process group is killed and the run counts as done
    (rc 0): finetune's metrics row for a step is written before its log line, and what comes after
    the last timed step (final checkpoint, export, interpreter exit) is not measured."""
    t0 = time.perf_counter()
    marks: dict[str, float] = {}
    lines = []
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    stopped = False
    try:
        for line in proc.stdout:
            now = time.perf_counter() - t0
            lines.append(f"{now:8.2f} {line}")
            for name, needle in PHASES:
                if name not in marks and needle in line:
                    marks[name] = now
            if stop_at and stop_at in line:
                stopped = True
                kill()
                break
        proc.wait()
    finally:
        watchdog.cancel()
        kill()  # leftovers of a launcher (its ranks share the process group)
    log.write_text("".join(lines))
    rc = 0 if stopped else proc.returncode
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "marks": marks, "log": str(log)}


def finetune_cmd(config: str, out: Path, accelerate_config: str | None, *overrides: str) -> list[str]:
    args = ["-m", "finetune", "--config", config, "--output_dir", str(out), "--overwrite_output_dir", "true"]
    args += list(overrides)
    if accelerate_config is None:
        return [PY, *args]
    cfg = str(ROOT / "accelerate_configs" / f"{accelerate_config}.yaml")
    port = ["--main_process_port", str(free_port())]
    return [PY, "-m", "accelerate.commands.launch", "--config_file", cfg, *port, *args]


def steady(steps: list[tuple[int, float]], warmup: int) -> dict:
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


def run_finetune(
    tag: str, config: str, work: Path, steps: int, warmup: int, threads: int, accelerate_config=None, **env
) -> dict:
    out = runs_dir(work) / tag
    cmd = finetune_cmd(config, out, accelerate_config, "--max_steps", str(steps))
    r = launch(cmd, bench_env(threads, **env), runs_dir(work) / f"{tag}.log", 900, stop_at=f"] step {steps}/{steps}")
    if r["rc"] != 0:
        raise RuntimeError(f"{tag}: exit {r['rc']}; see {r['log']}\n" + Path(r["log"]).read_text()[-2000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [row for row in rows if "loss" in row]
    per_step = [(row["tokens_per_s"] * row["step_time_s"], row["step_time_s"]) for row in train]
    padding = [row["padding_fraction"] for row in train[warmup:]]
    return {
        **steady(per_step, warmup),
        "losses": [row["loss"] for row in train],
        "padding_fraction": statistics.mean(padding) if padding else None,
        "wall_s": r["wall_s"],
    }


def run_worker(kind: str, spec: dict, work: Path, threads: int, tag: str) -> dict:
    """A bare-loop / Trainer / tokenization worker (this file, --worker) in a fresh process."""
    result = runs_dir(work) / f"{tag}.json"
    result.unlink(missing_ok=True)
    cmd = [PY, str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec), "--result", str(result)]
    env = spec.get("env", {})
    r = launch(cmd, bench_env(threads, **env), runs_dir(work) / f"{tag}.log", timeout=900)
    if r["rc"] != 0 or not result.exists():
        raise RuntimeError(f"{tag}: exit {r['rc']}; see {r['log']}\n" + Path(r["log"]).read_text()[-2000:])
    return {**json.loads(result.read_text()), "wall_s": r["wall_s"]}


def interleaved(systems: dict, repeats: int) -> dict[str, list[dict]]:
    """Run every system once per repeat, rotating the order each repeat (A B C, B C A, C A B, ...)."""
    names = list(systems)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            r = systems[name](rep)
            results[name].append(r)
            print(
                f"[perf]   repeat {rep + 1}/{repeats} {name:<16} {r['tokens_per_s']:8.1f} tokens/s  "
                f"(step {r['step_time_s']:.2f} s)",
                flush=True,
            )
    return results


def summary(runs: list[dict]) -> dict:
    tps = [r["tokens_per_s"] for r in runs]
    return {
        "tokens_per_s": statistics.median(tps),
        "tokens_per_s_runs": tps,
        "step_time_s": statistics.median(r["step_time_s"] for r in runs),
        "tokens_per_step": statistics.median(r["tokens_per_step"] for r in runs),
    }


def same_batches(runs: dict[str, list[dict]], names: tuple[str, ...]) -> None:
    """Systems compared batch for batch must have measured the same steps: equal real tokens per step
    (a different warm-up cut, or another data order, would compare different batches)."""
    per_step = {n: [round(r["tokens_per_step"], 3) for r in runs[n]] for n in names}
    if len({tuple(v) for v in per_step.values()}) > 1:
        raise RuntimeError(f"the compared runs measured different batches (tokens per step): {per_step}")


def compare(out: dict, runs: dict[str, list[dict]], ours: str, other: str, key: str) -> None:
    """out[key]: ours / other in median tokens/s; out[key + "_paired"]: the same per repeat (each
    repeat's two runs ran side by side)."""
    out[key] = out[ours]["tokens_per_s"] / out[other]["tokens_per_s"]
    out[f"{key}_paired"] = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[ours], runs[other])]


# ---------------------------------------------------------------- 1. throughput


def bench_throughput(work: Path, assets: dict, o) -> dict:
    """finetune vs bare loop vs HF Trainer on full 256-token blocks (no padding): pure loop overhead."""
    steps = o.steps
    config = write_run_config(
        work, "throughput", model=assets["model"], dataset=assets["text"], format="text", max_seq_length=256
    )
    spec = {"config": config, "steps": steps, "threads": 2, "collator": "default", "warmup": o.warmup}
    systems = {
        "finetune": lambda rep: run_finetune(f"tp_finetune_{rep}", config, work, steps, o.warmup, 2),
        "bare_loop": lambda rep: run_worker("bare", spec, work, 2, f"tp_bare_{rep}"),
        "hf_trainer": lambda rep: run_worker("trainer", spec, work, 2, f"tp_trainer_{rep}"),
    }
    runs = interleaved(systems, o.repeats)
    same_batches(runs, ("finetune", "bare_loop", "hf_trainer"))
    out = {name: summary(r) for name, r in runs.items()}
    for other in ("bare_loop", "hf_trainer"):
        compare(out, runs, "finetune", other, f"finetune_x_{other}")
    out["losses_first_steps"] = {n: r[0].get("losses", [])[:3] for n, r in runs.items()}
    out["setup"] = "34M Llama (hidden 512, 8 layers, vocab 8192), seq 256, micro batch 8, fp32, 1 process x 2 threads"
    return out


# ---------------------------------------------------------------- 2. packing


def bench_packing(work: Path, assets: dict, o) -> dict:
    """Real (non-padding) tokens/s on instruction data of 16..512 tokens."""
    steps = o.steps
    common = dict(model=assets["model"], dataset=assets["instr"], format="instruction", max_seq_length=512)
    padded = write_run_config(work, "packing_off", packing=False, **common)
    packed = write_run_config(work, "packing_on", packing=True, **common)
    spec = {"config": padded, "steps": steps, "threads": 2, "collator": "seq2seq", "warmup": o.warmup}
    systems = {
        "finetune_packing": lambda rep: run_finetune(f"pk_on_{rep}", packed, work, steps, o.warmup, 2),
        "finetune_padding": lambda rep: run_finetune(f"pk_off_{rep}", padded, work, steps, o.warmup, 2),
        "hf_trainer": lambda rep: run_worker("trainer", spec, work, 2, f"pk_trainer_{rep}"),
    }
    runs = interleaved(systems, o.repeats)
    same_batches(runs, ("finetune_padding", "hf_trainer"))
    out = {name: summary(r) for name, r in runs.items()}
    for name in ("finetune_packing", "finetune_padding"):
        compare(out, runs, name, "hf_trainer", f"{name}_x_hf_trainer")
    out["data"] = length_stats(padded, packed, work)
    out["setup"] = "34M Llama, instruction data 16..512 tokens, micro batch 8, max_seq_length 512, fp32, 2 threads"
    return out


def length_stats(config: str, packed_config: str, work: Path) -> dict:
    """Token lengths of the tokenized training rows, and the padding waste of pad-to-longest batches of 8:
    unpacked, packed by finetune (its own rows), and packed by two reference algorithms (simulated)."""
    lengths = tokenized_lengths(config, work)
    app_rows = tokenized_lengths(packed_config, work)
    q = statistics.quantiles(lengths, n=10)
    packed_rows = {m: pack_lengths(lengths, 512, m) for m in ("greedy", "first_fit_decreasing")}
    return {
        "packed_padding_fraction_batch8": {m: padding_fraction(rows, 8) for m, rows in packed_rows.items()},
        "packed_rows": {m: len(rows) for m, rows in packed_rows.items()},
        "packed_padding_fraction_batch8_app": padding_fraction(app_rows, 8),
        "packed_rows_app": len(app_rows),
        "examples": len(lengths),
        "min": min(lengths),
        "p10": q[0],
        "median": statistics.median(lengths),
        "p90": q[-1],
        "max": max(lengths),
        "padding_fraction_batch8": padding_fraction(lengths, 8),
    }


def pack_lengths(lengths: list[int], max_len: int, mode: str, window: int = 1000) -> list[int]:
    """Row lengths after packing, per window of `window` examples in dataset order (as finetune's
    data.pack runs under datasets.map(batch_size=1000)). greedy: finetune's order-preserving packing
    (a row is closed when the next example does not fit); first_fit_decreasing: longest first, each into
    the first row with room."""
    rows: list[int] = []
    for start in range(0, len(lengths), window):
        chunk = lengths[start : start + window]
        if mode == "greedy":
            cur = 0
            for n in chunk:
                if cur and cur + n > max_len:
                    rows.append(cur)
                    cur = 0
                cur += n
            rows.append(cur)
        else:
            bins: list[int] = []
            for n in sorted(chunk, reverse=True):
                for i, b in enumerate(bins):
                    if b + n <= max_len:
                        bins[i] += n
                        break
                else:
                    bins.append(n)
            rows += bins
    return rows


def padding_fraction(lengths: list[int], micro: int) -> float:
    """Share of computed tokens that are padding, batches of `micro` rows in finetune's epoch order,
    each padded to its longest row rounded up to a multiple of 8 (finetune's Collator)."""
    order = epoch_order(len(lengths), 42)
    real = padded = 0
    for i in range(0, len(order) - micro + 1, micro):
        batch = [lengths[j] for j in order[i : i + micro]]
        real += sum(batch)
        padded += micro * (-(-max(batch) // 8) * 8)
    return 1 - real / padded


def epoch_order(n: int, seed: int, epoch: int = 0) -> list[int]:
    from finetune.data import EpochSampler

    s = EpochSampler(n, seed)
    s.set_epoch(epoch)
    return list(s)


_LENGTHS: dict[str, list[int]] = {}


def tokenized_lengths(config: str, work: Path) -> list[int]:
    """Lengths of the rows finetune trains on for this run config (through finetune's own data code)."""
    if config not in _LENGTHS:
        ds, _ = finetune_datasets(config)
        _LENGTHS[config] = [len(x) for x in ds.train["input_ids"]]
    return _LENGTHS[config]


def finetune_datasets(config: str, **overrides):
    """finetune's tokenized datasets and tokenizer for a run config, built in this process."""
    from finetune import data

    cfg, tok = config_and_tokenizer(config, **overrides)
    ds = data.build_datasets(cfg.data, cfg.model.task, tok, cfg.train.seed, contextlib.nullcontext)
    return ds, tok


def config_and_tokenizer(config: str, **overrides):
    import datasets

    from finetune import model
    from finetune.config import build_config, load_yaml

    datasets.disable_progress_bars()
    cfg = build_config({**load_yaml(config), **overrides}, check_filesystem=False)
    return cfg, model.load_tokenizer(cfg.model)


# ---------------------------------------------------------------- 3. DDP scaling


def bench_ddp(work: Path, assets: dict, o) -> dict:
    """Same global batch (8 x 256 tokens): 2 ranks x micro 4 x 1 thread vs 1 process x micro 8 x 2 threads."""
    steps = o.steps
    config = write_run_config(
        work, "ddp", model=assets["model"], dataset=assets["text"], format="text", max_seq_length=256
    )
    ddp_config = write_run_config(
        work,
        "ddp2",
        model=assets["model"],
        dataset=assets["text"],
        format="text",
        max_seq_length=256,
        per_device_train_batch_size=4,
    )
    systems = {
        "1proc_x_2threads": lambda rep: run_finetune(f"ddp_single_{rep}", config, work, steps, o.warmup, 2),
        "2proc_x_1thread": lambda rep: run_finetune(f"ddp_two_{rep}", ddp_config, work, steps, o.warmup, 1, "ddp"),
    }
    runs = interleaved(systems, o.repeats)
    out = {name: summary(r) for name, r in runs.items()}
    compare(out, runs, "2proc_x_1thread", "1proc_x_2threads", "ddp_x_single")
    single_loss, ddp_loss = runs["1proc_x_2threads"][0]["losses"], runs["2proc_x_1thread"][0]["losses"]
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(single_loss, ddp_loss))
    out["setup"] = "34M Llama, seq 256, global batch 8, fp32 (finetune under single and accelerate_configs/ddp.yaml)"
    return out


# ---------------------------------------------------------------- 4. launch to first step


def bench_launch(work: Path, assets: dict, o) -> dict:
    """Wall time from the launch command to the end of optimizer step 1, with fresh caches and again."""
    # Micro batch 1: step 1 itself is short, the time is what comes before it.
    config = write_run_config(
        work,
        "launch",
        model=assets["model"],
        dataset=assets["instr"],
        format="instruction",
        max_seq_length=512,
        per_device_train_batch_size=1,
    )
    out: dict = {"imports": import_times(work)}
    for name, acc_config, threads in (("single", None, 2), ("zero2", "zero2", 1)):
        if o.quick and name == "zero2" and not o.only_given:
            continue
        caches = Path(tempfile.mkdtemp(prefix=f"launch_{name}_", dir=work))
        env = {"HF_DATASETS_CACHE": str(caches / "datasets"), "TORCH_EXTENSIONS_DIR": str(caches / "torch_ext")}
        for state in ("cold", "warm"):
            tag = f"launch_{name}_{state}"
            cmd = finetune_cmd(config, runs_dir(work) / tag, acc_config, "--max_steps", "2")
            r = launch(cmd, bench_env(threads, **env), runs_dir(work) / f"{tag}.log", 900, stop_at="] step 1/")
            if r["rc"] != 0 or "first_step" not in r["marks"]:
                raise RuntimeError(f"{tag}: exit {r['rc']}; see {r['log']}")
            m = r["marks"]
            out[f"{name}_{state}"] = {
                "to_first_step_s": m["first_step"],
                "startup_s": m["ready"],  # interpreter, imports, Accelerator (process group, DeepSpeed ops)
                "data_s": m["data"] - m["ready"],  # load + tokenize (datasets cache)
                "model_s": m["model"] - m["data"],  # from_pretrained
                "prepare_and_step_s": m["first_step"] - m["model"],  # optimizer, prepare, step 1
            }
            print(f"[perf]   {tag:<20} {m['first_step']:6.1f} s to step 1  {out[f'{name}_{state}']}", flush=True)
        shutil.rmtree(caches, ignore_errors=True)
    return out


def import_times(work: Path) -> dict:
    """Seconds to import what a run imports (warm page cache), the largest imports by cumulative time, and
    the same with `transformers.get_scheduler` added, as finetune imported it before its own schedules
    (it imports transformers.trainer_utils, and that imports peft whenever peft is installed)."""
    # What a run imports before its first step (run.py imports some of it inside run()).
    code = "import finetune.cli, finetune.run, accelerate, datasets; from transformers import AutoModelForCausalLM"
    t0 = time.perf_counter()
    subprocess.run([PY, "-c", code], cwd=ROOT, env=bench_env(2), check=True)
    wall = time.perf_counter() - t0
    total, rows = _importtime(code)
    with_scheduler, _ = _importtime(code + ", get_scheduler")
    top = sorted((r for r in rows if "." not in r[2]), reverse=True)[:8]  # packages, where first imported
    return {
        "import_s": wall,
        "importtime_total_s": total,
        "importtime_total_s_with_get_scheduler": with_scheduler,
        "peft_imported": any(name == "peft" for _, _, name in rows),
        "top_packages_s": {name: round(c, 2) for c, _, name in top},
    }


def _importtime(code: str) -> tuple[float, list[tuple[float, int, str]]]:
    """python -X importtime: (total seconds, [(cumulative s, depth, module)])."""
    r = subprocess.run(
        [PY, "-X", "importtime", "-c", code], cwd=ROOT, env=bench_env(2), capture_output=True, text=True, check=True
    )
    rows = []
    for line in r.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(2)) / 1e6, len(m.group(3)), m.group(4)))
    return sum(c for c, depth, _ in rows if depth == 1), rows


# ---------------------------------------------------------------- 5. rank balance


def rank_batches(lengths: list[int], world: int, micro: int, seed: int, mode: str, quad: float, epoch: int = 0):
    """Per optimizer step, the example indices each rank holds (GA 1).

    round_robin: finetune's default: EpochSampler order, batches of `micro`, accelerate deals batch
    j*world + r to rank r. balanced: `length_aware_batching`: the same global batch (same examples,
    same step) split across ranks by finetune.data.balanced_split (the app's own function)."""
    from finetune.data import balanced_split

    order = epoch_order(len(lengths), seed, epoch)
    per_step = world * micro
    steps = []
    for s in range(len(order) // per_step):
        chunk = order[s * per_step : (s + 1) * per_step]
        if mode == "round_robin":
            steps.append([chunk[r * micro : (r + 1) * micro] for r in range(world)])
        else:
            groups = balanced_split([lengths[i] for i in chunk], world, quad)
            steps.append([[chunk[i] for i in g] for g in groups])
    return steps


def simulate_balance(lengths: list[int], world: int, micro: int, quad: float) -> dict:
    """A whole epoch, both splits, exact token counts. Two cost models for a rank's micro batch:
    padded (rows x width, as here: CPU/eager kernels compute the padding) and real (sum of lengths, as
    unpadded/varlen GPU kernels do); each with attention's quadratic term. A step lasts as long as its
    most expensive rank; the others wait (idle_fraction: share of rank-time spent waiting)."""

    def costs_of(ranks: list[list[int]]) -> tuple[list[float], list[float]]:
        padded, real = [], []
        for idx in ranks:
            w = -(-max(lengths[i] for i in idx) // 8) * 8
            padded.append(len(idx) * w * (1 + quad * w))
            real.append(sum(lengths[i] * (1 + quad * lengths[i]) for i in idx))
        return padded, real

    per_mode = {m: rank_batches(lengths, world, micro, 42, m, quad) for m in ("round_robin", "balanced")}
    out: dict = {}
    for mode, steps in per_mode.items():
        stats: dict[str, list[float]] = {
            "padded_idle": [],
            "real_idle": [],
            "padded_max": [],
            "real_max": [],
            "pad": [],
        }
        for ranks in steps:
            padded, real = costs_of(ranks)
            stats["padded_idle"].append(1 - statistics.mean(padded) / max(padded))
            stats["real_idle"].append(1 - statistics.mean(real) / max(real))
            stats["padded_max"].append(max(padded))
            stats["real_max"].append(max(real))
            n_real = sum(lengths[i] for idx in ranks for i in idx)
            n_padded = sum(len(idx) * (-(-max(lengths[i] for i in idx) // 8) * 8) for idx in ranks)
            stats["pad"].append(1 - n_real / n_padded)
        out[mode] = {
            "idle_fraction": statistics.mean(stats["padded_idle"]),
            "idle_fraction_real_cost": statistics.mean(stats["real_idle"]),
            "padding_fraction": statistics.mean(stats["pad"]),
            "step_cost": sum(stats["padded_max"]),
            "step_cost_real": sum(stats["real_max"]),
            "steps": len(steps),
        }
    rr, bal = out["round_robin"], out["balanced"]
    out["predicted_step_time_x"] = bal["step_cost"] / rr["step_cost"]  # < 1: balanced is faster
    out["predicted_step_time_x_real_cost"] = bal["step_cost_real"] / rr["step_cost_real"]
    return out


def bench_balance(work: Path, assets: dict, o) -> dict:
    """Simulated over a whole epoch (exact token counts), then measured for a few steps on 2 ranks."""
    run = {"model": assets["small_model"], "dataset": assets["instr"], "format": "instruction", "max_seq_length": 512}
    config = write_run_config(work, "balance", **run)
    packed = write_run_config(work, "balance_packed", **run, packing=True)
    aware = write_run_config(work, "balance_aware", **run, length_aware_batching=True)
    quad = 1 / (6 * LLAMA_7M["hidden_size"])  # attention FLOPs / linear FLOPs per token and unit of width
    lengths = tokenized_lengths(config, work)
    out = {
        "simulated_padding": simulate_balance(lengths, 2, 8, quad),
        "simulated_packing": simulate_balance(tokenized_lengths(packed, work), 2, 8, quad),
    }
    spec = {"config": config, "steps": o.balance_steps, "micro": 8, "quad": quad, "warmup": 1}
    result = runs_dir(work) / "balance.json"
    result.unlink(missing_ok=True)
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve()),
        "--worker",
        "balance",
        "--spec",
        json.dumps(spec),
        "--result",
        str(result),
    ]
    r = launch(cmd, bench_env(1), runs_dir(work) / "balance.log", 900)
    if r["rc"] != 0 or not result.exists():
        raise RuntimeError(f"balance harness: exit {r['rc']}; see {r['log']}")
    out["measured"] = json.loads(result.read_text())
    m = out["measured"]
    out["measured_step_x"] = m["round_robin"]["step_time_s"] / m["balanced"]["step_time_s"]
    # The app itself: DDP on 2 ranks, with and without length_aware_batching, interleaved.
    systems = {
        "finetune_fixed": lambda rep: run_finetune(f"bal_fixed_{rep}", config, work, o.steps, o.warmup, 1, "ddp"),
        "finetune_length_aware": lambda rep: run_finetune(f"bal_aware_{rep}", aware, work, o.steps, o.warmup, 1, "ddp"),
    }
    runs = interleaved(systems, o.repeats)
    app = {
        name: {**summary(r), "padding_fraction": statistics.median(x["padding_fraction"] for x in r)}
        for name, r in runs.items()
    }
    compare(app, runs, "finetune_length_aware", "finetune_fixed", "aware_x_fixed")
    out["app"] = app
    out["setup"] = (
        "7M Llama (hidden 256, 4 layers), instruction data 16..512 tokens, padding, 2 ranks x micro 8 x 1 thread"
    )
    return out


# ---------------------------------------------------------------- 6. tokenization


def bench_tokenize(work: Path, assets: dict, o) -> dict:
    """finetune's data builder on the 100k-example instruction set: fresh cache, then the same cache again."""
    config = write_run_config(
        work,
        "tokenize",
        model=assets["model"],
        dataset=tokenize_set(work, o.n_tokenize),
        format="instruction",
        max_seq_length=512,
        packing=True,
    )
    out: dict = {}
    cache = Path(tempfile.mkdtemp(prefix="tokenize_cache_", dir=work))
    fresh = Path(tempfile.mkdtemp(prefix="tokenize_cache_", dir=work))
    runs = (
        ("first_run", cache, {}),
        ("second_run", cache, {}),  # same cache: every map/filter should be a cache hit
        ("first_run_2_workers", fresh, {"preprocessing_num_workers": 2}),
    )
    try:
        for state, where, overrides in runs:
            spec = {"config": config, "env": {"HF_DATASETS_CACHE": str(where)}, "overrides": overrides}
            before = cache_files(where)
            r = run_worker("tokenize", spec, work, 2, f"tokenize_{state}")
            r["new_cache_files"] = len(cache_files(where) - before)
            out[state] = r
            print(
                f"[perf]   tokenize {state:<20} {r['build_s']:6.1f} s  ({r['new_cache_files']} new cache files; "
                f"supervised count {r['supervised_count_s']:.1f} s)",
                flush=True,
            )
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(fresh, ignore_errors=True)
    out["cache_hit"] = out["second_run"]["new_cache_files"] == 0
    out["second_x_first_time"] = out["second_run"]["build_s"] / out["first_run"]["build_s"]
    out["workers_2_x_1"] = out["first_run"]["build_s"] / out["first_run_2_workers"]["build_s"]
    return out


def cache_files(cache: Path) -> set[str]:
    return {str(p) for p in cache.rglob("*.arrow")}


# ---------------------------------------------------------------- workers (run in their own process)


def _data_for_baselines(spec: dict):
    """finetune's tokenized rows in finetune's epoch-0 order: what the baselines train on, batch by batch."""
    ds, tok = finetune_datasets(spec["config"])
    order = epoch_order(len(ds.train), 42)
    return ds.train.select(order), tok


def worker_bare(spec: dict) -> dict:
    """A hand-written PyTorch loop: the same model, rows, batches, AdamW, linear schedule and clipping."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.data import Collator

    torch.set_num_threads(spec["threads"])
    train, tok = _data_for_baselines(spec)
    cfg = json.loads(Path(spec["config"]).read_text())
    collate = Collator(tok.pad_token_id)
    loader = torch.utils.data.DataLoader(train, batch_size=cfg["per_device_train_batch_size"], collate_fn=collate)
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["learning_rate"], weight_decay=0.0)
    total = spec["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    per_step, losses = [], []
    t = time.perf_counter()
    for step, batch in enumerate(loader):
        tokens = int(batch.pop("num_tokens"))
        batch.pop("num_supervised"), batch.pop("num_positions")
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
    return {**steady(per_step, spec["warmup"]), "losses": losses}


def worker_trainer(spec: dict) -> dict:
    """HF Trainer as a user writes it: TrainingArguments defaults (fused AdamW), our rows in our order."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    torch.set_num_threads(spec["threads"])
    train, tok = _data_for_baselines(spec)
    cfg = json.loads(Path(spec["config"]).read_text())
    train = train.remove_columns([c for c in train.column_names if c not in ("input_ids", "labels")])
    micro = cfg["per_device_train_batch_size"]
    lengths = [len(x) for x in train["input_ids"]]
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=micro,
            max_steps=spec["steps"],
            learning_rate=cfg["learning_rate"],
            lr_scheduler_type="linear",
            weight_decay=0.0,
            max_grad_norm=cfg["max_grad_norm"],
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=42,
            use_cpu=True,
            train_sampling_strategy="sequential",  # rows already in finetune's order
        )
        model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
        # "default": Trainer's own default collator (DataCollatorWithPadding; equal-length rows only).
        # "seq2seq": the usual choice for variable-length causal LM data (labels padded with -100);
        # DataCollatorWithPadding cannot pad the labels of such rows and raises.
        collator = DataCollatorForSeq2Seq(tok) if spec["collator"] == "seq2seq" else None
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train,
            processing_class=tok,
            data_collator=collator,
            callbacks=[Clock()],
        )
        trainer.train()
    times = [b - a for a, b in zip(marks, marks[1:])]
    tokens = [sum(lengths[i * micro : (i + 1) * micro]) for i in range(len(times))]
    return {**steady(list(zip(tokens, times)), spec["warmup"]), "optim": str(args.optim)}


def worker_tokenize(spec: dict) -> dict:
    """finetune.data.build_datasets, timed, in a process of its own (imports and tokenizer load not counted)."""
    from finetune import data

    cfg, tok = config_and_tokenizer(spec["config"], **spec.get("overrides", {}))
    t0 = time.perf_counter()
    ds = data.build_datasets(cfg.data, cfg.model.task, tok, cfg.train.seed, contextlib.nullcontext)
    build_s = time.perf_counter() - t0
    # build_datasets ends by counting supervised tokens with a Python loop over every label of every row
    # (run, cached or not); timed again here on its own.
    t0 = time.perf_counter()
    sum(sum(1 for t in labels[1:] if t != -100) for labels in ds.train["labels"])  # = data.supervised_count
    count_s = time.perf_counter() - t0
    n_raw = sum(1 for _ in open(json.loads(Path(spec["config"]).read_text())["dataset"]))
    return {
        "build_s": build_s,
        "supervised_count_s": count_s,
        "examples": n_raw,
        "examples_per_s": n_raw / build_s,
        "train_rows": len(ds.train),
        "supervised_tokens": ds.supervised_tokens,
    }


def worker_balance(spec: dict) -> dict:
    """Two ranks (torchrun, gloo): the same global batches split round-robin or balanced, interleaved
    step by step. Each step: forward+backward (timed: compute), a 1-element all_reduce right after
    (timed: the wait for the slower rank), the gradient all_reduce (comm), AdamW. Loss normalised by the
    global supervised-token count, as finetune does, so both splits compute the same update."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from finetune.data import Collator

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ds, tok = finetune_datasets(spec["config"])
    train = ds.train
    lengths = [len(x) for x in train["input_ids"]]
    cfg = json.loads(Path(spec["config"]).read_text())
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = [p for p in model.parameters()]
    collate = Collator(tok.pad_token_id)
    plans = {m: rank_batches(lengths, world, spec["micro"], 42, m, spec["quad"]) for m in ("round_robin", "balanced")}
    rec: dict[str, dict[str, list[float]]] = {
        m: {"compute": [], "wait": [], "comm": [], "step": [], "real": []} for m in plans
    }
    for step in range(spec["steps"] + spec["warmup"]):
        for mode in ("round_robin", "balanced") if step % 2 == 0 else ("balanced", "round_robin"):
            dist.barrier()
            t0 = time.perf_counter()
            batch = collate([train[i] for i in plans[mode][step][rank]])
            real = batch.pop("num_tokens").float()
            batch.pop("num_positions")
            n = batch.pop("num_supervised").float()
            count = n.clone()
            dist.all_reduce(count)
            loss = model(**batch).loss * n / count * world
            loss.backward()
            t1 = time.perf_counter()
            dist.all_reduce(torch.zeros(1))  # returns when the slowest rank is done computing
            t2 = time.perf_counter()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            t3 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t4 = time.perf_counter()
            dist.all_reduce(real)
            if step >= spec["warmup"]:
                r = rec[mode]
                r["compute"].append(t1 - t0)
                r["wait"].append(t2 - t1)
                r["comm"].append(t3 - t2)
                r["step"].append(t4 - t0)
                r["real"].append(float(real))
    gathered = [None] * world
    dist.all_gather_object(gathered, rec)
    dist.destroy_process_group()
    if rank != 0:
        return {}
    out = {}
    for mode in plans:
        waits = [statistics.mean(g[mode]["wait"]) for g in gathered]
        computes = [statistics.mean(g[mode]["compute"]) for g in gathered]
        step_time = statistics.mean(gathered[0][mode]["step"])
        out[mode] = {
            "wait_s_per_rank": waits,
            "compute_s_per_rank": computes,
            "wait_s_mean": statistics.mean(waits),
            "comm_s": statistics.mean(gathered[0][mode]["comm"]),
            "step_time_s": step_time,
            "idle_fraction": statistics.mean(waits) / step_time,
            "real_tokens_per_s": sum(gathered[0][mode]["real"]) / sum(gathered[0][mode]["step"]),
            "steps": len(gathered[0][mode]["step"]),
        }
    return out


WORKERS = {"bare": worker_bare, "trainer": worker_trainer, "tokenize": worker_tokenize, "balance": worker_balance}


# ---------------------------------------------------------------- report


def rows_for(results: dict) -> list[tuple]:
    """(benchmark, what, value, unit, ratio text, target text, met) rows of the one table."""
    rows: list[tuple] = []
    r = results.get("throughput")
    if r:
        for name in ("finetune", "bare_loop", "hf_trainer"):
            rows.append(("1 throughput", name, r[name]["tokens_per_s"], "tokens/s", "", "", None))
        for other, target in (("bare_loop", 0.97), ("hf_trainer", 1.0)):
            x = r[f"finetune_x_{other}"]
            rows.append(
                (
                    "1 throughput",
                    f"finetune / {other}",
                    x,
                    "x",
                    _range(r[f"finetune_x_{other}_paired"]),
                    f">= {target}",
                    verdict(x, r[f"finetune_x_{other}_paired"], target),
                )
            )
    r = results.get("packing")
    if r:
        d = r["data"]
        pad = d["packed_padding_fraction_batch8"]
        notes = {
            "finetune_packing": f"padding {d['packed_padding_fraction_batch8_app']:.0%} (in-order greedy: {pad['greedy']:.0%})",
            "finetune_padding": f"padding {d['padding_fraction_batch8']:.0%}",
            "hf_trainer": f"padding {d['padding_fraction_batch8']:.0%} (DataCollatorForSeq2Seq)",
        }
        for name in ("finetune_packing", "finetune_padding", "hf_trainer"):
            rows.append(("2 packing", name, r[name]["tokens_per_s"], "real tok/s", notes[name], "", None))
        x = r["finetune_packing_x_hf_trainer"]
        rows.append(
            (
                "2 packing",
                "packing / hf_trainer",
                x,
                "x",
                _range(r["finetune_packing_x_hf_trainer_paired"]),
                ">= 1.3",
                verdict(x, r["finetune_packing_x_hf_trainer_paired"], 1.3),
            )
        )
        rows.append(
            (
                "2 packing",
                "padding / hf_trainer",
                r["finetune_padding_x_hf_trainer"],
                "x",
                _range(r["finetune_padding_x_hf_trainer_paired"]),
                "",
                None,
            )
        )
    r = results.get("ddp")
    if r:
        rows.append(("3 ddp", "1 proc x 2 threads", r["1proc_x_2threads"]["tokens_per_s"], "tokens/s", "", "", None))
        rows.append(("3 ddp", "2 procs x 1 thread", r["2proc_x_1thread"]["tokens_per_s"], "tokens/s", "", "", None))
        note = f"{_range(r['ddp_x_single_paired'])}; max loss diff {r['max_loss_diff']:.1e}"
        rows.append(("3 ddp", "ddp / single", r["ddp_x_single"], "x", note, "", None))
    r = results.get("launch")
    if r:
        i = r["imports"]
        note = f"importtime {i['importtime_total_s']:.1f} s ({i['importtime_total_s_with_get_scheduler']:.1f} s"
        note += " with transformers.get_scheduler)"
        rows.append(("4 launch", "import what a run imports", i["import_s"], "s", note, "", None))
        for key in ("single_cold", "single_warm", "zero2_cold", "zero2_warm"):
            if key in r:
                p = r[key]
                detail = f"start {p['startup_s']:.1f} data {p['data_s']:.1f} model {p['model_s']:.1f} step {p['prepare_and_step_s']:.1f}"
                rows.append(("4 launch", key.replace("_", " "), p["to_first_step_s"], "s", detail, "", None))
    r = results.get("balance")
    if r:
        sim = r["simulated_padding"]
        for mode, label in (("round_robin", "now (round robin)"), ("balanced", "length-aware")):
            m = r["measured"][mode]
            note = (
                f"idle {m['idle_fraction']:.0%} of step {m['step_time_s']:.2f} s (sim {sim[mode]['idle_fraction']:.0%})"
            )
            rows.append(("5 balance", f"wait/step, {label}", m["wait_s_mean"], "s", note, "", None))
        note = f"sim {1 / sim['predicted_step_time_x']:.2f}x (padding {sim['round_robin']['padding_fraction']:.0%}"
        note += f" -> {sim['balanced']['padding_fraction']:.0%})"
        rows.append(("5 balance", "step: now / length-aware", r["measured_step_x"], "x", note, "", None))
        app = r.get("app")
        if app:
            for name, label in (
                ("finetune_fixed", "finetune ddp, fixed"),
                ("finetune_length_aware", "finetune ddp, length-aware"),
            ):
                note = f"padding {app[name]['padding_fraction']:.0%}, step {app[name]['step_time_s']:.2f} s"
                rows.append(("5 balance", label, app[name]["tokens_per_s"], "real tok/s", note, "", None))
            note = _range(app["aware_x_fixed_paired"])
            rows.append(("5 balance", "length-aware / fixed", app["aware_x_fixed"], "x", note, "", None))
        sp = r["simulated_packing"]
        note = f"length-aware: sim {1 / sp['predicted_step_time_x']:.2f}x faster"
        rows.append(
            ("5 balance", "packed rows: idle (sim)", sp["round_robin"]["idle_fraction"], "frac", note, "", None)
        )
    r = results.get("tokenize")
    if r:
        f, s, w = r["first_run"], r["second_run"], r["first_run_2_workers"]
        n = f"{f['examples'] // 1000}k ex"
        rows.append(
            ("6 tokenize", f"first run ({n})", f["examples_per_s"], "examples/s", f"{f['build_s']:.1f} s", "", None)
        )
        note = f"{w['build_s']:.1f} s ({r['workers_2_x_1']:.2f}x)"
        rows.append(("6 tokenize", "first run, 2 workers", w["examples_per_s"], "examples/s", note, "", None))
        note = f"{'cache hit' if r['cache_hit'] else 'CACHE MISS'}; label count {s['supervised_count_s']:.1f} s"
        rows.append(("6 tokenize", "second run", s["build_s"], "s", note, "hit", r["cache_hit"]))
    return rows


def verdict(ratio: float, paired: list[float], target: float) -> bool | str:
    """True when the median ratio and every repeat's paired ratio meet the target, False when none do;
    "tie" when the repeats disagree: the difference is within this machine's run-to-run noise."""
    hits = [p >= target for p in paired] + [ratio >= target]
    return True if all(hits) else False if not any(hits) else "tie"


def _range(values: list[float]) -> str:
    return f"runs {min(values):.2f}..{max(values):.2f}" if values else ""


def print_table(rows: list[tuple], command: str, context: str) -> str:
    lines = [f"$ {command}", context, ""]
    lines.append(f"{'benchmark':<12} {'what':<28} {'value':>10} {'unit':<11} {'':<44} {'target':<7} met")
    lines.append("-" * 120)
    for bench, what, value, unit, note, target, met in rows:
        mark = met if isinstance(met, str) else "" if met is None else ("yes" if met else "NO")
        lines.append(f"{bench:<12} {what:<28} {value:>10.2f} {unit:<11} {note:<44} {target:<7} {mark}")
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    return text


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in BENCHMARKS if k in results]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, name in zip(axes.flat, panels):
        r = results[name]
        if name in ("throughput", "packing", "ddp"):
            systems = [k for k, v in r.items() if isinstance(v, dict) and "tokens_per_s" in v]
            values = [r[s]["tokens_per_s"] for s in systems]
            bars = ax.bar(systems, values, color=["tab:blue", "tab:gray", "tab:orange", "tab:green"][: len(systems)])
            ax.bar_label(bars, fmt="%.0f")
            for i, s in enumerate(systems):
                runs = r[s]["tokens_per_s_runs"]
                ax.plot([i] * len(runs), runs, "k.", ms=4)
            ax.set_ylabel("real tokens/s" if name == "packing" else "tokens/s")
            ax.set_xticks(range(len(systems)), [s.replace("_", "\n", 1) for s in systems], fontsize=7)
            title = {
                "throughput": "1. throughput (34M, seq 256, batch 8)",
                "packing": "2. variable-length data (real tokens)",
                "ddp": "3. DDP: 2x1 thread vs 1x2 threads",
            }[name]
            ax.set_title(title, fontsize=10)
        elif name == "launch":
            keys = [k for k in ("single_cold", "single_warm", "zero2_cold", "zero2_warm") if k in r]
            bottom = [0.0] * len(keys)
            for part, color in (
                ("startup_s", "tab:gray"),
                ("data_s", "tab:blue"),
                ("model_s", "tab:orange"),
                ("prepare_and_step_s", "tab:green"),
            ):
                vals = [r[k][part] for k in keys]
                ax.bar(
                    [k.replace("_", "\n") for k in keys],
                    vals,
                    bottom=bottom,
                    color=color,
                    label=part.removesuffix("_s"),
                )
                bottom = [a + b for a, b in zip(bottom, vals)]
            ax.legend(fontsize=7)
            ax.set_ylabel("s to end of step 1")
            ax.set_title("4. launch to first step")
        elif name == "balance":
            modes = ["round_robin", "balanced"]
            ax.bar(modes, [r["measured"][m]["step_time_s"] for m in modes], color="tab:blue", label="step")
            ax.bar(modes, [r["measured"][m]["wait_s_mean"] for m in modes], color="tab:red", label="wait (mean rank)")
            ax.legend(fontsize=7)
            ax.set_ylabel("s per step")
            ax.set_title("5. rank balance (2 ranks, padding)")
        elif name == "tokenize":
            ax.bar(
                ["first run", "second run"], [r["first_run"]["build_s"], r["second_run"]["build_s"]], color="tab:blue"
            )
            ax.set_ylabel("s to build the data")
            ax.set_title(f"6. tokenize {r['first_run']['examples'] // 1000}k examples")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", default=",".join(BENCHMARKS), help="comma-separated subset of: " + ", ".join(BENCHMARKS)
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: the 7M model everywhere, 1 repeat, 4 steps, a 20k-example tokenization set; "
        "checks that everything runs, its numbers are not the targets'",
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats per comparison (default 4, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 6, quick 4)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the numbers")
    parser.add_argument("--work", default=str(ROOT / ".cache" / "bench_perf"), help="models, data and run outputs")
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"), help="where perf.json/perf.png go")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    o = parser.parse_args()
    if o.worker:
        result = WORKERS[o.worker](json.loads(o.spec))
        if result:
            Path(o.result).write_text(json.dumps(result, indent=1))
        return
    o.only_given = "--only" in sys.argv
    selected = [b.strip() for b in o.only.split(",") if b.strip()]
    unknown = [b for b in selected if b not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    o.repeats = o.repeats or (1 if o.quick else 4)
    o.steps = o.steps or 4
    o.warmup = min(o.warmup, o.steps - 1)
    o.balance_steps = 2 if o.quick else 6
    command = "bench/perf.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    work = Path(o.work)
    # One datasets cache for every run that does not ask for a fresh one (children inherit it).
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
    o.n_tokenize = 20_000 if o.quick else 100_000
    assets = build_assets(work)
    if o.quick:  # a smoke run: the small model everywhere (numbers not comparable with the targets)
        assets = {**assets, "model": assets["small_model"]}
    runs_dir(work).mkdir(parents=True)
    for old in sorted((work / "runs").glob("2*"))[:-5]:  # keep the newest 5 invocations' logs
        shutil.rmtree(old, ignore_errors=True)
    results: dict = {}
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    for name in selected:
        print(f"[perf] {name} ...", flush=True)
        t = time.perf_counter()
        results[name] = globals()[f"bench_{name}"](work, assets, o)
        results[name]["bench_wall_s"] = time.perf_counter() - t
    wall = time.perf_counter() - t0
    load_end = os.getloadavg()
    context = (
        f"{o.repeats} repeats x {o.steps} steps (first {o.warmup} dropped), medians; {wall / 60:.1f} min; "
        f"{os.cpu_count()} CPUs, load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at end"
    )
    table = print_table(rows_for(results), command, context)
    out = Path(o.results)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": command,
        "table": table,
        "wall_s": wall,
        "repeats": o.repeats,
        "steps": o.steps,
        "warmup_steps_dropped": o.warmup,
        "machine": {"cpus": os.cpu_count(), "load_avg_1_5_15_start": load_start, "load_avg_1_5_15_end": load_end},
        "versions": versions(),
    }
    (out / "perf.json").write_text(json.dumps({**meta, "results": results}, indent=1, default=float))
    plot(results, out / "perf.png")
    print(f"\n[perf] wrote {out / 'perf.json'} and {out / 'perf.png'}", flush=True)


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "transformers", "accelerate", "datasets", "deepspeed")}


if __name__ == "__main__":
    main()
