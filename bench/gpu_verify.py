"""GPU verification on ONE GPU (issue 33): what GPU users run first, measured in one command, one table.

    python bench/gpu_verify.py [--size 1b] [--budget_s 470] [--results bench/results/gpu.json]

On the GPU machine, from the project root. Parts, in the order --parts names them (a layout with CPU offload
after every other part; each skipped, and said so, once --budget_s is spent; the JSON is rewritten after every
part, so a run cut short keeps what it measured):

  build     a Llama of ~1.2B parameters from a config (Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 heads,
            8 KV heads, MLP 8192, vocabulary 128,256, tied embeddings), saved in bf16 as Hub checkpoints are,
            the demo tokenizer, packed text
  mfu       one process, bf16, packing, 2048 tokens x micro 4: MFU (model FLOPs / 989 TFLOP/s dense bf16, and
            against the bf16 matmul rate measured here) eager with the whole logits, with the chunked loss,
            and with torch_compile + chunked loss; host syncs observed per step (CUDA sync debug mode, by place);
            then two more steps under the app's profiler (profile_steps): where the time goes (GPU busy and idle,
            time by kind of work, top operators), outside the steps MFU is read from
  layouts   the shipped configs with ONE process each, bf16 (accelerate launch --mixed_precision bf16), nccl:
            single, ddp, zero2, zero3, fsdp2, zero3_offload: per-step losses against single within
            docs/precision.md's bf16 tolerance (3e-3 relative; the training update within 6% in L2), exported
            dtype identical, peak GPU memory next to the run's own estimate (finetune plan's)
  megatron  Megatron-LM through accelerate, TP 1 x PP 1 (megatron_tp2.yaml with one process; Megatron-LM from
            --megatron; Transformer Engine's layers where installed, else the local spec): against single on the
            same unpacked rows (Megatron refuses packing), losses, eval loss, exported HF weights; a resume from
            the checkpoint halfway repeats the later losses
  fp16      one process, fp16: the loss-scaling path runs, skipped steps counted
  qlora     LoRA on the 4-bit base (bitsandbytes nf4): loss falls, the adapter exports and reloads onto a fresh
            4-bit base with the same loss, the merge (peft.merge) into the full-precision base

--size tiny runs the same parts on a tiny Llama (a dry run of this script; on a CPU only the CPU-capable parts).
With 2 or more GPUs, bench/gpu_verify_multi.py covers TP and Megatron-LM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import harness
import yaml

from finetune import launching, profiling
from finetune.commands import parity

ROOT = harness.ROOT
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, the datasheet figure MFU is quoted against
PARTS = ("mfu", "layouts", "megatron", "fp16", "qlora")  # what --parts may name
LAYOUTS = "single,ddp,zero2,zero3,fsdp2,zero3_offload"  # single first (the reference), zero3_offload last (--layouts)
BF16_LOSS_RTOL, BF16_UPDATE_RTOL = 3e-3, 0.06  # docs/precision.md
SYNC_WARNING = "called a synchronizing CUDA operation"
REFERENCE: dict[str, parity.Outcome] = {}  # the single run, which every layout is compared with

SIZES = {  # LlamaConfig fields
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}

# Where the step sync counter hooks in: a sitecustomize on PYTHONPATH (the run is the real app, unmodified).
SITECUSTOMIZE = """
import warnings
try:
    import torch
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation.*")
except Exception as e:  # never break the run being measured
    print("gpu_verify sitecustomize:", e)
