"""Memory planning: what a run needs per rank under each Accelerate config, before anything runs.

    finetune plan --config run.yaml [--num_gpus 16 --gpus_per_node 8 --gpu_memory 80GB --host_memory 1TB]

The planner reads only the model's config (the model is built empty, on the meta device, to count its
parameters exactly, LoRA adapters included) and adds up, per rank, every component of the training peak:

  model states     parameters, gradients, AdamW's two moments, fp32 master copies, backend buffers (ZeRO-3
                   gathers and prefetch, DeepSpeed reduce buckets, FSDP's gathered layers): per backend,
                   from finetune/parallel/sharding.py (its docstring gives the bytes per parameter)
  activations      what autograd saves for backward (`activation_elements`), plus, at the start of backward,
                   the larger of the loss's logit copies and one layer's activation gradients
  logits           micro batch x sequence x vocabulary, fp32 in the loss (`logit_bytes`); with the chunked loss,
                   one chunk's tokens x vocabulary
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
estimate at 35M parameters on 2 ranks (1.84-1.93 GB against 1.60; 1.60 with the settings above)."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from finetune import chunked_loss
from finetune.config import AUTO_CLASSES, REFERENCE_METHODS, ConfigError, RunConfig
from finetune.parallel import sharding
from finetune.parallel.environment import launch_problems
from finetune.parallel.topology import Topology, launch_size, read_config_file, shipped_by_name

logger = logging.getLogger("finetune")


GB = 1e9


# A CPU rank's resident size in the training phase besides its model states, activations and buffers: the Python
# interpreter with torch, transformers, accelerate, datasets, the model code, the tokenized data and the process
# group (gloo). Measured on the development machine (2 ranks, a 2.9M-parameter Llama whose states are 0.05 GB;
# docs/memory.md): 0.56 GB per DDP rank; a DeepSpeed rank 0.03 GB more (deepspeed's import and its engine;
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
    # What tensor parallelism splits, each tensor once (a tied head is the input embeddings): the decoder layers'
    # weight matrices, the input embeddings and the head. transformers 5.23 adds the input embeddings (embed_tokens)
    # to every model's tp_plan (distributed/mixin.py init_parallel_plans, "embedding_rowwise": split over the
    # vocabulary), beside the plan's linears and lm_head ("colwise_gather_output"); Megatron-LM splits its vocabulary
    # embedding (VocabParallelEmbedding), output layer (ColumnParallelLinear) and the layers' matrices alike. Norms,
    # biases and learned position embeddings stay whole on every rank.
    tp_splittable: int
    weight_bytes: int  # bytes per weight as loaded (torch_dtype)
    tensor_sizes: tuple[int, ...] = ()
    model_type: str = ""  # config.model_type (whether the chunked loss applies)
    quantized: int = 0  # of total, the weights stored in 4 bits (QLoRA's base linears; sharding.NF4_BYTES each)
    num_labels: int = 0  # a classifier's outputs (its logits are rows x num_labels); 0: an LM head over the vocabulary
    input_embeddings: int = 0  # of tp_splittable, the input embeddings (the first pipeline stage's end)
    head: int = 0  # of tp_splittable, the head's own weights (the last stage's end); 0 when tied to the embeddings
    decoder_layers: int = 0  # an encoder-decoder's decoder blocks (of `layers`, which counts both stacks' blocks)
    position_bias: bool = False  # attention adds a learned bias (T5's relative positions): a trainable float mask
    dropout: float = 0.0  # the model config's dropout on hidden states (encoder-decoders; see seq2seq_activations)
    attention_dropout: float = 0.0  # and on attention probabilities
    activation_dropout: float = 0.0  # and on the MLP's activation

    def small_params(self, threshold: float) -> int:
        """Parameters in tensors below `threshold` elements (ZeRO-3 keeps those whole on every rank)."""
        return sum(n for n in self.tensor_sizes if n < threshold)

    @classmethod
    def of_model(
        cls, net, config, weight_bytes: int, numel=None, load_in_4bit: bool = False, task: str = "causal_lm"
    ) -> ModelShape:
        """Count a built model (on the meta device, or a real one: `numel` gives a partitioned one's full size), in
        weights (a 4-bit one packed two per byte counts as one weight each). load_in_4bit: a model built on the
        meta device for a QLoRA run, whose frozen decoder linears bitsandbytes would store in 4 bits (a loaded
        QLoRA model shows its 4-bit weights itself). task: the run's (a classifier's head outputs num_labels)."""
        import torch

        from finetune.model import weights_in

        size = numel or (lambda p: p.numel())

        def numel(p):
            return weights_in(p, size)

        params = list(net.parameters())
        layers, decoder = _stacks(net, config)
        layer_params = max((sum(numel(p) for p in layer.parameters()) for layer in layers), default=0)
        in_layers = sum(numel(p) for p in layers.parameters())
        total = sum(numel(p) for p in params)
        linears = [m for m in layers.modules() if isinstance(m, torch.nn.Linear)]
        own = [sum(numel(p) for p in m.parameters(recurse=False)) for m in net.modules()]
        text = getattr(config, "get_text_config", lambda: config)()
        hidden = _first(text, "hidden_size", "n_embd", "d_model")
        heads = _first(text, "num_attention_heads", "n_head")
        head_dim = getattr(text, "head_dim", None) or hidden // max(heads, 1)
        kv_heads = _first(text, "num_key_value_heads", "n_head", "num_attention_heads")
        quantized = sum(numel(p) for p in params if getattr(p, "quant_state", None) is not None)
        if load_in_4bit and not quantized:  # the base's linears, frozen under the adapter (its own stay in full)
            quantized = sum(numel(m.weight) for m in linears if not m.weight.requires_grad)
        return cls(
            total=total,
            trainable=sum(numel(p) for p in params if p.requires_grad),
            layers=len(layers),
            hidden=hidden,
            heads=heads,
            kv_dim=kv_heads * head_dim,
            intermediate=getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden,
            vocab=_first(text, "vocab_size"),
            gated_mlp=any("gate" in n.rsplit(".", 1)[-1] for n, _ in net.named_modules()),
            layer_params=layer_params,
            root_params=total - in_layers,
            largest_module=max(own, default=0),
            **_tp_split(net, layers, numel),
            weight_bytes=weight_bytes,
            tensor_sizes=tuple(sorted(numel(p) for p in params)),
            model_type=getattr(config, "model_type", ""),
            quantized=quantized,
            num_labels=int(getattr(config, "num_labels", 2) or 2) if task == "classification" else 0,
            decoder_layers=len(decoder),
            position_bias=bool(getattr(text, "relative_attention_num_buckets", 0)),
            dropout=_probability(text, "dropout_rate", "dropout", "hidden_dropout_prob", "resid_pdrop"),
            attention_dropout=_probability(
                text, "attention_dropout", "attention_probs_dropout_prob", "attn_pdrop", "dropout_rate"
            ),
            activation_dropout=_probability(text, "activation_dropout", "dropout_rate"),
        )


def _tp_split(net, layers, numel) -> dict[str, int]:
    """ModelShape's tp_splittable (what tensor parallelism splits, and why, is said there), input_embeddings and
    head, each tensor counted once: a tied head is the embeddings' Parameter."""
    import torch
    from transformers.pytorch_utils import Conv1D  # GPT-2's linears (Megatron-LM splits them as any other)

    def weight(module) -> torch.nn.Parameter | None:
        return getattr(module, "weight", None) if module is not None else None

    embeddings = weight(net.get_input_embeddings()) if hasattr(net, "get_input_embeddings") else None
    head = weight(net.get_output_embeddings()) if hasattr(net, "get_output_embeddings") else None
    matrices = [m.weight for m in layers.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]
    # a mixture of experts' fused experts (transformers 5.23: mlp.experts.gate_up_proj and down_proj, one 3D tensor
    # each, split by the plan's moe_tp_experts: packed by columns, by rows)
    matrices += [p for p in layers.parameters() if p.dim() >= 3]
    split = {id(p): p for p in [*matrices, embeddings, head] if p is not None}
    own_head = head is not None and head is not embeddings
    return {
        "tp_splittable": sum(numel(p) for p in split.values()),
        "input_embeddings": numel(embeddings) if embeddings is not None else 0,
        "head": numel(head) if own_head else 0,
    }


