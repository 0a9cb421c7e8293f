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
from dataclasses import dataclass
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
from finetune.config import AUTO_CLASSES, ConfigError, ModelArgs
from finetune.config.preflight import looks_local, run_config_in
from finetune.faults import fault_point
from finetune.fingerprint import BASE_FILE
from finetune.fingerprint import check as check_base
from finetune.fingerprint import record as record_base
from finetune.formats import at_rest
from finetune.model import (
    DTYPES,
    head_kwargs,
    load_error,
    model_config,
    peft_missing,
    quantized_base,
    save_dtype,
    saves_as_its_base,
)

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
    adapter = os.path.exists(os.path.join(tmp, "adapter_config.json"))
    if adapter and run_config.get("task") == "classification":
        # the classes a classifier adapter was trained for: `finetune merge` rebuilds the head from them
        write_atomic(os.path.join(tmp, LABELS_FILE), json.dumps([id2label[i] for i in sorted(id2label)]))
    if adapter:  # the weights it was trained on: `finetune merge` refuses a base with others (fingerprint.py)
        record_base(tmp, run_config["model"])
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


@dataclass(frozen=True)
class MergeBase:
    """The base model a merge loads: its name (a local directory or a Hub id) and the key that named it (--base_model,
    or base_model_name_or_path in the adapter's adapter_config.json), which every error about it names."""

    name: str
    key: str
    given: bool  # named by --base_model

    def fix(self, what: str) -> str:
        """How to name another base model: `what`, with --base_model first (the adapter's own file stays as it is)."""
        if self.given:
            return f"give --base_model {what}"
        return f"give {what} with --base_model (or set it there)"


def _merge_base(adapter_dir: str, adapter_config: dict, base_model: str | None) -> MergeBase:
    """The base model of a merge: base_model where given, else the one adapter_config.json names."""
    if base_model is not None:
        return MergeBase(base_model, "--base_model", True)
    key = f"base_model_name_or_path in {os.path.join(adapter_dir, 'adapter_config.json')}"
    return MergeBase(adapter_config.get("base_model_name_or_path") or "", key, False)


