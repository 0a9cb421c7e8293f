"""The run config's schema: typed sections (dataclasses whose field docs are `--help`), the choices each field takes, and coercion of a YAML or command-line value to a field's type.

A run config is a flat YAML mapping (``model: ...``, ``dataset: ...``, ``learning_rate: ...``).
Every field can also be given on the command line as ``--<field> <value>``, which wins
over the file. Field names follow transformers' ``TrainingArguments`` where one exists.

The parallelism is *not* here: it is in the Accelerate config file given to ``accelerate launch``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TASKS = ("causal_lm", "classification", "seq2seq")


FORMATS = ("auto", "text", "instruction", "chat", "classification", "source_target", "preference")
METHODS = ("sft", "dpo", "ipo", "orpo", "simpo")  # sft: the formats above; the others: preference pairs
REFERENCE_METHODS = ("dpo", "ipo")  # compared with a reference model (ORPO and SimPO need none)
# what a preference method's rows report beside the loss (train rows as named, eval rows as eval_<name>)
PREFERENCE_METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen", "logps_rejected")  # fmt: skip
REFERENCES = ("precomputed", "live")  # where dpo/ipo's reference log-probs come from (TrainArgs.reference)


GENERATION_METRICS = ("exact_match", "rouge", "bleu")  # scored on generated text (generation_metrics)


DTYPES = ("float32", "bfloat16", "float16", "auto")


MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")
SWITCHES = ("auto", "true", "false")


SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


PREEMPTION_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGTERM")


CPU_ALLOCATORS = ("keep", "release", "system")


DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


SHIPPED_METRICS = Path(__file__).parents[1] / "metric_modules"  # evaluate modules that load offline


# The data formats each task trains on (format: auto picks one of them from the columns, data.detect_format).
TASK_FORMATS = {
    "causal_lm": ("text", "instruction", "chat", "preference"),
    "classification": ("classification",),
    "seq2seq": ("instruction", "source_target"),
}
# a prompt -> answer split: generation eval scores them (preference: against the chosen answer)
PROMPT_FORMATS = ("instruction", "chat", "source_target", "preference")


def format_misfits(task: str, fmt: str) -> list[str]:
    """Why `fmt` cannot train `task` (TASK_FORMATS), most telling first; [] when it fits (or is auto):
    "needs_label" (classification with another format), "is_label" (classification data for causal LM),
    "needs_pairs" (seq2seq without input -> target pairs), "is_pairs" (source_target data for another task)."""
    if fmt == "auto":
        return []
    fits = fmt in TASK_FORMATS.get(task, ())
    homes = {other for other, formats in TASK_FORMATS.items() if fmt in formats}
    out = []
    if task == "classification" and not fits:
        out.append("needs_label")
    if task == "causal_lm" and homes == {"classification"}:
        out.append("is_label")
    if task == "seq2seq" and not fits:
        out.append("needs_pairs")
    if task != "seq2seq" and homes == {"seq2seq"}:
        out.append("is_pairs")
    return out


# The transformers Auto class of each task: the model finetune builds, plans and tells users to load.
AUTO_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "classification": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
}
DEFAULT_METRICS = {"causal_lm": [], "classification": ["accuracy", "f1"], "seq2seq": []}  # eval metrics by task


# What every setting that needs eval data says when there is none.
NO_EVAL_DATA = "is set but there is no eval data; give eval_dataset, eval_split or eval_fraction > 0"
# Files whose presence in output_dir means "a previous run lives here".
REFERENCE_FILE = "reference_logps.pt"  # preference methods: the starting model's log-probs (finetune/preference.py)
RUN_MARKERS = ("metrics.jsonl", "checkpoints", "final", "run_config.yaml", "logs", "curves.png", "runs", REFERENCE_FILE)


# final/README.md, the model card report.finish writes once final/ (and merged/ in it) is complete; PEFT writes a README.md
# of its own into an adapter directory, without CARD_MARK.
MODEL_CARD = "README.md"
CARD_MARK = "trained with finetune"
# Run-config keys that say where a run writes and how it starts, not what it trains: never compared between the config
# a run was trained with (its run_config.yaml) and the one given now.
NOT_COMPARED = ("output_dir", "resume_from_checkpoint", "overwrite_output_dir")


def shipped_metrics() -> list[str]:
    """The names of the evaluate modules shipped in SHIPPED_METRICS (they load offline)."""
    return sorted(p.name for p in SHIPPED_METRICS.iterdir() if p.is_dir())


class ConfigError(Exception):
    """One or more problems with the user's input. Each is (key, message) and names the fix."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__(self.render())

    def render(self, where: str = "the run config") -> str:
        """Every problem, a line each, under one heading that says where they are (a command's own input)."""
        n = len(self.problems)
        lines = [f"finetune: {n} problem{'s' if n > 1 else ''} in {where}:"]
        lines += [f"  - {key}: {msg}" for key, msg in self.problems]
        return "\n".join(lines)


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelArgs:
    """Which model to fine-tune and how to load it."""

    model: str = _f("", "Hub id or local directory of the base model.")
    task: str = _f(
        "causal_lm",
        f"What to train: one of {', '.join(TASKS)}. seq2seq: an encoder-decoder (T5, BART; AutoModelForSeq2SeqLM) "
        "reads the prompt (or source) and learns to write the response (or target).",
    )
    torch_dtype: str = _f(
        "float32",
        "dtype the weights are loaded in and the optimizer updates: float32 (recommended: fp32 master weights, "
        "the compute precision is mixed_precision's), bfloat16, float16 or auto (the checkpoint's own). Full "
        "fine-tuning of 16-bit weights loses the updates below their resolution where nothing keeps fp32 master "
        "weights (single, DDP, TP; DeepSpeed and FSDP2 keep them under mixed precision): warned at start, with the "
        "measurement (docs/precision.md). LoRA on a 16-bit base is fine.",
    )
    mixed_precision: str = _f(
        "auto",
        "Compute precision when `accelerate launch` names none (its --mixed_precision, or a mixed_precision line in "
        "the Accelerate config, wins whenever it is there): auto = bf16 on GPUs that support it (Ampere and newer), "
        "fp32 on a CPU or an older GPU; no = fp32; bf16; fp16 (GPUs only, with loss scaling; refused on a CPU). "
        "The precision that really ran is observed from the model and logged in every metrics row.",
    )
    save_dtype: str = _f(
        "auto",
        "dtype of the exported model (final/, merged/, the best checkpoint's export): float32, bfloat16, float16, "
        "or auto = the base model's own (its config.json dtype; float32 when it names none). Written from the "
        "full-precision weights the optimizer updates, cast once, the same under every Accelerate config.",
    )
    trust_remote_code: bool = _f(False, "Run model/tokenizer code shipped with the checkpoint. Off unless asked.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    chunked_loss: str = _f(
        "auto",
        "A causal LM's training loss computed loss_chunk_tokens tokens at a time, its logits never whole (each "
        "chunk's rebuilt in backward: one more LM-head forward per step): true, false, or auto = on for a vocabulary "
        "of 32k entries or more. Refused where the logits are more than the head's output (soft-capped, scaled, "
        "MoE router losses) or under Megatron-LM. Chunked or not, the LM head of such a plain-head causal LM runs on "
        "the learned positions only (not the prompts or padding). docs/performance.md.",
    )
    torch_compile: bool = _f(
        False,
        "Compile each repeated block of the model once (regional torch.compile, inductor; accelerate's "
        "TorchDynamoPlugin), under one process, DDP, ZeRO, FSDP2, adapters and gradient checkpointing. The first step "
        "pays for the compilation (logged). Refused under Megatron-LM. docs/performance.md.",
    )
    loss_chunk_tokens: int = _f(
        0, "Tokens per chunk of the chunked loss; 0 = about 2^25 logits per chunk (261 tokens at 128k entries)."
    )
    attn_implementation: str | None = _f(
        None, "Attention kernel (eager, sdpa, flash_attention_2); default: transformers' choice."
    )
    chat_template: str | None = _f(None, "Jinja chat template (text or a file path) for tokenizers without one.")


