"""The pure rules of a run config: every check that needs nothing but the config's values, composed by
`validate` (with the checks of disk and environment from preflight.py) into one list of problems."""

from __future__ import annotations

import dataclasses
import os

from finetune.config.schema import (
    CPU_ALLOCATORS,
    DEFAULT_METRICS,
    DTYPES,
    FORMATS,
    GENERATION_METRICS,
    METHODS,
    MIXED_PRECISIONS,
    NO_EVAL_DATA,
    PEFT_METHODS,
    PREEMPTION_SIGNALS,
    PREFERENCE_METRICS,
    REFERENCE_METHODS,
    REFERENCES,
    SCHEDULERS,
    SWITCHES,
    TASKS,
    PeftArgs,
    RunConfig,
    TrainArgs,
    changed_fields,
    choice,
    format_misfits,
    shipped_metrics,
)
from finetune.config.sources import has_eval_data, sources_of


def encoder_decoder_problems(task: str, encoder_decoder: bool, model: str, model_type: str | None) -> list:
    """task seq2seq needs an encoder-decoder model, and an encoder-decoder needs task seq2seq (also checked
    at load for Hub models, whose config.json is not read here)."""
    if task == "seq2seq" and not encoder_decoder:
        return [
            (
                "task",
                f"seq2seq needs an encoder-decoder model (T5, BART, ...; AutoModelForSeq2SeqLM) and {model!r} is a "
                f"{model_type or 'decoder-only'} model (its config has no is_encoder_decoder: true); set task: "
                "causal_lm, or point model at an encoder-decoder",
            )
        ]
    if task == "causal_lm" and encoder_decoder:
        return [("task", f"{model!r} is an encoder-decoder model ({model_type}); set task: seq2seq")]
    return []


# Model types whose learned position embeddings number positions from pad_token_id + 1 (transformers'
# create_position_ids_from_input_ids with padding_idx): max_position_embeddings - pad_token_id - 1 positions are usable
# (RoBERTa's 514 with pad 1: 512).
PADDING_OFFSET_POSITIONS = frozenset(
    {
        "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "roberta-prelayernorm", "data2vec-text", "xmod",
        "ibert", "longformer", "luke", "mpnet", "esm", "markuplm", "layoutlmv3", "lilt",
    }
)  # fmt: skip


def position_problems(model: str, config: dict, max_seq_length: int) -> list[tuple[str, str]]:
    """max_seq_length within the model's positions (config: its config.json; max_position_embeddings, or
    n_positions; none: no limit), less the padding offset of the PADDING_OFFSET_POSITIONS types."""
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return []
    known = f"max_position_embeddings={limit}"
    pad = config.get("pad_token_id")
    absolute = config.get("position_embedding_type") in (None, "absolute")  # ESM-2's rotary ones have no offset
    if config.get("model_type") in PADDING_OFFSET_POSITIONS and absolute and isinstance(pad, int) and pad >= 0:
        limit -= pad + 1
        known += f" less pad_token_id={pad} + 1: {config['model_type']} numbers its positions from the pad id + 1"
    if max_seq_length > limit:
        why = f"{max_seq_length} is beyond what {model!r} supports ({known}); set max_seq_length <= {limit}"
        return [("max_seq_length", why)]
    return []


def required_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    p = []
    if not cfg.model.model:
        p.append(("model", "is required: set it to a Hub model id or a local model directory"))
    if not cfg.data.dataset and cfg.data.datasets is None:
        p.append(("dataset", "is required: set it to a Hub dataset id or local data files (or give datasets:)"))
    return p


