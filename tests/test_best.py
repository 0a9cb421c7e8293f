"""The best checkpoint and early stopping: transformers' rule (checked against its own EarlyStoppingCallback), the
config refusals, and one real run whose eval loss rises: it stops where the rule says, keeps the best
checkpoint through pruning, exports exactly its weights, and a resume keeps the tracking."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import base_args, crash_after, finetune, generation_settings, with_generation_settings

from finetune.best import BestRule
from finetune.config import ConfigError, TrainArgs, build_config
from finetune.loop import TrainState


def expected_stop(values: list[float], patience: int, threshold: float, greater: bool = False) -> int | None:
    """Index of the evaluation that stops the run (None: never), written from transformers' docs: an evaluation
    counts as no improvement unless it beats the best so far by more than the threshold; the best so far is
    any strictly better value."""
    best, bad = None, 0
    for i, v in enumerate(values):
        better = v == v and (best is None or (v > best if greater else v < best))  # NaN (v != v) is never better
        if best is None or (better and abs(v - best) > threshold):
            bad = 0
        else:
            bad += 1
        if better:
            best = v
        if bad >= patience:
            return i
    return None


def transformers_stop(values: list[float], patience: int, threshold: float, greater: bool = False) -> int | None:
    """The same sequence through transformers' EarlyStoppingCallback and the Trainer's best-metric update."""
    from transformers import EarlyStoppingCallback, TrainerControl

    args = SimpleNamespace(metric_for_best_model="eval_loss", greater_is_better=greater)
    state = SimpleNamespace(best_metric=None)
    callback, control = EarlyStoppingCallback(patience, threshold), TrainerControl()
    for i, v in enumerate(values):
        callback.on_evaluate(args, state, control, metrics={"eval_loss": v})
        if state.best_metric is None:  # Trainer._determine_best_metric, after the callbacks
            state.best_metric = float("-inf") if greater else float("inf")
        if v > state.best_metric if greater else v < state.best_metric:
            state.best_metric = v
        if control.should_training_stop:
            return i
    return None


SEQUENCES = [
    [5.0, 4.0, 4.5, 4.2, 3.0, 3.1, 3.2],
    [5.0, 4.0, 3.995, 3.99, 3.98, 2.0],  # improvements below the threshold
    [1.0, 2.0, 3.0, 2.5, 4.0],
    [3.0, 3.0, 3.0],
    [float("nan"), 5.0, 4.0, float("nan"), 3.9, float("nan"), 3.0],  # a NaN eval is never the best
]


@pytest.mark.parametrize("values", SEQUENCES)
@pytest.mark.parametrize("patience,threshold", [(1, 0.0), (2, 0.0), (2, 0.01), (3, 0.05)])
@pytest.mark.parametrize("greater", [False, True])
def test_rule_is_transformers_early_stopping(values, patience, threshold, greater):
    rule = BestRule("eval_loss", greater, patience, threshold, load_best=True)
    state = TrainState()
    stop, best = None, None
    for i, v in enumerate(values):
        state.step = i + 1
        verdict = rule.update(state, v)
        if v == v and (best is None or (v > best if greater else v < best)):
            best = v
            assert verdict.new_best and state.best_step == i + 1
        else:
            assert not verdict.new_best
        if verdict.stop:
            stop = i
            break
    assert (
        stop
        == expected_stop(values, patience, threshold, greater)
        == transformers_stop(values, patience, threshold, greater)
    )
    assert state.best_metric == best


def problems_of(values: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        build_config(values)
    return dict(info.value.problems)


@pytest.fixture
def valid(tmp_path) -> dict:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    return {"model": str(model), "dataset": str(data), "output_dir": str(tmp_path / "out")}


def test_defaults_follow_transformers(valid):
    t = build_config({**valid, "load_best_model_at_end": True, "eval_steps": 2, "save_steps": 4}).train
    rule = BestRule.of(t)
    assert (rule.metric, rule.greater_is_better) == ("eval_loss", False)
    assert BestRule.of(TrainArgs(metric_for_best_model="perplexity")).greater_is_better is False
    assert BestRule.of(TrainArgs(metric_for_best_model="accuracy")).metric == "eval_accuracy"
    assert BestRule.of(TrainArgs(metric_for_best_model="eval_accuracy")).greater_is_better is True
    assert BestRule.of(TrainArgs(metric_for_best_model="loss", greater_is_better=True)).greater_is_better is True
    assert BestRule.of(TrainArgs()) is None


@pytest.mark.parametrize(
    "change, key, words",
    [
        ({"metric_for_best_model": "accuracy"}, "metric_for_best_model", "never computed"),
        ({"metric_for_best_model": "eval_rougeL"}, "metric_for_best_model", "eval_loss, eval_perplexity"),
        ({"load_best_model_at_end": True, "eval_fraction": 0}, "load_best_model_at_end", "eval data"),
        ({"load_best_model_at_end": True}, "load_best_model_at_end", "set eval_steps"),
        ({"load_best_model_at_end": True, "eval_steps": 2, "save_steps": None}, "load_best_model_at_end", "save_steps"),
        ({"load_best_model_at_end": True, "eval_steps": 4, "save_steps": 6}, "save_steps", "save_steps: 8"),
        ({"early_stopping_patience": 2, "eval_steps": 2}, "early_stopping_patience", "metric_for_best_model"),
        ({"early_stopping_patience": 0, "metric_for_best_model": "loss"}, "early_stopping_patience", ">= 1"),
        ({"early_stopping_threshold": 0.1}, "early_stopping_threshold", "early_stopping_patience"),
    ],
)
def test_bad_best_settings_name_key_and_fix(valid, change, key, words):
    found = problems_of({**valid, **change})
    assert list(found) == [key], found
    assert words in found[key]


def test_every_missing_prerequisite_is_named_at_once(valid):
    """--early_stopping_patience 2 --eval_fraction 0 said only 'set metric_for_best_model', then eval data and
    eval_steps appeared one fix at a time; load_best_model_at_end the same. One problem names them all."""
    found = problems_of({**valid, "early_stopping_patience": 2, "eval_fraction": 0})
    assert list(found) == ["early_stopping_patience"], found
    for fix in ("set metric_for_best_model", "set eval_steps", "give eval data"):
        assert fix in found["early_stopping_patience"], found
    found = problems_of({**valid, "load_best_model_at_end": True, "eval_fraction": 0, "save_steps": None})
    for fix in ("give eval data", "set eval_steps", "set save_steps"):
        assert fix in found["load_best_model_at_end"], found


def test_metric_of_a_source_or_a_shipped_metric_is_accepted(valid):
    cls = {**valid, "task": "classification", "metric_for_best_model": "f1"}
    assert build_config(cls).train.metric_for_best_model == "f1"
    mix = {
        **valid,
        "dataset": "",
        "datasets": [{"dataset": valid["dataset"], "name": "chat"}],
        "metric_for_best_model": "eval_chat_loss",
    }
    assert BestRule.of(build_config(mix).train).greater_is_better is False


# ---------------------------------------------------------------- a real run


@pytest.mark.slow
def stopping_run(assets, out, launcher: str):
    """A learning rate high enough that eval loss goes up and down: the run stops where the patience/threshold
    rule applied to its own metrics.jsonl says (every rank, by its own log), final/ holds exactly the best
    checkpoint's weights (not the last step's) with the base model's generation settings (which a checkpoint's
    config.json cannot give back), and save_total_limit 1 kept the best. Returns the run, its arguments, its eval
    losses and the best step."""
    from safetensors.torch import load_file

    base = with_generation_settings(assets.llama, out.parent / f"{out.name}_base")
    args = base_args(
        base,
        assets.instruction,
        "--max_steps",
        str(MAX_STEPS),
        "--learning_rate",
        "0.03",
        "--lr_scheduler_type",
        "constant",
        "--eval_fraction",
        "0.05",
        "--eval_steps",
        "1",
        "--save_steps",
        "2",
        "--save_total_limit",
        "1",
        "--load_best_model_at_end",
        "true",
        "--early_stopping_patience",
        str(PATIENCE),
        "--early_stopping_threshold",
        str(THRESHOLD),
    )
    run = finetune(out, *args, launcher=launcher)
    evals = run.eval_rows
    losses = [r["eval_loss"] for r in evals]
    assert [r["step"] for r in evals] == list(range(1, len(evals) + 1))
    stop = expected_stop(losses, PATIENCE, THRESHOLD)
    assert stop is not None and stop + 1 < MAX_STEPS, losses  # the scenario must stop early
    last = evals[-1]["step"]
    assert last == stop + 1 and run.train_rows[-1]["step"] == last
    best = evals[losses.index(min(losses))]["step"]  # the first of the lowest
    assert best != last, losses
    rank_logs = sorted((out / "logs").glob("rank*.log"))
    assert len(rank_logs) == run.train_rows[-1]["world_size"], rank_logs
    for log in rank_logs:  # every rank stopped there, and only there
        stops = re.findall(r"early stopping at step (\d+)", log.read_text())
        assert stops == [str(last)], (log.name, stops)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted(["latest", f"step_{best}", f"step_{last}"])
    final = load_file(str(out / "final" / "model.safetensors"))
    at_best, at_last = (checkpoint_weights(out / "checkpoints" / f"step_{step}") for step in (best, last))
    assert set(final) <= set(at_best) and final
    assert all((final[k] == at_best[k]).all() for k in final)
    assert any((final[k] != at_last[k]).any() for k in final)
    assert f"step {best}" in (out / "final" / "README.md").read_text()
    assert generation_settings(out / "final") == generation_settings(base)
    state = json.loads((out / "checkpoints" / f"step_{last}" / "trainer_state.json").read_text())
    assert (state["best_step"], state["evals_without_improvement"]) == (best, PATIENCE)
    assert state["best_metric"] == pytest.approx(min(losses), rel=1e-12)
    assert f"early stopping at step {last}" in run.output
    summary = run.output[run.output.index("run summary") :]  # names the weights final/ holds, not the last eval's
    assert f"best eval    step {best}: eval_loss {min(losses):.4f}" in summary and "last eval" in summary, summary
    assert "final eval" not in summary, summary
    return run, args, losses, best


PATIENCE, THRESHOLD, MAX_STEPS = 2, 0.01, 30


def checkpoint_weights(ckpt: Path) -> dict:
    """The whole model a checkpoint holds, read with the libraries' own tools, not finetune's: safetensors, or
    DeepSpeed's zero_to_fp32 over a ZeRO-3 checkpoint's partitions, or torch.distributed.checkpoint's converter over
    an FSDP2 checkpoint's shards."""
    import torch
    from safetensors.torch import load_file

    if (ckpt / "model.safetensors").exists():
        return load_file(str(ckpt / "model.safetensors"))
    if (ckpt / "pytorch_model").is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = ckpt.parent.parent / f"{ckpt.name}_whole.pt"
    dcp_to_torch_save(str(ckpt / "pytorch_model_fsdp_0"), str(whole))
    return torch.load(whole)["model"]


