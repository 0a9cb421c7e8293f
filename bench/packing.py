"""Packing: real (non-padding) tokens/s on instruction data of 16..512 tokens: finetune with packing, finetune
with padding, HF Trainer (DataCollatorForSeq2Seq). Also the padding share of each, and what order-preserving
greedy and first-fit-decreasing packing would leave on the same data.

    .venv/bin/python bench/packing.py [--quick] [--repeats 4] [--steps 4]
"""

from __future__ import annotations

import statistics
import sys

import harness

NAME = "packing"
TITLE = "2. variable-length data (real tokens)"
SYSTEMS = ("finetune_packing", "finetune_padding", "hf_trainer")


def run(ctx: harness.Context) -> dict:
    a = harness.assets(ctx)
    o = ctx.opts
    common = dict(model=a["model"], dataset=a["instr"], format="instruction", max_seq_length=512)
    padded = harness.write_run_config(ctx, "packing_off", packing=False, **common)
    packed = harness.write_run_config(ctx, "packing_on", packing=True, **common)
    spec = {"config": padded, "steps": o.steps, "threads": 2, "collator": "seq2seq", "warmup": o.warmup}
    systems = {
        "finetune_packing": lambda rep: harness.run_finetune(ctx, f"pk_on_{rep}", packed, o.steps, 2),
        "finetune_padding": lambda rep: harness.run_finetune(ctx, f"pk_off_{rep}", padded, o.steps, 2),
        "hf_trainer": lambda rep: harness.run_worker(ctx, "baselines.py", "trainer", spec, f"pk_trainer_{rep}", 2),
    }
    runs = harness.interleaved(systems, o.repeats)
    harness.same_batches(runs, ("finetune_padding", "hf_trainer"))
    out = {name: harness.summary(r) for name, r in runs.items()}
    for name in ("finetune_packing", "finetune_padding"):
        harness.ratio(out, runs, name, "hf_trainer", f"{name}_x_hf_trainer")
    out["data"] = length_stats(padded, packed)
    out["setup"] = "34M Llama, instruction data 16..512 tokens, micro batch 8, max_seq_length 512, fp32, 2 threads"
    return out


_LENGTHS: dict[str, list[int]] = {}


def tokenized_lengths(config: str) -> list[int]:
    """Lengths of the rows finetune trains on for this run config (through finetune's own data code)."""
    if config not in _LENGTHS:
        ds, _ = harness.finetune_datasets(config)
        _LENGTHS[config] = [len(x) for x in ds.train["input_ids"]]
    return _LENGTHS[config]


def length_stats(config: str, packed_config: str) -> dict:
    """Token lengths of the tokenized training rows, and the padding waste of pad-to-longest batches of 8:
    unpacked, packed by finetune (its own rows), and packed by two reference algorithms (simulated)."""
    lengths = tokenized_lengths(config)
    app_rows = tokenized_lengths(packed_config)
    q = statistics.quantiles(lengths, n=10)
    packed_rows = {m: pack_lengths(lengths, 512, m) for m in ("greedy", "first_fit_decreasing")}
    return {
        "packed_padding_fraction_batch8": {m: padding_fraction(rows, 8) for m, rows in packed_rows.items()},
        "packed_rows": {m: len(rows) for m, rows in packed_rows.items()},
        "packed_padding_fraction_batch8_app": padding_fraction(app_rows, 8),
        "packed_rows_app": len(app_rows),
        "examples": len(lengths),
        "min": min(lengths),
        "p10": q[0],
        "median": statistics.median(lengths),
        "p90": q[-1],
        "max": max(lengths),
        "padding_fraction_batch8": padding_fraction(lengths, 8),
    }


def pack_lengths(lengths: list[int], max_len: int, mode: str, window: int = 1000) -> list[int]:
    """Row lengths after packing, per window of `window` examples in dataset order (as finetune's
    data.pack runs under datasets.map(batch_size=1000)). greedy: finetune's order-preserving packing
    (a row is closed when the next example does not fit); first_fit_decreasing: longest first, each into
    the first row with room."""
    rows: list[int] = []
    for start in range(0, len(lengths), window):
        chunk = lengths[start : start + window]
        if mode == "greedy":
            cur = 0
            for n in chunk:
                if cur and cur + n > max_len:
                    rows.append(cur)
                    cur = 0
                cur += n
            rows.append(cur)
        else:
            bins: list[int] = []
            for n in sorted(chunk, reverse=True):
                for i, b in enumerate(bins):
                    if b + n <= max_len:
                        bins[i] += n
                        break
                else:
                    bins.append(n)
            rows += bins
    return rows


def padding_fraction(lengths: list[int], micro: int) -> float:
    """Share of computed tokens that are padding, batches of `micro` rows in finetune's epoch order,
    each padded to its longest row rounded up to a multiple of 8 (finetune's Collator)."""
    order = harness.epoch_order(len(lengths), 42)
    real = padded = 0
    for i in range(0, len(order) - micro + 1, micro):
        batch = [lengths[j] for j in order[i : i + micro]]
        real += sum(batch)
        padded += micro * (-(-max(batch) // 8) * 8)
    return 1 - real / padded


def rows(r: dict) -> list[harness.Row]:
    d = r["data"]
    notes = {
        "finetune_packing": f"padding {d['packed_padding_fraction_batch8_app']:.0%} "
        f"(in-order greedy: {d['packed_padding_fraction_batch8']['greedy']:.0%})",
        "finetune_padding": f"padding {d['padding_fraction_batch8']:.0%}",
        "hf_trainer": f"padding {d['padding_fraction_batch8']:.0%} (DataCollatorForSeq2Seq)",
    }
    out = [harness.Row("2 packing", n, r[n]["tokens_per_s"], "real tok/s", notes[n]) for n in SYSTEMS]
    out.append(harness.ratio_row("2 packing", "packing / hf_trainer", r, "finetune_packing_x_hf_trainer", 1.3))
    out.append(harness.ratio_row("2 packing", "padding / hf_trainer", r, "finetune_padding_x_hf_trainer"))
    return out


def plot(ax, r: dict) -> None:
    harness.bars(ax, r, list(SYSTEMS), ylabel="real tokens/s")


if __name__ == "__main__":
    harness.main(sys.modules[__name__])
