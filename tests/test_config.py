"""The run config at the edge: every problem reported at once with its key, through the API and the CLI;
every shipped YAML loads; overrides are typed; --help documents every field with its default."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.config import (
    RUN_MARKERS,
    ConfigError,
    ModelArgs,
    RunConfig,
    all_fields,
    build_config,
    load_yaml,
    parse,
)

ROOT = Path(__file__).resolve().parents[1]
RUN_CONFIGS = sorted((ROOT / "examples").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


@pytest.fixture
def valid(tmp_path) -> dict:
    """A config that passes every check, filesystem included: a model dir, a data file, a fresh output_dir."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    dataset = tmp_path / "train.jsonl"
    dataset.write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    return {"model": str(model), "dataset": str(dataset), "output_dir": str(tmp_path / "out")}


def write_yaml(path: Path, values: dict) -> str:
    path.write_text(yaml.safe_dump(values))
    return str(path)


def problems_of(values: dict, **kw) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        build_config(values, **kw)
    keys = [k for k, _ in info.value.problems]
    assert len(keys) == len(set(keys)), f"a key reported twice: {info.value.problems}"
    return dict(info.value.problems)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "1000"}
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


SEVERAL_PROBLEMS = {
    "learning_rat": 1e-4,  # typo of learning_rate
    "max_steps": "ten",  # wrong type
    "per_device_train_batch_size": -4,  # out of range
    "lr_scheduler_type": "cosin",  # not a choice
}


def test_every_problem_is_reported_at_once_with_its_key(valid):
    problems = problems_of({**valid, **SEVERAL_PROBLEMS})
    assert set(problems) == set(SEVERAL_PROBLEMS)
    assert "did you mean 'learning_rate'" in problems["learning_rat"]
    assert "integer" in problems["max_steps"] and "'ten'" in problems["max_steps"]
    assert "-4" in problems["per_device_train_batch_size"]
    assert "did you mean 'cosine'" in problems["lr_scheduler_type"]


def test_cli_reports_every_problem_exit_2_without_traceback(tmp_path, valid):
    proc = run_cli("--config", write_yaml(tmp_path / "bad.yaml", {**valid, **SEVERAL_PROBLEMS}))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for key in SEVERAL_PROBLEMS:
        assert f"- {key}:" in proc.stderr, proc.stderr
    assert "did you mean 'learning_rate'" in proc.stderr
    assert "4 problems" in proc.stderr


def test_cli_malformed_yaml_names_the_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("model: m\ndataset: d\nmax_steps: 3: 4\n")
    proc = run_cli("--config", str(bad))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "not valid YAML" in proc.stderr and "line 3" in proc.stderr, proc.stderr


def test_cli_missing_config_file(tmp_path):
    missing = tmp_path / "nowhere.yaml"
    proc = run_cli("--config", str(missing))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--config" in proc.stderr and str(missing) in proc.stderr


def test_cli_unknown_flag_suggests_the_field(tmp_path, valid):
    proc = run_cli("--config", write_yaml(tmp_path / "ok.yaml", valid), "--max_step", "3")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--max_step: unknown option; did you mean --max_steps?" in proc.stderr, proc.stderr


def test_a_misspelled_subcommand_is_named_with_the_right_one(tmp_path):
    """`finetune chek` said only "unexpected argument; options take the form --field value"."""
    proc = run_cli("chek", "--config", "run.yaml")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "- chek: unknown command; did you mean `finetune check`?" in proc.stderr, proc.stderr


@pytest.mark.parametrize("marker", RUN_MARKERS)
def test_output_dir_with_a_previous_run_is_refused(valid, marker):
    out = Path(valid["output_dir"])
    out.mkdir()
    (out / marker).mkdir() if marker in ("checkpoints", "final") else (out / marker).write_text("")
    problems = problems_of(valid)
    assert list(problems) == ["output_dir"]
    assert marker in problems["output_dir"] and "--overwrite_output_dir" in problems["output_dir"]


@pytest.mark.parametrize("allow", ["overwrite", "resume_latest", "resume_dir"])
def test_previous_run_is_accepted_when_overwriting_or_resuming(valid, allow):
    out = Path(valid["output_dir"])
    (out / "checkpoints" / "step_2").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step_2")
    (out / "metrics.jsonl").write_text("")
    extra = {
        "overwrite": {"overwrite_output_dir": True},
        "resume_latest": {"resume_from_checkpoint": "latest"},
        "resume_dir": {"resume_from_checkpoint": str(out / "checkpoints" / "step_2")},
    }[allow]
    cfg = build_config({**valid, **extra})
    assert cfg.train.output_dir == str(out)


