"""What the config's values say about the disk and the environment, checked before anything loads:
local model and data files, shipped metrics offline, the Hub token, output_dir and resume_from_checkpoint."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from finetune.config.rules import encoder_decoder_problems, position_problems
from finetune.config.schema import (
    CARD_MARK,
    DATA_EXTENSIONS,
    HUB_REPO_ID,
    MODEL_CARD,
    RUN_MARKERS,
    Finished,
    PeftArgs,
    RunConfig,
    TrainArgs,
    config_differences,
    hub_repo_id,
    shipped_metrics,
)


def looks_local(spec: str) -> bool:
    """True when a model/dataset spec names a local path rather than a Hub id."""
    return (
        spec.startswith((".", "/", "~"))
        or Path(spec).suffix.lower() in DATA_EXTENSIONS
        or any(c in spec for c in "*?[")
        or spec.count("/") > 1
        or os.path.exists(spec)
    )


def data_files(spec: str) -> list[str]:
    """The files a local dataset spec names: the files its glob matches, and the data files under the
    directories it matches."""
    import glob

    files = []
    for p in sorted(glob.glob(os.path.expanduser(spec))):
        if os.path.isdir(p):
            files += sorted(str(f) for f in Path(p).rglob("*") if f.suffix.lower() in DATA_EXTENSIONS)
        elif os.path.isfile(p):
            files.append(p)
    return files


def check_data_path(problems: list, key: str, spec: str) -> None:
    if not looks_local(spec):
        return
    import glob

    if not any(os.path.isfile(p) or os.path.isdir(p) for p in glob.glob(os.path.expanduser(spec))):
        problems.append((key, f"no file or directory matches {spec!r}; give an existing path or a Hub dataset id"))
        return
    files = data_files(spec)
    extensions = ", ".join(DATA_EXTENSIONS)
    unsupported = [f for f in files if Path(f).suffix.lower() not in DATA_EXTENSIONS]
    kinds = sorted({DATA_EXTENSIONS.get(Path(f).suffix.lower()) for f in files} - {None})
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    empty = [f for f in files if f not in unreadable and os.path.getsize(f) == 0]
    if unsupported:
        problems.append((key, f"{unsupported[0]!r} has an unsupported extension; use one of {extensions}"))
    elif not files:
        problems.append(
            (key, f"{spec!r} holds no data files; add {extensions} files to it, or give the files themselves")
        )
    elif len(kinds) > 1:
        problems.append(
            (key, f"{spec!r} names files of {len(kinds)} kinds ({', '.join(kinds)}); give files of one kind")
        )
    elif unreadable:
        problems.append((key, f"{unreadable[0]!r} is not readable; fix its permissions"))
    elif empty:
        problems.append((key, f"{empty[0]!r} is empty; give a file with examples (or leave it out)"))


def check_model_config(problems: list, model_dir: str, max_seq_length: int, task: str = "causal_lm") -> None:
    """What the model directory's config.json alone tells: that it is readable, how many positions fit, and
    whether it is an encoder-decoder (task seq2seq) or not."""
    import json

    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        problems.append(("model", f"cannot read {path} ({e}); point at a directory saved with save_pretrained"))
        return
    if not isinstance(config, dict):
        config = {}
    problems += encoder_decoder_problems(
        task, bool(config.get("is_encoder_decoder")), model_dir, config.get("model_type")
    )
    problems += position_problems(model_dir, config, max_seq_length)


def hub_offline() -> bool:
    return any(
        os.environ.get(k, "").upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE")
    )


def check_metrics(problems: list, names: list[str], key: str = "metrics") -> None:
    """Offline, only the metrics shipped with finetune and local metric directories can load."""
    if not hub_offline():
        return
    shipped = shipped_metrics()
    missing = [n for n in names if n not in shipped and not os.path.exists(n)]
    if missing:
        problems.append(
            (
                key,
                f"{', '.join(map(repr, missing))} not shipped with finetune and the Hub is offline (HF_HUB_OFFLINE); "
                f"use {', '.join(shipped)} or the path of a local evaluate metric",
            )
        )


def check_hub(problems: list, t: TrainArgs) -> None:
    """push_to_hub: a valid repository name, the Hub reachable by configuration, and a token; said before
    anything loads (not after hours of training). The token itself is only looked up, never kept."""
    import re

    if not t.push_to_hub:
        return
    if not re.fullmatch(HUB_REPO_ID, hub_repo_id(t)) or ".." in hub_repo_id(t):
        problems.append(
            (
                "hub_model_id",
                f"{hub_repo_id(t)!r} is not a Hub repository name; give namespace/name or name "
                "(letters, digits, '-', '_', '.')",
            )
        )
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        problems.append(
            (
                "push_to_hub",
                "the Hub is offline here (HF_HUB_OFFLINE is set); unset HF_HUB_OFFLINE on a machine "
                "with network, or set push_to_hub: false and upload final/ later (`hf upload`)",
            )
        )
        return
    from huggingface_hub import get_token

    if not get_token():
        problems.append(
            (
                "push_to_hub",
                "no Hugging Face token found; run `hf auth login` or set HF_TOKEN, or set push_to_hub: false",
            )
        )


def previous_run_in(output_dir: str) -> list[str]:
    """The markers of a previous run found in output_dir (empty if none)."""
    return [m for m in RUN_MARKERS if os.path.exists(os.path.join(output_dir, m))]


def adapter_problems(pe: PeftArgs) -> list[tuple[str, str]]:
    if pe.adapter and not os.path.isfile(os.path.join(pe.adapter, "adapter_config.json")):
        return [("peft.adapter", f"{pe.adapter!r} has no adapter_config.json; give a directory saved by PEFT")]
    return []


def filesystem_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What the values say about the disk and the environment: the model directory, the chat template file, the data
    files, the metrics that load offline, the checkpoint to resume from, a previous run in output_dir."""
    m, d, t = cfg.model, cfg.data, cfg.train
    p = model_dir_problems(m.model, d.max_seq_length, m.task)
    if m.chat_template and len(m.chat_template) < 256 and "{" not in m.chat_template:
        if not os.path.isfile(m.chat_template):
            p.append(
                (
                    "chat_template",
                    f"{m.chat_template!r} is neither a Jinja template nor an existing file; "
                    "give the template text or the path of a template file",
                )
            )
    if d.prepared_data:  # the run reads the prepared rows, not the raw data (which this machine may not have)
        if not os.path.isfile(os.path.join(d.prepared_data, "prepared.json")):
            p.append(
                (
                    "prepared_data",
                    f"{d.prepared_data!r} holds no prepared data (no prepared.json); run `finetune prepare --config "
                    f"<this run's config> --prepared_data {d.prepared_data}` first, or remove prepared_data to read the raw data",
                )
            )
    elif d.dataset and not d.datasets:
        check_data_path(p, "dataset", d.dataset)
    if d.eval_dataset and not d.datasets and not d.prepared_data:
        check_data_path(p, "eval_dataset", d.eval_dataset)
    if t.metrics:
        check_metrics(p, t.metrics)
    if t.generation_max_new_tokens and t.generation_metrics:
        check_metrics(p, t.generation_metrics, "generation_metrics")
    done = cfg.finished  # build_config's finished_run, read once for this check and for cli
    if done and not done.differences:  # nothing left to run: cli says so and exits 0
        return p + resume_problems(t)
    return p + resume_problems(t) + output_dir_problems(t, done)


