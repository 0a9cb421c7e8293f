"""Model and tokenizer: from a Hub id or a local directory, through transformers' Auto classes.

Nothing here is architecture-specific: any model that AutoModelForCausalLM,
AutoModelForSequenceClassification or AutoModelForSeq2SeqLM (task seq2seq) loads can be fine-tuned.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from finetune import chunked_loss
from finetune.config import AUTO_CLASSES, ConfigError, ModelArgs, PeftArgs
from finetune.config.preflight import PORTABLE, STATE_FILE
from finetune.config.rules import encoder_decoder_problems, position_problems

logger = logging.getLogger("finetune")
SINGLE_LABEL = "single_label_classification"  # the only problem_type finetune trains (one class per example)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_error(what: str, spec: str, e: Exception, key: str = "model", fix: str | None = None) -> ConfigError:
    """A model, tokenizer or config that from_pretrained could not load: the key that named it, and the fix (given
    where the run config's model is not what named it: `finetune merge`)."""
    first = (str(e).strip().splitlines() or [""])[0]
    if fix is None and os.path.isdir(spec):
        fix = "point model at a directory saved with save_pretrained"
    elif fix is None:
        fix = (
            "it is not a local directory and the Hub is unreachable or offline (HF_HUB_OFFLINE): "
            "give a local model directory, or a Hub id with the Hub reachable"
        )
    return ConfigError([(key, f"could not load the {what} from {spec!r} ({type(e).__name__}: {first}); {fix}")])


def load_tokenizer(m: ModelArgs):
    """Tokenizer with a pad token (EOS when it has none) and right padding; chat template override."""
    from transformers import AutoTokenizer

    if m.trust_remote_code:
        logger.warning("trust_remote_code is on: code shipped with %s will run", m.model)
    try:
        tok = AutoTokenizer.from_pretrained(m.model, trust_remote_code=m.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise load_error("tokenizer", m.model, e) from None
    _refuse_a_tokenizer_from_nothing(m.model, tok)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ConfigError(
                [
                    (
                        "model",
                        f"the tokenizer of {m.model!r} has neither a pad nor an EOS token; add one "
                        "with tokenizer.add_special_tokens and save it",
                    )
                ]
            )
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    if m.chat_template:
        tok.chat_template = open(m.chat_template).read() if os.path.isfile(m.chat_template) else m.chat_template
    return tok


def _refuse_a_tokenizer_from_nothing(path: str, tok) -> None:
    """transformers 5 builds a tokenizer of the config's class from a directory that holds no tokenizer files (a
    checkpoint written by an earlier finetune; weights copied alone): its special tokens only. Qwen's and GPT-2's
    (1 token) encode every text to nothing (a Qwen3-MoE run stopped: 'no supervised token left after truncation'),
    BERT's (5) and T5's to unknown tokens (a run would train on them)."""
    if not os.path.isdir(path):
        return
    files = {"tokenizer.json", "tokenizer_config.json", *type(tok).vocab_files_names.values()}
    if not any(os.path.isfile(os.path.join(path, f)) for f in files):
        raise ConfigError(
            [
                (
                    "model",
                    f"{path!r} holds no tokenizer files ({', '.join(sorted(files))}): transformers would build a "
                    "tokenizer of its special tokens only. Add the base model's tokenizer to it "
                    "(AutoTokenizer.from_pretrained(BASE).save_pretrained(DIR)); a checkpoint written by an "
                    "earlier finetune holds none",
                )
            ]
        )


def peft_missing(key: str = "peft.method") -> list[tuple[str, str]]:
    """[(key, the install line)] when the peft package is not installed; [] when it is."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return [(key, "needs the peft package: pip install 'finetune[peft]'")]
    return []


def check_peft_support(pe: PeftArgs) -> None:
    """Refuse what cannot run here, before anything heavy starts."""
    if pe.method == "none":
        return
    if peft_missing():
        raise ConfigError(peft_missing())
    if pe.load_in_4bit:
        import importlib.util

        if not torch.cuda.is_available():
            raise ConfigError(
                [
                    (
                        "peft.load_in_4bit",
                        "QLoRA's 4-bit base weights (bitsandbytes) need a CUDA GPU and "
                        "none is visible; set peft.load_in_4bit: false (plain LoRA) here",
                    )
                ]
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError([("peft.load_in_4bit", "needs bitsandbytes: pip install bitsandbytes")])


def newly_initialised(net, missing_keys) -> list[str]:
    """The outermost modules whose every weight from_pretrained initialised from nothing (missing from the
    checkpoint): a classifier's head, a pooler a base checkpoint lacks (DeBERTa's), DistilBERT's pre_classifier."""
    missing, found = set(missing_keys), []
    for name, module in net.named_modules():
        weights = [f"{name}.{n}" for n, _ in module.named_parameters()]
        if name and weights and missing.issuperset(weights) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def _say_if_trained_on_other_weights(adapter: str, base: str) -> None:
    """peft.adapter continued on a base model whose weights are not those it was trained on (its base_model.json:
    fingerprint.check): PEFT loads an adapter into any base of the same shapes without a word. Carrying an adapter
    to a sibling fine-tune can be meant, so the run goes on, saying so at start."""
    from finetune import fingerprint

    verdict = fingerprint.check(adapter, base)
    if verdict.same is False:
        logger.warning(
            "peft.adapter %s was trained on other weights than the model's, %s (%s; its base: %s): it continues on "
            "this model as asked; if that was not meant, set model to the adapter's base",
            adapter,
            base,
            verdict.note,
            verdict.trained_on,
        )


def apply_peft(net, pe: PeftArgs, task: str, new_modules: list[str] = ()):
    """Wrap the model with a LoRA/DoRA adapter (new, or continued from pe.adapter). new_modules (newly_initialised)
    are trained in full and saved with the adapter, as PEFT does a classifier's head: frozen, they would stay random
    in training and be drawn anew by every reload of the adapter (and its merge)."""
    if pe.method == "none":
        return net
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model

    if pe.adapter:
        _say_if_trained_on_other_weights(pe.adapter, net.name_or_path)
        return PeftModel.from_pretrained(net, pe.adapter, is_trainable=True)
    targets = pe.target_modules[0] if pe.target_modules == ["all-linear"] else pe.target_modules
    keep = list(pe.modules_to_save or [])
    keep += [m for m in new_modules if m not in keep]
    if new_modules:
        logger.info("trained in full and saved with the adapter (newly initialised): %s", ", ".join(new_modules))
    config = LoraConfig(
        r=pe.r,
        lora_alpha=pe.alpha,
        lora_dropout=pe.dropout,
        target_modules=targets,
        modules_to_save=keep or None,
        use_dora=pe.method == "dora",
        task_type={"classification": TaskType.SEQ_CLS, "seq2seq": TaskType.SEQ_2_SEQ_LM}.get(task, TaskType.CAUSAL_LM),
    )
    try:
        return get_peft_model(net, config)
    except TypeError as e:  # PEFT matched a LoRA layer as a module to save (by its name's end: pre_classifier)
        raise ConfigError(
            [("peft.modules_to_save", f"{e}. Exclude that layer from peft.target_modules, or name it exactly")]
        ) from None
    except ValueError as e:  # e.g. target modules not found
        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, mod in net.named_modules() if isinstance(mod, torch.nn.Linear)}
        )
        raise ConfigError(
            [
                (
                    "peft.target_modules",
                    f"{e}".splitlines()[0] + f" Set peft.target_modules to some of this model's linear layers "
                    f"({', '.join(linear)}) or [all-linear]",
                )
            ]
        ) from None