def choice_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Fields that take one of a few values."""
    m, d, t = cfg.model, cfg.data, cfg.train
    p: list[tuple[str, str]] = []
    choice(p, "task", m.task, TASKS)
    choice(p, "torch_dtype", m.torch_dtype, DTYPES)
    choice(p, "mixed_precision", m.mixed_precision, MIXED_PRECISIONS)
    choice(p, "save_dtype", m.save_dtype, DTYPES)
    choice(p, "chunked_loss", m.chunked_loss, SWITCHES)
    if m.loss_chunk_tokens < 0:
        p.append(("loss_chunk_tokens", f"must be >= 0 (0: chosen from the vocabulary size), got {m.loss_chunk_tokens}"))
    choice(p, "format", d.format, FORMATS)
    choice(p, "lr_scheduler_type", t.lr_scheduler_type, SCHEDULERS)
    choice(p, "cpu_allocator", t.cpu_allocator, CPU_ALLOCATORS)
    choice(p, "method", t.method, METHODS)
    return p


def peft_problems(pe: PeftArgs) -> list[tuple[str, str]]:
    p: list[tuple[str, str]] = []
    choice(p, "peft.method", pe.method, PEFT_METHODS)
    if pe.method != "none":
        if pe.r < 1:
            p.append(("peft.r", f"must be >= 1, got {pe.r}"))
        if not 0 <= pe.dropout < 1:
            p.append(("peft.dropout", f"must be in [0, 1), got {pe.dropout}"))
        if not pe.target_modules:
            p.append(("peft.target_modules", "must name at least one module, or [all-linear]"))
    elif given := [f"peft.{name}" for name in changed_fields(pe) if name != "method"]:
        # an adapter's settings without an adapter (as generation_metrics without generation): refused, not ignored
        p.append(("peft.method", f"is none (every weight trains, no adapter) but {', '.join(given)} configure an "
                                 "adapter; set peft.method: lora (or dora), or drop them"))  # fmt: skip
    return p


def data_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    p = []
    if "{prompt}" not in cfg.data.prompt_template:
        p.append(("prompt_template", "must contain the placeholder {prompt}"))
    if cfg.data.packing and cfg.model.task != "causal_lm":
        p.append(("packing", "packing applies to causal LM only; set packing: false"))
    return p + streaming_problems(cfg) + preference_problems(cfg)


def preference_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """A preference method needs preference pairs, a causal LM and whole pairs per row; sft needs no pairs."""
    d, t = cfg.data, cfg.train
    p = []
    if t.method == "sft":
        if d.format == "preference":
            p.append(("method", "format preference holds {prompt, chosen, rejected} pairs: set method: dpo (or ipo, "
                                "orpo, simpo), or give supervised data"))  # fmt: skip
        return p
    if t.method not in METHODS:
        return p
    if cfg.model.task != "causal_lm":
        p.append(("task", f"method {t.method} trains a causal LM on preference pairs; set task: causal_lm"))
    if d.format not in ("auto", "preference"):
        p.append(("format", f"method {t.method} reads preference pairs; set format: preference (or auto)"))
    off = "or set method: sft"
    for key, on, why in (
        ("packing", d.packing, "a pair's two answers are compared whole, each in its own row"),
        ("length_aware_batching", d.length_aware_batching, "a pair is two rows of its own lengths"),
    ):
        if on:
            p.append((key, f"is not supported with method {t.method} ({why}); turn it off, {off}"))
    if not t.beta > 0:
        p.append(("beta", f"must be > 0, got {t.beta}"))
    if not 0 <= t.label_smoothing < 0.5:
        p.append(("label_smoothing", f"must be in [0, 0.5), got {t.label_smoothing}"))
    if t.label_smoothing and t.method not in ("dpo", "simpo"):
        p.append(("label_smoothing", f"applies to dpo and simpo, not {t.method}; set it to 0"))
    choice(p, "reference", t.reference, REFERENCES)
    if t.reference == "live" and t.method not in REFERENCE_METHODS:
        p.append(("reference", f"is live, but {t.method} compares with no reference model; leave reference out"))
    if t.reference == "live" and t.method in REFERENCE_METHODS and cfg.peft.adapter:
        # the live reference is the policy with its adapter disabled: the base model, the start only for a fresh one
        p.append(("reference", f"is live, but peft.adapter continues {cfg.peft.adapter!r}: the live reference is the "
                               "base model with the adapter disabled, not the model training starts from (base + "
                               "adapter); set reference: precomputed (the starting model's log-probs, adapter on), or "
                               "merge the adapter first (finetune merge) and train a new one on the merged model"))  # fmt: skip
    if d.streaming and t.method in REFERENCE_METHODS and t.reference == "precomputed":
        p.append(("streaming", f"method {t.method} precomputes its reference log-probs over the whole data before "
                               "training, which a stream does not have; set reference: live (the reference model "
                               "beside the trained one), or streaming: false"))  # fmt: skip
    return p


def streaming_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What a stream of unknown length, read once in order, cannot do."""
    d, t = cfg.data, cfg.train
    if not d.streaming:
        return []
    p = []
    off = "or set streaming: false"
    if t.max_steps < 1:
        p.append(("max_steps", "streaming: a stream has no length to count epochs in; set max_steps (the stream "
                               "restarts, reshuffled, when it runs out)"))  # fmt: skip
    if d.datasets:
        p.append(("datasets", f"streaming reads one dataset; give `dataset` alone, {off}"))
    if d.length_aware_batching:
        p.append(("length_aware_batching", f"needs every row's length ahead, which a stream does not have; {off}"))
    if cfg.model.task == "classification":
        p.append(
            ("task", f"classification needs the whole data's label set ahead, which a stream does not have; {off}")
        )
    if d.prepared_data:
        p.append(("prepared_data", "prepared data is already tokenized and packed on disk; set streaming: false"))
    if d.preprocessing_num_workers:
        p.append(("preprocessing_num_workers", "streaming tokenizes as training reads, in the training process; "
                                               "set it to null"))  # fmt: skip
    if t.dataloader_num_workers:
        p.append(("dataloader_num_workers", "streaming reads one stream in order in the training process; set it "
                                            "to 0"))  # fmt: skip
    if d.eval_fraction > 0 and not (d.eval_dataset or d.eval_split) and not d.eval_fraction_max_rows:
        p.append(("eval_fraction_max_rows", "streaming holds out the stream's first eval_fraction_max_rows rows for "
                                            "eval (a fraction of a stream of unknown length cannot be taken); set it, "
                                            "give eval_dataset, or set eval_fraction: 0"))  # fmt: skip
    return p