@dataclass
class DataArgs:
    """Where the examples come from and how they become token ids."""

    dataset: str = _f("", "Hub dataset id, or a local .json/.jsonl/.csv/.parquet/.txt file, glob or directory.")
    datasets: list[dict] | None = _f(
        None,
        "A weighted mixture instead of `dataset` (YAML list, or YAML text on the command line): each source a "
        "mapping of the per-source data fields (dataset, format, *_column, eval_dataset/eval_split/eval_fraction, "
        "...; left out: the top-level value) plus weight (> 0) and name (default: the file stem). Each epoch "
        "draws as many rows as all sources hold, weight / sum of weights of them from each source; eval is "
        "reported per source (eval_<name>_loss) and overall. See docs/data.md.",
    )
    dataset_config: str | None = _f(None, "Hub dataset configuration name.")
    train_split: str = _f("train", "Split used for training.")
    eval_dataset: str | None = _f(None, "Separate eval data (same forms as `dataset`).")
    eval_split: str | None = _f(None, "Split of `dataset` (or `eval_dataset`) used for eval.")
    eval_fraction: float = _f(
        0.05,
        "When no eval data/split is given: fraction of train held out for eval (deterministic from seed); 0 disables eval.",
    )
    eval_fraction_max_rows: int | None = _f(
        2000,
        "The most rows eval_fraction holds out: on a large set the eval stays cheap and the rest trains (a 0.05 fraction of up "
        "to 40,000 rows is under it); null: no cap. An eval_dataset or eval_split is evaluated whole.",
    )
    format: str = _f(
        "auto",
        f"Example format: one of {', '.join(FORMATS)}; auto picks it and its shape (messages, ShareGPT, TRL's "
        "prompt-completion, alpaca, ...) from the columns and says which.",
    )
    text_column: str = _f("text", "Column with raw text (text and classification formats).")
    text_pair_column: str | None = _f(None, "Optional second text column (classification of sentence pairs).")
    prompt_column: str = _f("prompt", "Instruction format: prompt column (alpaca's instruction/input also accepted).")
    prompt_template: str = _f(
        "### Instruction:\n{prompt}\n\n### Response:\n",
        "Instruction format: how a prompt is shown to the model; must contain {prompt}.",
    )
    response_column: str | None = _f(
        None,
        "The answer column: instruction format, its text (default: response, or TRL's completion; alpaca's output "
        "also accepted); chat format, with prompt_column, the completion's messages (TRL's conversational "
        "prompt-completion: only the completion is learned).",
    )
    messages_column: str | None = _f(
        None, "Chat format: the column of message lists (default: messages, or ShareGPT's conversations)."
    )
    role_key: str | None = _f(
        None, "Chat format: the message key holding the role (default: role, or ShareGPT's from)."
    )
    content_key: str | None = _f(
        None, "Chat format: the message key holding the text (default: content, or ShareGPT's value)."
    )
    role_map: dict | None = _f(
        None,
        "Chat format: the data's role names -> the chat template's (system, user, assistant, tool), e.g. "
        "{bot: assistant, narrator: system}; ShareGPT's human and gpt are read as user and assistant without it.",
    )
    tools_column: str | None = _f(
        "tools", "Chat format: the column of tool definitions handed to the chat template, when the data has it."
    )
    chosen_column: str = _f(
        "chosen", "Preference format: the preferred answer (text, or a message list: the conversation or its answer)."
    )
    rejected_column: str = _f("rejected", "Preference format: the dispreferred answer, in the same form as chosen.")
    source_column: str = _f("source", "source_target format (task seq2seq): column the encoder reads.")
    target_column: str = _f("target", "source_target format (task seq2seq): column the decoder learns to write.")
    label_column: str = _f(
        "label",
        "Classification format: label column: strings (ids in sorted order), int ids, or a datasets ClassLabel "
        "(its names); a base classifier naming the same labels keeps its ids (docs/data.md).",
    )
    max_seq_length: int = _f(
        512,
        "Tokens per example; longer examples are truncated, raw text is chunked to it. At most the model's "
        "max_position_embeddings (RoBERTa-family models: less pad_token_id + 1, e.g. 512 of 514).",
    )
    packing: bool = _f(
        False,
        "Pack several short examples into each row (causal LM), attention kept per example; refused for a model "
        "that would let them attend to each other (OPT, Falcon, Bloom, MPT, XGLM, BioGPT).",
    )
    length_aware_batching: bool = _f(
        False,
        "Split each global batch into micro batches of similar token cost (long examples in smaller micro "
        "batches, short ones in larger): less padding, and ranks wait less for each other. The examples of "
        "each optimizer step stay the same; per_device_train_batch_size becomes the average rows per micro batch.",
    )
    max_train_samples: int | None = _f(None, "Use only the first N training examples (debugging).")
    prepared_data: str | None = _f(
        None,
        "A directory written by `finetune prepare` (the data tokenized, filtered and packed once, ahead of the "
        "job): the run reads its rows instead of the raw data, after checking they were made with this run's data "
        "fields, seed and tokenizer. `finetune prepare` writes it.",
    )
    preprocessing_num_workers: int | None = _f(
        None,
        "Processes that tokenize (datasets.map num_proc); null: one per core (up to 8) on machines with 2 or more "
        "cores and sets of 50,000 rows or more, else one.",
    )
    streaming: bool = _f(
        False,
        "Read the training data as a stream (local files or a Hub dataset): rows are shuffled in a seeded buffer, "
        "tokenized and packed as training consumes them, so neither the disk nor the memory holds the whole set. "
        "Needs max_steps (the stream restarts, reshuffled, when it runs out); eval comes from eval_dataset, "
        "eval_split or the stream's first eval_fraction_max_rows rows. Not with epochs, datasets mixtures, "
        "length_aware_batching, classification or prepared_data (docs/data.md). Preference pairs: with orpo or "
        "simpo, or dpo/ipo with reference: live (docs/preference.md).",
    )
    shuffle_buffer_size: int = _f(
        10_000, "streaming: rows held in the shuffle buffer (larger: closer to a full shuffle, more memory)."
    )


