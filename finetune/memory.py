"""Memory planning: what a run needs per rank under each Accelerate config, before anything runs.

    finetune plan --config run.yaml [--num_gpus 16 --gpus_per_node 8 --gpu_memory 80GB --host_memory 1TB]

The planner reads only the model's config (the model is built empty, on the meta device, to count its
parameters exactly, LoRA adapters included) and adds up, per rank, every component of the training peak:

  model states     parameters, gradients, AdamW's two moments, fp32 master copies, backend buffers (ZeRO-3
                   gathers and prefetch, DeepSpeed reduce buckets, FSDP's gathered layers): per backend,
                   from finetune/parallel/sharding.py (its docstring gives the bytes per parameter)
  activations      what autograd saves for backward (`activation_elements`), plus, at the start of backward,
                   the larger of the loss's logit copies and one layer's activation gradients
  logits           micro batch x sequence x vocabulary, fp32 in the loss (`logit_bytes`)
  overhead         CPU: the resident size of a rank before its model states exist (FRAMEWORK_GB, measured);
                   GPU: the CUDA context (CUDA_CONTEXT_GB) on the device, the process on the host

On a GPU the device total predicts torch.cuda.max_memory_allocated plus the context; a config fits when it
stays under GPU_HEADROOM of the GPU's memory (the caching allocator's fragmentation takes the rest). On a
CPU-only machine every part lands in the process's resident set: the host total predicts the training
phase's peak RSS (VmHWM) that metrics.report_memory measures, and every run logs both (estimate_train_peak_gb).
That prediction is the live set: it assumes the allocator returns freed memory (glibc with
MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0, what `cpu_allocator: release` sets). CPU runs default to
`cpu_allocator: keep`, which keeps freed buffers for the next step (faster steps) and so peaks higher: a 5M
Llama with a 32k vocabulary, micro batch 16 x 128, one process, peaked at 2.02 GB with keep, 1.47 with release and
1.57 with glibc's defaults, against an estimate of 1.51. With glibc's default dynamic thresholds freed blocks under
32 MiB stay resident; ZeRO-3, which gathers and frees every parameter each step, then measured 13-17% above the
estimate at 35M parameters on 2 ranks (1.84-1.93 GB against 1.60; 1.60 with the settings above).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config import ConfigError, RunConfig
from finetune.parallel import sharding
from finetune.parallel.topology import Topology

logger = logging.getLogger("finetune")
ROOT = Path(__file__).resolve().parents[1]
GB = 1e9

# A CPU rank's resident size in the training phase besides its model states, activations and buffers: the Python
# interpreter with torch, transformers, accelerate, datasets, the model code, the tokenized data and the process
# group (gloo). Measured on the development machine (2 ranks, a 2.9M-parameter Llama whose states are 0.05 GB;
# README "Plan memory"): 0.56 GB per DDP rank; a DeepSpeed rank 0.03 GB more (deepspeed's import and its engine;
# it was 0.08 until finetune.parallel.deepspeed.compile_on_first_call kept torch's compiler from loading).
FRAMEWORK_GB = 0.56
DEEPSPEED_EXTRA_GB = 0.03
CUDA_CONTEXT_GB = 0.75  # the CUDA context and kernels of torch on one GPU (0.5-1 GB depending on the GPU)
GPU_HEADROOM = 0.9  # a GPU config fits when its device estimate is under 90% of the GPU's memory
HOST_HEADROOM = 0.9  # and the host estimate of all ranks of a machine under 90% of its memory

# The order of preference among the shipped configs: the fastest first (least sharding, no offload).
PREFERENCE = [
    "single",
    "ddp",
    "zero1",
    "zero2",
    "fsdp2",
    "zero3",
    "tp2",
    "tp2_fsdp2",
    "megatron_tp2",
    "megatron_tp2_pp2",
    "zero2_offload",
    "fsdp2_offload",
    "zero3_offload",
]
GPU_ONLY = ("megatron_tp2", "megatron_tp2_pp2")


# ---------------------------------------------------------------- the model's shape, from its config


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts by kind and the dimensions that size activations; from the config alone."""

    total: int
    trainable: int
    layers: int
    hidden: int
    heads: int
    kv_dim: int  # key/value width: kv heads x head dim (grouped-query attention)
    intermediate: int
    vocab: int
    gated_mlp: bool  # SwiGLU-style MLP (gate and up projections)
    layer_params: int  # one decoder layer
    root_params: int  # outside the decoder layers: embeddings, final norm, head
    largest_module: int  # the largest module's own parameters (what ZeRO-3 gathers at once)
    tp_splittable: int  # parameters of the decoder layers' linears and the head (split by tensor parallelism)
    weight_bytes: int  # bytes per weight as loaded (torch_dtype)
    tensor_sizes: tuple[int, ...] = ()

    def small_params(self, threshold: float) -> int:
        """Parameters in tensors below `threshold` elements (ZeRO-3 keeps those whole on every rank)."""
        return sum(n for n in self.tensor_sizes if n < threshold)

    @classmethod
    def of_model(cls, net, config, weight_bytes: int, numel=None) -> ModelShape:
        """Count a built model (on the meta device, or a real one: `numel` gives a partitioned one's full size)."""
        import torch

        numel = numel or (lambda p: p.numel())
        params = list(net.parameters())
        layers = max(
            (m for m in net.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=torch.nn.ModuleList()
        )
        layer_params = max((sum(numel(p) for p in layer.parameters()) for layer in layers), default=0)
        in_layers = sum(numel(p) for p in layers.parameters())
        total = sum(numel(p) for p in params)
        linears = [m for m in layers.modules() if isinstance(m, torch.nn.Linear)]
        head = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None
        splittable = sum(numel(m.weight) for m in linears) + (numel(head.weight) if head is not None else 0)
        own = [sum(numel(p) for p in m.parameters(recurse=False)) for m in net.modules()]
        text = getattr(config, "get_text_config", lambda: config)()
        hidden = _first(text, "hidden_size", "n_embd", "d_model")
        heads = _first(text, "num_attention_heads", "n_head")
        head_dim = getattr(text, "head_dim", None) or hidden // max(heads, 1)
        kv_heads = _first(text, "num_key_value_heads", "n_head", "num_attention_heads")
        names = {n.rsplit(".", 1)[-1] for n, _ in net.named_modules()}
        return cls(
            total=total,
            trainable=sum(numel(p) for p in params if p.requires_grad),
            layers=len(layers),
            hidden=hidden,
            heads=heads,
            kv_dim=kv_heads * head_dim,
            intermediate=getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden,
            vocab=_first(text, "vocab_size"),
            gated_mlp=any("gate" in n for n in names),
            layer_params=layer_params,
            root_params=total - in_layers,
            largest_module=max(own, default=0),
            tp_splittable=splittable,
            weight_bytes=weight_bytes,
            tensor_sizes=tuple(sorted(numel(p) for p in params)),
        )


def _first(config, *names: str) -> int:
    for n in names:
        value = getattr(config, n, None)
        if value:
            return int(value)
    return 0


WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def shape_from_config(cfg: RunConfig, num_labels: int = 2, config=None) -> ModelShape:
    """The ModelShape of the run's model (or of `config`, a transformers config object): its config only, built
    empty on the meta device, adapters applied."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from finetune import model as model_lib

    config = config or model_lib.model_config(cfg.model)
    if config is None:
        raise ConfigError(
            [
                (
                    "model",
                    f"cannot read the config of {cfg.model.model!r}: give a local model directory (with config.json) "
                    "or a Hub id with the Hub reachable",
                )
            ]
        )
    weight_bytes = WEIGHT_BYTES.get(cfg.model.torch_dtype) or WEIGHT_BYTES.get(
        str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", "float32")).replace("torch.", ""), 4
    )
    classify = cfg.model.task == "classification"
    if classify:
        config.num_labels = num_labels
    cls = AutoModelForSequenceClassification if classify else AutoModelForCausalLM
    with init_empty_weights():
        net = cls.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
        if cfg.peft.method != "none" and not cfg.peft.adapter:
            net = model_lib.apply_peft(net, cfg.peft, cfg.model.task)
    return ModelShape.of_model(net, config, weight_bytes)


def llama_config(hidden: int, layers: int, vocab: int = 32000, head_dim: int = 64):
    """A Llama-shaped transformers config: SwiGLU MLP of ~8/3 x hidden (rounded to 64), one head per 64 dims."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=64 * round(8 * hidden / 3 / 64),
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // head_dim),
        num_key_value_heads=max(1, hidden // head_dim),
        vocab_size=vocab,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )


def with_layers(one: ModelShape, two: ModelShape, layers: int) -> ModelShape:
    """The shape of the same model with `layers` decoder layers, from its 1- and 2-layer shapes (everything but the
    root grows by one layer's worth per layer): no need to build a deep model to size it."""
    from collections import Counter

    per_layer = Counter(two.tensor_sizes) - Counter(one.tensor_sizes)
    root = Counter(one.tensor_sizes) - per_layer
    sizes = sorted(root.elements()) + sorted(n for n in per_layer.elements() for _ in range(layers))
    grow = layers - 1
    return dataclasses.replace(
        one,
        total=one.total + grow * one.layer_params,
        trainable=one.trainable + grow * (two.trainable - one.trainable),
        layers=layers,
        tp_splittable=one.tp_splittable + grow * (two.tp_splittable - one.tp_splittable),
        tensor_sizes=tuple(sorted(sizes)),
    )


def largest_llama(
    hidden: int,
    budget_gb: float,
    cfg: RunConfig,
    accelerate_config: Path,
    machines: Machines,
    vocab: int = 32000,
    max_layers: int = 1024,
) -> tuple[int, ModelShape, Estimate] | None:
    """The most layers a Llama of this width can have and still train within `budget_gb` per rank (device memory on
    GPUs, resident memory on CPUs) under this Accelerate config; None when even one layer does not fit. For
    capacity benchmarks: the peak memory grows with the layers, so a bisection finds the boundary."""

    one, two = (shape_from_config(cfg, config=llama_config(hidden, n, vocab)) for n in (1, 2))

    def trial(layers: int) -> tuple[ModelShape, Estimate]:
        shape = with_layers(one, two, layers)
        return shape, plan_config(shape, cfg, accelerate_config, machines)

    def within(est: Estimate) -> bool:
        return est.topology is not None and (est.device_gb if machines.on_gpu else est.host_gb) <= budget_gb

    lo, hi = 0, max_layers + 1  # within(lo) holds (0: nothing yet), within(hi) does not
    best = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        shape, est = trial(mid)
        if within(est):
            lo, best = mid, (mid, shape, est)
        else:
            hi = mid
    return best


# ---------------------------------------------------------------- activations and logits


def activation_elements(s: ModelShape, batch: int, seq: int, tp: int = 1, eager_attention: bool = False) -> float:
    """Elements autograd saves per decoder layer for backward, for a pre-norm decoder (Llama, Mistral, Qwen, GPT-2).

    Counted from what each op saves (as Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", section 4.1, count it for GPT, without dropout masks, with a gated MLP and SDPA):
      2 norms x (input + normalized output)                           4 s b h   (not split by TP)
      q, k, v after the rotary embedding                              s b (h + 2 kv)
      attention output, and its reshaped copy into o_proj             2 s b h
      MLP: gate and up outputs, the activation output, their product  4 s b i   (non-gated: 2 s b i)
      eager attention only: scores and probabilities                  2 a s^2 b (SDPA/flash keep none)
    With tensor parallelism everything but the norms is split tp ways."""
    sbh = seq * batch * s.hidden
    inner = seq * batch * (s.hidden + 2 * s.kv_dim) + 2 * sbh + (4 if s.gated_mlp else 2) * seq * batch * s.intermediate
    if eager_attention:
        inner += 2 * s.heads * seq * seq * batch
    return 4 * sbh + inner / tp


def logit_bytes(s: ModelShape, batch: int, seq: int, half: bool) -> float:
    """The loss's logit copies at the start of backward: transformers' loss upcasts logits to fp32, cross_entropy
    saves its fp32 log_softmax, and backward makes the gradient of that and of the logits (3 fp32 copies of
    batch x seq x vocab); under 16-bit mixed precision the 16-bit logits and their gradient add 2 bytes."""
    return batch * seq * s.vocab * (12 + (2 if half else 0))


def activation_parts(s: ModelShape, topo: Topology, batch: int, seq: int, cfg: RunConfig, half: bool):
    """(activations, logits) Parts for one micro batch; gradient checkpointing keeps only each layer's input and
    recomputes one layer at a time."""
    tp, in_flight = sharding.activation_split(topo)
    nbytes = 2 if half else s.weight_bytes
    eager = cfg.model.attn_implementation == "eager"
    per_layer = activation_elements(s, batch, seq, tp, eager) * nbytes
    layers = sharding.layers_per_rank(topo, s.layers)
    if cfg.model.gradient_checkpointing:
        saved = layers * seq * batch * s.hidden * nbytes + per_layer
        how = "layer inputs + one recomputed layer (gradient checkpointing)"
    else:
        saved = layers * per_layer
        how = f"{per_layer / 1e6:.0f} MB x {layers:g} layers"
    logits = logit_bytes(s, batch, seq, half)
    # at the start of backward the logit copies are alive; later one layer's activation gradients: the larger
    peak = saved * in_flight + max(logits, per_layer)
    return [
        sharding.Part("activations", peak - logits if logits >= per_layer else peak, note=how, phase=sharding.BACKWARD),
        sharding.Part(
            "logits",
            logits if logits >= per_layer else 0.0,
            note=f"{batch}x{seq}x{s.vocab}, fp32 loss",
            phase=sharding.BACKWARD,
        ),
    ]


def peak_bytes(parts: list, on_host: bool) -> float:
    """The peak of the parts in one memory: what always exists, plus the larger of the forward/backward parts and
    the optimizer-step parts (activations are freed by the time the step runs)."""
    mine = [p for p in parts if p.on_host == on_host]
    always = sum(p.bytes for p in mine if p.phase == sharding.ALWAYS)
    return always + max(sum(p.bytes for p in mine if p.phase == phase) for phase in (sharding.BACKWARD, sharding.STEP))


# ---------------------------------------------------------------- the estimate of one config on some machines


@dataclass(frozen=True)
class Machines:
    """Where the job runs: GPUs (num_gpus > 0) or CPU processes; memory per GPU and per machine, in GB."""

    num_gpus: int = 0
    gpus_per_node: int = 0
    gpu_memory_gb: float = 0.0
    host_memory_gb: float | None = None  # per machine; None: not checked
    cpu_processes: int = 2
    mixed_precision: str | None = None  # `accelerate launch --mixed_precision`; None: each config file's own

    @property
    def on_gpu(self) -> bool:
        return self.num_gpus > 0

    @property
    def processes(self) -> int:
        return self.num_gpus or self.cpu_processes

    @property
    def per_node(self) -> int:
        return self.gpus_per_node or self.processes

    @property
    def nodes(self) -> int:
        return math.ceil(self.processes / self.per_node)

    def describe(self) -> str:
        host = f", {self.host_memory_gb:.0f} GB host memory per machine" if self.host_memory_gb else ""
        if self.on_gpu:
            return (
                f"{self.num_gpus} GPU(s) of {self.gpu_memory_gb:.1f} GB, {self.per_node} per machine on "
                f"{self.nodes} machine(s){host}"
            )
        return f"{self.cpu_processes} CPU process(es) on this machine{host}"


@dataclass
class Estimate:
    """Per-rank memory of one Accelerate config: its parts, device and host totals, and whether it fits."""

    config: str
    topology: Topology | None
    parts: list = field(default_factory=list)
    device_gb: float = 0.0  # GPU memory (0 on CPU)
    host_gb: float = 0.0  # the process's resident memory
    fits: bool = False
    micro_batch: int = 0
    gradient_checkpointing: bool = False
    note: str = ""

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.parts:
            out[p.name] = out.get(p.name, 0.0) + p.bytes / GB
        return out


def estimate(
    shape: ModelShape,
    cfg: RunConfig,
    topology: Topology,
    mixed_precision: str,
    buckets: sharding.Buckets,
    machines: Machines,
    micro_batch: int | None = None,
    name: str = "",
    accumulation: int | None = None,
) -> Estimate:
    """Per-rank memory of training `shape` with the run config's batch and sequence under this topology."""
    half = mixed_precision in ("bf16", "fp16")
    batch = micro_batch or cfg.train.per_device_train_batch_size
    parts = sharding.model_states(topology, shape, mixed_precision, buckets)
    if (accumulation or cfg.train.gradient_accumulation_steps) > 1:  # gradients live across micro batches
        parts = [dataclasses.replace(p, phase=sharding.ALWAYS) if p.name == "gradients" else p for p in parts]
    parts += activation_parts(shape, topology, batch, cfg.data.max_seq_length, cfg, half)
    overhead = FRAMEWORK_GB + (DEEPSPEED_EXTRA_GB if buckets.reduce else 0.0)
    if machines.on_gpu:
        parts.append(sharding.Part("overhead", CUDA_CONTEXT_GB * GB, note="CUDA context"))
        parts.append(sharding.Part("overhead", overhead * GB, True, "the process (Python, libraries)"))
        device, host = peak_bytes(parts, False) / GB, peak_bytes(parts, True) / GB
    else:  # one memory: the offloaded parts land in the same resident set
        parts.append(sharding.Part("overhead", overhead * GB, note="the process (Python, libraries, gloo)"))
        parts = [dataclasses.replace(p, on_host=False) for p in parts]
        device, host = 0.0, peak_bytes(parts, False) / GB
    fits = True
    if machines.on_gpu and device > GPU_HEADROOM * machines.gpu_memory_gb:
        fits = False
    ranks_per_node = min(machines.per_node, topology.num_processes)
    if machines.host_memory_gb and host * ranks_per_node > HOST_HEADROOM * machines.host_memory_gb:
        fits = False
    return Estimate(
        name,
        topology,
        parts,
        device,
        host,
        fits,
        batch,
        cfg.model.gradient_checkpointing,
    )


def shipped_configs() -> list[Path]:
    """The shipped single-machine Accelerate configs, in order of preference (multinode_* variants have the same
    per-rank memory as their single-machine twins)."""
    found = {p.stem: p for p in (ROOT / "accelerate_configs").glob("*.yaml")}
    return [found[n] for n in PREFERENCE if n in found]


def plan_config(
    shape: ModelShape, cfg: RunConfig, path: Path, machines: Machines, micro_batch=None, accumulation=None
) -> Estimate:
    """The estimate of one Accelerate config file launched on `machines` (num_processes from the machines, as
    `accelerate launch --num_processes` would; fixed-size layouts such as tp2 keep theirs)."""
    name = path.stem
    if name in GPU_ONLY and not machines.on_gpu:
        return Estimate(name, None, note="GPU only (Megatron-LM)")
    n, why = sharding.launch_size(path, machines.processes)
    if not n:
        return Estimate(name, None, note=why)
    topo, ds, mixed = sharding.read_config_file(path, num_processes=n, num_machines=math.ceil(n / machines.per_node))
    mixed = machines.mixed_precision or mixed or default_precision(cfg, machines)
    buckets = sharding.buckets_for(topo, ds, shape.hidden)
    est = estimate(shape, cfg, topo, mixed, buckets, machines, micro_batch, name, accumulation)
    est.note = why
    return est


def default_precision(cfg: RunConfig | None, machines: Machines) -> str:
    """What a run decides when neither the launch line nor the Accelerate config says (the run config's
    mixed_precision; auto: bf16 on GPUs, as on the Ampere and newer GPUs a plan is made for; fp32 on CPUs)."""
    asked = cfg.model.mixed_precision if cfg is not None else "auto"
    return ("bf16" if machines.on_gpu else "no") if asked == "auto" else asked


def plan(shape: ModelShape, cfg: RunConfig, machines: Machines, configs: list[Path] | None = None) -> list[Estimate]:
    """One Estimate per Accelerate config at the run config's micro batch."""
    return [plan_config(shape, cfg, p, machines) for p in configs or shipped_configs()]


@dataclass
class Recommendation:
    config: str
    micro_batch: int
    gradient_accumulation_steps: int
    gradient_checkpointing: bool
    estimate: Estimate | None
    why: str


def recommend(
    shape: ModelShape,
    cfg: RunConfig,
    machines: Machines,
    global_batch: int | None = None,
    configs: list[Path] | None = None,
) -> Recommendation:
    """The fastest config that fits (PREFERENCE: least sharding, no offload) and the largest micro batch that fits
    for the target global batch (micro x accumulation x data parallel); gradient checkpointing only when nothing
    fits without it."""
    paths = configs or shipped_configs()
    t = cfg.train
    target = global_batch or t.per_device_train_batch_size * t.gradient_accumulation_steps * machines.processes
    for checkpointing in sorted({cfg.model.gradient_checkpointing, True}):
        run = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, gradient_checkpointing=checkpointing))
        for path in paths:
            if path.stem == "single" and machines.processes > 1:  # plan for every device the job has
                continue
            first = plan_config(shape, run, path, machines, micro_batch=1)
            if first.topology is None:
                continue
            dp = first.topology.dp
            if target % dp:
                continue
            per_rank = target // dp
            for micro in sorted((d for d in range(1, per_rank + 1) if per_rank % d == 0), reverse=True):
                est = plan_config(shape, run, path, machines, micro, per_rank // micro)
                if est.fits:
                    faster = [
                        p.stem for p in paths[: paths.index(path)] if p.stem != "single" or machines.processes == 1
                    ]
                    why = _why(est, machines, faster)
                    return Recommendation(path.stem, micro, per_rank // micro, checkpointing, est, why)
    return Recommendation(
        "",
        0,
        0,
        True,
        None,
        f"nothing fits on {machines.describe()}, even at micro batch 1 with gradient checkpointing and offload: "
        "use more or larger devices, a shorter max_seq_length, or LoRA (peft.method: lora)",
    )


def _why(est: Estimate, machines: Machines, faster: list[str]) -> str:
    where = (
        f"{est.device_gb:.1f} GB of {machines.gpu_memory_gb:g} GB per GPU"
        if machines.on_gpu
        else f"{est.host_gb:.2f} GB per process"
    )
    reason = f"it needs {where}"
    if faster:
        reason += f"; the faster {', '.join(faster)} {'does' if len(faster) == 1 else 'do'} not fit at this batch"
    if est.gradient_checkpointing:
        reason += "; only with gradient checkpointing (recomputes activations: ~30% more compute)"
    return reason


# ---------------------------------------------------------------- the run's own estimate (run.py)


def run_estimate(cfg: RunConfig, accelerator, backend, net) -> Estimate:
    """This run's per-rank estimate for its own topology, from the built model (logged at start)."""
    import torch

    topology, numel = backend.topology, backend.numel
    config = getattr(net, "config", None)
    dtype = next((p.dtype for p in net.parameters()), torch.float32)
    shape = ModelShape.of_model(net, config, torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4, numel)
    on_gpu = accelerator.device.type == "cuda"
    machines = Machines(num_gpus=topology.num_processes if on_gpu else 0, cpu_processes=topology.num_processes)
    buckets = sharding.from_topology(topology, shape.hidden)
    est = estimate(shape, cfg, topology, backend.mixed_precision, buckets, machines, name="this run")
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in est.by_kind().items())
    total = f"device {est.device_gb:.2f} GB, host {est.host_gb:.2f} GB" if on_gpu else f"{est.host_gb:.2f} GB"
    logger.info("memory estimate per rank (finetune plan): %s (GB: %s)", total, kinds)
    return est


def train_peak_estimate(est: Estimate, device) -> dict[str, float]:
    """What metrics.report_memory logs next to the measured training peak: on a GPU the device estimate (compare
    peak_gpu_allocated), on the CPU the resident-size estimate (compare peak_rss)."""
    return {"estimate_train_peak_gb": round(est.device_gb if device.type == "cuda" else est.host_gb, 4)}


# ---------------------------------------------------------------- `finetune plan`

PLAN_DESCRIPTION = """\
Plan memory: for every shipped Accelerate config, what one rank needs to train this model (parameters,
gradients, optimizer states, master copies, activations, logits, buffers, overhead), on the device and on
the host, whether it fits, and the config and micro batch x accumulation to use. Reads only the model's
config: no weights, no GPU needed.

  finetune plan --config examples/sft.yaml
  finetune plan --model meta-llama/Llama-3.1-8B --max_seq_length 4096 --per_device_train_batch_size 2 \\
      --num_gpus 16 --gpus_per_node 8 --gpu_memory 80GB --host_memory 1TB --global_batch_size 64
  finetune plan --model ./my_model --peft.method lora --num_gpus 1 --gpu_memory 24GB

Without --num_gpus on a machine without a GPU it plans for this machine: 2 processes sharing its memory.
Every run config field works as a flag (see finetune --help); dataset is not needed."""


def build_parser() -> argparse.ArgumentParser:
    from finetune.config import build_parser as run_parser

    parser = run_parser()
    parser.prog = "finetune plan"
    parser.description = PLAN_DESCRIPTION
    parser.epilog = (
        "Sizes take a unit (80GB, 80GiB, 1TB; a bare number is GB). Exit code 2 means bad input. "
        "The estimate formulas and their sources: finetune/memory.py and finetune/parallel/sharding.py."
    )
    group = parser.add_argument_group("plan (the machines to plan for)")
    group.add_argument("--num_gpus", type=str, help="GPUs in the job (default: this machine's; none: CPU processes)")
    group.add_argument("--gpus_per_node", type=str, help="GPUs per machine (default: min(num_gpus, 8))")
    group.add_argument("--gpu_memory", help="memory of one GPU, e.g. 80GB (required with --num_gpus)")
    group.add_argument(
        "--host_memory",
        help="memory of one machine, e.g. 512GB (default: this machine's MemTotal for CPU processes; unchecked for GPUs)",
    )
    group.add_argument("--num_processes", type=str, help="CPU processes when planning without GPUs (default: 2)")
    group.add_argument(
        "--global_batch_size", type=str, help="target rows per optimizer step (default: the run config's batch)"
    )
    group.add_argument(
        "--configs",
        help="comma-separated Accelerate configs (names or files) to plan, the preferred first (default: every shipped one, fastest first)",
    )
    return parser


def parse_size_gb(key: str, text: str) -> float:
    """'80GB', '80GiB', '1TB', '80' (GB) -> GB."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?[bB]?)?\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise ConfigError([(key, f"{text!r} is not a memory size; write it like 80GB, 80GiB or 1TB")])
    value, unit = float(m.group(1)), (m.group(2) or "GB").upper().rstrip("B")
    scale = {"K": 1e-6, "M": 1e-3, "G": 1.0, "T": 1e3, "KI": 2**10 / GB, "MI": 2**20 / GB, "GI": 2**30 / GB}
    scale["TI"] = 2**40 / GB
    return value * scale[unit]


def _positive_int(problems: list, key: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        problems.append((key, f"must be a whole number >= 1, got {text!r}"))
        return None
    return value


def host_memory_gb() -> float | None:
    """This machine's MemTotal."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) * 1024 / GB
    except (OSError, StopIteration):
        return None


def parse(argv: list[str]) -> tuple[RunConfig, Machines, int | None, list[Path] | None]:
    """argv -> (run config, machines, target global batch, configs); every problem in one ConfigError."""
    from finetune.config import build_config, load_yaml, parse_cli_value, unknown_option_problems
    from finetune.parity import accelerate_config_path

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    plan_keys = (
        "num_gpus",
        "gpus_per_node",
        "gpu_memory",
        "host_memory",
        "num_processes",
        "global_batch_size",
    )
    problems = unknown_option_problems(unknown, tuple(f"--{k}" for k in (*plan_keys, "configs")))
    opts = {k: getattr(args, k) for k in (*plan_keys, "configs")}
    values = load_yaml(args.config) if args.config else {}
    overrides = {k: parse_cli_value(k, v) for k, v in vars(args).items() if k not in ("config", *plan_keys, "configs")}
    values = {**values, **overrides}
    values.setdefault("dataset", "(not needed to plan)")
    if not values.get("model"):
        problems.append(("model", "is required: give --model ID|PATH, or --config with a model"))
    cfg = None
    try:
        cfg = build_config(values, check_filesystem=False)
    except ConfigError as e:
        problems += e.problems
    gpus = _positive_int(problems, "--num_gpus", opts["num_gpus"])
    per_node = _positive_int(problems, "--gpus_per_node", opts["gpus_per_node"])
    procs = _positive_int(problems, "--num_processes", opts["num_processes"])
    target = _positive_int(problems, "--global_batch_size", opts["global_batch_size"])
    sizes = {}
    for key in ("gpu_memory", "host_memory"):
        if opts[key] is not None:
            try:
                sizes[key] = parse_size_gb(f"--{key}", opts[key])
            except ConfigError as e:
                problems += e.problems
    if gpus is None and (per_node or "gpu_memory" in sizes):
        problems.append(("--num_gpus", "is required with --gpus_per_node/--gpu_memory: say how many GPUs to plan for"))
    # the run config's mixed_precision (--mixed_precision), as `accelerate launch --mixed_precision` would give it;
    # auto: each Accelerate config's own, else bf16 on GPUs and fp32 on CPUs (default_precision)
    mixed = cfg.model.mixed_precision if cfg is not None and cfg.model.mixed_precision != "auto" else None
    configs = None
    if opts["configs"]:
        try:
            configs = [accelerate_config_path(n) for n in opts["configs"].split(",") if n]
        except ConfigError as e:
            problems += e.problems
    machines = None
    if gpus is None:
        gpus, memory = _local_gpus()
        sizes.setdefault("gpu_memory", memory)
    if gpus:
        if not sizes.get("gpu_memory"):
            problems.append(("--gpu_memory", "is required with --num_gpus: the memory of one GPU, e.g. 80GB"))
        else:
            host = sizes.get("host_memory")
            machines = Machines(gpus, per_node or min(gpus, 8), sizes["gpu_memory"], host, mixed_precision=mixed)
    else:
        machines = Machines(0, 0, 0.0, sizes.get("host_memory") or host_memory_gb(), procs or 2, mixed)
    if cfg is not None and problems == [] and target is not None:
        dp_max = machines.processes
        if target % dp_max and target < dp_max:
            problems.append(
                ("--global_batch_size", f"{target} is smaller than the {dp_max} processes; give at least {dp_max}")
            )
    if problems:
        raise ConfigError(problems)
    return cfg, machines, target, configs


def _local_gpus() -> tuple[int, float]:
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return n, torch.cuda.get_device_properties(0).total_memory / GB
    except Exception:  # noqa: BLE001 -- no usable CUDA: plan for CPU processes
        pass
    return 0, 0.0


def render(shape: ModelShape, cfg: RunConfig, machines: Machines, rows: list[Estimate], rec: Recommendation) -> str:
    """The table (one row per config) and the recommendation."""
    gpu = machines.on_gpu
    lines = [
        f"model: {cfg.model.model}: {shape.total / 1e6:,.1f}M parameters, {shape.trainable / 1e6:,.1f}M trainable; "
        f"{shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}",
        f"batch: micro {cfg.train.per_device_train_batch_size} x seq {cfg.data.max_seq_length}"
        f"{', gradient checkpointing' if cfg.model.gradient_checkpointing else ''}"
        f"{', mixed precision ' + machines.mixed_precision if machines.mixed_precision else ''}; "
        f"on {machines.describe()}",
        "",
    ]
    kinds = ["parameters", "gradients", "optimizer", "master copy", "activations", "logits", "buffers", "overhead"]
    short = {"parameters": "params", "gradients": "grads", "optimizer": "optim", "master copy": "master"}
    head = f"{'config':<17} {'procs':>5} " + " ".join(f"{short.get(k, k)[:7]:>7}" for k in kinds)
    head += f" {'device GB' if gpu else '':>9} {'host GB':>8}  {'fits':<4}  notes"
    lines += [head, "-" * len(head)]
    for e in rows:
        if e.topology is None:
            lines.append(
                f"{e.config:<17} {'-':>5} " + " ".join(f"{'':>7}" for _ in kinds) + f" {'':>9} {'':>8}  no    {e.note}"
            )
            continue
        k = e.by_kind()
        device = f"{e.device_gb:9.2f}" if gpu else f"{'':>9}"
        cells = " ".join(f"{k.get(kind, 0.0):7.2f}" for kind in kinds)
        lines.append(
            f"{e.config:<17} {e.topology.num_processes:>5} {cells} {device} {e.host_gb:8.2f}  {'yes' if e.fits else 'no':<4}  {e.note}"
        )
    lines.append("")
    lines.append(
        "(per rank, GB; total = the parts that always exist + the larger of the forward/backward parts (activations,"
        " logits, gathers) and the optimizer-step parts (gradients freed after each step, their flat copies))"
    )
    if rec.config:
        launch = f"accelerate launch --config_file accelerate_configs/{rec.config}.yaml"
        if machines.nodes > 1 and (ROOT / "accelerate_configs" / f"multinode_{rec.config}.yaml").exists():
            launch = (
                f"accelerate launch --config_file accelerate_configs/multinode_{rec.config}.yaml "
                f"--num_machines {machines.nodes} --machine_rank R --main_process_ip HOST"
            )
        gc = " --gradient_checkpointing true" if rec.gradient_checkpointing else ""
        lines.append(
            f"recommended: {rec.config}, micro batch {rec.micro_batch} x gradient accumulation "
            f"{rec.gradient_accumulation_steps}{' with gradient checkpointing' if rec.gradient_checkpointing else ''}: "
            f"{rec.why}."
        )
        lines.append(
            f"  {launch} --num_processes {rec.estimate.topology.num_processes} -m finetune ... "
            f"--per_device_train_batch_size {rec.micro_batch} --gradient_accumulation_steps "
            f"{rec.gradient_accumulation_steps}{gc}"
        )
    else:
        lines.append(f"recommended: none: {rec.why}.")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`finetune plan`: exit 0 with a plan, 1 when nothing fits, 2 on bad input."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg, machines, target, configs = parse(argv)
        shape = shape_from_config(cfg)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    rows = plan(shape, cfg, machines, configs)
    rec = recommend(shape, cfg, machines, target, configs)
    print(render(shape, cfg, machines, rows, rec))
    return 0 if rec.config else 1