AT_LEAST_ONE = (
    "shuffle_buffer_size",
    "host_wait_timeout",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "max_seq_length",
    "logging_steps",
)
AT_LEAST_ONE_OR_NULL = {  # key -> what null means for it
    "ddp_timeout": "the default: 600 s on CPU, 1800 s on GPU",
    "eval_steps": "off",
    "save_steps": "off",
    "save_total_limit": "keep every checkpoint",
    "max_train_samples": "every example",
    "eval_fraction_max_rows": "no cap",
    "preprocessing_num_workers": "chosen from the cores and the data size",
}
NON_NEGATIVE = ("weight_decay", "max_grad_norm", "warmup_steps", "adam_epsilon", "dataloader_num_workers")


def number_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Counts, steps, rates and fractions out of range."""
    d, t = cfg.data, cfg.train
    p: list[tuple[str, str]] = []
    values = {**dataclasses.asdict(d), **dataclasses.asdict(t)}
    p += [(key, f"must be >= 1, got {values[key]}") for key in AT_LEAST_ONE if values[key] < 1]
    for key, null in AT_LEAST_ONE_OR_NULL.items():
        if values[key] is not None and values[key] < 1:
            p.append((key, f"must be >= 1, or null ({null}), got {values[key]}"))
    if t.preemption_signal not in PREEMPTION_SIGNALS:
        p.append(("preemption_signal", f"must be one of {', '.join(PREEMPTION_SIGNALS)}, got {t.preemption_signal!r}"))
    if t.max_steps == 0 or t.max_steps < -1:
        p.append(("max_steps", f"must be >= 1, or -1 to use num_train_epochs; got {t.max_steps}"))
    if t.max_steps == -1 and t.num_train_epochs <= 0:
        p.append(("num_train_epochs", f"must be > 0 when max_steps is -1; got {t.num_train_epochs}"))
    if not 0 <= t.seed < 2**32:  # numpy's seeds, and the data order's: 32 bits
        p.append(("seed", f"must be in [0, 2**32 - 1], got {t.seed}"))
    if not t.learning_rate > 0:
        p.append(("learning_rate", f"must be > 0, got {t.learning_rate}"))
    p += [(key, f"must be >= 0, got {values[key]}") for key in NON_NEGATIVE if (values[key] or 0) < 0]
    for key in ("adam_beta1", "adam_beta2", "warmup_ratio", "eval_fraction"):
        if not 0 <= values[key] < 1:
            p.append((key, f"must be in [0, 1), got {values[key]}"))
    if t.profile_steps is not None and t.profile_window is None:
        p.append(("profile_steps", f"expected FIRST-LAST optimizer steps from 1, like 5-7, or one step like 5; got "
                                   f"{t.profile_steps!r}"))  # fmt: skip
    return p


def eval_problems(t: TrainArgs, has_eval: bool) -> list[tuple[str, str]]:
    return [(key, NO_EVAL_DATA) for key in ("eval_steps", "eval_on_start") if getattr(t, key) and not has_eval]


FORMAT_FIXES = {  # format_misfits' reasons, as the top-level `format:` says them
    "needs_label": "{fmt!r} is a causal-LM format; task classification needs format classification: set format: "
    "classification (or auto), or task: causal_lm",
    "is_label": "classification data needs task classification: set task: classification",
    "needs_pairs": "{fmt!r} has no input -> target pairs for task seq2seq; set format: instruction (prompt -> "
    "response) or source_target (source_column -> target_column), or task: causal_lm",
    "is_pairs": "source_target is the encoder-decoder format; set task: seq2seq, or (causal LM) format: instruction "
    "with prompt_column and response_column",
}


def format_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """The data format against the task (schema.TASK_FORMATS)."""
    fmt = cfg.data.format
    return [("format", FORMAT_FIXES[why].format(fmt=fmt)) for why in format_misfits(cfg.model.task, fmt)]


def task_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Generation eval that the task or data cannot use: it needs eval examples whose answer is text, and
    metrics that score generated text need it on."""
    return generation_problems(cfg) + generated_metric_problems(cfg)