def build_model(
    m: ModelArgs,
    tokenizer,
    label_names: list[str] | None,
    max_seq_length: int,
    pe: PeftArgs | None = None,
    reentrant_checkpointing: bool = False,
    extra_kwargs: dict | None = None,
    load_weights: bool = True,
    micro_batch_tokens: int = 0,
    eval_batch_tokens: int = 0,
    numel: Callable[[torch.nn.Parameter], int] = torch.nn.Parameter.numel,
    mixed_precision: str = "no",
):
    """Load the model for the task; a classifier gets a head sized to the labels in the data; adapters on top.
    load_weights False: the architecture only, on the meta device (the backend brings its own weights).
    micro_batch_tokens, eval_batch_tokens: the most tokens a training micro batch and an eval batch hold (the
    chunked loss cuts every one alike). numel: a parameter's full size (the backend's: ZeRO-3 partitions at load).
    mixed_precision: the run's (no, bf16, fp16): what QLoRA's 4-bit layers compute in."""
    import transformers
    from transformers import AutoConfig

    config = _check_config(m, max_seq_length, pe)
    masks_without_host_sync()
    masks_converted_once()
    kwargs = _load_kwargs(m, pe, label_names, mixed_precision)
    if label_names is not None:
        _say_what_becomes_of_the_head(m.model, config, label_names)
    cls = getattr(transformers, AUTO_CLASSES[m.task])
    missing = ()
    try:
        if load_weights:
            model, info = cls.from_pretrained(m.model, **kwargs, **(extra_kwargs or {}), output_loading_info=True)
            missing = info["missing_keys"]
            saves_as_its_base(model, m.model)
        else:
            config = AutoConfig.from_pretrained(m.model, trust_remote_code=m.trust_remote_code)
            with torch.device("meta"):
                model = cls.from_config(config, trust_remote_code=m.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        if m.attn_implementation and "attn_implementation" in str(e):
            first = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(
                [("attn_implementation", f"{first} Set attn_implementation to one of those, or drop it")]
            ) from None
        raise load_error("model", m.model, e) from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant_checkpointing})
        if reentrant_checkpointing:  # reentrant checkpoints need an input that requires grad (frozen embeddings)
            model.enable_input_require_grads()
    if load_weights:
        _set_loss(model, m, micro_batch_tokens, eval_batch_tokens, numel)
    if not pe:
        return model
    return apply_peft(
        model, pe, "classification" if label_names is not None else m.task, newly_initialised(model, missing)
    )


