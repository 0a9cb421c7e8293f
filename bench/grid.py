"""The step, on a grid of shapes (issues 18 and 31): finetune vs HF Trainer vs a bare PyTorch loop.

Parts (--parts, default all):
  grid    tokens/s at three Llama sizes (about 5M, 34M and 135M parameters, vocabulary 32000, tied embeddings)
          and one with a Llama-3-sized vocabulary (128-v128k: the 34M shape with 128,256 entries, 85M parameters)
          x sequence lengths 128 and 512, fixed-length data (no padding anywhere), fp32, 1 process x 2 threads.
          Targets: finetune >= 1.0x Trainer at every point and >= 1.03x as the median over the grid;
          finetune >= 0.97x the bare loop.
  eval    eval tokens/s on the same eval rows: finetune's eval loop vs `Trainer.evaluate` (34M, seq 512);
          each evaluates twice and the second pass is timed. Target >= 1.0x.
  launch  warm launch to the end of optimizer step 1 (34M, seq 512, micro batch 1, datasets cache warm):
          `python -m finetune` vs a Trainer script (bench/baselines.py), both timed from the launch command.
          Target: Trainer's time / finetune's >= 1.0.
  ddp     2 processes x 1 thread vs 1 process x 2 threads (34M, seq 512, the same global batch). Target >= 0.95x.

--data sft trains the grid's points on instruction rows instead (a fine-tune's usual data): each row exactly `seq`
tokens, a prompt of 20-60% of them (40% on average, uniformly drawn; not learned), then the answer and EOS
(`format: instruction`, `prompt_template: "{prompt}"`), no padding; every side trains on the same rows, batches,
labels and losses, and finetune's LM head runs on the learned positions only (finetune/chunked_loss.py).

The vocabulary: a word-level tokenizer of 32000 entries (w0 .. w31993 and the specials) and text of words drawn
uniformly from it, so every token id of the 32k embedding occurs and the LM head is a 32k-wide matmul and
softmax, as with a real Llama-2-sized vocabulary. finetune cuts the text into full blocks (its `text` format);
the baselines train on the same blocks in the same order. The 128k point has its own tokenizer of 128,256 words.

Settings (every table says which): --allocator equal (the default) runs every side, finetune too, with the glibc
allocator settings finetune's `cpu_allocator: keep` sets, in its environment from the start
(`cpu_allocator_env("keep")`); --allocator default leaves each side its own default (finetune: keep, set at start;
Trainer and the bare loop: glibc's thresholds). --compile compiles on every side: finetune `torch_compile: true`
(its repeated blocks), Trainer `torch_compile=True`, the bare loop `torch.compile(model)`; the first step (with
the compilation) is dropped from the figures as every run's first step is.

    .venv/bin/python bench/grid.py --quick                       # smoke run: two tiny sizes, 1 repeat
    .venv/bin/python bench/grid.py                               # all parts (~25 min on 2 idle cores, estimated; --parts grid ~19)
    .venv/bin/python bench/grid.py --parts eval,launch --repeats 5
    .venv/bin/python bench/grid.py --parts grid --allocator default                    # each side's defaults
    .venv/bin/python bench/grid.py --parts grid --sizes 34M --seqs 512 --compile        # compiled on every side
    .venv/bin/python bench/grid.py --parts grid --data sft                               # instruction rows
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys

import ddp
import harness

from finetune.parallel.environment import cpu_allocator_env

NAME = "grid"
TITLE = "issue 18: finetune / Trainer over the grid"
VOCAB = 32000
VOCAB_128K = 128_256  # Llama 3's
PARTS = ("grid", "eval", "launch", "ddp")
SEQS = (128, 512)


def llama(hidden: int, layers: int, heads: int, inter: int) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )


# name -> (model shape, tokens per micro batch, optimizer steps per run, vocabulary). The 135M model takes 1024
# tokens per micro batch to stay near 4 GB (Trainer, seq 512, estimate: weights+grads+AdamW 16 B x 136M = 2.2 GB,
# activations ~1 GB, logits 2 x 512 x 32000 x 4 B = 0.13 GB per copy, ~0.6 GB of libraries). At 128k entries one
# micro batch's logits are 1024 x 128256 x 4 B = 0.5 GB per copy.
SIZES = {
    "5M": (llama(128, 4, 4, 352), 2048, 6, VOCAB),
    "34M": (llama(512, 6, 8, 1376), 2048, 4, VOCAB),
    "135M": (llama(768, 16, 12, 2048), 1024, 3, VOCAB),
    "85M-v128k": (llama(512, 6, 8, 1376), 1024, 4, VOCAB_128K),
}
QUICK_SIZES = {
    "q1M": (llama(32, 2, 2, 64), 512, 3, VOCAB),
    "q3M": (llama(64, 2, 2, 128), 512, 3, VOCAB),
}
REPEATS = 3  # the default here (the suite's is 4): the grid part stays near 19 minutes on 2 idle cores
REFERENCE = "34M"  # the size of the eval, launch and ddp parts (QUICK: the larger quick one)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help=f"grid parts to run (default {','.join(PARTS)})")
    parser.add_argument("--sizes", default=None, help="grid sizes (default 5M,34M,135M)")
    parser.add_argument("--seqs", default=None, help="grid sequence lengths (default 128,512)")
    parser.add_argument(
        "--allocator",
        choices=("equal", "default"),
        default="equal",
        help="equal (default): every side runs with cpu_allocator keep's glibc settings in its environment; "
        "default: each side its own (finetune keep, the others glibc's)",
    )
    parser.add_argument("--compile", action="store_true", help="compile on every side (finetune, Trainer, bare loop)")
    parser.add_argument(
        "--data",
        choices=("text", "sft"),
        default="text",
        help="the grid's rows: text (default; every token learned) or sft (instruction rows: prompt 20-60%% of "
        "each row, not learned)",
    )


# ---------------------------------------------------------------- assets


def build_assets(ctx: harness.Context, sizes: dict) -> dict:
    """Per vocabulary: its word-level tokenizer, train and eval text; one model per size (built once under
    work/grid/; the 32k vocabulary's files keep their first names)."""
    from transformers import AutoTokenizer

    from finetune import demo

    root = ctx.work / "grid"
    out: dict = {"models": {}, "params": {}, "train": {}, "eval": {}, "vocab": {}, "words": {}}
    for name, (shape, _, _, vocab) in sizes.items():
        suffix = "" if vocab == VOCAB else f"_{vocab}"
        tok_dir = root / f"tokenizer{suffix}"
        if not (tok_dir / "tokenizer.json").exists():
            harness.log(f"building the {vocab}-word tokenizer and its data under {root} (once)")
            build_tokenizer(tok_dir, vocab)
        tok = AutoTokenizer.from_pretrained(tok_dir)
        path = root / f"llama_{name}"
        if not (path / "config.json").exists():
            harness.log(f"building the {name} model")
            demo.build_model("llama", path, tok, **shape)
        out["models"][name], out["params"][name], out["vocab"][name] = str(path), parameter_count(path), vocab
        words = [w for w in tok.get_vocab() if w.startswith("w")]
        out["words"][name] = sorted(words)
        for split, n_rows, seed in (("train", 240, 1), ("eval", 8, 2)):
            data = root / f"{split}{suffix}.jsonl"
            if not data.exists():
                rng = random.Random(seed)
                rows = [{"text": " ".join(rng.choice(words) for _ in range(1024))} for _ in range(n_rows)]
                demo.write_jsonl(rows, data)
            out[split][name] = str(data)
    return out


SFT_PROMPT_SHARE = (0.2, 0.6)  # --data sft: each row's prompt share, uniformly drawn (40% on average)


def sft_rows(ctx: harness.Context, words: list[str], vocab: int, seq: int, n_rows: int = 240) -> str:
    """--data sft: instruction rows of exactly `seq` tokens (prompt + answer + EOS under `prompt_template:
    "{prompt}"` with the word-level tokenizer of `vocab` entries, which adds no other token), the prompt
    SFT_PROMPT_SHARE of it."""
    path = ctx.work / "grid" / f"sft_s{seq}_{vocab}.jsonl"
    if not path.exists():
        rng = random.Random(seq)
        rows = []
        for _ in range(n_rows):
            prompt = round(seq * rng.uniform(*SFT_PROMPT_SHARE))
            text = [rng.choice(words) for _ in range(seq - 1)]
            rows.append({"prompt": " ".join(text[:prompt]), "response": " ".join(text[prompt:])})
        from finetune import demo

        demo.write_jsonl(rows, path)
    return str(path)


def build_tokenizer(path, vocab: int) -> None:
    """A word-level tokenizer of exactly `vocab` entries, saved as a standard Hugging Face tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from finetune.demo import SPECIALS

    ids = {t: i for i, t in enumerate(SPECIALS)}
    ids.update({f"w{i}": len(SPECIALS) + i for i in range(vocab - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    assert len(hf) == vocab, len(hf)
    hf.save_pretrained(path)


def parameter_count(path) -> int:
    """Parameters as saved (a tied LM head is stored once)."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


# ---------------------------------------------------------------- parts


def run(ctx: harness.Context) -> dict:
    o = ctx.opts
    repeats = o.repeats  # REPEATS unless given (harness.run_suite)
    sizes = QUICK_SIZES if ctx.quick else SIZES
    if getattr(o, "sizes", None):
        sizes = {n: sizes[n] for n in o.sizes.split(",")}
    seqs = tuple(int(s) for s in o.seqs.split(",")) if getattr(o, "seqs", None) else SEQS
    parts = (getattr(o, "parts", None) or ",".join(PARTS)).split(",")
    reference = REFERENCE if REFERENCE in sizes else list(sizes)[-1]
    a = build_assets(ctx, sizes if reference in sizes else {**sizes, reference: SIZES[reference]})
    settings = {
        "allocator": o.allocator,
        "env": cpu_allocator_env("keep") if o.allocator == "equal" else {},
        "compile": o.compile,
        "data": o.data,
    }
    out: dict = {"params": a["params"], "vocab": a["vocab"], "parts": parts, "settings": settings}
    if "grid" in parts:
        out["grid"] = {}
        for name, (_, tokens, steps, _) in sizes.items():
            for seq in seqs:
                point = f"{name}_s{seq}"
                harness.log(f"  grid {point}: micro {tokens // seq} x {seq} tokens, {steps} steps, {o.data} rows")
                data = a["train"][name] if o.data == "text" else sft_rows(ctx, a["words"][name], a["vocab"][name], seq)
                out["grid"][point] = grid_point(
                    ctx, point, a["models"][name], data, seq, tokens // seq, steps, repeats, settings
                )
        summarize_grid(out)
    _, tokens, steps, _ = (QUICK_SIZES if ctx.quick else SIZES)[reference]
    model, train = a["models"][reference], a["train"][reference]
    if "eval" in parts:
        out["eval"] = eval_part(ctx, model, train, a["eval"][reference], 512, tokens // 512, repeats, settings)
    if "launch" in parts:
        out["launch"] = launch_part(ctx, model, train, 512, repeats, settings)
    if "ddp" in parts:  # finetune on both sides: its own settings
        out["ddp"] = ddp.measure(ctx, "grid_ddp", model, train, 512, max(2, tokens // 512), steps, repeats)
    out["reference_size"], out["repeats"] = reference, repeats
    return out


def settings(r: dict) -> str:
    """Which settings each side had (harness.run_suite puts it above the table)."""
    settings = r["settings"]
    if settings["allocator"] == "equal":
        env = " ".join(f"{k}={v}" for k, v in settings["env"].items())
        alloc = f"every side with {env} (cpu_allocator keep's settings)"
    else:
        alloc = "each side's default (finetune cpu_allocator keep; Trainer and the bare loop glibc's)"
    data = settings.get("data", "text")
    rows = "text (every token learned)" if data == "text" else "sft (instruction rows, prompt 20-60% not learned)"
    return f"allocator: {alloc}; compile: {'on every side' if settings['compile'] else 'off'}; data: {rows}"


def grid_point(
    ctx: harness.Context,
    point: str,
    model: str,
    data: str,
    seq: int,
    micro: int,
    steps: int,
    repeats: int,
    settings: dict,
) -> dict:
    sft = settings["data"] == "sft"
    config = harness.write_run_config(
        ctx,
        f"grid_{point}",
        model=model,
        dataset=data,
        format="instruction" if sft else "text",
        **({"prompt_template": "{prompt}"} if sft else {}),
        max_seq_length=seq,
        per_device_train_batch_size=micro,
        torch_compile=settings["compile"],
    )
    warmup = ctx.opts.warmup
    spec = {"config": config, "steps": steps, "threads": 2, "collator": "default", "warmup": warmup}
    spec |= {"env": settings["env"], "compile": settings["compile"]}
    env = settings["env"]
    systems = {
        "finetune": lambda rep: harness.run_finetune(ctx, f"{point}_finetune_{rep}", config, steps, 2, None, **env),
        "bare_loop": lambda rep: harness.run_worker(ctx, "baselines.py", "bare", spec, f"{point}_bare_{rep}", 2),
        "hf_trainer": lambda rep: harness.run_worker(ctx, "baselines.py", "trainer", spec, f"{point}_trainer_{rep}", 2),
    }
    runs = harness.interleaved(systems, repeats)
    harness.same_batches(runs, tuple(systems))
    out = {n: harness.summary(r) for n, r in runs.items()}
    for other in ("hf_trainer", "bare_loop"):
        harness.ratio(out, runs, "finetune", other, f"finetune_x_{other}")
    out["setup"] = {"seq": seq, "micro": micro, "steps": steps, "warmup": warmup}
    return out


def summarize_grid(out: dict) -> None:
    """The median over the grid of finetune / Trainer, and the same per repeat (each repeat's median over points)."""
    points = list(out["grid"].values())
    out["grid_median_x_hf_trainer"] = statistics.median(p["finetune_x_hf_trainer"] for p in points)
    repeats = min(len(p["finetune_x_hf_trainer_paired"]) for p in points)
    out["grid_median_x_hf_trainer_paired"] = [
        statistics.median(p["finetune_x_hf_trainer_paired"][r] for p in points) for r in range(repeats)
    ]


def eval_part(
    ctx: harness.Context, model: str, train: str, evalset: str, seq: int, micro: int, repeats: int, settings: dict
) -> dict:
    """finetune (2 steps, eval after each; the second eval is timed from its log lines) vs Trainer.evaluate()
    twice (the second timed), on finetune's eval rows, the same eval batch, 2 threads."""
    from baselines import EVAL_DONE

    config = harness.write_run_config(
        ctx,
        "grid_eval",
        model=model,
        dataset=train,
        eval_dataset=evalset,
        format="text",
        max_seq_length=seq,
        per_device_train_batch_size=micro,
        per_device_eval_batch_size=micro,
        eval_steps=1,
    )
    ds, _ = harness.finetune_datasets(config)
    eval_tokens = sum(len(x) for x in ds.eval["input_ids"])

    def ours(rep: int) -> dict:
        tag = f"eval_finetune_{rep}"
        cmd = harness.finetune_cmd(config, ctx.runs / tag, None, "--max_steps", "2")
        marks = {"step2": "] step 2/2", "eval2": "eval @ step 2:"}
        r = harness.launch(ctx, tag, cmd, 2, stop_at="eval @ step 2:", marks=marks, **settings["env"])
        seconds = r.marks["eval2"] - r.marks["step2"]
        return {"eval_s": seconds, "eval_tokens_per_s": eval_tokens / seconds}

    def trainer(rep: int) -> dict:
        spec = {"config": config, "steps": 2, "threads": 2, "warmup": 0, "mode": "eval", "env": settings["env"]}
        marks = {"eval1": EVAL_DONE.format(1), "eval2": EVAL_DONE.format(2)}
        r = harness.run_worker(ctx, "baselines.py", "trainer", spec, f"eval_trainer_{rep}", 2, marks=marks)
        if r["eval_tokens"] != eval_tokens:
            raise RuntimeError(f"Trainer evaluated {r['eval_tokens']} tokens, finetune {eval_tokens}")
        seconds = r["marks"]["eval2"] - r["marks"]["eval1"]
        return {"eval_s": seconds, "eval_tokens_per_s": eval_tokens / seconds}

    key = "eval_tokens_per_s"
    runs = harness.interleaved({"finetune": ours, "hf_trainer": trainer}, repeats, key=key)
    out = {n: harness.summary(r, key) for n, r in runs.items()}
    harness.ratio(out, runs, "finetune", "hf_trainer", "finetune_x_hf_trainer", key=key)
    out["eval_tokens"], out["eval_rows"], out["seq"] = eval_tokens, len(ds.eval), seq
    return out


def launch_part(ctx: harness.Context, model: str, data: str, seq: int, repeats: int, settings: dict) -> dict:
    """Seconds from the launch command to the end of optimizer step 1, warm: one untimed launch of each first
    (it fills the datasets cache), then interleaved repeats. Micro batch 1: step 1 itself is short. Uncompiled
    (the eval part too): --compile is for the grid's steps."""
    from baselines import FIRST_STEP_DONE

    config = harness.write_run_config(
        ctx, "grid_launch", model=model, dataset=data, format="text", max_seq_length=seq, per_device_train_batch_size=1
    )
    spec = {"config": config, "steps": 2, "threads": 2, "warmup": 0, "mode": "first_step", "env": settings["env"]}

    def ours(rep: int) -> dict:
        tag = f"launch_finetune_{rep}"
        cmd = harness.finetune_cmd(config, ctx.runs / tag, None, "--max_steps", "2")
        r = harness.launch(ctx, tag, cmd, 2, stop_at="] step 1/", **settings["env"])
        return {"to_first_step_s": r.marks["first_step"]}

    def trainer(rep: int) -> dict:
        marks = {"first_step": FIRST_STEP_DONE}
        r = harness.run_worker(
            ctx, "baselines.py", "trainer", spec, f"launch_trainer_{rep}", 2, stop_at=FIRST_STEP_DONE, marks=marks
        )
        return {"to_first_step_s": r["marks"]["first_step"]}

    ours("warm-up"), trainer("warm-up")
    key = "to_first_step_s"
    runs = harness.interleaved({"finetune": ours, "hf_trainer": trainer}, repeats, key=key)
    out = {n: harness.summary(r, key) for n, r in runs.items()}
    harness.ratio(out, runs, "finetune", "hf_trainer", "hf_trainer_x_finetune", key=key, lower=True)
    return out


# ---------------------------------------------------------------- report


def rows(r: dict) -> list[harness.Row]:
    out: list[harness.Row] = []
    params = ", ".join(f"{n} = {p / 1e6:.1f}M" for n, p in r["params"].items())
    for point, p in r.get("grid", {}).items():
        size, seq = point.rsplit("_s", 1)
        what = f"{size} seq {seq} (micro {p['setup']['micro']})"
        note = f"Trainer {p['hf_trainer']['tokens_per_s']:.0f}, bare {p['bare_loop']['tokens_per_s']:.0f}"
        out.append(harness.Row("grid", what, p["finetune"]["tokens_per_s"], "tokens/s", note))
        out.append(harness.ratio_row("grid", "  finetune / hf_trainer", p, "finetune_x_hf_trainer", 1.0))
        out.append(harness.ratio_row("grid", "  finetune / bare_loop", p, "finetune_x_bare_loop", 0.97))
    if "grid" in r:
        # issue 31's target on equal settings; issue 18's with each side's own allocator
        target = 1.15 if r["settings"]["allocator"] == "equal" else 1.03
        out.append(
            harness.ratio_row("grid", "median over grid / Trainer", r, "grid_median_x_hf_trainer", target, params)
        )
    if "eval" in r:
        e = r["eval"]
        note = f"{e['eval_rows']} rows x {e['seq']}; Trainer {e['hf_trainer']['eval_tokens_per_s']:.0f} tok/s"
        out.append(harness.Row("grid eval", "finetune eval", e["finetune"]["eval_tokens_per_s"], "tokens/s", note))
        out.append(harness.ratio_row("grid eval", "finetune / Trainer.evaluate", e, "finetune_x_hf_trainer", 1.0))
    if "launch" in r:
        lr = r["launch"]
        note = f"Trainer {lr['hf_trainer']['to_first_step_s']:.1f} s"
        out.append(harness.Row("grid launch", "finetune to step 1, warm", lr["finetune"]["to_first_step_s"], "s", note))
        out.append(harness.ratio_row("grid launch", "Trainer time / finetune time", lr, "hf_trainer_x_finetune", 1.0))
    if "ddp" in r:
        out += ddp.rows(r["ddp"], bench="grid ddp")
    return out


def plot(ax, r: dict) -> None:
    points = list(r.get("grid", {}))
    if not points:
        ax.axis("off")
        return
    x = range(len(points))
    for key, label in (("finetune_x_hf_trainer", "/ Trainer"), ("finetune_x_bare_loop", "/ bare loop")):
        ax.plot(x, [r["grid"][p][key] for p in points], "o-", label=f"finetune {label}")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xticks(list(x), [p.replace("_s", "\nseq ") for p in points], fontsize=7)
    ax.set_ylabel("tokens/s ratio")
    ax.legend(fontsize=7)


if __name__ == "__main__":
    harness.main(sys.modules[__name__])