# Data fields that do not change the rows the data becomes (how they are batched, or where they are read from). Every
# other data field shapes the rows: prepared data is refused when one differs (prepared.made_from), and so is a resume
# (checkpoint.FIXED_ON_RESUME), whose saved data position counts rows.
NOT_IN_ROWS = ("prepared_data", "preprocessing_num_workers", "length_aware_batching")
ROW_FIELDS = tuple(f.name for f in dataclasses.fields(DataArgs) if f.name not in NOT_IN_ROWS)


@dataclass
class TrainArgs:
    """The optimisation: schedule, batch sizes, logging, checkpoints."""

    output_dir: str = _f("outputs/run", "Where metrics.jsonl, checkpoints/ and final/ are written.")
    overwrite_output_dir: bool = _f(False, "Replace a previous run in output_dir (refused otherwise).")
    method: str = _f(
        "sft",
        f"One of {', '.join(METHODS)}. sft: supervised fine-tuning on text, instruction or chat data. dpo, ipo, "
        "orpo, simpo: preference tuning on {prompt, chosen, rejected} pairs (format preference; docs/preference.md); "
        "dpo and ipo compare with the starting model's log-probs (see reference).",
    )
    beta: float = _f(
        0.1, "Preference methods: dpo/ipo/simpo: the strength of the preference (dpo's beta, ipo's tau); orpo: lambda."
    )
    label_smoothing: float = _f(
        0.0, "dpo and simpo: the assumed rate of wrongly labelled pairs (robust DPO), in [0, 0.5)."
    )
    simpo_gamma: float = _f(0.5, "simpo: the target reward margin gamma.")
    reference: str = _f(
        "precomputed",
        "dpo/ipo: where the reference log-probs come from. precomputed: the starting model's, computed once before "
        "training by the prepared model and kept in output_dir/reference_logps.pt (training holds one model). live: "
        "one more forward per micro batch, without gradients: with a new adapter (peft.method lora or dora) the "
        "policy's own base model with the adapter disabled (no second copy; refused with peft.adapter, whose start "
        "is the base plus that adapter), without one a frozen copy of the starting model, sharded as the trained "
        "one (ZeRO-3, FSDP2); what streamed pairs need. docs/preference.md.",
    )
    max_steps: int = _f(-1, "Optimizer steps to run; -1 uses num_train_epochs.")
    num_train_epochs: float = _f(1.0, "Epochs to run when max_steps is -1.")
    per_device_train_batch_size: int = _f(8, "Micro batch per process.")
    per_device_eval_batch_size: int = _f(8, "Eval batch per process.")
    gradient_accumulation_steps: int = _f(1, "Micro batches per optimizer step on each process.")
    learning_rate: float = _f(5e-5, "Peak learning rate (AdamW).")
    weight_decay: float = _f(0.0, "AdamW weight decay (not applied to biases and norm weights).")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    lr_scheduler_type: str = _f("linear", f"One of {', '.join(SCHEDULERS)}.")
    warmup_steps: int = _f(0, "Linear warmup steps (wins over warmup_ratio when > 0).")
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total steps.")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this; 0 disables clipping.")
    logging_steps: int = _f(10, "Log a metrics.jsonl row every N optimizer steps.")
    eval_steps: int | None = _f(None, "Evaluate every N optimizer steps (always at the end when there is eval data).")
    eval_on_start: bool = _f(False, "Evaluate once before training (shows the starting point).")
    save_steps: int | None = _f(
        500,
        "Checkpoint every N optimizer steps and at the end. null: no checkpoints (only final/), but the one a stop "
        "signal asks for (preemption_signal, SIGTERM): a crashed run then starts again.",
    )
    save_total_limit: int | None = _f(None, "Keep only the newest N checkpoints.")
    metric_for_best_model: str | None = _f(
        None,
        "The eval metric that picks the best checkpoint (eval_loss, eval_perplexity, eval_accuracy, "
        "eval_<source>_loss ...; `loss` means eval_loss, as in transformers). Default with "
        "load_best_model_at_end: eval_loss.",
    )
    greater_is_better: bool | None = _f(
        None, "Whether a larger metric_for_best_model is better; default: false for loss and perplexity, else true."
    )
    load_best_model_at_end: bool = _f(
        False,
        "Export the best checkpoint's weights (by metric_for_best_model) to final/ instead of the last step's; "
        "needs eval_steps and save_steps a multiple of it. A new best is checkpointed when it is evaluated, "
        "and save_total_limit never prunes it.",
    )
    early_stopping_patience: int | None = _f(
        None,
        "Stop when metric_for_best_model has not improved (by more than early_stopping_threshold) for this many "
        "evaluations in a row; every rank stops at the same step, with a checkpoint.",
    )
    early_stopping_threshold: float = _f(
        0.0, "How much metric_for_best_model must improve on the best so far to reset early_stopping_patience."
    )
    seed: int = _f(
        42, "Seed for init, data order and dropout, 0 to 2**32 - 1; results do not depend on the world size."
    )
    resume_from_checkpoint: str | None = _f(
        None,
        "'latest', a checkpoint directory, or 'auto' (resume when output_dir has a checkpoint, else start fresh: "
        "for launchers that restart failed jobs).",
    )
    metrics: list[str] | None = _f(
        None,
        "Eval metrics: names shipped with finetune (accuracy, f1) or any evaluate.load name; default by task "
        "(classification: accuracy, f1). f1 with 2 classes: the F1 of the class with id 1 (id2label['1'] in "
        "final/config.json; sklearn's average='binary'); with 3 or more: the macro average over the classes.",
    )
    generation_max_new_tokens: int | None = _f(
        None,
        "Generation eval: at every eval, greedily generate up to this many tokens for eval prompts (an eval "
        "example without its answer) and score them against the answers with generation_metrics; null or 0: off.",
    )
    generation_num_examples: int | None = _f(
        64, "Generation eval: how many eval examples to generate for (the first N of the eval set); null: all."
    )
    generation_metrics: list[str] = _f(
        list(GENERATION_METRICS),
        f"Generation eval: metrics of the generated text against the answers ({', '.join(GENERATION_METRICS)}, "
        "shipped with finetune; or an evaluate module taking text predictions and references). Eval rows get "
        "eval_exact_match, eval_rougeL, eval_bleu, ...; a few samples go to metrics.jsonl.",
    )
    preemption_signal: str = _f(
        "SIGUSR1",
        "Besides SIGTERM, the signal that asks the run to stop for preemption (SLURM: --signal=USR1@300): every "
        "rank finishes the optimizer step in progress, a checkpoint is written, and the run exits; "
        "--resume_from_checkpoint auto continues from it.",
    )
    ddp_timeout: int | None = _f(
        None,
        "Seconds a collective of the training step may wait for the other ranks before the run fails (a stuck "
        "rank); default 600 on CPU, 1800 on GPU. Waits for one process's work on the host take host_wait_timeout.",
    )
    host_wait_timeout: int = _f(
        14400,
        "Seconds the ranks may wait for one process working alone on the host before the run fails: the first "
        "rank downloading the model or preparing (tokenizing) the data, the main process writing and checksumming "
        "a checkpoint, writing final/ or merging the adapter (hours for a large model or dataset). They wait on a "
        "gloo group of their own, not the device's collectives (ddp_timeout); a rank that dies is noticed at once.",
    )
    cpu_allocator: str = _f(
        "keep",
        "CPU runs on Linux (glibc): what happens to the large buffers a step frees. keep: kept for the next step "
        "(no mmap, no trim below 2 GB): no page faults to refill them, steps up to ~1.5x faster on small models, "
        "a somewhat higher resident peak; release: returned at once (mmap above 64 KB, trim at 0): the lowest "
        "resident peak (what `finetune plan` estimates), slower steps; system: glibc's own thresholds. MALLOC_* "
        "variables in the environment win over it. Ignored on GPUs.",
    )
    ddp_find_unused_parameters: bool = _f(
        False, "DDP: detect parameters that get no gradient (slower; needed by some models)."
    )
    sync_batchnorm: bool = _f(False, "DDP: convert BatchNorm layers to SyncBatchNorm.")
    dataloader_num_workers: int | None = _f(
        None,
        "Worker processes per data loader; default: 2 on a GPU (the next batches are collated while the GPU "
        "computes; batches are also put in pinned memory there), 0 on a CPU (the cores are busy training).",
    )
    report_to: list[str] = _f(
        [],
        "Trackers that get every metrics row and the run config, through accelerate: tensorboard (files in "
        "output_dir/runs), wandb, mlflow, trackio, comet_ml, aim, clearml, dvclive, swanlab, or all (every one "
        "installed); metrics.jsonl is always written, curves.png unless curves is false.",
    )
    curves: bool = _f(
        True,
        "Draw output_dir/curves.png (loss, eval metrics, learning rate, tokens/s) at evals, 30 s apart at most, and at "
        "the end. false: not drawn, about a second of CPU less per run (sweeps of many short runs); `finetune plot "
        "OUTPUT_DIR` draws it from metrics.jsonl at any time.",
    )
    run_name: str | None = _f(
        None, "Name of the run in the trackers, the model card and `finetune plot` (default: output_dir's name)."
    )
    tracker_project: str = _f(
        "finetune",
        "Project (wandb, trackio, comet_ml), experiment (mlflow) or run folder (tensorboard) the trackers log to.",
    )
    push_to_hub: bool = _f(
        False,
        "At the end, the main process uploads final/ (model or adapter, tokenizer, model card; merged/ too) to the "
        "Hugging Face Hub. Needs a token (`hf auth login` or HF_TOKEN; never saved or logged), checked before "
        "training starts.",
    )
    hub_model_id: str | None = _f(
        None, "Hub repository (namespace/name, or name under your account); default: output_dir's name."
    )
    hub_private_repo: bool | None = _f(
        None, "Create the Hub repository as private (default: the Hub's default, public)."
    )
    disable_tqdm: bool = _f(
        False,
        "No progress bars, training's or the libraries' (loading weights, mapping data): a log line every logging_steps instead.",
    )
    profile_steps: str | None = _f(
        None,
        "Profile optimizer steps FIRST-LAST (e.g. 5-7; or one step, 5) with torch's profiler on every rank: a "
        "Chrome trace, an operator table and a summary (device busy and idle, time by kind of work) per rank in "
        "output_dir/profile/, the main process's summary in the log. Skip the first steps (warm-up, compilation); "
        "profiled steps run slower. docs/performance.md.",
    )

    @property
    def rows_per_example(self) -> int:
        """Rows of the model's batch per example: a preference pair is two (its chosen and its rejected answer)."""
        return 1 if self.method == "sft" else 2

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """profile_steps as (first, last) optimizer step, 1-based; None when off or not of the shape FIRST-LAST."""
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", str(self.profile_steps or ""))
        if not m:
            return None
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        return (first, last) if 1 <= first <= last else None


