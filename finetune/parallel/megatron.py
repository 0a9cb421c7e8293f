"""Megatron-LM tensor/pipeline parallelism through accelerate (NVIDIA GPUs; docs/megatron.md).

  accelerate_configs/megatron_tp2.yaml       TP 2
  accelerate_configs/megatron_tp2_pp2.yaml   TP 2 x PP 2 (4 micro batches per step)

Megatron-LM semantics, and where finetune meets them (accelerate.utils.megatron_lm, accelerate's
examples/by_feature/megatron_lm_gpt_pretraining.py):
- accelerate builds Megatron's own model from the HF model's config; the weights come from the HF model
  converted to Megatron's layout at start (`ensure_converted`, or the user's `<model>/megatron`), which Megatron
  loads as its `pretrained_checkpoint`, so the HF model is built on the meta device (Backend.needs_hf_weights).
- Where the step runs: `model(**batch)` in train mode, i.e. Backend.forward_loss, is the whole optimizer step over
  `num_micro_batches` micro batches: forward, backward, clipping, optimizer and scheduler step. The rest of the
  loop's step (loop.train_step) does nothing here: `accelerator.backward` returns at once (accelerate's
  MEGATRON_LM branch), Backend.clip_grad_norm hands back the norm Megatron computed, and the prepared optimizer
  and scheduler are an OptimizerStepRunsInForward and a SchedulerStepRunsInForward, whose step() and zero_grad()
  do nothing (accelerate's Megatron wrappers, named for what they are).
- The scheduler is Megatron's (the dummy scheduler's lengths, the plugin's lr_decay_style); the optimizer we
  pass only lends its class and hyperparameters. One prepare call (a second initialises Megatron again).
- gradient_accumulation_steps must be 1: micro batches belong to the pipeline. The global batch is the
  plugin's: data parallel size x micro batch x num_micro_batches (Topology.rows_per_micro_batch).
- The loss is the mean over the global batch's supervised tokens (gpt_loss), on the last pipeline stage only;
  the main process is the last rank (accelerate's PartialState). Eval statistics come from the same loss
  function's [sum, count] report, never from logits (only the last stage has any).
- Checkpoints go through save_state/load_state (Megatron's own format); export joins the TP/PP shards under
  HF names (`megatron_to_hf`).

`problems` runs before Accelerator() and before any model loads; it refuses what cannot work here (no CUDA,
no Megatron-LM, a model type accelerate cannot map, ...) with one ConfigError naming each fix.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from finetune.config import RunConfig
from finetune.config.rules import effective_metric
from finetune.model import model_config
from finetune.parallel import base, ddp
from finetune.parallel.topology import Launcher

# A Megatron-LM checkpoint the user converted from the HF model, used when present (<model>/megatron), and the
# folder of finetune's own conversion in output_dir otherwise.
CONVERTED_DIR = "megatron"
# accelerate's Megatron model families finetune trains (as causal LMs, through GPTTrainStep with gpt_batch and
# gpt_loss; megatron-bert's BertTrainStep and t5's T5TrainStep have no finetune loss/eval wiring) and exports.
CAUSAL_LM_FAMILIES = ("gpt2", "llama")
MEGATRON_LR_STYLES = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
}
DOCS = "docs/megatron.md"
# What Megatron-LM's eval reports (Backend.eval_stats: the batch's summed NLL and supervised-token count): no
# per-source values (Backend.gather_for_metrics), no metric that needs logits.
MEGATRON_EVAL_KEYS = ("eval_loss", "eval_perplexity")
NOTES: list[str] = []  # what this module did before the Accelerator, for the start log (Backend.observed)
KEY = "accelerate config"  # the problem is in the Accelerate config (or this machine), not in the run config
logger = logging.getLogger("finetune")


# ---------------------------------------------------------------- what the launcher asked for


@dataclass(frozen=True)
class MegatronLayout:
    """The Megatron-LM layout the launcher set (accelerate/utils/launch.py, prefix MEGATRON_LM_; topology.Launcher
    reads it)."""

    tp: int
    pp: int
    num_micro_batches: int
    sequence_parallel: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> MegatronLayout:
        return cls.of(Launcher.read(env))

    @classmethod
    def of(cls, launcher: Launcher) -> MegatronLayout:
        return cls(
            tp=launcher.megatron_tp,
            pp=launcher.megatron_pp,
            num_micro_batches=launcher.megatron_micro_batches,
            sequence_parallel=launcher.megatron_sequence_parallel,
        )


# ---------------------------------------------------------------- checks before anything starts


def megatron_family(model_type: str) -> str | None:
    """The accelerate Megatron model family of a HF model_type: the model type itself when accelerate has a parser
    registered under exactly that name, else None. Not accelerate's own rule (MegatronLMPlugin.set_network_size_args
    takes the first registered name contained in the model type), which hands llama4_text or mllama, whose
    architectures are not Llama's, to the llama parser: their weights then fail to convert, or convert wrong."""
    from accelerate.utils.dataclasses import MODEL_CONFIGS_TO_MEGATRON_PARSERS

    return model_type if model_type in MODEL_CONFIGS_TO_MEGATRON_PARSERS else None


def supported_model_types() -> list[str]:
    from accelerate.utils.dataclasses import MODEL_CONFIGS_TO_MEGATRON_PARSERS

    return list(MODEL_CONFIGS_TO_MEGATRON_PARSERS)


