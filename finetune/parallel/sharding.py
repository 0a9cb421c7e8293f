"""Memory facts of each backend: how a rank holds its share of the model states, and the buffers the backend adds.

`finetune plan` (finetune/memory/) asks this module, and only this module, what differs between DDP, the
ZeRO stages, FSDP2, tensor parallelism and Megatron-LM. It works from an Accelerate config file without
launching anything (`topology.read_config_file`), or from a running job's Topology (`from_topology`).

`model_states(topology, shape, precision, buckets)` lists a rank's parts in bytes, each placed on the device
or on the host (CPU offload). Per parameter, with P trainable and T total parameters, N ranks sharding them,
w the bytes of the weights a backend trains (the model's dtype; 2 in DeepSpeed's own bf16/fp16 modes: its bf16
runs under autocast over fp32 weights unless the JSON enables bf16 itself; outside those modes ZeRO-3 holds 4
whatever the model's dtype, zero.Init building in the DeepSpeed config's dtype):

  DDP (torch AdamW)   weights T*w, gradients P*w (views of DDP's 25 MB buckets: gradient_as_bucket_view),
                      moments 2*P*w (torch keeps them in the parameter's dtype)
  ZeRO-1              weights T*w, full gradients P*w, fp32 master partition 4P/N (only with 16-bit weights or
                      offload: in fp32 finetune.parallel.deepspeed.share_fp32_master_weights makes the weights'
                      own partition the master), moments 8P/N, the flat fp32 gradient partition 4P/N; in bf16/fp16
                      with grad_accum_dtype fp32 (ds_configs/zero1.json) DeepSpeed's BF16_Optimizer instead keeps
                      the full gradients in fp32 (4P) and steps on a view of its partition
  ZeRO-2              as ZeRO-1, but gradients reduced during backward into a partition 4P/N through one
                      reduce bucket (reduce_bucket_size; "auto" = hidden^2, accelerate fills it), and copied
                      into one flat fp32 tensor for the step (another 4P/N)
  ZeRO-3              weights T*w/N, master 4P/N (only with 16-bit weights or offload, as above), moments
                      8P/N, gradient partition 4P/N (allocated once), copied sub-group by sub-group into a flat
                      tensor for the step (sub_group_size elements at most; 2e7 in ds_configs/); gathered: a parameter
                      d parameters from the model's end stays gathered from its forward to its backward when
                      2d is within stage3_max_reuse_distance (partitioned_param_coordinator releases only the
                      others), up to stage3_max_live_parameters (both 3e7 in ds_configs/); at least the module
                      computing now and the prefetch bucket; and one module's full gradient before it is reduced
  DeepSpeed buckets   in the weights' dtype, or fp32 with communication_data_type fp32 (ds_configs/)
  all                 AdamW steps in place: finetune.optim builds torch's fused kernel, which allocates no
                      temporary (the multi-tensor one would: the size of exp_avg_sq); so does DeepSpeedCPUAdam
Each part also says when it exists (`Part.phase`): always; during forward and backward only; or from the end
of backward through the optimizer step (gradients the backend frees after every step: DeepSpeed ZeRO-1/2 and
FSDP2, while DDP keeps its buckets). With gradient accumulation the gradients live across micro batches.
  FSDP2               weights T*w/N, gradients P*w/N, moments 2P*w/N, N = dp_shard x tp (_fsdp: the
                      processes, but HSDP's dp_replicate groups each hold the whole model); gathered: the root
                      module (embeddings, head) for the whole step, the layer computing now and the one
                      prefetched, and one layer's full gradient before its reduce-scatter
  TP (tp ranks)       what the model's tp_plan splits (ModelShape.tp_splittable: the decoder layers' linears,
                      the input embeddings, the head; a tied head is the embeddings, one tensor) split tp ways, the
                      norms and biases whole (under TP x FSDP2 the tp rank's part is then cut dp_shard ways)
  Megatron-LM         the same split tp ways (its vocabulary embedding and output layer too), the layers pp ways
                      (the first stage holds the embeddings, the last the head); fp32 main gradients; distributed
                      optimizer: moments and master sharded over data parallel
Mixed precision through accelerate (autocast) keeps fp32 weights and adds their 16-bit casts (autocast's
cache: 2 bytes per weight for the forward and backward).
QLoRA (peft.load_in_4bit; one process, DDP, ZeRO-1/2): the base's decoder linears are stored in NF4, NF4_BYTES per
weight (bitsandbytes dequantizes one layer at a time, autocast caches no copy of them); the rest as loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.parallel.topology import Launcher, Topology

ALWAYS, BACKWARD, STEP, EVAL = "always", "backward", "step", "eval"
# bitsandbytes' NF4: two weights per byte and an fp32 absmax per block of 64 (finetune does not double-quantize)
NF4_BYTES = 0.5 + 4 / 64


@dataclass(frozen=True)
class Part:
    """One component of a rank's memory, and when it exists: always (between steps too), during forward and
    backward only (activations, gathered parameters), from the end of backward through the optimizer step
    (gradients a backend frees after every step, their flat copies for the step), or during evaluation (its
    logits)."""

    name: str
    bytes: float
    on_host: bool = False  # offloaded to the CPU (on a CPU-only machine device and host are the same memory)
    note: str = ""
    phase: str = ALWAYS


@dataclass(frozen=True)
class Buckets:
    """Communication buffer sizes, in elements (DeepSpeed JSON's "auto" as accelerate fills it from hidden_size)."""

    reduce: float = 0.0
    prefetch: float = 0.0
    persistence_threshold: float = 0.0
    max_live: float = 0.0  # ZeRO-3: parameters gathered at most at once
    max_reuse: float = 0.0  # ZeRO-3: a gathered parameter used again within this many parameters stays gathered
    sub_group: float = 0.0  # ZeRO-3: the optimizer steps over sub-groups of at most this many elements
    megatron_distributed_optimizer: bool = False
    bf16_weights: bool = False  # the DeepSpeed JSON enables bf16 itself: DeepSpeed's bf16 mode, not autocast
    fp32_communication: bool = False  # DeepSpeed communication_data_type fp32: reduce buckets in fp32
    fp32_accumulation: bool = False  # DeepSpeed data_types.grad_accum_dtype fp32 (ZeRO-1 in 16 bits: BF16_Optimizer)

    @classmethod
    def read(cls, topology: Topology, ds_config: Mapping | None, hidden: int, distributed_optimizer: bool = False):
        """The buckets of a DeepSpeed JSON (or {}), for a model of this hidden size; distributed_optimizer: Megatron-LM
        shards its optimizer states over data parallel (use_distributed_optimizer)."""
        zero = (ds_config or {}).get("zero_optimization", {})

        def value(key: str, auto: float) -> float:
            v = zero.get(key, auto)
            return auto if v == "auto" else float(v)

        # accelerate.Accelerator._prepare_deepspeed fills these "auto" values from the model's hidden size
        return cls(
            reduce=value("reduce_bucket_size", hidden * hidden) if topology.zero_stage else 0.0,
            prefetch=value("stage3_prefetch_bucket_size", 0.9 * hidden * hidden) if topology.zero_stage == 3 else 0.0,
            persistence_threshold=value("stage3_param_persistence_threshold", 10 * hidden)
            if topology.zero_stage == 3
            else 0.0,
            max_live=value("stage3_max_live_parameters", 1e9),  # DeepSpeed's defaults
            max_reuse=value("stage3_max_reuse_distance", 1e9),
            sub_group=value("sub_group_size", 1e9),
            megatron_distributed_optimizer=distributed_optimizer,
            bf16_weights=((ds_config or {}).get("bf16") or {}).get("enabled") is True,
            fp32_communication=str((ds_config or {}).get("communication_data_type", "")).lower() in ("fp32", "float32"),
            fp32_accumulation=str(((ds_config or {}).get("data_types") or {}).get("grad_accum_dtype", "")).lower()
            in ("fp32", "float32"),
        )


def model_states(topology: Topology, shape: Any, mixed_precision: str, buckets: Buckets) -> list[Part]:
    """A rank's parameters, gradients, optimizer states, master copies and backend buffers, in bytes.

    `shape` is a finetune.memory.ModelShape (parameter counts by kind, from the model's config alone)."""
    half = mixed_precision in ("bf16", "fp16")
    t = topology
    if t.family == "deepspeed":
        # bf16 runs under autocast over fp32 weights (deepspeed.bf16_through_autocast) unless the JSON enables
        # DeepSpeed's bf16 mode itself; fp16 is DeepSpeed's fp16 mode
        native = mixed_precision == "fp16" or (mixed_precision == "bf16" and buckets.bf16_weights)
        parts = _deepspeed(t, shape, native, buckets)
        if half and not native and (shape.weight_bytes == 4 or t.zero_stage == 3):  # fp32 weights (_deepspeed)
            casts = 2 * (shape.total - shape.quantized)
            parts.append(Part("buffers", casts, note="autocast's 16-bit weight casts", phase=BACKWARD))
        return parts
    if t.family == "fsdp":
        return _fsdp(t, shape, half)
    if t.family == "megatron":
        return _megatron(t, shape, half, buckets)
    return _ddp(t, shape, half)


def frozen_copy(topology: Topology, shape: Any) -> Part:
    """dpo/ipo's live reference without an adapter (backend.prepare_frozen): a second copy of the starting model's
    weights, placed as the layout places it: sharded under ZeRO-3 and FSDP2 (offloaded where the parameters are),
    whole on each rank elsewhere (one process, DDP, ZeRO-1/2, whose reference engine runs at stage 0)."""
    t, w = topology, shape.weight_bytes
    if t.family == "fsdp":
        return Part("reference", _split(shape, t.tp)[0] * w / t.dp_shard, t.offload_params, "live reference, sharded")
    if t.family == "deepspeed" and t.zero_stage == 3:
        return Part("reference", shape.total * w / t.num_processes, t.offload_params, "live reference, sharded")
    return Part("reference", _split(shape, t.tp, t.pp)[0] * w, note="live reference: a frozen copy")


def _split(shape, tp: int, pp: int = 1) -> tuple[float, float]:
    """(total, trainable) parameters the fullest rank holds when what tensor parallelism splits (shape.tp_splittable:
    the layers' matrices, the input embeddings and the head) is split tp ways and the decoder layers pp ways. With
    pp > 1 the first stage holds the input embeddings, the last the head (a tied one: a copy of the embeddings,
    Megatron-LM's shared_embedding), the final norm and anything else outside the layers counted on the fullest."""
    rest = shape.total - shape.tp_splittable  # whole on every rank: norms, biases, learned position embeddings
    if pp == 1:
        total = shape.tp_splittable / tp + rest
    else:
        ends = shape.input_embeddings + shape.head
        outside = shape.root_params - ends  # the final norm (position embeddings: GPT-2's)
        layers = (shape.tp_splittable - ends) / tp + rest - outside
        total = layers / pp + max(shape.input_embeddings, shape.head or shape.input_embeddings) / tp + outside
    trainable = shape.trainable * total / max(shape.total, 1)
    return total, trainable


def _weights(shape, total: float, w: float, tp: int = 1) -> Part:
    """The parameters Part of a rank holding `total` of the model's weights whole, at w bytes each; QLoRA's 4-bit
    ones (shape.quantized: decoder linears, split tp ways where tensor parallelism splits them, which the run
    refuses for now: tensor.model_problems) at NF4_BYTES."""
    q = shape.quantized / tp
    return Part("parameters", (total - q) * w + q * NF4_BYTES, note=f"{q / 1e6:.0f}M of them in 4 bits" if q else "")


def _ddp(t: Topology, shape, half: bool) -> list[Part]:
    w = shape.weight_bytes
    total, trainable = _split(shape, t.tp)
    parts = [
        _weights(shape, total, w, t.tp),
        Part("gradients", trainable * w, note="views of DDP's 25 MB buckets, kept between steps"),
        Part("optimizer", 2 * trainable * w, note="AdamW exp_avg + exp_avg_sq"),
    ]
    if half and w == 4:
        casts = 2 * (total - shape.quantized / t.tp)
        parts.append(Part("buffers", casts, note="autocast's 16-bit weight casts", phase=BACKWARD))
    return parts


def _deepspeed(t: Topology, shape, half: bool, b: Buckets) -> list[Part]:
    n = t.num_processes
    # DeepSpeed casts the model to bf16/fp16 in its 16-bit modes; outside them ZeRO-3's zero.Init builds every
    # parameter in fp32 whatever torch_dtype says (deepspeed.zero3_weights_dtype_note)
    w = 2 if half else 4 if t.zero_stage == 3 else shape.weight_bytes
    total, trainable = shape.total, shape.trainable
    host_opt = t.offload_optimizer
    states = [Part("optimizer", 8 * trainable / n, host_opt, "fp32 AdamW moments, partitioned")]
    # the fp32 master: the weights' own partition in fp32 without offload (share_fp32_master_weights)
    master = [Part("master copy", 4 * trainable / n, host_opt, "fp32 partition")] if w != 4 or host_opt else []
    if t.zero_stage < 3:
        if t.zero_stage == 1 and w == 2 and b.fp32_accumulation and not host_opt:  # DeepSpeed's BF16_Optimizer
            grads = [Part("gradients", 4 * trainable, note="full, accumulated in fp32; its partition is a view")]
        elif t.zero_stage == 1:  # gradients accumulate whole in .grad, are reduced at the boundary, freed after
            grads = [
                Part("gradients", trainable * w, note="full, in .grad until the step", phase=STEP),
                Part("gradients", 4 * trainable / n, host_opt, "flat fp32 partition for the step", phase=STEP),
            ]
        else:  # reduced bucket by bucket during backward into the partition, freed after the step
            grads = [Part("gradients", 4 * trainable / n, host_opt, "reduced partition", phase=STEP)]
            if not host_opt:
                grads.append(
                    Part("buffers", 4 * trainable / n, note="the gradients' flat copy for the step", phase=STEP)
                )
        cw = 4 if b.fp32_communication else w  # communication_data_type
        buffers = [Part("buffers", b.reduce * cw, note="reduce bucket", phase=BACKWARD)]
        if host_opt:  # the 16-bit copy of the partition the CPU optimizer writes back through
            buffers.append(Part("buffers", w * trainable / n, True, "offload write-back buffer"))
        return [_weights(shape, total, w), *grads, *master, *states, *buffers]
    persistent = shape.small_params(b.persistence_threshold)  # kept whole on every rank
    params = Part("parameters", (total - persistent) * w / n + persistent * w, t.offload_params, "partitioned")
    parts = [params, Part("gradients", 4 * trainable / n, host_opt, "partition buffer, allocated once")]
    if not host_opt:
        step_copy = min(trainable / n, b.sub_group + shape.largest_module / n)  # a sub-group ends past the limit
        parts.append(Part("buffers", 4 * step_copy, note="one sub-group's flat gradient copy for the step", phase=STEP))
    parts += master + states
    # A parameter d parameters from the model's end is used again in backward ~2d parameters after its forward use:
    # DeepSpeed keeps it gathered when that is within max_reuse_distance, up to max_live_parameters in all.
    kept = min(shape.total, b.max_reuse / 2, b.max_live)
    gathered = max(kept, shape.largest_module + b.prefetch)
    how = "gathered in forward, kept for backward (max_reuse_distance)" if kept else "gathered module + prefetch"
    parts.append(Part("buffers", gathered * w, note=how, phase=BACKWARD))
    parts.append(
        Part(
            "buffers",
            shape.largest_module * w + b.reduce * (4 if b.fp32_communication else w),
            note="one module's full gradient + reduce bucket",
            phase=BACKWARD,
        )
    )
    return parts


def _fsdp(t: Topology, shape, half: bool) -> list[Part]:
    """FSDP2 cuts a rank's model states dp_shard x tp ways, which is every process but under HSDP: its dp_replicate
    groups each hold the whole model (accelerate 1.15 shards over the mesh's dp_replicate and dp_shard_cp dimensions,
    utils/fsdp_utils.py fsdp2_prepare_model, and torch's fully_shard replicates over the first). Under TP x FSDP2
    the tp_plan first splits what ModelShape.tp_splittable counts tp ways (every weight but the norms: transformers
    5.23 adds the input embeddings to every plan, distributed/mixin.py init_parallel_plans), then fully_shard cuts
    a tp rank's part dp_shard ways; the norms, Replicate on the "tp" mesh (accelerate's _prepare_tp), only
    dp_shard ways."""
    held, trainable = _split(shape, t.tp)  # a tp rank's part of the model, which fully_shard cuts dp_shard ways
    n = t.dp_shard
    w = shape.weight_bytes
    host = t.offload_params
    gw = 2 if half else w  # FSDP2's MixedPrecisionPolicy gathers in the 16-bit dtype
    over = f"sharded {t.dp_shard * t.tp} ways" + (f", x {t.dp_replicate} replicas" if t.dp_replicate > 1 else "")
    parts = [
        Part("parameters", held * w / n, host, over),
        Part("gradients", trainable * w / n, host, f"{over}, freed after the step", phase=STEP),
        Part("optimizer", 2 * trainable * w / n, host, f"AdamW moments, {over}"),
    ]
    layer = shape.layer_params / t.tp
    ends = shape.input_embeddings + shape.head  # gathered over dp_shard only: still split tp ways
    root = shape.root_params - ends + ends / t.tp
    parts.append(Part("buffers", (root + 2 * layer) * gw, note="root module + 2 layers gathered", phase=BACKWARD))
    parts.append(
        Part(
            "buffers",
            (root + layer) * gw,
            note="unsharded gradients before reduce-scatter",
            phase=BACKWARD,
        )
    )
    return parts


def _megatron(t: Topology, shape, half: bool, b: Buckets) -> list[Part]:
    w = 2 if half else shape.weight_bytes
    total, trainable = _split(shape, t.tp, t.pp)
    shard = t.dp if b.megatron_distributed_optimizer else 1
    parts = [
        Part("parameters", total * w),
        Part("gradients", 4 * trainable, note="fp32 main_grad buffer"),
        Part(
            "optimizer", 8 * trainable / shard, note="fp32 moments" + (", distributed optimizer" if shard > 1 else "")
        ),
    ]
    if half:
        parts.append(Part("master copy", 4 * trainable / shard, note="fp32 master weights"))
    return parts


def activation_split(topology: Topology) -> tuple[int, int]:
    """(ways each layer's inner activations are split, micro batches a pipeline stage holds at once)."""
    in_flight = min(topology.pp, topology.num_micro_batches) if topology.pp > 1 else 1  # 1F1B: the first stage
    return topology.tp, in_flight


def layers_per_rank(topology: Topology, layers: int) -> float:
    return layers / topology.pp


def buckets_for(topology: Topology, ds_config: Mapping, hidden: int) -> Buckets:
    """Buckets of a config read from a file (topology.read_config_file) for a model of this hidden size."""
    return Buckets.read(topology, ds_config, hidden, bool(ds_config.get("megatron_distributed_optimizer", False)))


def from_topology(topology: Topology, hidden: int, env: Mapping[str, str] = os.environ) -> Buckets:
    """Buckets of a running job: its DeepSpeed JSON is the file the launcher named."""
    ds: dict = {}
    launcher = Launcher.read(env)
    path = launcher.deepspeed_config_file
    if topology.zero_stage and path:
        try:
            ds = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            ds = {}
    return Buckets.read(topology, ds, hidden, launcher.megatron_distributed_optimizer)
