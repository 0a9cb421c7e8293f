"""final/: the trained model as a standard Hugging Face directory (or the adapter), and adapter merging.

The weights come through the backend (ZeRO-3 partitions, FSDP and TP shards, Megatron's TP x PP shards
gathered; an empty-shell checkpoint otherwise); PeftModel.save_pretrained keeps only the adapter (and
modules_to_save) tensors of them. Written to a temporary directory and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import yaml

from finetune.checkpoint import (
    CONFIG_FILE,
    WriteError,
    attempt_write,
    replace_directory,
    report,
    resume_hint,
    which_failed,
    write_atomic,
)
from finetune.cluster import host_gather, host_wait
from finetune.config import ConfigError
from finetune.config.preflight import looks_local
from finetune.faults import fault_point
from finetune.formats import at_rest
from finetune.model import DTYPES, head_kwargs, load_error, model_config, peft_missing, quantized_base, save_dtype

LABELS_FILE = "labels.json"


def export(
    accelerator,
    backend,
    model,
    tokenizer,
    run_config: dict[str, Any],
    output_dir: str,
    dtype: str,
    weights_from: Callable[[str], None] | None = None,
) -> str:
    """Write output_dir/final/: model (or adapter) + tokenizer + the effective run config. A collective.
    dtype: what every floating weight is written in (model.save_dtype), cast once from the full-precision weights.
    weights_from: write the weights from elsewhere instead (one process: the best checkpoint, finetune.best)."""
    final = os.path.join(output_dir, "final")
    tmp = os.path.join(output_dir, ".tmp_final")
    main = accelerator.is_main_process
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    host_wait()
    if weights_from is None:
        error = attempt_write(backend.save_pretrained, model, tmp, DTYPES[dtype])  # every rank takes part
    else:
        error = attempt_write(_one_process, backend, weights_from, tmp) if main else None
    if main and error is None:
        error = attempt_write(_finish, backend.hf_model(model), tokenizer, run_config, tmp, final, dtype)
    failed = which_failed(host_gather(report(accelerator.process_index, error)))
    if failed:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(
            f"could not write {final} ({failed}); {'a previous' if os.path.exists(final) else 'no'} final/ is "
            f"there. Free space or fix the filesystem, then write it from the run's end: {resume_hint(output_dir)}"
        )
    return final


def _one_process(backend, weights_from: Callable[[str], None], tmp: str) -> None:
    with backend.one_process_loading():
        weights_from(tmp)


def _finish(net, tokenizer, run_config: dict[str, Any], tmp: str, final: str, dtype: str) -> None:
    """The main process: what final/ holds beside the weights, then final/ in place."""
    stamp_dtype(tmp, dtype)
    absolute_base_model(tmp)
    at_rest(tokenizer).save_pretrained(tmp)
    write_atomic(os.path.join(tmp, CONFIG_FILE), yaml.safe_dump(run_config, sort_keys=False))
    id2label = getattr(net.config, "id2label", None)
    if os.path.exists(os.path.join(tmp, "adapter_config.json")) and run_config.get("task") == "classification":
        # the classes a classifier adapter was trained for: `finetune merge` rebuilds the head from them
        write_atomic(os.path.join(tmp, LABELS_FILE), json.dumps([id2label[i] for i in sorted(id2label)]))
    fault_point("enospc-in-export", 0)
    fault_point("signal-in-export", 0)
    replace_directory(tmp, final)


def stamp_dtype(directory: str, dtype: str) -> None:
    """config.json says the dtype the weights were written in (transformers writes the in-memory model's, which
    under mixed precision is not what was saved). An adapter directory has no config.json: nothing to say."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        config = json.load(f)
    config["dtype"] = dtype
    write_atomic(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def absolute_base_model(directory: str) -> None:
    """An adapter's adapter_config.json names a local base model by its absolute path. PEFT writes the path the run
    was given (demo/base_model: relative to the folder the run started in), which `finetune merge` or a load from
    any other folder would not find. A Hub id stays as it is."""
    path = os.path.join(directory, "adapter_config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        config = json.load(f)
    base = config.get("base_model_name_or_path")
    if base and not os.path.isabs(base) and os.path.isdir(base):  # from_pretrained loaded it from there
        config["base_model_name_or_path"] = os.path.abspath(base)
        write_atomic(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


MERGE_MARKER = "finetune_merge.json"  # in a merged model directory: what it was merged from; marks it replaceable


def merge_adapter(adapter_dir: str, out_dir: str, dtype: str | None = None, overwrite: bool = False) -> str:
    """Base model + adapter -> one plain model directory (loads with from_pretrained), atomically, in dtype (None:
    the run's save_dtype, as final/ was written; auto: the base model's own). The merge itself is done in float32,
    whatever the base model's dtype.

    out_dir must be new or empty, or hold a previous merge (its MERGE_MARKER) and be ADAPTER/merged or replaced on
    purpose (overwrite); a ConfigError otherwise, and for a base model that is not where the adapter says.

    A classifier adapter's classes come from its labels.json (the base model is rebuilt with that head); an
    encoder-decoder's adapter says so in its task_type."""
    from transformers import AutoTokenizer

    from finetune.config import ModelArgs

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    base = ModelArgs(model=adapter_config.get("base_model_name_or_path") or "")
    problems = peft_missing("adapter") + _base_model_problems(adapter_dir, base.model)
    problems += _merge_output_problems(adapter_dir, base.model, out_dir, overwrite)
    if problems:
        raise ConfigError(problems)
    quantized = quantized_base(model_config(base), base.model)  # an unreadable config: from_pretrained says why
    if quantized:
        raise ConfigError([("adapter", quantized)])
    label_names = None
    if os.path.exists(os.path.join(adapter_dir, LABELS_FILE)):
        with open(os.path.join(adapter_dir, LABELS_FILE)) as f:
            label_names = json.load(f)
    try:
        merged = _adapted_model(adapter_dir, adapter_config, label_names)
    except OSError as e:  # a Hub id neither cached nor reachable, or a base directory without weights
        raise _base_load_error(adapter_dir, base.model, e) from None
    if dtype in (None, "auto"):  # the run's save_dtype (None), or the base model's own dtype, as its config.json says
        dtype = save_dtype(ModelArgs(model=base.model, save_dtype=dtype or _run_save_dtype(adapter_dir)))
    merged = merged.merge_and_unload().to(DTYPES[dtype])
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".merging-", dir=parent)  # a name of its own: nobody's files are in it
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(tmp)
        marker = {"adapter": os.path.abspath(adapter_dir), "base_model": base.model, "dtype": dtype}
        write_atomic(os.path.join(tmp, MERGE_MARKER), json.dumps(marker, indent=2) + "\n")
        if os.path.isdir(out_dir):  # empty, or a previous merge (checked above)
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _run_save_dtype(adapter_dir: str) -> str:
    """The save_dtype of the run that wrote adapter_dir (its run_config.yaml); auto without one."""
    try:
        with open(os.path.join(adapter_dir, CONFIG_FILE)) as f:
            said = (yaml.safe_load(f) or {}).get("save_dtype", "auto")
    except (OSError, yaml.YAMLError, AttributeError):
        return "auto"
    return said if said in DTYPES else "auto"


def _adapted_model(adapter_dir: str, adapter_config: dict, label_names: list | None):
    """The base model with the adapter on it, in float32; a classifier rebuilt with the adapter's classes."""
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSeq2SeqLM, AutoPeftModelForSequenceClassification

    if label_names:
        return AutoPeftModelForSequenceClassification.from_pretrained(
            adapter_dir, dtype=DTYPES["float32"], **head_kwargs(label_names)
        )
    seq2seq = adapter_config.get("task_type") == "SEQ_2_SEQ_LM"
    auto = AutoPeftModelForSeq2SeqLM if seq2seq else AutoPeftModelForCausalLM
    return auto.from_pretrained(adapter_dir, dtype=DTYPES["float32"])


def _base_model_problems(adapter_dir: str, name: str) -> list[tuple[str, str]]:
    """The base model that adapter_config.json names, where it is local: there, and a model directory."""
    where = f"base_model_name_or_path in {os.path.join(adapter_dir, 'adapter_config.json')}"
    fix = "set it there to the base model's directory (or Hub id)"
    if not name:
        return [("adapter", f"{where} names no base model; {fix}")]
    if looks_local(name) and not os.path.isdir(os.path.expanduser(name)):
        return [("adapter", f"the base model {name!r} ({where}) does not exist here; moved? {fix}")]
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        return [("adapter", f"the base model {name!r} ({where}) has no config.json; {fix}")]
    return []


def _base_load_error(adapter_dir: str, name: str, e: OSError) -> ConfigError:
    """The base model that adapter_config.json names could not be loaded (a directory without weights, a Hub id
    neither in the local cache nor reachable): why, and what to set there instead."""
    from huggingface_hub import constants

    key = f"base_model_name_or_path in {os.path.join(adapter_dir, 'adapter_config.json')}"
    if os.path.isdir(name):
        return load_error("base model", name, e, key=key, fix="set it there to a directory saved with save_pretrained")
    offline = constants.is_offline_mode()
    fix = (
        "it is not a local directory nor in the local Hugging Face cache, and the Hub is "
        + ("offline (HF_HUB_OFFLINE)" if offline else "unreachable")
        + ": set it there to a local copy of the base model (a directory saved with save_pretrained), or merge "
        + ("with HF_HUB_OFFLINE unset" if offline else "again")
        + " where the Hub is reachable (the base model is then downloaded into the cache)"
    )
    return load_error("base model", name, e, key=key, fix=fix)


def _merge_output_problems(adapter_dir: str, base: str, out_dir: str, overwrite: bool) -> list[tuple[str, str]]:
    """Where the merged model may go: never over the adapter, the base model or the current folder (nor a folder
    holding them), nor over a file of the user's; over a previous merge only in ADAPTER/merged or with overwrite."""
    out = os.path.realpath(out_dir)
    kept = {"the adapter": adapter_dir, "the base model": base, "the current folder": os.getcwd()}
    for what, path in kept.items():
        if path and os.path.exists(path) and os.path.commonpath([out, os.path.realpath(path)]) == out:
            return [("--output", f"{out_dir!r} would replace {what} ({path}); choose another --output")]
    if not os.path.lexists(out_dir):
        return []
    if not os.path.isdir(out_dir) or os.path.islink(out_dir):
        return [("--output", f"{out_dir!r} exists and is not a directory; choose another --output")]
    if not os.listdir(out_dir):
        return []
    if not os.path.isfile(os.path.join(out_dir, MERGE_MARKER)):
        return [("--output", f"{out_dir!r} holds files that are not a merge finetune wrote (no {MERGE_MARKER}); "
                             "choose another --output, a new or empty directory")]  # fmt: skip
    if overwrite or out == os.path.realpath(os.path.join(adapter_dir, "merged")):
        return []
    return [("--output", f"{out_dir!r} holds a previous merge; add --overwrite to replace it, or choose another "
                         "--output")]  # fmt: skip