def megatron_lm_missing() -> str | None:
    """Why accelerate cannot use Megatron-LM here, or None when it can. Mirrors accelerate's
    is_megatron_lm_available (megatron-core >= 0.8 and megatron.training) plus megatron.legacy, which
    accelerate.utils.megatron_lm also imports. Nothing is imported but the `megatron` package itself."""
    if importlib.util.find_spec("megatron") is None:
        return "no `megatron` package is installed"
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "`megatron` is importable but megatron-core is not installed"
    from packaging.version import Version

    if Version(version) < Version("0.8.0"):
        return f"megatron-core {version} is older than 0.8.0, the oldest accelerate supports"
    missing = []
    for module in ("megatron.training", "megatron.legacy", "megatron.training.gpt_builders"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    if missing:
        return (
            f"megatron-core {version} is installed but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not (they come from the Megatron-LM source tree, "
            "not from the megatron-core wheel)"
        )
    return None


def converted_checkpoint(model: str) -> str:
    """Where a Megatron-LM checkpoint the user converted from `model` is used from (docs/megatron.md)."""
    return os.path.join(os.path.expanduser(model), CONVERTED_DIR)


def pretrained_checkpoint(cfg: RunConfig, layout: MegatronLayout) -> str:
    """The checkpoint Megatron starts from: the user's `<model>/megatron` if there is one, else finetune's own
    conversion of the HF weights in the run's output_dir (`ensure_converted`)."""
    mine = converted_checkpoint(cfg.model.model)
    if os.path.isdir(mine):
        return mine
    return os.path.join(cfg.train.output_dir, CONVERTED_DIR, f"tp{layout.tp}_pp{layout.pp}")


def ensure_converted(cfg: RunConfig, layout: MegatronLayout) -> str:
    """The HF weights converted to Megatron's layout for this TP x PP (`write_converted`), once per run: every
    rank calls it before the process group exists, the first one to take the lock converts, the others find it
    done. A conversion of other weights (the source's files changed) is replaced."""
    import fcntl
    import json
    import shutil

    from finetune.model import model_config

    out = pretrained_checkpoint(cfg, layout)
    source = local_model_dir(cfg.model.model)
    stamp = json.dumps({"source": source, "te": uses_transformer_engine(), "files": _file_stamps(source)})
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = os.path.join(out, "converted_from.json")
        if os.path.isfile(done):
            with open(done) as f:
                if f.read() == stamp:
                    return out
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_converted(source, tmp, model_config(cfg.model), layout.tp, layout.pp, uses_transformer_engine())
        with open(os.path.join(tmp, "converted_from.json"), "w") as f:
            f.write(stamp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        # said by the rank that converted, whichever it is (the screen is the main process's: the last rank)
        note = f"megatron: converted {source} to Megatron-LM's layout (TP {layout.tp} x PP {layout.pp}) in {out}"
        logger.info(note, extra={"every_rank": True})
    return out


def local_model_dir(model: str) -> str:
    """A local directory holding the model's files (a Hub id: its snapshot in the Hub cache)."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(model, allow_patterns=["*.json", "*.safetensors"])


def _file_stamps(directory: str) -> list:
    names = sorted(n for n in os.listdir(directory) if n.endswith((".safetensors", ".json")))
    return [
        (n, os.path.getsize(os.path.join(directory, n)), os.path.getmtime(os.path.join(directory, n))) for n in names
    ]


def checkpoint_layout(path: str) -> tuple[int, int] | None:
    """(tp, pp) of a legacy Megatron checkpoint (mp_rank_TT[_PPP] directories), or None when the layout is
    not fixed in the files (torch_dist checkpoints load under any TP/PP) or cannot be told."""
    try:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt")) as f:
            tag = f.read().strip()
    except OSError:
        return None
    step_dir = os.path.join(path, tag if tag == "release" else f"iter_{int(tag):07d}")
    if not os.path.isdir(step_dir) or os.path.exists(os.path.join(step_dir, ".metadata")):
        return None
    ranks = [re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?", n) for n in os.listdir(step_dir)]
    ranks = [m for m in ranks if m]
    if not ranks:
        return None
    tp = 1 + max(int(m.group(1)) for m in ranks)
    pp = 1 + max(int(m.group(2) or 0) for m in ranks)
    return tp, pp


def _heads_layers(config) -> tuple[int | None, int | None, int | None]:
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv = getattr(config, "num_key_value_heads", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    return heads, kv, layers


def megatron_problems(cfg: RunConfig, env: Mapping[str, str] = os.environ, here: bool = True) -> list:
    """Everything that keeps this run from starting under Megatron-LM, as (key, message with the fix); without here,
    not what this machine lacks (GPUs, Megatron-LM, the converted weights): finetune plan, for other machines."""
    p: list[tuple[str, str]] = []
    launcher = Launcher.read(env)
    layout = MegatronLayout.of(launcher)
    if here:
        _environment_problems(p)
    _setting_problems(p, cfg, layout)
    _unsupported_problems(p, cfg)
    _model_option_problems(p, cfg)
    _eval_problems(p, cfg)
    _layout_problems(p, cfg, layout, launcher)
    config = model_config(cfg.model)
    if config is None:
        return p
    _model_problems(p, cfg, config, layout, launcher)
    if here:
        _converted_problems(p, cfg, layout)
    return p


def _environment_problems(p: list) -> None:
    """GPUs and the Megatron-LM source tree."""
    import torch

    if not torch.cuda.is_available():
        p.append(
            (
                KEY,
                "Megatron-LM (distributed_type: MEGATRON_LM) needs NVIDIA GPUs and CUDA, and this machine has "
                "none: run it on a GPU machine (see docs/megatron.md), or use a config that runs here "
                "(accelerate_configs/tp2.yaml for tensor parallelism, ddp.yaml, zero2.yaml)",
            )
        )
    missing = megatron_lm_missing()
    if missing:
        p.append(
            (
                KEY,
                f"Megatron-LM is not installed ({missing}). accelerate imports megatron.training and "
                "megatron.legacy from the Megatron-LM source tree: on the GPU machine, `git clone "
                "https://github.com/NVIDIA/Megatron-LM` and `pip install --no-build-isolation -e Megatron-LM` "
                f"(see {DOCS})",
            )
        )


def _setting_problems(p: list, cfg: RunConfig, layout: MegatronLayout) -> None:
    """The batch settings Megatron-LM through accelerate needs."""
    t = cfg.train
    if t.gradient_accumulation_steps != 1:
        p.append(
            (
                "gradient_accumulation_steps",
                f"must be 1 under Megatron-LM, got {t.gradient_accumulation_steps}: micro batches belong to the "
                "pipeline. Set gradient_accumulation_steps: 1 and megatron_lm_num_micro_batches: "
                f"{layout.num_micro_batches * t.gradient_accumulation_steps} in the Accelerate config "
                "(same global batch)",
            )
        )
    if t.per_device_eval_batch_size != t.per_device_train_batch_size:
        p.append(
            (
                "per_device_eval_batch_size",
                f"must equal per_device_train_batch_size ({t.per_device_train_batch_size}) under Megatron-LM, got "
                f"{t.per_device_eval_batch_size}: accelerate makes the smaller of the two loaders' batch sizes "
                "Megatron's micro batch, for training too",
            )
        )


def _model_option_problems(p: list, cfg: RunConfig) -> None:
    """How finetune runs a transformers model, which Megatron-LM replaces by its own GPT."""
    if cfg.model.chunked_loss == "true":  # Megatron's GPT computes its own, vocabulary-parallel, cross-entropy
        p.append(("chunked_loss", "is true, but Megatron-LM computes its own loss; set chunked_loss: auto or false"))
    if cfg.model.torch_compile:
        p.append(
            (
                "torch_compile",
                "is true, but Megatron-LM runs its own GPT (fused kernels of its own), not the transformers model "
                "finetune would compile; set torch_compile: false",
            )
        )


def _unsupported_problems(p: list, cfg: RunConfig) -> None:
    """Features of finetune that do not run under Megatron-LM."""
    if cfg.peft.method != "none":
        p.append(
            (
                "peft.method",
                f"{cfg.peft.method} adapters do not work under Megatron-LM (it builds its own model from the "
                "converted checkpoint); set peft.method: none, or use a DDP/DeepSpeed config for adapters",
            )
        )
    if cfg.train.generation_max_new_tokens:
        p.append(
            (
                "generation_max_new_tokens",
                "generation eval does not run under Megatron-LM (the model is Megatron's GPT, which has no "
                "transformers generate); drop generation_max_new_tokens, or use a DDP/DeepSpeed/FSDP2 config",
            )
        )
    if cfg.train.method != "sft":
        p.append(
            (
                "method",
                f"{cfg.train.method} is not supported under Megatron-LM (its step computes the SFT loss inside "
                "Megatron's GPT); use a DDP/DeepSpeed/FSDP2 config for preference tuning",
            )
        )
    if cfg.data.streaming:
        p.append(
            (
                "streaming",
                "is not supported under Megatron-LM (accelerate builds Megatron's own data loaders from sized "
                "datasets); set streaming: false, or use a DDP/DeepSpeed/FSDP2 config",
            )
        )
    if cfg.data.packing:
        p.append(
            (
                "packing",
                "is not supported under Megatron-LM (its GPT step attends across packed examples); set packing: false",
            )
        )
    if cfg.train.load_best_model_at_end:
        p.append(
            (
                "load_best_model_at_end",
                "is not supported under Megatron-LM (its checkpoints are in Megatron's own format, with no full "
                "weights to export the best one from); set load_best_model_at_end: false (early stopping works), "
                "or use a DDP/DeepSpeed/FSDP config",
            )
        )
    if cfg.data.length_aware_batching:
        p.append(
            (
                "length_aware_batching",
                "is not supported under Megatron-LM (accelerate rebuilds the train loader with a fixed batch "
                "size); set length_aware_batching: false",
            )
        )


def _eval_problems(p: list, cfg: RunConfig) -> None:
    """What the eval under Megatron-LM cannot report (MEGATRON_EVAL_KEYS)."""
    metric = effective_metric(cfg.train)
    if metric is not None and metric not in MEGATRON_EVAL_KEYS:
        p.append(
            (
                "metric_for_best_model",
                f"is {cfg.train.metric_for_best_model!r}, but Megatron-LM's eval reports only "
                f"{' and '.join(MEGATRON_EVAL_KEYS)}, over all eval rows (its eval statistics are sums over each "
                "batch: no per-source values, no metrics from logits); set metric_for_best_model: eval_loss, or use "
                "a DDP/DeepSpeed/FSDP2 config",
            )
        )


def _layout_problems(p: list, cfg: RunConfig, layout: MegatronLayout, launcher: Launcher) -> None:
    n = launcher.world_size
    if n % (layout.tp * layout.pp):
        p.append(
            (
                KEY,
                f"{n} processes cannot be split into tensor parallel {layout.tp} x pipeline parallel {layout.pp} "
                f"groups; make num_processes a multiple of {layout.tp * layout.pp}",
            )
        )
    if layout.sequence_parallel and cfg.data.max_seq_length % layout.tp:
        p.append(
            (
                "max_seq_length",
                f"must be a multiple of megatron_lm_tp_degree {layout.tp} with sequence parallelism, got "
                f"{cfg.data.max_seq_length}",
            )
        )


def _model_problems(p: list, cfg: RunConfig, config, layout: MegatronLayout, launcher: Launcher) -> None:
    """The model: a type accelerate's Megatron integration builds, as a causal LM, split evenly by TP and PP."""
    model_type = getattr(config, "model_type", "") or ""
    family = megatron_family(model_type)
    if family is None:
        p.append(
            (
                "model",
                f"model type {model_type!r} is not one accelerate's Megatron-LM integration can build (it knows "
                f"{', '.join(supported_model_types())}: accelerate.utils.dataclasses.MODEL_CONFIGS_TO_MEGATRON_PARSERS); "
                "train this model with accelerate_configs/tp2.yaml, ddp.yaml or a zero*.yaml config instead",
            )
        )
        return
    if cfg.model.task != "causal_lm" or family not in CAUSAL_LM_FAMILIES:
        p.append(
            (
                "task",
                f"finetune trains causal LMs ({', '.join(CAUSAL_LM_FAMILIES)}) under Megatron-LM, not "
                f"{cfg.model.task} with a {model_type!r} model; use task: causal_lm with one of those, or a "
                "DDP/DeepSpeed/FSDP2 config",
            )
        )
    if family == "llama":
        p += llama_problems(config)
    heads, _, layers = _heads_layers(config)
    if heads and heads % layout.tp:
        p.append((KEY, f"megatron_lm_tp_degree {layout.tp} must divide the model's {heads} attention heads"))
    if layers and layers % layout.pp and not launcher.megatron_uneven_last_stage:
        p.append(
            (
                KEY,
                f"megatron_lm_pp_degree {layout.pp} must divide the model's {layers} layers (or set "
                "megatron_lm_decoder_last_pipeline_num_layers)",
            )
        )
    heads, kv, _ = _heads_layers(config)
    if kv and kv % layout.tp:
        p.append((KEY, f"megatron_lm_tp_degree {layout.tp} must divide the model's {kv} key/value heads"))


def rope_parameters(config) -> dict:
    """A Llama config's RoPE parameters (transformers 5: rope_parameters; before: rope_scaling), with its rope_type
    ("default" where it names none)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def llama_problems(config) -> list[tuple[str, str]]:
    """What of a Llama's architecture the Megatron-LM model finetune builds (`architecture_args`) and the weights it
    converts (`hf_to_megatron`) leave out: it would train another model, and say nothing."""
    p = []
    other = "train this model with accelerate_configs/tp2.yaml, ddp.yaml or a zero*.yaml config instead"
    biases = [k for k in ("attention_bias", "mlp_bias") if getattr(config, k, False)]
    if biases:
        p.append(
            (
                "model",
                f"the model's config has {' and '.join(f'{k}: true' for k in biases)}, and finetune builds Megatron-LM's "
                f"Llama without biases (add_bias_linear false; the conversion maps no bias tensor); {other}",
            )
        )
    rope = rope_parameters(config)
    kind = rope["rope_type"]
    if kind == "llama3":
        differ = {k: rope.get(k) for k, v in MEGATRON_LLAMA3_ROPE.items() if rope.get(k) != v}
        if differ:
            p.append(
                (
                    "model",
                    f"the model's llama3 RoPE scaling has {', '.join(f'{k} {v}' for k, v in differ.items())}, and the "
                    "Megatron-LM finetune runs applies llama3 scaling with "
                    f"{', '.join(f'{k} {v:g}' for k, v in MEGATRON_LLAMA3_ROPE.items())} only (gpt_builders passes no "
                    f"factor; RotaryEmbedding._apply_scaling's defaults); {other}",
                )
            )
    elif kind != "default":
        p.append(
            (
                "model",
                f"the model's RoPE scaling is rope_type {kind!r}, and finetune runs Megatron-LM with plain RoPE or "
                f"Llama 3's llama3 scaling only; {other}",
            )
        )
    return p


def _converted_problems(p: list, cfg: RunConfig, layout: MegatronLayout) -> None:
    """The converted Megatron-LM checkpoint of the model, when one exists already: complete, for this layout."""
    converted = converted_checkpoint(cfg.model.model)
    if not os.path.isdir(converted):  # finetune converts the HF weights at start (ensure_converted)
        local = os.path.expanduser(cfg.model.model)
        has = ("model.safetensors", "model.safetensors.index.json")
        if os.path.isdir(local) and not any(os.path.isfile(os.path.join(local, n)) for n in has):
            p.append(
                (
                    "model",
                    f"{local} holds no model.safetensors (or its index): finetune converts the HF weights to "
                    "Megatron's layout from safetensors files; save the model with safe_serialization=True, or "
                    f"convert it yourself into {converted} (see {DOCS})",
                )
            )
    elif not os.path.isfile(os.path.join(converted, "latest_checkpointed_iteration.txt")):
        p.append(
            (
                "model",
                f"{converted} holds no Megatron-LM checkpoint (no latest_checkpointed_iteration.txt): finish the "
                f"conversion into it, or remove it and finetune converts the HF weights itself (see {DOCS})",
            )
        )
    else:
        saved = checkpoint_layout(converted)
        if saved and saved != (layout.tp, layout.pp):
            p.append(
                (
                    "model",
                    f"the converted checkpoint {converted} is for TP {saved[0]} x PP {saved[1]} but the Accelerate "
                    f"config asks for TP {layout.tp} x PP {layout.pp}; convert again with --target-tensor-parallel-size "
                    f"{layout.tp} --target-pipeline-parallel-size {layout.pp} (or save in torch_dist format), or "
                    "remove it and finetune converts the HF weights itself",
                )
            )


# ---------------------------------------------------------------- the MegatronLMPlugin finetune builds


def plugin_kwargs(cfg: RunConfig, env: Mapping[str, str] = os.environ, config=None) -> dict[str, Any]:
    """MegatronLMPlugin keyword arguments: the layout from the Accelerate config (the environment the launcher
    set) and everything the run config owns (clipping, sequence length, schedule shape, seed, checkpoint).

    The sequence length is fixed to max_seq_length (pipeline stages exchange tensors of one shape); which
    plugin field carries it depends on the model family, because accelerate's parsers read different ones
    (the gpt2 parser replaces `seq_length` by `decoder_seq_length`). accelerate's parsers set only the sizes
    (layers, hidden, heads, vocabulary, positions): the rest of a Llama's architecture goes in other_megatron_args
    (`architecture_args`), and the plugin's defaults that would change the run are overridden: context
    parallel 2, full recomputation, rotary positions for gpt2.
    """
    layout = MegatronLayout.from_env(env)
    config = config if config is not None else model_config(cfg.model)
    family = megatron_family(getattr(config, "model_type", "") or "") if config is not None else None
    seq = cfg.data.max_seq_length
    lengths = {"gpt2": {"decoder_seq_length": seq}, "megatron-bert": {"encoder_seq_length": seq}}.get(
        family, {"seq_length": seq}
    )
    other: dict[str, Any] = {
        "seed": cfg.train.seed,
        "pretrained_checkpoint": pretrained_checkpoint(cfg, layout),
        # other_megatron_args is applied last: no activation recomputation unless gradient_checkpointing
        "recompute_granularity": "full" if cfg.model.gradient_checkpointing else None,
        # Megatron pads the vocabulary to a multiple of this x TP, and the padded logits enter the softmax: with
        # 1 the padded vocabulary is the real one whenever TP divides it (the loss is the HF model's loss)
        "make_vocab_size_divisible_by": 1,
        # finetune owns the schedule (a resume may change max_steps, the learning rate or the warmup: checkpoint.py
        # SCHEDULE_KEYS): Megatron's scheduler takes this run's values, not the checkpoint's (where they differ it
        # would assert otherwise), and its position (num_steps) from the checkpoint
        "override_opt_param_scheduler": True,
        **architecture_args(config, family),
        **(te_spec_args() if uses_transformer_engine() else LOCAL_SPEC_ARGS),
    }
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int):
        other["eos_token_id"] = eos  # accelerate's GPTTrainStep reads args.eos_token_id
    kwargs: dict[str, Any] = {
        "tp_degree": layout.tp,
        "pp_degree": layout.pp,
        "num_micro_batches": layout.num_micro_batches,
        "sequence_parallelism": layout.sequence_parallel,
        "context_parallel_size": 1,  # accelerate's default is 2 (no finetune config asks for context parallelism)
        "gradient_clipping": cfg.train.max_grad_norm or 0.0,  # None would mean 1.0 to accelerate
        "use_rotary_position_embeddings": family != "gpt2",
        "lr_decay_style": MEGATRON_LR_STYLES[cfg.train.lr_scheduler_type],
        "min_lr": 0.0,
        "other_megatron_args": other,
        **lengths,
    }
    if family in CAUSAL_LM_FAMILIES:
        kwargs["custom_get_batch_function"] = gpt_batch
        kwargs["custom_loss_function"] = gpt_loss
    return kwargs


# Llama 3's RoPE scaling as Megatron-LM applies it at the pinned commit: RotaryEmbedding._apply_scaling's defaults
# (core/models/common/embeddings/rotary_pos_embedding.py), which gpt_builders.py leaves as they are (it passes
# rope_scaling alone, no factor): Llama 3.1's values. Other values are refused (llama_problems).
MEGATRON_LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def architecture_args(config, family: str | None) -> dict[str, Any]:
    """Megatron arguments for the parts of a Llama-family architecture accelerate's parser leaves out (GQA,
    SwiGLU, RMSNorm, no biases, untied output, RoPE base and Llama 3's RoPE scaling, head size); Megatron's
    defaults fit GPT-2. What they cannot express is refused before the run (llama_problems)."""
    if family != "llama" or config is None:
        return {}
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    rope = rope_parameters(config)
    scaling = (
        {"use_rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
        if rope["rope_type"] == "llama3"
        else {}
    )
    return {
        "group_query_attention": kv != heads,
        "num_query_groups": kv,
        "ffn_hidden_size": config.intermediate_size,
        "swiglu": True,
        "normalization": "RMSNorm",
        "norm_epsilon": config.rms_norm_eps,
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not getattr(config, "tie_word_embeddings", False),
        "rotary_base": int(getattr(config, "rope_theta", None) or rope.get("rope_theta", 1e4)),
        **scaling,
        "kv_channels": getattr(config, "head_dim", None) or config.hidden_size // heads,
    }


# Megatron's local layer spec (no Transformer Engine): torch norms and linear layers, none of the fused kernels
# that need Transformer Engine or Apex (transformer_config.py:1294, torch_norm.py:30).
LOCAL_SPEC_ARGS = {
    "transformer_impl": "local",
    "no_persist_layer_norm": True,
    "masked_softmax_fusion": False,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
}


def te_spec_args() -> dict:
    """With Transformer Engine's layers: Megatron fuses the weight gradient's accumulation by default, and its output
    layer (its own ColumnParallelLinear under either spec) then needs Apex's fused_weight_gradient_mlp_cuda and raises
    when the model is built where only Transformer Engine is installed (layers.py:44, 916): off without Apex."""
    return {"gradient_accumulation_fusion": importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None}


def uses_transformer_engine() -> bool:
    """Megatron's default layer spec is Transformer Engine's; without it installed, the local spec."""
    return importlib.util.find_spec("transformer_engine") is not None


def numpy_product_for_megatron() -> None:
    """Workaround: Megatron-LM at the pinned commit calls np.product, which numpy 2.0 removed, when it saves or
    checks a torch_dist checkpoint (dist_checkpointing exchange_utils.py:66, validation.py:522, mapping.py:219;
    seen with data parallelism > 1). Give numpy the old name back (np.prod) for this process.
    tests/test_megatron_cpu.py::test_megatron_still_calls_np_product fails once Megatron no longer does."""
    import numpy as np

    if "product" not in np.__dict__:
        np.product = np.prod


def environment(cfg: RunConfig) -> None:
    """Before CUDA initialises: with TP > 1 Megatron (on GPUs before Blackwell) requires one hardware queue per
    device, so that its tensor-parallel communication and compute are issued in order (arguments.py ~959)."""
    ddp.environment(cfg)
    numpy_product_for_megatron()
    if MegatronLayout.from_env().tp > 1 and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        NOTES.append("CUDA_DEVICE_MAX_CONNECTIONS=1 (tensor parallelism: Megatron-LM requires it)")


def problems(cfg: RunConfig, env: Mapping[str, str] = os.environ, here: bool = True) -> list[tuple[str, str]]:
    return megatron_problems(cfg, env, here)


def accelerator_kwargs(cfg: RunConfig) -> dict:
    """The MegatronLMPlugin: the layout from the Accelerate config plus what the run config owns. The HF weights
    are converted to Megatron's layout first, unless the model directory holds a converted checkpoint."""
    from accelerate.utils import MegatronLMPlugin

    layout = MegatronLayout.from_env()
    if not os.path.isdir(converted_checkpoint(cfg.model.model)):
        ensure_converted(cfg, layout)
    vocab = getattr(model_config(cfg.model), "vocab_size", None)
    if vocab and vocab % layout.tp:
        NOTES.append(
            f"the vocabulary ({vocab}) is not a multiple of TP {layout.tp}: Megatron pads it to "
            f"{padded_vocab(vocab, layout.tp)} and the padded logits (zero weights) enter the softmax, so the loss "
            "differs slightly from the HF model's; the export drops them"
        )
    return {"megatron_lm_plugin": MegatronLMPlugin(**plugin_kwargs(cfg))}


class OptimizerStepRunsInForward:
    """Megatron-LM's prepared optimizer as the loop sees it: `step()` and `zero_grad()` do nothing, because the
    optimizer step already ran inside Backend.forward_loss (model(**batch) in train mode: forward and backward over
    the micro batches, clipping, the optimizer and scheduler step). Mixed over accelerate's
    MegatronLMOptimizerWrapper (whose methods are the ones that run; this class names them, see `_named`)."""

    def step(self):
        """Nothing to do: the optimizer stepped inside forward_loss."""
        return super().step()

    def zero_grad(self, set_to_none=None):
        """Nothing to do: Megatron zeroes its gradient buffers inside forward_loss's step."""
        return super().zero_grad(set_to_none)


class SchedulerStepRunsInForward:
    """Megatron-LM's prepared scheduler as the loop sees it: `step()` does nothing, because Megatron's own scheduler
    stepped inside Backend.forward_loss. Mixed over accelerate's MegatronLMSchedulerWrapper."""

    def step(self, *args, **kwargs):
        """Nothing to do: the learning rate moved inside forward_loss."""
        return super().step(*args, **kwargs)


def _named(obj, kind: type):
    """obj, the same object with the same behaviour, re-classed under `kind` (mixed over its own class): a reader of
    loop.py who follows `run.optimizer.step()` into a debugger or a traceback finds where the step really runs."""
    obj.__class__ = type(kind.__name__, (kind, type(obj)), {"__doc__": kind.__doc__, "__module__": __name__})
    return obj


def make_scheduler(optimizer, plan, warmup: int):
    """Megatron's scheduler placeholder (accelerate refuses any other under Megatron-LM).

    accelerate divides both lengths by the data-parallel size (MegatronLMPlugin.set_scheduler_args), as it
    expects the lengths a per-process stepped scheduler would have; the shape comes from the plugin's
    lr_decay_style (`plugin_kwargs`). Megatron's "constant" still warms up: HF's constant has no warmup."""
    from accelerate.utils import MegatronLMDummyScheduler

    dp = plan.data_parallel_size
    # Megatron's scheduler asserts warmup < decay steps, where every other backend's schedule (optim.build_scheduler)
    # warms up over the whole run when warmup_steps >= total steps. Within the warmup Megatron's learning rate is
    # max_lr x steps / warmup as theirs, and decay steps (here train_iters) count only after it: decaying from
    # step warmup + 1 gives the same learning rates at every step the run takes (only the one logged after the last
    # step may differ, where warmup equals the total steps: there the HF linear schedule has reached 0).
    total = max(plan.total_steps, warmup + 1)
    return MegatronLMDummyScheduler(optimizer, total_num_steps=total * dp, warmup_num_steps=warmup * dp)


class Backend(ddp.Backend):
    """Megatron-LM through accelerate (its own model, optimizer and schedule; GPU only).

    accelerate builds Megatron's model from the HF model's config alone (weights from the converted checkpoint),
    and `model(**batch)` in train mode (forward_loss) is the whole optimizer step over the pipeline's micro batches:
    forward, backward, clipping (the plugin's gradient_clipping), optimizer and scheduler step. `accelerator.backward`
    returns at once, and the prepared optimizer and scheduler (OptimizerStepRunsInForward, SchedulerStepRunsInForward)
    do nothing on `step` and `zero_grad`, so the loop's calls are harmless; what the loop reads back (loss, gradient
    norm, learning rate, eval statistics) comes through the methods below.
    """

    checkpoint_format = "native"  # Megatron's own checkpoint; no conversion to or from other layouts
    needs_hf_weights = False  # Megatron loads the converted checkpoint (pretrained_checkpoint)

    def __init__(self, accelerator, topology, cfg):
        super().__init__(accelerator, topology, cfg)
        self.hf = None  # the HF model given to prepare: its config, and save_pretrained for export
        self.optimizer = None  # Megatron's optimizer (accelerate's wrapper): its fp32 main weights for export
        self.scheduler = None  # Megatron's scheduler (accelerate's wrapper): a resume sets this run's peak in it
        self.grad_norm = None
        self.eval_dict: dict = {}
        for note in NOTES:
            logger.info("megatron: %s", note)

    def layout(self, plan) -> dict:
        """What a checkpoint records about the run that writes it, and the mixed precision too: Megatron's own
        checkpoint holds its optimizer's state as its precision keeps it (fp32 main weights beside 16-bit ones, or
        none), and as the distributed optimizer shards it (Topology.distributed_optimizer), so a resume with either
        changed is one under another layout, refused before anything loads (checkpoint.find_resume)."""
        return {**super().layout(plan), "mixed_precision": self.mixed_precision}

    def fp32_master_weights(self) -> bool:
        """Megatron-LM updates its own GPT's weights, never the HF model finetune builds for its config (on the meta
        device, in the checkpoint's dtype): fp32 without mixed precision, 16-bit under bf16/fp16 with fp32 main
        weights in its optimizer (the plugin's params_dtype; megatron.core.optimizer's
        Float16OptimizerWithFloat16Params). So nothing loses updates below a 16-bit weight's resolution."""
        return True

    def keep_checkpoints_per_machine(self) -> None:
        raise base.no_checkpoints_per_machine(
            "Megatron-LM writes each tensor/pipeline shard from its own rank, with no per-machine copy"
        )

    def prepare(self, model, optimizer, train_loader, eval_loader, scheduler, plan):
        """One accelerate.prepare call (each call initialises Megatron again, and a second one fails), with the
        dummy scheduler; then keep what Megatron's train/eval steps return that the forward drops."""
        self.hf = model
        warmup = 0 if self.cfg.train.lr_scheduler_type == "constant" else plan.warmup_steps
        scheduler = make_scheduler(optimizer, plan, warmup)
        prepared = base.prepare_all(self.acc, model, optimizer, train_loader, eval_loader, scheduler)
        engine = prepared[0]
        train_step, eval_step = engine.train_step, engine.eval_step

        def keep_grad_norm(**batch):
            loss, skipped, grad_norm, zeros = train_step(**batch)
            self.grad_norm = grad_norm
            return loss, skipped, grad_norm, zeros

        def keep_eval_dict(**batch):
            self.eval_dict = eval_step(**batch)
            return self.eval_dict

        engine.train_step, engine.eval_step = keep_grad_norm, keep_eval_dict
        self.optimizer, self.scheduler = prepared[1], prepared[4]
        _named(prepared[1], OptimizerStepRunsInForward)
        _named(prepared[4], SchedulerStepRunsInForward)
        return prepared

    def observed(self, model) -> dict:
        """Megatron's own parallel state, and the share of the model's parameters this rank holds."""
        from megatron.core import mpu
        from megatron.core.utils import unwrap_model

        mine = sum(p.numel() for chunk in unwrap_model(model.module) for p in chunk.parameters())
        return {
            "tp": mpu.get_tensor_model_parallel_world_size(),
            "pp": mpu.get_pipeline_model_parallel_world_size(),
            "dp": mpu.get_data_parallel_world_size(),
            "tp_rank": mpu.get_tensor_model_parallel_rank(),
            "pp_rank": mpu.get_pipeline_model_parallel_rank(),
            "parameter_shard": round(mine / sum(p.numel() for p in self.hf.parameters()), 4),
        }

    def close(self) -> None:
        stop_checkpoint_writer()

    def forward_loss(self, model, batch):
        """The whole optimizer step (forward, backward, clipping, optimizer and scheduler step over the micro
        batches), and its loss (already the mean over the global batch's supervised tokens, on the last pipeline
        stage only), broadcast from the last rank so that every rank logs the same value."""
        loss = model(**batch)
        return last_stage_loss(self.acc, loss.loss if hasattr(loss, "loss") else loss)

    def clip_grad_norm(self, model, max_norm):
        """The gradient norm Megatron computed and clipped with inside forward_loss (plugin gradient_clipping)."""
        return self.grad_norm

    def learning_rate(self, optimizer, scheduler) -> float:
        return optimizer.param_groups[0]["lr"]  # Megatron's scheduler has no get_last_lr

    def eval_stats(self, model, batch, labels, task):
        """Summed NLL and supervised-token count of the batch, from the loss function's report (gpt_loss), over
        the data-parallel replicas: the same token-weighted eval loss as every other backend.

        Megatron cuts every batch into num_micro_batches slices of micro_batch_size rows
        (MegatronEngine.get_batch_data_iterator), so a short last batch is filled up with rows that supervise
        nothing; and under data parallelism accelerate fills the last round of batches with rows from the start
        of the eval set, which are unsupervised here so that every row counts once (as gather_for_metrics drops
        them on the other backends); with one replica too, where accelerate shards the loader all the same
        (prepare_data_loader under MEGATRON_LM, whatever the number of processes)."""
        import torch
        from megatron.core import mpu
        from megatron.training import get_args

        args = get_args()
        rows = args.micro_batch_size * args.num_micro_batches
        state = self.acc.gradient_state
        real = labels.shape[0]
        if state.end_of_dataloader and state.remainder > 0:  # (one replica too: accelerate shards for Megatron)
            real = min(max(state.remainder - mpu.get_data_parallel_rank() * rows, 0), real)
        labels = labels.clone()
        labels[real:] = IGNORE
        batch = {**batch, "labels": labels}
        if labels.shape[0] < rows:
            fill = {"labels": IGNORE}
            batch = {k: _fill_rows(v, rows, fill.get(k, 0)) for k, v in batch.items()}
        model(**batch)  # eval mode: forward only over the micro batches
        sums = torch.zeros(2, device=self.acc.device)
        if mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0:
            sums += self.eval_dict["lm loss"].view(-1, 2).sum(0).float()
        torch.distributed.all_reduce(sums)  # every replica's last stage contributes once
        return {"nll": sums[:1], "count": sums[1:]}

    def gather_for_metrics(self, stats):
        """The batch's statistics, already summed over the data-parallel replicas (eval_stats), without the mixture's
        `source` column: that tags this rank's rows, and a sum over every replica's rows has no row to tag, so
        Megatron-LM reports the overall eval values only (no eval_<source>_...; docs/data.md)."""
        from finetune.mixture import SOURCE

        return {k: v for k, v in stats.items() if k != SOURCE}

    def writes_after_its_collectives(self) -> bool:
        """No: dist_checkpointing.save has rank 0 torch.save common.pt before the sharded save's collectives."""
        return False

    def load_state(self, path: str) -> None:
        """Megatron's initial load of pretrained_checkpoint leaves args.finetune on, which makes every later
        load skip the optimizer, scheduler, RNG and iteration: resume must turn it off first.

        The schedule is this run's, from the checkpoint's position on (a resume may change the learning rate,
        max_steps or the warmup, as on every backend: checkpoint.SCHEDULE_KEYS): the plugin's
        override_opt_param_scheduler makes Megatron's scheduler keep this run's lengths and peak, but each
        parameter group carries its own peak (max_lr), restored with the optimizer's state, which wins over the
        scheduler's: set back to this run's learning rate, then the learning rate is computed again."""
        import torch
        from megatron.training import get_args

        get_args().finetune = False
        with torch.no_grad():  # loading writes into parameters in place: with fp32 and the distributed optimizer the
            self.acc.load_state(path)  # main weights are the parameters themselves (a leaf that requires grad)
        for group in self.optimizer.param_groups:
            if "max_lr" in group:
                group["max_lr"] = self.cfg.train.learning_rate
        self.scheduler.scheduler.step(0)  # Megatron's OptimizerParamScheduler: the learning rate at its position

    def hf_model(self, model):
        return self.hf

    def full_state_dict(self, model):
        """The trained weights under HF names (main process), in fp32: under bf16/fp16 the fp32 main weights of
        Megatron's optimizer, not the 16-bit copies the model computes with (what every other backend exports:
        its fp32 master weights). Every rank sends the main weights it holds (whole parameters, or with the
        distributed optimizer its data-parallel slice of them), and the ranks of data-parallel replica 0 the
        parameters that have none (fp32 runs: all), to the main process over the host (cluster.host_gather: an
        object gather on the NCCL group stages world size x the largest shard on every GPU, an OOM at the end of a
        7B run), which joins each tensor/pipeline shard and then the shards (`megatron_to_hf`). A collective."""
        import torch
        from megatron.core import mpu
        from megatron.core.utils import unwrap_model

        from finetune.cluster import host_gather, main_rank

        weights, main, sixteen = {}, {}, (torch.bfloat16, torch.float16)
        pieces, sliced = main_weight_pieces(self.optimizer, mpu.get_data_parallel_rank())
        for chunk in unwrap_model(model.module):
            for name, p in chunk.named_parameters():
                name = _global_layer_name(chunk, name)
                if id(p) in pieces:
                    main[name] = (tuple(p.shape), *pieces[id(p)])
                elif mpu.get_data_parallel_rank() == 0 and not (sliced and p.requires_grad and p.dtype in sixteen):
                    weights[name] = p.detach().float().cpu()  # (a 16-bit one is in the replicas' slices)
        shards = host_gather((mpu.get_tensor_model_parallel_rank(), weights, main), to=main_rank(self.acc))
        if not self.acc.is_main_process:  # (the main process is the last rank)
            return {}
        by_tp: dict[int, dict[str, torch.Tensor]] = {}
        for tp_rank, whole, sent in shards:  # (a name is in one of the two, on one replica or sliced over them)
            shard = by_tp.setdefault(tp_rank, {})
            shard.update(whole)
            for name, (shape, start, values) in sent.items():  # slice by slice: the replicas' slices cover it
                if name not in shard:
                    shard[name] = torch.empty(shape)
                shard[name].view(-1)[start : start + values.numel()] = values
        return megatron_to_hf([by_tp[r] for r in sorted(by_tp)], self.hf.config)


def main_weight_pieces(optimizer, dp_rank: int) -> tuple[dict, bool]:
    """The fp32 main weights this rank sends for the export, of those its Megatron optimizer keeps for 16-bit model
    parameters (bf16/fp16 runs; none in fp32, where the parameters are the weights): id(parameter) -> (offset into
    the flattened parameter, fp32 values on the host); and whether they are slices (the distributed optimizer),
    whose union over the data-parallel replicas covers every trainable 16-bit parameter. Megatron's
    DistributedOptimizer keeps this data-parallel rank's slice (shard_fp32_from_float16_groups beside
    model_float16_groups, at the parameter's "param" range): every rank sends its slices. Its
    Float16OptimizerWithFloat16Params keeps whole parameters on every replica (fp32_from_float16_groups beside
    float16_groups): replica 0 sends them, the others nothing. A precision-aware optimizer (other_megatron_args)
    keeps them inside the optimizer's state: none here, the 16-bit parameters are exported."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's MegatronLMOptimizerWrapper
    pieces, sliced = {}, False
    for opt in getattr(inner, "chained_optimizers", [inner]):
        if getattr(getattr(opt, "config", None), "use_precision_aware_optimizer", False):
            continue
        if hasattr(opt, "shard_fp32_from_float16_groups"):
            sliced = True
            for params, mains in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
                for p, m in zip(params, mains):
                    start = opt._get_model_param_range_map(p)["param"].start
                    pieces[id(p)] = (start, m.detach().float().cpu().view(-1))
        elif hasattr(opt, "fp32_from_float16_groups") and dp_rank == 0:
            for params, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for p, m in zip(params, mains):
                    pieces[id(p)] = (0, m.detach().float().cpu().view(-1))
    return pieces, sliced


def _fill_rows(t, rows: int, value):
    """t with rows appended (filled with value) up to `rows`; anything that is not a batch tensor as it is."""
    import torch

    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


def stop_checkpoint_writer() -> None:
    """Megatron's torch_dist checkpoint writer keeps a spawn-based multiprocessing Manager (a server process, and
    the resource tracker spawn starts) for the life of the process (filesystem_async.py ~54); a rank that ends
    with os._exit would leave both behind. Shut it down."""
    import sys

    writer = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    queue = getattr(writer, "_results_queue", None)
    if queue is None:
        return
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
    writer._results_queue = None


def _global_layer_name(chunk, name: str) -> str:
    """decoder.layers.<local>.x -> decoder.layers.<global>.x (pipeline stages number their layers from 0)."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not m:
        return name
    layer = chunk.decoder.layers[int(m.group(1))]
    return f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"


def last_stage_loss(accelerator, loss):
    """The step's loss on every rank. Under Megatron-LM the forward returns it already averaged over the
    global batch, on the last pipeline stage only (others return 0); the last rank is on the last stage."""
    import torch

    value = loss.detach().float().reshape(1).to(accelerator.device)
    torch.distributed.broadcast(value, src=accelerator.num_processes - 1)
    return value[0]


# Batches and loss for accelerate's GPTTrainStep that honour finetune's labels (its default batch function
# uses input_ids only and supervises every token; its default loss averages per micro batch).

IGNORE = -100


def megatron_gpt_inputs(batch: Mapping[str, Any], seq_length: int) -> tuple:
    """finetune's collated batch -> Megatron's (tokens, labels, loss_mask, attention_mask, position_ids).

    Fixed width seq_length (pipeline stages exchange tensors of one shape); Megatron's labels are the next
    token at each position (HF labels are shifted inside the model); positions whose label is -100 (prompt,
    padding) get loss_mask 0; the attention mask is causal (True = masked), padding is on the right.
    """
    import torch

    ids, labels = batch["input_ids"].long(), batch["labels"].long()
    b, n = ids.shape
    if n >= seq_length:
        ids, labels = ids[:, :seq_length], labels[:, :seq_length]
    else:
        ids = torch.cat([ids, ids.new_zeros(b, seq_length - n)], dim=1)
        labels = torch.cat([labels, labels.new_full((b, seq_length - n), IGNORE)], dim=1)
    target = torch.cat([labels[:, 1:], labels.new_full((b, 1), IGNORE)], dim=1)
    loss_mask = (target != IGNORE).float()
    target = target.masked_fill(target == IGNORE, 0)
    position_ids = torch.arange(seq_length, device=ids.device).unsqueeze(0).expand(b, -1)
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=ids.device).tril()
    attention_mask = (~causal).view(1, 1, seq_length, seq_length)
    return ids, target, loss_mask, attention_mask, position_ids