PEFT_METHODS = ("none", "lora", "dora")


@dataclass
class PeftArgs:
    """Adapters (a `peft:` mapping in YAML; --peft.<field> on the command line). Off by default."""

    method: str = _f("none", f"One of {', '.join(PEFT_METHODS)}; none trains every weight.")
    r: int = _f(8, "Adapter rank.")
    alpha: float = _f(16.0, "Adapter scaling numerator (lora_alpha); the update is scaled by alpha / r.")
    dropout: float = _f(0.0, "Dropout on the adapter input.")
    target_modules: list[str] = _f(["all-linear"], "Module names to adapt, or [all-linear].")
    modules_to_save: list[str] | None = _f(
        None, "Modules trained in full and saved with the adapter; every newly initialised layer is added (a head)."
    )
    adapter: str | None = _f(None, "An existing adapter directory to continue training from.")
    merge: bool = _f(False, "Also write final/merged: the base model with the adapter merged in.")
    load_in_4bit: bool = _f(False, "QLoRA: load the base model in 4 bit (bitsandbytes; CUDA only).")


SECTIONS = {"model": ModelArgs, "data": DataArgs, "train": TrainArgs, "peft": PeftArgs}


NESTED = ("peft",)  # sections written as a mapping in YAML and as --<section>.<field> on the command line


