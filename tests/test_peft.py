"""PEFT: LoRA/DoRA under every backend, adapters never empty, reload, merge, resume."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    ROOT,
    assert_layout,
    base_args,
    classification_args,
    crash_after,
    finetune,
    max_rel_diff,
    max_tensor_diff,
    max_weight_diff,
    reevaluate,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
LORA = ["--peft.method", "lora", "--peft.r", "4", "--peft.alpha", "8"]


def check_adapter(final, r: int, hidden: int = 64) -> dict[str, torch.Tensor]:
    """Adapter tensors are present, non-empty and shaped (r, in) / (out, r); a mixture of experts' fused experts
    (3D parameters, peft's ParamWrapper) r per expert, 2r for gate_up_proj: a multiple of r."""
    tensors = load_file(str(final / "adapter_model.safetensors"))
    lora = {k: v for k, v in tensors.items() if "lora_" in k}
    assert lora, list(tensors)
    for k, v in lora.items():
        assert v.numel() > 0, k
        if "lora_A" in k or "lora_B" in k:  # (DoRA's lora_magnitude_vector: one value per output)
            rank = v.shape[0] if "lora_A" in k else v.shape[1]
            assert (rank % r == 0 if ".mlp.experts." in k else rank == r) and v.numel() > rank, (k, v.shape)
    assert any("q_proj.lora_A" in k and tuple(v.shape) == (r, hidden) for k, v in lora.items())
    return tensors


def test_lora_causal_lm_same_under_every_backend(assets, tmp_path):
    """single, ZeRO-1, ZeRO-2 with CPU offload, ZeRO-3, ZeRO-3 with CPU offload, FSDP2 (gradient checkpointing on;
    ZeRO-1 and ZeRO-3 offload with FINETUNE_CONFIG_GRID=1):
    same losses, the same non-empty adapters (ZeRO-3 and FSDP2 shard the frozen base and gather the adapter; ZeRO-1/2
    hold the model whole, as DDP does, and partition the adapter's optimizer states; offload steps the adapter with
    DeepSpeed's CPU Adam). DDP's adapter: test_resume_layouts' adapter chain, weights against one process's.
    Parity runs from the user's folder, with every path relative to it (the config, the model and data in it,
    output_dir; the runs started in the project root: 'file ... does not exist'), and reads the overrides as
    `finetune` does (a bare boolean, --key=value: it paired them two by two). The model is a mixture of experts
    (Qwen3-MoE, 4 experts; its second layer dense): all-linear adapts the experts, which transformers keeps as 3D
    parameters (mlp.experts.gate_up_proj), through peft's parameter targeting, beside the linears."""
    from finetune import demo

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1])
    base_model = demo.build_model("qwen3_moe", tmp_path / "qwen3_moe", assets.tokenizer, **moe)
    run = tmp_path / "lora.yaml"
    run.write_text(
        json.dumps(
            {
                "model": os.path.relpath(base_model, tmp_path),
                "dataset": os.path.relpath(assets.instruction, tmp_path),
                "max_seq_length": 64,
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 1,
                "learning_rate": 1e-2,
                "eval_fraction": 0.1,
                "peft": {"method": "lora", "r": 4, "alpha": 8},
                "curves": False,
            }
        )
    )
    out = tmp_path / "parity"
    layouts = ("single", "zero1", "zero2_offload", "zero3", "zero3_offload", "fsdp2")
    if not os.environ.get("FINETUNE_CONFIG_GRID"):  # suite time (about 25 s): ZeRO-1 partitions the adapter's moments
        layouts = ("single", "zero2_offload", "zero3", "fsdp2")  # as ZeRO-2 does; ZeRO-3 offload is both of these
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune",
            "parity",
            "--config",
            run.name,
            "--steps",
            "5",
            "--configs",
            ",".join(layouts),
            "--output_dir",
            out.name,
            "--",
            "--gradient_checkpointing",
            "--run_name=lora-parity",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    losses, adapters = {}, {}
    for name in layouts:
        said = yaml.safe_load((out / name / "run_config.yaml").read_text())
        assert (said["gradient_checkpointing"], said["run_name"]) == (True, "lora-parity"), name
        adapters[name] = check_adapter(out / name / "final", r=4)
        adapter_config = json.loads((out / name / "final" / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == base_model, name  # given relative: merge from anywhere
        assert "trainable (" in (out / f"{name}.log").read_text()
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "loss" in r]
        assert_layout(train, name, every_row=True)
        losses[name] = [r["loss"] for r in train]
    # the exported adapters equal one process's (computed here from the files), and training moved them
    base = adapters["single"]
    assert any(v.abs().max() > 0 for k, v in base.items() if "lora_B" in k)  # B starts at zero
    assert any(".mlp.experts." in k and "lora_B" in k and v.abs().max() > 0 for k, v in base.items()), list(base)
    for name, tensors in adapters.items():
        assert max_tensor_diff(base, tensors) <= 1e-5, name
    # Facts about the model are counted once, before prepare, the same under every backend (MFU's reference)
    flops = {
        name: re.search(r"trainable \([\d.]+%\), (.+FLOPs per token.*)", (out / f"{name}.log").read_text())[1]
        for name in layouts
    }
    assert len(set(flops.values())) == 1, flops
    for name, values in losses.items():  # computed here, not taken from parity's verdict
        assert max_rel_diff(losses["single"], values) <= 1e-5, (name, losses)
    # The ZeRO-3 adapter reloads on the base model and gives its final eval loss again.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = out / "zero3" / "final"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), final)
    rows = [json.loads(line) for line in (out / "zero3" / "metrics.jsonl").read_text().splitlines()]
    again = reevaluate(model, AutoTokenizer.from_pretrained(final), assets.instruction, "causal_lm")
    assert again["eval_loss"] == pytest.approx([r for r in rows if "eval_loss" in r][-1]["eval_loss"], rel=1e-5)
    # finetune merge folds the experts' adapter in too: the merged model's logits are the adapted model's, and its
    # file holds each expert's own linears, as the base model's does
    from finetune.export import merge_adapter

    merged = AutoModelForCausalLM.from_pretrained(merge_adapter(str(final), str(tmp_path / "merged")))
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, model.eval()(ids).logits, atol=1e-5)
    expected = set(load_file(os.path.join(base_model, "model.safetensors")))
    assert set(load_file(str(tmp_path / "merged" / "model.safetensors"))) == expected