def test_a_run_without_a_checkpoint_is_told_a_command_that_is_accepted(valid):
    """A run that stopped before its first checkpoint leaves metrics.jsonl and no checkpoint. Its hint said "start the
    run again" (refused: a previous run, "resume it with --resume_from_checkpoint latest"), and `latest` was refused
    with "drop resume_from_checkpoint to start fresh": the first command again. Both name a command that passes."""
    from finetune.checkpoint import resume_hint

    out = Path(valid["output_dir"])
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    hint = resume_hint(str(out))
    refused = problems_of({**valid, "resume_from_checkpoint": "latest"})["resume_from_checkpoint"]
    assert "--resume_from_checkpoint auto" in hint and "'auto'" in refused, (hint, refused)
    assert "--overwrite_output_dir true" in hint and "--overwrite_output_dir true" in refused, (hint, refused)
    for suggested in ({"resume_from_checkpoint": "auto"}, {"overwrite_output_dir": True}):
        assert build_config({**valid, **suggested}).train.output_dir == str(out)
    (out / "final").mkdir()  # a finished run with save_steps null: the plain rerun's refusal offers no resume
    again = problems_of(valid)["output_dir"]
    assert "--overwrite_output_dir" in again and "resume_from_checkpoint latest" not in again, again


def finished_in(out: Path, cfg: RunConfig, card: str) -> None:
    """What a finished run leaves: final/ with its run config and model card, metrics.jsonl up to step 3."""
    (out / "final").mkdir(parents=True)
    (out / "final" / "run_config.yaml").write_text(yaml.safe_dump(cfg.to_flat(), sort_keys=False))
    (out / "final" / "README.md").write_text(card)
    (out / "run_config.yaml").write_text(yaml.safe_dump(cfg.to_flat(), sort_keys=False))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))


def test_a_requeued_run_that_had_finished_ends_at_once(tmp_path, valid):
    """A SLURM job preempted after its run's last step's vote exits 128+N once final/ is complete; SLURM requeues it,
    and its --resume_from_checkpoint auto was refused (exit 2: output_dir holds a previous run) without a checkpoint
    (save_steps null), or wrote final/ again from the last one. The same run config on a finished run (final/ and its
    model card complete) now exits 0 at once, saying so, before anything loads, and leaves output_dir as it was
    (`finetune check` of that launch says so too: it said "check passed" and nothing of the run ending at once); a
    run config that differs (but for resume_from_checkpoint, overwrite_output_dir) is refused as before, saying that
    run finished; a card without finetune's mark (an adapter's own README.md: report.finish had not run),
    push_to_hub (no record of the upload) or several machines (final/ on machine 0 only) is not taken for one."""
    from finetune.config.preflight import finished_run
    from finetune.config.schema import CARD_MARK

    out = Path(valid["output_dir"])
    auto = {**valid, "resume_from_checkpoint": "auto"}
    finished_in(out, build_config(valid), f"# run\n\nA model, {CARD_MARK} on `data`.\n")
    cfg = build_config(auto)
    done = finished_run(cfg)
    assert done and done.final == str(out / "final") and done.step == 3 and not done.differences, done
    assert cfg.finished == done  # the parse carries it to cli, which reads final/ and metrics.jsonl no second time
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    run_yaml = write_yaml(tmp_path / "run.yaml", auto)
    proc = run_cli("--config", run_yaml)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == done.message(str(out)), proc.stderr
    assert f"the run in {out} finished already ({out / 'final'} complete, step 3); nothing left to run" in proc.stderr
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()} == before
    checked = run_cli("check", "--config", run_yaml)  # the preflight of that launch: it passes, and says why it
    assert checked.returncode == 0 and checked.stdout.rstrip().endswith("check passed"), checked  # would not train
    assert (
        f"the run in {out} finished already ({out / 'final'} complete, step 3): launched with --resume_from_checkpoint "
        "auto, the run ends at once (exit 0) without training. Pick a new output_dir, or add --overwrite_output_dir "
        "true, to train again."
    ) in checked.stdout.splitlines(), checked.stdout
    assert "output_dir" in problems_of(valid)  # without auto: refused as before
    assert finished_run(build_config({**auto, "overwrite_output_dir": True})) is None
    assert finished_run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, push_to_hub=True))) is None
    changed = problems_of({**auto, "max_steps": 5})["output_dir"]
    assert "holds a previous run (final)" in changed and "that run finished" in changed, changed
    assert "max_steps was -1, now 5" in changed, changed
    # several machines: final/ is machine 0's alone where output_dirs are not shared, and the others would wait
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ACCELERATE_NUM_MACHINES", "2")
        assert finished_run(cfg) is None
    (out / "final" / "README.md").write_text("# Model Card for Model ID\n")  # PEFT's, in an adapter's final/
    assert finished_run(cfg) is None and "output_dir" in problems_of(auto)


