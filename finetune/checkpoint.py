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
Either from_pretrained directory holds the run's tokenizer too: it loads whole, as final/ does (a new run's model,
an eval, a server).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import yaml

from finetune.cluster import host_gather, host_wait
from finetune.config import ROW_FIELDS, ConfigError
from finetune.config.preflight import (
    CONFIG_FILE,
    LATEST,
    PORTABLE,
    STATE_FILE,
    checkpoints_dir,
    list_checkpoints,
    named_by_latest,
    resolve_resume,
)
from finetune.config.schema import config_differences
from finetune.faults import fault_point
from finetune.formats import at_rest
from finetune.parallel.base import save_from_this_process, unwrap
from finetune.parallel.topology import (
    describe_layout,
    has_portable_copy,
    native_layout_changes,
    resumes_across_layouts,
    writes_whole_tensors,
)

PARAM_NAMES = "optimizer_param_names.json"
MANIFEST = "manifest.json"


HALF_WRITTEN = ".tmp_step_"  # a checkpoint being written: checkpoints/.tmp_step_<N>, renamed step_<N> once complete
REPLACED = ".replaced"  # a directory replace_directory replaced: <name>.replaced<pid>, removed once the new one is in


def remove_half_written(output_dir: str) -> list[str]:
    """Remove what a stopped run left half done; the paths removed. A resumed (or replacing) run would otherwise leave
    each one on disk, a whole checkpoint's or model's size:
      - checkpoints it was writing (checkpoints/.tmp_step_N: never complete, never resumed from);
      - old copies it was removing after writing them anew (replace_directory): checkpoints/step_N.replaced<pid>
        beside the new step_N, and final.replaced<pid> beside the new final/. One without its new copy beside it
        (a stop between replace_directory's two renames) is the only copy, and kept."""
    replaced = re.escape(REPLACED) + r"\d+"
    removed = _remove_leftovers(checkpoints_dir(output_dir), re.escape(HALF_WRITTEN) + r"\d+|(step_\d+)" + replaced)
    return removed + _remove_leftovers(output_dir, r"(final)" + replaced)


def _remove_leftovers(root: str, pattern: str) -> list[str]:
    """Remove the entries of root whose name matches pattern in full, where its group 1 (the name of the new copy),
    if it has one, is an entry of root too; the paths removed."""
    listed = sorted(os.listdir(root)) if os.path.isdir(root) else []
    leftover = re.compile(pattern)
    names = [n for n in listed if (m := leftover.fullmatch(n)) and (m.group(1) is None or m.group(1) in listed)]
    for name in names:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return [os.path.join(root, name) for name in names]


