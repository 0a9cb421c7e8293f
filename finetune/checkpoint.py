"""Resumable checkpoints and the exported model.

Layout under output_dir:
  checkpoints/step_<N>/   accelerate.save_state (model, optimizer, scheduler, RNG per rank)
                          + trainer_state.json (step, data position, counters) + run_config.yaml
  checkpoints/latest      text file naming the newest *complete* checkpoint
  final/                  a standard HF model directory + tokenizer + run_config.yaml

Everything is written to a hidden temporary directory first and renamed into place, so a run
killed while saving leaves the previous checkpoint (and `latest`) intact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import yaml

LATEST = "latest"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "run_config.yaml"


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    found = [
        (int(m.group(1)), os.path.join(root, name))
        for name in os.listdir(root)
        if (m := re.fullmatch(r"step_(\d+)", name)) and os.path.isfile(os.path.join(root, name, STATE_FILE))
    ]
    return sorted(found)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    accelerator,
    model,
    optimizer,
    output_dir: str,
    step: int,
    trainer_state: dict[str, Any],
    run_config: dict[str, Any],
    save_total_limit: int | None,
) -> str:
    """Save a resumable checkpoint on every rank, atomically; update `latest`; prune old ones.

    Besides accelerate's native state, a checkpoint holds what a *different* layout needs to resume
    (trainer_state.json's "layout" says which one wrote it): torch-native checkpoints add config.json
    and the optimizer's parameter names; DeepSpeed ones add portable/ (full weights + Adam moments).
    """
    root = checkpoints_dir(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp_step_{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp, safe_serialization=True)
    _write_portable(accelerator, model, optimizer, tmp, trainer_state["layout"])
    _fault_point("in-checkpoint", step)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_atomic(os.path.join(tmp, CONFIG_FILE), yaml.safe_dump(run_config, sort_keys=False))
        _write_atomic(os.path.join(tmp, STATE_FILE), json.dumps(trainer_state, indent=2))
        if os.path.exists(final):  # e.g. a resumed run saving the step it resumed from
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(os.path.join(root, LATEST), f"step_{step}\n")
        if save_total_limit:
            for _, path in list_checkpoints(output_dir)[:-save_total_limit]:
                if path != final:
                    shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def latest_complete(output_dir: str) -> str | None:
    """The checkpoint `latest` names, if there is one."""
    try:
        return resolve_resume(output_dir, LATEST)
    except OSError:
        return None


def resume_hint(output_dir: str) -> str:
    """What a user should do after a crash, naming the last complete checkpoint."""
    last = latest_complete(output_dir)
    if last is None:
        return "No checkpoint was completed; start the run again."
    return f"Last complete checkpoint: {last}. Continue with the same command plus --resume_from_checkpoint latest."


def _fault_point(name: str, step: int) -> None:
    """Fault injection for the crash tests: FINETUNE_FAULT=<name>:<step>[:<rank>] kills this process there."""
    spec = os.environ.get("FINETUNE_FAULT", "").split(":")
    if (
        len(spec) >= 2
        and spec[0] == name
        and int(spec[1]) == step
        and (len(spec) < 3 or spec[2] == os.environ.get("RANK", "0"))
    ):
        os.kill(os.getpid(), 9)


def resolve_resume(output_dir: str, spec: str | None) -> str | None:
    """The checkpoint directory that `resume_from_checkpoint` (latest, auto or a path) names; None: start fresh."""
    if spec == "auto":
        spec = LATEST if os.path.exists(os.path.join(checkpoints_dir(output_dir), LATEST)) else None
    if spec != LATEST:
        return spec
    with open(os.path.join(checkpoints_dir(output_dir), LATEST)) as f:
        return os.path.join(checkpoints_dir(output_dir), f.read().strip())


def read_trainer_state(path: str) -> dict[str, Any]:
    """A checkpoint's trainer_state.json; a ConfigError when `path` is not a complete finetune checkpoint."""
    from finetune.config import ConfigError

    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        missing = [k for k in ("step", "layout") if k not in state]
    except (OSError, json.JSONDecodeError) as e:
        missing = [f"{STATE_FILE} ({type(e).__name__})"]
    if missing:
        raise ConfigError(
            [
                (
                    "resume_from_checkpoint",
                    f"{path} is not a complete finetune checkpoint (missing "
                    f"{', '.join(missing)}); give a checkpoints/step_N directory "
                    "written by finetune, or drop resume_from_checkpoint to start "
                    "fresh",
                )
            ]
        )
    return state


def load_checkpoint(accelerator, path: str) -> dict[str, Any]:
    """Same layout: restore model, optimizer, scheduler and RNG on every rank; return the trainer state."""
    accelerator.load_state(path)
    return read_trainer_state(path)


# ---------------------------------------------------------------- resuming under another layout
#
# Any layout resumes under any other (ZeRO-3 on 2 ranks under DDP, one process or ZeRO-1/2, and the
# reverse; any world size): the model is rebuilt from the checkpoint's full weights through
# from_pretrained (ZeRO-3 aware), and AdamW's step, moments and fp32 master weights are set per
# parameter name. The global batch must be the one the checkpoint was trained with, so the data
# position and the schedule carry over exactly. Adapter runs keep their base model and take the
# adapter's weights by name. Tensor-parallel runs are refused.

PORTABLE = "portable"
PARAM_NAMES = "optimizer_param_names.json"


def _write_portable(accelerator, model, optimizer, tmp: str, layout: dict[str, Any]) -> None:
    net = accelerator.unwrap_model(model)
    if layout["zero_stage"] == 0:
        if accelerator.is_main_process:
            net.config.save_pretrained(tmp)  # model.safetensors + config.json: a from_pretrained directory
            name_of = {id(p): n for n, p in net.named_parameters()}
            inner = getattr(optimizer, "optimizer", optimizer)  # optimizer.bin's state is indexed in this order
            names = [name_of[id(p)] for group in inner.param_groups for p in group["params"]]
            _write_atomic(os.path.join(tmp, PARAM_NAMES), json.dumps(names))
        return
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    state_dict = accelerator.get_state_dict(model)  # collective (gathers ZeRO-3 partitions)
    relink_deepspeed_optimizer_states(optimizer)
    moments = {}
    for name, p in net.named_parameters():  # same order on every rank: each call is a collective
        if not p.requires_grad:
            continue
        values = {
            "param": safe_get_full_fp32_param(p),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq"),
        }
        if accelerator.is_main_process:
            moments.update({f"{k}/{name}": v.detach().float().cpu().contiguous() for k, v in values.items()})
    if accelerator.is_main_process:
        out = os.path.join(tmp, PORTABLE)
        net.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        save_file(moments, os.path.join(out, "optimizer.safetensors"))


def relink_deepspeed_optimizer_states(optimizer) -> bool:
    """Workaround (DeepSpeed 0.19.8, ZeRO-1/2): after the first step of the *first* parameter group,
    `_lazy_init_hp_params_optimizer_state` links every group's per-parameter views of the Adam state,
    while later groups' states are still empty; their views stay empty for good and
    `safe_get_full_optimizer_state` raises "exp_avg not found". Linking again once every group has
    stepped fixes the views. tests/test_deepspeed.py::test_deepspeed_still_needs_the_relink shows it.
    Returns True when it relinked."""
    zero = getattr(optimizer, "optimizer", None)  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    if os.environ.get("FINETUNE_NO_DS_RELINK") or not hasattr(zero, "_hp_optimizer_states_linked"):
        return False
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()
    return True


def needs_portable_resume(saved: dict[str, Any], here: dict[str, Any]) -> bool:
    return saved["layout"] != here


def check_portable_resume(path: str, saved: dict[str, Any], here: dict[str, Any], global_batch: int) -> None:
    """Refuse, before the model loads, what a resume under another layout cannot do exactly."""
    from finetune.config import ConfigError

    was = saved["layout"]
    desc = f"{was['distributed_type']} (ZeRO-{was['zero_stage']}) on {was['world_size']} process(es)"
    problems = []
    if was.get("tensor_parallel", 1) > 1 or here.get("tensor_parallel", 1) > 1:
        problems.append(
            (
                "resume_from_checkpoint",
                f"{path} was written by {desc} with tensor parallel "
                f"{was.get('tensor_parallel', 1)}; tensor-parallel runs resume "
                "only under the layout they were saved with",
            )
        )
    if was["global_batch_size"] != global_batch:
        problems.append(
            (
                "per_device_train_batch_size",
                f"{path} was trained with a global batch of {was['global_batch_size']} and this run has "
                f"{global_batch}; choose micro batch x gradient_accumulation_steps x processes = "
                f"{was['global_batch_size']} so the data position and schedule carry over",
            )
        )
    if problems:
        raise ConfigError(problems)


def portable_model_dir(path: str, saved: dict[str, Any]) -> str:
    """The from_pretrained directory holding a checkpoint's full weights."""
    return os.path.join(path, PORTABLE) if saved["layout"]["zero_stage"] > 0 else path


def _read_portable(path: str, saved: dict[str, Any]) -> tuple[dict, dict]:
    """A checkpoint's trainable weights (fp32 masters) and Adam moments, by parameter name."""
    import torch
    from safetensors.torch import load_file

    if saved["layout"]["zero_stage"] > 0:
        tensors = load_file(os.path.join(path, PORTABLE, "optimizer.safetensors"))
        names = [k.split("/", 1)[1] for k in tensors if k.startswith("param/")]
        moments = {n: (tensors[f"exp_avg/{n}"], tensors[f"exp_avg_sq/{n}"]) for n in names}
        return {n: tensors[f"param/{n}"] for n in names}, moments
    with open(os.path.join(path, PARAM_NAMES)) as f:
        names = json.load(f)
    state = torch.load(os.path.join(path, "optimizer.bin"), map_location="cpu", weights_only=True)["state"]
    moments = {n: (state[i]["exp_avg"], state[i]["exp_avg_sq"]) for i, n in enumerate(names)}
    masters = {n: t for n, t in load_file(os.path.join(path, "model.safetensors")).items() if n in moments}
    return masters, moments


def _trainable(net, path: str, names) -> dict:
    named = {n: p for n, p in net.named_parameters() if p.requires_grad}
    differ = set(named) ^ set(names)
    if differ:
        raise RuntimeError(f"checkpoint {path} and this model disagree on parameters: {sorted(differ)[:5]}")
    return named


def _copy_by_name(named: dict, weights: dict) -> None:
    import torch

    with torch.no_grad():
        for n, w in weights.items():
            named[n].copy_(w.to(named[n].dtype))


def load_portable_adapter(net, path: str, saved: dict[str, Any]) -> None:
    """Adapter runs: the base model is the run's own (frozen, unchanged by training); the adapter's
    trained weights are set by name before accelerate.prepare (under ZeRO-3, where PEFT's copies of
    partitioned modules are partitioned too, through GatheredParameters)."""
    import contextlib

    masters, _ = _read_portable(path, saved)
    named = _trainable(net, path, masters)
    params = [named[n] for n in masters]
    gathered = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with gathered:
        _copy_by_name(named, masters)


def load_portable_optimizer(
    accelerator, model, optimizer, path: str, saved: dict[str, Any], here: dict[str, Any]
) -> None:
    """Set AdamW's moments, step and fp32 master weights by parameter name, from any layout into any
    layout: into torch AdamW directly, into DeepSpeed's partitions through its safe_set_full_* API."""
    import torch

    masters, moments = _read_portable(path, saved)
    named = _trainable(accelerator.unwrap_model(model), path, moments)
    if here["zero_stage"] > 0:
        _set_deepspeed_state(optimizer, named, moments, masters, saved["step"])
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> torch AdamW
    _copy_by_name(named, masters)
    for n, (m, v) in moments.items():
        p = named[n]
        inner.state[p] = {
            "step": torch.tensor(float(saved["step"])),
            "exp_avg": m.to(p.device, p.dtype),
            "exp_avg_sq": v.to(p.device, p.dtype),
        }


def _set_deepspeed_state(optimizer, named: dict, moments: dict, masters: dict, step: int) -> None:
    """DeepSpeed creates Adam's state lazily, at the first step, and safe_set_full_optimizer_state can
    only write into state that exists. So: one step of the inner optimizer (torch AdamW or DeepSpeedCPUAdam
    over the flat fp32 partitions) with zero gradients and lr 0, which creates the state and changes no
    weight; then the step count, and every parameter's moments and master weights by name. Every rank
    holds the full tensors and keeps its own partition of them."""
    import torch
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero = optimizer.optimizer  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    inner = zero.optimizer  # -> the torch-style optimizer over this rank's flat fp32 partitions
    zero3 = hasattr(zero, "fp32_partitioned_groups_flat")
    # ZeRO-3 hands the optimizer one sub-group at a time (its param groups are empty in between)
    flats = zero.fp32_partitioned_groups_flat if zero3 else [p for g in inner.param_groups for p in g["params"]]
    lrs = [group["lr"] for group in inner.param_groups]
    grads = [p.grad for p in flats]  # ZeRO-3 with offload keeps a gradient buffer attached
    for group in inner.param_groups:
        group["lr"] = 0.0
    for p in flats:
        p.grad = torch.zeros_like(p)
    if zero3:
        for i in range(len(flats)):
            zero._optimizer_step(i)
    else:
        inner.step()
    for group, lr in zip(inner.param_groups, lrs):
        group["lr"] = lr
    for p, g in zip(flats, grads):
        p.grad = g
        state = inner.state[p]
        if torch.is_tensor(state["step"]):
            state["step"].fill_(step)
        else:  # DeepSpeedCPUAdam counts in a Python int
            state["step"] = step
    relink_deepspeed_optimizer_states(optimizer)  # ZeRO-1/2: link the new state to each parameter's fragment
    for n, p in named.items():  # the same order on every rank
        m, v = moments[n]
        for key, value in ((None, masters.get(n)), ("exp_avg", m), ("exp_avg_sq", v)):
            if value is None:
                continue
            if hasattr(p, "ds_id") and p.ds_numel % zero.partition_count:
                _set_uneven_zero3_partition(p, value.float(), key)
            elif key is None:
                safe_set_full_fp32_param(p, value.float())
            else:
                safe_set_full_optimizer_state(p, value.float(), key)


def _set_uneven_zero3_partition(param, value, key: str | None) -> None:
    """Workaround (DeepSpeed 0.19.8): ZeRO-3's set_full_hp_param cuts this rank's slice out of the full
    value at rank x partition size, for a whole partition; when the parameter's size is not a multiple
    of the world size, the last rank's slice runs past the end ("start (2) + length (2) exceeds
    dimension size (3)"). The same write, with the slice's missing tail left as DeepSpeed's zero
    padding. tests/test_resume_layouts.py::test_into_offloaded_zero_with_uneven_partitions needs it."""
    opt = param._z3_optimizer
    part, group = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    start = part.numel() * opt._get_param_partition_rank(param)
    piece = value.flatten()[start : start + part.numel()]
    part.data.zero_()
    part.data[: piece.numel()].copy_(piece)
    if opt._swappable_optimizer_subgroup(group):
        opt._optimizer_states_and_gradient_swap_out(group)


def set_scheduler_position(scheduler, step: int, world_size: int) -> None:
    """Put an LR schedule at optimizer step `step` (accelerate steps it world_size times per step)."""
    inner = getattr(scheduler, "scheduler", scheduler)
    inner.last_epoch = step * world_size - 1
    inner._step_count = step * world_size
    inner.step()


def export(accelerator, model, tokenizer, run_config: dict[str, Any], output_dir: str) -> str:
    """Write final/: a full HF model directory (or, for adapter runs, the adapter) plus tokenizer and config.

    The state dict comes from accelerate, which gathers ZeRO-3 partitions (an empty-shell checkpoint
    otherwise); PeftModel.save_pretrained keeps only the adapter (and modules_to_save) tensors of it.
    """
    final = os.path.join(output_dir, "final")
    tmp = os.path.join(output_dir, ".tmp_final")
    from finetune import megatron

    if megatron.tp_enabled(accelerator):  # transformers gathers a tensor-parallel model itself, on every rank
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.unwrap_model(model).save_pretrained(
            tmp, is_main_process=accelerator.is_main_process, safe_serialization=True
        )
    else:
        state_dict = accelerator.get_state_dict(model)  # a collective: every rank takes part
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(tmp)
        _write_atomic(os.path.join(tmp, CONFIG_FILE), yaml.safe_dump(run_config, sort_keys=False))
        id2label = getattr(accelerator.unwrap_model(model).config, "id2label", None)
        if os.path.exists(os.path.join(tmp, "adapter_config.json")) and run_config.get("task") == "classification":
            # the classes a classifier adapter was trained for: `finetune merge` rebuilds the head from them
            _write_atomic(os.path.join(tmp, LABELS_FILE), json.dumps([id2label[i] for i in sorted(id2label)]))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


LABELS_FILE = "labels.json"


def merge_adapter(adapter_dir: str, out_dir: str) -> str:
    """Base model + adapter -> one plain model directory (loads with from_pretrained), atomically.

    A classifier adapter's classes come from its labels.json (the base model is rebuilt with that head)."""
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification
    from transformers import AutoTokenizer

    label_names = None
    if os.path.exists(os.path.join(adapter_dir, LABELS_FILE)):
        with open(os.path.join(adapter_dir, LABELS_FILE)) as f:
            label_names = json.load(f)

    if label_names:
        merged = AutoPeftModelForSequenceClassification.from_pretrained(
            adapter_dir,
            num_labels=len(label_names),
            id2label=dict(enumerate(label_names)),
            label2id={n: i for i, n in enumerate(label_names)},
        )
    else:
        merged = AutoPeftModelForCausalLM.from_pretrained(adapter_dir)
    merged = merged.merge_and_unload()
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(tmp)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