def test_best_checkpoint_early_stopping_pruning_and_resume(assets, tmp_path):
    """One process: stopping_run, then a resume from the best checkpoint ends the same way."""
    from safetensors.torch import load_file

    run, args, losses, best = stopping_run(assets, tmp_path / "run", "python")
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run.output_dir, resumed_dir)
    crash_after(resumed_dir, best)
    resumed = finetune(resumed_dir, *args, "--resume_from_checkpoint", "latest", launcher="python")
    assert [r["eval_loss"] for r in resumed.eval_rows] == pytest.approx(losses, rel=1e-6)
    again = load_file(str(resumed_dir / "final" / "model.safetensors"))
    final = load_file(str(run.output_dir / "final" / "model.safetensors"))
    assert final and all((again[k] == final[k]).all() for k in final)


def test_the_best_checkpoint_of_a_mixture_of_experts_is_exported_in_its_base_models_layout(assets, tmp_path):
    """A checkpoint holds transformers' in-memory names (the experts fused: mlp.experts.gate_up_proj); final/ from
    the best checkpoint holds each expert's own linears, as the base model (and the Hub's checkpoints) do, and
    reloads to exactly the checkpoint's weights. So do final/ of a new run whose model is that checkpoint, and the
    merge of an adapter trained on it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune import demo

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    base = demo.build_model("qwen3_moe", tmp_path / "qwen3_moe", assets.tokenizer, **moe)
    args = base_args(base, assets.instruction, "--max_steps", "4", "--learning_rate", "0.03", "--eval_fraction")
    args += ["0.05", "--eval_steps", "1", "--save_steps", "1", "--load_best_model_at_end", "true"]
    # the highest eval loss is the best: an early step's checkpoint (asserted), not the last step's model
    run = finetune(tmp_path / "run", *args, "--greater_is_better", "true")
    losses = [r["eval_loss"] for r in run.eval_rows]
    best = run.eval_rows[losses.index(max(losses))]["step"]
    assert best < 4, losses  # final/ comes from a checkpoint, not the last step's model
    at_best = load_file(str(run.output_dir / "checkpoints" / f"step_{best}" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in at_best
    assert set(load_file(str(run.output_dir / "final" / "model.safetensors"))) == set(
        load_file(f"{base}/model.safetensors")
    )
    reloaded = AutoModelForCausalLM.from_pretrained(run.output_dir / "final").state_dict()
    assert all((reloaded[k] == v).all() for k, v in at_best.items())
    ckpt = str(run.output_dir / "checkpoints" / f"step_{best}")
    again = finetune(tmp_path / "again", *base_args(ckpt, assets.instruction, "--max_steps", "1"))
    assert set(load_file(str(again.output_dir / "final" / "model.safetensors"))) == set(
        load_file(f"{base}/model.safetensors")
    )
    lora = ["--peft.method", "lora", "--peft.target_modules", "q_proj", "--peft.merge", "true"]
    adapted = finetune(tmp_path / "lora", *base_args(ckpt, assets.instruction, "--max_steps", "1"), *lora)
    assert set(load_file(str(adapted.output_dir / "final" / "merged" / "model.safetensors"))) == set(
        load_file(f"{base}/model.safetensors")
    )


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["ddp", "zero3", "fsdp2"])
def test_every_rank_stops_at_the_same_step_and_exports_the_best(assets, tmp_path, launcher):
    """stopping_run under DDP, ZeRO-3 and FSDP2 (2 ranks): the sharded layouts save and load their own checkpoint
    formats, and final/ must still be the best checkpoint's whole model."""
    stopping_run(assets, tmp_path / launcher, launcher)


