"""`finetune plan` and the per-run memory estimate: counted like the real model, close to what real runs measure,
the recommendation logic on invented clusters, and bad input."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT, base_args, finetune, grid_param, qwen3_moe_model

from finetune import memory
from finetune.cli import run_cli
from finetune.config import build_config
from finetune.parallel import sharding, topology

pytestmark = pytest.mark.xdist_group("memory")  # one worker: the sized models are built once
TOLERANCE = 0.15  # the estimate of the training-phase peak RSS per rank, relative to the measurement
# Two Llama sizes 12x apart in parameters (2.9M and 35M, fp32), 2 ranks, micro batch 4 x 256 tokens.
SIZES = {
    "small": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, vocab_size=4000),
    "large": dict(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, vocab_size=16000
    ),
}
# Every (size, config) pair runs when FINETUNE_MEMORY_GRID=1; by default the two extremes of the larger size.
GRID = [
    (size, config, precision)
    for precision in ("no", "bf16")
    for size in SIZES
    for config in ("ddp", "zero1", "zero2", "zero3")
]
DEFAULT = {("large", "zero3", "no"), ("small", "zero3", "bf16")}  # (large, ddp, no) with the grid: suite time
# `cpu_allocator: release`: glibc returns freed blocks to the system at once (what the estimate assumes on a CPU,
# finetune/memory/); with its default dynamic thresholds it keeps freed blocks under 32 MiB, and ZeRO-3's per-step
# gathers left 0.25-0.33 GB per rank more resident at 35M parameters.


@pytest.fixture(scope="module")
def sized_models(assets, tmp_path_factory):
    from finetune import demo

    root = tmp_path_factory.mktemp("memory")
    models = {
        name: demo.build_model(
            "llama", root / name, assets.tokenizer, num_key_value_heads=dims["num_attention_heads"], **dims
        )
        for name, dims in SIZES.items()
    }
    rows = [{"text": " ".join(e["text"] for e in demo.topic_examples(40, seed=i))} for i in range(40)]
    return models, demo.write_jsonl(rows, root / "long_text.jsonl")


def run_config(model: str, **more) -> object:
    values = {"model": model, "dataset": "(unused)", "max_seq_length": 256, "per_device_train_batch_size": 4, **more}
    return build_config(values, check_filesystem=False)


# ---------------------------------------------------------------- counting the model without its weights


def test_meta_count_matches_the_real_model_with_and_without_lora(assets):
    """The planner's count (config only, meta device) equals the loaded model's, LoRA's trainable share included."""
    from transformers import AutoModelForCausalLM

    from finetune.model import apply_peft

    real = AutoModelForCausalLM.from_pretrained(assets.llama)
    shape = memory.shape_from_config(run_config(assets.llama))
    assert shape.total == shape.trainable == sum(p.numel() for p in real.parameters())
    assert shape.layers == real.config.num_hidden_layers and shape.vocab == real.config.vocab_size
    lora = run_config(assets.llama, peft={"method": "lora", "r": 4})
    shape = memory.shape_from_config(lora)
    peft_model = apply_peft(real, lora.peft, "causal_lm")
    assert shape.total == sum(p.numel() for p in peft_model.parameters())
    assert shape.trainable == sum(p.numel() for p in peft_model.parameters() if p.requires_grad) < shape.total / 5


def test_qlora_holds_the_base_linears_in_four_bits(assets):
    """peft.load_in_4bit: the planner holds the base's decoder linears (what bitsandbytes quantizes; counted here
    by name in the real model) at NF4's 0.5 + 4/64 bytes (two weights a byte, an fp32 absmax per 64), the rest as
    loaded, and autocast caches no 16-bit copy of them (under DDP and ZeRO-2, the layouts that run QLoRA)."""
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained(assets.llama)
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    base = sum(p.numel() for n, p in real.named_parameters() if n.split(".")[-2] in linears)
    assert base > 0
    lora = {"method": "lora", "r": 4}
    plain = memory.shape_from_config(run_config(assets.llama, peft=lora))
    qlora = memory.shape_from_config(run_config(assets.llama, peft={**lora, "load_in_4bit": True}))
    assert plain.quantized == 0 and qlora.quantized == base and qlora.total == plain.total
    w = plain.weight_bytes
    for name in ("ddp", "zero2"):  # bf16 through autocast over the weights as loaded (fp32 here) in both
        topo, _, _ = topology.read_config_file(ROOT / "accelerate_configs" / f"{name}.yaml", num_processes=2)

        def part(shape, kind, topo=topo):
            return sum(
                x.bytes for x in sharding.model_states(topo, shape, "bf16", sharding.Buckets()) if x.name == kind
            )

        assert part(plain, "parameters") == plain.total * w
        four_bit = (qlora.total - base) * w + base * (0.5 + 4 / 64)
        assert part(qlora, "parameters") == pytest.approx(four_bit), name
        assert part(plain, "buffers") - part(qlora, "buffers") == pytest.approx(2 * base), name


def _saved_masks(run, seq: int) -> list:
    """The distinct seq x seq tensors autograd keeps for backward while `run()` runs: (dtype, storage id)."""
    import torch

    seen = {}

    def pack(t):
        if t.dim() == 4 and tuple(t.shape[-2:]) == (seq, seq):
            seen[t.untyped_storage().data_ptr()] = t.dtype
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sorted((str(dtype), ptr) for ptr, dtype in seen.items())