def _stacks(net, config):
    """(every block, the decoder's blocks): an encoder-decoder's both stacks, else the longest ModuleList."""
    import torch

    def blocks(module, key=len):  # the longest ModuleList: a stack's layers
        lists = (m for m in module.modules() if isinstance(m, torch.nn.ModuleList))
        return max(lists, key=key, default=torch.nn.ModuleList())

    def weight(m) -> int:  # a stack's blocks hold all its layers' weights (a T5 block's own list of 3 does not)
        return sum(p.numel() for p in m.parameters())

    base = net.get_base_model() if hasattr(net, "get_base_model") else net
    if getattr(config, "is_encoder_decoder", False) and hasattr(base, "get_encoder"):  # both stacks' blocks
        decoder = blocks(base.get_decoder(), weight)
        return torch.nn.ModuleList([*blocks(base.get_encoder(), weight), *decoder]), decoder
    return blocks(net), torch.nn.ModuleList()


def _first(config, *names: str) -> int:
    for n in names:
        value = getattr(config, n, None)
        if value:
            return int(value)
    return 0


def _probability(config, *names: str) -> float:
    """The first of these config fields that the config has (0.0 if none)."""
    for n in names:
        value = getattr(config, n, None)
        if value is not None:
            return float(value)
    return 0.0


WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def shape_from_config(cfg: RunConfig, num_labels: int = 2, config=None) -> ModelShape:
    """The ModelShape of the run's model (or of `config`, a transformers config object): its config only, built
    empty on the meta device, adapters applied."""
    import transformers
    from accelerate import init_empty_weights

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
    cls = getattr(transformers, AUTO_CLASSES[cfg.model.task])  # finetune.model builds the same
    with init_empty_weights():
        net = cls.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    net.tie_weights()  # under init_empty_weights T5's embeddings come out untied (and tie_weights does nothing there)
    with init_empty_weights():
        if cfg.peft.method != "none" and not cfg.peft.adapter:
            net = model_lib.apply_peft(net, cfg.peft, cfg.model.task)
    return ModelShape.of_model(net, config, weight_bytes, load_in_4bit=cfg.peft.load_in_4bit, task=cfg.model.task)


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


def logit_bytes(s: ModelShape, tokens: int, half: bool) -> float:
    """The loss's logit copies at the start of backward: transformers' loss upcasts logits to fp32, cross_entropy
    saves its fp32 log_softmax, and backward makes the gradient of that and of the logits (3 fp32 copies of
    tokens x vocab); under 16-bit mixed precision the 16-bit logits and their gradient add 2 bytes. tokens: the
    micro batch's, or one chunk's under the chunked loss (which rebuilds them a chunk at a time in backward).
    A classifier's head outputs num_labels per position (a decoder's score head scores every position before
    pooling the last; an encoder's pools first), not the vocabulary."""
    return tokens * logit_width(s) * (12 + (2 if half else 0))


def logit_width(s: ModelShape) -> int:
    """What the head outputs per position: a classifier's labels, else the vocabulary."""
    return s.num_labels or s.vocab