"""


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


BUDGET = Budget(3600)  # main() sets --budget_s


def build(work: Path, size: str) -> dict:
    """The model, tokenizer and data; returns the run config (also written to work/run.yaml)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from finetune import demo

    tok = demo.build_tokenizer(work / "tokenizer")
    model_dir = work / f"llama_{size}"
    if not (model_dir / "config.json").exists():
        cfg = LlamaConfig(
            **SIZES[size],
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            net = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        net.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        del net
    rows = [{"text": " ".join(e["text"] for e in demo.topic_examples(40, seed=i))} for i in range(3000)]
    data = demo.write_jsonl(rows, work / "text.jsonl")
    run = {
        "model": str(model_dir),
        "dataset": data,
        "format": "text",
        "packing": True,
        "max_seq_length": 1024,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "learning_rate": 1e-4,
        "eval_fraction": 0.01,
        "eval_steps": None,
        "save_steps": None,
        "logging_steps": 1,
        "disable_tqdm": True,
    }
    (work / "run.yaml").write_text(yaml.safe_dump(run))
    return run


def one_process_config(name: str, work: Path) -> Path:
    """The shipped Accelerate config `name` with num_processes 1 (the DeepSpeed JSON path stays the shipped one;
    Megatron-LM's TP and PP 1, without sequence parallelism, which needs TP)."""
    path = parity.accelerate_config_path(name)
    cfg = yaml.safe_load(path.read_text())
    if cfg.get("num_processes", 1) == 1:
        return path
    cfg["num_processes"] = 1
    if "megatron_lm_config" in cfg:
        cfg["megatron_lm_config"].update(
            megatron_lm_tp_degree=1, megatron_lm_pp_degree=1, megatron_lm_sequence_parallelism=False
        )
    out = work / "configs" / f"{name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(cfg))
    return out


def launch(name: str, config: str, work: Path, run_args: list[str], launch_args=(), env=None):
    """One run of the real app under `config` (a shipped name); its metrics rows, log text and error (or "")."""
    from finetune.metrics import read_metrics

    out = work / "runs" / name
    args = [*run_args, "--output_dir", str(out), "--overwrite_output_dir", "true"]
    cmd = launching.finetune_command(args, one_process_config(config, work), tuple(launch_args))
    log = work / "runs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    timeout = max(60, BUDGET.left() + 60)  # a run started inside the budget may finish a minute after it
    r = launching.launch(cmd, timeout=timeout, env={**os.environ, **(env or {})}, log=log)
    error = ""
    if r.timed_out:
        error = f"timed out after {timeout} s"
    elif r.rc != 0:
        error = f"exit {r.rc}: " + " | ".join(r.output.strip().splitlines()[-4:])
    rows = read_metrics(str(out)) if (out / "metrics.jsonl").exists() else []
    return rows, r.output, error, r.wall_s


def train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "loss" in r and "eval_loss" not in r]


def peak_row(rows: list[dict]) -> dict:
    return next((r["peak_memory"][0] for r in rows if "peak_memory" in r), {})


def exported_dtypes(final: Path) -> str:
    """The dtypes of final/'s weights, read from the safetensors headers (not from config.json)."""
    seen = Counter()
    for f in sorted(final.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        seen.update(v["dtype"] for k, v in header.items() if k != "__metadata__")
    return ",".join(sorted(seen)) or "none"


def matmul_rate() -> float | None:
    """bf16 8192^3 matmul FLOP/s measured on this GPU (mean of 10 after 3 warm-ups)."""
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t0)


