"""Which weights an adapter was trained on: a fingerprint of the base model's files, recorded beside the adapter
(final/BASE_FILE) when the run exports, and compared by `finetune merge` with the base it is asked to merge into.

Merging an adapter into another checkpoint of the same architecture (one trained on Llama-3.1-8B-Instruct into
Llama-3.1-8B, or into another fine-tune of it) fits every module and shape and gives a silently wrong model: only
the weights tell them apart.

The fingerprint is read from the base model's safetensors files on disk (a local directory, or the Hugging Face
cache for a Hub id), never from the loaded model: a QLoRA run holds its base in 4 bits, and a run may grow the
embeddings or train modules in full beside the adapter. Per tensor of a floating-point type: its shape and its first
HEAD values (index 0 of every dimension but the last) rounded to bfloat16, hashed. A fine-tune changes every weight
(a LoRA merged into q_proj changes every row of it), so a few values of each tensor tell checkpoints apart, and
reading them costs one small read per tensor, whatever the model's size. Rounding to bfloat16 makes a float32 copy and
a bfloat16 copy of one model the same base (casting rounds to nearest even, and rounding twice the same way changes
nothing); a float16 copy of a bfloat16 model is the same base too (float16 holds every bfloat16 value of its
range), one of a float32 model may differ (rounded twice, two ways). A model whose weights are only in
pytorch_model.bin has no fingerprint: a merge into it says it could not verify.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass

from finetune.checkpoint import write_atomic

BASE_FILE = "base_model.json"  # in an adapter directory: the base model it was trained on and its fingerprint
SCHEME = "bf16-head256-sha256/1"  # how the fingerprint was computed: a merge compares only the same scheme
HEAD = 256  # values read from each tensor
# the files from_pretrained loads a model's weights from, in its order (transformers modeling_utils.py:588-605: the
# single file first, then the index of shards); pytorch_model.bin has no header to read a slice from
SAFE_WEIGHTS = "model.safetensors"
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Verdict:
    """A base model against the fingerprint an adapter records. same: True (the weights it was trained on), False
    (other weights), None (not verified: note says why); found: False where the base's safetensors files are not on
    disk (a Hub id not yet in the cache: a later look may find them); reshaped: some tensor has another shape;
    trained_on: the base model the adapter's BASE_FILE names (None without one)."""

    same: bool | None
    note: str
    found: bool = True
    reshaped: bool = False
    trained_on: str | None = None


def record(directory: str, base_model: str) -> None:
    """BASE_FILE in directory (an adapter's): the base model as the run loaded it (a local one by its absolute path)
    and its fingerprint; none where its weights are not in safetensors files, with why."""
    name = os.path.abspath(base_model) if os.path.isdir(base_model) else base_model
    tensors, why = _fingerprint(name)
    said = {"base_model": name, "scheme": SCHEME, "tensors": tensors}
    if tensors is None:
        said["no_fingerprint"] = why
    write_atomic(os.path.join(directory, BASE_FILE), json.dumps(said, indent=1) + "\n")


def check(adapter_dir: str, base_model: str) -> Verdict:
    """base_model's weights against those the adapter in adapter_dir was trained on (its BASE_FILE): the tensors
    both hold are compared (a copy saved without a tied lm_head still compares the rest)."""
    said = _recorded(adapter_dir)
    if not said:
        return Verdict(None, f"the adapter records no fingerprint of its base model's weights (no {BASE_FILE}: "
                             "written by an older finetune or another tool)")  # fmt: skip
    verdict = _compare(said, base_model)
    return dataclasses.replace(verdict, trained_on=said.get("base_model"))


def _recorded(adapter_dir: str) -> dict:
    """What the adapter's BASE_FILE says ({} without a readable one: an older finetune's adapter, another tool's)."""
    try:
        with open(os.path.join(adapter_dir, BASE_FILE)) as f:
            said = json.load(f)
    except (OSError, ValueError):
        return {}
    return said if isinstance(said, dict) else {}