def generation_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    m, d, t = cfg.model, cfg.data, cfg.train
    p: list[tuple[str, str]] = []
    gen = t.generation_max_new_tokens
    if gen is not None and gen < 0:
        p.append(("generation_max_new_tokens", f"must be >= 1, or null/0 (off); got {gen}"))
    elif gen and m.task == "classification":
        why = (
            "a classifier predicts a label and generates no text; drop generation_max_new_tokens (eval reports "
            "accuracy and f1), or use task causal_lm or seq2seq with text answers"
        )
        p.append(("generation_max_new_tokens", why))
    elif gen and d.format == "text":
        why = (
            "raw text data (format text) has no prompt/answer split to generate and score; use instruction, "
            "chat (or source_target) data, or drop generation_max_new_tokens"
        )
        p.append(("generation_max_new_tokens", why))
    elif gen and not has_eval_data(d):  # a mixture's sources too
        p.append(("generation_max_new_tokens", NO_EVAL_DATA))
    if t.generation_num_examples is not None and t.generation_num_examples < 1:
        p.append(("generation_num_examples", f"must be >= 1 or null (all), got {t.generation_num_examples}"))
    if "generation_metrics" in changed_fields(t) and not gen:
        p.append(("generation_metrics", "is set but generation eval is off; set generation_max_new_tokens (e.g. 32)"))
    elif gen and not t.generation_metrics:
        p.append(("generation_metrics", f"must name at least one metric, e.g. [{', '.join(GENERATION_METRICS)}]"))
    return p


def generated_metric_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """metrics score a classifier's predicted labels; those that score generated text belong in
    generation_metrics."""
    p = []
    for name in cfg.train.metrics or []:
        if name in GENERATION_METRICS and cfg.model.task == "classification":
            why = (
                f"{name!r} scores generated text and a classifier generates none; use accuracy or f1 "
                "(or task causal_lm/seq2seq with generation_max_new_tokens)"
            )
            p.append(("metrics", why))
        elif name in GENERATION_METRICS:
            why = (
                f"{name!r} scores generated text; remove it from metrics and set generation_max_new_tokens "
                f"(generation_metrics defaults to {', '.join(GENERATION_METRICS)})"
            )
            p.append(("metrics", why))
        elif cfg.model.task != "classification":
            why = (
                f"{name!r} would score a classifier's predicted labels, and a {cfg.model.task} run predicts none "
                "(its eval reports eval_loss and eval_perplexity); remove it, or score generated text: set "
                "generation_max_new_tokens and generation_metrics"
            )
            p.append(("metrics", why))
    return p


# ---------------------------------------------------------------- the best checkpoint and early stopping (best.py)

LOSS_LIKE = ("loss", "perplexity")


def metric_key(name: str) -> str:
    """transformers' rule: a metric name without the eval_ prefix gets it."""
    return name if name.startswith("eval_") else f"eval_{name}"


def effective_metric(t: TrainArgs) -> str | None:
    if t.metric_for_best_model:
        return metric_key(t.metric_for_best_model)
    return "eval_loss" if t.load_best_model_at_end else None


def greater_is_better(t: TrainArgs, metric: str) -> bool:
    if t.greater_is_better is not None:
        return t.greater_is_better
    return not metric.endswith(LOSS_LIKE)