def gpt_batch(data_iterator):
    """custom_get_batch_function for MegatronLMPlugin (GPU only: Megatron's model lives on CUDA)."""
    import torch
    from megatron.training import get_args

    data = next(data_iterator)
    device = torch.device("cuda", torch.cuda.current_device())
    parts = megatron_gpt_inputs(data, get_args().seq_length)
    return tuple(x.to(device, non_blocking=True) for x in parts)


def gpt_loss(loss_mask, output_tensor):
    """custom_loss_function: (sum of supervised token losses, their count, report). Megatron divides by the
    count over all micro batches and data-parallel ranks (calculate_per_token_loss, on in accelerate's
    plugin), so the update is the mean over the supervised tokens of the global batch, as on every backend.
    The report is [sum, count]: Megatron's train step sums it over micro batches and data-parallel ranks and
    returns sum / count, the exact token mean; in eval the pairs are concatenated (Backend.eval_stats)."""
    import torch

    losses = (output_tensor[0] if isinstance(output_tensor, tuple) else output_tensor).float().view(-1)
    mask = loss_mask.view(-1).float()
    total, count = (losses * mask).sum(), mask.sum()
    return total, count.int(), {"lm loss": torch.stack([total.detach(), count.detach()])}


# ---------------------------------------------------------------- Megatron-Core weights -> HF names
#
# Megatron-Core's GPTModel (transformer_engine layer spec, accelerate's default) per tensor-parallel rank:
#   embedding.word_embeddings.weight [Vpad/tp, h] (dim 0)      output_layer.weight [Vpad/tp, h] (dim 0)
#   decoder.layers.L.self_attention.linear_qkv.weight (dim 0; per query group: its q heads, k, v)
#   decoder.layers.L.self_attention.linear_proj.weight (dim 1)  decoder.layers.L.mlp.linear_fc1.weight (dim 0;
#   each rank [gate_r; up_r] for SwiGLU)  decoder.layers.L.mlp.linear_fc2.weight (dim 1); norms replicated.
# (Megatron-LM tools/checkpoint/schema_core.py, megatron/core/transformer/attention.py, mlp.py.)