def replace_directory(tmp: str, final: str) -> None:
    """The directory `tmp` as `final`. An earlier `final` is renamed aside first and removed after: removed first (a
    checkpoint of hundreds of GB takes minutes), a run stopped meanwhile would have neither."""
    if not os.path.exists(final):
        os.replace(tmp, final)
        return
    aside = f"{final}{REPLACED}{os.getpid()}"
    os.replace(final, aside)
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


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
        tokenizer,
    ):
        self.acc, self.backend, self.model, self.optimizer = accelerator, backend, model, optimizer
        self.tokenizer = tokenizer  # beside the weights: a checkpoint's from_pretrained directory loads whole
        self.output_dir, self.run_config, self.layout = output_dir, run_config, layout
        self.save_total_limit = save_total_limit
        self.writes = writes  # this process makes and names the directories (cluster.Storage.writes)

    def save(self, trainer_state: dict[str, Any]) -> str:
        """Save a resumable checkpoint on every rank, atomically; update `latest`; prune old ones.

        A write error on any rank (a full disk, an I/O error) removes the half-written checkpoint and stops
        the run with one message (CheckpointWriteError); `latest` still names the previous checkpoint."""
        acc, step = self.acc, trainer_state["step"]
        root = checkpoints_dir(self.output_dir)
        final = os.path.join(root, f"step_{step}")
        tmp = os.path.join(root, f"{HALF_WRITTEN}{step}")
        error = None
        if self.writes:
            shutil.rmtree(tmp, ignore_errors=True)
            error = attempt_write(os.makedirs, tmp) or attempt_write(fault_point, "enospc-making-checkpoint", step)
        # save_state and _write_full_tensors hold collectives: every rank enters each, or none after an error
        if _none_failed(error):
            safe = self.backend.writes_after_its_collectives()
            error = attempt_write(acc.save_state, tmp, safe_serialization=True, torch_save_errors=safe)
        if _none_failed(error):
            error = attempt_write(self._write_full_tensors, tmp)
        if error is None:
            error = attempt_write(fault_point, "enospc-in-checkpoint", step)
        fault_point("in-checkpoint", step)
        host_wait()
        if self.writes and error is None:
            error = attempt_write(self._write_metadata, tmp, trainer_state)
        self._raise_if_any_failed(error, step, tmp)
        # Named complete by the writer; its error (a full disk at `latest`, a network filesystem's) ends every rank
        # with the same message, not the writer alone while the others wait
        self._raise_if_any_failed(attempt_write(self._publish, tmp, final, step) if self.writes else None, step, tmp)
        if self.writes and self.save_total_limit:
            best = trainer_state.get("best_step")  # finetune.best: never pruned
            for old_step, path in list_checkpoints(self.output_dir)[: -self.save_total_limit]:
                if path != final and old_step != best:
                    shutil.rmtree(path, ignore_errors=True)
        host_wait()
        return final

    def _publish(self, tmp: str, final: str, step: int) -> None:
        """The written checkpoint in place, then `latest` naming it (each step atomic)."""
        replace_directory(tmp, final)  # a step_N there: a resumed run saving the step it resumed from
        fault_point("enospc-naming-checkpoint", step)
        write_atomic(os.path.join(os.path.dirname(final), LATEST), f"step_{step}\n")

    def _write_metadata(self, tmp: str, trainer_state: dict[str, Any]) -> None:
        """The run config, the manifest of every file (size and SHA-256, verified at resume), and last the
        trainer state, which marks the checkpoint complete."""
        write_atomic(os.path.join(tmp, CONFIG_FILE), yaml.safe_dump(self.run_config, sort_keys=False))
        fault_point("slow-checksum", trainer_state["step"])  # tests: the checksums of hundreds of GB
        write_atomic(os.path.join(tmp, MANIFEST), json.dumps(manifest_of(tmp), indent=1))
        state = {**trainer_state, "layout": self.layout}
        write_atomic(os.path.join(tmp, STATE_FILE), json.dumps(state, indent=2))

    def _raise_if_any_failed(self, error: OSError | None, step: int, tmp: str) -> None:
        where = which_failed(host_gather(report(self.acc.process_index, error)))
        if not where:
            return
        previous = latest_complete(self.output_dir)
        needs = _size_of(previous) if previous else _size_of(tmp)
        host_wait()  # every rank has measured before the writer removes what it measured
        if self.writes:
            shutil.rmtree(tmp, ignore_errors=True)
        host_wait()
        free = shutil.disk_usage(self.output_dir).free if os.path.isdir(self.output_dir) else 0
        kept = f"{previous} is intact and `latest` still names it" if previous else "no earlier checkpoint exists"
        raise CheckpointWriteError(
            f"could not write checkpoint step_{step} ({where}). A checkpoint of this run takes about "
            f"{_in_units(needs)}; {_in_units(free)} are free under {self.output_dir}. {kept}. Free space, "
            "set save_total_limit (keep fewer checkpoints) or choose another output_dir, then continue with "
            "--resume_from_checkpoint latest."
        )

    def _write_full_tensors(self, tmp: str) -> None:
        """What another layout needs to resume (see the module docstring)."""
        net = unwrap(self.acc, self.model)
        if not resumes_across_layouts(self.layout):
            return
        if writes_whole_tensors(self.layout):
            if self.writes:
                # model.safetensors + config.json (+ generation_config.json, as save_pretrained writes it): a
                # from_pretrained directory. Without the base's generation settings from_pretrained derives them from
                # config.json, and final/ from the best checkpoint or a converted resume lost them (sampling, eos list)
                net.config.save_pretrained(tmp)
                if getattr(net, "generation_config", None) is not None:  # models that generate
                    net.generation_config.save_pretrained(tmp)
                at_rest(self.tokenizer).save_pretrained(tmp)
                name_of = {id(p): n for n, p in net.named_parameters()}
                inner = getattr(self.optimizer, "optimizer", self.optimizer)  # optimizer.bin's order
                names = [name_of[id(p)] for group in inner.param_groups for p in group["params"]]
                write_atomic(os.path.join(tmp, PARAM_NAMES), json.dumps(names))
            return
        from safetensors.torch import save_file

        weights = self.backend.full_state_dict(self.model)  # collectives: every rank takes part
        moments = self.backend.full_adam_moments(self.model, self.optimizer)
        if self.acc.is_main_process:  # (without a shared output_dir: machine 0's copy only)
            out = os.path.join(tmp, PORTABLE)
            # a copy: save_pretrained removes entries from the dict it is given (tied names; every one it writes)
            save_from_this_process(net, out, state_dict=dict(weights), safe_serialization=True)
            at_rest(self.tokenizer).save_pretrained(out)
            # The fp32 masters are the full state dict's trainable weights (gathered once, not again with the moments)
            tensors = {f"param/{n}": weights[n].detach().float().cpu().contiguous() for n in moments}
            tensors |= {
                f"{k}/{n}": v.detach().float().cpu().contiguous() for n, s in moments.items() for k, v in s.items()
            }
            save_file(tensors, os.path.join(out, "optimizer.safetensors"))


