"""Generation eval: what the fine-tuned model writes, scored against the answers.

When generation_max_new_tokens is set, every eval also takes the first generation_num_examples eval
examples without their answer: the prompt is the tokens before the first supervised label (instruction,
chat), the encoder input (seq2seq) or the pair's prompt (preference), the reference is the text of that first
answer (preference: the chosen one). The model continues
each prompt greedily, stopping at EOS or at a special token that ends the answers (a chat template's
<|im_end|>), and generation_metrics score its text against the references: the eval row gains
eval_exact_match, eval_rougeL, eval_bleu, ...; a row of sample completions goes to metrics.jsonl (and the
trackers).

The numbers do not depend on the layout: the prompts are cut into the same batches (of
per_device_eval_batch_size, padded the same way) on every layout, and greedy decoding in fp32 is a function
of the weights. The batches are dealt round-robin to the data-parallel ranks, and every rank makes the same
number of generate calls (the last round is filled up with a repeat whose output is dropped): with ZeRO-3 or
FSDP every forward is a collective, and backend.generate keeps the decoding steps of one call in lockstep.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from finetune.config import PROMPT_FORMATS, ConfigError, RunConfig
from finetune.data import IGNORE

logger = logging.getLogger("finetune")
SAMPLES = 3  # sample completions logged per eval


@dataclass
class Example:
    prompt: list[int]  # token ids the model continues (seq2seq: the encoder input)
    answer: list[int]  # the supervised tokens it should write
    reference: str  # their text


def examples_of(evalset, task: str, n: int | None, tokenizer) -> list[Example]:
    """The first n tokenized eval rows as (prompt, answer): the answer is the first run of supervised labels."""
    rows = evalset.select(range(min(n or len(evalset), len(evalset))))
    out = []
    if "chosen_ids" in rows.column_names:  # preference pairs: the prompt, and the chosen answer as the reference
        pairs = [(list(p), list(c)) for p, c in zip(rows["prompt_ids"], rows["chosen_ids"])]
        return [Example(p, c, tokenizer.decode(c, skip_special_tokens=True).strip()) for p, c in pairs if p and c]
    for ids, labels in zip(rows["input_ids"], rows["labels"]):
        if task == "seq2seq":
            prompt, answer = list(ids), [t for t in labels if t != IGNORE]
        else:
            first = next((i for i, t in enumerate(labels) if t != IGNORE), len(labels))
            end = next((i for i in range(first, len(labels)) if labels[i] == IGNORE), len(labels))
            prompt, answer = list(ids[:first]), list(labels[first:end])
        if prompt and answer:
            out.append(Example(prompt, answer, tokenizer.decode(answer, skip_special_tokens=True).strip()))
    return out


class GenerationEval:
    """Generate for the eval prompts on every rank, gather the texts, score them (the same on every rank)."""

    def __init__(self, examples: list[Example], metrics: dict[str, Any], cfg: RunConfig, tokenizer):
        self.examples, self.metrics, self.tokenizer = examples, metrics, tokenizer
        self.max_new_tokens = cfg.train.generation_max_new_tokens
        self.batch_size = cfg.train.per_device_eval_batch_size
        self.encoder_decoder = cfg.model.task == "seq2seq"
        self.report = bool(cfg.train.report_to)
        special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        # answers end with EOS (instruction, seq2seq) or the chat template's end-of-turn token
        stop = {tokenizer.eos_token_id} | {t for e in examples for t in e.answer if t in special}
        self.stop_ids = sorted(t for t in stop if t is not None)

    def evaluate(self, run, step: int) -> dict[str, float]:
        """Scores of this eval (every rank takes part); writes the samples row."""
        from finetune.cluster import host_gather

        topo = run.backend.topology
        n, size = len(self.examples), self.batch_size
        batches = math.ceil(n / size)
        rounds = math.ceil(batches / topo.dp)
        mine: list[tuple[int, str]] = []
        run.model.eval()
        for k in range(topo.dp_rank, rounds * topo.dp, topo.dp):
            real = k < batches  # else: a repeat, so that every rank makes the same number of calls
            start = k * size if real else 0
            chunk = self.examples[start : start + size]
            texts = self._generate(run, chunk)
            if real:
                mine += [(start + j, text) for j, text in enumerate(texts)]
        run.model.train()
        generated = dict(pair for rank in host_gather(mine) for pair in rank)  # TP replicas give the same text
        predictions = [generated[i] for i in range(n)]
        references = [e.reference for e in self.examples]
        scores: dict[str, float] = {}
        for module in self.metrics.values():
            result = module.compute(predictions=predictions, references=references)
            scores.update({f"eval_{k}": float(v) for k, v in result.items() if isinstance(v, (int, float))})
        self._log_samples(run, step, predictions)
        return scores

    def _generate(self, run, chunk: list[Example]) -> list[str]:
        """One batch: prompts padded on the left (a decoder-only model continues the last position) or, for an
        encoder, on the right; the new tokens decoded without special tokens."""
        pad = self.tokenizer.pad_token_id
        width = max(len(e.prompt) for e in chunk)
        ids, mask = [], []
        for e in chunk:
            gap = width - len(e.prompt)
            if self.encoder_decoder:
                ids.append(e.prompt + [pad] * gap)
                mask.append([1] * len(e.prompt) + [0] * gap)
            else:
                ids.append([pad] * gap + e.prompt)
                mask.append([0] * gap + [1] * len(e.prompt))
        device = run.accelerator.device
        config = run.backend.hf_model(run.model).generation_config
        stop = sorted(set(self.stop_ids) | set(_as_list(config.eos_token_id)))
        out = run.backend.generate(
            run.model,
            input_ids=torch.tensor(ids, device=device),
            attention_mask=torch.tensor(mask, device=device),
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=stop,
            pad_token_id=pad,
            use_cache=True,
        )
        new = out[:, 1:] if self.encoder_decoder else out[:, width:]  # seq2seq output starts with the decoder start
        return [t.strip() for t in self.tokenizer.batch_decode(new.tolist(), skip_special_tokens=True)]

    def _log_samples(self, run, step: int, predictions: list[str]) -> None:
        samples = [
            {"prompt": self.tokenizer.decode(e.prompt), "generated": p, "reference": e.reference}
            for e, p in zip(self.examples[:SAMPLES], predictions)
        ]
        run.log.write({"step": step, "eval_samples": samples})
        if self.report:  # trackers show text (tensorboard: add_text)
            text = "\n\n".join(
                f"**prompt** {s['prompt']}\n**generated** {s['generated']}\n**reference** {s['reference']}"
                for s in samples
            )
            run.accelerator.log({"eval_samples": text}, step=step)


def _as_list(x) -> list[int]:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _without_answers(ds) -> str:
    """What of the eval data has no text answers to generate, in words ('' when all has): the data's format, or a
    mixture's sources each in their own (chat and instruction sources generate alike)."""
    from finetune.mixture import SOURCE

    m = ds.mixture
    if ds.format in PROMPT_FORMATS:
        return ""
    if m is None or len(m.formats) != len(m.names):  # (a mixture prepared before its sources' formats were kept)
        return f"the data is in the {ds.format} format, which has"
    evaluated = sorted(set(ds.eval[SOURCE])) if SOURCE in ds.eval.column_names else range(len(m.names))
    unfit = [f"source {m.names[i]!r} ({m.formats[i]} format)" for i in evaluated if m.formats[i] not in PROMPT_FORMATS]
    return f"the eval rows of {', '.join(unfit)} have" if unfit else ""


