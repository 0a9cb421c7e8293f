"""What a person looks at around a run: trackers, loss curves, the model card, the Hub, the end summary.

  trackers      report_to through accelerate; the whole effective run config, flattened, as the tracked config
  curves        output_dir/curves.png from metrics.jsonl (at each eval and at the end); `finetune plot` overlays runs
  model card    final/README.md: Hub metadata, how to load it, data, hyperparameters, parallelism, results
  Hub           push_to_hub: final/ (with merged/) uploaded by the main process at the end
  summary       one block at the end of the run: where things are, final metrics, speed, memory

Everything here reads metrics.jsonl and the run config; nothing here touches the training itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from finetune.checkpoint import CONFIG_FILE, write_atomic
from finetune.config import RunConfig, TrainArgs, hub_repo_id, looks_local, sources_of

logger = logging.getLogger("finetune")
CURVES = "curves.png"
CARD = "README.md"
PIPELINE_TAGS = {
    "causal_lm": "text-generation",
    "classification": "text-classification",
    "seq2seq": "text2text-generation",
}
ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA"}
AUTO_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "classification": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
}


# ---------------------------------------------------------------- trackers


def run_name(train: TrainArgs) -> str:
    return train.run_name or Path(os.path.abspath(train.output_dir)).name


def tracker_problems(report_to: list[str]) -> list[tuple[str, str]]:
    """A tracker asked for but not installed: said before training starts (accelerate would only warn)."""
    import accelerate.utils

    out = []
    for name in report_to:
        available = getattr(accelerate.utils, f"is_{name}_available", None)
        if available is not None and not available():
            package = {"tensorboard": "tensorboard", "comet_ml": "comet-ml"}.get(name, name)
            out.append(
                (
                    "report_to",
                    f"{name} is not installed here; install it (pip install {package}) or remove it from report_to",
                )
            )
    return out


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A run config as scalars only (what every tracker accepts): nested sections as `peft.r`, lists joined with
    commas, None as "null"."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(str(v) for v in value)
        elif value is None:
            out[name] = "null"
        else:
            out[name] = value
    return out


def tracked_config(cfg: RunConfig, facts: dict[str, Any]) -> dict[str, Any]:
    """The whole effective run config, flattened, plus how the run is spread (world size, backend, precision).
    The Hub token is never part of it: it is not a run-config field, and is read only by huggingface_hub."""
    return {**flatten(cfg.to_flat()), **{k: v for k, v in facts.items() if isinstance(v, (int, float, str, bool))}}


def init_trackers(accelerator, cfg: RunConfig, facts: dict[str, Any]) -> None:
    t = cfg.train
    name = run_name(t)
    accelerator.init_trackers(
        t.tracker_project,
        config=tracked_config(cfg, facts),
        init_kwargs={
            "wandb": {"name": name},
            "mlflow": {"run_name": name},
            "trackio": {"name": name},
            "comet_ml": {"experiment_name": name},
            "aim": {"experiment": name},
            "swanlab": {"experiment_name": name},
        },
    )


# ---------------------------------------------------------------- curves


def read_rows(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _label(output_dir: str | os.PathLike) -> str:
    """A run's name on a plot: its run_name when it has one, else its directory's name."""
    path = Path(output_dir) / CONFIG_FILE
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        saved = {}
    return saved.get("run_name") or Path(os.path.abspath(output_dir)).name


def series(rows: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (steps, values): train rows (loss, learning_rate, tokens_per_s) and eval rows (eval_*)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key in ("loss", "learning_rate", "tokens_per_s") or key.startswith("eval_"):
                if isinstance(value, (int, float)) and math.isfinite(value):
                    steps, values = out.setdefault(key, ([], []))
                    steps.append(row["step"])
                    values.append(value)
    return out


PANELS = (
    ("loss", "loss (train, and eval dashed)"),
    ("metrics", "eval metrics"),
    ("learning_rate", "learning rate"),
    ("tokens_per_s", "tokens/s (all ranks)"),
)


def build_figure(runs: list[tuple[str, list[dict[str, Any]]]]):
    """One figure, four panels, every run overlaid in its own colour: train and eval loss, the other eval
    metrics, the learning rate, throughput. Built without pyplot (no display, no global state)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 7.5), dpi=100)  # laid out by hand: a layout engine doubles the drawing time
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.07, top=0.91, hspace=0.35, wspace=0.18)
    axes = dict(zip((p for p, _ in PANELS), fig.subplots(2, 2).flat))
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for (label, rows), color in zip(runs, colors):
        s = series(rows)
        if "loss" in s:
            axes["loss"].plot(*s["loss"], color=color, label=f"{label} train")
        if "eval_loss" in s:
            axes["loss"].plot(*s["eval_loss"], color=color, ls="--", marker="o", ms=4, label=f"{label} eval")
        metrics = sorted(k for k in s if k.startswith("eval_") and k != "eval_loss")
        for i, key in enumerate(metrics):
            axes["metrics"].plot(
                *s[key], color=color, ls=("-", "--", ":", "-.")[i % 4], marker="o", ms=4, label=f"{label} {key[5:]}"
            )
        for key in ("learning_rate", "tokens_per_s"):
            if key in s:
                axes[key].plot(*s[key], color=color, label=label)
    for name, title in PANELS:
        ax = axes[name]
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    if any("perplexity" in line.get_label() for line in axes["metrics"].lines):
        axes["metrics"].set_yscale("log")
    axes["learning_rate"].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    title = runs[0][0] if len(runs) == 1 else f"{len(runs)} runs"
    fig.suptitle(title)
    return fig