def test_lora_classifier_saves_head_and_reloads(assets, tmp_path):
    """The classifier head (trained in full beside the adapter, under ZeRO-3: gathered from its shards) is saved
    with it; the reloaded adapter reproduces the run's eval loss, and so does the model card's loading snippet;
    `finetune merge` then makes one plain model of it. The tokenizer in final/ cuts nothing (the run's tokenizing
    cut the rows at max_seq_length with transformers' truncation, which stays set on the Rust tokenizer)."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = tmp_path / "cls_train.jsonl"  # a path of its own: tokenized by this run, not read from the datasets cache
    shutil.copy(assets.classification, data)
    args = classification_args(assets.llama, assets)
    args[args.index(assets.classification)] = str(data)
    res = finetune(
        tmp_path / "zero3",
        *args,
        "--max_steps",
        "4",
        "--per_device_train_batch_size",
        "8",
        "--max_seq_length",
        "32",
        "--learning_rate",
        "1e-2",
        "--save_steps",
        "null",
        *LORA,
        launcher="zero3",
    )
    final = res.output_dir / "final"
    tensors = check_adapter(final, r=4)
    head = [k for k in tensors if "score" in k]
    assert head and all(tensors[k].shape[0] == 4 for k in head), head  # 4 classes, saved with the adapter
    labels = ["food", "sports", "tech", "weather"]
    base = AutoModelForSequenceClassification.from_pretrained(
        assets.llama, num_labels=4, id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)}
    )
    model = PeftModel.from_pretrained(base, final)
    tok = AutoTokenizer.from_pretrained(final)
    base.config.pad_token_id = tok.pad_token_id
    again = reevaluate(
        model, tok, assets.classification, "classification", max_seq_length=32, eval_dataset=assets.classification_eval
    )
    assert again["eval_loss"] == pytest.approx(res.eval_rows[-1]["eval_loss"], rel=1e-5)
    saved = json.loads((final / "tokenizer.json").read_text())
    assert saved["truncation"] is None and saved["padding"] is None
    card = card_snippet(final)
    assert card["model"].config.id2label == dict(enumerate(labels))
    ids = torch.randint(3, 500, (2, 16))
    with torch.no_grad():
        assert (card["model"](input_ids=ids).logits - model(input_ids=ids).logits).abs().max().item() == 0
    check_merge_command(final, assets.llama, tmp_path)


def card_snippet(final) -> dict:
    """The names that the model card's "How to load it" Python defines, run against final/ (its placeholder path)."""
    text = (final / "README.md").read_text()
    code = text.split("## How to load it", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    names: dict = {}
    exec(code.replace("'path/to/final'", repr(str(final))), names)
    return names


def check_merge_command(final, base_model: str, tmp_path):
    """`finetune merge` on a classifier adapter: one plain model with the labels, equal to adapter + base."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "merge", str(final)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = AutoModelForSequenceClassification.from_pretrained(final / "merged")
    assert merged.config.id2label == {0: "food", 1: "sports", 2: "tech", 3: "weather"}
    base = AutoModelForSequenceClassification.from_pretrained(base_model, num_labels=4)
    adapter = PeftModel.from_pretrained(base, final)
    ids = torch.randint(3, 500, (2, 16))
    with torch.no_grad():
        assert (adapter(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item() <= 1e-5
    bad = subprocess.run(
        [sys.executable, "-m", "finetune", "merge", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "adapter_config.json" in bad.stderr


def test_dora_and_merge_under_zero3_and_fsdp2(assets, tmp_path):
    """DoRA under ZeRO-3 and FSDP2 (parameters sharded both ways): the same losses, non-empty adapters, and
    each merged model computes what base + adapter computes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    args = base_args(
        assets.llama, assets.instruction, "--max_steps", "4", "--learning_rate", "1e-2", "--eval_fraction", "0.1"
    )
    dora = ["--peft.method", "dora", "--peft.r", "4", "--peft.merge", "true"]
    runs = {launcher: finetune(tmp_path / launcher, *args, *dora, launcher=launcher) for launcher in ("zero3", "fsdp2")}
    assert runs["zero3"].train_rows[-1]["zero_stage"] == 3 and runs["fsdp2"].train_rows[-1]["fsdp_version"] == 2
    a, b = runs["zero3"].losses(), runs["fsdp2"].losses()
    assert max_rel_diff(a, b) <= 1e-5, (a, b)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(assets.llama)
    for launcher, res in runs.items():
        final = res.output_dir / "final"
        tensors = check_adapter(final, r=4)
        assert any("lora_magnitude_vector" in k for k in tensors), launcher  # DoRA's magnitudes were saved
        merged = AutoModelForCausalLM.from_pretrained(final / "merged")
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets.llama), final)
        with torch.no_grad():
            x, y = adapter(input_ids=ids).logits, merged(input_ids=ids).logits
            assert (x - y).abs().max().item() <= 1e-5, launcher
            assert (base(input_ids=ids).logits - y).abs().max().item() > 1e-4  # the adapter did something