def seq2seq_activations(s: ModelShape, batch: int, seq: int, nbytes: int, eager: bool, on_gpu: bool):
    """(encoder layer, decoder layer, shared) bytes autograd saves for an encoder-decoder (T5, BART), the source and
    the target each seq long (both are cut to max_seq_length). Measured on CPU (docs/memory.md) with what each op
    saves, as activation_elements counts a decoder-only layer, and:
      a decoder layer's cross-attention: its norm, q, k and v over the encoder's output, attention output, o input
                                                                          5 s b h + 2 s b kv
      the model's dropout (a fresh model config's, e.g. T5's dropout_rate 0.1): each site keeps its noise (fp32 on
      the CPU, where torch multiplies by it; a bool mask on a GPU) and the dropped copy: after the attention and MLP
      outputs (cross-attention's output too), and the MLP activation (BART's activation_dropout)
                                                                                   (2 s b h + s b i) x (noise + w)
      attention probabilities, b a s^2 per attention call, where they are materialised: eager attention (2, 3 with
      dropout); SDPA on a CPU falls back to its math kernel, which keeps them, where the mask needs a gradient (T5's
      learned position bias: self-attention) or attention dropout is on (1, 3 with dropout: probabilities, noise,
      dropped); on a GPU SDPA's kernels keep none
      shared by a stack's layers: the mask of each attention kind (b s^2), and on a GPU, with a learned position bias,
      the bias added to it, which SDPA's kernel keeps (b a s^2 for the encoder's self-attention, the decoder's self-
      and cross-attention; the CPU's math kernel adds it and keeps none)
    Nothing is added for a layer's gradients in backward (a decoder-only layer's are): measured on a CPU, a T5's and a
    BART's training peak was their saved tensors, a layer's gradients taking the place of what it frees."""
    sbh, sbi, sbkv = seq * batch * s.hidden, seq * batch * s.intermediate, seq * batch * s.kv_dim
    noise = 1 if on_gpu else 4
    drop = ((2 * sbh if s.dropout > 0 else 0) + (sbi if s.activation_dropout > 0 else 0)) * (noise + nbytes)
    scores = batch * s.heads * seq * seq
    attn_drop = s.attention_dropout > 0

    def probabilities(self_attention: bool) -> float:
        if eager:
            return (3 if attn_drop else 2) * scores * nbytes
        math_kernel = not on_gpu and (attn_drop or (self_attention and s.position_bias))
        return (scores * (2 * nbytes + noise) if attn_drop else scores * nbytes) if math_kernel else 0.0

    encoder = activation_elements(s, batch, seq) * nbytes + drop + probabilities(True)
    cross = (5 * sbh + 2 * sbkv) * nbytes + (sbh * (noise + nbytes) if s.dropout > 0 else 0.0) + probabilities(False)
    shared = 3 * batch * seq * seq * nbytes + (3 * scores * nbytes if s.position_bias and on_gpu else 0.0)
    return encoder, encoder + cross, shared