def save_figure(fig, path: str | os.PathLike) -> str:
    """PNG, written to a temporary file and renamed (a reader never sees half a picture)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return str(path)


CURVES_EVERY_S = 30.0  # during training, curves.png is redrawn at an eval at most this often (about 1 s of CPU)
_last_drawn: dict[str, float] = {}


def write_curves(output_dir: str, min_interval: float = 0.0, rows: list[dict[str, Any]] | None = None) -> str | None:
    """output_dir/curves.png from its metrics.jsonl (main process; rows: already read): at evals, if the last
    picture is older than min_interval seconds, and at the end."""
    import time

    now = time.monotonic()
    if now - _last_drawn.get(output_dir, -math.inf) < min_interval:
        return None
    rows = read_rows(output_dir) if rows is None else rows
    if not rows:
        return None
    _last_drawn[output_dir] = now
    return save_figure(build_figure([(_label(output_dir), rows)]), os.path.join(output_dir, CURVES))


def plot_main(argv: list[str]) -> int:
    """`finetune plot DIR [DIR ...] [-o OUT.png]`: the curves of several runs in one picture."""
    parser = argparse.ArgumentParser(
        prog="finetune plot",
        description="Overlay the curves of several runs (their metrics.jsonl) in one PNG: train and eval loss, "
        "eval metrics, learning rate, tokens/s. Runs are labelled by run_name, else their directory's name.",
    )
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="output_dir of a run (holds metrics.jsonl)")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG to write (default: curves.png)")
    args = parser.parse_args(argv)
    from finetune.config import ConfigError

    missing = [d for d in args.dirs if not (Path(d) / "metrics.jsonl").is_file()]
    if missing:
        problems = [(d, "has no metrics.jsonl; give the output_dir of a run") for d in missing]
        print(ConfigError(problems).render(), file=sys.stderr)
        return 2
    runs = [(_label(d), read_rows(d)) for d in args.dirs]
    labels = [label for label, _ in runs]
    if len(set(labels)) < len(labels):  # same names in different folders: say which folder
        runs = [(f"{Path(os.path.abspath(d)).parent.name}/{label}", rows) for d, (label, rows) in zip(args.dirs, runs)]
    out = save_figure(build_figure(runs), args.output)
    print(f"wrote {os.path.abspath(out)} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


# ---------------------------------------------------------------- what the run did, from metrics.jsonl


def outcome(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Final eval metrics, tokens, training time, mean tokens/s and MFU, peak memory per rank, planner estimates."""
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    seconds = tokens = busy = 0.0
    previous = 0
    mfu_time = 0.0
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
    memory = next((r["peak_memory"] for r in reversed(rows) if "peak_memory" in r), [])
    return {
        "steps": train[-1]["step"] if train else 0,
        "final_eval": {k: v for k, v in (evals[-1] if evals else {}).items() if k.startswith("eval_")},
        "final_loss": train[-1]["loss"] if train else None,
        "tokens_seen": train[-1]["tokens_seen"] if train else 0,
        "train_seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else None,
        "mfu": mfu_time / busy if busy else None,
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


def _allocator_note(cfg, memory: dict[int, dict[str, float]]) -> str:
    """On a CPU the estimate is the live set (cpu_allocator: release); keep and glibc's defaults peak higher."""
    on_cpu = not any("gpu" in k for peaks in peak_per_rank(memory).values() for k in peaks)
    return (
        f"; on a CPU it assumes cpu_allocator release (this run: {cfg.train.cpu_allocator})"
        if on_cpu and cfg.train.cpu_allocator != "release"
        else ""
    )


def _memory_text(memory: dict[int, dict[str, float]]) -> str:
    names = {"rss": "host RSS", "gpu_allocated": "GPU allocated", "gpu_reserved": "GPU reserved"}
    return "; ".join(
        f"rank {rank} " + ", ".join(f"{names.get(k, k)} {v:.2f} GB" for k, v in peaks.items())
        for rank, peaks in peak_per_rank(memory).items()
    )


# ---------------------------------------------------------------- model card


def _base_model_card(model: str) -> dict[str, Any]:
    """The base model's card metadata (license, ...), from its local directory or the local Hub cache."""
    from huggingface_hub import ModelCard

    path = Path(model) / CARD
    try:
        if path.is_file():
            return ModelCard.load(path).data.to_dict()
        if not looks_local(model):
            from huggingface_hub import hf_hub_download

            return ModelCard.load(hf_hub_download(model, CARD, local_files_only=True)).data.to_dict()
    except Exception:  # no card, unreadable card, not cached: the card then says nothing about a license
        pass
    return {}


EXTRA_FRAMEWORKS = ("peft", "deepspeed", "bitsandbytes")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    names = ["finetune", "torch", "transformers", "accelerate", "datasets", "tokenizers"]
    names += [n for n in EXTRA_FRAMEWORKS if n in sys.modules]  # the ones this run used
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def card_metadata(cfg: RunConfig) -> dict[str, Any]:
    m, d = cfg.model, cfg.data
    peft_on = cfg.peft.method != "none"
    base = _base_model_card(m.model)
    tags = ["finetune", m.task.replace("_", "-")]
    tags += [cfg.peft.method, "peft"] if peft_on else []
    meta: dict[str, Any] = {
        "library_name": "peft" if peft_on else "transformers",
        "pipeline_tag": PIPELINE_TAGS[m.task],
        "tags": tags,
    }
    if not looks_local(m.model):
        meta["base_model"] = m.model
    if base.get("license"):
        meta["license"] = base["license"]
    named = [x for src in sources_of(d) for x in (src.args.dataset, src.args.eval_dataset)]
    datasets = [s for s in named if s and not looks_local(s)]
    if datasets:
        meta["datasets"] = list(dict.fromkeys(datasets))
    return meta


def _data_lines(d, about: dict[str, Any]) -> list[str]:
    """Where the training and eval rows came from: one dataset, or a mixture's sources and weights."""
    rows = f"{about.get('train_rows', '?')} train rows, {about.get('eval_rows', 0)} eval rows"
    if d.datasets:
        sources = sources_of(d)
        total = sum(src.weight for src in sources)
        lines = [f"- a mixture of {len(sources)} sources ({rows}; eval also reported per source):"]
        return lines + [f"  - `{src.name}`: `{src.args.dataset}`, weight {src.weight / total:.2f}" for src in sources]
    held_out = f", split `{d.eval_split}`" if d.eval_split else f", {d.eval_fraction:g} of train held out"
    return [
        f"- train: `{d.dataset}`"
        + (f" (config `{d.dataset_config}`)" if d.dataset_config else "")
        + f", split `{d.train_split}`, {about.get('train_rows', '?')} rows",
        f"- eval: `{d.eval_dataset or d.dataset}`"
        + (held_out if not d.eval_dataset or d.eval_split else "")
        + f", {about.get('eval_rows', 0)} rows",
    ]


def card_text(cfg: RunConfig, rows: list[dict[str, Any]], about: dict[str, Any]) -> str:
    """final/README.md: Hub metadata (YAML header) and what a user of the model needs to know."""
    from huggingface_hub import ModelCard, ModelCardData

    m, d, t, pe = cfg.model, cfg.data, cfg.train, cfg.peft
    peft_on = pe.method != "none"
    res = outcome(rows)
    meta = card_metadata(cfg)
    name = run_name(t)
    auto = AUTO_CLASSES[m.task]
    repo = hub_repo_id(t) if t.push_to_hub else about.get("final_dir", "path/to/final")
    if peft_on:
        load = (
            f"from peft import {AUTO_CLASSES[m.task].replace('AutoModel', 'AutoPeftModel')}"
            f" as Auto\n\nmodel = Auto.from_pretrained({repo!r})  # loads the base model {m.model!r}, then the adapter"
        )
        if pe.merge:
            load += f"\n# or the merged model (base + adapter in one):\n# from transformers import {auto}\n"
            load += f"# model = {auto}.from_pretrained({repo!r}, subfolder='merged')"
    else:
        load = f"from transformers import {auto}\n\nmodel = {auto}.from_pretrained({repo!r})"
    load += f"\nfrom transformers import AutoTokenizer\ntokenizer = AutoTokenizer.from_pretrained({repo!r})"
    hyper = {
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler_type,
        "warmup": f"{t.warmup_steps} steps" if t.warmup_steps else f"ratio {t.warmup_ratio}",
        "optimizer": f"AdamW (betas {t.adam_beta1}, {t.adam_beta2}; eps {t.adam_epsilon}; weight decay {t.weight_decay})",
        "max_grad_norm": t.max_grad_norm,
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "global_batch_size": about.get("global_batch_size"),
        "optimizer steps": res["steps"],
        "max_seq_length": d.max_seq_length,
        "packing": d.packing,
        "seed": t.seed,
        "torch_dtype (weights loaded in)": m.torch_dtype,
    }
    if peft_on:
        hyper.update(
            {
                "adapter": f"{pe.method} r={pe.r} alpha={pe.alpha} dropout={pe.dropout}",
                "target_modules": ", ".join(pe.target_modules),
            }
        )
    lines = [f"# {name}", ""]
    lines += [
        f"{'A ' + ADAPTER_NAMES.get(pe.method, pe.method) + ' adapter for' if peft_on else 'A fine-tuned version of'} "
        f"`{m.model}` "
        f"({m.task.replace('_', ' ')}), trained with finetune on "
        + (f"`{d.dataset}`." if d.dataset else f"a mixture of {len(d.datasets)} datasets."),
        "",
        "## How to load it",
        "",
        "```python",
        load,
        "```",
        "",
        "## Training data",
        "",
        *_data_lines(d, about),
        f"- format: {about.get('data_format', d.format)}"
        + (
            " (loss on the responses / assistant turns only)"
            if about.get("data_format") in ("instruction", "chat")
            else ""
        ),
        "",
        "## Hyperparameters",
        "",
        "| name | value |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in hyper.items() if v is not None),
        "",
        "The complete run config is in `run_config.yaml`.",
        "",
        "## Parallelism",
        "",
        f"- Accelerate config family: {about.get('parallelism', '?')}",
        f"- distributed type: {res['distributed_type'] or about.get('distributed_type')}, "
        f"world size: {res['world_size'] or about.get('world_size')}",
        f"- mixed precision: {about.get('mixed_precision', 'no')}; observed in training: weights "
        f"{(about.get('precision') or {}).get('weights_dtype', '?')}, compute "
        f"{(about.get('precision') or {}).get('compute_dtype', '?')}",
        f"- saved in: {about.get('save_dtype', '?')} (save_dtype {m.save_dtype}; from the full-precision weights)",
        "",
        "## Results",
        "",
    ]
    if res["final_eval"]:
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.4f} |" for k, v in res["final_eval"].items()]
    else:
        lines += ["No eval set."]
    if about.get("best"):  # load_best_model_at_end (finetune.best)
        lines += ["", "### Best checkpoint", "", about["best"]]
    tok_s = f"{res['tokens_per_s']:.0f}" if res["tokens_per_s"] else "?"
    lines += [
        "",
        f"- final train loss: {res['final_loss']:.4f}" if res["final_loss"] is not None else "- final train loss: ?",
        *(
            [f"- optimizer steps skipped by the fp16 loss scaler: {res['skipped_steps']}"]
            if res["skipped_steps"]
            else []
        ),
        f"- tokens seen: {res['tokens_seen']:,}",
        f"- wall time: {about.get('wall_time_s', 0):.1f} s (training steps {res['train_seconds']:.1f} s), "
        f"{tok_s} tokens/s" + (f", MFU {100 * res['mfu']:.1f}%" if res["mfu"] else ""),
        f"- peak memory: {_memory_text(res['peak_memory']) or '?'}",
        "",
        "## Framework versions",
        "",
        *(f"- {k} {v}" for k, v in _versions().items()),
        "",
    ]
    card = ModelCard(f"---\n{ModelCardData(**meta).to_yaml()}\n---\n\n" + "\n".join(lines))
    return str(card)


