"""FSDP2 by swapping the Accelerate config (fsdp2, fsdp2_offload, tp2_fsdp2): the run of one process, really
sharded, on CPU processes (gloo) through the one named workaround in finetune/parallel/fsdp.py."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
from conftest import (
    ROOT,
    base_args,
    crash_after,
    finetune,
    max_rel_diff,
    max_weight_diff,
    run_killing_the_group,
)

pytestmark = pytest.mark.slow

PROBE = """
import os, sys
from accelerate import Accelerator
if sys.argv[1] == "workaround":
    from finetune.config.schema import TrainArgs
    from finetune.parallel.fsdp import come_up_on_cpu
    come_up_on_cpu(TrainArgs(ddp_timeout=60))
acc = Accelerator()
print(f"rank {acc.process_index}: {acc.distributed_type} {acc.num_processes} fsdp2={acc.is_fsdp2}", flush=True)
if sys.argv[1] == "workaround":  # accelerate's default units for a model whose _no_split_modules hold its embeddings
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from transformers import BertConfig, BertForSequenceClassification
    size = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    try:
        fsdp2_prepare_model(acc, BertForSequenceClassification(BertConfig(**size)))
        print("bert with its embeddings unit: prepared", flush=True)
    except TypeError as e:
        print(f"bert with its embeddings unit: {e}", flush=True)