def activation_parts(
    s: ModelShape, topo: Topology, batch: int, seq: int, cfg: RunConfig, half: bool, on_gpu: bool = True
):
    """(activations, logits) Parts for one micro batch; gradient checkpointing keeps only each layer's input and
    recomputes one layer at a time. An encoder-decoder's layers: seq2seq_activations."""
    tp, in_flight = sharding.activation_split(topo)
    nbytes = 2 if half else s.weight_bytes
    eager = cfg.model.attn_implementation == "eager"
    per_layer = activation_elements(s, batch, seq, tp, eager) * nbytes
    layers = sharding.layers_per_rank(topo, s.layers)
    # a padded or packed batch's attention mask, batch x seq^2, one tensor all layers share and keep for backward
    # (model.masks_converted_once)
    mask = batch * seq * seq * nbytes
    stacks, one_layer = None, per_layer  # one_layer: what a recomputed layer saves
    if s.decoder_layers:  # not split by TP or PP: those refuse encoder-decoders
        encoder, decoder, mask = seq2seq_activations(s, batch, seq, nbytes, eager, on_gpu)
        stacks = (s.layers - s.decoder_layers) * encoder + s.decoder_layers * decoder
        one_layer, per_layer = max(encoder, decoder), 0.0
    if cfg.model.gradient_checkpointing:
        saved = layers * seq * batch * s.hidden * nbytes + one_layer + mask
        how = "layer inputs + one recomputed layer (gradient checkpointing) + the attention mask"
    elif stacks is not None:
        saved = stacks + mask
        how = f"{s.layers - s.decoder_layers} encoder + {s.decoder_layers} decoder layers + masks {mask / 1e6:.0f} MB"
    else:
        saved = layers * per_layer + mask
        how = f"{per_layer / 1e6:.0f} MB x {layers:g} layers + the attention mask {mask / 1e6:.0f} MB"
    tokens = batch * seq
    chunked = _chunked_loss(s, cfg)
    if chunked:
        tokens = min(tokens, chunked_loss.chunk_tokens(cfg.model.loss_chunk_tokens, s.vocab))
    logits = logit_bytes(s, tokens, half)
    if chunked and cfg.peft.method == "none":  # each chunk's head weight gradient, before it is added to .grad
        logits += s.vocab * s.hidden * s.weight_bytes
    # at the start of backward the logit copies are alive; later one layer's activation gradients: the larger
    peak = saved * in_flight + max(logits, per_layer)
    return [
        sharding.Part("activations", peak - logits if logits >= per_layer else peak, note=how, phase=sharding.BACKWARD),
        sharding.Part(
            "logits",
            logits if logits >= per_layer else 0.0,
            note=f"{batch}x{seq}x{logit_width(s)}, fp32 loss"
            if tokens == batch * seq
            else f"{tokens}x{s.vocab}, chunked loss"
            + (" + a chunk's head weight gradient" if cfg.peft.method == "none" else ""),
            phase=sharding.BACKWARD,
        ),
    ]


def _chunked_loss(s: ModelShape, cfg: RunConfig) -> bool:
    """Whether the run's loss (training and evaluation) is chunked, as model.build_model decides it."""
    return chunked_loss.wanted(cfg.model.chunked_loss, s.model_type, cfg.model.task, s.vocab, s.hidden, s.total)


def eval_parts(s: ModelShape, cfg: RunConfig, half: bool, topology: Topology) -> list:
    """Evaluation's logits, where the run evaluates (without gradients, between steps): one chunk's where finetune's
    loss forward runs (a plain-head causal LM, not under Megatron-LM: chunked_loss.row_nll, chunked without
    gradients whatever chunked_loss says); else an eval batch's logits in the compute dtype, and one row's fp32
    copy and log-softmax at a time (metrics.per_example_stats; preference pairs, two rows each:
    preference.sequence_logps)."""
    d = cfg.data
    if not (d.eval_dataset or d.eval_split or d.eval_fraction > 0) or cfg.model.task == "classification":
        return []
    rows = cfg.train.per_device_eval_batch_size * cfg.train.rows_per_example
    tokens = rows * d.max_seq_length
    if topology.transformers_forward and chunked_loss.supported(s.model_type, cfg.model.task):
        chunk = min(tokens, chunked_loss.chunk_tokens(cfg.model.loss_chunk_tokens, s.vocab))
        note = f"{chunk}x{s.vocab}, a chunk at a time"
        return [sharding.Part("eval", logit_bytes(s, chunk, half), note=note, phase=sharding.EVAL)]
    whole = tokens * s.vocab * (2 if half else s.weight_bytes) + d.max_seq_length * s.vocab * 8
    note = f"{rows}x{d.max_seq_length}x{s.vocab}, a row at a time in fp32"
    return [sharding.Part("eval", whole, note=note, phase=sharding.EVAL)]