@pytest.mark.slow
def test_load_best_model_at_end_exports_the_best_adapter(assets, tmp_path):
    """An adapter run: final/ holds the best checkpoint's adapter weights (set by name from the checkpoint's full
    state, on the run's base model), not the last step's."""
    from safetensors.torch import load_file

    args = base_args(
        assets.llama,
        assets.instruction,
        "--max_steps",
        "3",
        "--learning_rate",
        "0.1",
        "--lr_scheduler_type",
        "constant",
        "--eval_fraction",
        "0.05",
        "--eval_steps",
        "1",
        "--save_steps",
        "1",
        "--load_best_model_at_end",
        "true",
        "--peft.method",
        "lora",
        "--peft.r",
        "4",
    )
    run = finetune(tmp_path / "lora", *args, launcher="python")
    losses = [r["eval_loss"] for r in run.eval_rows]
    best = run.eval_rows[losses.index(min(losses))]["step"]
    assert best != 3, losses  # the scenario: the learning rate is too high for the adapter after the first step

    def adapter(step: int) -> dict:
        full = load_file(str(run.output_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))
        return {k.replace(".default", ""): v for k, v in full.items() if "lora_" in k}

    final = load_file(str(run.output_dir / "final" / "adapter_model.safetensors"))
    assert final and set(final) == set(adapter(best))
    assert all((final[k] == adapter(best)[k]).all() for k in final)
    assert any((final[k] != adapter(3)[k]).any() for k in final)
