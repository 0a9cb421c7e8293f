"""Tensor and pipeline parallelism: Megatron-LM through accelerate, and torch-native tensor parallelism.

Both are chosen by the Accelerate config, like every other backend:

  accelerate_configs/megatron_tp2.yaml       Megatron-LM, TP 2            (GPU only)
  accelerate_configs/megatron_tp2_pp2.yaml   Megatron-LM, TP 2 x PP 2     (GPU only)
  accelerate_configs/tp2.yaml                torch TP (DTensor, the model's tp_plan), TP 2 (GPU, or CPU on gloo)

Megatron-LM semantics, and where finetune meets them (accelerate.utils.megatron_lm):
- The forward runs the whole step: `model(**batch)` is forward, backward, optimizer and scheduler step over
  `num_micro_batches` micro batches. `accelerator.backward`, `optimizer.step` and `scheduler.step` are no-ops.
- The scheduler is Megatron's: accelerate refuses any other; `make_scheduler` builds its placeholder.
- gradient_accumulation_steps must be 1: micro batches belong to the pipeline (megatron_lm_num_micro_batches).
- The global batch comes from the plugin: data parallel size x micro batch x num_micro_batches (`batch_layout`).
- The loss a forward returns is already averaged (over micro batches and data-parallel ranks), also in eval;
  only the last pipeline stage has it, so the main process is the last rank (accelerate's PartialState).
- Checkpoints go through `save_state`/`load_state` (Megatron's own format inside).
- Megatron builds its own model, initialised at random: the HF weights must be converted to Megatron's layout
  before training (docs/megatron.md); `check_before_start` refuses to start without the converted checkpoint.

`check_before_start` runs before Accelerator() and before any model loads; it refuses what cannot work here
(no CUDA, no Megatron-LM, a model type accelerate cannot map, ...) with one ConfigError naming each fix.

Torch-native TP: accelerate 1.15's ParallelismConfig refuses MULTI_CPU, although the sharded model trains on
gloo with the losses of one process. `CpuTensorParallelConfig` is the one workaround of accelerate internals
(test: tests/test_megatron.py::test_accelerate_still_refuses_tp_on_cpu fails once accelerate no longer needs it).
`save_state` cannot write DTensors (safetensors reads their storage pointer); `enable_tp_checkpointing` makes
model and optimizer state go through torch.distributed.checkpoint's full state dicts instead.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from finetune.config import RunConfig

# Where a Megatron-LM checkpoint converted from the HF model is expected (docs/megatron.md shows how to make it).
CONVERTED_DIR = "megatron"
# Which of accelerate's Megatron model families can train which finetune task (accelerate picks the train step
# from the family: gpt -> GPTTrainStep, a causal LM; megatron-bert -> BertTrainStep, a classifier when not
# pretraining; t5 -> T5TrainStep, seq2seq, which finetune does not train).
TASK_FAMILIES = {"causal_lm": ("gpt2", "llama", "glm4_moe"), "classification": ("megatron-bert",)}
MEGATRON_LR_STYLES = {
    "linear": "linear",
    "cosine": "cosine",
    "constant": "constant",
    "constant_with_warmup": "constant",
}
DOCS = "docs/megatron.md"
KEY = "accelerate config"  # the problem is in the Accelerate config (or this machine), not in the run config


# ---------------------------------------------------------------- what the launcher asked for


def _true(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


def megatron_requested(env: Mapping[str, str] = os.environ) -> bool:
    """`accelerate launch` with `distributed_type: MEGATRON_LM` sets ACCELERATE_USE_MEGATRON_LM=true."""
    return _true(env.get("ACCELERATE_USE_MEGATRON_LM"))


def tensor_parallel_size(env: Mapping[str, str] = os.environ) -> int:
    """torch-native TP degree: a `parallelism_config` in the Accelerate config sets these for every rank."""
    if not _true(env.get("ACCELERATE_USE_PARALLELISM_CONFIG")):
        return 1
    return int(env.get("PARALLELISM_CONFIG_TP_SIZE", "1"))


def world_size(env: Mapping[str, str] = os.environ) -> int:
    return int(env.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class MegatronLayout:
    """The Megatron-LM layout the launcher set (accelerate/utils/launch.py, prefix MEGATRON_LM_)."""

    tp: int
    pp: int
    num_micro_batches: int
    sequence_parallel: bool

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> MegatronLayout:
        # Same defaults as accelerate's MegatronLMPlugin.__post_init__.
        return cls(
            tp=int(env.get("MEGATRON_LM_TP_DEGREE", 1)),
            pp=int(env.get("MEGATRON_LM_PP_DEGREE", 1)),
            num_micro_batches=int(env.get("MEGATRON_LM_NUM_MICRO_BATCHES", 1)),
            sequence_parallel=_true(env.get("MEGATRON_LM_SEQUENCE_PARALLELISM", "False")),
        )

    def data_parallel_size(self, num_processes: int) -> int:
        return num_processes // (self.tp * self.pp)


def batch_layout(micro_batch_size: int, num_processes: int, env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(rows one data-parallel rank consumes per optimizer step, data-parallel size) under Megatron-LM.

    accelerate rebuilds the train loader with batch size micro x num_micro_batches and shards it over the
    data-parallel ranks only (TP and PP ranks of one replica read the same rows), so the global batch is
    data_parallel_size x micro_batch_size x num_micro_batches: the plugin's `global_batch_size`.
    """
    layout = MegatronLayout.from_env(env)
    return micro_batch_size * layout.num_micro_batches, layout.data_parallel_size(num_processes)


