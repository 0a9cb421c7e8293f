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
    output_dir: str,
    step: int,
    trainer_state: dict[str, Any],
    run_config: dict[str, Any],
    save_total_limit: int | None,
) -> str:
    """Save a resumable checkpoint on every rank, atomically; update `latest`; prune old ones."""
    root = checkpoints_dir(output_dir)
    final = os.path.join(root, f"step_{step}")
    tmp = os.path.join(root, f".tmp_step_{step}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp, safe_serialization=True)
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


def resolve_resume(output_dir: str, spec: str) -> str:
    """The checkpoint directory that `resume_from_checkpoint` (latest or a path) names."""
    if spec != LATEST:
        return spec
    with open(os.path.join(checkpoints_dir(output_dir), LATEST)) as f:
        return os.path.join(checkpoints_dir(output_dir), f.read().strip())


def load_checkpoint(accelerator, path: str) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG on every rank; return the trainer state."""
    accelerator.load_state(path)
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def export(accelerator, model, tokenizer, run_config: dict[str, Any], output_dir: str) -> str:
    """Write final/: a full HF model directory (or, for adapter runs, the adapter) plus tokenizer and config.

    The state dict comes from accelerate, which gathers ZeRO-3 partitions (an empty-shell checkpoint
    otherwise); PeftModel.save_pretrained keeps only the adapter (and modules_to_save) tensors of it.
    """
    final = os.path.join(output_dir, "final")
    tmp = os.path.join(output_dir, ".tmp_final")
    state_dict = accelerator.get_state_dict(model)  # a collective: every rank takes part
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _write_atomic(os.path.join(tmp, CONFIG_FILE), yaml.safe_dump(run_config, sort_keys=False))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def merge_adapter(adapter_dir: str, out_dir: str, label_names: list[str] | None = None) -> str:
    """Base model + adapter -> one plain model directory (loads with from_pretrained), atomically.

    label_names: for a classifier, the classes (the base model is rebuilt with a head of that size)."""
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification
    from transformers import AutoTokenizer

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