def _set_loss(model, m: ModelArgs, micro_batch_tokens: int, eval_batch_tokens: int, numel) -> None:
    """finetune's loss forward for a plain-head causal LM (the head on the supervised positions only), chunked where
    chunked_loss asks for it; under torch_compile the loss compiled (chunked or not)."""
    vocab, hidden, params = full_sizes(model, numel)
    chunked = chunked_loss.wanted(m.chunked_loss, model.config.model_type, m.task, vocab, hidden, params)
    if chunked_loss.supported(model.config.model_type, m.task):
        chunk = chunked_loss.chunk_tokens(m.loss_chunk_tokens, vocab)
        pieces = chunked_loss.install(model, chunk, micro_batch_tokens, eval_batch_tokens, m.torch_compile, chunked)
        if chunked:
            logger.info(
                "chunked loss: up to %d tokens per chunk, %d chunks per micro batch (vocabulary %d; chunked_loss %s; "
                "eval too); the LM head on the learned positions only",
                chunk,
                pieces,
                vocab,
                m.chunked_loss,
            )
        else:
            logger.info("loss: the LM head on the learned positions only (chunked_loss %s)", m.chunked_loss)
    elif m.torch_compile and m.task == "causal_lm":  # transformers' loss, compiled too
        model.loss_function = chunked_loss.compiled_loss(model.loss_function)


def full_sizes(model, numel: Callable[[torch.nn.Parameter], int]) -> tuple[int, int, int]:
    """The vocabulary, hidden size and parameter count of a loaded model, as every layout sees it (numel: a
    parameter's full size, the backend's)."""
    embeddings = model.get_input_embeddings()
    params = sum(weights_in(p, numel) for p in model.parameters())
    return embeddings.num_embeddings, embeddings.embedding_dim, params