# ---------------------------------------------------------------- checks before anything starts


def megatron_family(model_type: str) -> str | None:
    """The accelerate Megatron model family a HF model_type maps to, by accelerate's own rule
    (MegatronLMPlugin.set_network_size_args: the first registered name contained in the model type)."""
    from accelerate.utils.dataclasses import MODEL_CONFIGS_TO_MEGATRON_PARSERS

    return next((name for name in MODEL_CONFIGS_TO_MEGATRON_PARSERS if name in model_type.lower()), None)


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
    for module in ("megatron.training", "megatron.legacy"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    if missing:
        return (
            f"megatron-core {version} is installed but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not (they come from the Megatron-LM source tree, "
            "not from the megatron-core wheel)"
        )
    return None


def converted_checkpoint(model: str) -> str:
    """Where the Megatron-LM checkpoint converted from `model` must be (docs/megatron.md)."""
    return os.path.join(os.path.expanduser(model), CONVERTED_DIR)


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


def _model_config(cfg: RunConfig):
    """The model's config.json through AutoConfig (no weights), or None when it cannot be read here
    (model loading reports that later, with its own message)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model.model, trust_remote_code=cfg.model.trust_remote_code)
    except Exception:  # noqa: BLE001 -- any failure here is reported by the model builder
        return None


def _heads_layers(config) -> tuple[int | None, int | None, int | None]:
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv = getattr(config, "num_key_value_heads", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    return heads, kv, layers


def megatron_problems(cfg: RunConfig, env: Mapping[str, str] = os.environ) -> list:
    """Everything that keeps this run from starting under Megatron-LM, as (key, message with the fix)."""
    import torch

    p: list[tuple[str, str]] = []
    t, layout = cfg.train, MegatronLayout.from_env(env)
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
    if cfg.peft.method != "none":
        p.append(
            (
                "peft.method",
                f"{cfg.peft.method} adapters do not work under Megatron-LM (it builds its own model from the "
                "converted checkpoint); set peft.method: none, or use a DDP/DeepSpeed config for adapters",
            )
        )
    if cfg.data.packing:
        p.append(
            (
                "packing",
                "is not supported under Megatron-LM (its GPT step attends across packed examples); set packing: false",
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
    n = world_size(env)
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
    config = _model_config(cfg)
    if config is None:
        return p
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
        return p
    if family not in TASK_FAMILIES[cfg.model.task]:
        fits = [task for task, families in TASK_FAMILIES.items() if family in families]
        p.append(
            (
                "task",
                f"accelerate trains {model_type!r} under Megatron-LM as "
                f"{fits[0] if fits else 'a seq2seq model, which finetune does not train'}, not {cfg.model.task}; "
                f"use a {'/'.join(TASK_FAMILIES[cfg.model.task])} model, or another Accelerate config",
            )
        )
    heads, _, layers = _heads_layers(config)
    if heads and heads % layout.tp:
        p.append((KEY, f"megatron_lm_tp_degree {layout.tp} must divide the model's {heads} attention heads"))
    if layers and layers % layout.pp and "MEGATRON_LM_DECODER_LAST_PIPELINE_NUM_LAYERS" not in env:
        p.append(
            (
                KEY,
                f"megatron_lm_pp_degree {layout.pp} must divide the model's {layers} layers (or set "
                "megatron_lm_decoder_last_pipeline_num_layers)",
            )
        )
    converted = converted_checkpoint(cfg.model.model)
    if not os.path.isfile(os.path.join(converted, "latest_checkpointed_iteration.txt")):
        p.append(
            (
                "model",
                f"no Megatron-LM checkpoint at {converted}: Megatron builds its own model, initialised at random, so "
                "the HF weights must be converted to Megatron's layout first (Megatron-LM's "
                f"tools/checkpoint/convert.py, --save-dir {converted}; see {DOCS})",
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
                    f"{layout.tp} --target-pipeline-parallel-size {layout.pp} (or save in torch_dist format)",
                )
            )
    return p


# ---------------------------------------------------------------- the MegatronLMPlugin finetune builds


def plugin_kwargs(cfg: RunConfig, env: Mapping[str, str] = os.environ, model_config=None) -> dict[str, Any]:
    """MegatronLMPlugin keyword arguments: the layout from the Accelerate config (the environment the launcher
    set) and everything the run config owns (clipping, sequence length, schedule shape, seed, checkpoint).

    The sequence length is fixed to max_seq_length (pipeline stages exchange tensors of one shape); which
    plugin field carries it depends on the model family, because accelerate's parsers read different ones
    (the gpt2 parser replaces `seq_length` by `decoder_seq_length`).
    """
    layout = MegatronLayout.from_env(env)
    config = model_config if model_config is not None else _model_config(cfg)
    family = megatron_family(getattr(config, "model_type", "") or "") if config is not None else None
    seq = cfg.data.max_seq_length
    lengths = {"gpt2": {"decoder_seq_length": seq}, "megatron-bert": {"encoder_seq_length": seq}}.get(
        family, {"seq_length": seq}
    )
    other: dict[str, Any] = {"seed": cfg.train.seed, "pretrained_checkpoint": converted_checkpoint(cfg.model.model)}
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int):
        other["eos_token_id"] = eos  # accelerate's GPTTrainStep reads args.eos_token_id
    kwargs: dict[str, Any] = {
        "tp_degree": layout.tp,
        "pp_degree": layout.pp,
        "num_micro_batches": layout.num_micro_batches,
        "sequence_parallelism": layout.sequence_parallel,
        "gradient_clipping": cfg.train.max_grad_norm,
        "lr_decay_style": MEGATRON_LR_STYLES[cfg.train.lr_scheduler_type],
        "min_lr": 0.0,
        "other_megatron_args": other,
        **lengths,
    }
    if family in TASK_FAMILIES["causal_lm"]:
        kwargs["custom_get_batch_function"] = gpt_batch
        kwargs["custom_loss_function"] = gpt_loss
    return kwargs


def make_plugin(cfg: RunConfig):
    """The MegatronLMPlugin to give Accelerator(megatron_lm_plugin=...), or None when not under Megatron-LM."""
    if not megatron_requested():
        return None
    from accelerate.utils import MegatronLMPlugin

    return MegatronLMPlugin(**plugin_kwargs(cfg))


def make_scheduler(optimizer, total_steps: int, warmup_steps: int, num_processes: int):
    """Megatron's scheduler placeholder (accelerate refuses any other under Megatron-LM).

    accelerate divides both lengths by the data-parallel size (MegatronLMPlugin.set_scheduler_args), as it
    expects the lengths a per-process stepped scheduler would have; the shape comes from the plugin's
    lr_decay_style (`plugin_kwargs`)."""
    from accelerate.utils import MegatronLMDummyScheduler

    dp = MegatronLayout.from_env().data_parallel_size(num_processes)
    return MegatronLMDummyScheduler(optimizer, total_num_steps=total_steps * dp, warmup_num_steps=warmup_steps * dp)


def is_megatron(accelerator) -> bool:
    return str(accelerator.distributed_type).endswith("MEGATRON_LM")


def last_stage_loss(accelerator, loss):
    """The step's loss on every rank. Under Megatron-LM the forward returns it already averaged over micro
    batches and data-parallel ranks, on the last pipeline stage only (others return 0): take the last rank's."""
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
    The report is the data-parallel mean of the micro batch's mean (the form accelerate's eval averages)."""
    import torch
    from megatron.core import mpu

    losses = (output_tensor[0] if isinstance(output_tensor, tuple) else output_tensor).float().view(-1)
    mask = loss_mask.view(-1).float()
    total, count = (losses * mask).sum(), mask.sum()
    report = (total / count.clamp(min=1)).detach().clone()
    torch.distributed.all_reduce(report, group=mpu.get_data_parallel_group())
    report /= mpu.get_data_parallel_world_size()
    return total, count.int(), {"lm loss": report}