def test_torch_still_keeps_a_converted_mask_per_attention_call():
    """torch converts a boolean attention mask into a float one in every scaled_dot_product_attention call and keeps
    each copy for backward: model.masks_converted_once works around it; once this fails, delete it."""
    import torch
    import torch.nn.functional as F

    seq = 16
    q, k, v = (torch.randn(1, 2, seq, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(seq, seq, dtype=torch.bool).tril().view(1, 1, seq, seq)
    kept = _saved_masks(lambda: [F.scaled_dot_product_attention(q, k, v, attn_mask=mask) for _ in range(3)], seq)
    assert len(kept) == 3 and {dtype for dtype, _ in kept} == {"torch.float32"}, kept


@pytest.mark.parametrize("precision", ["fp32", "bf16 autocast"])
def test_a_training_forward_keeps_one_attention_mask_for_every_layer(assets, precision):
    """A packed batch's mask: one tensor in the dtype attention computes in, which every layer shares (transformers'
    boolean mask would be converted, and kept, once per layer), and the same loss as with transformers' mask."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM
    from transformers import masking_utils as mu

    from finetune.model import masks_converted_once

    masks_converted_once()
    converted = mu.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    model = AutoModelForCausalLM.from_pretrained(assets.llama, attn_implementation="sdpa")
    layers, seq = model.config.num_hidden_layers, 12
    assert layers >= 2
    ids = torch.randint(5, 100, (2, seq), generator=torch.Generator().manual_seed(0))
    packed = torch.tensor([list(range(5)) + list(range(7))] * 2)
    batch = {"input_ids": ids, "labels": ids, "position_ids": packed, "use_cache": False}  # as training calls it
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if precision != "fp32" else contextlib.nullcontext()
    want = "torch.bfloat16" if precision != "fp32" else "torch.float32"
    losses = []

    def forward():
        with cast:
            losses.append(model(**batch).loss.float().item())

    once = _saved_masks(forward, seq)
    mu.AttentionMaskInterface.register("sdpa", converted.__wrapped__)  # transformers' own boolean mask
    try:
        per_layer = _saved_masks(forward, seq)
    finally:
        mu.AttentionMaskInterface.register("sdpa", converted)
    assert len(once) == 1 and len(per_layer) == layers, (once, per_layer)
    assert {dtype for dtype, _ in once + per_layer} == {want}
    assert losses[0] == pytest.approx(losses[1], rel=1e-6 if precision == "fp32" else 1e-3)


def test_plan_builds_an_encoder_decoder_as_one(assets):
    """task seq2seq is planned with the class training builds (AutoModelForSeq2SeqLM: config.AUTO_CLASSES), not as
    a causal LM (no T5 causal-LM class exists: the planner used to fail on it)."""
    from transformers import AutoModelForSeq2SeqLM

    real = AutoModelForSeq2SeqLM.from_pretrained(assets.t5)
    shape = memory.shape_from_config(run_config(assets.t5, task="seq2seq", format="instruction"))
    assert shape.total == shape.trainable == sum(p.numel() for p in real.parameters()) > 0


def test_every_shipped_config_is_read_without_launching():
    """Each shipped Accelerate config becomes the topology its comments promise."""
    seen = {}
    for path in sorted((ROOT / "accelerate_configs").glob("*.yaml")):
        topo, _, mixed = topology.read_config_file(path)
        seen[path.stem] = (topo.family, topo.zero_stage, topo.offload_params, topo.tp, topo.pp, topo.num_processes)
        assert mixed is None  # the run config's mixed_precision decides (environment.set_mixed_precision)
    assert seen["ddp"] == ("ddp", 0, False, 1, 1, 2)
    assert seen["zero3_offload"] == ("deepspeed", 3, True, 1, 1, 2)
    assert seen["zero2_offload"][:3] == ("deepspeed", 2, False)
    assert seen["fsdp2_offload"][:3] == ("fsdp", 0, True)
    assert seen["tp2"][0] == "tensor" and seen["tp2"][3] == 2
    assert seen["megatron_tp2_pp2"][3:] == (2, 2, 4)


def test_sharding_saves_what_the_zero_paper_says(assets):
    """Model states per rank at N ranks, fp32 AdamW, without buffers: DDP 16 B/parameter, ZeRO-1 8 + 12/N
    (DeepSpeed keeps the full gradients and a flat partition of them; the fp32 master is the weights' own
    partition, share_fp32_master_weights), ZeRO-2 4 + 12/N, ZeRO-3 16/N (each also copies its gradient
    partition, or a sub-group of it, into one flat tensor for the step: a buffer)."""
    shape = memory.shape_from_config(run_config(assets.llama))
    p = shape.total
    for n in (2, 8):
        per_param = {}
        for name in ("ddp", "zero1", "zero2", "zero3"):
            topo, ds, mixed = topology.read_config_file(ROOT / "accelerate_configs" / f"{name}.yaml", num_processes=n)
            parts = sharding.model_states(topo, shape, mixed or "no", sharding.Buckets())
            per_param[name] = sum(x.bytes for x in parts if x.name != "buffers") / p
        assert per_param["ddp"] == pytest.approx(16)
        assert per_param["zero1"] == pytest.approx(8 + 12 / n)
        assert per_param["zero2"] == pytest.approx(4 + 12 / n)
        assert per_param["zero3"] == pytest.approx(16 / n, rel=0.05)  # small tensors stay whole


def test_a_live_reference_copy_is_counted_as_the_layout_places_it(assets):
    """dpo with reference: live and no adapter holds a frozen copy of the starting model (backend.prepare_frozen):
    whole on each rank under DDP and ZeRO-1/2, sharded under ZeRO-3 and FSDP2; nothing with precomputed references
    or an adapter (its reference is the base with the adapter disabled)."""
    machines = memory.Machines(cpu_processes=2)
    shape = memory.shape_from_config(run_config(assets.llama))
    whole = shape.total * shape.weight_bytes / 1e9  # GB, as by_kind() gives them
    live = run_config(assets.llama, method="dpo", reference="live")
    for name, share in (("ddp", 1), ("zero2", 1), ("zero3", 1 / 2), ("fsdp2", 1 / 2)):
        path = ROOT / "accelerate_configs" / f"{name}.yaml"
        est = memory.plan_config(shape, live, path, machines)
        assert est.by_kind()["reference"] == pytest.approx(whole * share), name
        without = memory.plan_config(shape, run_config(assets.llama, method="dpo"), path, machines)
        assert "reference" not in without.by_kind()
        assert est.host_gb == pytest.approx(without.host_gb + whole * share), name
    lora = run_config(assets.llama, method="dpo", reference="live", peft={"method": "lora"})
    assert (
        "reference" not in memory.plan_config(shape, lora, ROOT / "accelerate_configs" / "ddp.yaml", machines).by_kind()
    )


def test_fsdp2_shards_over_dp_shard_x_tp_and_hsdp_replicas_hold_it_whole(assets, tmp_path):
    """FSDP2 cuts a rank's model states dp_shard x tp ways (sharding._fsdp): under HSDP (parallelism_config
    dp_replicate_size 2 x dp_shard_size 2 on 4 processes) each dp_replicate group holds the whole model over its 2
    dp_shard ranks (seen: parameter_shard 0.5 on 4 CPU processes; 0.2505 under HSDP x TP, 2 x 2 x 2 on 8: the norms,
    which TP leaves whole, cut dp_shard ways only), so a rank holds what it holds under FSDP2 on 2 processes; the
    estimate had divided by every process (a quarter; an eighth under HSDP x TP). Parameters, gradients, AdamW moments (fp32) and a live reference copy (dpo, which TP
    refuses); the plan of such a config file, and the start log's estimate (Topology.read: test_parallel's HSDP
    test), alike."""
    import yaml

    shape = memory.shape_from_config(run_config(assets.llama))
    fsdp2 = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text())
    live = run_config(assets.llama, method="dpo", reference="live")

    def planned(n: int, **sizes: int) -> dict[str, float]:
        pc = {"parallelism_config": {f"parallelism_config_{k}_size": v for k, v in sizes.items()}} if sizes else {}
        (tmp_path / "acc.yaml").write_text(yaml.safe_dump({**fsdp2, "num_processes": n, **pc}))
        cfg = run_config(assets.llama) if "tp" in sizes else live
        est = memory.plan_config(shape, cfg, tmp_path / "acc.yaml", memory.Machines(cpu_processes=n))
        assert not est.refused, est.refused
        return {k: v * 1e9 for k, v in est.by_kind().items()}

    w = 4  # fp32, each a share of the whole model
    for n, sizes, share in [
        (4, dict(dp_replicate=2, dp_shard=2), 1 / 2),
        (2, {}, 1 / 2),
        (8, dict(dp_replicate=2, dp_shard=2, tp=2), 0.2505),
        (4, dict(dp_shard=2, tp=2), 0.2505),
        (4, {}, 1 / 4),
    ]:
        got = planned(n, **sizes)
        want = {"parameters": shape.total, "gradients": shape.trainable, "optimizer": 2 * shape.trainable}
        if "tp" not in sizes:  # dpo's live reference: sharded as the trained model (prepare_frozen)
            want["reference"] = shape.total
        shares = {k: got[k] / (v * w) for k, v in want.items()}
        assert shares == pytest.approx(dict.fromkeys(want, share), abs=1e-4), (n, sizes)
    hsdp = topology.read_config_file(tmp_path / "acc.yaml")[0]
    assert (hsdp.dp, hsdp.dp_replicate, hsdp.dp_shard) == (4, 1, 4)  # the last: fsdp2.yaml on 4
    (tmp_path / "acc.yaml").write_text(
        yaml.safe_dump(
            {
                **fsdp2,
                "num_processes": 4,
                "parallelism_config": {
                    "parallelism_config_dp_replicate_size": 2,
                    "parallelism_config_dp_shard_size": 2,
                },
            }
        )
    )
    hsdp = topology.read_config_file(tmp_path / "acc.yaml")[0]
    assert (hsdp.dp, hsdp.dp_replicate, hsdp.dp_shard) == (4, 2, 2)
    assert "data parallel 4 (2 replicas x 2 shards) x tensor 1" in hsdp.summary()


# parameter_shard (a rank's share of the model's parameters, metrics.jsonl) seen on CPU processes with the tiny Llama
# of assets.llama / assets.llama_tied (150,848 / 112,448 parameters): under tp2 every weight but the norms is split,
# the input embeddings included (Shard(0) over the vocabulary; the tied head is the same tensor), and Megatron-LM
# (tests/cuda_standin) holds the same share; under PP 2 its fullest rank is the last stage (a layer, the final norm and
# the head: a tied head is a copy of the embeddings there).
OBSERVED_SHARE = {
    ("tp2", "llama"): 0.5011,
    ("tp2", "llama_tied"): 0.5014,
    ("tp2_fsdp2", "llama"): 0.2505,  # 4 processes: the norms, whole under TP, cut dp_shard ways only
    ("tp2_fsdp2", "llama_tied"): 0.2507,
    ("megatron_tp2", "llama"): 0.5011,
    ("megatron_tp2", "llama_tied"): 0.5014,
    ("megatron_pp2", "llama"): 0.5002,
    ("megatron_pp2", "llama_tied"): 0.671,
    # assets.gpt2 (171,264, tied): Conv1D matrices split, learned positions whole; its column-parallel biases split
    # too, which the estimate holds whole (448 weights: 0.6009 estimated)
    ("megatron_tp2", "gpt2"): 0.5983,
    # test_megatron's TP test model (conftest.qwen3_moe_model, 137,728): the fused experts split (moe_tp_experts), the router's
    # gate whole, which the estimate splits (256 weights a layer: 0.5037 estimated); the experts counted whole: 0.68
    ("tp2", "qwen3_moe"): 0.5028,
}


@pytest.mark.parametrize("layout,model", list(OBSERVED_SHARE), ids=["-".join(k) for k in OBSERVED_SHARE])
def test_tensor_parallel_estimate_holds_the_share_a_rank_really_holds(assets, tmp_path, layout, model):
    """The estimate's parameters, gradients and AdamW moments (fp32) under tensor and pipeline parallelism are the
    model's counts x the share a rank was seen to hold (OBSERVED_SHARE). transformers 5.23 splits the input embeddings
    too (distributed/mixin.py init_parallel_plans adds them to every tp_plan), and so does Megatron-LM: the estimate
    counted them whole on every rank (0.63 of the untied model under TP 2 against 0.50 held; 0.75 under PP 2), and
    GPT-2's Conv1D matrices too (0.89 against 0.60), and a mixture of experts' fused experts (0.68 against 0.50)."""
    path = qwen3_moe_model(assets.tokenizer, tmp_path / model) if model == "qwen3_moe" else getattr(assets, model)
    shape = memory.shape_from_config(run_config(path))
    assert shape.total == {"llama": 150848, "llama_tied": 112448, "gpt2": 171264, "qwen3_moe": 137728}[model]
    name = "megatron_tp2_pp2" if layout == "megatron_pp2" else layout
    processes = 2 if layout.startswith("megatron") else None  # the TP configs: their mesh's (2; tp2_fsdp2 4)
    topo = topology.read_config_file(ROOT / "accelerate_configs" / f"{name}.yaml", num_processes=processes)[0]
    if layout == "megatron_pp2":  # TP 1 x PP 2 on 2 processes: `--megatron_lm_tp_degree 1 --megatron_lm_pp_degree 2`
        topo = dataclasses.replace(topo, tp=1, pp=2, dp=1)
    got = {x.name: x.bytes for x in sharding.model_states(topo, shape, "no", sharding.Buckets()) if x.name != "buffers"}
    share = OBSERVED_SHARE[(layout, model)]
    want = {"parameters": shape.total, "gradients": shape.trainable, "optimizer": 2 * shape.trainable}
    for kind, count in want.items():
        tolerance = {"gpt2": 3e-3, "qwen3_moe": 1e-3}.get(model, 1e-4)
        assert got[kind] / (count * 4) == pytest.approx(share, abs=tolerance), kind


def test_plan_shows_an_fsdp2_mesh_accelerate_refuses_as_refused(assets, tmp_path, capsys):
    """An FSDP2 parallelism_config with no dp_shard ranks (tp_size equal to the processes), which accelerate 1.15
    refuses at Accelerator(): the plan's row says the run's own refusal (fsdp.mesh_problems), with no estimate."""
    import yaml

    fsdp2 = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text())
    path = tmp_path / "tp_only.yaml"
    path.write_text(
        yaml.safe_dump({**fsdp2, "num_processes": 2, "parallelism_config": {"parallelism_config_tp_size": 2}})
    )
    argv = ["plan", "--model", assets.llama, "--max_seq_length", "64", "--configs", f"{path},fsdp2"]
    assert run_cli(argv) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tp_only "))
    assert "refused: parallelism_config_dp_shard_size: is 1 in an FSDP2 parallelism_config (tp 2)" in row, row


def test_a_preference_pair_is_two_rows_of_activations_and_logits(assets):
    """A micro batch of B pairs is one forward over 2B rows (data.Collator): the planner counts the activations and
    logits of 2B rows, in training and evaluation (no eval split here, so training alone)."""
    machines = memory.Machines(cpu_processes=1)
    shape = memory.shape_from_config(run_config(assets.llama))
    path = ROOT / "accelerate_configs" / "single.yaml"

    def parts(**more) -> dict:
        est = memory.plan_config(shape, run_config(assets.llama, eval_fraction=0, **more), path, machines)
        return {k: v for k, v in est.by_kind().items() if k in ("activations", "logits")}

    pairs, rows = parts(method="dpo", per_device_train_batch_size=4), parts(per_device_train_batch_size=8)
    assert pairs and pairs == pytest.approx(rows), (pairs, rows)
    assert parts(per_device_train_batch_size=4)["logits"] == pytest.approx(rows["logits"] / 2)


def test_a_classifiers_logits_are_its_labels_not_the_vocabulary(tmp_path):
    """task classification: the head outputs num_labels per position (a Llama's score head scores every position,
    then pools the last), so the loss's logit copies are rows x seq x labels, not x 32,000 (the planner counted
    the vocabulary: 1.57 GB at 16 x 256 tokens where a real run peaked at 0.61 GB in all)."""
    model = llama_config_dir(tmp_path, "m", 256, 2, 512, vocab=32000)
    path = ROOT / "accelerate_configs" / "single.yaml"
    machines = memory.Machines(cpu_processes=1)
    kinds, totals = {}, {}
    for task in ("causal_lm", "classification"):
        cfg = run_config(model, task=task, per_device_train_batch_size=16, eval_fraction=0, chunked_loss="false")
        est = memory.plan_config(memory.shape_from_config(cfg), cfg, path, machines)
        kinds[task], totals[task] = est.by_kind(), est.host_gb
    logits = 16 * 256 * 32000 * 12 / 1e9
    assert kinds["causal_lm"]["logits"] == pytest.approx(logits)
    assert kinds["classification"].get("logits", 0.0) <= 16 * 256 * 2 * 12 / 1e9
    assert totals["classification"] < totals["causal_lm"] - 0.8 * logits


# ---------------------------------------------------------------- the estimate against real runs


@pytest.mark.slow
@pytest.mark.parametrize(
    "size,config,precision",
    [grid_param(*case, default=case in DEFAULT, grid="FINETUNE_MEMORY_GRID") for case in GRID],
)
def test_estimate_is_within_15_percent_of_the_measured_peak(sized_models, tmp_path, size, config, precision):
    """A real 2-rank run logs the planner's estimate at start and its measured training-phase peak RSS at the end;
    every rank's measurement is within 15% of the estimate, which is also what `finetune plan` says for that
    config from the model's config alone; in fp32 and in bf16 (`accelerate launch --mixed_precision bf16`)."""
    models, data = sized_models
    args = base_args(models[size], data, "--max_seq_length", "256", "--format", "text", "--eval_fraction", "0")
    args += ["--cpu_allocator", "release", "--max_steps", "3"]
    launch = ("--mixed_precision", precision)
    r = finetune(tmp_path / "run", *args, launcher=config, timeout=900, launch_args=launch)
    assert {row["compute_dtype"] for row in r.train_rows} == {"bfloat16" if precision == "bf16" else "float32"}
    memory_row = next(row for row in r.rows if "peak_memory" in row)["peak_memory"]
    assert len(memory_row) == 2
    planned = memory.plan_config(
        memory.shape_from_config(run_config(models[size])),
        run_config(models[size], eval_fraction=0),
        ROOT / "accelerate_configs" / f"{config}.yaml",
        memory.Machines(cpu_processes=2, mixed_precision=precision),
    )
    for rank in memory_row:
        estimate, measured = rank["estimate_train_peak_gb"], rank["train_peak_rss_gb"]
        assert estimate == pytest.approx(planned.host_gb, rel=0.01)
        print(
            f"{size} {config} {precision} rank {rank['rank']}: estimate {estimate:.3f} GB, measured {measured:.3f} GB"
        )
        assert abs(estimate - measured) <= TOLERANCE * measured, (size, config, precision, estimate, measured)
    assert "memory estimate per rank (finetune plan)" in r.output
    assert "CPU allocator: release" in r.output  # the estimate's assumption was in effect, not glibc's defaults