def merge_adapter(
    adapter_dir: str,
    out_dir: str,
    dtype: str | None = None,
    overwrite: bool = False,
    base_model: str | None = None,
    allow_other_base: bool = False,
) -> str:
    """Base model + adapter -> one plain model directory (loads with from_pretrained), atomically, in dtype (None:
    the run's save_dtype, as final/ was written; auto: the base model's own). The merge itself is done in float32,
    whatever the base model's dtype.

    base_model: the base model to merge into (a directory or Hub id) instead of the one adapter_config.json names;
    it must fit the adapter (_adapted_model) and hold the weights it was trained on, where the adapter's BASE_FILE
    fingerprints them (allow_other_base: merge into other weights on purpose). adapter_dir is only read.

    out_dir must be new or empty, or hold a previous merge (its MERGE_MARKER) and be ADAPTER/merged or replaced on
    purpose (overwrite); a ConfigError otherwise, for a base model that is not there or cannot be loaded, and for
    one the adapter does not fit or whose weights are not the adapter's base's. Nothing is written then. What the
    weights check found is in MERGE_MARKER's base_weights.

    A classifier adapter's classes come from its labels.json (the base model is rebuilt with that head); an
    encoder-decoder's adapter says so in its task_type (one without, another tool's: the base's config does)."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    base = _merge_base(adapter_dir, adapter_config, base_model)
    problems = peft_missing("adapter") + _base_model_problems(base)
    problems += _merge_output_problems(adapter_dir, base.name, out_dir, overwrite)
    if problems:
        raise ConfigError(problems)
    quantized = quantized_base(model_config(ModelArgs(model=base.name)), base.name)  # unreadable: loading says why
    if quantized:
        raise ConfigError([(base.key, quantized)])
    tokenizer = _adapter_tokenizer(adapter_dir)
    checked = _base_weights(adapter_dir, base, allow_other_base, loaded=False)  # refused without the load's wait
    merged = _adapted_model(adapter_dir, adapter_config, base, len(tokenizer))
    checked = checked or _base_weights(adapter_dir, base, allow_other_base, loaded=True)
    if dtype in (None, "auto"):  # the run's save_dtype (None), or the base model's own dtype, as its config.json says
        dtype = save_dtype(ModelArgs(model=base.name, save_dtype=dtype or _run_save_dtype(adapter_dir)))
    merged = merged.merge_and_unload().to(DTYPES[dtype])
    used = os.path.abspath(base.name) if os.path.isdir(base.name) else base.name
    marker = {"adapter": os.path.abspath(adapter_dir), "base_model": used, "dtype": dtype, "base_weights": checked}
    _write_merged(merged, tokenizer, marker, out_dir)
    return out_dir


def _base_weights(adapter_dir: str, base: MergeBase, allow_other_base: bool, loaded: bool) -> str | None:
    """The base model's weights against those the adapter was trained on (fingerprint.check): refused where they
    differ, unless allow_other_base; else what was found, for MERGE_MARKER. Before the base has loaded (loaded
    False), None where the answer waits for the load: a Hub id whose files the load downloads into the cache, and a
    base of other shapes, whose fit check (_adapted_model) tells what does not fit."""
    verdict = check_base(adapter_dir, base.name)
    if not loaded and (not verdict.found or verdict.reshaped):
        return None
    if verdict.same is None:
        return f"not verified: {verdict.note}"
    if verdict.same:
        return verdict.note
    if allow_other_base:
        trained = f"not the weights the adapter was trained on ({verdict.trained_on})"
        return f"{trained}: {verdict.note}; merged with allow_other_base"
    why = (
        f"the weights of the base model {base.name!r} are not the ones the adapter in {adapter_dir} was trained on "
        f"({verdict.trained_on!r}, fingerprinted in its {BASE_FILE}): {verdict.note}. Merged into other weights, an "
        "adapter makes a silently wrong model. Merge it into the model it was trained on: "
        + base.fix("that model's directory or Hub id")
        + "; or, to merge it into this one on purpose (a sibling fine-tune), add --allow_other_base"
    )
    raise ConfigError([(base.key, why)])


def _write_merged(merged, tokenizer, marker: dict, out_dir: str) -> None:
    """The merged model, its tokenizer and MERGE_MARKER, written beside out_dir and renamed into place."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".merging-", dir=parent)  # a name of its own: nobody's files are in it
    try:
        merged.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_atomic(os.path.join(tmp, MERGE_MARKER), json.dumps(marker, indent=2) + "\n")
        if os.path.isdir(out_dir):  # empty, or a previous merge (checked by _merge_output_problems)
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_save_dtype(adapter_dir: str) -> str:
    """The save_dtype of the run that wrote adapter_dir (its run_config.yaml); auto without one."""
    said = run_config_in(adapter_dir).get("save_dtype", "auto")
    return said if isinstance(said, str) and said in DTYPES else "auto"


def _adapter_tokenizer(adapter_dir: str):
    """The tokenizer saved with the adapter (the run's: what the merged model is used with)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(adapter_dir)
    except (OSError, ValueError, KeyError) as e:
        raise load_error(
            "tokenizer", adapter_dir, e, key="adapter", fix="save the run's tokenizer there (save_pretrained)"
        ) from None


def _adapted_model(adapter_dir: str, adapter_config: dict, base: MergeBase, vocab: int):
    """The base model with the adapter on it, in float32 (a classifier rebuilt with the classes of the adapter's
    labels.json; the embeddings grown to the adapter's tokenizer of vocab tokens, as the run grew them). Refused
    where the adapter does not fit the base: no module it adapts, a tensor of another shape, an adapted module
    missing or left over (a base of other sizes or layers)."""
    import transformers
    from peft import PeftConfig, get_peft_model

    label_names = _label_names(adapter_dir)
    task_type = adapter_config.get("task_type")
    if task_type is None:  # another tool's adapter may not say: the base does (an encoder-decoder's, or not)
        seq2seq = bool(getattr(model_config(ModelArgs(model=base.name)), "is_encoder_decoder", False))
    else:
        seq2seq = task_type == "SEQ_2_SEQ_LM"
    auto = AUTO_CLASSES["classification" if label_names else "seq2seq" if seq2seq else "causal_lm"]
    try:
        net = getattr(transformers, auto).from_pretrained(
            base.name, dtype=DTYPES["float32"], **(head_kwargs(label_names) if label_names else {})
        )
    except OSError as e:  # a Hub id neither cached nor reachable, or a base directory without weights
        raise _base_load_error(base, e) from None
    except ValueError as e:  # a kind of model the adapter's Auto class does not load (an encoder-decoder's, ...)
        raise _misfit(adapter_dir, base, f"{auto} does not load it ({_first_line(e)})") from None
    saves_as_its_base(net, base.name)
    if vocab > net.get_input_embeddings().num_embeddings:
        net.resize_token_embeddings(vocab)
    config = PeftConfig.from_pretrained(adapter_dir)
    config.base_model_name_or_path, config.inference_mode = base.name, True  # in memory: the file stays as it is
    try:
        net = get_peft_model(net, config)
        loaded = net.load_adapter(adapter_dir, "default")  # as PeftModel.from_pretrained, which drops this result
    except (ValueError, RuntimeError) as e:  # no module to adapt (NoMatchingPeftModuleError), a size mismatch
        raise _misfit(adapter_dir, base, _first_line(e, "size mismatch")) from None
    left = [f"{len(keys)} {what} (e.g. {keys[0]})" for keys, what in _unplaced(loaded) if keys]
    if left:
        raise _misfit(adapter_dir, base, " and ".join(left))
    return net


def _unplaced(loaded) -> list[tuple[list[str], str]]:
    """What load_adapter could not place: the adapter's tensors without a module of the base (a layer or module it
    lacks), the base's adapted modules without a tensor in the adapter (a layer it has more)."""
    return [
        (list(loaded.unexpected_keys), "of the adapter's tensors have no module in it"),
        (list(loaded.missing_keys), "of its adapted modules have no tensor in the adapter"),
    ]