def norm_names(te: bool) -> tuple[str, str]:
    """Where a layer's two norms live: Transformer Engine's spec folds them into the next linear layer (what GPU
    runs with Transformer Engine use), the local spec (no Transformer Engine: CPU, or a GPU without it) keeps
    them as modules of their own."""
    if te:
        return "self_attention.linear_qkv.layer_norm_", "mlp.linear_fc1.layer_norm_"
    return "input_layernorm.", "pre_mlp_layernorm."


def _dims(config) -> tuple[int, int, int, int, int]:
    """(hidden, layers, query heads, query groups, head size) of a llama-family or gpt2 config."""
    h = config.hidden_size if hasattr(config, "hidden_size") else config.n_embd
    layers = config.num_hidden_layers if hasattr(config, "num_hidden_layers") else config.n_layer
    nq = config.num_attention_heads if hasattr(config, "num_attention_heads") else config.n_head
    ng = getattr(config, "num_key_value_heads", None) or nq
    d = getattr(config, "head_dim", None) or h // nq
    return h, layers, nq, ng, d


def megatron_to_hf(shards: list[dict], config) -> dict:
    """Join the TP shards (index = TP rank; each holds every pipeline stage's layers, global numbering) of a
    Megatron-Core GPT model and name them as the HF model of `config` (llama family or gpt2). Either layer spec
    (Transformer Engine's or the local one) is read; the vocabulary padding is dropped."""
    import torch

    def cat(name: str, dim: int):
        return torch.cat([s[name] for s in shards], dim=dim)

    def one(name: str):
        return shards[0][name]

    h, layers, nq, ng, d = _dims(config)
    vocab = config.vocab_size
    te = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in shards[0]
    attn_norm, mlp_norm = norm_names(te)
    out: dict[str, torch.Tensor] = {}
    embed = cat("embedding.word_embeddings.weight", 0)[:vocab]
    gpt2 = config.model_type == "gpt2"
    for i in range(layers):
        pre = f"decoder.layers.{i}."
        qkv = cat(pre + "self_attention.linear_qkv.weight", 0)
        fc1 = [s[pre + "mlp.linear_fc1.weight"] for s in shards]
        if gpt2:
            out |= _gpt2_layer_to_hf(shards, i, qkv, (h, nq, d), te)
            continue
        w = qkv.view(ng, nq // ng + 2, d, h)
        to = f"model.layers.{i}."
        out[to + "self_attn.q_proj.weight"] = w[:, : nq // ng].reshape(nq * d, h)
        out[to + "self_attn.k_proj.weight"] = w[:, nq // ng].reshape(ng * d, h)
        out[to + "self_attn.v_proj.weight"] = w[:, nq // ng + 1].reshape(ng * d, h)
        out[to + "self_attn.o_proj.weight"] = cat(pre + "self_attention.linear_proj.weight", 1)
        out[to + "input_layernorm.weight"] = one(pre + attn_norm + "weight")
        out[to + "post_attention_layernorm.weight"] = one(pre + mlp_norm + "weight")
        out[to + "mlp.gate_proj.weight"] = torch.cat([f.chunk(2, 0)[0] for f in fc1], 0)
        out[to + "mlp.up_proj.weight"] = torch.cat([f.chunk(2, 0)[1] for f in fc1], 0)
        out[to + "mlp.down_proj.weight"] = cat(pre + "mlp.linear_fc2.weight", 1)
    if gpt2:
        out["transformer.wte.weight"] = embed
        out["transformer.wpe.weight"] = one("embedding.position_embeddings.weight")
        out["transformer.ln_f.weight"] = one("decoder.final_layernorm.weight")
        out["transformer.ln_f.bias"] = one("decoder.final_layernorm.bias")
        out["lm_head.weight"] = embed
        return out
    out["model.embed_tokens.weight"] = embed
    out["model.norm.weight"] = one("decoder.final_layernorm.weight")
    untied = not getattr(config, "tie_word_embeddings", False) and "output_layer.weight" in shards[0]
    out["lm_head.weight"] = cat("output_layer.weight", 0)[:vocab] if untied else embed
    return out


def _gpt2_layer_to_hf(shards: list[dict], i: int, qkv, dims: tuple[int, int, int], te: bool) -> dict:
    """Layer i of a Megatron-Core GPT (TP shards, qkv already joined) under GPT-2's names (Conv1D: transposed)."""
    import torch

    h, nq, d = dims
    attn_norm, mlp_norm = norm_names(te)
    pre, to = f"decoder.layers.{i}.", f"transformer.h.{i}."

    def cat(name: str, dim: int):
        return torch.cat([s[name] for s in shards], dim=dim)

    bias = cat(pre + "self_attention.linear_qkv.bias", 0)
    return {
        to + "ln_1.weight": shards[0][pre + attn_norm + "weight"],
        to + "ln_1.bias": shards[0][pre + attn_norm + "bias"],
        to + "attn.c_attn.weight": qkv.view(nq, 3, d, h).transpose(0, 1).reshape(3 * h, h).T,
        to + "attn.c_attn.bias": bias.view(nq, 3, d).transpose(0, 1).reshape(3 * h),
        to + "attn.c_proj.weight": cat(pre + "self_attention.linear_proj.weight", 1).T,
        to + "attn.c_proj.bias": shards[0][pre + "self_attention.linear_proj.bias"],
        to + "ln_2.weight": shards[0][pre + mlp_norm + "weight"],
        to + "ln_2.bias": shards[0][pre + mlp_norm + "bias"],
        to + "mlp.c_fc.weight": cat(pre + "mlp.linear_fc1.weight", 0).T,
        to + "mlp.c_fc.bias": cat(pre + "mlp.linear_fc1.bias", 0),
        to + "mlp.c_proj.weight": cat(pre + "mlp.linear_fc2.weight", 1).T,
        to + "mlp.c_proj.bias": shards[0][pre + "mlp.linear_fc2.bias"],
    }


# ---------------------------------------------------------------- HF weights -> Megatron-Core (the inverse)


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron's vocabulary size with make_vocab_size_divisible_by 1 (`plugin_kwargs`): the real one whenever TP
    divides it, else the next multiple of TP (each TP rank holds an equal slice)."""
    return -(-vocab // tp) * tp


def hf_to_megatron(hf: Mapping[str, Any], config, tp: int, te: bool) -> list[dict]:
    """The inverse of `megatron_to_hf`: HF weights (llama family or gpt2) -> one dict per TP rank under
    Megatron-Core names, every layer numbered globally; the vocabulary zero-padded to `padded_vocab`."""
    import torch

    h, layers, nq, ng, d = _dims(config)
    gpt2 = config.model_type == "gpt2"
    attn_norm, mlp_norm = norm_names(te)
    full: dict[str, tuple[torch.Tensor, int | None]] = {}  # Megatron name -> (whole tensor, TP split dim)

    def vocab_rows(w):
        return torch.cat([w, w.new_zeros(padded_vocab(w.shape[0], tp) - w.shape[0], *w.shape[1:])])

    for i in range(layers):
        pre = f"decoder.layers.{i}."
        if gpt2:
            full |= _gpt2_layer_to_megatron(hf, i, (h, nq, d), te)
            continue
        at = f"model.layers.{i}."
        q = hf[at + "self_attn.q_proj.weight"].view(ng, nq // ng, d, h)
        k = hf[at + "self_attn.k_proj.weight"].view(ng, 1, d, h)
        v = hf[at + "self_attn.v_proj.weight"].view(ng, 1, d, h)
        full |= {
            pre + attn_norm + "weight": (hf[at + "input_layernorm.weight"], None),
            pre + "self_attention.linear_qkv.weight": (torch.cat([q, k, v], 1).reshape(-1, h), 0),
            pre + "self_attention.linear_proj.weight": (hf[at + "self_attn.o_proj.weight"], 1),
            pre + mlp_norm + "weight": (hf[at + "post_attention_layernorm.weight"], None),
            pre + "mlp.linear_fc2.weight": (hf[at + "mlp.down_proj.weight"], 1),
        }
    if gpt2:
        full["embedding.word_embeddings.weight"] = (vocab_rows(hf["transformer.wte.weight"]), 0)
        full["embedding.position_embeddings.weight"] = (hf["transformer.wpe.weight"], None)
        full["decoder.final_layernorm.weight"] = (hf["transformer.ln_f.weight"], None)
        full["decoder.final_layernorm.bias"] = (hf["transformer.ln_f.bias"], None)
    else:
        embed = vocab_rows(hf["model.embed_tokens.weight"])
        full["embedding.word_embeddings.weight"] = (embed, 0)
        full["decoder.final_layernorm.weight"] = (hf["model.norm.weight"], None)
        if not getattr(config, "tie_word_embeddings", False):
            full["output_layer.weight"] = (vocab_rows(hf.get("lm_head.weight", hf["model.embed_tokens.weight"])), 0)
    shards = [
        {n: (w if dim is None else w.chunk(tp, dim)[r]).clone() for n, (w, dim) in full.items()} for r in range(tp)
    ]
    if not gpt2:  # SwiGLU: each TP rank holds [its slice of gate; its slice of up]
        for i in range(layers):
            at = f"model.layers.{i}."
            gate, up = hf[at + "mlp.gate_proj.weight"].chunk(tp, 0), hf[at + "mlp.up_proj.weight"].chunk(tp, 0)
            for r, s in enumerate(shards):
                s[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.cat([gate[r], up[r]], 0)
    return shards


def _gpt2_layer_to_megatron(hf: Mapping[str, Any], i: int, dims: tuple[int, int, int], te: bool) -> dict:
    """Layer i of a GPT-2 (Conv1D weights: transposed) under Megatron-Core names, as (whole tensor, TP split dim)."""
    h, nq, d = dims
    attn_norm, mlp_norm = norm_names(te)
    pre, at = f"decoder.layers.{i}.", f"transformer.h.{i}."
    qkv = hf[at + "attn.c_attn.weight"].T.reshape(3, nq, d, h).transpose(0, 1).reshape(3 * h, h)
    bias = hf[at + "attn.c_attn.bias"].view(3, nq, d).transpose(0, 1).reshape(3 * h)
    return {
        pre + attn_norm + "weight": (hf[at + "ln_1.weight"], None),
        pre + attn_norm + "bias": (hf[at + "ln_1.bias"], None),
        pre + "self_attention.linear_qkv.weight": (qkv, 0),
        pre + "self_attention.linear_qkv.bias": (bias, 0),
        pre + "self_attention.linear_proj.weight": (hf[at + "attn.c_proj.weight"].T, 1),
        pre + "self_attention.linear_proj.bias": (hf[at + "attn.c_proj.bias"], None),
        pre + mlp_norm + "weight": (hf[at + "ln_2.weight"], None),
        pre + mlp_norm + "bias": (hf[at + "ln_2.bias"], None),
        pre + "mlp.linear_fc1.weight": (hf[at + "mlp.c_fc.weight"].T, 0),
        pre + "mlp.linear_fc1.bias": (hf[at + "mlp.c_fc.bias"], 0),
        pre + "mlp.linear_fc2.weight": (hf[at + "mlp.c_proj.weight"].T, 1),
        pre + "mlp.linear_fc2.bias": (hf[at + "mlp.c_proj.bias"], None),
    }


def pipeline_stage(shard: dict, layers: int, pp: int, stage: int, tied: bool) -> dict:
    """The part of one TP rank's weights (global layer numbering) that pipeline stage `stage` of `pp` holds,
    its layers numbered from 0 as Megatron saves them. A tied output layer on the last of several stages is a
    copy of the embedding (Megatron keeps the two equal by summing their gradients)."""
    per = layers // pp
    out = {}
    for name, w in shard.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            i = int(m.group(1))
            if stage * per <= i < (stage + 1) * per:
                out[f"decoder.layers.{i - stage * per}.{m.group(2)}"] = w
        elif name.startswith("embedding.") and stage == 0:
            out[name] = w
        elif (name.startswith("decoder.final_layernorm") or name == "output_layer.weight") and stage == pp - 1:
            out[name] = w
    if tied and pp > 1 and stage == pp - 1:
        out["output_layer.weight"] = shard["embedding.word_embeddings.weight"]
    return out


def read_hf_weights(model_dir: str) -> dict:
    """The HF model's tensors as stored (safetensors, one file or an index of several)."""
    import json

    from safetensors.torch import load_file

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict = {}
    for name in files:
        out |= load_file(os.path.join(model_dir, name))
    return out


def write_converted(model_dir: str, out_dir: str, config, tp: int, pp: int, te: bool) -> None:
    """The HF weights of model_dir as a Megatron-LM checkpoint of iteration 1 (legacy format, one
    mp_rank_TT[_PPP]/model_optim_rng.pt per TP x PP rank): what Megatron's pretrained_checkpoint loads. Not a
    "release" checkpoint: at this commit _load_base_checkpoint reads one as no checkpoint at all (iteration -1)
    and starts from random weights."""
    import torch

    layers = _dims(config)[1]
    tied = bool(getattr(config, "tie_word_embeddings", config.model_type == "gpt2"))
    shards = hf_to_megatron(read_hf_weights(model_dir), config, tp, te)
    for t, shard in enumerate(shards):
        for p in range(pp):
            rank_dir = os.path.join(out_dir, "iter_0000001", f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            os.makedirs(rank_dir, exist_ok=True)
            state = {"model": pipeline_stage(shard, layers, pp, p, tied), "checkpoint_version": 3.0, "iteration": 1}
            torch.save(state, os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
