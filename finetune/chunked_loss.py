"""A causal LM's training loss without its whole logits: the LM head and the cross-entropy run a chunk of tokens
at a time, and each chunk's logits are recomputed in backward (model.chunked_loss).

With a modern vocabulary the logits and their gradient dominate a fine-tune's activation memory: 4,096 tokens at
128k entries are 2 GB in fp32, and again for the gradient. Here at most one chunk's are alive at once, forward or
backward; the price is one more LM-head forward per step (the recomputation).

Model-agnostic by construction: the head is called as a module (`get_output_embeddings()`), never read as a
weight, so ZeRO-3 gathers its whole weight for each call (a fused loss that reads `lm_head.weight` directly gets
the empty local shard: trl#3368), LoRA on the head and `modules_to_save` run their own forward, and DDP and FSDP2
see the call inside the model's forward. The forward replaced is the model instance's own, so it runs inside
every wrapper's forward (DDP, FSDP2, DeepSpeed, PEFT) as transformers' did. Used where labels are given with
gradients enabled (a training forward), and where a forward asks for each row's summed NLL (`ROW_NLL`): evaluation,
whose logits would otherwise be the eval batch's whole (8 rows of 4,096 tokens at 128k entries: 17 GB in fp32, and
the loss's copies of them), and preference tuning's answer log-probs, with gradients or without (the references).
Generation, and any other forward, runs transformers' own, with the logits.

The head runs on the supervised positions only: a fine-tune's prompts, padding and the end of each row are never
learned, and their logits were computed and thrown away (transformers computes the head for every position). The
collator gives each batch the flat indices of its supervised next-token targets (POSITIONS, `supervised_positions`,
found on the host: no host sync on the device), and the forward selects those rows of the hidden states before the
head: the same loss and gradients, with the head's matmul, the logits and the cross-entropy cut to the supervised
share of the tokens (at 128k entries, where the head is most of a small model's step, a prompt of 40% of the tokens
makes the step about 1.35x as fast). For that share alone the forward is installed with chunking off too
(`chunked_loss: false`): in training one call of the head, nothing recomputed; without gradients a chunk at a time
either way (nothing to recompute there).
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from finetune.config import ConfigError

logger = logging.getLogger("finetune")

IGNORE = -100
# Causal LMs whose forward is exactly `logits = lm_head(decoder(...).last_hidden_state)` and transformers' causal
# LM loss: no logit soft-capping (Gemma 2/3), scaling (Cohere, Granite) or auxiliary router loss (MoE models).
PLAIN_HEADS = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2", "gpt_neox", "phi3", "olmo2", "smollm3", "starcoder2"}
)
# auto: on from this vocabulary size up, where the extra head forward costs at most this share of a step's compute
# (2 x vocabulary x hidden FLOPs per token against about 6 x parameters). Measured at 128k entries (bench/README.md):
# a 93M model whose tied head is 70% of it trained at 0.74x the speed with it; a 1B model's head is 21%.
AUTO_MIN_VOCAB = 32_768
AUTO_MAX_COST = 0.10
# auto chunk size: about this many logits per chunk (128 MB in fp32; the loss keeps three such copies at its
# peak: the logits, their log-softmax and its gradient), never fewer than 128 tokens.
CHUNK_LOGITS = 2**25
ROW_NLL = "finetune_row_nll"  # a forward keyword: each row's summed next-token NLL, chunked
INSTALLED = "finetune_chunked_loss"  # the model attribute: True chunked, False whole (PEFT passes attributes on)
POSITIONS = "finetune_supervised_positions"  # a batch key and forward keyword: supervised_positions(labels)


def chunk_tokens(requested: int, vocab_size: int) -> int:
    return requested or max(128, CHUNK_LOGITS // vocab_size)


def supported(model_type: str, task: str) -> bool:
    """Whether this forward can replace the model's: a causal LM whose logits are its LM head's output."""
    return task == "causal_lm" and model_type in PLAIN_HEADS


def supervised_positions(labels: torch.Tensor) -> torch.Tensor:
    """The flat indices (into the batch's rows x width positions) of the positions whose next token is learned:
    labels shifted by one, -100 after each row's last token. Computed by the collator, on the host."""
    return (_targets(labels) != IGNORE).nonzero().squeeze(1)


def _targets(labels: torch.Tensor) -> torch.Tensor:
    """The flat next-token targets: the labels shifted by one, -100 after each row's last token."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)


def wanted(setting: str, model_type: str, task: str, vocab_size: int, hidden: int, params: int) -> bool:
    """Whether the chunked loss runs: chunked_loss true, false or auto (refusals name the key and the reason).
    From the model's full sizes (the planner's and every layout's: never a ZeRO-3 rank's partition): its vocabulary,
    hidden size and parameter count."""
    if setting == "false":
        return False
    why = None
    if task != "causal_lm":
        why = f"task is {task}: the chunked loss replaces a causal LM's loss (the others keep transformers' own)"
    elif not supported(model_type, task):
        why = (
            f"model_type {model_type!r} is not one whose logits are only its LM head's output (known: "
            f"{', '.join(sorted(PLAIN_HEADS))}); soft-capped, scaled or auxiliary-loss heads would train differently"
        )
    if why is None:
        return setting == "true" or (
            vocab_size >= AUTO_MIN_VOCAB and extra_cost(vocab_size, hidden, params) <= AUTO_MAX_COST
        )
    if setting == "true":
        raise ConfigError([("chunked_loss", f"is true, but {why}. Set it to auto or false")])
    return False


def extra_cost(vocab_size: int, hidden: int, params: int) -> float:
    """The chunked loss's extra head forward as a share of a training step's compute (2 V H against 6 N per token)."""
    return vocab_size * hidden / (3 * max(params, 1))


def install(
    model, chunk: int, micro_batch_tokens: int, eval_batch_tokens: int, compiled: bool = False, chunked: bool = True
) -> int:
    """Replace `model`'s forward (a transformers causal LM, not yet wrapped) by one whose training loss, and the
    eval NLL asked for with ROW_NLL, run the head on the supervised positions (POSITIONS, where the batch has them)
    and, chunked, a chunk at a time; the number of chunks each training micro batch is cut into (1: not chunked,
    the head called once and nothing recomputed; without gradients it is chunked either way). compiled
    (torch_compile): the cross-entropy runs through torch.compile (`compiled_loss`).

    Every micro batch, on every rank, is cut into the same number of chunks, from the largest micro batch the run
    can have (micro_batch_tokens; without gradients, enough for an eval batch of eval_batch_tokens too): under
    ZeRO-3 each call of the head gathers its weight, a collective that every rank must make as often as the others.
    A narrower batch has smaller chunks; a length-aware micro batch above that size has larger ones."""
    pieces = max(1, -(-micro_batch_tokens // chunk)) if chunked else 1
    # Without gradients chunks cost nothing more (nothing to recompute): evaluation and reference log-probs are
    # always chunked, never the eval batch's whole logits.
    no_grad_pieces = max(pieces, -(-eval_batch_tokens // chunk))
    plain_forward = model.forward
    nll_sum = compiled_loss(token_nll_sum) if compiled else token_nll_sum

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        per_row = kwargs.pop(ROW_NLL, False)
        positions = kwargs.pop(POSITIONS, None)
        train = labels is not None and torch.is_grad_enabled() and kwargs.get("past_key_values") is None
        if not (train or per_row):
            return plain_forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, labels=labels, **kwargs
            )
        kwargs.pop("use_cache", None)
        # Looked up at each call: PEFT replaces the head by its LoRA or modules_to_save wrapper after this install.
        out = self.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        )
        head, hidden = self.get_output_embeddings(), out.last_hidden_state
        if per_row:  # a dict: every wrapper passes it on
            n = pieces if torch.is_grad_enabled() else no_grad_pieces
            return {"nll": row_nll(head, hidden, labels, n, positions, recompute=chunked)}
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=chunked_nll(head, hidden, labels, pieces, nll_sum, positions, chunked))

    model.forward = types.MethodType(forward, model)
    setattr(model, INSTALLED, chunked)
    return pieces


def installed(model) -> bool:
    """Whether `model` (a transformers or PEFT model) runs this forward, chunked or not."""
    return getattr(model, INSTALLED, None) is not None


def chunks(model) -> bool:
    """Whether `model` (a transformers or PEFT model) runs the chunked loss."""
    return bool(getattr(model, INSTALLED, False))


def token_nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of logits (computed in fp32) against targets, -100 ignored."""
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")