def _label_names(adapter_dir: str) -> list | None:
    """A classifier adapter's classes in id order (its LABELS_FILE); None for any other adapter."""
    path = os.path.join(adapter_dir, LABELS_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _first_line(e: Exception, containing: str = "") -> str:
    """The error's first line (its first line containing `containing`, where one does)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [type(e).__name__]
    return next((line for line in lines if containing and containing in line), lines[0])


def _misfit(adapter_dir: str, base: MergeBase, why: str) -> ConfigError:
    """The adapter does not fit the base model: why, and the model it was trained on (the run's, where its
    run_config.yaml says)."""
    trained = run_config_in(adapter_dir).get("model")
    on = f" (its run trained {trained!r})" if isinstance(trained, str) and trained else ""
    return ConfigError(
        [
            (
                base.key,
                f"the adapter in {adapter_dir} does not fit the base model {base.name!r}: {why.rstrip('.')}. Merge it into the "
                f"model it was trained on{on}: " + base.fix("that model's directory or Hub id"),
            )
        ]
    )


def _base_model_problems(base: MergeBase) -> list[tuple[str, str]]:
    """The base model, where it is local: there, and a model directory."""
    if not base.name:
        return [(base.key, "names no base model; " + base.fix("the base model's directory or Hub id"))]
    if looks_local(base.name) and not os.path.isdir(os.path.expanduser(base.name)):
        moved = "" if base.given else "moved? "
        fix = base.fix("the base model's directory (or Hub id)")
        return [(base.key, f"the base model {base.name!r} does not exist here; {moved}{fix}")]
    if os.path.isdir(base.name) and not os.path.isfile(os.path.join(base.name, "config.json")):
        return [
            (
                base.key,
                f"the base model {base.name!r} has no config.json; "
                + base.fix("a model directory saved with save_pretrained"),
            )
        ]
    return []


def _base_load_error(base: MergeBase, e: OSError) -> ConfigError:
    """The base model could not be loaded (a directory without weights, a Hub id neither in the local cache nor
    reachable): why, and what to give instead."""
    from huggingface_hub import constants

    if os.path.isdir(base.name):
        return load_error(
            "base model", base.name, e, key=base.key, fix=base.fix("a directory saved with save_pretrained")
        )
    offline = constants.is_offline_mode()
    fix = (
        "it is not a local directory nor in the local Hugging Face cache, and the Hub is "
        + ("offline (HF_HUB_OFFLINE)" if offline else "unreachable")
        + ": "
        + base.fix("a local copy of the base model (a directory saved with save_pretrained)")
        + ", or merge "
        + ("with HF_HUB_OFFLINE unset" if offline else "again")
        + " where the Hub is reachable (the base model is then downloaded into the cache)"
    )
    return load_error("base model", base.name, e, key=base.key, fix=fix)


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