def computed_metrics(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(the eval keys this run reports, prefixes of the keys of metric modules whose keys only they know).
    Per source too (eval_<name>_...) for a mixture."""
    names = cfg.train.metrics if cfg.train.metrics is not None else DEFAULT_METRICS[cfg.model.task]
    shipped = set(shipped_metrics())
    if cfg.train.method != "sft":  # a preference method's eval: its loss and reward statistics
        keys = ["loss", *PREFERENCE_METRICS]
    else:
        keys = ["loss"] + (["perplexity"] if cfg.model.task != "classification" else [])
    keys += [n for n in names if n in shipped]  # accuracy, f1, exact_match report their own name
    prefixes = [os.path.basename(n.rstrip("/")) for n in names if n not in shipped]  # e.g. rouge -> rougeL
    scopes = [""]
    if cfg.data.datasets and all(isinstance(e, dict) for e in cfg.data.datasets):
        scopes += [f"{s.name}_" for s in sources_of(cfg.data)]
    keys = [f"eval_{s}{k}" for s in scopes for k in keys]
    prefixes = [f"eval_{s}{k}" for s in scopes for k in prefixes]
    if cfg.train.generation_max_new_tokens:  # scored on the whole eval set only: eval_exact_match, eval_rougeL, ...
        prefixes += [f"eval_{m}" for m in cfg.train.generation_metrics]
    return keys, prefixes


def best_problems(cfg: RunConfig, has_eval: bool | None = None) -> list[tuple[str, str]]:
    """What keeps the best-checkpoint and early-stopping settings from working, each with its fix."""
    t = cfg.train
    has_eval = has_eval_data(cfg.data) if has_eval is None else has_eval
    p: list[tuple[str, str]] = []
    metric = effective_metric(t)
    if t.metric_for_best_model is not None:
        keys, prefixes = computed_metrics(cfg)
        if not has_eval:
            p.append(("metric_for_best_model", NO_EVAL_DATA))
        elif metric not in keys and not metric.startswith(tuple(prefixes)):
            why = (
                f"{t.metric_for_best_model!r} is never computed: this run's eval reports {', '.join(keys)}"
                f"{' and the keys of ' + ', '.join(prefixes) if prefixes else ''}; set one of them"
            )
            p.append(("metric_for_best_model", why))
    if t.load_best_model_at_end:
        p += _load_best_problems(t, has_eval)
    return p + _early_stopping_problems(t, metric, has_eval)


EVAL_DATA = "give eval data (eval_dataset, eval_split or eval_fraction > 0)"


def _prerequisites(key: str, what: str, missing: list[tuple[bool, str]]) -> list[tuple[str, str]]:
    """One problem naming every missing prerequisite of `key` and its fix at once (not one per attempt)."""
    fixes = [fix for lacking, fix in missing if lacking]
    return [(key, f"needs {what}: {'; '.join(fixes)}")] if fixes else []


def _load_best_problems(t: TrainArgs, has_eval: bool) -> list[tuple[str, str]]:
    """load_best_model_at_end needs evaluations and checkpoints at the evaluated steps."""
    missing = _prerequisites(
        "load_best_model_at_end",
        "evaluations during training and checkpoints to load the best from",
        [
            (not has_eval, EVAL_DATA),
            (not t.eval_steps, "set eval_steps"),
            (not t.save_steps, "set save_steps (a multiple of eval_steps)"),
        ],
    )
    if missing:
        return missing
    if t.save_steps % t.eval_steps:
        up = -(-t.save_steps // t.eval_steps) * t.eval_steps
        why = (
            f"must be a multiple of eval_steps ({t.eval_steps}) with load_best_model_at_end (as in transformers: "
            f"every regular checkpoint is an evaluated one), got {t.save_steps}; set save_steps: {up}"
        )
        return [("save_steps", why)]
    return []


def _early_stopping_problems(t: TrainArgs, metric: str | None, has_eval: bool) -> list[tuple[str, str]]:
    p = []
    if t.early_stopping_patience is not None:
        if t.early_stopping_patience < 1:
            p.append(("early_stopping_patience", f"must be >= 1 or null (off), got {t.early_stopping_patience}"))
        else:
            p += _prerequisites(
                "early_stopping_patience",
                "evaluations during training of a metric that must keep improving",
                [
                    (metric is None, "set metric_for_best_model (e.g. eval_loss)"),
                    (not t.eval_steps, "set eval_steps"),
                    (not has_eval, EVAL_DATA),
                ],
            )
    if t.early_stopping_threshold < 0:
        p.append(("early_stopping_threshold", f"must be >= 0, got {t.early_stopping_threshold}"))
    elif t.early_stopping_threshold and t.early_stopping_patience is None:
        p.append(("early_stopping_threshold", "has no effect without early_stopping_patience; set it, or drop this"))
    return p