def compiled_loss(fn):
    """`fn` (a loss of logits and labels) through torch.compile (inductor), for torch_compile: regional compilation
    compiles the decoder blocks, and this compiles the loss, where a large vocabulary spends a step's time (at 128k
    entries the cast to fp32, log-softmax and NLL, forward and backward, fused: 0.157 s against 0.268 eager for
    512 tokens on this CPU). Only tensors go in, never the head: the LM head stays the module every wrapper hooks
    (ZeRO-3's gather, FSDP2's unshard). Compiled for any number of tokens at the first call (dynamic): the learned
    positions differ from batch to batch, and a static first compilation would be followed by a dynamic one at the
    second batch, inside the run's timed steps."""
    return torch.compile(fn, dynamic=True)


def chunked_nll(
    head,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    pieces: int,
    nll_sum=token_nll_sum,
    positions: torch.Tensor | None = None,
    recompute: bool = True,
) -> torch.Tensor:
    """Mean cross-entropy of `head(hidden)` against the labels shifted by one (transformers' ForCausalLMLoss: the
    logits in fp32, -100 ignored), over `pieces` chunks of the tokens (only the supervised `positions`, where
    given); recompute: each chunk's logits are rebuilt in backward. A batch with nothing to learn gives 0
    (transformers' mean gives NaN). nll_sum: token_nll_sum or its compiled form."""
    targets, parts = _chunks(hidden, labels, pieces, positions)
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in parts:
        if recompute:
            total = total + checkpoint(_head_nll_sum, head, h, t, nll_sum, use_reentrant=False)
        else:
            total = total + _head_nll_sum(head, h, t, nll_sum)
    # the supervised count: known on the host where the positions are given
    count = max(targets.numel(), 1) if positions is not None else (targets != IGNORE).sum().clamp(min=1)
    return total / count