@pytest.mark.slow
def test_an_encoder_decoders_estimate_is_within_15_percent_of_its_measured_peak(assets, tmp_path):
    """T5 (learned position bias, dropout 0.1 as a released T5's config has it): both stacks' blocks, the decoder's
    cross-attention, the dropout noise and, on a CPU, the attention probabilities SDPA's math kernel keeps (the
    bias needs a gradient; attention dropout). The planner counted one stack, decoder-only style: 1.41 GB against a
    measured 7.52 at 16 x 512 tokens. docs/memory.md has T5 and BART at two sizes."""
    from finetune import demo

    model = demo.build_model(
        "t5", tmp_path / "t5", assets.tokenizer, d_model=128, d_kv=16, d_ff=512, num_heads=8, dropout_rate=0.1
    )
    words = " ".join(e["text"] for e in demo.topic_examples(60, seed=0)).split()
    rows = [{"source": " ".join(words[i : i + 500]), "target": " ".join(words[i + 7 : i + 507])} for i in range(24)]
    data = demo.write_jsonl(rows, tmp_path / "pairs.jsonl")
    args = base_args(model, data, "--task", "seq2seq", "--format", "source_target", "--max_seq_length", "384")
    args += ["--per_device_train_batch_size", "8", "--eval_fraction", "0", "--cpu_allocator", "release"]
    r = finetune(tmp_path / "run", *args, "--max_steps", "2", timeout=600)
    (rank,) = next(row for row in r.rows if "peak_memory" in row)["peak_memory"]
    cfg = run_config(model, task="seq2seq", format="source_target", max_seq_length=384, per_device_train_batch_size=8)
    shape = memory.shape_from_config(cfg)
    assert shape.decoder_layers == 2 and shape.layers == 4 and shape.position_bias
    estimate, measured = rank["estimate_train_peak_gb"], rank["train_peak_rss_gb"]
    print(f"t5 seq2seq: estimate {estimate:.3f} GB, measured {measured:.3f} GB")
    assert measured > 1.0  # activations dominate: the old count (one stack) was far below
    assert abs(estimate - measured) <= TOLERANCE * measured, (estimate, measured)