def model_dir_problems(model: str, max_seq_length: int, task: str) -> list[tuple[str, str]]:
    if model and looks_local(model) and not os.path.isdir(os.path.expanduser(model)):
        return [("model", f"directory {model!r} does not exist; give a model directory (with config.json) or a Hub id")]
    if not (model and os.path.isdir(model)):
        return []  # a Hub id
    p: list[tuple[str, str]] = []
    if os.path.isfile(os.path.join(model, STATE_FILE)):  # a finetune checkpoint
        p += _checkpoint_as_model_problems(model)
    elif not os.path.isfile(os.path.join(model, "config.json")):
        p.append(("model", _not_a_model(model)))
    if not p:
        check_model_config(p, model, max_seq_length, task)
    return p


def _not_a_model(path: str) -> str:
    """Why a directory without config.json is no model, and what to give: an adapter (a LoRA run's final/), a
    finetune run's output_dir (its final/ is), or anything else."""
    final = os.path.join(path, "final")
    run = os.path.isfile(os.path.join(path, CONFIG_FILE))
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return f"{path!r} is an adapter (adapter_config.json), not a model: {_ways_on_with(path)}"
    if run and os.path.isfile(os.path.join(final, "adapter_config.json")):
        return f"{path!r} is the output_dir of an adapter run, not a model: {_ways_on_with(final)}"
    if run and os.path.isfile(os.path.join(final, "config.json")):
        return f"{path!r} is a finetune run's output_dir, not a model: set model to its final/ ({final})"
    return f"{path!r} has no config.json; point at a directory saved with save_pretrained"