class WriteError(Exception):
    """An output of the run could not be written (a full disk, an I/O error); the message says what is intact."""


class CheckpointWriteError(WriteError):
    """A checkpoint could not be written; the previous one is intact."""


class WriteFailedElsewhere(OSError):
    """What a rank meets when a checkpoint writer that works across ranks (torch distributed checkpoint, Megatron-LM's)
    raises on it for another rank's write error: `rank` is that rank where the writer said (else None)."""

    def __init__(self, rank: int | None, text: str):
        super().__init__(errno.EIO, text)
        self.rank = rank


def report(process_index: int, error: OSError | None) -> tuple[int | None, str, bool] | None:
    """What a rank says of its write step, for which_failed: (the rank that failed, its error, whether first-hand)."""
    if error is None:
        return None
    if isinstance(error, WriteFailedElsewhere):
        return error.rank, error.strerror, False
    return process_index, str(error), True


def which_failed(reports: list) -> str:
    """ "rank N: error; ..." from every rank's report (empty: none failed). The ranks' own errors; where none has its own
    (a writer that told one rank of another's failure), what they were told."""
    said = [r for r in reports if r]
    first_hand = [(rank, text) for rank, text, own in said if own]
    told = list(dict.fromkeys((rank, text) for rank, text, own in said if not own and rank is not None))
    failed = first_hand or told or [(None, text) for _, text, _ in said[:1]]
    return "; ".join(text if rank is None else f"rank {rank}: {text}" for rank, text in failed[:3])


def _none_failed(error: OSError | None) -> bool:
    """Whether no rank has a write error so far (every rank asks: a barrier)."""
    return not any(host_gather(error is not None))