def weights_in(p: torch.nn.Parameter, numel: Callable[[torch.nn.Parameter], int]) -> int:
    """How many weights a parameter holds (numel: the backend's full size): a QLoRA base weight packs two 4-bit
    weights per byte (bitsandbytes' Params4bit, half the elements), its quant_state keeps the weight's own shape.
    The model's sizes (parameter counts, FLOPs, MFU) count weights; memory counts bytes (finetune.memory)."""
    state = getattr(p, "quant_state", None)
    shape = getattr(state, "shape", None)
    return shape.numel() if shape is not None else numel(p)


def masks_without_host_sync() -> None:
    """Workaround (transformers 5.23): a training forward builds its attention mask without waiting for the device.

    To skip the mask where it can, masking_utils reads the batch on the host in every forward: whether a padding
    mask is all ones (`_ignore_causal_mask_sdpa`), and whether position_ids hold more than one sequence per row
    (`find_packed_sequence_indices`). On a GPU each read makes the host wait until the device has finished all the
    work queued before it, every micro batch. So with gradients enabled (a training forward) the mask is built
    without the reads: where the reads would have skipped it (a batch without padding, a packed batch of one
    sequence per row), the plain causal mask is built instead, which gives equal results. Evaluation and
    generation (no gradients) keep transformers' own path.
    tests/test_host_sync.py::test_transformers_still_reads_masks_on_the_host fails once transformers stops
    reading them: then delete this."""
    from transformers import masking_utils as mu

    if getattr(mu, "_finetune_without_host_sync", False):
        return
    find_packed, ignore_causal = mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa

    def find_packed_sequence_indices(position_ids):
        if not torch.is_grad_enabled():
            return find_packed(position_ids)
        first = position_ids[:, :1] - 1  # as transformers computes it, without the "one sequence per row?" read
        return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)

    def _ignore_causal_mask_sdpa(padding_mask, *args, **kwargs):
        if padding_mask is not None and torch.is_grad_enabled():
            return False  # a padded training batch needs its mask (transformers reads it to find that out)
        return ignore_causal(padding_mask, *args, **kwargs)

    find_packed_sequence_indices.__wrapped__, _ignore_causal_mask_sdpa.__wrapped__ = find_packed, ignore_causal
    mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa = (
        find_packed_sequence_indices,
        _ignore_causal_mask_sdpa,
    )
    mu._finetune_without_host_sync = True


def saves_as_its_base(net, path: str) -> None:
    """A whole model loaded from a finetune checkpoint's weights (checkpoint.Resume.model_dir: a resume converted from
    another layout, final/ from the best checkpoint, a checkpoint named as a new run's model, or as the base an
    adapter is merged into) saves in the layout its base model came in, as every other export does.

    A checkpoint holds transformers' in-memory names (a mixture of experts' fused mlp.experts.gate_up_proj, where
    Mixtral's and Qwen-MoE's Hub checkpoints hold each expert's own linears), so loading it uses none of the model's
    weight conversions; transformers 5.23 reverts at save only the conversions its load used
    (core_model_loading.py:1876) and final/ kept the fused names (seen: a tiny Qwen3-MoE resumed in one process from
    a TP checkpoint). With no record of a load, save_pretrained reverts the model class's own conversions, as for a
    model made from its config (revert_weight_conversion)."""
    path = os.path.abspath(path)
    holder = os.path.dirname(path) if os.path.basename(path) == PORTABLE else path
    if os.path.isfile(os.path.join(holder, STATE_FILE)):
        net._weight_conversions = None