def row_nll(
    head,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    pieces: int,
    positions: torch.Tensor | None = None,
    recompute: bool = True,
) -> torch.Tensor:
    """Each row's summed next-token NLL (metrics.per_example_stats' "nll", from the same fp32 logits) over `pieces`
    chunks of the tokens (only the supervised `positions`, where given): one chunk's logits alive at a time, with
    gradients too (recompute: each chunk's rebuilt in backward)."""
    _, parts = _chunks(hidden, labels, pieces, positions)
    if torch.is_grad_enabled() and recompute:
        nll = [checkpoint(_head_token_nll, head, h, t, use_reentrant=False) for h, t in parts]
    else:
        nll = [_head_token_nll(head, h, t) for h, t in parts]
    if positions is None:
        return torch.cat(nll).view(labels.shape).sum(-1)
    rows = torch.div(positions, labels.shape[-1], rounding_mode="floor")
    return hidden.new_zeros(labels.shape[0], dtype=torch.float32).index_add(0, rows, torch.cat(nll))


def _chunks(hidden: torch.Tensor, labels: torch.Tensor, pieces: int, positions: torch.Tensor | None = None):
    """The flat next-token targets (only those at `positions`, where given), and `pieces` chunks of (hidden states, their targets)."""
    targets = _targets(labels)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if positions is not None:
        targets, flat = targets.index_select(0, positions), flat.index_select(0, positions)
    return targets, zip(torch.tensor_split(flat, pieces), torch.tensor_split(targets, pieces), strict=True)


def _head_nll_sum(head, hidden: torch.Tensor, targets: torch.Tensor, nll_sum) -> torch.Tensor:
    return nll_sum(head(hidden), targets)


def _head_token_nll(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE, reduction="none")