def test_adapter_resume_equals_uninterrupted(assets, tmp_path):
    args = [
        *base_args(
            assets.llama,
            assets.chat,
            "--max_steps",
            "4",
            "--save_steps",
            "2",
            "--eval_fraction",
            "0.1",
            "--learning_rate",
            "1e-2",
        ),
        *LORA,
    ]
    straight = finetune(tmp_path / "straight", *args)  # across layouts: tests/test_resume_layouts.py
    part = tmp_path / "part"
    shutil.copytree(straight.output_dir, part)
    crash_after(part, 2)
    resumed = finetune(part, *args, "--resume_from_checkpoint", "latest")
    assert [r["step"] for r in resumed.train_rows] == [1, 2, 3, 4]
    assert max_rel_diff(straight.losses(), resumed.losses()) <= 1e-6
    assert max_weight_diff(straight.output_dir / "final", part / "final", "adapter_model.safetensors") <= 1e-6


@pytest.fixture(scope="module")
def lora_run(assets, tmp_path_factory):
    """A LoRA run of the tiny Llama (one process, 2 steps, a checkpoint at the end) that merges at its end
    (peft.merge); tests only read its output_dir."""
    args = base_args(assets.llama, assets.instruction, "--max_steps", "2", "--eval_fraction", "0", "--save_steps", "2")
    return finetune(tmp_path_factory.mktemp("lora_run") / "run", *args, *LORA, "--peft.merge", "true")


