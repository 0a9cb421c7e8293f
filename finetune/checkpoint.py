"""Resumable checkpoints: written atomically, resumed exactly, or converted to another layout.

Layout under output_dir:
  checkpoints/step_<N>/   accelerate.save_state (model, optimizer, scheduler, RNG per rank)
                          + trainer_state.json (step, data position, counters, the writer's layout)
                          + run_config.yaml, and what another layout needs to resume (below)
  checkpoints/latest      text file naming the newest *complete* checkpoint

Everything is written to a hidden temporary directory first and renamed into place, so a run
killed while saving leaves the previous checkpoint (and `latest`) intact.

Resuming under another layout (ZeRO-3 on 2 ranks under FSDP2, DDP or one process, and the reverse;
any world size): the model is rebuilt from the checkpoint's full weights through from_pretrained,
and AdamW's step, moments and fp32 master weights are set per parameter name through the backend
(finetune.parallel). The global batch must be the one the checkpoint was trained with, so the data
position and the schedule carry over exactly. Adapter runs keep their base model and take the
adapter's weights by name. Full tensors are in one of two forms:
  - the backend's own checkpoint already holds them (one process, DDP, TP): model.safetensors,
    optimizer.bin, and optimizer_param_names.json naming optimizer.bin's entries;
  - portable/ (DeepSpeed, FSDP): a from_pretrained directory plus optimizer.safetensors
    (param/NAME, exp_avg/NAME, exp_avg_sq/NAME).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import yaml

from finetune.cluster import fault_point
from finetune.config import ConfigError

LATEST = "latest"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "run_config.yaml"
PORTABLE = "portable"
PARAM_NAMES = "optimizer_param_names.json"


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


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Checkpointer:
    """Saves the run's resumable state; built once by run.py and handed to the loop."""

    def __init__(
        self,
        accelerator,
        backend,
        model,
        optimizer,
        output_dir: str,
        run_config: dict,
        layout: dict,
        save_total_limit: int | None,
        writes: bool,
    ):
        self.acc, self.backend, self.model, self.optimizer = accelerator, backend, model, optimizer
        self.output_dir, self.run_config, self.layout = output_dir, run_config, layout
        self.save_total_limit = save_total_limit
        self.writes = writes  # this process makes and names the directories (cluster.Storage.writes)

    def save(self, trainer_state: dict[str, Any]) -> str:
        """Save a resumable checkpoint on every rank, atomically; update `latest`; prune old ones."""
        acc, step = self.acc, trainer_state["step"]
        root = checkpoints_dir(self.output_dir)
        final = os.path.join(root, f"step_{step}")
        tmp = os.path.join(root, f".tmp_step_{step}")
        if self.writes:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        acc.wait_for_everyone()
        acc.save_state(tmp, safe_serialization=True)
        self._write_full_tensors(tmp)
        fault_point("in-checkpoint", step)
        acc.wait_for_everyone()
        if self.writes:
            write_atomic(os.path.join(tmp, CONFIG_FILE), yaml.safe_dump(self.run_config, sort_keys=False))
            state = {**trainer_state, "layout": self.layout}
            write_atomic(os.path.join(tmp, STATE_FILE), json.dumps(state, indent=2))
            if os.path.exists(final):  # e.g. a resumed run saving the step it resumed from
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_atomic(os.path.join(root, LATEST), f"step_{step}\n")
            if self.save_total_limit:
                for _, path in list_checkpoints(self.output_dir)[: -self.save_total_limit]:
                    if path != final:
                        shutil.rmtree(path, ignore_errors=True)
        acc.wait_for_everyone()
        return final

    def _write_full_tensors(self, tmp: str) -> None:
        """What another layout needs to resume (see the module docstring)."""
        net = self.acc.unwrap_model(self.model)
        if self.backend.checkpoint_format == "native":
            return
        if self.backend.checkpoint_format == "full":
            if self.writes:
                net.config.save_pretrained(tmp)  # model.safetensors + config.json: a from_pretrained directory
                name_of = {id(p): n for n, p in net.named_parameters()}
                inner = getattr(self.optimizer, "optimizer", self.optimizer)  # optimizer.bin's order
                names = [name_of[id(p)] for group in inner.param_groups for p in group["params"]]
                write_atomic(os.path.join(tmp, PARAM_NAMES), json.dumps(names))
            return
        from safetensors.torch import save_file

        weights = self.backend.full_state_dict(self.model)  # collectives: every rank takes part
        optim = self.backend.full_optimizer_state(self.model, self.optimizer)
        if self.acc.is_main_process:  # (without a shared output_dir: machine 0's copy only)
            out = os.path.join(tmp, PORTABLE)
            net.save_pretrained(out, state_dict=weights, safe_serialization=True)
            tensors = {
                f"{k}/{n}": v.detach().float().cpu().contiguous() for n, s in optim.items() for k, v in s.items()
            }
            save_file(tensors, os.path.join(out, "optimizer.safetensors"))


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


# ---------------------------------------------------------------- resume