def test_a_checkpoint_of_another_run_does_not_let_a_run_into_an_occupied_output_dir(tmp_path, valid):
    """resume_from_checkpoint naming another run's checkpoint starts output_dir over from it: refused where output_dir
    holds a run (unless overwrite_output_dir), as a fresh start is; and overwrite_output_dir is refused where it would
    remove that very checkpoint (inside output_dir's checkpoints/ but not one of its own)."""
    other = tmp_path / "other" / "checkpoints" / "step_4"
    other.mkdir(parents=True)
    out = Path(valid["output_dir"])
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("")
    elsewhere = {**valid, "resume_from_checkpoint": str(other)}
    problems = problems_of(elsewhere)
    assert list(problems) == ["output_dir"] and "--overwrite_output_dir" in problems["output_dir"]
    assert str(other) in problems["output_dir"], problems
    assert build_config({**elsewhere, "overwrite_output_dir": True}).train.output_dir == str(out)
    assert build_config({**elsewhere, "output_dir": str(tmp_path / "new")}).train.output_dir == str(tmp_path / "new")
    inside = out / "checkpoints" / "kept" / "step_4"
    inside.mkdir(parents=True)
    problems = problems_of({**valid, "resume_from_checkpoint": str(inside), "overwrite_output_dir": True})
    assert list(problems) == ["resume_from_checkpoint"] and "overwrite_output_dir" in problems["resume_from_checkpoint"]


def test_missing_local_dataset_and_model_are_reported_by_key(tmp_path, valid):
    problems = problems_of({**valid, "dataset": str(tmp_path / "no.jsonl"), "model": str(tmp_path / "no_model")})
    assert set(problems) == {"dataset", "model"}
    assert "no.jsonl" in problems["dataset"]
    assert "no_model" in problems["model"] and "does not exist" in problems["model"]

    (tmp_path / "empty_model").mkdir()
    problems = problems_of({**valid, "model": str(tmp_path / "empty_model")})
    assert set(problems) == {"model"} and "config.json" in problems["model"]


def test_filesystem_checks_can_be_skipped(tmp_path, valid):
    cfg = build_config({**valid, "model": str(tmp_path / "no_model")}, check_filesystem=False)
    assert cfg.model.model == str(tmp_path / "no_model")


def test_cli_overrides_win_over_yaml_and_are_typed(tmp_path, valid):
    path = write_yaml(
        tmp_path / "run.yaml", {**valid, "max_steps": 100, "eval_steps": 5, "packing": False, "learning_rate": 0.1}
    )
    base = parse(["--config", path])
    assert (base.train.max_steps, base.train.eval_steps, base.data.packing) == (100, 5, False)

    cfg = parse(["--config", path, "--max_steps", "10", "--eval_steps", "null", "--packing", "--learning_rate", "1e-3"])
    assert cfg.train.max_steps == 10 and type(cfg.train.max_steps) is int
    assert cfg.train.eval_steps is None
    assert cfg.data.packing is True
    assert cfg.train.learning_rate == pytest.approx(1e-3) and type(cfg.train.learning_rate) is float
    assert cfg.model.model == valid["model"]  # untouched fields come from the file


def test_shipped_run_configs_load():
    assert RUN_CONFIGS, "no examples/*.yaml found"
    for path in RUN_CONFIGS:
        values = load_yaml(path)
        assert values, f"{path} is empty"
        cfg = build_config(values, check_filesystem=False)
        assert isinstance(cfg, RunConfig)
        flat = cfg.to_flat()
        for key, value in values.items():  # every value in the file reached the typed config
            assert flat[key] == value, (path.name, key)