def masks_converted_once() -> None:
    """Workaround (transformers 5.23 with torch 2.13): a training forward converts its attention mask once, not in
    every layer.

    For a padded or packed batch transformers builds the boolean mask that scaled_dot_product_attention takes, once
    per forward, and hands that tensor to every layer. torch converts a boolean mask into an additive float one in
    each call, and autograd keeps each layer's copy for backward: layers x batch x seq^2 x 4 bytes in fp32 (a 93M
    model's 8 layers at 4,864 packed tokens: 757 MB, a third of its saved activations; bf16 halves it). So with
    gradients enabled the sdpa mask function returns the float mask itself (0 where attention goes, the dtype's
    minimum elsewhere, as transformers' eager masks are), in the dtype attention computes in (autocast's where it
    is on): every layer then uses, and autograd keeps, that one tensor. Evaluation and generation keep
    transformers' boolean masks (nothing is kept for backward there).
    tests/test_memory.py::test_torch_still_keeps_a_converted_mask_per_attention_call fails once torch stops keeping
    a copy per call: then delete this."""
    from transformers import masking_utils as mu

    if getattr(mu, "_finetune_masks_converted_once", False):
        return
    boolean = mu.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def sdpa_mask(*args, **kwargs):
        mask = boolean(*args, **kwargs)
        if mask is None or mask.dtype != torch.bool or not torch.is_grad_enabled():
            return mask
        kind = mask.device.type
        dtype = (
            torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else kwargs.get("dtype", torch.float32)
        )
        return torch.where(mask, torch.zeros((), device=mask.device, dtype=dtype), torch.finfo(dtype).min)

    sdpa_mask.__wrapped__ = boolean
    mu.AttentionMaskInterface.register("sdpa", sdpa_mask)
    mu._finetune_masks_converted_once = True


def packing_problems(m: ModelArgs, packing: bool) -> list[tuple[str, str]]:
    """packing: true where the model would let packed examples attend to each other (from its config, before the
    Accelerator, the data or the weights). An unreadable config is left to the model's loading, which says why."""
    if not packing or m.task != "causal_lm":
        return []
    config = model_config(m)
    if config is None or packing_isolates(config, m.trust_remote_code):
        return []
    return [
        (
            "packing",
            f"is true, but {m.model} ({getattr(config, 'model_type', 'unknown type')}) would let the examples "
            "packed into a row attend to each other: its modeling code does not hand the restarting position_ids "
            "to transformers' attention mask (OPT, Falcon, Bloom, MPT, XGLM and BioGPT in transformers 5.23), so "
            "no per-example mask is built; set packing: false (each example in its own padded row)",
        )
    ]


def packing_isolates(config, trust_remote_code: bool = False) -> bool:
    """Whether the causal LM of `config` keeps packed examples apart. finetune's packed rows carry no padding
    mask, only position_ids that restart at each example, and transformers' masking_utils turns those into a
    block-diagonal mask only where the model's forward passes them to it (create_causal_mask(position_ids=...)):
    many do, some do not. Found by a forward of the model built on the meta device (no weights, no memory) with
    masking_utils' argument check watched: every mask it asks for must get the position_ids and no padding mask.
    A model that builds no mask there (its own masking code, or one that fails to build) counts as mixing them.
    tests/test_data.py::test_packing_isolation_is_decided_per_model_type checks this against real forwards."""
    import inspect

    from transformers import AutoModelForCausalLM

    try:
        from transformers import masking_utils as mu

        original = mu._preprocess_mask_arguments
    except (ImportError, AttributeError):  # a transformers this check does not know: say so, refuse nobody
        logger.warning("packing: cannot check that this transformers keeps packed examples apart; trusting it")
        return True
    signature = inspect.signature(original)
    asked: list[bool] = []

    def watched(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments
        asked.append(given["position_ids"] is not None and given["attention_mask"] is None)
        return True, None, None, None, None, None, None  # "no mask": the rest of the forward runs on meta tensors

    mu._preprocess_mask_arguments = watched
    try:
        with torch.device("meta"):
            net = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
            takes = "use_cache" in inspect.signature(net.forward).parameters
            ids, positions = torch.zeros((1, 4), dtype=torch.long), torch.tensor([[0, 1, 0, 1]])
            net(input_ids=ids, position_ids=positions, **({"use_cache": False} if takes else {}))
    except Exception:  # noqa: BLE001 -- masks are asked for before the layers run; a meta op failing later is no matter
        pass
    finally:
        mu._preprocess_mask_arguments = original
    return bool(asked) and all(asked)


def _check_config(m: ModelArgs, max_seq_length: int, pe: PeftArgs | None):
    """What the model's config says before its weights load (a Hub model's config.json was not there to check
    at validation): the task's kind of model, enough positions for max_seq_length, and no merge into a base stored
    quantized. Returns the config."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(m.model, trust_remote_code=m.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise load_error("model config", m.model, e) from None
    problems = encoder_decoder_problems(
        m.task, bool(getattr(config, "is_encoder_decoder", False)), m.model, getattr(config, "model_type", None)
    )
    positions = ("model_type", "max_position_embeddings", "n_positions", "pad_token_id", "position_embedding_type")
    problems = problems or position_problems(m.model, {k: getattr(config, k, None) for k in positions}, max_seq_length)
    quantized = quantized_base(config, m.model)
    if pe is not None and pe.merge and quantized:
        problems.append(("peft.merge", f"{quantized}; set peft.merge: false (final/ holds the adapter)"))
    if problems:
        raise ConfigError(problems)
    return config


def quantized_base(config, name: str) -> str | None:
    """Why an adapter cannot be merged into a base model stored quantized (a *-bnb-4bit release): its weights load
    quantized, the merged weights would be quantized again (the adapter's update rounded away), and a quantized
    model cannot be cast to the save dtype. None where the config names no quantization."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", "")
    )
    return (
        f"{name} is stored quantized ({method}): an adapter merged into it would be quantized again and could not "
        "be saved in full precision; merge it into the model's full-precision release instead (peft: "
        "PeftModel.from_pretrained(base, adapter).merge_and_unload())"
    )