@dataclass
class Resume:
    """The checkpoint a run continues from, and whether it converts from another layout."""

    path: str
    saved: dict[str, Any]  # its trainer_state.json
    portable: bool  # written by another layout: weights and AdamW state go by parameter name

    @property
    def step(self) -> int:
        return self.saved["step"]

    def describe(self) -> str:
        if not self.portable:
            return self.path
        from finetune.parallel.topology import describe_layout

        return f"{self.path} (written by {describe_layout(self.saved['layout'])}, converted)"

    def model_dir(self) -> str:
        """The from_pretrained directory holding the checkpoint's full weights."""
        if self.saved["layout"].get("checkpoint_format") == "portable":
            return os.path.join(self.path, PORTABLE)
        return self.path

    def full_state(self) -> dict[str, dict[str, Any]]:
        """{name: {param (fp32 master), exp_avg, exp_avg_sq}} of the trainable parameters."""
        import torch
        from safetensors.torch import load_file

        portable = os.path.join(self.path, PORTABLE, "optimizer.safetensors")
        if os.path.exists(portable):
            out: dict[str, dict[str, Any]] = {}
            for key, value in load_file(portable).items():
                kind, name = key.split("/", 1)
                out.setdefault(name, {})[kind] = value
            return out
        state = torch.load(os.path.join(self.path, "optimizer.bin"), map_location="cpu", weights_only=True)["state"]
        if not all(isinstance(k, str) for k in state):  # indexed as the optimizer's parameters: names beside it
            with open(os.path.join(self.path, PARAM_NAMES)) as f:
                names = json.load(f)
            state = {names[i]: s for i, s in state.items()}
        weights = load_file(os.path.join(self.path, "model.safetensors"))
        return {
            n: {"param": weights[n], "exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]} for n, s in state.items()
        }


def find_resume(output_dir: str, spec: str | None, layout: dict[str, Any]) -> Resume | None:
    """The checkpoint to continue from (None: start fresh), refused before any model loads when a resume
    under another layout cannot be exact."""
    path = resolve_resume(output_dir, spec)
    if not path:
        return None
    saved = read_trainer_state(path)
    was, here = dict(saved["layout"]), dict(layout)
    batch_was, batch_here = was.pop("global_batch_size"), here.pop("global_batch_size")
    resume = Resume(path, saved, portable=was != here)
    if batch_was != batch_here:
        raise ConfigError(
            [
                (
                    "per_device_train_batch_size",
                    f"{path} was trained with a global batch of {batch_was} and this run has {batch_here}; choose "
                    f"micro batch x gradient_accumulation_steps x data-parallel processes = {batch_was} so the data "
                    "position and schedule carry over",
                )
            ]
        )
    if resume.portable and was.get("checkpoint_format") == "portable" and not os.path.isdir(resume.model_dir()):
        raise ConfigError(
            [
                (
                    "resume_from_checkpoint",
                    f"{resume.describe()} cannot be converted on this machine: it is this machine's own copy of a "
                    f"checkpoint written without a shared output_dir, and its full tensors ({PORTABLE}/) are on "
                    "machine 0 only; resume under the layout that wrote it, or copy "
                    f"{os.path.join(path, PORTABLE)} from machine 0",
                )
            ]
        )
    if resume.portable and "native" in (was.get("checkpoint_format"), here.get("checkpoint_format")):
        raise ConfigError(
            [
                (
                    "resume_from_checkpoint",
                    f"{resume.describe()} cannot be resumed here: a checkpoint in a backend's own format only "
                    "(Megatron-LM) resumes under the layout that wrote it, and other layouts do not resume into "
                    "that backend; use the same Accelerate config, or start from the exported final/ model",
                )
            ]
        )
    return resume


def restore_adapter(backend, net, resume: Resume) -> None:
    """Adapter runs: the base model is the run's own (frozen, unchanged by training); the adapter's trained
    weights are set by name before accelerate.prepare."""
    from finetune.parallel.ddp import trainable_parameters

    weights = {n: s["param"] for n, s in resume.full_state().items()}
    named = trainable_parameters(net)
    _check_same_parameters(resume.path, named, weights)
    backend.set_weights_by_name(named, weights)


def _check_same_parameters(path: str, named: dict, state: dict) -> None:
    differ = set(named) ^ set(state)
    if differ:
        raise RuntimeError(f"checkpoint {path} and this model disagree on parameters: {sorted(differ)[:5]}")


def restore(accelerator, backend, model, optimizer, scheduler, plan, resume: Resume) -> dict[str, Any]:
    """Restore model, optimizer, scheduler (and, same layout, RNG) on every rank; return the trainer state."""
    if not resume.portable:
        backend.load_state(resume.path)
        return resume.saved
    from finetune.optim import set_scheduler_position
    from finetune.parallel.ddp import trainable_parameters

    state = resume.full_state()
    _check_same_parameters(resume.path, trainable_parameters(accelerator.unwrap_model(model)), state)
    backend.set_full_optimizer_state(model, optimizer, state, resume.step)
    set_scheduler_position(scheduler, plan.scheduler_position(resume.step))
    return resume.saved