def test_the_saved_run_config_is_a_run_config():
    """run_config.yaml (output_dir/ and final/) is RunConfig.to_flat(): every field, defaults included. Given back
    as --config it builds the same config, for every shipped example (DPO, mixture, seq2seq among them) and one with
    an adapter: no rule refuses a key only for being written (generation_metrics with generation off was)."""
    examples = [load_yaml(path) for path in RUN_CONFIGS]
    examples.append({**examples[0], "peft": {"method": "lora", "r": 4}})
    for values in examples:
        cfg = build_config(values, check_filesystem=False)
        again = build_config(yaml.safe_load(yaml.safe_dump(cfg.to_flat())), check_filesystem=False)
        assert again == cfg, values["output_dir"]


def test_shipped_accelerate_configs_load_with_accelerate():
    from accelerate.commands.config.config_args import load_config_from_file

    assert ACCELERATE_CONFIGS, "no accelerate_configs/*.yaml found"
    for path in ACCELERATE_CONFIGS:
        cfg = load_config_from_file(str(path))
        # never MULTI_CPU: accelerate's CPU launcher needs MPI (finetune runs the GPU configs on CPU instead)
        assert cfg.distributed_type.value in {"NO", "MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM"}, path.name
        assert cfg.num_processes >= 1
        if cfg.distributed_type.value == "FSDP":  # FSDP2, wrapping any model by its _no_split_modules
            assert cfg.fsdp_config["fsdp_version"] == 2, path.name
            assert "fsdp_transformer_layer_cls_to_wrap" not in cfg.fsdp_config, path.name
    names = {p.stem for p in ACCELERATE_CONFIGS}
    assert {"fsdp2", "fsdp2_offload", "tp2_fsdp2"} <= names


def test_help_lists_every_field_with_its_default():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    options = proc.stdout[proc.stdout.index("options:") :]
    lines = options.splitlines()
    fields = all_fields()
    assert len(fields) > 40
    for name, (_, f) in fields.items():
        # An option's block: its own line, plus the indented help lines under it.
        start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"--{name} "))
        end = next((i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("-")), len(lines))
        block = " ".join(" ".join(lines[start:end]).split())
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "(required)" if default == "" else f"(default: {default!r})"
        assert shown in block, (name, block)


def test_docs_run_config_names_every_field():
    """docs/run-config.md lists every field (the README says so): each schema field in backticks, or under a pattern
    the page gives (`adam_*`, `*_column`)."""
    import fnmatch
    import re

    page = (ROOT / "docs" / "run-config.md").read_text()
    named = set(re.findall(r"`([\w.*]+)`", page))
    missing = [name for name in all_fields() if not any(fnmatch.fnmatchcase(name, n) for n in named)]
    assert not missing, f"docs/run-config.md does not name {missing}"


def test_cli_text_values_stay_verbatim(tmp_path, valid):
    """Text fields are not YAML-typed on the command line: dates, 'no', '1.10' and templates survive."""
    path = write_yaml(tmp_path / "run.yaml", valid)
    cfg = parse(
        [
            "--config",
            path,
            "--prompt_template",
            "Question: {prompt}\nAnswer: ",
            "--output_dir",
            str(tmp_path / "2024-01-01"),
            "--eval_split",
            "no",
            "--dataset_config",
            "1.10",
            "--max_steps",
            "1e3",
        ]
    )
    assert cfg.data.prompt_template == "Question: {prompt}\nAnswer: "
    assert cfg.train.output_dir.endswith("2024-01-01")
    assert (cfg.data.eval_split, cfg.data.dataset_config) == ("no", "1.10")
    assert cfg.train.max_steps == 1000 and type(cfg.train.max_steps) is int


NON_FINITE = [
    ("--max_steps", ".inf"),
    ("--max_steps", "1e400"),
    ("--max_steps", "nan"),
    ("--peft.r", "1e400"),
    ("--num_train_epochs", "nan"),
    ("--num_train_epochs", ".inf"),
    ("--weight_decay", "nan"),
    ("--adam_epsilon", ".nan"),
    ("--seed", "-1"),
    ("--seed", "99999999999"),
]