def _load_kwargs(m: ModelArgs, pe: PeftArgs | None, label_names: list[str] | None, mixed_precision: str) -> dict:
    """from_pretrained's arguments: dtype, attention, 4-bit quantization (its layers compute in the run's mixed
    precision: fp32 where it has none, as every other layer does), a classifier head for the labels."""
    kwargs = {"dtype": DTYPES[m.torch_dtype], "trust_remote_code": m.trust_remote_code}
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    if pe is not None and pe.load_in_4bit:
        from transformers import BitsAndBytesConfig

        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute
        )
    if label_names is not None:
        kwargs.update(head_kwargs(label_names), ignore_mismatched_sizes=True)
    return kwargs


def head_kwargs(label_names: list[str]) -> dict:
    """from_pretrained's arguments for a classifier of these labels (in id order): one label per example, learned
    with cross-entropy, whatever the base's config says (a multi-label or regression base would take BCE or MSE
    over the head's outputs and fail on class ids)."""
    return {
        "num_labels": len(label_names),
        "id2label": dict(enumerate(label_names)),
        "label2id": {n: i for i, n in enumerate(label_names)},
        "problem_type": SINGLE_LABEL,
    }


def base_label_names(m: ModelArgs) -> list[str] | None:
    """The label names of the base model's classifier head in id order (its config's id2label), for a classification
    run: where they are the data's, the data takes their ids (data.label_names_of). None where the base has no names
    of its own (transformers' default LABEL_0, LABEL_1, ...), or its config cannot be read here."""
    return _named_labels(model_config(m)) if m.task == "classification" else None


def _named_labels(config) -> list[str] | None:
    id2label = getattr(config, "id2label", None) or {}
    try:
        names = [str(id2label[i]) for i in range(len(id2label))]
    except KeyError:  # ids not 0..N-1 (or not ints): no order to take
        return None
    return names if names and names != [f"LABEL_{i}" for i in range(len(names))] else None