"""


def launch_probe(tmp_path, mode: str) -> str:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--local_addr", "127.0.0.1"]
    # c10d rendezvous on port 0: the agent binds a port the OS picks and tells its ranks (no port to race for).
    cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", str(script), mode]
    env = {**os.environ, "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "OMP_NUM_THREADS": "1"}
    env["FSDP_AUTO_WRAP_POLICY"] = "TRANSFORMER_BASED_WRAP"
    proc = run_killing_the_group(cmd, env, 120)
    return proc.stdout + proc.stderr


def test_accelerate_still_refuses_fsdp_on_cpu(tmp_path):
    """The reason for finetune.parallel.fsdp.come_up_on_cpu: without it, CPU ranks launched for FSDP do not
    come up as FSDP. When the first assertion fails, accelerate accepts FSDP on CPU: delete the workaround.
    And the reason for fsdp.wrap_classes: accelerate's default units (the model's _no_split_modules) fail for a
    BERT, which lists BertEmbeddings there. When the last assertion fails, accelerate shards it: delete that."""
    without = launch_probe(tmp_path, "plain")
    assert "rank 0:" in without and "DistributedType.FSDP" not in without, without[-2000:]
    with_it = launch_probe(tmp_path, "workaround")
    assert with_it.count("DistributedType.FSDP 2 fsdp2=True") == 2, with_it[-2000:]
    assert with_it.count("bert with its embeddings unit: Invariant encountered") == 2, with_it[-2000:]


def test_units_leave_out_the_classes_that_hold_the_input_embeddings(assets):
    """fsdp.wrap_classes: by default every _no_split_modules class but BertEmbeddings (the BERT classifier under
    fsdp2 runs: tests/test_resume_layouts.py::test_into_offloaded_zero_with_uneven_partitions); a decoder's layers
    unchanged; a user's list that names the embeddings' holder refused, naming the key and the fix."""
    from types import SimpleNamespace

    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from finetune.config import ConfigError
    from finetune.parallel.fsdp import wrap_classes

    def units(model, given=None):
        plugin = SimpleNamespace(auto_wrap_policy=transformer_auto_wrap_policy, transformer_cls_names_to_wrap=given)
        wrap_classes(plugin, model)
        return plugin.transformer_cls_names_to_wrap

    bert = AutoModelForSequenceClassification.from_pretrained(assets.bert, num_labels=3)
    assert units(bert) == ["BertLayer"]
    assert units(bert, ["BertLayer"]) == ["BertLayer"]
    with pytest.raises(ConfigError) as refused:
        units(bert, ["BertEmbeddings", "BertLayer"])
    assert "fsdp_transformer_layer_cls_to_wrap" in str(refused.value) and "BertEmbeddings out" in str(refused.value)
    llama = AutoModelForCausalLM.from_pretrained(assets.llama)
    assert units(llama) == sorted(llama._no_split_modules)


def test_transformers_still_lacks_replicate_parallel():
    """The reason for finetune.parallel.fsdp.replicate_parallel_shim (TP x FSDP2 in accelerate 1.15)."""
    import transformers.integrations.tensor_parallel as compat

    assert getattr(compat, "ReplicateParallel", None) is None


def single_ga4(assets, out, model: str):
    """The reference: one process, GA 4 (the global batch of 2 ranks x GA 2), 4 steps, checkpoint at 2."""
    return finetune(out, *fsdp_args(assets, model), "--gradient_accumulation_steps", "4")


def fsdp_args(assets, model: str) -> list[str]:
    return base_args(model, assets.instruction, "--max_steps", "4", "--save_steps", "2", "--eval_fraction", "0.1")


def hsdp_config(tmp_path) -> str:
    """accelerate_configs/fsdp2.yaml as HSDP on 4 processes (parallelism_config dp_replicate 2 x dp_shard 2: two
    copies of the model, each sharded over 2 ranks); its path, for finetune(launcher=...)."""
    import yaml

    acc = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp2.yaml").read_text())
    acc["num_processes"] = 4
    acc["parallelism_config"] = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}
    (tmp_path / "hsdp.yaml").write_text(yaml.safe_dump(acc))
    return str(tmp_path / "hsdp.yaml")


def test_fsdp2_and_hsdp_equal_one_process_and_resume_exactly(assets, tmp_path):
    """2 ranks x GA 2, fp32: per-step losses within 1e-5 relative of one process, exported weights within 1e-5;
    each rank really holds half the model (FSDP2 DTensors); 2 steps + resume + 2 steps equals 4 steps.
    (fsdp2_offload against one process: tests/test_deepspeed.py::test_parity_over_every_single_node_backend.)
    A Llama whose LM head is tied to its input embeddings: final/ holds the one tensor under one name, as one
    process exports it (FSDP2's gathered state dict has it twice; max_weight_diff compares the names).
    HSDP (hsdp_config: 4 data-parallel ranks x GA 1, the same global batch) takes the fsdp2 run over at its step-2
    checkpoint (converted by name): steps 3-4, the eval loss (40 rows: a round of 4 ranks x 8, then 8 rows on one
    rank) and final/ as one process's, within 1e-5, each rank holding half the model; its own step-3 checkpoint
    resumes under HSDP exactly, and in one process (converted, the log naming HSDP: topology.describe_layout)."""
    launcher, model = "fsdp2", assets.llama_tied
    single = single_ga4(assets, tmp_path / "single", model)
    run = finetune(
        tmp_path / launcher, *fsdp_args(assets, model), "--gradient_accumulation_steps", "2", launcher=launcher
    )
    rows = run.train_rows
    assert all(r["fsdp_version"] == 2 and 0.45 <= r["parameter_shard"] <= 0.55 for r in rows), rows[-1]
    assert not any(r["offload_params"] for r in rows) and "offload" not in run.output.split("parallelism:")[1][:80]
    assert max_rel_diff(single.losses(), run.losses()) <= 1e-5, (single.losses(), run.losses())
    assert max_weight_diff(single.output_dir / "final", run.output_dir / "final") <= 1e-5
    eval_a, eval_b = single.eval_rows[-1]["eval_loss"], run.eval_rows[-1]["eval_loss"]
    assert abs(eval_a - eval_b) / eval_a <= 1e-5

    part = tmp_path / "part"  # the same run, "crashed" after its step-2 checkpoint, resumed (FSDP's own format)
    shutil.copytree(run.output_dir, part)
    crash_after(part, 2)
    resumed = finetune(
        part,
        *fsdp_args(assets, model),
        "--gradient_accumulation_steps",
        "2",
        "--resume_from_checkpoint",
        "latest",
        launcher=launcher,
    )
    assert "converted" not in resumed.output and [r["step"] for r in resumed.train_rows] == [1, 2, 3, 4]
    assert max_rel_diff(run.losses(), resumed.losses()) <= 1e-6
    assert max_weight_diff(run.output_dir / "final", part / "final") <= 1e-6

    hsdp, more = hsdp_config(tmp_path), ["--resume_from_checkpoint", "latest", "--save_steps", "1"]
    taken_over = tmp_path / "hsdp"  # fsdp2 -> HSDP at step 2, checkpoints at 3 and 4
    shutil.copytree(run.output_dir, taken_over)
    crash_after(taken_over, 2)
    ga1 = [*fsdp_args(assets, model), "--gradient_accumulation_steps", "1"]
    over = finetune(taken_over, *ga1, *more, launcher=hsdp, timeout=600)
    assert "written by FSDP FSDP2 on 2 process(es), converted" in over.output
    assert "data parallel 4 (2 replicas x 2 shards)" in over.output
    rows = over.train_rows[2:]  # (steps 1-2 are the fsdp2 run's)
    assert [(r["step"], r["distributed_type"], r["world_size"], r["fsdp_version"]) for r in rows] == [
        (3, "FSDP", 4, 2),
        (4, "FSDP", 4, 2),
    ]
    assert all(0.45 <= r["parameter_shard"] <= 0.55 for r in rows), rows  # each replica's 2 ranks hold half each
    assert max_rel_diff(single.losses(), over.losses()) <= 1e-5, (single.losses(), over.losses())
    assert max_weight_diff(single.output_dir / "final", taken_over / "final") <= 1e-5
    assert abs(eval_a - over.eval_rows[-1]["eval_loss"]) / eval_a <= 1e-5, (eval_a, over.eval_rows[-1])
    for name, launcher, accumulation in (("hsdp_resumed", hsdp, "1"), ("hsdp_to_one", "python", "4")):
        again = tmp_path / name  # HSDP's step-3 checkpoint, resumed natively / in one process
        shutil.copytree(taken_over, again)
        crash_after(again, 3)
        ga = ["--gradient_accumulation_steps", accumulation]
        resumed = finetune(again, *fsdp_args(assets, model), *ga, *more, launcher=launcher, timeout=600)
        if launcher == hsdp:
            assert "converted" not in resumed.output and [r["step"] for r in resumed.train_rows] == [1, 2, 3, 4]
        else:
            assert "written by FSDP FSDP2 HSDP (2 replicas x 2 shards) on 4 process(es), converted" in resumed.output
        assert max_rel_diff(over.losses(), resumed.losses()) <= 1e-6, (name, over.losses(), resumed.losses())
        assert max_weight_diff(taken_over / "final", again / "final") <= 1e-6, name
        assert resumed.eval_rows[-1]["eval_loss"] == pytest.approx(over.eval_rows[-1]["eval_loss"], rel=1e-6), name


def test_tp2_x_fsdp2_on_four_processes_equals_one_process(assets, tmp_path):
    """TP 2 x FSDP 2 on 4 CPU processes: 2 data-parallel ranks x GA 2 = the reference's global batch; losses
    within 1e-4 relative; each rank holds about a quarter of the model. The model ties its LM head to its input
    embeddings (fsdp.untied_while_split; it failed to load before): the plan splits the one tensor over the
    vocabulary for both, and final/ holds it under one name, as one process exports it, and reloads tied.
    The eval loss within 1e-5 relative, as fsdp2's: the 40 eval rows are 2 rounds of 2 ranks x 8 and 8 more, and
    accelerate's gather_for_metrics counted rows 0-31 twice and 32-39 once (fsdp.gathered_once_per_tp_group)."""
    from transformers import AutoModelForCausalLM

    single = single_ga4(assets, tmp_path / "single", assets.llama_tied)
    run = finetune(
        tmp_path / "tp2_fsdp2",
        *fsdp_args(assets, assets.llama_tied),
        "--gradient_accumulation_steps",
        "2",
        launcher="tp2_fsdp2",
        timeout=600,
    )
    assert "data parallel 2 x tensor 2 x pipeline 1" in run.output
    assert "x data parallel 2 = global batch 16" in run.output
    rows = run.train_rows
    assert all(r["fsdp_version"] == 2 and 0.2 <= r["parameter_shard"] <= 0.3 for r in rows), rows[-1]
    assert max_rel_diff(single.losses(), run.losses()) <= 1e-4, (single.losses(), run.losses())
    assert max_weight_diff(single.output_dir / "final", run.output_dir / "final") <= 1e-4
    eval_a, eval_b = single.eval_rows[-1]["eval_loss"], run.eval_rows[-1]["eval_loss"]
    assert abs(eval_a - eval_b) / eval_a <= 1e-5, (eval_a, eval_b)
    reloaded = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_a_tied_head_is_split_with_its_embeddings_or_refused(assets):
    """fsdp.untied_while_split: the head has a Parameter of its own while the plan splits the model, and is tied
    again to the split embeddings after; split another way than the embeddings (a placement of its own), the
    model is refused, naming both and what to use instead."""
    from transformers import AutoModelForCausalLM

    from finetune.config import ConfigError
    from finetune.parallel.fsdp import untied_while_split

    llama = AutoModelForCausalLM.from_pretrained(assets.llama_tied)
    embed = llama.model.embed_tokens
    with untied_while_split(llama):
        assert llama.lm_head.weight is not embed.weight
        embed.weight = torch.nn.Parameter(embed.weight.detach().clone())  # as the plan replaces it
    assert llama.lm_head.weight is embed.weight and [n for n, _ in llama.named_parameters() if "lm_head" in n] == []
    with pytest.raises(ConfigError) as refused, untied_while_split(llama):
        llama.lm_head.weight.placements = ("Shard(dim=1)",)  # as a row-wise head's DTensor
    said = str(refused.value)
    assert "lm_head.weight" in said and "model.embed_tokens.weight" in said and "fsdp2.yaml" in said


def test_transformers_still_fails_on_a_tied_head(assets):
    """The reason for finetune.parallel.fsdp.untied_while_split: apply_tensor_parallelism finds a tied LM head's
    weight in named_parameters() under the embeddings' name only, and looks lm_head.weight up as a module. When
    this fails, transformers splits a loaded tied model: delete the workaround (test_tp2_x_fsdp2_... proves it)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    llama = AutoModelForCausalLM.from_pretrained(assets.llama_tied)
    plan = llama._expand_parallel_plan(dict(llama.tp_plan))
    head = {name: style for name, style in plan.items() if name.startswith("lm_head")}
    assert head == {"lm_head.weight": "colwise_gather_output", "lm_head": "colwise_gather_output"}
    with pytest.raises(KeyError, match="lm_head.weight"):
        apply_tensor_parallelism(llama, None, head)  # fails at the lookup, before it needs a mesh


def counted_over_tp2_x_dp2(n_rows: int, gather_for_metrics) -> dict[int, int]:
    """How often each eval row is counted when 4 ranks (dp_shard 2 x tp 2, accelerate's mesh: tp innermost) read
    accelerate's prepared eval loaders (batch 8) and gather with gather_for_metrics(accelerator, batch), in one
    process: each rank's loader as prepare_data_loader makes it for that rank, accelerate's gather as what it
    returns (every rank's batch, in rank order)."""
    from collections import Counter
    from types import SimpleNamespace

    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import GradientState

    class Mesh:  # what prepare_data_loader reads of accelerate's device mesh: its names and sizes
        sizes = {"dp_shard": 2, "tp": 2}
        mesh_dim_names = tuple(sizes)

        def __getitem__(self, name: str):
            return SimpleNamespace(size=lambda: self.sizes[name])

    loaders = [
        prepare_data_loader(
            torch.utils.data.DataLoader(torch.arange(n_rows), batch_size=8), num_processes=4, process_index=rank,
            torch_device_mesh=Mesh(),
        )
        for rank in range(4)
    ]  # fmt: skip
    counted: Counter = Counter()
    for batches in zip(*loaders):
        accelerator = SimpleNamespace(gather=lambda _, b=batches: {"row": torch.cat(b)}, gradient_state=GradientState())
        counted.update(gather_for_metrics(accelerator, {"row": batches[0]})["row"].tolist())
    return {row: counted[row] for row in range(n_rows)}


def test_accelerate_still_counts_every_tp_copy_of_an_eval_row():
    """The reason for finetune.parallel.fsdp.gathered_once_per_tp_group: under TP x FSDP2 accelerate's
    gather_for_metrics keeps every TP rank's copy of a batch, and cuts the last round by a remainder counted in
    data-parallel batches: with 40 rows (2 rounds of 16 and 8) rows 32-39 count once, the others twice (the eval
    loss weighs the last 8 rows half); with 44, rows 40-43 are dropped and 36-39 count once. When this fails,
    accelerate counts each row once (or gathers otherwise): check the eval loss of
    test_tp2_x_fsdp2_on_four_processes_equals_one_process without the workaround, then delete it and this test."""
    from accelerate import Accelerator

    def accelerate(accelerator, stats):
        return Accelerator.gather_for_metrics(accelerator, stats)

    counted = counted_over_tp2_x_dp2(40, accelerate)
    assert [r for r, n in counted.items() if n == 1] == list(range(32, 40)) and set(counted.values()) == {1, 2}
    counted = counted_over_tp2_x_dp2(44, accelerate)
    assert [r for r, n in counted.items() if n == 0] == list(range(40, 44))
    assert [r for r, n in counted.items() if n == 1] == list(range(36, 40))


def test_every_eval_row_counts_once_under_tp_x_fsdp2():
    """fsdp.gathered_once_per_tp_group: each row of the eval set once, whether the eval set fills the last round of
    data-parallel batches (32 rows), leaves part of one rank's batch (40), runs into the next rank's (44), or is
    smaller than one batch (5)."""
    from finetune.parallel.fsdp import gathered_once_per_tp_group
    from finetune.parallel.topology import Topology

    topology = Topology("fsdp", "FSDP", num_processes=4, num_machines=1, process_index=0, dp=2, tp=2, fsdp_version=2)
    for n_rows in (32, 40, 44, 5):
        counted = counted_over_tp2_x_dp2(n_rows, lambda acc, stats: gathered_once_per_tp_group(acc, stats, topology))
        assert set(counted.values()) == {1}, (n_rows, counted)


def test_transformers_still_replaces_the_device_mesh():
    """The reason for finetune.parallel.fsdp.tensor_parallel_on: from_pretrained(tp_plan=..., device_mesh=...)
    replaces the given mesh by one of its own over every rank. When this fails, transformers honours
    device_mesh: load with tp_plan="auto", device_mesh=accelerate's "tp" mesh, and delete the workaround."""
    import inspect

    from transformers import PreTrainedModel

    source = inspect.getsource(PreTrainedModel.from_pretrained)
    assert "device_mesh = mesh_manager.get_mesh(" in source