def test_an_adapter_runs_checkpoint_is_refused_as_a_model_and_its_adapter_exported_by_a_resume(lora_run, tmp_path):
    """An adapter run's checkpoint holds its base's weights under PEFT's names (base_model.model.*) beside the
    adapter's: from_pretrained uses none of them and draws every weight anew (said in one log line), so naming it
    as a run's model is refused at the edge (test_bad_inputs' model_is_an_adapter_runs_checkpoint, launched). When
    the first assertion fails, transformers reads such a checkpoint: look again at the refusal. The way on it names:
    resumed into a new output_dir with max_steps at its step, a run trains nothing and its final/ is the
    checkpoint's adapter."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune.config.preflight import model_dir_problems

    checkpoints = sorted((lora_run.output_dir / "checkpoints").glob("step_*"))
    assert checkpoints
    net, info = AutoModelForCausalLM.from_pretrained(checkpoints[-1], output_loading_info=True)
    assert {n for n, _ in net.named_parameters()} <= set(info["missing_keys"]), info
    problems = model_dir_problems(str(checkpoints[-1]), 64, "causal_lm")
    assert [k for k, _ in problems] == ["model"] and "is a checkpoint of an adapter run" in problems[0][1], problems
    config, step = lora_run.output_dir / "run_config.yaml", checkpoints[-1].name.removeprefix("step_")
    export = finetune(tmp_path / "export", "--config", str(config), "--resume_from_checkpoint", str(checkpoints[-1]),
                      "--max_steps", step, "--peft.merge", "false", expect_ok=False)  # fmt: skip
    assert export.returncode == 0 and not export.train_rows, export.output[-3000:]  # (no rows: conftest's check)
    ours = load_file(str(export.output_dir / "final" / "adapter_model.safetensors"))
    theirs = load_file(str(lora_run.output_dir / "final" / "adapter_model.safetensors"))
    assert ours and ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_continue_from_existing_adapter(assets, lora_run, tmp_path):
    second = finetune(
        tmp_path / "second",
        *base_args(assets.llama, assets.instruction, "--max_steps", "2", "--eval_fraction", "0"),
        "--peft.method",
        "lora",
        "--peft.adapter",
        str(lora_run.output_dir / "final"),
    )
    assert second.losses()[0] < lora_run.losses()[0]  # starts where the first run left off
    check_adapter(second.output_dir / "final", r=4)


def test_merge_refuses_a_base_model_with_other_weights(assets, lora_run, tmp_path, capsys, caplog):
    """An adapter merged into a model of the same architecture and shapes but other weights (one trained on
    Llama-3.1-8B-Instruct into Llama-3.1-8B) fits every module: the merge wrote a silently wrong model. The run's
    final/ now holds base_model.json, a fingerprint of the base model's files (finetune/fingerprint.py), and `finetune
    merge` refuses a base whose weights differ: exit 2 naming --base_model, the base the adapter was trained on and
    --allow_other_base, nothing written. The same weights pass re-saved in shards or in bfloat16 (the same at
    bfloat16 precision), and so does the run's own merge (peft.merge); --allow_other_base merges into other weights
    on purpose; a base saved only as pytorch_model.bin merges, said not verified. A run continuing the adapter
    (peft.adapter) on other weights says so at start."""
    from transformers import AutoModelForCausalLM

    from finetune import demo
    from finetune.commands.merge import main as merge

    final = lora_run.output_dir / "final"
    said = json.loads((final / "base_model.json").read_text())
    base_file = load_file(str(Path(assets.llama) / "model.safetensors"))
    assert said["base_model"] == assets.llama and said["tensors"].keys() == base_file.keys(), said
    assert said["tensors"]["model.embed_tokens.weight"].startswith(f"{len(assets.tokenizer)}x64:"), said
    marker = json.loads((final / "merged" / "finetune_merge.json").read_text())
    assert marker["base_weights"] == f"the weights the adapter was trained on ({len(base_file)} tensors compared)"

    net = AutoModelForCausalLM.from_pretrained(assets.llama)
    copies = {"sharded": (tmp_path / "sharded", torch.float32), "bf16": (tmp_path / "bf16", torch.bfloat16)}
    for name, (path, dtype) in copies.items():
        net.to(dtype).save_pretrained(path, max_shard_size="200KB" if name == "sharded" else "50GB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    other = demo.build_model("llama", tmp_path / "other", assets.tokenizer, seed=1)  # the same shapes
    before = {p: p.read_bytes() for p in lora_run.output_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert merge([str(final), "--base_model", other, "--output", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert f"  - --base_model: the weights of the base model {other!r} are not the ones the adapter in" in err, err
    assert f"was trained on ({assets.llama!r}, fingerprinted in its base_model.json): " in err, err
    assert "tensors compared differ (e.g. " in err and "give --base_model that model's directory or Hub id" in err
    assert "add --allow_other_base" in err and "Traceback" not in err, err
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".merging-*"))
    # continued on those other weights (peft.adapter), the adapter trains on, as asked, said at start
    from finetune.config import PeftArgs
    from finetune.model import apply_peft

    for base, warned in ((other, True), (assets.llama, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="finetune"):
            apply_peft(AutoModelForCausalLM.from_pretrained(base), PeftArgs(method="lora", adapter=str(final)), "x")
        said = f"peft.adapter {final} was trained on other weights than the model's, {other} ("
        assert (said in caplog.text) == warned and (f"its base: {assets.llama})" in caplog.text) == warned, base

    for name, base in (("sharded", tmp_path / "sharded"), ("bf16", tmp_path / "bf16"), ("other", other)):
        flag = ["--allow_other_base"] if name == "other" else []
        assert merge([str(final), "--base_model", str(base), "--output", str(tmp_path / name / "m"), *flag]) == 0
        note = json.loads((tmp_path / name / "m" / "finetune_merge.json").read_text())["base_weights"]
        assert f"base model weights: {note}" in capsys.readouterr().out
        if name == "other":
            assert note.startswith(f"not the weights the adapter was trained on ({assets.llama}): "), note
            assert note.endswith("; merged with allow_other_base"), note
        else:
            assert note == f"the weights the adapter was trained on ({len(base_file)} tensors compared)", name
    assert {p: p.read_bytes() for p in lora_run.output_dir.rglob("*") if p.is_file()} == before

    bin_only = tmp_path / "bin_only"  # no safetensors to read a fingerprint from
    shutil.copytree(assets.llama, bin_only, ignore=shutil.ignore_patterns("model.safetensors"))
    torch.save(base_file, bin_only / "pytorch_model.bin")
    assert merge([str(final), "--base_model", str(bin_only), "--output", str(tmp_path / "mb")]) == 0
    note = json.loads((tmp_path / "mb" / "finetune_merge.json").read_text())["base_weights"]
    assert note.startswith(f"not verified: no fingerprint of {str(bin_only)!r}: no model.safetensors"), note


def test_qlora_refused_without_cuda(assets, tmp_path):
    res = finetune(
        tmp_path / "q",
        *base_args(assets.llama, assets.instruction, "--max_steps", "2"),
        *LORA,
        "--peft.load_in_4bit",
        "true",
        launcher="python",
        expect_ok=False,
    )
    assert res.returncode == 2 and "peft.load_in_4bit" in res.output and "CUDA" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "q").exists()


def test_qlora_is_refused_where_its_4_bit_weights_would_be_sharded(monkeypatch):
    """peft.load_in_4bit under FSDP2 (accelerate leaves bitsandbytes' packed weights whole on every rank; the full
    state dict cannot gather them) and ZeRO-3 (a quantized model loads without its partitioned start): refused by
    the family's own checks (the launch's environment, the shipped DeepSpeed JSONs), naming the key and the configs
    that run it. ZeRO-2 and DDP take it. (On a CPU the run refuses 4-bit for the missing GPU first.)"""
    from finetune.config import build_config
    from finetune.parallel import deepspeed, fsdp

    def refusal(family, env: dict) -> list[str]:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        qlora = {"model": "m", "dataset": "d.jsonl", "peft": {"method": "lora", "load_in_4bit": True}}
        found = [fix for key, fix in family.problems(build_config(qlora, check_filesystem=False))]
        plain = build_config({**qlora, "peft": {"method": "lora"}}, check_filesystem=False)
        assert not [key for key, _ in family.problems(plain) if key == "peft.load_in_4bit"]
        return [fix for fix in found if "QLoRA" in fix]

    (fsdp2,) = refusal(fsdp, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    assert "under FSDP2" in fsdp2 and "ddp.yaml" in fsdp2
    ds = ROOT / "ds_configs"
    for name, refused in (("zero3.json", True), ("zero3_offload.json", True), ("zero2.json", False)):
        found = refusal(
            deepspeed, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds / name)}
        )
        assert bool(found) == refused, (name, found)
        assert not found or ("under ZeRO-3" in found[0] and "zero2.yaml" in found[0])


def test_qlora_layers_compute_in_the_runs_precision():
    """QLoRA's 4-bit layers compute in the run's mixed precision (they were bf16 whatever it was: an fp32 run on a
    GPU without bf16 emulated it, and the precision probe said fp32): the quantization from_pretrained is given.
    The model card says the adapter learned against 4-bit weights."""
    from finetune import model
    from finetune.config import build_config
    from finetune.report import RunFacts, card

    qlora = {"model": "m", "dataset": "d.jsonl", "peft": {"method": "lora", "load_in_4bit": True}}
    cfg = build_config(qlora, check_filesystem=False)
    compute = {
        precision: model._load_kwargs(cfg.model, cfg.peft, None, precision)["quantization_config"]
        for precision in ("no", "bf16", "fp16")
    }
    assert {k: q.bnb_4bit_compute_dtype for k, q in compute.items()} == {
        "no": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
    }
    assert all(q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" for q in compute.values())
    said = card._hyperparameters(cfg, RunFacts(), steps=10)
    assert said["base weights in training"] == "4-bit NF4 (bitsandbytes, QLoRA)"
    lora = build_config({**qlora, "peft": {"method": "lora"}}, check_filesystem=False)
    assert "base weights in training" not in card._hyperparameters(lora, RunFacts(), steps=10)


def test_an_adapter_is_not_merged_into_a_base_stored_quantized(assets, tmp_path):
    """A base model stored quantized (a *-bnb-4bit release: its config.json names a quantization_config) cannot
    take a merge: the merged weights would be quantized again and could not be saved in full precision. A run
    asking for one (peft.merge) is refused before its weights load, and `finetune merge` of an adapter on such a
    base, each naming the key, the model and what to do; exit 2, no traceback."""
    quantized = tmp_path / "llama-bnb-4bit"
    shutil.copytree(assets.llama, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (quantized / "config.json").write_text(json.dumps(config))
    res = finetune(
        tmp_path / "run",
        *base_args(
            str(quantized), assets.instruction, "--max_steps", "2", "--peft.method", "lora", "--peft.merge", "true"
        ),
        expect_ok=False,
    )
    assert res.returncode == 2 and "Traceback" not in res.output, res.output[-3000:]
    assert "peft.merge" in res.output and "stored quantized (bitsandbytes)" in res.output, res.output[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(quantized)}))
    merge = subprocess.run(
        [sys.executable, "-m", "finetune", "merge", str(adapter)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert merge.returncode == 2 and "Traceback" not in merge.stderr, merge.stderr[-3000:]
    assert "stored quantized (bitsandbytes)" in merge.stderr and not (adapter / "merged").exists()


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_a_classifier_adapter_keeps_every_newly_initialised_layer(assets, tmp_path, arch):
    """A base checkpoint without the classifier's extra layers (BERT's pooler, saved from BertForMaskedLM;
    DistilBERT's pre_classifier): LoRA trains them in full and saves them with the adapter, so the reloaded adapter
    and its merge are the model trained (frozen, they stayed random and every reload drew them anew). DistilBERT's
    pre_classifier under all-linear also crashed PEFT (LoRA on it, then matched as the `classifier` to save)."""
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoModelForSequenceClassification

    from finetune.config import ModelArgs, PeftArgs
    from finetune.export import merge_adapter
    from finetune.model import build_model

    sizes = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    if arch == "distilbert":
        sizes = {"dim": 32, "n_layers": 1, "n_heads": 2, "hidden_dim": 64}
    config = AutoConfig.for_model(arch, vocab_size=len(assets.tokenizer), **sizes)
    base = str(tmp_path / arch)
    AutoModelForMaskedLM.from_config(config).save_pretrained(base)  # no pooler, no pre_classifier
    assets.tokenizer.save_pretrained(base)
    labels = ["a", "b", "c"]
    pe = PeftArgs(method="lora", r=4, alpha=8)
    torch.manual_seed(0)
    net = build_model(ModelArgs(model=base, task="classification"), assets.tokenizer, labels, 32, pe)
    new = {"bert": "bert.pooler", "distilbert": "pre_classifier"}[arch]
    trained = [n for n, p in net.named_parameters() if p.requires_grad and new in n]
    assert trained, [n for n, p in net.named_parameters() if p.requires_grad]
    with torch.no_grad():  # as training leaves them: the adapter and the extra layers moved
        for p in net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    net.eval()
    out = tmp_path / "adapter"
    net.save_pretrained(out)
    assets.tokenizer.save_pretrained(out)
    (out / "labels.json").write_text(json.dumps(labels))
    ids = torch.randint(3, len(assets.tokenizer), (2, 12))
    with torch.no_grad():
        want = net(input_ids=ids).logits
        torch.manual_seed(1)  # another draw for whatever the reload initialises afresh
        reloaded = AutoPeftModelForSequenceClassification.from_pretrained(out, num_labels=3).eval()
        assert (reloaded(input_ids=ids).logits - want).abs().max().item() <= 1e-5
        merged = AutoModelForSequenceClassification.from_pretrained(merge_adapter(str(out), str(tmp_path / "m"))).eval()
        assert (merged(input_ids=ids).logits - want).abs().max().item() <= 1e-5


def test_an_adapter_names_a_local_base_model_by_its_absolute_path(assets, tmp_path, monkeypatch):
    """final/adapter_config.json said base_model_name_or_path as the run was given it (demo/base_model), so `finetune
    merge` from another folder failed ("could not load the base model from 'demo/base_model' ... Hub is
    unreachable"). export writes a local one's absolute path; a Hub id stays a Hub id."""
    from finetune.export import absolute_base_model

    monkeypatch.chdir(Path(assets.llama).parent)
    for given, recorded in ((Path(assets.llama).name, assets.llama), ("someorg/a-model", "someorg/a-model")):
        (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": given, "r": 4}))
        absolute_base_model(str(tmp_path))
        config = json.loads((tmp_path / "adapter_config.json").read_text())
        assert config == {"base_model_name_or_path": recorded, "r": 4}


def test_merge_never_replaces_what_it_did_not_write(assets, tmp_path, capsys, monkeypatch):
    """`finetune merge` replaces only a previous merge: ADAPTER/merged as it stands, another --output with
    --overwrite. It removed whatever --output held (a user's files, the adapter itself) and then wrote there. A base
    model that is no longer where adapter_config.json says, a Hub id neither cached nor reachable, a directory without
    weights: exit 2 naming base_model_name_or_path and the fix, --base_model first (it was an OSError traceback, then
    a fix naming the run config's model, then only editing adapter_config.json by hand). Every refusal leaves every
    file as it was."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.commands.merge import main as merge

    adapter = tmp_path / "final"
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(assets.llama), LoraConfig(r=2, init_lora_weights=False))
    lora.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(assets.llama).save_pretrained(adapter)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "a_file").write_text("mine too")

    def files() -> dict:
        return {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}

    assert merge([str(adapter)]) == 0
    merged = adapter / "merged" / "model.safetensors"
    first = merged.stat().st_mtime_ns
    assert merge([str(adapter)]) == 0 and merged.stat().st_mtime_ns != first  # the default place: replaced
    assert merge([str(adapter), "--output", str(tmp_path / "m")]) == 0
    before = files()
    refused = [
        [str(adapter), "--output", str(tmp_path / "m")],  # a previous merge, without --overwrite
        [str(adapter), "--output", str(mine), "--overwrite"],  # never a user's files
        [str(adapter), "--output", str(adapter), "--overwrite"],  # nor the adapter
        [str(adapter), "--output", str(tmp_path), "--overwrite"],  # nor a folder holding it
        [str(adapter), "--output", str(tmp_path / "a_file")],
    ]
    capsys.readouterr()
    for args in refused:
        assert merge(args) == 2, args
        assert "- --output:" in capsys.readouterr().err
    assert files() == before
    assert merge([str(adapter), "--output", str(tmp_path / "m"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "m" / "finetune_merge.json").read_text())["adapter"] == str(adapter)
    assert load_file(str(tmp_path / "m" / "model.safetensors")).keys() == load_file(str(merged)).keys()

    moved = tmp_path / "moved"
    shutil.copytree(adapter, moved, ignore=shutil.ignore_patterns("merged"))
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert merge([str(moved)]) == 2 and not (moved / "merged").exists()
    err = capsys.readouterr().err
    assert "base_model_name_or_path" in err and str(tmp_path / "gone") in err and "Traceback" not in err
    assert err.startswith("finetune: 1 problem in what finetune merge was given:"), err
    assert "give the base model's directory (or Hub id) with --base_model (or set it there)" in err, err

    config["base_model_name_or_path"] = "someorg/a-model-not-in-the-cache"  # a Hub id, offline and not cached
    (moved / "adapter_config.json").write_text(json.dumps(config))
    assert merge([str(moved)]) == 2 and not (moved / "merged").exists()  # was an OSError traceback
    err = capsys.readouterr().err
    assert "base_model_name_or_path in" in err and "someorg/a-model-not-in-the-cache" in err and "Hub" in err, err
    # the fix is the adapter's key, not the run config's model: a local copy there, or the Hub reachable
    assert "the Hub is offline (HF_HUB_OFFLINE): give a local copy of the base model" in err, err
    assert "with --base_model (or set it there)" in err, err
    assert "merge with HF_HUB_OFFLINE unset where the Hub is reachable" in err, err
    no_weights = tmp_path / "config_only"  # a base directory without weights: was 'point model at ...'
    no_weights.mkdir()
    shutil.copy(Path(assets.llama) / "config.json", no_weights)
    config["base_model_name_or_path"] = str(no_weights)
    (moved / "adapter_config.json").write_text(json.dumps(config))
    assert merge([str(moved)]) == 2 and not (moved / "merged").exists()
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "give a directory saved with save_pretrained with --base_model" in err, err
    assert "point model" not in err and "Traceback" not in err, err

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails, as without finetune[peft]
    assert merge([str(adapter)]) == 2  # was a ModuleNotFoundError traceback
    err = capsys.readouterr().err
    assert "  - adapter: needs the peft package: pip install 'finetune[peft]'" in err and "Traceback" not in err, err


def lora_adapter(base_model: str, directory: Path) -> Path:
    """A LoRA adapter of base_model (q_proj and v_proj, r 2, B not zero: the merge changes the weights) saved as
    finetune saves one: task_type, the tokenizer, and the run config naming the model it trained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=8, init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(AutoModelForCausalLM.from_pretrained(base_model), config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(base_model).save_pretrained(directory)
    (directory / "run_config.yaml").write_text(yaml.safe_dump({"model": base_model, "peft": {"method": "lora"}}))
    return directory


def merged_by_hand(base_model: str, adapter: Path) -> dict[str, torch.Tensor]:
    """The base's weights with the adapter merged in, from the two safetensors: W + (alpha / r) B A."""
    weights = load_file(str(Path(base_model) / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    for key in [k for k in lora if ".lora_A." in k]:
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[name] = weights[name] + scale * lora[key.replace(".lora_A.", ".lora_B.")] @ lora[key]
    return weights


def test_the_fingerprint_of_a_hub_model_is_read_from_the_local_cache(assets, tmp_path, monkeypatch):
    """A run of a Hub id records the fingerprint of its files in the local Hugging Face cache (a lookup, never a
    download: HF_HUB_OFFLINE here), the same as a local copy's; a Hub id not in the cache has none, and says it may
    come (found False: a merge looks again once the load has downloaded it)."""
    from huggingface_hub import constants

    from finetune import fingerprint

    repo = tmp_path / "hub" / "models--someorg--tiny-llama"
    shutil.copytree(assets.llama, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    fingerprint.record(str(tmp_path), "someorg/tiny-llama")
    said = json.loads((tmp_path / fingerprint.BASE_FILE).read_text())
    assert said["base_model"] == "someorg/tiny-llama" and len(said["tensors"]) == 21, said
    assert fingerprint.check(str(tmp_path), assets.llama).same is True
    missing = fingerprint.check(str(tmp_path), "someorg/not-cached")
    assert (missing.same, missing.found) == (None, False), missing
    assert "no model.safetensors or complete model.safetensors.index.json for it in the local Hugging Face cache" in (
        missing.note
    )


def test_merge_into_a_base_model_given_with_base_model(assets, tmp_path):
    """An adapter whose adapter_config.json names a base model that is not here (trained on another machine): `finetune
    merge --base_model` merges it into a copy of that base in another directory, with the weights of a merge into the
    original (computed here from the two safetensors); finetune_merge.json names the base used, the adapter directory
    is left byte for byte as it was, and the default dtype (auto here: no save_dtype in the run config) is the given
    base's own. Without --base_model the only fix was editing adapter_config.json by hand."""
    from finetune.commands.merge import main as merge

    adapter = lora_adapter(assets.llama, tmp_path / "final")
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/on/another/machine/llama"
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    base = tmp_path / "models" / "llama"
    shutil.copytree(assets.llama, base)
    before = {p: p.read_bytes() for p in adapter.rglob("*") if p.is_file()}
    assert merge([str(adapter), "--base_model", str(base), "--output", str(tmp_path / "m")]) == 0
    merged = load_file(str(tmp_path / "m" / "model.safetensors"))
    want = merged_by_hand(assets.llama, adapter)
    assert max_tensor_diff(merged, want) <= 1e-6
    assert any((merged[k] - load_file(str(base / "model.safetensors"))[k]).abs().max() > 1e-3 for k in merged)
    marker = json.loads((tmp_path / "m" / "finetune_merge.json").read_text())
    not_verified = "not verified: the adapter records no fingerprint of its base model's weights (no base_model.json"
    assert marker.pop("base_weights").startswith(not_verified), marker  # lora_adapter writes none
    assert marker == {"adapter": str(adapter), "base_model": str(base), "dtype": "float32"}, marker
    assert {p: p.read_bytes() for p in adapter.rglob("*") if p.is_file()} == before

    base_config = json.loads((base / "config.json").read_text())
    base_config["dtype"] = "bfloat16"  # the given base's own dtype is what auto writes
    (base / "config.json").write_text(json.dumps(base_config))
    assert merge([str(adapter), "--base_model", str(base), "--output", str(tmp_path / "m16")]) == 0
    merged16 = load_file(str(tmp_path / "m16" / "model.safetensors"))
    assert all(torch.equal(merged16[k], merged[k].to(torch.bfloat16)) for k in merged)  # one merge, two casts
    assert json.loads((tmp_path / "m16" / "finetune_merge.json").read_text())["dtype"] == "bfloat16"


def test_merge_refuses_a_base_model_the_adapter_does_not_fit(assets, tmp_path, capsys):
    """--base_model naming a model the adapter was not trained on: a narrower Llama (LoRA shapes that do not fit), a
    shallower one (adapter tensors without a module), a deeper one (adapted modules without a tensor: they would
    merge nothing), GPT-2 (no q_proj or v_proj), T5 (not a causal LM), a directory that is not there. Exit 2 naming
    --base_model, what does not fit and the model the run trained; nothing written, no traceback. peft alone loads
    a shallower or deeper base (only the deeper one with a warning), and a merge into it would be silently wrong."""
    from finetune import demo
    from finetune.commands.merge import main as merge

    adapter = lora_adapter(assets.llama, tmp_path / "final")
    build = {"narrow": {"hidden_size": 32}, "shallow": {"num_hidden_layers": 1}, "deep": {"num_hidden_layers": 3}}
    bases = {name: demo.build_model("llama", tmp_path / name, assets.tokenizer, **o) for name, o in build.items()}
    bases |= {"gpt2": assets.gpt2, "t5": assets.t5, "nowhere": str(tmp_path / "nowhere")}
    why = {
        "narrow": "size mismatch for base_model.model.model.layers.0.self_attn.q_proj.lora_A",
        "shallow": "4 of the adapter's tensors have no module in it (e.g. base_model.model.model.layers.1.",
        "deep": "4 of its adapted modules have no tensor in the adapter (e.g. base_model.model.model.layers.2.",
        "gpt2": "not found in the base model",
        "t5": "AutoModelForCausalLM does not load it",
        "nowhere": "does not exist here; give --base_model the base model's directory (or Hub id)",
    }
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    capsys.readouterr()
    for name, base in bases.items():
        assert merge([str(adapter), "--base_model", base, "--output", str(tmp_path / "m")]) == 2, name
        err = capsys.readouterr().err
        assert "  - --base_model: " in err and why[name] in err and "Traceback" not in err, (name, err)
        if name != "nowhere":
            assert f"does not fit the base model {base!r}" in err, err
            assert f"Merge it into the model it was trained on (its run trained {assets.llama!r})" in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep", "final", "narrow", "shallow"]


def test_an_encoder_decoders_adapter_without_a_task_type_merges_as_one(assets, tmp_path, capsys):
    """An adapter saved without task_type (another tool's: get_peft_model on a bare LoraConfig) says nothing of its
    Auto class; merge reads it from the base: an encoder-decoder's (T5) merges as one, with the weights of a merge by
    hand. Was refused: 'AutoModelForCausalLM does not load it'."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from finetune.commands.merge import main as merge

    torch.manual_seed(0)
    adapter = tmp_path / "adapter"
    config = LoraConfig(r=2, lora_alpha=8, init_lora_weights=False, target_modules=["q", "v"])
    get_peft_model(AutoModelForSeq2SeqLM.from_pretrained(assets.t5), config).save_pretrained(adapter)
    AutoTokenizer.from_pretrained(assets.t5).save_pretrained(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text()).get("task_type") is None
    assert merge([str(adapter), "--output", str(tmp_path / "m")]) == 0, capsys.readouterr().err
    merged = load_file(str(tmp_path / "m" / "model.safetensors"))
    want = merged_by_hand(assets.t5, adapter)
    assert merged and max_tensor_diff(merged, want) <= 1e-6
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["T5ForConditionalGeneration"]