def _compare(said: dict, base_model: str) -> Verdict:
    """base_model's fingerprint against the one BASE_FILE records (said)."""
    recorded = said.get("tensors") if said.get("scheme") == SCHEME else None
    if not isinstance(recorded, dict) or not recorded:
        why = said.get("no_fingerprint") or f"its {BASE_FILE} has another scheme than {SCHEME}"
        return Verdict(None, f"the adapter records no fingerprint of its base model's weights ({why})")
    tensors, why = _fingerprint(base_model)
    if tensors is None:
        return Verdict(None, f"no fingerprint of {base_model!r}: {why}", found=False)
    common = sorted(recorded.keys() & tensors.keys())
    if not common:
        return Verdict(None, f"none of the tensors the adapter's {BASE_FILE} fingerprints is in {base_model!r}")
    differ = [k for k in common if recorded[k] != tensors[k]]
    if differ:
        reshaped = [k for k in differ if _shape(recorded[k]) != _shape(tensors[k])]
        k = (reshaped or differ)[0]
        e = f"{k}: {_shape(tensors[k]) or 'a scalar'} for {_shape(recorded[k]) or 'a scalar'}" if reshaped else k
        return Verdict(
            False, f"{len(differ)} of the {len(common)} tensors compared differ (e.g. {e})", True, bool(reshaped)
        )
    return Verdict(True, f"the weights the adapter was trained on ({len(common)} tensors compared)")


def _fingerprint(base_model: str) -> tuple[dict[str, str] | None, str]:
    """The fingerprint of base_model's files (tensor name -> digest), or None and why there is none."""
    from safetensors import SafetensorError

    files = _weight_files(base_model)
    if not files:
        where = "in it" if os.path.isdir(base_model) else "for it in the local Hugging Face cache"
        return None, f"no {SAFE_WEIGHTS} or complete {SAFE_WEIGHTS_INDEX} {where} (pytorch_model.bin only?)"
    try:
        return {k: v for path in files for k, v in _digests(path).items()}, ""
    except (OSError, SafetensorError) as e:
        return None, f"its safetensors files could not be read ({e})"


def _weight_files(base_model: str) -> list[str] | None:
    """The safetensors files of base_model: a local directory's, or a Hub id's in the local Hugging Face cache (a
    cache lookup, never a download); None where there are none."""
    from huggingface_hub import try_to_load_from_cache

    def locate(filename: str) -> str | None:
        if os.path.isdir(base_model):
            path = os.path.join(base_model, filename)
            return path if os.path.isfile(path) else None
        try:
            found = try_to_load_from_cache(base_model, filename)
        except ValueError:  # not a valid Hub id (HFValidationError)
            return None
        return found if isinstance(found, str) else None  # else None or _CACHED_NO_EXIST (file_download.py:74)

    single = locate(SAFE_WEIGHTS)
    if single:
        return [single]
    index = locate(SAFE_WEIGHTS_INDEX)
    if not index:
        return None
    try:
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    files = [locate(shard) for shard in shards]
    return files if all(files) else None


def _digests(path: str) -> dict[str, str]:
    """Each floating-point tensor of one safetensors file: its shape ("4096x4096") and the sha256 of its first HEAD
    values (index 0 along every dimension but the last: one contiguous read) rounded to bfloat16."""
    import torch
    from safetensors import safe_open

    digests = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            piece = f.get_slice(key)
            shape = piece.get_shape()
            head = piece[(*[slice(0, 1)] * (len(shape) - 1), slice(0, HEAD))] if shape else f.get_tensor(key)
            if not head.is_floating_point():  # a buffer of ids, a quantized release's packed weights
                continue
            values = head.reshape(-1).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
            digests[key] = "x".join(map(str, shape)) + ":" + hashlib.sha256(values).hexdigest()[:16]
    return digests


def _shape(digest: str) -> str:
    """The shape a digest holds ("4096x4096"; "" for a scalar)."""
    return digest.rpartition(":")[0]
