"""Data at scale: preparation speed against the tokenizer itself, and memory that does not grow with the rows.

For each size of an instruction set (prompt/response, 20-200 words; default 20k, 200k and 1M rows) and a chat set,
packing off and on, each step in a fresh process:
  floor     a plain batched call of the same fast tokenizer over the same texts (prompts through the default
            prompt template, responses; chat: the template's rendering): rows/s, one process
  prepare   `finetune prepare` with an empty datasets cache: preparation seconds and rows/s (finetune's own log
            line, after imports and the tokenizer load), ratio to the floor, peak RSS of the preparing process
  run       `finetune` on the same datasets cache (a rank that only reads the cache), eval on (the default held-out
            split, capped by eval_fraction_max_rows), 2 steps: seconds to the end of step 1, peak RSS
  stream    `finetune --streaming true` on the raw file (no cache: read, shuffled, tokenized as it trains), eval on
            (the stream's first eval_fraction_max_rows rows), 2 steps: seconds to the end of step 1, peak RSS
and the ratio of the peak RSS at the largest size to the smallest, for both runs (the target: within 10%).

    .venv/bin/python bench/data_scale.py [--sizes 20000,1000000] [--chat 20000] [--packing on|off|both]

The data, tokenizer and model (the 7M Llama of bench/harness.py) are built once under .cache/bench_data_scale/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".cache" / "bench_data_scale"
PY = sys.executable
TIMEOUT_S = 3600
FLOORS: dict[str, float] = {}


def log(message: str) -> None:
    print(f"[data_scale] {message}", file=sys.stderr, flush=True)


def assets() -> tuple[str, str]:
    """The tokenizer and the 7M Llama (harness.LLAMA_7M), built once."""
    sys.path.insert(0, str(ROOT / "bench"))
    import harness

    from finetune import demo

    model = WORK / "llama7m"
    if not (model / "config.json").exists():
        tok = demo.build_tokenizer(WORK / "tokenizer")
        demo.build_model("llama", model, tok, **harness.LLAMA_7M)
    return str(WORK / "tokenizer"), str(model)


def dataset(kind: str, n: int) -> str:
    """n instruction rows (prompt/response, 20-200 words, 40% prompt) or two-turn conversations, built once."""
    from finetune import demo

    path = WORK / f"{kind}_{n}.jsonl"
    if path.exists():
        return str(path)
    rng = random.Random(n)
    words = sorted({w for t in demo.TOPICS.values() for w in t.split()} | set(demo.FILLER))
    tmp = str(path) + ".tmp"
    with open(tmp, "w") as f:
        for _ in range(n):
            k = rng.randint(20, 200)
            p = max(1, k * 2 // 5)
            prompt, answer = " ".join(rng.choices(words, k=p)), " ".join(rng.choices(words, k=k - p))
            if kind == "chat":
                turns = [("user", prompt), ("assistant", answer), ("user", "Are you sure?"), ("assistant", "Yes.")]
                row = {"messages": [{"role": r, "content": c} for r, c in turns]}
            else:
                row = {"prompt": prompt, "response": answer}
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return str(path)


FLOOR = """
import json, sys, time
from transformers import AutoTokenizer
from finetune.config import DataArgs
tok = AutoTokenizer.from_pretrained(sys.argv[1])
rows = [json.loads(line) for line in open(sys.argv[2])]
start = time.perf_counter()
if "messages" in rows[0]:
    texts = [tok.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    tok(texts, add_special_tokens=False)
else:
    template = DataArgs().prompt_template
    tok([template.format(prompt=r["prompt"]) for r in rows])
    tok([r["response"] for r in rows], add_special_tokens=False)
print(json.dumps({"rows_per_s": len(rows) / (time.perf_counter() - start)}))
"""


def timed(cmd: list[str], env: dict) -> tuple[str, float, float, float | None]:
    """(output, wall s, peak RSS GB, s to the end of step 1) of a command under /usr/bin/time -v."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        ["/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines, first_step = [], None
    deadline = start + TIMEOUT_S
    for line in proc.stdout:
        lines.append(line)
        if first_step is None and "] step 1/" in line:
            first_step = time.perf_counter() - start
        if time.perf_counter() > deadline:
            proc.kill()
            break
    proc.wait(timeout=60)
    out = "".join(lines)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}):\n{out[-3000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out).group(1)) / 2**20
    return out, time.perf_counter() - start, peak, first_step


