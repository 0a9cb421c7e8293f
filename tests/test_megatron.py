"""Tensor and pipeline parallelism on a CPU machine.

Megatron-LM is GPU only: here it must be refused up front, clearly, with exit code 2, and the plugin finetune
builds must be what accelerate expects. Torch-native TP (accelerate_configs/tp2.yaml) runs on 2 CPU ranks and
must give the losses of one process, resume exactly and export a model that reloads.
"""

from __future__ import annotations

import json
import os
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, base_args, crash_after, finetune, max_rel_diff, max_weight_diff, qwen3_moe_model

from finetune.config import ConfigError, build_config
from finetune.parallel import megatron, tensor
from finetune.parallel.topology import Launcher, Topology, requested_family

MEGATRON = ["megatron_tp2", "megatron_tp2_pp2", "megatron_tp2_pp2_multinode"]


LAUNCH_KEYS = ("ACCELERATE_USE_", "MEGATRON_LM_", "PARALLELISM_CONFIG_")  # what a launcher tells a rank


def launch_env(name: str, *launch_args: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file accelerate_configs/<name>.yaml` gives each rank,
    computed by accelerate's own launcher code (plus WORLD_SIZE, which torchrun adds)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    argv = ["--config_file", str(ROOT / "accelerate_configs" / f"{name}.yaml"), "--main_process_port", "0"]
    args = launch_command_parser().parse_args([*argv, *launch_args, "-m", "finetune"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {**{k: v for k, v in env.items() if k.startswith(LAUNCH_KEYS)}, "WORLD_SIZE": str(args.num_processes)}


@pytest.fixture
def run_values(assets, tmp_path) -> dict:
    return {
        "model": assets.llama,
        "dataset": assets.instruction,
        "output_dir": str(tmp_path / "out"),
        "max_seq_length": 64,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
    }


def with_converted_checkpoint(model_dir, tmp_path, tp: int = 2, pp: int = 1):
    """A copy of a model dir holding a (fake, legacy-layout) converted Megatron checkpoint."""
    import shutil

    model = tmp_path / "model_with_megatron"
    shutil.copytree(model_dir, model)
    step = model / "megatron" / "iter_0000001"
    for t in range(tp):
        (step / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{0:03d}")).mkdir(parents=True)
        for p in range(1, pp):
            (step / f"mp_rank_{t:02d}_{p:03d}").mkdir(parents=True)
    (model / "megatron" / "latest_checkpointed_iteration.txt").write_text("1\n")
    return str(model)


# ---------------------------------------------------------------- shipped configs


def test_megatron_and_tp_configs_say_what_their_names_say():
    expected = {  # name: (tp, pp, num_micro_batches, processes, machines)
        "megatron_tp2": (2, 1, 1, 2, 1),
        "megatron_tp2_pp2": (2, 2, 4, 4, 1),
        "megatron_tp2_pp2_multinode": (2, 2, 4, 16, 2),
    }
    for name, (tp, pp, micro, procs, machines) in expected.items():
        raw = yaml.safe_load((ROOT / "accelerate_configs" / f"{name}.yaml").read_text())
        assert raw["distributed_type"] == "MEGATRON_LM"
        assert (raw["num_processes"], raw["num_machines"]) == (procs, machines), name
        env = launch_env(name)
        layout = megatron.MegatronLayout.from_env(env)
        assert (layout.tp, layout.pp, layout.num_micro_batches) == (tp, pp, micro), name
        assert requested_family(env) == "megatron" and Launcher.read(env).tp_size == 1
    env = launch_env("tp2")
    assert Launcher.read(env).tp_size == 2 and requested_family(env) == "tensor"
    assert env["WORLD_SIZE"] == "2"


# ---------------------------------------------------------------- the plugin finetune builds


@pytest.mark.parametrize("name", MEGATRON)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_plugin_matches_what_accelerate_expects(assets, run_values, monkeypatch, name, arch):
    """Our kwargs, through accelerate's own MegatronLMPlugin and the calls accelerate.prepare makes
    (_prepare_megatron_lm), give Megatron the layout of the Accelerate config and the run config's values."""
    from accelerate.utils import MegatronLMPlugin
    from transformers import AutoModelForCausalLM

    from finetune.data import Collator
    from finetune.parallel import make_plan
    from finetune.parallel.plan import Plan

    env = launch_env(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = build_config({**run_values, "model": getattr(assets, arch), "max_grad_norm": 0.5, "warmup_steps": 3})
    layout = megatron.MegatronLayout.from_env()
    world = int(env["WORLD_SIZE"])
    plugin = MegatronLMPlugin(**megatron.plugin_kwargs(cfg))
    from_env_only = MegatronLMPlugin()  # what accelerate builds from the launcher's environment alone
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_micro_batches", "sequence_parallel"):
        assert plugin.megatron_lm_default_args[key] == from_env_only.megatron_lm_default_args[key], key
    assert (plugin.tp_degree, plugin.pp_degree, plugin.num_micro_batches) == (
        layout.tp,
        layout.pp,
        layout.num_micro_batches,
    )

    # What accelerate.prepare does with a train loader, the model and the scheduler (GPU-free part).
    model = AutoModelForCausalLM.from_pretrained(getattr(assets, arch))
    batch = Collator(0)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}] * 4)  # shorter than max_seq_length
    micro = cfg.train.per_device_train_batch_size
    dp = world // (plugin.tp_degree * plugin.pp_degree)
    plugin.set_training_args(micro, dp)
    plugin.set_network_size_args(model, batch)
    topo = Topology(
        "megatron",
        "MEGATRON_LM",
        world,
        1,
        0,
        dp=dp,
        tp=layout.tp,
        pp=layout.pp,
        num_micro_batches=layout.num_micro_batches,
    )
    plan: Plan = make_plan(cfg.train, 10_000, topo)
    rows, data_parallel = plan.micro_batch_size, plan.data_parallel_size
    scheduler = megatron.make_scheduler(torch.optim.AdamW(model.parameters()), plan, plan.warmup_steps)
    plugin.set_scheduler_args(scheduler)
    args = plugin.megatron_lm_default_args
    assert args["tensor_model_parallel_size"] == 2
    assert args["pipeline_model_parallel_size"] == layout.pp
    assert args["data_parallel_size"] == data_parallel == dp
    assert args["micro_batch_size"] == micro
    assert args["global_batch_size"] == data_parallel * rows == dp * micro * layout.num_micro_batches
    assert args["seq_length"] == cfg.data.max_seq_length  # fixed, not the first batch's width
    assert args["clip_grad"] == 0.5
    assert (args["train_iters"], args["lr_warmup_iters"]) == (plan.total_steps, 3)
    assert args["lr_decay_style"] == "linear" and args["seed"] == cfg.train.seed
    # No <model>/megatron: finetune converts the HF weights into the run's output_dir at start (ensure_converted)
    assert args["pretrained_checkpoint"] == os.path.join(cfg.train.output_dir, "megatron", f"tp2_pp{layout.pp}")
    assert args["make_vocab_size_divisible_by"] == 1  # the padded vocabulary is the real one (600 = 2 x 300)
    assert args["transformer_impl"] == "local"  # no Transformer Engine here: the local spec, no fused kernels
    assert args["eos_token_id"] == model.config.eos_token_id
    assert args["context_parallel_size"] == 1 and args["recompute_granularity"] is None
    if arch == "llama":  # what accelerate's parser leaves out of a Llama's architecture
        c = model.config
        assert args["swiglu"] and args["normalization"] == "RMSNorm" and not args["add_bias_linear"]
        assert (args["num_query_groups"], args["ffn_hidden_size"]) == (c.num_key_value_heads, c.intermediate_size)
    else:
        assert args["position_embedding_type"] != "rope" if "position_embedding_type" in args else True
        assert plugin.megatron_lm_default_args.get("use_rotary_position_embeddings") is not True


def test_transformer_engine_without_apex_builds_without_the_fused_weight_gradient(assets, run_values, monkeypatch):
    """Megatron fuses the weight gradient's accumulation by default, and its output layer (Megatron's own, under
    Transformer Engine's spec too) refuses to be built without Apex's extension: with Transformer Engine alone the
    fusion is off; with Apex it stays on (the fast path of NGC containers)."""
    import importlib.util

    for k, v in launch_env("megatron_tp2").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(megatron, "uses_transformer_engine", lambda: True)
    cfg = build_config({**run_values, "model": assets.llama})
    real = importlib.util.find_spec
    for apex in (False, True):
        fake = types.SimpleNamespace(name="fused_weight_gradient_mlp_cuda") if apex else None

        def find_spec(name, *more, fake=fake):
            return fake if name == "fused_weight_gradient_mlp_cuda" else real(name, *more)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        other = megatron.plugin_kwargs(cfg)["other_megatron_args"]
        assert other["gradient_accumulation_fusion"] is apex
        assert "transformer_impl" not in other  # Megatron's default spec: Transformer Engine's
    vendor = Path(os.environ.get("FINETUNE_MEGATRON_LM", ROOT.parent / "shared/vendor/megatron-lm-9a1c0d05"))
    layers = vendor / "megatron/core/tensor_parallel/layers.py"
    if layers.exists():  # the refusal this avoids, in the Megatron-LM that docs/megatron.md pins
        text = layers.read_text()
        assert "import fused_weight_gradient_mlp_cuda" in text
        assert "if config.gradient_accumulation_fusion and not _grad_accum_fusion_available:" in text


def test_transformers_still_saves_on_rank_0_only(assets, monkeypatch, tmp_path):
    """The reason for parallel.base.save_from_this_process: under torch.distributed, save_pretrained writes on rank
    0 only, whatever is_main_process says (accelerate's main process under Megatron-LM is the last rank). When the
    first assertion fails, transformers leaves it to the caller: delete the workaround."""
    import transformers.distributed.mixin as mixin
    from transformers import AutoModelForCausalLM

    from finetune.parallel.base import save_from_this_process

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)  # the last of 2 ranks
    net = AutoModelForCausalLM.from_pretrained(assets.llama)
    net.save_pretrained(tmp_path / "plain", is_main_process=True)
    assert not (tmp_path / "plain" / "model.safetensors").exists()
    save_from_this_process(net, tmp_path / "ours")
    assert (tmp_path / "ours" / "model.safetensors").exists() and (tmp_path / "ours" / "config.json").exists()
    assert "should_save_on_this_rank" not in vars(net)


def test_gpt_inputs_supervise_what_the_other_backends_supervise(assets):
    """Megatron's (tokens, labels, loss_mask) from our batch: the same supervised next-token targets as the HF
    loss (labels shifted inside the model), padded to the fixed sequence length."""
    from finetune.data import Collator

    examples = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
        {"input_ids": [10, 11, 12], "labels": [-100, 11, 12]},
    ]
    batch = Collator(0)(examples)
    tokens, target, mask, attention, positions = megatron.megatron_gpt_inputs(batch, seq_length=16)
    assert tokens.shape == target.shape == mask.shape == positions.shape == (2, 16)
    assert attention.shape == (1, 1, 16, 16) and attention[0, 0, 0, 1] and not attention[0, 0, 1, 0]
    hf_targets = batch["labels"][:, 1:]
    supervised = hf_targets != -100
    assert int(mask.sum()) == int(batch["num_supervised"]) == 5
    assert torch.equal(mask[:, : hf_targets.shape[1]].bool(), supervised)
    assert torch.equal(target[:, : hf_targets.shape[1]][supervised], hf_targets[supervised])
    assert torch.equal(tokens[:, :8], batch["input_ids"])


def test_the_loop_steps_that_do_nothing_under_megatron_say_so():
    """Under Megatron-LM the step runs inside forward_loss; the prepared optimizer and scheduler the loop then calls
    are accelerate's no-op wrappers, the same objects under names that say where the step runs."""
    from accelerate.utils.megatron_lm import MegatronLMOptimizerWrapper, MegatronLMSchedulerWrapper

    optimizer = MegatronLMOptimizerWrapper.__new__(MegatronLMOptimizerWrapper)  # no Accelerator: no __init__
    scheduler = MegatronLMSchedulerWrapper.__new__(MegatronLMSchedulerWrapper)
    assert megatron._named(optimizer, megatron.OptimizerStepRunsInForward) is optimizer
    assert megatron._named(scheduler, megatron.SchedulerStepRunsInForward) is scheduler
    assert type(optimizer).__name__ == "OptimizerStepRunsInForward" and isinstance(
        optimizer, MegatronLMOptimizerWrapper
    )
    assert type(scheduler).__name__ == "SchedulerStepRunsInForward" and isinstance(
        scheduler, MegatronLMSchedulerWrapper
    )
    assert "forward_loss" in type(optimizer).__doc__ and "forward_loss" in type(scheduler).__doc__
    assert optimizer.step() is None and optimizer.zero_grad(set_to_none=True) is None and scheduler.step() is None


# ---------------------------------------------------------------- refusals, one problem at a time


def launched_as(monkeypatch, name: str) -> None:
    """This process's environment as a rank of `accelerate launch --config_file <name>.yaml` has it, and nothing
    left from another config: in-process code that ran before in this worker (an Accelerator built with a DeepSpeed
    or FSDP plugin sets ACCELERATE_USE_DEEPSPEED / _FSDP for good) would otherwise change the family."""
    for key in [k for k in os.environ if k.startswith(LAUNCH_KEYS)]:
        monkeypatch.delenv(key)
    for k, v in launch_env(name).items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def on_a_gpu_machine_with_megatron(monkeypatch):
    """Pretend CUDA and Megatron-LM are there, so that one refusal at a time can be looked at."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron, "megatron_lm_missing", lambda: None)
    launched_as(monkeypatch, "megatron_tp2")


def check(cfg) -> None:
    """What make_accelerator does before Accelerator(): the launched family's refusals, all at once."""
    from finetune.parallel.environment import family_module

    found = family_module().problems(cfg)
    if found:
        raise ConfigError(found)


def problems(cfg) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        check(cfg)
    assert "Traceback" not in info.value.render()
    return {k: m for k, m in info.value.problems}


def test_a_supported_megatron_run_passes_the_checks(on_a_gpu_machine_with_megatron, run_values, assets, tmp_path):
    model = with_converted_checkpoint(assets.llama, tmp_path)
    check(build_config({**run_values, "model": model}))


@pytest.mark.parametrize(
    "change, key, words",
    [
        ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps", "megatron_lm_num_micro_batches: 4"),
        ({"per_device_eval_batch_size": 2}, "per_device_eval_batch_size", "micro batch"),
        ({"peft": {"method": "lora"}}, "peft.method", "peft.method: none"),
        ({"packing": True}, "packing", "packing: false"),
        ({"length_aware_batching": True}, "length_aware_batching", "length_aware_batching: false"),
        (
            {"load_best_model_at_end": True, "eval_steps": 2, "save_steps": 2},
            "load_best_model_at_end",
            "load_best_model_at_end: false",
        ),
        ({"max_seq_length": 63}, "max_seq_length", "multiple of megatron_lm_tp_degree 2"),
        ({"task": "classification"}, "task", "causal_lm"),
    ],
)
def test_each_megatron_refusal_names_its_key_and_fix(
    on_a_gpu_machine_with_megatron, run_values, assets, tmp_path, change, key, words
):
    values = {**run_values, "model": with_converted_checkpoint(assets.llama, tmp_path), **change}
    if change.get("task") == "classification":
        values["dataset"] = assets.classification
    found = problems(build_config(values))
    assert list(found) == [key], found
    assert words in found[key]


def test_unsupported_model_type_is_refused_before_loading(on_a_gpu_machine_with_megatron, run_values, assets):
    found = problems(build_config({**run_values, "model": assets.bert}))
    assert list(found) == ["model"]
    assert "'bert'" in found["model"] and "MODEL_CONFIGS_TO_MEGATRON_PARSERS" in found["model"]
    assert "tp2.yaml" in found["model"]
    assert megatron.megatron_family("bert") is None and megatron.megatron_family("megatron-bert") == "megatron-bert"
    assert set(megatron.supported_model_types()) >= {"gpt2", "llama", "megatron-bert"}


LLAMA3_ROPE = {  # Llama 3.1's
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama_3_rope_goes_to_megatron_and_what_it_cannot_build_is_refused(
    on_a_gpu_machine_with_megatron, run_values, assets, tmp_path
):
    """Llama 3.x's RoPE scaling reaches Megatron (use_rope_scaling; it trained plain RoPE and said nothing: final/
    2.4e-3 off one process's, test_megatron_cpu's bf16 checkpoint test compares it). What the Megatron-LM finetune
    builds cannot be is refused under `model` before anything loads: biases (its Llama had none and the conversion
    dropped them), other RoPE scalings or llama3 values, and Llama-named model types of other architectures
    (accelerate's substring rule took llama4_text for llama, and the conversion failed with a KeyError)."""
    import shutil

    from transformers import LlamaConfig

    args = megatron.architecture_args(LlamaConfig(rope_parameters=LLAMA3_ROPE), "llama")
    assert (args["use_rope_scaling"], args["rope_scaling_factor"], args["rotary_base"]) == (True, 8.0, 500000)
    assert "use_rope_scaling" not in megatron.architecture_args(LlamaConfig(), "llama")

    def with_config(name: str, **change) -> str:
        model = tmp_path / name
        shutil.copytree(assets.llama, model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **change}))
        return str(model)

    check(build_config({**run_values, "model": with_config("llama3", rope_parameters=LLAMA3_ROPE)}))
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 128}
    refused = {
        "attention_bias: true and mlp_bias: true": with_config("bias", attention_bias=True, mlp_bias=True),
        "factor 32.0": with_config("llama3_2", rope_parameters={**LLAMA3_ROPE, "factor": 32.0}),
        "rope_type 'yarn'": with_config("yarn", rope_parameters=yarn),
        "model type 'llama4_text' is not one": with_config("llama4", model_type="llama4_text"),
    }
    for words, model in refused.items():
        found = problems(build_config({**run_values, "model": model}))
        assert list(found) == ["model"] and words in found["model"], (words, found)


def test_megatron_reports_eval_values_over_all_rows_only(on_a_gpu_machine_with_megatron, run_values, assets):
    """Megatron-LM's eval statistics are sums over each batch (and over the data-parallel replicas), so they carry no
    row to tag with a mixture's source: no eval_<source>_... is reported, and a per-source metric_for_best_model is
    refused at start. Before, the per-source values came out whenever a batch was one row (and were this rank's
    rows' tags on every replica's sums: wrong), and such a metric failed after the steps to the first eval."""
    from finetune.mixture import summarize_by_source

    backend = megatron.Backend.__new__(megatron.Backend)  # gather_for_metrics needs no state
    one_row_batch = {"nll": torch.tensor([12.0]), "count": torch.tensor([4.0]), "source": torch.tensor([1])}
    out = summarize_by_source(backend.gather_for_metrics(one_row_batch), {}, None, ["aa", "bb"])
    assert set(out) == {"eval_loss", "eval_perplexity"} and out["eval_loss"] == 3.0, out

    values = {k: v for k, v in run_values.items() if k != "dataset"}
    values["datasets"] = [{"dataset": assets.instruction, "format": "instruction", "name": n} for n in ("aa", "bb")]
    values |= {"eval_fraction": 0.1, "eval_steps": 2, "save_steps": 2, "metric_for_best_model": "eval_bb_loss"}
    found = problems(build_config(values))
    assert list(found) == ["metric_for_best_model"], found
    assert "'eval_bb_loss'" in found["metric_for_best_model"] and "eval_loss" in found["metric_for_best_model"]
    check(build_config({**values, "metric_for_best_model": "eval_loss"}))


def test_the_documented_megatron_commands_pass_the_checks(monkeypatch, assets, tmp_path):
    """docs/megatron.md's Run commands, with a local model and data in place of the Hub's (and the tiny model's 512
    positions): accepted as written
    (examples/sft.yaml alone is refused, for each override the doc gives). Before, the doc's command was refused."""
    from finetune.config import parse

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron, "megatron_lm_missing", lambda: None)
    monkeypatch.chdir(ROOT)
    run = (ROOT / "docs" / "megatron.md").read_text().split("### Run", 1)[1].split("\n### ", 1)[0]
    commands = re.findall(
        r"accelerate launch --config_file accelerate_configs/(\w+)\.yaml -m finetune ([^\n]*\\\n[^\n]*)", run
    )
    assert [name for name, _ in commands] == ["megatron_tp2", "megatron_tp2_pp2"], run
    local = ["--dataset", assets.instruction, "--output_dir", str(tmp_path / "out"), "--max_seq_length", "512"]
    for name, command in commands:
        argv = command.replace("\\\n", " ").split()
        argv[argv.index("--model") + 1] = assets.llama
        launched_as(monkeypatch, name)
        check(parse([*argv, *local]))
        found = problems(parse(["--config", "examples/sft.yaml", "--model", assets.llama, *local]))
        assert set(found) == {"gradient_accumulation_steps", "packing", "per_device_eval_batch_size"}, found


def test_missing_or_mismatched_converted_checkpoint(on_a_gpu_machine_with_megatron, run_values, assets, tmp_path):
    check(build_config(run_values))  # no <model>/megatron: finetune converts the HF weights itself
    model = with_converted_checkpoint(assets.llama, tmp_path, tp=4)
    assert megatron.checkpoint_layout(os.path.join(model, "megatron")) == (4, 1)
    found = problems(build_config({**run_values, "model": model}))
    assert "--target-tensor-parallel-size 2" in found["model"] and "remove it" in found["model"]
    os.remove(os.path.join(model, "megatron", "latest_checkpointed_iteration.txt"))
    found = problems(build_config({**run_values, "model": model}))
    assert "holds no Megatron-LM checkpoint" in found["model"]
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    for name in os.listdir(assets.llama):
        if name != "model.safetensors":
            (bin_only / name).write_bytes((Path(assets.llama) / name).read_bytes())
    found = problems(build_config({**run_values, "model": str(bin_only)}))
    assert "holds no model.safetensors" in found["model"]


def test_megatron_lm_missing_names_what_accelerate_imports(monkeypatch, tmp_path):
    assert megatron.megatron_lm_missing() == "no `megatron` package is installed"  # this machine
    # megatron-core's wheel without the Megatron-LM source tree: megatron.core only.
    fake = tmp_path / "site"
    (fake / "megatron" / "core").mkdir(parents=True)
    (fake / "megatron" / "__init__.py").write_text("")
    (fake / "megatron" / "core" / "__init__.py").write_text("")
    (fake / "megatron_core-0.14.0.dist-info").mkdir()
    (fake / "megatron_core-0.14.0.dist-info" / "METADATA").write_text("Name: megatron-core\nVersion: 0.14.0\n")
    monkeypatch.syspath_prepend(str(fake))
    try:
        why = megatron.megatron_lm_missing()
    finally:  # find_spec imported the fake package: forget it
        for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
            del sys.modules[name]
    assert "megatron.training, megatron.legacy, megatron.training.gpt_builders are not" in why and "source tree" in why


def run_refused(tmp_path, env_of: str, *args: str):
    """python -m finetune in the environment accelerate launch gives a rank of `env_of` (rank 0)."""
    return finetune(
        tmp_path / "run",
        *args,
        launcher="python",
        expect_ok=False,
        extra_env={**launch_env(env_of), "RANK": "0", "LOCAL_RANK": "0"},
        timeout=120,
    )


def test_no_cuda_is_refused_with_exit_2(assets, tmp_path):
    res = run_refused(tmp_path, "megatron_tp2", *base_args(assets.llama, assets.instruction, "--max_steps", "2"))
    assert res.returncode == 2, res.output[-3000:]
    assert "needs NVIDIA GPUs and CUDA, and this machine has none" in res.output
    assert "Traceback" not in res.output and "distributed:" not in res.output  # refused before Accelerator()


def test_no_megatron_lm_is_refused_with_exit_2(assets, tmp_path):
    res = run_refused(tmp_path, "megatron_tp2_pp2", *base_args(assets.llama, assets.instruction, "--max_steps", "2"))
    assert res.returncode == 2, res.output[-3000:]
    assert "Megatron-LM is not installed (no `megatron` package is installed)" in res.output
    assert "pip install --no-build-isolation -e Megatron-LM" in res.output and "Traceback" not in res.output


def test_unsupported_model_type_is_refused_with_exit_2(assets, tmp_path):
    args = base_args(assets.bert, assets.classification, "--task", "classification", "--max_steps", "2")
    res = run_refused(tmp_path, "megatron_tp2", *args)
    assert res.returncode == 2, res.output[-3000:]
    assert "model type 'bert' is not one accelerate's Megatron-LM integration can build" in res.output
    assert "Loading weights" not in res.output and "Traceback" not in res.output


def test_accelerate_launch_reaches_the_refusal_on_cpu(assets, tmp_path):
    """The real launcher starts its ranks on a machine without GPUs; every rank refuses (exit 2), rank 0 says why."""
    res = finetune(
        tmp_path / "run",
        *base_args(assets.llama, assets.instruction, "--max_steps", "2", "--gradient_accumulation_steps", "2"),
        launcher="megatron_tp2",
        expect_ok=False,
        timeout=120,
    )
    assert res.returncode == 2, res.output[-3000:]  # the rank's code, through the launcher (launcher_report)
    # The ranks' output, then the launcher's report, which names the message from torchrun's error file.
    ours, report = res.output.split("[launcher] finetune failed:", 1)
    assert ours.count("needs NVIDIA GPUs and CUDA") <= 1, res.output[-3000:]  # printed by rank 0 only
    assert "needs NVIDIA GPUs and CUDA" in report and "Traceback" not in res.output
    assert "gradient_accumulation_steps: must be 1 under Megatron-LM, got 2" in res.output


# ---------------------------------------------------------------- torch-native tensor parallelism


def test_accelerate_still_refuses_tp_on_cpu():
    """The reason for megatron.CpuTensorParallelConfig. When this fails, accelerate accepts TP on MULTI_CPU:
    delete the workaround (parallelism_config() can return None everywhere) and this test."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    cpu_ranks = types.SimpleNamespace(
        distributed_type=DistributedType.MULTI_CPU,
        multi_device=False,
        is_fsdp2=False,
        num_processes=2,
        is_main_process=True,
    )
    with pytest.raises(ValueError, match="only compatible .* but got DistributedType.MULTI_CPU"):
        ParallelismConfig(tp_size=2)._validate_accelerator(cpu_ranks)
    cpu_config = tensor._cpu_tp_config_class()(tp_size=2)
    cpu_config._validate_accelerator(cpu_ranks)  # the workaround accepts it
    with pytest.raises(ValueError, match="does not match num_processes"):
        cpu_config._validate_accelerator(types.SimpleNamespace(**{**vars(cpu_ranks), "num_processes": 4}))


def test_transformers_still_reduces_the_accumulated_gradient(monkeypatch):
    """The reason for tensor.per_backward_grad_all_reduce: transformers' "replicated_with_grad_allreduce" style (Qwen3's
    q_norm/k_norm) all-reduces param.grad after each micro batch's backward, i.e. the sum so far. Two ranks holding
    the same gradients (an all_reduce that doubles), two micro batches: transformers' gradient is 2 x (2 x G1 + G2),
    the workaround's the reduced sum 2 x (G1 + G2). When this fails, transformers reduces each backward's own
    gradient (or no longer through this hook): check test_tp2_on_cpu_equals_one_process_and_resumes_exactly without
    the workaround, then delete it and this test."""
    import torch.distributed as dist
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, ReplicatedWithGradAllReduce

    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, **kw: t.mul_(2))  # 2 ranks, equal gradients
    mesh = types.SimpleNamespace(get_group=lambda *a: None)
    micro_batches = [torch.tensor([[1.0, 2.0]]), torch.tensor([[10.0, 20.0]])]  # the gradients they give: themselves

    def accumulated(style) -> list[float]:
        layer = style.install_forward(torch.nn.Linear(2, 1, bias=False), mesh)
        for x in micro_batches:
            layer(x).sum().backward()
        return layer.weight.grad.flatten().tolist()

    g1, g2 = (x.flatten() for x in micro_batches)
    assert isinstance(ALL_PARALLEL_STYLES["replicated_with_grad_allreduce"], ReplicatedWithGradAllReduce)
    transformers_style = ReplicatedWithGradAllReduce()
    assert accumulated(transformers_style) == (2 * (2 * g1 + g2)).tolist()  # [24, 48], not [22, 44]

    monkeypatch.setitem(type(ALL_PARALLEL_STYLES)._global_mapping, "replicated_with_grad_allreduce", transformers_style)
    tensor.per_backward_grad_all_reduce()  # what a TP run registers before its model loads
    assert accumulated(ALL_PARALLEL_STYLES["replicated_with_grad_allreduce"]) == (2 * (g1 + g2)).tolist()


def test_tp_refusals(monkeypatch, run_values, assets):
    launched_as(monkeypatch, "tp2")
    check(build_config(run_values))  # llama, causal LM: fine
    found = problems(build_config({**run_values, "model": assets.gpt2}))
    assert "no tensor-parallel plan" in found["model"]
    found = problems(
        build_config(
            {**run_values, "task": "classification", "dataset": assets.classification, "peft": {"method": "lora"}}
        )
    )
    assert set(found) == {"task", "peft.method"}
    monkeypatch.setenv("WORLD_SIZE", "4")
    found = problems(build_config(run_values))
    assert "tp_size 2, 4 processes" in found["accelerate config"] and "tp2_fsdp2.yaml" in found["accelerate config"]


@pytest.mark.slow
def test_tp2_on_cpu_equals_one_process_and_resumes_exactly(assets, tmp_path):
    """TP 2 on 2 CPU ranks (gloo), 2 micro batches a step: per-step losses within 1e-6 relative of one process and
    the exported weights within 1e-5 absolute, as the other layouts' (docs/megatron.md gives the measured figures);
    2 steps + resume + 2 steps equals 4 steps; final/ is a whole model that reloads. The model ties its LM head to
    its input embeddings: final/ has the names one process's has (max_weight_diff), not a gathered lm_head.weight
    besides. It is a Qwen3-MoE with q/k/v biases: Qwen2's sharded biases beside plain norms in AdamW's no-decay group
    (the fused kernel refuses a group mixing DTensors and tensors: optim.build_optimizer), per-head q_norm/k_norm,
    whose gradient transformers sums over the ranks (wrong under gradient accumulation without
    tensor.per_backward_grad_all_reduce: final/ q_norm 2e-3 off), a dense MLP in its first layer and 4 experts, 2
    per token, in its second (transformers' moe_tp_experts: the fused gate_up_proj split packed, down_proj by rows,
    the router's gate a plain tensor); final/ holds the experts one by one, as the Hub's checkpoints do."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = qwen3_moe_model(assets.tokenizer, tmp_path / "qwen3_moe")
    args = base_args(model, assets.instruction, "--max_steps", "4", "--save_steps", "2", "--eval_fraction", "0.1")
    args += ["--gradient_accumulation_steps", "2"]
    single = finetune(tmp_path / "single", *args)
    tp = finetune(tmp_path / "tp", *args, launcher="tp2")
    assert "distributed: MULTI_CPU, world size 2," in tp.output, tp.output[-3000:]
    assert "x data parallel 1 = global batch 8" in tp.output  # both ranks hold the same batch
    a, b = single.losses(), tp.losses()
    assert len(a) == len(b) == 4
    loss_diff = max_rel_diff(a, b)
    weight_diff = max_weight_diff(single.output_dir / "final", tp.output_dir / "final")
    print(f"TP 2 against one process: losses {loss_diff:.1e} relative, weights {weight_diff:.1e} absolute")
    assert loss_diff <= 1e-6, (a, b)
    assert weight_diff <= 1e-5
    assert abs(single.eval_rows[-1]["eval_loss"] - tp.eval_rows[-1]["eval_loss"]) <= 1e-6
    assert [r["learning_rate"] for r in single.train_rows] == [r["learning_rate"] for r in tp.train_rows]
    for key in ("tokens_seen", "padding_fraction"):  # each TP rank counts the batch both hold: counted once
        assert [r[key] for r in single.train_rows] == pytest.approx([r[key] for r in tp.train_rows]), key

    step2 = tp.output_dir / "checkpoints" / "step_2"
    saved = load_file(str(step2 / "model.safetensors"))  # whole tensors, not rank 0's shards
    whole = load_file(str(single.output_dir / "checkpoints" / "step_2" / "model.safetensors"))
    assert whole and {k: saved[k].shape for k in whole} == {k: v.shape for k, v in whole.items()}
    base = load_file(os.path.join(model, "model.safetensors"))  # per expert: transformers saves the Hub's layout
    assert set(load_file(str(tp.output_dir / "final" / "model.safetensors"))) == set(base)  # so does final/

    import shutil

    part = tmp_path / "part"
    shutil.copytree(tp.output_dir, part)
    crash_after(part, 2)
    resumed = finetune(part, *args, "--resume_from_checkpoint", "latest", launcher="tp2")
    assert [r["step"] for r in resumed.train_rows] == [1, 2, 3, 4]
    assert max_rel_diff(b, resumed.losses()) <= 1e-6
    assert max_weight_diff(tp.output_dir / "final", part / "final") <= 1e-6
    model = AutoModelForCausalLM.from_pretrained(tp.output_dir / "final")
    assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for v in base.values())
    assert all(0.4 <= r["parameter_shard"] <= 0.6 for r in tp.train_rows)  # each rank holds about half

    # The TP checkpoint resumed in one process (converted by parameter name): the run goes on as under TP.
    crash_after(part, 2)
    single_resumed = finetune(part, *args, "--resume_from_checkpoint", "latest")
    assert "written by MULTI_CPU TP 2 on 2 process(es), converted" in single_resumed.output
    assert max_rel_diff(b, single_resumed.losses()) <= 1e-5
    # the optimizer's moments too (the packed gate_up_proj's halves in their places): the same weights
    assert max_weight_diff(tp.output_dir / "final", part / "final") <= 1e-5
    print(json.dumps({"single": a, "tp2": b}))