def _say_what_becomes_of_the_head(model: str, config, label_names: list[str]) -> None:
    """Log what the run does to a base classifier's head where it is not the data's: a problem_type other than
    single-label classification is replaced; a head named for other labels is re-initialised (another count) or
    keeps its rows for other labels (the same count)."""
    problem = getattr(config, "problem_type", None)
    if problem not in (None, SINGLE_LABEL):
        logger.warning(
            "problem_type: %s's config says %s; finetune trains one label per example with cross-entropy, so the "
            "model is loaded (and exported) with problem_type %s",
            model, problem, SINGLE_LABEL,
        )  # fmt: skip
    base = _named_labels(config)
    if base is None or base == label_names:
        return
    if len(base) != len(label_names):
        fate = f"its head is re-initialised for the data's {len(label_names)} labels"
    else:
        pairs = ", ".join(f"{a} -> {b}" for a, b in zip(base, label_names))
        fate = f"its head keeps its rows, each now standing for another label (by id: {pairs})"
    logger.warning(
        "labels: %s's classifier head was trained for labels %s and the data's labels are %s: %s; give data with "
        "the base's labels to keep what the head learned",
        model, base, label_names, fate,
    )  # fmt: skip


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of the model, counted once before prepare, the same under every backend; its training FLOPs (MFU).

    FLOPs, as the training math needs them (PaLM, appendix B; recomputation, by gradient checkpointing or the chunked
    loss, is not counted): every weight's matmul costs 2 FLOPs per parameter forward and 2 backward for the gradient
    of its input; a trained weight 2 more for its own gradient (a frozen one's is never computed: LoRA's base
    weights). Attention scores add 12 x layers x hidden x sequence per token. The input embeddings are a lookup. The
    LM head (tied to the embeddings or not: a matmul all the same) counts on the learned positions only, where the
    loss needs it (finetune computes it there alone: chunked_loss), not on prompts or padding. A mixture of experts'
    routed experts count with the share of them a token goes through (experts per token / experts, from the config:
    `routed_share`); its router and shared experts, which every token goes through, in full."""

    total: int  # parameters (full sizes, however the backend holds them)
    trainable: int
    body: int  # parameters other than the input embeddings and the LM head
    body_trainable: int
    head: int  # the LM head's parameters (output embeddings, tied or not); 0 without one (a classifier's is body)
    head_trainable: int
    layers: int
    hidden: int
    seq_len: int
    routed: int = 0  # the routed experts' parameters (part of body); 0 in a dense model
    routed_trainable: int = 0
    routed_share: float = 1.0  # experts per token / experts

    @property
    def active_body(self) -> float:
        """The body's parameters a token goes through (all but the routed experts it is not sent to)."""
        return self.body - (1.0 - self.routed_share) * self.routed

    @property
    def active_body_trainable(self) -> float:
        return self.body_trainable - (1.0 - self.routed_share) * self.routed_trainable

    @property
    def attention_flops_per_token(self) -> float:
        """Attention scores' training FLOPs per token: a third forward, two thirds backward."""
        return 12.0 * self.layers * self.hidden * self.seq_len

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per input token, the LM head's aside."""
        return 4.0 * self.active_body + 2.0 * self.active_body_trainable + self.attention_flops_per_token

    @property
    def flops_per_learned(self) -> float:
        """The LM head's training FLOPs per learned position."""
        return 4.0 * self.head + 2.0 * self.head_trainable

    def flops(self, tokens: float, learned: float, reference: bool = False) -> float:
        """Model FLOPs of training on `tokens` input tokens with `learned` positions learned (next-token targets).
        reference: a frozen reference model's forward over the same tokens too (preference tuning's live reference
        log-probs: 2 per weight, a third of attention's, the head on the learned positions)."""
        flops = self.flops_per_token * tokens + self.flops_per_learned * learned
        if reference:
            flops += (2.0 * self.active_body + self.attention_flops_per_token / 3) * tokens + 2.0 * self.head * learned
        return flops

    @classmethod
    def of(cls, net, numel: Callable[[torch.nn.Parameter], int], seq_len: int) -> ModelFacts:
        """`numel` gives a parameter's full size (the backend's: ZeRO-3 partitions at load)."""

        def params_of(name: str) -> list:
            module = getattr(net, name)() if hasattr(net, name) else None
            return list(module.parameters()) if isinstance(module, torch.nn.Module) else []

        def size(params, trainable_only=False) -> int:
            return sum(weights_in(p, numel) for p in params if p.requires_grad or not trainable_only)

        params = list(net.parameters())
        head = params_of("get_output_embeddings")
        apart = {id(p) for p in [*params_of("get_input_embeddings"), *head]}
        body = [p for p in params if id(p) not in apart]
        cfg = text_config(net)
        share = routed_share(cfg)
        routed = routed_experts(net) if share < 1.0 else []
        return cls(
            total=size(params),
            trainable=size(params, trainable_only=True),
            body=size(body),
            body_trainable=size(body, trainable_only=True),
            head=size(head),
            head_trainable=size(head, trainable_only=True),
            layers=getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", 0) or 0,
            hidden=getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0) or 0,
            seq_len=seq_len,
            routed=size(routed),
            routed_trainable=size(routed, trainable_only=True),
            routed_share=share if routed else 1.0,
        )