def attempt_write(fn, *args, torch_save_errors: bool = True, **kwargs) -> OSError | None:
    """Run a step of writing a checkpoint or final/; the OSError it raised, if any (collected from every rank).
    torch_save_errors False: torch.save's failures (TORCH_WRITER_FAILED) stay crashes, where a collective follows
    them that the other ranks would wait in (backend.writes_after_its_collectives)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        io = as_os_error(e, torch_save_errors)
        if io is None:
            raise
        return io
    except BaseException as e:
        # torch distributed checkpoint (FSDP's, Megatron-LM's) raises a CheckpointException (a BaseException) on every
        # rank, holding each failed rank's exception (torch's: on every rank; Megatron's: on the coordinator only):
        # this rank's own is its write error; another's, the write error of that rank (WriteFailedElsewhere)
        failures = getattr(e, "failures", None) if type(e).__name__ == "CheckpointException" else None
        if not isinstance(failures, dict):
            raise
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        errors = {r: as_os_error(wrapped[0]) for r, wrapped in failures.items()}
        if None in errors.values():  # not a write error: a crash
            raise
        if rank in errors:
            return errors[rank]
        if errors:
            return WriteFailedElsewhere(*next((r, str(io)) for r, io in errors.items()))
        return WriteFailedElsewhere(None, "a checkpoint write failed on another rank (the writer did not say which)")
    return None


# torch.save's zip writer (PyTorchStreamWriter, C++) reports a failed write as a RuntimeError without the errno: on a
# full disk "basic_ios::clear: iostream error" from the record, then "[enforce fail at inline_container.cc:672] .
# unexpected pos 743232 vs 743120" from closing the file (seen writing optimizer.bin on a full tmpfs)
TORCH_WRITER_FAILED = re.compile(r"inline_container\.cc.*unexpected pos|PytorchStreamWriter failed|iostream error")


def as_os_error(e: BaseException, torch_save: bool = True) -> OSError | None:
    """The OSError behind a failed write. safetensors' Rust writer raises its own SafetensorError for one
    ("Error while serializing: I/O error: No space left on device (os error 28)"), and torch.save a RuntimeError
    (TORCH_WRITER_FAILED; not with torch_save False), not an OSError: read back; as is Megatron-LM's report of its
    writer processes' ("Worker failure: [Errno 28] No space left on device: ...", gathered without its cause). An
    error raised *from* an OSError is not one: backends raise those to end a rank that others wait for
    (parallel/tensor.py's save_pretrained)."""
    if isinstance(e, OSError):
        return e
    found = re.search(r"I/O error: (.*) \(os error (\d+)\)", str(e))
    if type(e).__name__ == "SafetensorError" and found:
        return OSError(int(found.group(2)), found.group(1))
    if torch_save and isinstance(e, RuntimeError) and TORCH_WRITER_FAILED.search(str(e)):
        return OSError(errno.EIO, f"torch.save could not write a file, a full disk or an I/O error ({e})")
    worker = re.match(r"Worker failure: \[Errno (\d+)\] (.*)", str(e), re.S)
    if isinstance(e, RuntimeError) and worker:
        return OSError(int(worker.group(1)), worker.group(2))
    return None


def _in_units(n: int) -> str:
    """A size in the largest unit that leaves it at least 1 (1.23 GB, 45.60 MB, 789.00 KB): a small checkpoint is not
    "0.00 GB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


def _size_of(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def manifest_of(directory: str) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file under `directory` (but the manifest itself)."""
    paths = {}
    for d, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, directory)
            if rel != MANIFEST:
                paths[rel] = path
    digests = _sha256s(list(paths.values()))
    return {rel: [os.path.getsize(path), digests[path]] for rel, path in sorted(paths.items())}


def _sha256s(paths: list[str]) -> dict[str, str]:
    """Each file's SHA-256, several files at once (hashlib leaves the interpreter lock while it hashes): the other
    ranks wait inside the collective timeout while the writer hashes a checkpoint, hundreds of GB for a large
    model, and a one-file-at-a-time hash runs at about one core's 1-2 GB/s."""
    from concurrent.futures import ThreadPoolExecutor

    from finetune.cluster import usable_cores

    workers = max(1, min(8, len(paths), usable_cores()))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(paths, pool.map(_sha256, paths)))


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def damage(path: str) -> str | None:
    """What is wrong with a checkpoint, checked against the manifest written with it; None: intact."""
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        return f"{STATE_FILE} is missing (an incomplete checkpoint)"
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None  # written before manifests existed: nothing to check against
    except (OSError, json.JSONDecodeError) as e:
        return f"{MANIFEST} cannot be read ({type(e).__name__})"
    for rel, (size, _) in manifest.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != size:
            return f"{rel} has {os.path.getsize(full)} bytes, {size} were written"
    digests = _sha256s([os.path.join(path, rel) for rel in manifest])
    for rel, (_, digest) in manifest.items():
        if digests[os.path.join(path, rel)] != digest:
            return f"{rel} does not match its checksum (damaged)"
    return None


def latest_complete(output_dir: str) -> str | None:
    """The checkpoint `latest` names, if there is one."""
    try:
        return named_by_latest(output_dir)
    except OSError:
        return None


