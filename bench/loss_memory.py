"""The chunked loss at a 128k vocabulary (issue 31): training peak memory and step time against transformers' loss
and HF Trainer, and the longest sequence each trains within a memory budget.

peak     a Llama-shaped model of 93M parameters (hidden 512, 8 layers, 8 heads, tied 128,256-entry embeddings, as
         small Llama 3 models have), one process, fp32, micro batch 1, --seq tokens (default 2048, packed text):
         finetune with chunked_loss true and false, and HF Trainer on finetune's rows in finetune's order. Equal
         settings on every side: the same rows, batch, learning rate, clipping, threads and glibc allocator
         settings (RELEASE: what finetune's `cpu_allocator: release` sets, which `finetune plan` assumes on a CPU,
         in every process's environment: freed memory goes back at once, so the resident peak is what was
         alive, not what glibc kept). Measured: the
         training-phase peak RSS (each side resets the high-water mark as training starts: finetune.metrics) and
         the median step time. Target: chunked <= 0.6x Trainer's peak.
eval     one eval batch (--eval_batch rows of --seq tokens) through the run's own evaluation
         (`Backend.eval_stats`), with the chunked loss (each row's NLL a chunk at a time) and without (the batch's
         whole logits, as transformers' forward gives them): the peak resident memory above the loaded model, and
         the two eval losses (equal to 1e-5 relative).
pairs    one preference micro batch (--pairs pairs: twice as many rows of --seq tokens, the first quarter of each
         a prompt) through training's answer log-probs (`Backend.answer_logps`, as DPO and the other methods take
         them) and the backward of a DPO loss over them, with the chunked loss and without (the batch's whole
         logits): the peak resident memory above the loaded model, and the log-probs (equal to 1e-5 relative).
zero3    the peak part's chunked finetune and Trainer under DeepSpeed ZeRO-3 on 2 ranks (1 thread each): finetune
         with accelerate_configs/zero3.yaml, Trainer under torchrun with the same DeepSpeed JSON
         (ds_configs/zero3.json, its "auto" values filled by each from the same run config) and gloo; the larger
         of the 2 ranks' training-phase peaks. Target: chunked <= 0.6x Trainer's peak.
longest  the longest max_seq_length (a multiple of 256) that `finetune plan`'s estimate puts within --budget_gb,
         with the chunked loss and without (transformers' loss, which Trainer computes the same way); then a run of
         finetune with the chunked loss at its length and one of Trainer at the unchunked length, each of which must
         stay inside the budget (nothing is run that the planner says will not fit). Target: >= 1.8x.
zero3_longest  the same under ZeRO-3 on 2 ranks (a rank's peak within --budget_gb), as the zero3 part runs them.

    .venv/bin/python bench/loss_memory.py [--parts peak,eval,pairs,longest,zero3,zero3_longest] [--seq 2048] [--eval_batch 4]
                                          [--pairs 2] [--budget_gb 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys

import harness

from finetune.parallel.environment import cpu_allocator_env

NAME = "loss_memory"
TITLE = "Chunked loss: peak memory and longest sequence at a 128k vocabulary (one process)"
REPEATS = 1
VOCAB = 128_256
RELEASE = cpu_allocator_env("release")  # what cpu_allocator: release sets, as glibc's environment
SHAPE = {"hidden": 512, "layers": 8, "heads": 8}
PEAK_TARGET = 0.6  # chunked peak / Trainer's
LONGEST_TARGET = 1.8  # chunked longest sequence / unchunked


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parts",
        default="peak,eval,pairs,longest,zero3,zero3_longest",
        help="any of peak, eval, pairs, longest, zero3, zero3_longest (default: all)",
    )
    parser.add_argument("--seq", type=int, default=2048, help="peak, eval: tokens per row (default 2048)")
    parser.add_argument("--eval_batch", type=int, default=4, help="eval: rows per eval batch (default 4)")
    parser.add_argument("--pairs", type=int, default=2, help="pairs: preference pairs per micro batch (default 2)")
    parser.add_argument("--budget_gb", type=float, default=4.0, help="longest: training peak budget (default 4)")


def build_model(ctx: harness.Context) -> str:
    from finetune import demo

    config = demo.llama_config(**SHAPE, vocab=VOCAB, max_positions=16384)
    config.tie_word_embeddings = True
    return harness.saved_llama(ctx, "llama_128k_h512_l8", config)


def run_config(ctx: harness.Context, model: str, seq: int, chunked: str) -> str:
    return harness.write_run_config(
        ctx,
        f"loss_{chunked}_{seq}",
        model=model,
        dataset=harness.assets(ctx)["text"],
        format="text",
        packing=True,
        max_seq_length=seq,
        per_device_train_batch_size=1,
        learning_rate=1e-4,
        eval_fraction=0,
        save_steps=None,
        chunked_loss=chunked,
        cpu_allocator="release",
    )


def finetune_side(ctx: harness.Context, model: str, seq: int, chunked: str, layout: str | None = None) -> dict:
    """One process with 2 threads, or `layout` (a shipped Accelerate config of 2 ranks) with 1 thread per rank;
    the largest rank's training-phase peak."""
    tag = f"finetune_{chunked}_{seq}" + (f"_{layout}" if layout else "")
    out = ctx.runs / tag
    steps = str(ctx.opts.steps_given or 3)
    cmd = harness.finetune_cmd(run_config(ctx, model, seq, chunked), out, layout, "--max_steps", steps)
    r = harness.launch(ctx, tag, cmd, 1 if layout else 2, **RELEASE)
    rows = harness.read_rows(out)
    shutil.rmtree(out)
    ranks = next(row["peak_memory"] for row in rows if "peak_memory" in row)
    assert len(ranks) == (2 if layout else 1), ranks
    peak = max(ranks, key=lambda m: m["train_peak_rss_gb"])
    times = sorted(row["step_time_s"] for row in rows if "loss" in row)[1:] or [0.0]
    return {
        "train_peak_gb": peak["train_peak_rss_gb"],
        "planned_gb": peak.get("estimate_train_peak_gb"),
        "step_s": times[len(times) // 2],
        "losses": [row["loss"] for row in rows if "loss" in row],
        "wall_s": r.wall_s,
    }


def trainer_side(ctx: harness.Context, model: str, seq: int, zero3: bool = False) -> dict:
    """One process with 2 threads, or DeepSpeed ZeRO-3 (finetune's ds_configs/zero3.json) on 2 ranks under torchrun
    with 1 thread each; the largest rank's training-phase peak."""
    spec = {"config": run_config(ctx, model, seq, "false"), "steps": ctx.opts.steps_given or 3, "warmup": 1}
    spec |= {"threads": 1 if zero3 else 2, "collator": "seq2seq", "env": RELEASE}
    launcher = None
    if zero3:
        spec["deepspeed"] = str(harness.ROOT / "ds_configs" / "zero3.json")
        launcher = harness.torchrun(2)
    tag = f"trainer_{seq}" + ("_zero3" if zero3 else "")
    r = harness.run_worker(ctx, "baselines.py", "trainer", spec, tag, spec["threads"], launcher=launcher)
    assert r.get("ranks") == (2 if zero3 else 1), r
    return {"train_peak_gb": r["train_peak_rss_gb"], "step_s": r["step_time_s"], "zero_stage": r.get("zero_stage")}


def eval_worker(spec: dict) -> dict:
    """One eval batch through Backend.eval_stats (one process), the peak RSS above the loaded model."""
    import torch

    from finetune import metrics

    batch, seq = spec["batch"], spec["seq"]
    net, backend, ids = _loaded(spec, batch, seq, eval_batch_tokens=batch * seq)
    net.eval()
    before = metrics.peak_memory(torch.device("cpu"))["peak_rss_gb"]
    metrics.reset_peak_memory(torch.device("cpu"))
    with torch.no_grad():
        stats = backend.eval_stats(net, {"input_ids": ids}, ids.clone(), "causal_lm")
    peak = metrics.peak_memory(torch.device("cpu"))["peak_rss_gb"]
    return {"loss": (stats["nll"].sum() / stats["count"].sum()).item(), "model_gb": before, "peak_gb": peak}


def pairs_worker(spec: dict) -> dict:
    """One preference micro batch: its answers' log-probs through Backend.answer_logps with gradients, and the
    backward of a DPO loss over them (references at 0), one process; the peak RSS above the loaded model."""
    import torch
    import torch.nn.functional as F

    from finetune import metrics

    rows, seq = 2 * spec["pairs"], spec["seq"]
    net, backend, ids = _loaded(spec, rows, seq, micro_batch_tokens=rows * seq)
    labels = ids.clone()
    labels[:, : seq // 4] = -100  # the prompts
    before = metrics.peak_memory(torch.device("cpu"))["peak_rss_gb"]
    metrics.reset_peak_memory(torch.device("cpu"))
    sums, _ = backend.answer_logps(net, {"input_ids": ids}, labels)
    b = rows // 2
    (-F.logsigmoid(0.1 * (sums[:b] - sums[b:]))).mean().backward()
    peak = metrics.peak_memory(torch.device("cpu"))["peak_rss_gb"]
    return {"logps": sums.tolist(), "model_gb": before, "peak_gb": peak}


def _loaded(spec: dict, rows: int, seq: int, **tokens):
    """The model (chunked "true": built as a run builds it, finetune's chunked loss; "false": transformers' own
    forward, the whole logits, as before finetune's loss forward ran the head on the learned positions with
    chunked_loss false too and evaluated a chunk at a time), a one-process backend, and rows x seq random token
    ids."""
    from types import SimpleNamespace

    import torch

    from finetune import model
    from finetune.config import build_config
    from finetune.parallel import ddp

    torch.set_num_threads(2)
    if spec["chunked"] == "true":
        values = {"model": spec["model"], "dataset": "unused.jsonl", "output_dir": "unused", "chunked_loss": "true"}
        net = model.build_model(build_config(values, check_filesystem=False).model, _Tokenizer(), None, seq, **tokens)
    else:
        from transformers import AutoModelForCausalLM

        net = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(0))
    backend = ddp.Backend(SimpleNamespace(unwrap_model=lambda m, **kw: m, mixed_precision="no"), None, None)
    return net, backend, ids


class _Tokenizer:
    """What model.build_model reads of a tokenizer (its length, the pad id) for a model whose vocabulary is VOCAB."""

    pad_token_id = 0

    def __len__(self) -> int:
        return VOCAB


def eval_side(ctx: harness.Context, model: str, chunked: str) -> dict:
    spec = {"model": model, "chunked": chunked, "batch": ctx.opts.eval_batch, "seq": ctx.opts.seq, "env": RELEASE}
    return harness.run_worker(ctx, "loss_memory.py", "eval", spec, f"eval_{chunked}", 2)


def pairs_side(ctx: harness.Context, model: str, chunked: str) -> dict:
    spec = {"model": model, "chunked": chunked, "pairs": ctx.opts.pairs, "seq": ctx.opts.seq, "env": RELEASE}
    return harness.run_worker(ctx, "loss_memory.py", "pairs", spec, f"pairs_{chunked}", 2)


def planned_gb(ctx: harness.Context, model: str, seq: int, chunked: str, layout: str = "single") -> float:
    """finetune plan's estimate of a rank's training peak (a shipped Accelerate config on CPU processes: 2 where
    the config is not `single`)."""
    from finetune import memory
    from finetune.config import build_config

    values = {"model": model, "dataset": "planned.jsonl", "output_dir": str(ctx.runs / "plan")}
    values |= {"max_seq_length": seq, "per_device_train_batch_size": 1, "chunked_loss": chunked, "eval_fraction": 0}
    cfg = build_config(values, check_filesystem=False)
    shape = memory.shape_from_config(cfg)
    machines = memory.Machines(num_gpus=0, cpu_processes=1 if layout == "single" else 2)
    return memory.plan_config(shape, cfg, harness.ROOT / "accelerate_configs" / f"{layout}.yaml", machines).host_gb


def longest(ctx: harness.Context, model: str, chunked: str, layout: str = "single") -> tuple[int, float]:
    """The longest multiple of 256 whose planned peak is within the budget (and that planned peak)."""
    lo, hi = 0, 64  # in units of 256 tokens: within(lo) holds (0: nothing), within(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        fits = planned_gb(ctx, model, 256 * mid, chunked, layout) <= ctx.opts.budget_gb
        lo, hi = (mid, hi) if fits else (lo, mid)
    return 256 * lo, planned_gb(ctx, model, 256 * lo, chunked, layout) if lo else 0.0


def run(ctx: harness.Context) -> dict:
    model = build_model(ctx)
    parts, out = ctx.opts.parts.split(","), {"vocab": VOCAB, **SHAPE}
    if "peak" in parts:
        seq = ctx.opts.seq
        harness.log(f"  peak: seq {seq}, finetune chunked / unchunked, Trainer")
        out["peak"] = {
            "seq": seq,
            "chunked": finetune_side(ctx, model, seq, "true"),
            "unchunked": finetune_side(ctx, model, seq, "false"),
            "trainer": trainer_side(ctx, model, seq),
        }
    if "eval" in parts:
        harness.log(f"  eval: {ctx.opts.eval_batch} x {ctx.opts.seq} tokens, chunked / whole logits")
        out["eval"] = {"batch": ctx.opts.eval_batch, "seq": ctx.opts.seq}
        out["eval"] |= {side: eval_side(ctx, model, side) for side in ("true", "false")}
    if "pairs" in parts:
        harness.log(f"  pairs: {ctx.opts.pairs} pairs x 2 rows x {ctx.opts.seq} tokens, chunked / whole logits")
        out["pairs"] = {"pairs": ctx.opts.pairs, "seq": ctx.opts.seq}
        out["pairs"] |= {side: pairs_side(ctx, model, side) for side in ("true", "false")}
    if "zero3" in parts:
        seq = ctx.opts.seq
        harness.log(f"  zero3: seq {seq}, 2 ranks, finetune chunked / Trainer")
        out["zero3"] = {
            "seq": seq,
            "chunked": finetune_side(ctx, model, seq, "true", "zero3"),
            "trainer": trainer_side(ctx, model, seq, zero3=True),
        }
    for part, layout in (("longest", "single"), ("zero3_longest", "zero3")):
        if part in parts:
            out[part] = longest_part(ctx, model, layout)
    return out


def longest_part(ctx: harness.Context, model: str, layout: str) -> dict:
    """The planner's longest sequences within the budget, chunked and not (Trainer's loss), under `layout`; then a
    run of finetune chunked and one of Trainer at those lengths, which must stay within it."""
    budget, ranks = ctx.opts.budget_gb, layout != "single"
    (seq_on, plan_on), (seq_off, plan_off) = longest(ctx, model, "true", layout), longest(ctx, model, "false", layout)
    harness.log(f"  longest within {budget} GB ({layout}, planned): chunked {seq_on}, unchunked {seq_off}")
    out = {"budget_gb": budget, "layout": layout, "chunked": {"seq": seq_on, "planned_gb": plan_on}}
    out["unchunked"] = {"seq": seq_off, "planned_gb": plan_off}
    if seq_on:
        out["chunked"] |= finetune_side(ctx, model, seq_on, "true", layout if ranks else None)
    if seq_off:
        out["unchunked"] |= {"trainer": trainer_side(ctx, model, seq_off, zero3=ranks)}
    return out


def rows(r: dict) -> list[harness.Row]:
    out = []
    if "peak" in r:
        p = r["peak"]
        for side in ("chunked", "unchunked", "trainer"):
            x = p[side]
            name = f"finetune chunked_loss {'true' if side == 'chunked' else 'false'}" if side != "trainer" else side
            step = f"step {x['step_s']:.1f} s" if x.get("step_s") else ""
            out.append(harness.Row("loss memory", f"{name}, seq {p['seq']}", x["train_peak_gb"], "GB", step))
        ratio = p["chunked"]["train_peak_gb"] / p["trainer"]["train_peak_gb"]
        target = f"<= {PEAK_TARGET}"
        out.append(harness.Row("loss memory", "chunked / Trainer peak", ratio, "x", "", target, ratio <= PEAK_TARGET))
        speed = p["unchunked"]["step_s"] / p["chunked"]["step_s"]
        out.append(harness.Row("loss memory", "chunked / unchunked speed", speed, "x", "finetune, same run otherwise"))
    if "zero3" in r:
        z = r["zero3"]
        for side, name in (("chunked", "finetune chunked_loss true"), ("trainer", "Trainer")):
            x = z[side]
            note = f"step {x['step_s']:.1f} s, largest of 2 ranks" + (
                f", DeepSpeed stage {x['zero_stage']}" if x.get("zero_stage") else ""
            )
            out.append(harness.Row("loss memory ZeRO-3", f"{name}, seq {z['seq']}", x["train_peak_gb"], "GB", note))
        ratio = z["chunked"]["train_peak_gb"] / z["trainer"]["train_peak_gb"]
        met = ratio <= PEAK_TARGET
        out.append(
            harness.Row("loss memory ZeRO-3", "chunked / Trainer peak", ratio, "x", "", f"<= {PEAK_TARGET}", met)
        )
    if "eval" in r:
        e = r["eval"]
        same = abs(e["true"]["loss"] / e["false"]["loss"] - 1) <= 1e-5
        out += _above_model_rows(
            "eval memory",
            e,
            f"{e['batch']} x {e['seq']} tokens",
            lambda x: f"eval_loss {x['loss']:.6f}, model loaded {x['model_gb']:.2f} GB",
            f"same loss: {same}",
        )
    if "pairs" in r:
        e = r["pairs"]
        a, b = e["true"]["logps"], e["false"]["logps"]
        same = len(a) == len(b) > 0 and all(abs(x / y - 1) <= 1e-5 for x, y in zip(a, b))
        what = f"{e['pairs']} pairs ({2 * e['pairs']} rows) x {e['seq']} tokens"
        out += _above_model_rows("pairs memory", e, what, lambda x: "", f"same log-probs: {same}")
    for lg in (r[part] for part in ("longest", "zero3_longest") if part in r):
        budget, bench = lg["budget_gb"], "longest sequence" + (" ZeRO-3" if lg.get("layout") == "zero3" else "")
        on, off = lg["chunked"], lg["unchunked"]
        measured_on, measured_off = on.get("train_peak_gb"), off.get("trainer", {}).get("train_peak_gb")
        for name, x, measured in (("finetune chunked", on, measured_on), ("Trainer (unchunked)", off, measured_off)):
            note = f"planned {x['planned_gb']:.2f} GB" + (
                f", measured {measured:.2f} GB ({'within' if measured <= budget else 'OVER'} {budget} GB)"
                if measured
                else ""
            )
            out.append(harness.Row(bench, f"{name} in {budget} GB", x["seq"], "tokens", note))
        if off["seq"]:
            ratio = on["seq"] / off["seq"]
            confirmed = all(m is not None and m <= budget for m in (measured_on, measured_off))
            met = ratio >= LONGEST_TARGET and confirmed
            out.append(harness.Row(bench, "chunked / Trainer", ratio, "x", "", f">= {LONGEST_TARGET}", met))
    return out


def _above_model_rows(bench: str, e: dict, what: str, note, same: str) -> list[harness.Row]:
    """Each side's peak above the loaded model (chunked_loss true, and false: the whole logits), then their ratio;
    note(side's results) annotates a side's row, same the ratio's."""
    above = {side: e[side]["peak_gb"] - e[side]["model_gb"] for side in ("true", "false")}
    out = [
        harness.Row(bench, f"{name}, {what}", above[side], "GB", note(e[side]))
        for side, name in (("true", "chunked_loss true"), ("false", "transformers' forward (whole logits)"))
    ]
    return [*out, harness.Row(bench, "chunked / whole, above the model", above["true"] / above["false"], "x", same)]


if __name__ == "__main__":
    if not harness.worker_main({"eval": eval_worker, "pairs": pairs_worker}):
        harness.main(sys.modules[__name__])