def text_config(net):
    """The config that holds the language model's sizes (hidden_size, num_hidden_layers, experts): a model of several
    parts (Gemma 3, Mistral 3: a vision tower beside the language model) keeps them in its text_config."""
    cfg = getattr(net, "config", None)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


# The config's count of routed experts, and of experts each token goes to, under the names MoE configs use
# (Mixtral, PhiMoE, GraniteMoE: num_local_experts; Qwen2/3-MoE, OLMoE: num_experts; DeepSeek V2/V3, GLM-4-MoE:
# n_routed_experts; ERNIE 4.5: moe_num_experts and moe_k; Hunyuan: moe_topk).
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk")


def routed_share(config) -> float:
    """Experts per token / routed experts from a model config; 1.0 for a dense model or a config that says neither."""

    def first(keys) -> int | None:
        for key in keys:
            value = getattr(config, key, None)
            if isinstance(value, (list, tuple)) and value and len(set(value)) == 1:
                value = value[0]  # one value per layer, all alike
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    experts, per_token = first(EXPERT_COUNT_KEYS), first(EXPERTS_PER_TOKEN_KEYS)
    return min(per_token / experts, 1.0) if experts and per_token else 1.0


def routed_experts(net) -> list:
    """The routed experts' parameters: those of transformers' fused expert modules (MixtralExperts,
    Qwen2MoeExperts, DeepseekV3Experts, ...: one tensor over every expert) or of an `experts` ModuleList (one
    module per expert, as older and remote modeling code has them); not the shared experts (Qwen2-MoE's
    shared_expert, DeepSeek's shared_experts, GraniteMoeSharedExperts), which every token goes through."""
    found: dict[int, torch.nn.Parameter] = {}
    for name, module in net.named_modules():
        kind = type(module).__name__
        fused = kind.endswith("Experts") and "Shared" not in kind
        listed = name.rsplit(".", 1)[-1] == "experts" and isinstance(module, torch.nn.ModuleList)
        if fused or listed:
            found.update((id(p), p) for p in module.parameters())
    return list(found.values())


# bench/precision.py --parts weights (docs/precision.md): what updating bf16 weights in place costs
BF16_WEIGHTS_EVIDENCE = (
    "after 300 steps the mean loss of the last 50 was 2.55 with bfloat16 weights against 0.98 with fp32 master "
    "weights and bf16 compute, from the same start (6.51) on the same data"
)


def save_dtype(m: ModelArgs) -> str:
    """The dtype the exported model is written in: save_dtype, or for auto the base model's own (its config.json
    dtype; float32 when it names none, or names something else such as int8)."""
    if m.save_dtype != "auto":
        return m.save_dtype
    config = model_config(m)
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(named).replace("torch.", "") if named is not None else "float32"
    return name if name in DTYPES and name != "auto" else "float32"


def model_config(m: ModelArgs):
    """The model's config.json through AutoConfig (no weights), or None when it cannot be read here
    (model loading reports that later, with its own message)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(m.model, trust_remote_code=m.trust_remote_code)
    except Exception:  # noqa: BLE001 -- any failure here is reported by the model builder
        return None