def measure(kind: str, n: int, packing: bool, tokenizer: str, model: str) -> dict:
    path = dataset(kind, n)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    if path not in FLOORS:  # one floor per data file (packing does not change it)
        done = subprocess.run(
            [PY, "-c", FLOOR, tokenizer, path], capture_output=True, text=True, env=env, timeout=TIMEOUT_S
        )
        FLOORS[path] = json.loads(done.stdout.strip().splitlines()[-1])["rows_per_s"]
    floor = FLOORS[path]
    scratch = Path(tempfile.mkdtemp(prefix="scale_", dir=WORK))
    env["HF_DATASETS_CACHE"] = str(scratch / "cache")
    common = ["--model", model, "--dataset", path, "--max_seq_length", "512", "--packing", str(packing).lower()]
    try:
        out, _, prep_peak, _ = timed(
            [PY, "-m", "finetune", "prepare", *common, "--prepared_data", str(scratch / "p")], env
        )
        m = re.search(r"data prepared: (\d+) rows in ([\d.]+) s", out)
        rows, prep_s = int(m.group(1)), float(m.group(2))
        run = [*common, "--max_steps", "2", "--logging_steps", "1", "--save_steps", "null", "--disable_tqdm", "true"]
        out, run_s, run_peak, first_step = timed([PY, "-m", "finetune", *run, "--output_dir", str(scratch / "o")], env)
        assert "tokenizing train" not in out and "packing:" not in out, "the run did not read the datasets cache"
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:  # streaming: nothing prepared, nothing cached
        run += ["--streaming", "true", "--output_dir", str(scratch / "s")]
        out, _, stream_peak, stream_first_step = timed([PY, "-m", "finetune", *run], env)
        assert "train rows streamed" in out and "tokenizing train" not in out, "the run did not stream"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "kind": kind, "rows": n, "packing": packing, "floor_rows_per_s": floor, "prepare_s": prep_s,
        "prepare_rows_per_s": rows / prep_s, "prepare_peak_gb": prep_peak, "run_first_step_s": first_step,
        "run_s": run_s, "run_peak_gb": run_peak, "stream_first_step_s": stream_first_step,
        "stream_peak_gb": stream_peak,
    }  # fmt: skip


def table(results: list[dict]) -> str:
    head = (
        "| data | rows | packing | floor rows/s | prepare s | prepare rows/s | x floor | prepare peak GB "
        "| run: s to step 1 | run peak GB | stream: s to step 1 | stream peak GB |\n" + "| --- " * 12 + "|"
    )
    lines = [head]
    for r in results:
        lines.append(
            f"| {r['kind']} | {r['rows']:,} | {'on' if r['packing'] else 'off'} | {r['floor_rows_per_s']:,.0f} "
            f"| {r['prepare_s']:.1f} | {r['prepare_rows_per_s']:,.0f} "
            f"| {r['prepare_rows_per_s'] / r['floor_rows_per_s']:.2f} | {r['prepare_peak_gb']:.2f} "
            f"| {r['run_first_step_s'] or float('nan'):.1f} | {r['run_peak_gb']:.2f} "
            f"| {r['stream_first_step_s'] or float('nan'):.1f} | {r['stream_peak_gb']:.2f} |"
        )
    for kind in sorted({r["kind"] for r in results}):
        for packing in (False, True):
            same = sorted(
                (r for r in results if r["kind"] == kind and r["packing"] == packing), key=lambda r: r["rows"]
            )
            if len(same) > 1:
                lo, hi = same[0], same[-1]
                for what in ("run", "stream"):
                    a, b = hi[f"{what}_peak_gb"], lo[f"{what}_peak_gb"]
                    lines.append(
                        f"\n{kind}, packing {'on' if packing else 'off'}: {what} peak at {hi['rows']:,} rows / at "
                        f"{lo['rows']:,} rows = {a:.2f} / {b:.2f} GB = {a / b:.2f} (target <= 1.10)"
                    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="20000,200000,1000000", help="instruction set sizes (rows)")
    parser.add_argument("--chat", type=int, default=20000, help="rows of the chat set (0: none)")
    parser.add_argument("--packing", choices=("on", "off", "both"), default="both")
    opts = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    tokenizer, model = assets()
    packings = {"on": [True], "off": [False], "both": [False, True]}[opts.packing]
    plan = [("instruction", int(n)) for n in opts.sizes.split(",")] + ([("chat", opts.chat)] if opts.chat else [])
    results = []
    for kind, n in plan:
        for packing in packings:
            log(f"{kind} {n:,} rows, packing {packing}")
            results.append(measure(kind, n, packing, tokenizer, model))
            log(json.dumps(results[-1]))
    print(f"\n`.venv/bin/python bench/data_scale.py {' '.join(sys.argv[1:])}` ({os.cpu_count()} cores)\n")
    print(table(results))


if __name__ == "__main__":
    main()