def resume_hint(output_dir: str) -> str:
    """What a user should do after a crash, naming the last complete checkpoint."""
    try:
        last = resolve_resume(output_dir, LATEST)  # where `latest` is missing: the newest complete checkpoint
    except OSError:
        last = None
    if last is None:
        return (
            "No checkpoint was completed; start the run again: the same command plus --resume_from_checkpoint auto "
            "(which starts afresh where there is no checkpoint), or plus --overwrite_output_dir true."
        )
    return f"Last complete checkpoint: {last}. Continue with the same command plus --resume_from_checkpoint latest."


def choose(output_dir: str, spec: str | None) -> tuple[str | None, list[tuple[str, str]]]:
    """The checkpoint to continue from (None: start fresh), verified against its manifest, and the damaged
    ones skipped on the way as (path, what is wrong). With latest/auto that is the newest intact checkpoint;
    a path names one, and a damaged one is refused."""
    path = resolve_resume(output_dir, spec)
    if not path:
        return None, []
    if spec not in (LATEST, "auto"):
        why = damage(path) if os.path.isfile(os.path.join(path, STATE_FILE)) else None  # else: read_trainer_state
        if why:
            raise ConfigError(
                [
                    (
                        "resume_from_checkpoint",
                        f"{path} is damaged: {why}; give an older checkpoints/step_N, or 'latest', which skips "
                        "damaged checkpoints",
                    )
                ]
            )
        return path, []
    newest = int(re.sub(r"\D", "", os.path.basename(path)) or 0)
    older = [p for step, p in reversed(list_checkpoints(output_dir)) if step < newest]
    skipped = []
    for candidate in [path, *older]:
        why = damage(candidate)
        if why is None:
            return candidate, skipped
        skipped.append((candidate, why))
    raise ConfigError(
        [
            (
                "resume_from_checkpoint",
                f"every checkpoint under {checkpoints_dir(output_dir)} is damaged ("
                + "; ".join(f"{os.path.basename(p)}: {why}" for p, why in skipped)
                + "); start fresh with --overwrite_output_dir true, or restore a checkpoint from a backup",
            )
        ]
    )


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
    changes: list = dataclasses.field(default_factory=list)  # (key, in the checkpoint, now): applied

    @property
    def step(self) -> int:
        return self.saved["step"]

    @property
    def updates(self) -> int:
        """The optimizer updates applied up to the step: fp16's skipped steps (the loss scaler found an overflow)
        stepped neither AdamW nor the LR schedule (accelerate steps the schedule only after an applied update)."""
        return self.step - self.saved.get("skipped_steps", 0)

    def describe(self) -> str:
        if not self.portable:
            return self.path
        return f"{self.path} (written by {describe_layout(self.saved['layout'])}, converted)"

    def model_dir(self) -> str:
        """The from_pretrained directory holding the checkpoint's full weights."""
        if has_portable_copy(self.saved["layout"]):
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
        # mmap: the file's pages, shared by the ranks of a machine that all read it (as safetensors' are), not a
        # private copy of 8 bytes per parameter in every rank
        path = os.path.join(self.path, "optimizer.bin")
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["state"]
        if not all(isinstance(k, str) for k in state):  # indexed as the optimizer's parameters: names beside it
            with open(os.path.join(self.path, PARAM_NAMES)) as f:
                names = json.load(f)
            state = {names[i]: s for i, s in state.items()}
        weights = load_file(os.path.join(self.path, "model.safetensors"))
        return {
            n: {"param": weights[n], "exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]} for n, s in state.items()
        }


# Run-config values a resume cannot change: the model and how it reads text (chat_template), what is trained (task,
# method, the adapter's shape), every data field that shapes the rows (config.ROW_FIELDS, as prepared data checks
# them: the saved data position counts rows), their order (seed), and what picks the best checkpoint. (The global
# batch is checked from the layout.) Anything else changed on resume is applied and logged.
FIXED_ON_RESUME = (
    "model",
    "task",
    "chat_template",
    "method",
    *ROW_FIELDS,
    "seed",
    "metric_for_best_model",
    "greater_is_better",
    "peft.method",
    "peft.r",
    "peft.alpha",
    "peft.target_modules",
    "peft.modules_to_save",
)
SCHEDULE_KEYS = {"learning_rate", "max_steps", "num_train_epochs", "warmup_steps", "warmup_ratio", "lr_scheduler_type"}


def config_changes(path: str, run_config: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, in the checkpoint, now) for every run-config value that differs from the checkpoint's; a value
    the resume cannot change is refused (ConfigError), naming the key and the fix."""
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            saved = yaml.safe_load(f) or {}
    except OSError:
        return []
    changes = config_differences(saved, run_config)
    fixed = [(k, was, now) for k, was, now in changes if k in FIXED_ON_RESUME]
    if fixed:
        raise ConfigError(
            [
                (
                    k,
                    f"is {now!r} but {path} was trained with {was!r}; a resume continues the same run, so set it back "
                    "to the checkpoint's value, or start a new run in another output_dir",
                )
                for k, was, now in fixed
            ]
        )
    return changes


def find_resume(path: str | None, layout: dict[str, Any], run_config: dict[str, Any]) -> Resume | None:
    """The Resume of the chosen checkpoint (`choose`; None: start fresh), refused before any model loads when a
    resume under another layout cannot be exact, or when the run config changes what a resume cannot."""
    if not path:
        return None
    saved = read_trainer_state(path)
    # (a layout entry that the checkpoint's writer did not record yet is not compared: it resumes as it did then)
    was, here = dict(saved["layout"]), {k: v for k, v in layout.items() if k in saved["layout"]}
    batch_was, batch_here = was.pop("global_batch_size"), here.pop("global_batch_size")
    resume = Resume(path, saved, portable=was != here, changes=config_changes(path, run_config))
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
    if resume.portable and has_portable_copy(was) and not os.path.isdir(resume.model_dir()):
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
    if resume.portable and not (resumes_across_layouts(was) and resumes_across_layouts(here)):
        raise ConfigError(
            [
                (
                    "resume_from_checkpoint",
                    f"{path} was written by {describe_layout(saved['layout'])} and cannot be resumed by this run, "
                    f"{describe_layout(layout)} ({'; '.join(native_layout_changes(was, here))}): a checkpoint in a "
                    "backend's own format only (Megatron-LM) resumes under the layout that wrote it, and other "
                    "layouts do not resume into that backend; set those back in the Accelerate config (or on the "
                    "accelerate launch command line), or start from the exported final/ model",
                )
            ]
        )
    return resume


def restore_adapter(backend, net, resume: Resume) -> None:
    """Adapter runs: the base model is the run's own (frozen, unchanged by training); the adapter's trained
    weights are set by name before accelerate.prepare."""
    from finetune.parallel.base import trainable_parameters

    weights = {n: s["param"] for n, s in resume.full_state().items()}
    named = trainable_parameters(net)
    _check_same_parameters(resume.path, named, weights)
    backend.set_weights_by_name(named, weights)


def _check_same_parameters(path: str, named: dict, state: dict) -> None:
    differ = set(named) ^ set(state)
    if differ:
        raise RuntimeError(f"checkpoint {path} and this model disagree on parameters: {sorted(differ)[:5]}")


def restore(accelerator, backend, model, optimizer, scheduler, plan, resume: Resume, learning_rate: float) -> dict:
    """Restore model, optimizer, scheduler (and, same layout, RNG) on every rank; return the trainer state.
    A changed learning rate or schedule applies from the resumed step on."""
    from finetune.optim import reschedule, set_scheduler_position

    if not resume.portable:
        backend.load_state(resume.path)
        if {k for k, _, _ in resume.changes} & SCHEDULE_KEYS:
            reschedule(scheduler, learning_rate, plan.scheduler_position(resume.updates))
        return resume.saved
    from finetune.parallel.base import trainable_parameters

    state = resume.full_state()
    _check_same_parameters(resume.path, trainable_parameters(unwrap(accelerator, model)), state)
    backend.set_full_optimizer_state(model, optimizer, state, resume.updates)
    set_scheduler_position(scheduler, plan.scheduler_position(resume.updates))
    return resume.saved