# ---------------------------------------------------------------- the recommendation on invented clusters


def llama_config_dir(root: Path, name: str, hidden: int, layers: int, intermediate: int, vocab: int = 32000) -> str:
    """A Llama config.json alone (no weights): all the planner reads."""
    from finetune.demo import llama_config

    path = root / name
    config = llama_config(
        hidden, layers, heads=hidden // 128, intermediate=intermediate, vocab=vocab, max_positions=32768
    )
    config.save_pretrained(path)
    return str(path)


GB80 = dict(
    gpu_memory_gb=80.0, host_memory_gb=1000.0, mixed_precision="no"
)  # fp32, as launched with --mixed_precision no
CASES = [
    # name, model (hidden, layers, intermediate), seq, micro, machines, expected config, micro batch, checkpointing
    (
        "7B, 4k tokens in bf16 (auto on GPUs): ZeRO-1 fits",
        (4096, 32, 11008),
        4096,
        1,
        memory.Machines(8, 8, gpu_memory_gb=80.0, host_memory_gb=1000.0),
        "zero1",
        1,
        False,
    ),
    ("fits without sharding", (1024, 16, 2816), 1024, 4, memory.Machines(8, 8, **GB80), "ddp", 4, False),
    ("7B: sharded optimizer states", (4096, 32, 11008), 2048, 1, memory.Machines(8, 8, **GB80), "zero1", 1, False),
    ("7B, 4k tokens: sharded parameters", (4096, 32, 11008), 4096, 1, memory.Machines(8, 8, **GB80), "fsdp2", 1, False),
    (
        "7B on one GPU needs offload",
        (4096, 32, 11008),
        512,
        1,
        memory.Machines(1, 1, **GB80),
        "zero2_offload",
        1,
        False,
    ),
    ("long sequences need TP", (2048, 24, 5632), 16384, 1, memory.Machines(2, 2, **GB80), "tp2", 1, False),
    (  # tp2_fsdp2's mesh is 4 processes (tp 2 x dp_shard 2): a launch on 8 is refused (fsdp.problems)
        "7B on 4 x 50 GB GPUs: TP x FSDP",
        (4096, 32, 11008),
        2048,
        1,
        memory.Machines(4, 4, 50.0, 1000.0, mixed_precision="no"),
        "tp2_fsdp2",
        1,
        False,
    ),
    (
        "micro batch shrinks to fit",
        (1024, 16, 2816),
        4096,
        16,
        memory.Machines(8, 8, 24.0, 500.0, mixed_precision="no"),
        "ddp",
        2,
        False,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_recommendation(tmp_path, case):
    name, (hidden, layers, inter), seq, micro, machines, config, want_micro, checkpointing = case
    model = llama_config_dir(tmp_path, "m", hidden, layers, inter)
    cfg = run_config(model, max_seq_length=seq, per_device_train_batch_size=micro)
    shape = memory.shape_from_config(cfg)
    rec = memory.recommend(shape, cfg, machines)
    assert (rec.config, rec.micro_batch, rec.gradient_checkpointing) == (config, want_micro, checkpointing), rec.why
    est = rec.estimate
    assert est.fits and est.device_gb <= memory.GPU_HEADROOM * machines.gpu_memory_gb
    target = micro * machines.processes
    assert rec.micro_batch * rec.gradient_accumulation_steps * est.topology.dp == target
    # every config the preference order puts first really does not fit at that micro batch
    for faster in memory.PREFERENCE[: memory.PREFERENCE.index(config)]:
        if faster == "single" and machines.processes > 1:
            continue
        other = memory.plan_config(
            shape, cfg, ROOT / "accelerate_configs" / f"{faster}.yaml", machines, rec.micro_batch
        )
        assert not other.fits, (faster, other.device_gb)


def test_a_layout_the_run_refuses_is_shown_refused_and_never_recommended(tmp_path, capsys, monkeypatch):
    """LoRA on 8 GPUs: tensor parallelism and Megatron-LM refuse adapters at start (their backends' problems(), which
    the plan asks with the environment accelerate's launcher would give), so their rows say so, with the run's own
    message, and carry no estimate (QLoRA's tp2 row had shown -29 GB of parameters and fit); the recommendation is a
    layout the run starts. Each refusal is the run's: the same config launched fails on it."""
    from finetune.parallel.environment import family_module
    from finetune.parallel.topology import launch_environment, launch_size

    model = llama_config_dir(tmp_path, "70b", 8192, 80, 28672)
    argv = ["plan", "--model", model, "--peft.method", "lora", "--num_gpus", "8", "--gpu_memory", "80GB"]
    argv += ["--max_seq_length", "1024", "--per_device_train_batch_size", "1", "--mixed_precision", "bf16"]
    for qlora in ([], ["--peft.load_in_4bit"]):
        code = run_cli(argv + qlora)
        out = capsys.readouterr().out
        rows = {
            line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in memory.PREFERENCE
        }
        for name in ("tp2", "tp2_fsdp2", "megatron_tp2"):
            assert "  no    refused: " in rows[name] and "peft.method: " in rows[name], rows[name]
            assert "-" not in rows[name].split("refused:")[0], rows[name]  # no (negative) numbers
        rec = next(line for line in out.splitlines() if line.startswith("recommended:"))
        assert code == 0 and "refused" not in rows[rec.split()[1].rstrip(",")], rec
        if qlora:  # QLoRA is refused under ZeRO-3 and FSDP2 too
            assert "refused: peft.load_in_4bit: " in rows["zero3"] and "refused: peft.load_in_4bit" in rows["fsdp2"]
    # the row's refusal is what the run itself says when launched so
    cfg = run_config(model, peft={"method": "lora"})
    path = ROOT / "accelerate_configs" / "tp2.yaml"
    env = launch_environment(path, launch_size(path, 8)[0])
    for key in [k for k in __import__("os").environ if k.startswith(topology.LAUNCH_KEYS)]:
        monkeypatch.delenv(key)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ("peft.method", "adapters are not supported with tensor parallelism; set peft.method: none") in (
        family_module().problems(cfg)
    )


def test_a_config_left_out_is_never_said_not_to_fit(tmp_path, capsys):
    """Configs the recommender does not try are named with why (one process of several, a global batch that does
    not split over their data-parallel ranks); only those tried are said not to fit; a config named with --configs
    is planned even where it runs one process (it said "nothing fits" about single, which fits)."""
    model = llama_config_dir(tmp_path, "7b", 4096, 32, 11008)
    argv = ["plan", "--model", model, "--num_gpus", "8", "--gpu_memory", "80GB", "--max_seq_length", "4096"]
    argv += ["--per_device_train_batch_size", "1", "--mixed_precision", "bf16"]
    assert run_cli([*argv, "--global_batch_size", "60"]) == 0
    rec = capsys.readouterr().out.split("recommended: ")[1]
    assert "ddp, zero1, zero2, fsdp2, zero3: the global batch 60 does not split over its 8 data-parallel ranks" in rec
    assert "single: runs one process of the 8" in rec
    assert "ddp, zero1" not in rec.split("does not split")[1], rec  # not also said not to fit
    assert run_cli([*argv, "--global_batch_size", "63"]) == 0
    rec = capsys.readouterr().out.split("recommended: ")[1]
    assert rec.startswith("tp2,") and "it uses 2 of the 8 GPUs" in rec and "do not fit" not in rec, rec
    small = ["plan", "--model", llama_config_dir(tmp_path, "s", 256, 2, 512), "--max_seq_length", "64"]
    assert run_cli([*small, "--configs", "single"]) == 0
    assert "recommended: single, micro batch" in capsys.readouterr().out
    assert run_cli([*small, "--configs", "tp2", "--num_processes", "1"]) == 1
    out = capsys.readouterr().out
    assert "recommended: none: no config given can run this job" in out and "tp2: needs 2 processes" in out, out
    assert "fit" not in out.split("recommended: ")[1]


def test_nothing_fits_says_what_to_change(tmp_path, capsys):
    model = llama_config_dir(tmp_path, "70b", 8192, 80, 28672)
    code = run_cli(
        [
            "plan",
            "--model",
            model,
            "--max_seq_length",
            "4096",
            "--per_device_train_batch_size",
            "1",
            "--num_gpus",
            "1",
            "--gpu_memory",
            "24GB",
            "--host_memory",
            "64GB",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "recommended: none" in out and "LoRA" in out
    assert out.count(" no ") >= len(memory.shipped_configs()) - 1


def test_evaluation_that_does_not_fit_is_named(tmp_path, capsys):
    """A 128k vocabulary, 8 eval rows of 32k tokens. A model whose logits are more than its head's output (Granite
    scales them: transformers' forward): evaluation's logits (8 x 32,768 x 128,256 in bf16, 67 GB, and one row's
    fp32 copy and log-softmax, 34 GB) fit nowhere, and the message names the eval batch. A Llama of the same shape
    evaluates a chunk at a time through finetune's loss forward, with chunked_loss false too, and fits."""
    model = llama_config_dir(tmp_path, "1b", 2048, 16, 8192, vocab=128_256)
    granite = tmp_path / "granite"
    granite.mkdir()
    config = json.loads((Path(model) / "config.json").read_text())
    config.update(model_type="granite", architectures=["GraniteForCausalLM"], logits_scaling=8.0)
    (granite / "config.json").write_text(json.dumps(config))
    argv = ["--max_seq_length", "32768", "--per_device_train_batch_size", "1", "--chunked_loss", "false"]
    argv += ["--num_gpus", "8", "--gpu_memory", "80GB", "--mixed_precision", "bf16"]
    assert run_cli(["plan", "--model", str(granite), *argv]) == 1
    out = capsys.readouterr().out
    assert "recommended: none" in out and "evaluation is the largest part (100.9 GB" in out, out[-600:]
    assert "lower per_device_eval_batch_size" in out
    assert run_cli(["plan", "--model", model, *argv]) == 0
    out = capsys.readouterr().out
    assert "recommended: none" not in out and "evaluation is the largest part" not in out


def test_gradient_checkpointing_when_activations_are_the_problem(tmp_path):
    """Nothing fits at micro batch 1 without checkpointing; with it, the least sharded config that fits."""
    model = llama_config_dir(tmp_path, "m", 2048, 24, 5632)
    cfg = run_config(model, max_seq_length=32768, per_device_train_batch_size=1, eval_fraction=0)  # eval: its own
    machines = memory.Machines(2, 2, 80.0, 500.0, mixed_precision="no")  # fp32
    shape = memory.shape_from_config(cfg)
    assert not any(e.fits for e in memory.plan(shape, cfg, machines))
    rec = memory.recommend(shape, cfg, machines)
    assert rec.gradient_checkpointing and rec.config == "ddp" and rec.estimate.fits
    assert "gradient checkpointing" in rec.why


def test_largest_llama_in_a_budget():
    """For a capacity benchmark: the most layers that fit a per-rank budget; one more does not; ZeRO-3 fits more
    than DDP in the same budget (not 2x: with the shipped stage3_max_reuse_distance every parameter stays gathered
    from its forward to its backward, 4 of ZeRO-3's 12 bytes per parameter at 2 ranks)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import sizing  # bench/sizing.py: a benchmark's helper, tested here

    cfg = run_config("(config given)", max_seq_length=256)
    machines = memory.Machines(cpu_processes=2)
    found = {}
    for name in ("ddp", "zero3"):
        path = ROOT / "accelerate_configs" / f"{name}.yaml"
        layers, shape, est = sizing.largest_llama(1024, 6.0, cfg, path, machines)
        assert est.host_gb <= 6.0 and shape.layers == layers
        exact = memory.shape_from_config(cfg, config=sizing.llama_config(1024, layers))  # built, not extrapolated
        assert exact == shape
        bigger = memory.shape_from_config(cfg, config=sizing.llama_config(1024, layers + 1))
        assert memory.plan_config(bigger, cfg, path, machines).host_gb > 6.0
        found[name] = shape.total
    assert found["zero3"] > 1.1 * found["ddp"]
    assert sizing.largest_llama(1024, 0.1, cfg, ROOT / "accelerate_configs" / "ddp.yaml", machines) is None


# ---------------------------------------------------------------- the command


def test_plan_for_this_machine_prints_every_config(assets, capsys):
    code = run_cli(["plan", "--model", assets.llama, "--max_seq_length", "64", "--per_device_train_batch_size", "4"])
    out = capsys.readouterr().out
    assert code == 0
    for path in memory.shipped_configs():
        assert f"\n{path.stem} " in out
    assert "2 CPU process(es) on this machine" in out
    assert "recommended: ddp, micro batch 4 x gradient accumulation 1" in out


def test_plan_reads_a_run_config_and_lora(assets, tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text(json.dumps({"model": assets.llama, "dataset": assets.text, "peft": {"method": "lora"}}))
    assert run_cli(["plan", "--config", str(run), "--num_gpus", "4", "--gpu_memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "4 GPU(s) of 17.2 GB" in out and "trainable" in out and "device GB" in out


def test_plan_of_an_adapter_without_peft_installed_says_what_to_install(assets, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails, as without finetune[peft]
    assert run_cli(["plan", "--model", assets.llama, "--peft.method", "lora"]) == 2
    err = capsys.readouterr().err
    assert "  - peft.method: needs the peft package: pip install 'finetune[peft]'" in err and "Traceback" not in err


def test_the_printed_launch_works_from_where_the_user_is(tmp_path, monkeypatch):
    """From the checkout's root the shipped configs' relative paths; from anywhere else (an installed package's
    configs are in site-packages) absolute ones, and the DeepSpeed JSON the config names, which accelerate would
    look for in the current folder."""
    from finetune.commands.plan import launch_command

    zero2 = topology.shipped_by_name()["zero2"]
    monkeypatch.chdir(ROOT)
    assert launch_command(zero2, memory.Machines()) == "accelerate launch --config_file accelerate_configs/zero2.yaml"
    monkeypatch.chdir(tmp_path)
    assert launch_command(zero2, memory.Machines()) == (
        f"accelerate launch --config_file {ROOT}/accelerate_configs/zero2.yaml "
        f"--deepspeed_config_file {ROOT}/ds_configs/zero2.json"
    )
    sixteen = memory.Machines(16, 8, 80.0)  # two machines: the multi-node twin, and its JSON
    zero3 = launch_command(topology.shipped_by_name()["zero3"], sixteen)
    assert zero3.startswith(f"accelerate launch --config_file {ROOT}/accelerate_configs/multinode_zero3.yaml ")
    assert "--deepspeed_config_file " in zero3 and zero3.endswith(
        "--num_machines 2 --machine_rank R --main_process_ip HOST"
    )


def test_without_shipped_configs_plan_asks_for_files(assets, tmp_path, monkeypatch, capsys):
    """An install that lost its package data: bad input naming --configs, not an empty plan."""
    monkeypatch.setattr(topology, "SHIPPED", tmp_path)
    assert run_cli(["plan", "--model", assets.llama]) == 2
    assert (
        f"  - --configs: no shipped Accelerate config found in {tmp_path}; pass --configs FILE.yaml"
        in capsys.readouterr().err
    )
    assert run_cli(["plan", "--model", assets.llama, "--configs", "ddp"]) == 2
    assert (
        f"'ddp' is neither a file nor a shipped config (none found in {tmp_path}: pass --configs FILE.yaml"
        in capsys.readouterr().err
    )


def test_plan_reads_a_mixture_config(assets, capsys):
    """A config with datasets: (a mixture) plans; it was refused ("datasets: and dataset are both set"), the plan
    having set a placeholder dataset of its own."""
    argv = ["plan", "--config", str(ROOT / "examples" / "mixture.yaml"), "--model", assets.llama]
    code = run_cli([*argv, "--max_seq_length", "64", "--per_device_train_batch_size", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "recommended: " in captured.out


def test_plan_help(capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(["plan", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in (
        "--num_gpus",
        "--gpu_memory",
        "--host_memory",
        "--global_batch_size",
        "--peft.method",
        "--max_seq_length",
    ):
        assert flag in out


@pytest.mark.parametrize(
    "argv,key,fix",
    [
        (["--num_gpus", "8"], "--gpu_memory", "e.g. 80GB"),
        (["--num_gpus", "8", "--gpu_memory", "80XB"], "--gpu_memory", "like 80GB"),
        (["--num_gpus", "0", "--gpu_memory", "80GB"], "--num_gpus", ">= 1"),
        (["--num_gpu", "8"], "--num_gpu", "did you mean --num_gpus"),
        (["--peft.method", "lorra"], "peft.method", "did you mean 'lora'"),
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size", "must be >= 1"),
    ],
)
def test_bad_input_exits_2_naming_key_and_fix(assets, capsys, argv, key, fix):
    code = run_cli(["plan", "--model", assets.llama, *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert f"  - {key}: " in err and fix in err, err
    assert "Traceback" not in err


def test_missing_model_exits_2(capsys, tmp_path):
    assert run_cli(["plan", "--max_seq_length", "128"]) == 2
    assert "  - model: is required" in capsys.readouterr().err
    assert run_cli(["plan", "--model", str(tmp_path / "nowhere")]) == 2
    assert "  - model: cannot read the config" in capsys.readouterr().err