def _ways_on_with(adapter: str) -> str:
    """How to train on from an adapter directory: on its base (adapter_config.json's), or its merge."""
    try:
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            base = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    merged = os.path.join(adapter, "merged")  # peft.merge's, or finetune merge's by default
    merge = merged if os.path.isdir(merged) else f"finetune merge {adapter} writes it to {merged}"
    return (
        f"set model to its base model ({base!r}) and peft.adapter to {adapter} to train the adapter on, or give its "
        f"merge ({merge}) as model"
    )


def _checkpoint_as_model_problems(path: str) -> list[tuple[str, str]]:
    """A finetune checkpoint named as a run's model: a whole-model run's loads through from_pretrained (the
    checkpoint, or its PORTABLE copy); an adapter run's holds PEFT's names for its base's weights beside the
    adapter's, which from_pretrained leaves unused (every weight drawn anew, said in one log line)."""
    saved = run_config_in(path)  # unreadable: what from_pretrained makes of it says the rest
    peft = saved.get("peft")
    method, base = peft.get("method", "none") if isinstance(peft, dict) else "none", saved.get("model")
    resume = f"continue it with resume_from_checkpoint: {path} (in a new output_dir, a run of its own)"
    if method != "none":
        why = (
            f"{path!r} is a checkpoint of an adapter run (peft.method {method}): from_pretrained would use none of "
            f"its weights. To train on from it, {resume}; with max_steps at its step that run trains nothing and "
            f"its final/ is the checkpoint's adapter, to give as peft.adapter with model: its base ({base!r})"
        )
        return [("model", why)]
    if os.path.isfile(os.path.join(path, "config.json")):
        return []
    portable = os.path.join(path, PORTABLE)
    if os.path.isfile(os.path.join(portable, "config.json")):
        return [("model", f"{path!r} is a checkpoint whose whole model is in {PORTABLE}/: set model to {portable}")]
    return [
        ("model", f"{path!r} is a checkpoint whose layout alone reads its weights (no from_pretrained copy); {resume}")
    ]


# ---------------------------------------------------------------- resume_from_checkpoint and output_dir

LATEST = "latest"  # checkpoints/latest names the newest complete checkpoint
STATE_FILE = "trainer_state.json"  # written last into a checkpoint: it marks the checkpoint complete
CONFIG_FILE = "run_config.yaml"  # the run's config, in each checkpoint, final/ and output_dir
PORTABLE = "portable"  # a checkpoint's from_pretrained copy of the whole model under DeepSpeed and FSDP2


def run_config_in(directory: str) -> dict:
    """The run config a run wrote into directory (its CONFIG_FILE: a checkpoint, final/, output_dir); {} without a
    readable one."""
    import yaml

    try:
        with open(os.path.join(directory, CONFIG_FILE)) as f:
            said = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return said if isinstance(said, dict) else {}


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def outside_checkpoints(output_dir: str, spec: str) -> bool:
    """The checkpoint path `spec` is not in <output_dir>/checkpoints: another run's."""
    return os.path.dirname(os.path.realpath(spec)) != os.path.realpath(checkpoints_dir(output_dir))


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


def latest_missing(output_dir: str) -> bool:
    """output_dir has a complete checkpoint but no `latest` naming one: a run stopped after completing its first
    checkpoint and before naming it (a full disk or a kill between the two). `latest` and `auto` resume from the
    newest complete checkpoint then (checked against its manifest as always), not from nothing."""
    return not os.path.exists(os.path.join(checkpoints_dir(output_dir), LATEST)) and bool(list_checkpoints(output_dir))