# How to train again where a run finished already (Finished): what the run ending at once and `finetune check` say.
TRAIN_AGAIN = "Pick a new output_dir, or add --overwrite_output_dir true, to train again."


@dataclass(frozen=True)
class Finished:
    """A finished run in output_dir (preflight.finished_run): its final/, last step, and how its run config differs
    from this one's (config_differences)."""

    final: str
    step: int | None
    differences: list[tuple[str, object, object]]

    def message(self, output_dir: str) -> str:
        """What the run says as it ends at once (cli)."""
        return f"finetune: {self._state(output_dir)}; nothing left to run. {TRAIN_AGAIN}"

    def launch_note(self, output_dir: str) -> str:
        """What `finetune check` says of it: the launch it checks would not train (its own exit 0 is no sign of that)."""
        return (
            f"{self._state(output_dir)}: launched with --resume_from_checkpoint auto, the run ends at once (exit 0) "
            f"without training. {TRAIN_AGAIN}"
        )

    def _state(self, output_dir: str) -> str:
        step = f", step {self.step}" if self.step is not None else ""
        return f"the run in {output_dir} finished already ({self.final} complete{step})"


@dataclass
class RunConfig:
    """The whole run config: one section per builder. Flat in YAML and on the command line."""

    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    peft: PeftArgs = field(default_factory=PeftArgs)
    # Not a setting but a fact of the disk that parsing found (build_config, with the filesystem checked): the run in
    # output_dir finished already. Read once there, since it reads final/ and all of metrics.jsonl; the output_dir
    # check and the start (cli: nothing left to run) both ask it. None otherwise; never compared.
    finished: Finished | None = field(default=None, compare=False)

    def to_flat(self) -> dict[str, Any]:
        """The effective config as the YAML a user would write (what is saved next to every export)."""
        flat: dict[str, Any] = {}
        for name in SECTIONS:
            values = dataclasses.asdict(getattr(self, name))
            if name in NESTED:
                flat[name] = values
            else:
                flat.update(values)
        return flat


