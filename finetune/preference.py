"""Preference tuning: `method: dpo | ipo | orpo | simpo` on {prompt, chosen, rejected} pairs (format preference).

A micro batch of B pairs is one forward over 2B rows (the B chosen answers, then the B rejected ones, each after
its prompt: data.Collator). Each row's log-probability of its answer is the sum of its answer tokens' log-probs
(`sequence_logps`); the loss of a pair is one of the formulas below, as TRL writes them (trl/trainer/dpo_trainer.py
`dpo_loss`, trl/trainer/orpo_trainer.py `odds_ratio_loss`, trl/trainer/cpo_trainer.py `cpo_loss` with loss_type
simpo), and the loop averages it over every pair of the global batch (num_supervised counts pairs), so 2 ranks x
GA 1 and 1 rank x GA 2 make the same update, as for SFT.

    dpo    z = (pc - pr) - (rc - rr)                 loss = -(1-e) log s(b z) - e log s(-b z)     rewards b(p - r)
    ipo    z = (pc/nc - pr/nr) - (rc/nc - rr/nr)     loss = (z - 1/(2b))^2                        rewards b(p/n - r/n)
    orpo   a = p/n;  z = (ac - ar) - (log(1 - e^ac) - log(1 - e^ar))
                                                     loss = -ac - b log s(z)                      rewards b a
    simpo  a = p/n;  z = ac - ar - g/b               loss = -(1-e) log s(b z) - e log s(-b z)     rewards b a

p: the policy's summed answer log-prob, r: the reference model's (the starting model, computed once before
training: `compute_references`), n: answer tokens, c/r suffixes: chosen/rejected, s: sigmoid, b: beta, e:
label_smoothing, g: simpo_gamma. ORPO's first term is the chosen answer's mean NLL per pair (the paper's per-example
L_SFT; TRL takes the token mean over its batch, which depends on how the batch is cut); SimPO is TRL's CPO with
loss_type simpo and cpo_alpha 0 (no NLL term), as in the SimPO paper.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from finetune import chunked_loss, cluster
from finetune.config import PREFERENCE_METRICS, REFERENCE_METHODS
from finetune.config.schema import REFERENCE_FILE
from finetune.data import PAIR_INDEX
from finetune.formats import IGNORE

logger = logging.getLogger("finetune")

INPUTS = ("input_ids", "attention_mask", chunked_loss.POSITIONS)  # what the model's forward reads of a pair batch


def model_inputs(batch: dict) -> dict:
    """What the model's forward reads of a pair batch (the rest is for the loss); the supervised positions where
    the collator gives them (chunked_loss.POSITIONS)."""
    return {k: batch[k] for k in INPUTS if k in batch}


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-prob of its labelled tokens (each predicted from the one before) and their count.
    Without gradients (evaluation, the references' pass) a row at a time: one row's fp32 copy and log-sum-exp, not
    the batch's."""
    if not torch.is_grad_enabled() and logits.shape[0] > 1:
        rows = [sequence_logps(logits[i : i + 1], labels[i : i + 1]) for i in range(logits.shape[0])]
        return torch.cat([s for s, _ in rows]), torch.cat([n for _, n in rows])
    counts = answer_counts(labels)
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    picked = torch.gather(logits, 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logps = (picked - torch.logsumexp(logits, dim=-1)) * (labels != IGNORE)
    return logps.sum(-1), counts


def answer_counts(labels: torch.Tensor) -> torch.Tensor:
    """Per row: how many labelled tokens sequence_logps sums (each predicted from the one before)."""
    return (labels[:, 1:] != IGNORE).sum(-1)


def pair_losses(
    method: str,
    beta: float,
    policy: tuple[torch.Tensor, torch.Tensor],
    counts: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair, from summed log-probs (chosen, rejected) and token counts."""
    (pc, pr), (nc, nr) = policy, (counts[0].clamp(min=1), counts[1].clamp(min=1))
    if method == "dpo":
        rc, rr = reference
        z = (pc - pr) - (rc - rr)
        loss = -F.logsigmoid(beta * z) * (1 - label_smoothing) - F.logsigmoid(-beta * z) * label_smoothing
        return loss, beta * (pc - rc), beta * (pr - rr)
    if method == "ipo":
        rc, rr = reference
        z = (pc / nc - pr / nr) - (rc / nc - rr / nr)
        return (z - 1 / (2 * beta)) ** 2, beta * (pc - rc) / nc, beta * (pr - rr) / nr
    ac, ar = pc / nc, pr / nr
    if method == "orpo":
        z = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
        return -ac - beta * F.logsigmoid(z), beta * ac, beta * ar
    if method == "simpo":
        z = ac - ar - simpo_gamma / beta
        loss = -F.logsigmoid(beta * z) * (1 - label_smoothing) - F.logsigmoid(-beta * z) * label_smoothing
        return loss, beta * ac, beta * ar
    raise ValueError(f"unknown preference method {method!r}")


@dataclass
class References:
    """The starting model's summed answer log-probs per pair, (N, 2) chosen/rejected, by the pair's index in its
    split; None until computed (data.Collator puts them in each batch as `ref_logps`)."""

    train: torch.Tensor | None = None
    eval: torch.Tensor | None = None

    def lookup(self, split: str, index: torch.Tensor) -> torch.Tensor | None:
        table = getattr(self, split)
        return None if table is None else table[index]


@dataclass
class Objective:
    """A preference method's loss for the loop, the reward statistics of its log rows, and its eval."""

    method: str
    beta: float
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    live: Callable[[dict], torch.Tensor] | None = None  # reference: live (live_reference); else the collators' table
    window: dict = field(default_factory=dict)  # sums since the last log row

    @classmethod
    def of(cls, t, live: Callable[[dict], torch.Tensor] | None = None) -> Objective | None:
        """None for sft (the loop then takes the model's own loss)."""
        if t.method == "sft":
            return None
        return cls(t.method, t.beta, t.label_smoothing, t.simpo_gamma, live)  # live: only ever made for dpo/ipo

    def with_reference(self, batch: dict) -> dict:
        """The batch, with its pairs' reference log-probs where they are computed live (before the policy's forward:
        ZeRO-3 gathers each layer's weights in the order the training forward and backward use them)."""
        if self.live is not None:
            batch["ref_logps"] = self.live(batch)
        return batch

    @property
    def needs_reference(self) -> bool:
        return self.method in REFERENCE_METHODS

    def per_pair(self, logps: tuple[torch.Tensor, torch.Tensor], batch: dict) -> dict[str, torch.Tensor]:
        """Loss, rewards and log-probs of each pair of a batch, from its rows' answer log-probs and token counts
        (backend.answer_logps)."""
        sums, counts = logps
        b = sums.shape[0] // 2
        reference = None
        if self.needs_reference:
            ref = batch["ref_logps"].to(sums.dtype)
            reference = (ref[:, 0], ref[:, 1])
        loss, chosen, rejected = pair_losses(
            self.method, self.beta, (sums[:b], sums[b:]), (counts[:b], counts[b:]), reference,
            self.label_smoothing, self.simpo_gamma,
        )  # fmt: skip
        return {"loss": loss, "chosen_reward": chosen, "rejected_reward": rejected, "chosen_logps": sums[:b],
                "rejected_logps": sums[b:]}  # fmt: skip

    def loss(self, logps: tuple[torch.Tensor, torch.Tensor], batch: dict) -> torch.Tensor:
        """The micro batch's mean loss over its pairs (the loop weighs it by pairs / global pairs)."""
        stats = self.per_pair(logps, batch)
        with torch.no_grad():
            for k, v in _row_sums(stats).items():
                self.window[k] = self.window.get(k, 0.0) + v
        return stats["loss"].mean()

    def window_row(self, acc) -> dict[str, float]:
        """The reward statistics since the last row, over every rank's pairs (a collective: every rank calls it)."""
        sums = self.window_sums(acc, torch.float32)
        self.window = {}
        return _named(sums)

    def window_sums(self, acc, dtype: torch.dtype = torch.float64) -> dict[str, float]:
        """The sums since the last row, over every rank's pairs (a collective). A checkpoint between two rows keeps
        them as summed, in float64 (loop.TrainState.window), for the resumed run's window (resume_window)."""
        keys = sorted(_ROW_KEYS)
        sums = torch.stack([torch.as_tensor(self.window.get(k, 0.0), device=acc.device).to(dtype) for k in keys])
        return dict(zip(keys, acc.reduce(sums, reduction="sum").tolist()))

    def resume_window(self, sums: dict[str, float], device, main: bool) -> None:
        """Resumed between two rows: the window starts from the checkpoint's sums (on the main process: the next
        row's all-reduce adds the other ranks' own)."""
        self.window = {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in sums.items()} if main else {}

    def summarize(self, stats: dict[str, torch.Tensor]) -> dict[str, float]:
        """Eval metrics from the gathered per-pair statistics: eval_loss and the reward statistics."""
        sums = {k: float(v) for k, v in _row_sums(stats).items()}
        return {"eval_loss": sums["loss"] / max(sums["pairs"], 1), **{f"eval_{k}": v for k, v in _named(sums).items()}}


_ROW_KEYS = ("pairs", "loss", "chosen_reward", "rejected_reward", "correct", "chosen_logps", "rejected_logps")


def _row_sums(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: stats[k].detach().double().sum() for k in _ROW_KEYS if k in stats}
    out["pairs"] = torch.tensor(float(stats["loss"].numel()))
    out["correct"] = (stats["chosen_reward"] > stats["rejected_reward"]).double().sum()
    return out


def _named(sums: dict[str, float]) -> dict[str, float]:
    """The row's statistics, in PREFERENCE_METRICS' order (what metric_for_best_model may name)."""
    n = max(sums["pairs"], 1)
    chosen, rejected = sums["chosen_reward"], sums["rejected_reward"]
    values = (chosen, rejected, chosen - rejected, sums["correct"], sums["chosen_logps"], sums["rejected_logps"])
    return {k: v / n for k, v in zip(PREFERENCE_METRICS, values, strict=True)}


# ---------------------------------------------------------------- the reference: the starting model


def live_reference(backend, model, adapter: bool) -> Callable[[dict], torch.Tensor]:
    """reference: live. A batch's (B, 2) reference log-probs, in eval mode (no dropout) and without gradients, from
    `model` as the backend placed it (sharded as training shards it): adapter True, the policy itself with its
    adapter disabled (the base model, where a new adapter starts: LoRA's B and DoRA's update start at zero; a
    continued one, peft.adapter, starts elsewhere and is refused by config.rules); False, a frozen copy of the
    starting model (backend.prepare_frozen)."""
    import contextlib

    off = backend.hf_model(model).disable_adapter if adapter else contextlib.nullcontext  # PEFT's, inside wrappers

    @torch.no_grad()
    def logps(batch: dict) -> torch.Tensor:
        was_training = model.training
        model.eval()
        try:
            with off():
                sums, _ = backend.answer_logps(model, model_inputs(batch), batch["labels"])
            if not adapter:  # FSDP2 leaves the head whole for a backward that the frozen copy never runs
                backend.end_inference(model)
        finally:
            model.train(was_training)
        b = sums.shape[0] // 2
        return torch.stack([sums[:b], sums[b:]], dim=1)

    return logps


@torch.no_grad()
def compute_references(acc, backend, model, splits: dict, collate, batch_size: int) -> dict[str, torch.Tensor]:
    """Each split's (N, 2) summed answer log-probs under the model as it is now (the start of training), every rank
    its share of the batches (the prepared model: sharded as training shards it), gathered by pair index."""
    out = {}
    model.eval()
    for split, ds in splits.items():
        loader = acc.prepare_data_loader(
            torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False, collate_fn=collate)
        )
        table = torch.full((len(ds), 2), float("nan"), dtype=torch.float64)
        for batch in loader:
            sums, _ = backend.answer_logps(model, model_inputs(batch), batch["labels"])
            b = sums.shape[0] // 2
            got = backend.gather_for_metrics(
                {"index": batch[PAIR_INDEX], "chosen": sums[:b].double(), "rejected": sums[b:].double()}
            )
            table[got["index"].cpu()] = torch.stack([got["chosen"], got["rejected"]], dim=1).cpu()
        if torch.isnan(table).any():
            raise RuntimeError(
                f"reference log-probs: {int(torch.isnan(table).any(1).sum())} {split} pairs not computed"
            )
        out[split] = table
    backend.end_inference(model)
    model.train()
    return out


def references_made_from(ds, model: str) -> str:
    """What the reference log-probs were computed from, as a resume checks it: the pairs' tokens (data.content_hash
    of each split) and the model. Not datasets' _fingerprint, which hashes the data files' paths and modification
    times: machines sharing output_dir, each with its own copy of the same data, refused every resume."""
    from finetune.data import content_hash

    return f"{content_hash(ds.train)}/{content_hash(ds.eval)}/{model}"


def load_or_compute_references(acc, backend, model, ds, collate, batch_size: int, output_dir: str, step: int,
                               writes: bool, fingerprint: str) -> dict[str, torch.Tensor]:  # fmt: skip
    """The starting model's log-probs: a run at step 0 computes them and saves them in output_dir (`writes`: the
    process that writes this machine's files; every rank holds every pair's, gathered); a resume reads them from
    there (made for this data), and is refused on every machine when one lacks them: a checkpoint cannot give them
    back."""
    from finetune.config import ConfigError

    path = os.path.join(output_dir, REFERENCE_FILE)
    if step > 0:
        saved = torch.load(path, weights_only=True) if os.path.exists(path) else {}
        found = saved.get("fingerprint") == fingerprint
        views = cluster.host_gather((cluster.machine_rank(), found))  # a collective: one machine must not go on alone
        lacking = sorted({m for m, ok in views if not ok})
        if not lacking:
            logger.info("reference log-probs: read from %s", path)
            return {k: v for k, v in saved.items() if k != "fingerprint"}
        where = f" on machine {', '.join(map(str, lacking))}" if len({m for m, _ in views}) > 1 else ""
        raise ConfigError([("resume_from_checkpoint", f"{path} (the starting model's log-probs for this data) is "
                            f"missing or was made for other data{where}; resume from the output_dir of the run that "
                            "started it (on each machine, when output_dir is not shared), or start over")])  # fmt: skip
    splits = {"train": ds.train, **({"eval": ds.eval} if ds.eval is not None else {})}
    import time

    start = time.perf_counter()
    tables = compute_references(acc, backend, model, splits, collate, batch_size)
    logger.info(
        "reference log-probs: the starting model over %s pairs in %.1f s (computed once; training holds one model)",
        " + ".join(f"{len(t)} {k}" for k, t in tables.items()), time.perf_counter() - start,
    )  # fmt: skip
    if writes:  # the global main; each machine's local main when output_dir is not shared (cluster.Storage)
        torch.save({"fingerprint": fingerprint, **tables}, path + ".tmp")
        os.replace(path + ".tmp", path)
    cluster.host_wait()
    return tables