def has_checkpoint(output_dir: str) -> bool:
    """output_dir has a checkpoint to resume from: the one `latest` names, or (latest_missing) a complete one."""
    return os.path.exists(os.path.join(checkpoints_dir(output_dir), LATEST)) or latest_missing(output_dir)


def resume_spec(output_dir: str, spec: str | None) -> str | None:
    """resume_from_checkpoint as it applies: auto is latest when output_dir has a checkpoint, else None (fresh); the
    other run's checkpoint that output_dir's run started from is latest too once that run has one (restarts_its_start)."""
    has_own = has_checkpoint(output_dir)
    if spec == "auto":
        return LATEST if has_own else None
    if has_own and spec not in (None, LATEST) and restarts_its_start(output_dir, spec):
        return LATEST
    return spec


def restarts_its_start(output_dir: str, spec: str) -> bool:
    """spec is the other run's checkpoint that the run in output_dir started from (its run_config.yaml says so): this
    is that run again, the same command (a launcher's restart, --max_restarts; a requeued job). It continues from its
    own newest checkpoint, or, having none, starts over from spec."""
    started = run_config_in(output_dir).get("resume_from_checkpoint")
    return (
        outside_checkpoints(output_dir, spec)
        and isinstance(started, str)
        and os.path.realpath(started) == os.path.realpath(spec)
    )


def resolve_resume(output_dir: str, spec: str | None) -> str | None:
    """The checkpoint directory that `resume_from_checkpoint` (latest, auto or a path) names; None: start fresh."""
    spec = resume_spec(output_dir, spec)
    if spec != LATEST:
        return spec
    if latest_missing(output_dir):
        return list_checkpoints(output_dir)[-1][1]
    return named_by_latest(output_dir)


def named_by_latest(output_dir: str) -> str:
    """The checkpoint checkpoints/latest names (OSError without one)."""
    with open(os.path.join(checkpoints_dir(output_dir), LATEST)) as f:
        return os.path.join(checkpoints_dir(output_dir), f.read().strip())


def resume_problems(t: TrainArgs) -> list[tuple[str, str]]:
    resume = resume_spec(t.output_dir, t.resume_from_checkpoint)
    latest = os.path.join(checkpoints_dir(t.output_dir), LATEST)
    if resume and resume != LATEST and not os.path.isdir(resume):
        return [
            ("resume_from_checkpoint", f"{resume!r} is not a directory; give 'latest' or a checkpoints/step_N path")
        ]
    if resume == LATEST and not has_checkpoint(t.output_dir):
        why = (
            f"'latest' but {t.output_dir}/checkpoints has no complete checkpoint; to start afresh there, give 'auto' "
            "instead (the newest checkpoint, or a fresh start where there is none), or drop it and add "
            "--overwrite_output_dir true"
        )
        return [("resume_from_checkpoint", why)]
    if resume == LATEST:
        try:
            named = resolve_resume(t.output_dir, LATEST)
        except (OSError, UnicodeDecodeError) as e:
            named, why = None, f"cannot read {latest} ({e})"
        else:
            why = f"{latest} names {named}, which is not a directory"
        if named is None or not os.path.isdir(named):
            why = f"'latest' but {why}; give a checkpoints/step_N directory, or drop resume_from_checkpoint to start fresh"
            return [("resume_from_checkpoint", why)]
    return []


def resumes_elsewhere(t: TrainArgs) -> bool:
    """resume_from_checkpoint names a checkpoint outside <output_dir>/checkpoints, another run's: for output_dir this
    run is a start (from that checkpoint), not the continuation of what output_dir holds."""
    spec = resume_spec(t.output_dir, t.resume_from_checkpoint)
    return bool(spec) and spec != LATEST and outside_checkpoints(t.output_dir, spec)