def syncs_per_step(output: str, first: int, last: int) -> tuple[float | None, dict[str, int]]:
    """CUDA sync warnings between the log lines of steps `first` and `last` (disable_tqdm: "step N/M"),
    per step, and their places (file:line)."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if re.search(rf"\bstep {first}/\d+", line)), None)
    end = next((i for i, line in enumerate(lines) if re.search(rf"\bstep {last}/\d+", line)), None)
    if start is None or end is None:
        return None, {}
    places = Counter()
    for line in lines[start:end]:
        if SYNC_WARNING in line:
            m = re.search(r"([\w./-]+\.py:\d+): UserWarning", line)
            places[m.group(1).split("site-packages/")[-1].split(str(ROOT) + "/")[-1] if m else "?"] += 1
    return sum(places.values()) / (last - first), dict(places.most_common())


def part_mfu(work: Path, run: dict, base_args: list[str], result: dict, budget: Budget, steps: int) -> None:
    import torch

    rate = matmul_rate()
    result["matmul_bf16_tflops"] = rate / 1e12 if rate else None
    site = work / "syncdebug"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    seq, micro = (2048, 4) if torch.cuda.is_available() else (256, 2)
    variants = {
        "eager": ["--chunked_loss", "false"],
        "chunked_loss": ["--chunked_loss", "true"],
        "compile+chunked_loss": ["--chunked_loss", "true", "--torch_compile", "true"],
    }
    every = max(steps // 3, 1)
    profiled = f"{steps + 1}-{steps + 2}"  # after the measured steps: the profiler slows what it watches
    for name, extra in variants.items():
        if budget.left() < 60:
            result["mfu"][name] = {"status": "SKIPPED: out of time"}
            continue
        args = [
            *base_args,
            "--max_seq_length",
            str(seq),
            "--per_device_train_batch_size",
            str(micro),
            "--max_steps",
            str(steps + 2),
            "--logging_steps",
            str(every),
            "--profile_steps",
            profiled,
            *extra,
        ]
        rows, output, error, wall = launch(f"mfu_{name}", "single", work, args, ("--mixed_precision", "bf16"), env)
        measured = [r for r in train_rows(rows) if r["step"] <= steps]
        tr = measured[1:]  # the first window holds the warm-up (and the compilation)
        summary = work / "runs" / f"mfu_{name}" / "profile" / "summary_0.json"
        profile = json.loads(summary.read_text()) if summary.exists() else None
        syncs, places = syncs_per_step(output, every, steps)
        peak = peak_row(rows)
        compile_s = re.search(r"torch_compile: the first step took ([\d.]+) s", output)
        result["mfu"][name] = {
            "status": error or "ok",
            "wall_s": round(wall, 1),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in tr) if tr else None,
            "step_time_s": statistics.median(r["step_time_s"] for r in tr) if tr else None,
            "data_wait_s": statistics.median(r.get("data_wait_s", 0.0) for r in tr) if tr else None,
            "mfu_vs_989": statistics.median(r["mfu"] for r in tr if r.get("mfu")) if tr and tr[0].get("mfu") else None,
            "peak_gpu_allocated_gb": peak.get("train_peak_gpu_allocated_gb"),
            "estimate_train_peak_gb": peak.get("estimate_train_peak_gb"),
            "compile_first_step_s": float(compile_s.group(1)) if compile_s else None,
            "host_syncs_per_step": syncs,
            "host_sync_places": places,
            "losses": [r["loss"] for r in measured],
            "profile": profile,
        }
        shutil.rmtree(work / "runs" / f"mfu_{name}", ignore_errors=True)
        m = result["mfu"][name]
        if m["mfu_vs_989"] and rate:
            m["mfu_vs_matmul"] = m["mfu_vs_989"] * PEAK_BF16 / rate
        print(f"[gpu_verify] mfu {name}: {json.dumps({k: v for k, v in m.items() if k != 'losses'})}", flush=True)
        if profile:
            print(f"[gpu_verify] {profiling.describe(profile)}", flush=True)


def outcome_of(name: str, rows: list[dict], error: str, wall: float, final: Path) -> tuple[parity.Outcome, dict]:
    """A run's Outcome (losses, the exported weights) and its figures."""
    from safetensors.torch import load_file

    tr = train_rows(rows)
    o = parity.Outcome(name, not error and bool(tr), losses=[r["loss"] for r in tr])
    if o.ok and (final / "model.safetensors").exists():
        o.weights = load_file(str(final / "model.safetensors"))
    peak = peak_row(rows)
    return o, {
        "status": error or ("ok" if tr else "no training rows"),
        "wall_s": round(wall, 1),
        "distributed_type": tr[0].get("distributed_type") if tr else None,
        "compute_dtype": tr[0].get("compute_dtype") if tr else None,
        "exported_dtype": exported_dtypes(final) if final.exists() else None,
        "peak_gpu_allocated_gb": peak.get("train_peak_gpu_allocated_gb"),
        "estimate_train_peak_gb": peak.get("estimate_train_peak_gb"),
        "step_time_s": statistics.median(r["step_time_s"] for r in tr[1:]) if len(tr) > 1 else None,
        "eval_loss": next((r["eval_loss"] for r in reversed(rows) if "eval_loss" in r), None),
        "losses": o.losses,
    }


def base_of(run: dict) -> dict:
    """The base model's weights, as an export names them (a tied head under both names)."""
    base = parity.base_weights(run["model"]) or {}
    if "lm_head.weight" not in base and "model.embed_tokens.weight" in base:  # tied: the export writes both
        base["lm_head.weight"] = base["model.embed_tokens.weight"]
    return base


def part_layouts(
    names: list[str], work: Path, run: dict, base_args: list[str], result: dict, budget: Budget, steps: int
) -> None:
    base = base_of(run)
    ref = REFERENCE.get("single")
    for name in names:
        if budget.left() < (150 if name == "zero3_offload" else 60):
            result["layouts"][name] = {"status": "SKIPPED: out of time"}
            continue
        args = [*base_args, "--max_steps", str(steps)]
        rows, output, error, wall = launch(name, name, work, args, ("--mixed_precision", "bf16"))
        o, entry = outcome_of(name, rows, error, wall, work / "runs" / name / "final")
        if name == "single":
            ref = REFERENCE["single"] = o
        elif ref is not None and ref.ok and o.ok:
            loss, weight, update = parity.compare(ref, o, base)
            entry.update(max_rel_loss_diff=loss, max_abs_weight_diff=weight, update_rel_l2=update)
            entry["within_tolerance"] = bool(
                loss <= BF16_LOSS_RTOL
                and update is not None
                and update <= BF16_UPDATE_RTOL
                and entry["exported_dtype"] == result["layouts"]["single"]["exported_dtype"]
            )
        result["layouts"][name] = entry
        shutil.rmtree(work / "runs" / name, ignore_errors=True)  # a 1B run's checkpoint is 20-26 GB
        print(
            f"[gpu_verify] layout {name}: {json.dumps({k: v for k, v in entry.items() if k != 'losses'})}", flush=True
        )


