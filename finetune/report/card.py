"""The model card, final/README.md: Hub metadata, how to load it, data, hyperparameters, parallelism, results."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from finetune.checkpoint import write_atomic
from finetune.config import AUTO_CLASSES, RunConfig, hub_repo_id, looks_local, sources_of
from finetune.config.schema import CARD_MARK, MODEL_CARD
from finetune.report.outcome import RunFacts, memory_text, outcome
from finetune.report.trackers import run_name

CARD = MODEL_CARD


PIPELINE_TAGS = {
    "causal_lm": "text-generation",
    "classification": "text-classification",
    "seq2seq": "text2text-generation",
}


ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA"}


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


def card_text(cfg: RunConfig, rows: list[dict[str, Any]], facts: RunFacts) -> str:
    """final/README.md: Hub metadata (YAML header) and what a user of the model needs to know."""
    from huggingface_hub import ModelCard, ModelCardData

    m, d, pe = cfg.model, cfg.data, cfg.peft
    res = outcome(rows)
    what = (
        f"A {ADAPTER_NAMES.get(pe.method, pe.method)} adapter for" if pe.method != "none" else "A fine-tuned version of"
    )
    source = f"`{d.dataset}`." if d.dataset else f"a mixture of {len(d.datasets)} datasets."
    lines = [
        f"# {run_name(cfg.train)}",
        "",
        f"{what} `{m.model}` ({m.task.replace('_', ' ')}), {CARD_MARK} on {source}",
    ]
    load = _how_to_load(cfg, facts.label_names)
    lines += ["", "## How to load it", "", "```python", load, "```", "", "## Training data", ""]
    lines += _data_lines(d, facts)
    lines += ["", "## Hyperparameters", "", "| name | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in _hyperparameters(cfg, facts, res["steps"]).items() if v is not None]
    lines += ["", "The complete run config is in `run_config.yaml`.", "", "## Parallelism", ""]
    lines += _parallelism_lines(m, facts, res)
    lines += ["", "## Results", ""] + _result_lines(facts, res)
    lines += ["", "## Framework versions", "", *(f"- {k} {v}" for k, v in _versions().items()), ""]
    meta = card_metadata(cfg)
    return str(ModelCard(f"---\n{ModelCardData(**meta).to_yaml()}\n---\n\n" + "\n".join(lines)))


def _how_to_load(cfg: RunConfig, label_names: list[str] | None) -> str:
    """The Python that loads final/: from the Hub repo when the run pushes, else from a placeholder path (the card
    travels with the model: a path of the machine it was trained on would mean nothing elsewhere). A classifier
    adapter's base model is loaded with the run's head: its classes (labels.json, in the head's order) and the pad
    token the run set (transformers would build a 2-class head named LABEL_0, LABEL_1)."""
    m, t, pe = cfg.model, cfg.train, cfg.peft
    auto = AUTO_CLASSES[m.task]
    repo = hub_repo_id(t) if t.push_to_hub else "path/to/final"
    load = f"from transformers import AutoTokenizer\n\ntokenizer = AutoTokenizer.from_pretrained({repo!r})\n"
    if pe.method == "none":
        return load + f"from transformers import {auto}\n\nmodel = {auto}.from_pretrained({repo!r})"
    load += f"from peft import {auto.replace('AutoModel', 'AutoPeftModel')} as Auto\n\n"
    head = ""
    if label_names is not None:
        load += f"labels = {label_names!r}  # labels.json: the classes, in the order of the head's outputs\n"
        head = (
            ", num_labels=len(labels), id2label=dict(enumerate(labels)), "
            "label2id={n: i for i, n in enumerate(labels)}, problem_type='single_label_classification', "
            "pad_token_id=tokenizer.pad_token_id"
        )
    load += f"model = Auto.from_pretrained({repo!r}{head})  # loads the base model {m.model!r}, then the adapter"
    if pe.merge:
        load += f"\n# or the merged model (base + adapter in one):\n# from transformers import {auto}\n"
        load += f"# model = {auto}.from_pretrained({repo!r}, subfolder='merged')"
    return load


def _data_lines(d, facts: RunFacts) -> list[str]:
    """Where the training and eval rows came from: one dataset, or a mixture's sources and weights; the format."""
    train_rows = "?" if facts.train_rows is None else facts.train_rows
    learned = " (loss on the responses / assistant turns only)" if facts.data_format in ("instruction", "chat") else ""
    fmt = [f"- format: {facts.data_format or d.format}{learned}"]
    rows = f"{train_rows} train rows, {facts.eval_rows} eval rows"
    if d.datasets:
        sources = sources_of(d)
        total = sum(src.weight for src in sources)
        lines = [f"- a mixture of {len(sources)} sources ({rows}; eval also reported per source):"]
        lines += [f"  - `{src.name}`: `{src.args.dataset}`, weight {src.weight / total:.2f}" for src in sources]
        return lines + fmt
    cap = f" (at most {d.eval_fraction_max_rows} rows)" if d.eval_fraction_max_rows else ""
    held_out = f", split `{d.eval_split}`" if d.eval_split else f", {d.eval_fraction:g} of train held out{cap}"
    return [
        f"- train: `{d.dataset}`"
        + (f" (config `{d.dataset_config}`)" if d.dataset_config else "")
        + f", split `{d.train_split}`, {train_rows} rows",
        f"- eval: `{d.eval_dataset or d.dataset}`"
        + (held_out if not d.eval_dataset or d.eval_split else "")
        + f", {facts.eval_rows} rows",
        *fmt,
    ]


def _hyperparameters(cfg: RunConfig, facts: RunFacts, steps: int) -> dict[str, Any]:
    m, d, t, pe = cfg.model, cfg.data, cfg.train, cfg.peft
    hyper = {
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler_type,
        "warmup": f"{t.warmup_steps} steps" if t.warmup_steps else f"ratio {t.warmup_ratio}",
        "optimizer": f"AdamW (betas {t.adam_beta1}, {t.adam_beta2}; eps {t.adam_epsilon}; weight decay {t.weight_decay})",
        "max_grad_norm": t.max_grad_norm,
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "global_batch_size": facts.global_batch_size,
        "optimizer steps": steps,
        "max_seq_length": d.max_seq_length,
        "packing": d.packing,
        "seed": t.seed,
        "torch_dtype (weights loaded in)": m.torch_dtype,
    }
    if pe.method != "none":
        hyper["adapter"] = f"{pe.method} r={pe.r} alpha={pe.alpha} dropout={pe.dropout}"
        hyper["target_modules"] = ", ".join(pe.target_modules)
        if pe.load_in_4bit:  # the adapter learned against these weights, not the full-precision ones
            hyper["base weights in training"] = "4-bit NF4 (bitsandbytes, QLoRA)"
    return hyper


def _parallelism_lines(m, facts: RunFacts, res: dict[str, Any]) -> list[str]:
    return [
        f"- Accelerate config family: {facts.parallelism or '?'}",
        f"- distributed type: {res['distributed_type'] or facts.distributed_type}, "
        f"world size: {res['world_size'] or facts.world_size}",
        f"- mixed precision: {facts.mixed_precision}; observed in training: weights "
        f"{facts.precision.get('weights_dtype', '?')}, compute {facts.precision.get('compute_dtype', '?')}",
        f"- saved in: {facts.save_dtype or '?'} (save_dtype {m.save_dtype}; from the full-precision weights)",
    ]


def _result_lines(facts: RunFacts, res: dict[str, Any]) -> list[str]:
    if res["final_eval"]:
        lines = ["| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {v:.4f} |" for k, v in res["final_eval"].items()]
    else:
        lines = ["No eval set."]
    if facts.best:  # load_best_model_at_end (finetune.best)
        lines += ["", "### Best checkpoint", "", facts.best]
    tok_s = f"{res['tokens_per_s']:.0f}" if res["tokens_per_s"] else "?"
    skipped = res["skipped_steps"]
    return lines + [
        "",
        f"- final train loss: {res['final_loss']:.4f}" if res["final_loss"] is not None else "- final train loss: ?",
        *([f"- optimizer steps skipped by the fp16 loss scaler: {skipped}"] if skipped else []),
        f"- tokens seen: {res['tokens_seen']:,}",
        f"- wall time: {facts.wall_time_s:.1f} s (training steps {res['train_seconds']:.1f} s), "
        f"{tok_s} tokens/s" + (f", MFU {100 * res['mfu']:.1f}%" if res["mfu"] else ""),
        f"- peak memory: {memory_text(res['peak_memory']) or '?'}",
    ]


def write_card(final_dir: str, cfg: RunConfig, rows: list[dict[str, Any]], facts: RunFacts) -> str:
    path = os.path.join(final_dir, CARD)
    write_atomic(path, card_text(cfg, rows, facts))
    return path