def build_generation(cfg: RunConfig, ds, tokenizer) -> GenerationEval | None:
    """The generation eval of this run, or None when it is off. Before the model loads: a format without
    text answers is a ConfigError here."""
    from finetune.metrics import load_metrics

    t = cfg.train
    if not t.generation_max_new_tokens or ds.eval is None:
        return None
    unfit = _without_answers(ds)
    if unfit:
        raise ConfigError(
            [
                (
                    "generation_max_new_tokens",
                    f"{unfit} no prompt/answer split to generate and score; use instruction, chat (or "
                    "source_target) data, or drop generation_max_new_tokens"
                    + (" (or give such a source no eval rows: eval_fraction 0)" if "source" in unfit else ""),
                )
            ]
        )
    examples = examples_of(ds.eval, cfg.model.task, t.generation_num_examples, tokenizer)
    if not examples:
        raise ConfigError(
            [
                (
                    "generation_max_new_tokens",
                    "no eval example has a prompt and an answer left after truncation; raise max_seq_length",
                )
            ]
        )
    metrics = load_metrics(t.generation_metrics, cfg.model.task, key="generation_metrics")
    logger.info(
        "generation eval: %d eval prompts, up to %d new tokens, greedy; metrics %s",
        len(examples),
        t.generation_max_new_tokens,
        ", ".join(metrics),
    )
    return GenerationEval(examples, metrics, cfg, tokenizer)