def changed_fields(section: Any) -> list[str]:
    """The fields of a section (ModelArgs, ..., PeftArgs) whose value is not the default: what the user set, whether
    or not the YAML also holds the defaults (a saved run_config.yaml writes every field)."""
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(type(section)(), f.name)]


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved, now) for every value of the run config `now` (to_flat) that differs from `saved` (a run_config.yaml
    as written), by dotted key (peft.method), the names the command line uses; NOT_COMPARED and the keys `saved` does
    not hold (written before they existed) are left out."""
    was, now = dotted(saved), dotted(now)
    return [(k, was[k], v) for k, v in now.items() if k not in NOT_COMPARED and k in was and was[k] != v]


def dotted(flat: dict[str, Any]) -> dict[str, Any]:
    """The run config's sections (peft: {...}) as dotted keys (peft.method)."""
    out = {}
    for k, v in flat.items():
        if k in NESTED and isinstance(v, dict):  # not a mapping field's value (role_map): that is one value
            out.update({f"{k}.{sub}": x for sub, x in v.items()})
        else:
            out[k] = v
    return out


def all_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """field name -> (section, dataclasses.Field), for every run-config field."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            name = f"{section}.{f.name}" if section in NESTED else f.name
            assert name not in out, f"duplicate field {name}"
            out[name] = (section, f)
    return out


def field_type(section: str, name: str) -> tuple[type, bool, type | None]:
    """(base type, optional?, list item type) of a field, from its annotation."""
    hint = typing.get_type_hints(SECTIONS[section])[name.removeprefix(f"{section}.")]
    optional = False
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        optional = type(None) in args
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is list:
        return list, optional, typing.get_args(hint)[0]
    if typing.get_origin(hint) is dict:
        return dict, optional, None
    return hint, optional, None


def coerce(section: str, name: str, value: Any) -> tuple[Any, str | None]:
    """Check `value` against the field's type. Returns (value, error message or None)."""
    base, optional, item = field_type(section, name)
    if value is None:
        return (None, None) if optional else (value, f"must not be empty (expected {base.__name__})")
    if base is bool:
        if isinstance(value, bool):
            return value, None
        return value, f"expected true or false, got {value!r}"
    if base in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-3 (no dot) as a string; users write it anyway
            value = float(value)
        except ValueError:
            pass
    if base in (int, float) and isinstance(value, float) and not math.isfinite(value):
        # .inf, nan, 1e400: no count, rate or size is infinite (int() of one raises; a float one crashes later)
        return value, f"must be a finite number, got {value!r}"
    if base is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            if name.endswith("_steps") and isinstance(value, float) and 0 < value < 1:  # transformers' ratio form
                return value, f"expected a number of steps, got {value!r} (a fraction of the run is not taken here)"
            return value, f"expected an integer, got {value!r}"
        return int(value), None
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, f"expected a number, got {value!r}"
        return float(value), None
    if base is list:
        if isinstance(value, str) and value.strip().startswith("["):  # --metrics [accuracy, f1]: YAML's flow list
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                return value, f"expected a list like [a, b] or a,b; got {value!r}: close the bracket"
        elif isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            return value, f"expected a list of {item.__name__}, got {value!r}"
        return value, None
    if base is dict:
        if isinstance(value, str) and value.strip().startswith("{"):  # --role_map "{bot: assistant}"
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                return value, f"expected a mapping like {{a: b}}; got {value!r}: close the brace"
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return value, f"expected a mapping of names to names like {{bot: assistant}}, got {value!r}"
        return value, None
    if base is str:
        if isinstance(value, bool):  # YAML's true/false for a switch that also takes auto
            return ("true" if value else "false"), None
        if isinstance(value, (int, float)):
            return str(value), None
        if not isinstance(value, str):
            return value, f"expected a string, got {value!r}"
        return value, None
    raise AssertionError(f"unhandled type {base} for {name}")


HUB_REPO_ID = r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*"


def hub_repo_id(train: TrainArgs) -> str:
    """hub_model_id, or output_dir's name (as transformers' Trainer does)."""
    return train.hub_model_id or Path(os.path.abspath(train.output_dir)).name


def choice(problems: list, key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append((key, f"{value!r} is not one of {', '.join(choices)}{hint}"))