def part_megatron(work: Path, run: dict, base_args: list[str], result: dict, budget: Budget, steps: int, mlm: str):
    """Megatron-LM through accelerate on this GPU, TP 1 x PP 1 (the shipped megatron_tp2.yaml with one process;
    Megatron-LM from the folder `mlm`, Transformer Engine's layers where it is installed, else the local spec, as
    the log says), without packing (refused there: its GPT step attends across packed examples), against single on
    the same rows: losses, eval loss and the exported HF weights; then a resume from the checkpoint halfway, whose
    later losses must equal the first run's."""
    import torch

    if budget.left() < 180:
        result["megatron"] = {"status": "SKIPPED: out of time"}
        return
    env = {"PYTHONPATH": os.pathsep.join([mlm, os.environ.get("PYTHONPATH", "")])}
    half = max(steps // 2, 1)
    args = [*base_args, "--max_steps", str(steps), "--packing", "false"]
    # a dry run on a CPU (tests/cuda_standin) in fp32: Megatron's bf16 path checks torch.cuda's tensor types
    launch_args = ("--mixed_precision", "bf16" if torch.cuda.is_available() else "no")
    m: dict = {}
    outcomes = {}
    for name, config, more in (("single", "single", []), ("megatron", "megatron_tp2", ["--save_steps", str(half)])):
        rows, output, error, wall = launch(f"megatron_{name}", config, work, [*args, *more], launch_args, env)
        o, m[name] = outcome_of(name, rows, error, wall, work / "runs" / f"megatron_{name}" / "final")
        outcomes[name] = o
        if error:
            m[name]["log_tail"] = output.strip().splitlines()[-15:]
        if name == "megatron":
            impl = re.search(r"transformer_impl \.+ (\w+)", output)  # Megatron's table of its arguments
            m[name]["transformer_impl"] = impl.group(1) if impl else None
        if not o.ok:
            break
    ref, o = outcomes["single"], outcomes.get("megatron")
    if o is not None and ref.ok and o.ok:
        loss, weight, update = parity.compare(ref, o, base_of(run))
        m.update(max_rel_loss_diff=loss, max_abs_weight_diff=weight, update_rel_l2=update)
        m["within_tolerance"] = bool(loss <= BF16_LOSS_RTOL and update is not None and update <= BF16_UPDATE_RTOL)
        checkpoint = work / "runs" / "megatron_megatron" / "checkpoints" / f"step_{half}"
        if checkpoint.is_dir() and budget.left() >= 90:
            again = [*args, "--resume_from_checkpoint", str(checkpoint)]
            rows, _, error, _ = launch("megatron_resume", "megatron_tp2", work, again, launch_args, env)
            later = [r["loss"] for r in train_rows(rows) if r["step"] > half]
            first = parity.Outcome("first", True, losses=o.losses[half:])
            m["resume"] = {
                "status": error or "ok",
                "from": f"step_{half}",
                "losses_after": later,
                "max_rel_loss_diff": parity.compare(first, parity.Outcome("resumed", True, losses=later))[0],
            }
    result["megatron"] = m
    for name in ("megatron_single", "megatron_megatron", "megatron_resume"):
        shutil.rmtree(work / "runs" / name, ignore_errors=True)  # a 1B Megatron checkpoint is ~17 GB
    shown = {k: v for k, v in m.items() if k not in ("single", "megatron")}
    print(f"[gpu_verify] megatron: {json.dumps(shown)}", flush=True)
    for name in ("single", "megatron"):
        if name in m:
            print(f"[gpu_verify]   {name}: {json.dumps({k: v for k, v in m[name].items() if k != 'losses'})}")


def fp16_overflow_seen() -> dict:
    """finetune's optimizer under fp16 (optim.build_optimizer) through accelerate's loss scaler on this device, one
    step whose gradients overflow: accelerate must say it was skipped, and the weights must not move (a fused
    optimizer's skip it does not see: huggingface/accelerate#4242)."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from finetune.config import TrainArgs
    from finetune.optim import build_optimizer

    acc = Accelerator(mixed_precision="fp16")
    try:
        net = torch.nn.Linear(64, 64)
        net, opt = acc.prepare(net, build_optimizer(net, TrainArgs(), "fp16"))
        before = [p.detach().clone() for p in net.parameters()]
        with acc.autocast():
            loss = net(torch.randn(8, 64, device=acc.device)).float().sum() * float("inf")
        acc.backward(loss)
        opt.step()
        return {
            "skip_seen": bool(acc.optimizer_step_was_skipped),
            "weights_unchanged": all(torch.equal(a, p) for a, p in zip(before, net.parameters())),
        }
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def part_fp16(work: Path, base_args: list[str], result: dict, steps: int) -> None:
    import torch

    rows, output, error, wall = launch(
        "fp16", "single", work, [*base_args, "--max_steps", str(steps)], ("--mixed_precision", "fp16")
    )
    tr = train_rows(rows)
    result["fp16"] = {
        "status": error or "ok",
        "compute_dtype": tr[0].get("compute_dtype") if tr else None,
        "losses": [r["loss"] for r in tr],
        "skipped_steps": tr[-1].get("skipped_steps") if tr else None,
        "skip_warnings_in_log": output.count("the fp16 loss scaler skipped the update"),
        "forced_overflow": fp16_overflow_seen() if torch.cuda.is_available() else None,
    }
    print(f"[gpu_verify] fp16: {json.dumps(result['fp16'])}", flush=True)


def part_qlora(work: Path, run: dict, base_args: list[str], result: dict, steps: int) -> None:
    import torch

    args = [
        *base_args,
        "--max_steps",
        str(steps),
        "--learning_rate",
        "1e-3",
        "--peft.method",
        "lora",
        "--peft.load_in_4bit",
        "true",
        "--peft.merge",
        "true",
    ]
    rows, output, error, wall = launch("qlora", "single", work, args, ("--mixed_precision", "bf16"))
    tr = train_rows(rows)
    final = work / "runs" / "qlora" / "final"
    merged = final / "merged"  # peft.merge: the merged model beside the adapter (run.train_and_export)
    q = {
        "status": error or "ok",
        "losses": [r["loss"] for r in tr],
        "adapter_files": sorted(p.name for p in final.glob("*")) if final.exists() else [],
        "merged_files": sorted(p.name for p in merged.glob("*")) if merged.exists() else [],
    }
    result["qlora"] = q
    if error or not final.exists():
        print(f"[gpu_verify] qlora: {json.dumps(q)}", flush=True)
        return
    # Reload: the adapter onto a fresh 4-bit base, and the merged model; the loss on the same packed text.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    tok = AutoTokenizer.from_pretrained(run["model"])
    text = [json.loads(line)["text"] for line in open(run["dataset"])][:8]
    batch = tok(text, return_tensors="pt", padding=True, truncation=True, max_length=512).to("cuda")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    def loss_of(net) -> float:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return float(net(**batch, labels=labels).loss)

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(run["model"], quantization_config=bnb, device_map={"": 0})
    q["reload_base_4bit_loss"] = loss_of(base)
    q["reload_adapter_4bit_loss"] = loss_of(PeftModel.from_pretrained(base, str(final)))
    del base
    if merged.exists():
        net = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.bfloat16).cuda()
        q["reload_merged_loss"] = loss_of(net)
        q["merged_dtype"] = exported_dtypes(merged)
        del net
    else:
        q["status"] = f"no merged model at {merged} (peft.merge true)"
    torch.cuda.empty_cache()
    print(f"[gpu_verify] qlora: {json.dumps(q)}", flush=True)


def versions() -> dict:
    import accelerate
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    out["accelerate"] = accelerate.__version__
    for mod in ("deepspeed", "peft", "bitsandbytes", "datasets"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out[mod] = f"missing ({type(e).__name__})"
    return out


def print_table(result: dict) -> None:
    print(f"\n[gpu_verify] {result['device']}  ({result['model']})")
    head = f"{'layout (1 GPU, bf16)':<22} {'loss rel diff':>13} {'update L2':>9} {'exported':>9} {'peak GB':>8} {'estimate':>8} {'step s':>7}  status"
    print(head + "\n" + "-" * len(head))
    for name, e in result["layouts"].items():
        f = lambda k, fmt, e=e: format(e[k], fmt) if e.get(k) is not None else "-"  # noqa: E731
        print(
            f"{name:<22} {f('max_rel_loss_diff', '.2e'):>13} {f('update_rel_l2', '.3f'):>9} {e.get('exported_dtype') or '-':>9} "
            f"{f('peak_gpu_allocated_gb', '.1f'):>8} {f('estimate_train_peak_gb', '.1f'):>8} {f('step_time_s', '.3f'):>7}  {e['status']}"
        )
    head = f"{'MFU (1 GPU, bf16, packed)':<22} {'tokens/s':>9} {'MFU/989':>8} {'MFU/matmul':>10} {'peak GB':>8} {'syncs/step':>10}  status"
    print("\n" + head + "\n" + "-" * len(head))
    for name, m in result["mfu"].items():
        g = lambda k, fmt, m=m: format(m[k], fmt) if m.get(k) is not None else "-"  # noqa: E731
        print(
            f"{name:<22} {g('tokens_per_s', '.0f'):>9} {g('mfu_vs_989', '.1%'):>8} {g('mfu_vs_matmul', '.1%'):>10} "
            f"{g('peak_gpu_allocated_gb', '.1f'):>8} {g('host_syncs_per_step', '.1f'):>10}  {m['status']}"
        )
    for name, m in result["mfu"].items():
        if m.get("profile"):
            print(f"profile {name}: {profiling.describe(m['profile'])}")
    for part in ("megatron", "fp16", "qlora"):
        if part in result:
            print(f"\n{part}: {json.dumps(result[part])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--parts", default="mfu,layouts,fp16,qlora", help=f"of {', '.join(PARTS)}")
    parser.add_argument("--megatron", help="Megatron-LM's folder (holding megatron/) for --parts megatron")
    parser.add_argument("--layouts", default=LAYOUTS, help="shipped configs, single first (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per layout run")
    parser.add_argument("--mfu_steps", type=int, default=12)
    parser.add_argument("--budget_s", type=float, default=470, help="parts not started by then are skipped")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "gpu_verify"))
    parser.add_argument("--results", default=str(ROOT / "bench" / "results" / "gpu.json"))
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))} ({', '.join(PARTS)})")
    if "megatron" in parts and not os.path.isdir(os.path.join(args.megatron or "", "megatron")):
        parser.error("--parts megatron needs --megatron: a Megatron-LM folder holding megatron/ (docs/megatron.md)")
    global BUDGET
    budget = BUDGET = Budget(args.budget_s)

    import torch

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor()})"
    result = {
        "command": " ".join(sys.argv),
        "device": device,
        "versions": versions(),
        "model": f"Llama {args.size} from config",
        "layouts": {},
        "mfu": {},
    }

    def save() -> None:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(result, indent=1, default=str))

    t0 = time.perf_counter()
    run = build(work, args.size)
    result["build_s"] = round(time.perf_counter() - t0, 1)
    save()
    base_args = ["--config", str(work / "run.yaml")]
    cuda = torch.cuda.is_available()
    layouts = args.layouts.split(",")
    offloaded = [name for name in layouts if "offload" in name]  # DeepSpeed compiles its CPU Adam on first use
    layout_args = (work, run, base_args, result, budget, args.steps)
    runs = {  # part: (runs it, needs seconds left; None: not on this machine)
        "layouts": (lambda: part_layouts([n for n in layouts if n not in offloaded], *layout_args), 0),
        "mfu": (lambda: part_mfu(work, run, base_args, result, budget, args.mfu_steps), 0),
        "fp16": (lambda: part_fp16(work, base_args, result, 8), 40 if cuda else None),
        "qlora": (lambda: part_qlora(work, run, base_args, result, 10), 60 if cuda else None),
        "megatron": (lambda: part_megatron(work, run, base_args, result, budget, args.steps, args.megatron), 0),
        "offloaded layouts": (lambda: part_layouts(offloaded, *layout_args), 0),  # a minute or two: last
    }
    order = [*parts, "offloaded layouts"] if "layouts" in parts else parts
    for part in order:
        fn, needs = runs[part]
        if needs is None or budget.left() < needs:
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one part's failure is a finding; the others still run
            import traceback

            traceback.print_exc()
            result.setdefault("errors", {})[part] = f"{type(e).__name__}: {e}"
        save()
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