def peak_bytes(parts: list, on_host: bool) -> float:
    """The peak of the parts in one memory: what always exists, plus the largest of the forward/backward parts, the
    optimizer-step parts (activations are freed by the time the step runs) and evaluation's."""
    mine = [p for p in parts if p.on_host == on_host]
    always = sum(p.bytes for p in mine if p.phase == sharding.ALWAYS)
    phases = (sharding.BACKWARD, sharding.STEP, sharding.EVAL)
    return always + max(sum(p.bytes for p in mine if p.phase == phase) for phase in phases)


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
    refused: list = field(default_factory=list)  # (key, why): what the run refuses under this layout; not estimated

    def by_kind(self) -> dict[str, float]:
        return self._sum_by("name")

    def by_phase(self) -> dict[str, float]:
        """GB per phase (sharding.ALWAYS, BACKWARD, STEP, EVAL), device and host together."""
        return self._sum_by("phase")

    def _sum_by(self, field_name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.parts:
            key = getattr(p, field_name)
            out[key] = out.get(key, 0.0) + p.bytes / GB
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
    batch = (micro_batch or cfg.train.per_device_train_batch_size) * cfg.train.rows_per_example
    parts = sharding.model_states(topology, shape, mixed_precision, buckets)
    if (accumulation or cfg.train.gradient_accumulation_steps) > 1:  # gradients live across micro batches
        parts = [dataclasses.replace(p, phase=sharding.ALWAYS) if p.name == "gradients" else p for p in parts]
    parts += activation_parts(shape, topology, batch, cfg.data.max_seq_length, cfg, half, machines.on_gpu)
    parts += eval_parts(shape, cfg, half, topology)
    t = cfg.train
    if t.method in REFERENCE_METHODS and t.reference == "live" and cfg.peft.method == "none":
        parts.append(sharding.frozen_copy(topology, shape))
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
    found = shipped_by_name()
    return [found[n] for n in PREFERENCE if n in found]


def one_process(path: Path) -> bool:
    """Whether an Accelerate config file launches one process (single.yaml)."""
    return read_config_file(path)[0].num_processes == 1


def plan_config(
    shape: ModelShape, cfg: RunConfig, path: Path, machines: Machines, micro_batch=None, accumulation=None
) -> Estimate:
    """The estimate of one Accelerate config file launched on `machines` (num_processes from the machines, as
    `accelerate launch --num_processes` would; fixed-size layouts such as tp2 keep theirs), at this micro batch and
    accumulation (default: the run config's). A layout the run would refuse at start with this run config (its
    backend's own problems(): adapters under tensor parallelism, QLoRA under ZeRO-3 or FSDP2, seq2seq under FSDP2,
    ...) is not estimated: its Estimate holds the refusals."""
    name = path.stem
    if not machines.on_gpu and read_config_file(path)[0].needs_gpu:
        return Estimate(name, None, note="GPU only (Megatron-LM)")
    n, why = launch_size(path, machines.processes)
    if not n:
        return Estimate(name, None, note=why)
    topo, ds, mixed = read_config_file(path, num_processes=n, num_machines=math.ceil(n / machines.per_node))
    t = cfg.train
    as_run = dataclasses.replace(
        t,
        per_device_train_batch_size=micro_batch or t.per_device_train_batch_size,
        gradient_accumulation_steps=accumulation or t.gradient_accumulation_steps,
    )
    refused = launch_problems(dataclasses.replace(cfg, train=as_run), path, n)
    if refused:
        return Estimate(name, topo, note=why, refused=refused, micro_batch=micro_batch or t.per_device_train_batch_size)
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


def run_estimate(cfg: RunConfig, accelerator, backend, net) -> Estimate:
    """This run's per-rank estimate for its own topology, from the built model (logged at start)."""
    import torch

    topology, numel = backend.topology, backend.numel
    config = getattr(net, "config", None)
    dtype = next((p.dtype for p in net.parameters()), torch.float32)
    weight_bytes = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    shape = ModelShape.of_model(net, config, weight_bytes, numel, task=cfg.model.task)
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
