"""The model card, final/README.md: Hub metadata, how to load it, data, hyperparameters, parallelism, results."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from finetune.checkpoint import write_atomic
from finetune.config import AUTO_CLASSES, RunConfig, hub_repo_id, looks_local, sources_of
from finetune.report.outcome import memory_text, outcome
from finetune.report.trackers import run_name

CARD = "README.md"


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
        f"- peak memory: {memory_text(res['peak_memory']) or '?'}",
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