@pytest.mark.parametrize(("flag", "text"), NON_FINITE)
def test_non_finite_numbers_and_seeds_out_of_range_are_problems_of_their_key(tmp_path, valid, flag, text):
    """Numbers no count, rate or seed can be: one problem naming the key (they passed and then crashed with a
    traceback: int() of inf in coerce, make_plan of a nan epoch count, AdamW, numpy's seed, after data prep)."""
    with pytest.raises(ConfigError) as info:
        parse(["--config", write_yaml(tmp_path / "run.yaml", valid), "--peft.method", "lora", flag, text])
    assert [k for k, _ in info.value.problems] == [flag[2:]], info.value.problems
    assert parse(["--config", str(tmp_path / "run.yaml"), "--seed", str(2**32 - 1)]).train.seed == 2**32 - 1


def test_a_count_below_one_says_what_null_means_for_its_key(valid):
    """null is not 'off' for every count: ddp_timeout's is the default timeout, preprocessing_num_workers' an
    automatic choice (both said 'must be >= 1 or null (off)')."""
    found = problems_of({**valid, "ddp_timeout": 0, "preprocessing_num_workers": 0, "eval_steps": 0})
    assert found["ddp_timeout"] == "must be >= 1, or null (the default: 600 s on CPU, 1800 s on GPU), got 0"
    assert (
        found["preprocessing_num_workers"] == "must be >= 1, or null (chosen from the cores and the data size), got 0"
    )
    assert found["eval_steps"] == "must be >= 1, or null (off), got 0"


def test_a_fraction_of_the_run_as_steps_says_a_count_is_expected(tmp_path, valid):
    """transformers takes eval_steps: 0.1 as a tenth of the run; here it is one problem saying a count is wanted."""
    with pytest.raises(ConfigError) as info:
        parse(["--config", write_yaml(tmp_path / "run.yaml", valid), "--eval_steps", "0.1"])
    assert info.value.problems == [
        ("eval_steps", "expected a number of steps, got 0.1 (a fraction of the run is not taken here)")
    ]


def test_unknown_flag_is_one_problem(tmp_path, valid):
    path = write_yaml(tmp_path / "run.yaml", valid)
    with pytest.raises(ConfigError) as info:
        parse(["--config", path, "--max_step", "3"])
    assert [k for k, _ in info.value.problems] == ["--max_step"]


@pytest.mark.parametrize("text", ["[q_proj,v_proj]", "[q_proj, v_proj]", "q_proj,v_proj", " q_proj , v_proj "])
def test_list_fields_take_yaml_lists_and_commas_on_the_command_line(tmp_path, text):
    """--peft.target_modules [q_proj,v_proj] (the form --help shows defaults in) is two modules, not '[q_proj' and
    'v_proj]'; so is the comma form. A list left open is a problem naming the key."""
    base = [
        "--model",
        "m/x",
        "--dataset",
        "d/x",
        "--output_dir",
        str(tmp_path / "o"),
        "--peft.method",
        "lora",
        "--task",
        "classification",
    ]
    cfg = parse([*base, "--peft.target_modules", text, "--metrics", "[accuracy]"])
    assert cfg.peft.target_modules == ["q_proj", "v_proj"] and cfg.train.metrics == ["accuracy"]
    assert parse([*base, "--peft.target_modules", "[all-linear]"]).peft.target_modules == ["all-linear"]
    with pytest.raises(ConfigError) as info:
        parse([*base, "--peft.target_modules", "[q_proj"])
    assert [k for k, _ in info.value.problems] == ["peft.target_modules"]


@pytest.mark.parametrize("model_type,pad,usable", [("roberta", 1, 512), ("xlm-roberta", 1, 512), ("bert", 0, 514)])
def test_max_seq_length_fits_positions_that_start_after_the_pad_id(tmp_path, model_type, pad, usable):
    """RoBERTa-family models number positions from pad_token_id + 1: of max_position_embeddings 514 with pad id 1,
    512 are usable (513 passed the check and crashed in the first forward with an index error). Checked alike from
    a local config.json (validation) and from a loaded config (a Hub model, at load)."""
    from finetune.config.rules import position_problems
    from finetune.model import _check_config

    config = {"model_type": model_type, "max_position_embeddings": 514, "pad_token_id": pad}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ModelArgs(model=str(tmp_path), task="classification")
    assert position_problems("m", config, usable) == []
    _check_config(args, usable, None)  # no ConfigError
    [(key, why)] = position_problems("m", config, usable + 1)
    assert key == "max_seq_length" and f"set max_seq_length <= {usable}" in why
    with pytest.raises(ConfigError) as info:
        _check_config(args, usable + 1, None)
    assert info.value.problems == [(key, why.replace("'m'", repr(str(tmp_path))))]