def write_card(final_dir: str, cfg: RunConfig, rows: list[dict[str, Any]], about: dict[str, Any]) -> str:

    path = os.path.join(final_dir, CARD)
    write_atomic(path, card_text(cfg, rows, about))
    return path


# ---------------------------------------------------------------- Hub


class PushFailed(RuntimeError):
    """The upload to the Hub failed; the model is saved locally (the message says where and how to upload)."""


def hub_preflight(cfg: RunConfig) -> list[tuple[str, str]]:
    """push_to_hub on the main process, before anything loads: the Hub answers and the token may write."""
    if not cfg.train.push_to_hub:
        return []
    from huggingface_hub import HfApi, constants

    try:
        who = HfApi().whoami()
    except Exception as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status == 401:
            return [("push_to_hub", "the Hugging Face token was refused (401); log in again (`hf auth login`)")]
        first = (str(e).splitlines() or [""])[0][:200]
        return [
            (
                "push_to_hub",
                f"cannot reach the Hub at {constants.ENDPOINT} ({type(e).__name__}: {first}); check the network, "
                "or set push_to_hub: false and upload final/ later (`hf upload`)",
            )
        ]
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        return [("push_to_hub", "the Hugging Face token is read-only; use a token with write access")]
    return []


def push(cfg: RunConfig, final_dir: str) -> str:
    """Upload final/ (model or adapter, tokenizer, card, run config; merged/ inside it) to hub_model_id."""
    from huggingface_hub import HfApi

    t = cfg.train
    api = HfApi()
    repo_id = hub_repo_id(t)
    try:
        url = api.create_repo(repo_id, private=t.hub_private_repo, exist_ok=True, repo_type="model")
        api.upload_folder(
            repo_id=url.repo_id,
            folder_path=final_dir,
            repo_type="model",
            commit_message=f"finetune: {run_name(t)}",
        )
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:300]
        raise PushFailed(
            f"the upload to the Hub ({repo_id}) failed: {type(e).__name__}: {first}. The model is saved in "
            f"{os.path.abspath(final_dir)}; upload it with `hf upload {repo_id} {os.path.abspath(final_dir)}`"
        ) from None
    return f"{url}"