def finished_run(cfg: RunConfig) -> Finished | None:
    """Under --resume_from_checkpoint auto (what a requeued job runs again), the run output_dir holds when it finished:
    final/ is complete (renamed into place whole, export.py) and so is what report.finish writes after it, merged/
    included (the model card, MODEL_CARD with CARD_MARK). With `differences` empty (nothing but NOT_COMPARED differs
    from final/run_config.yaml) it is this very run, and nothing is left to run, not even final/ again: with
    load_best_model_at_end it holds the best step's weights, which a resume would only choose again. None with
    push_to_hub (whether the upload completed is not recorded) and on several machines (final/ is machine 0's alone
    where their output_dirs are not shared: the others would resume or start and wait for it at the join until
    ddp_timeout): those runs go on as before."""
    from finetune.parallel.topology import Launcher

    t = cfg.train
    if t.resume_from_checkpoint != "auto" or t.overwrite_output_dir or t.push_to_hub or not t.output_dir:
        return None
    if Launcher.read().num_machines > 1:
        return None
    import yaml

    final = os.path.join(t.output_dir, "final")
    try:
        with open(os.path.join(final, MODEL_CARD)) as f:
            card = f.read()
        with open(os.path.join(final, CONFIG_FILE)) as f:
            saved = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if CARD_MARK not in card or not isinstance(saved, dict):
        return None
    return Finished(final, last_step(t.output_dir), config_differences(saved, cfg.to_flat()))


def last_step(output_dir: str) -> int | None:
    """The last step metrics.jsonl names (None without one)."""
    step = None
    try:
        with open(os.path.join(output_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut short by a kill
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    step = max(step or 0, row["step"])
    except (OSError, UnicodeDecodeError):
        return None
    return step


def output_dir_problems(t: TrainArgs, finished: Finished | None = None) -> list[tuple[str, str]]:
    """output_dir is a directory, and holds no previous run unless this one resumes (from one of its checkpoints) or
    replaces it."""
    if t.output_dir and os.path.isfile(t.output_dir):
        return [("output_dir", f"{t.output_dir!r} is a file; give a directory")]
    if not t.output_dir:
        return []
    elsewhere = resumes_elsewhere(t)
    if t.overwrite_output_dir:
        return _removed_by_overwrite(t) if elsewhere else []
    if resume_spec(t.output_dir, t.resume_from_checkpoint) and not elsewhere:
        return []
    found = previous_run_in(t.output_dir)
    if t.resume_from_checkpoint == "auto" or (elsewhere and restarts_its_start(t.output_dir, t.resume_from_checkpoint)):
        found = [m for m in found if m == "final"]  # nothing checkpointed: a run that died that early left no final/
    if not found:
        return []
    resume = "resume it with --resume_from_checkpoint latest, " if has_checkpoint(t.output_dir) else ""
    why = (
        f"{t.output_dir!r} holds a previous run ({', '.join(found)}); pick a new output_dir, "
        f"{resume}or replace it with --overwrite_output_dir"
    )
    if finished and finished.differences:
        key, was, now = finished.differences[0]
        more = f" and {len(finished.differences) - 1} more" if len(finished.differences) > 1 else ""
        why += (
            f"; that run finished ({finished.final} is complete) with another run config ({key} was {was!r}, now "
            f"{now!r}{more}), and has no checkpoint to resume from"
        )
    if elsewhere:
        why += (
            f" ({t.resume_from_checkpoint} is not one of its checkpoints: this run would start it over from another "
            "run's checkpoint)"
        )
    from finetune.parallel.topology import Launcher

    restart = Launcher.read().restart
    if restart:  # the launcher restarted this run (--max_restarts): the previous run is its own first attempt
        why += (
            f"; this is the launcher's restart {restart} (--max_restarts): launch with --resume_from_checkpoint auto "
            "so that a restart continues from the newest checkpoint"
        )
    return [("output_dir", why)]


def _removed_by_overwrite(t: TrainArgs) -> list[tuple[str, str]]:
    """overwrite_output_dir with another run's checkpoint: the checkpoint must not be among what it removes."""
    spec = os.path.realpath(t.resume_from_checkpoint)
    for marker in RUN_MARKERS:
        removed = os.path.realpath(os.path.join(t.output_dir, marker))
        if spec == removed or spec.startswith(removed + os.sep):
            why = (
                f"{t.resume_from_checkpoint} is inside {os.path.join(t.output_dir, marker)}, which "
                "--overwrite_output_dir removes before training; move the checkpoint out of output_dir first"
            )
            return [("resume_from_checkpoint", why)]
    return []