# ---------------------------------------------------------------- the end of a run


def finish(accelerator, cfg: RunConfig, final_dir: str, about: dict[str, Any]) -> None:
    """Main process, after export and the memory report: curves, model card, Hub, and the summary block."""
    if not accelerator.is_main_process:
        return
    out = cfg.train.output_dir
    rows = read_rows(out)
    curves = write_curves(out, rows=rows)
    card = write_card(final_dir, cfg, rows, {**about, "final_dir": os.path.abspath(final_dir)})
    url = push(cfg, final_dir) if cfg.train.push_to_hub else None
    for line in summary(cfg, rows, about, final_dir, card, curves, url):
        logger.info(line)


def summary(cfg, rows, about, final_dir, card, curves, url) -> list[str]:
    res = outcome(rows)
    peft_on = cfg.peft.method != "none"
    how = "PeftModel/AutoPeft*.from_pretrained" if peft_on else f"{AUTO_CLASSES[cfg.model.task]}.from_pretrained"
    lines = ["-" * 24 + " run summary " + "-" * 24]
    lines.append(f"model        {os.path.abspath(final_dir)} (load with {how})")
    if peft_on and cfg.peft.merge:
        lines.append(f"merged       {os.path.abspath(os.path.join(final_dir, 'merged'))}")
    lines.append(f"model card   {os.path.abspath(card)}")
    if curves:
        lines.append(f"curves       {os.path.abspath(curves)}")
    if res["final_eval"]:
        lines.append("final eval   " + "  ".join(f"{k} {v:.4f}" for k, v in res["final_eval"].items()))
    speed = f"{res['tokens_per_s']:.0f} tokens/s" if res["tokens_per_s"] else "tokens/s ?"
    mfu = f", MFU {100 * res['mfu']:.1f}%" if res["mfu"] is not None else ""
    lines.append(
        f"training     {res['steps']} steps, {res['tokens_seen']:,} tokens, wall time {about.get('wall_time_s', 0):.1f} s "
        f"(steps {res['train_seconds']:.1f} s), {speed}{mfu}"
    )
    precision = f"precision    compute {res['compute_dtype'] or '?'}, final/ saved in {about.get('save_dtype', '?')}"
    if res["skipped_steps"]:
        precision += f"; {res['skipped_steps']} step(s) skipped by the fp16 loss scaler (overflow)"
    lines.append(precision)
    if res["peak_memory"]:
        lines.append(f"peak memory  {_memory_text(res['peak_memory'])}")
    if res["estimates"]:
        lines.append(
            "planner      "
            + ", ".join(
                f"{k.removeprefix('estimate_').removesuffix('_gb')} {v:.2f} GB" for k, v in res["estimates"].items()
            )
            + " per rank (finetune plan)"
            + _allocator_note(cfg, res["peak_memory"])
        )
    lines.append(f"logs         {os.path.abspath(os.path.join(cfg.train.output_dir, 'logs'))} (every rank)")
    if cfg.train.report_to:
        lines.append(
            f"trackers     {', '.join(cfg.train.report_to)}"
            + (
                f" (tensorboard --logdir {os.path.abspath(os.path.join(cfg.train.output_dir, 'runs'))})"
                if "tensorboard" in cfg.train.report_to or "all" in cfg.train.report_to
                else ""
            )
        )
    if url:
        lines.append(f"hub          {url}")
    return lines
