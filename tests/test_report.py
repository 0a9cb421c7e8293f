"""What a person looks at around a run: trackers, curves, the model card, the Hub, the console and the summary.

Unit tests in this process; two real 2-process launches (DDP with TensorBoard, ZeRO-2) check the screen, the
rank logs, TensorBoard against metrics.jsonl, curves.png and the model card of a real run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import struct
from pathlib import Path

import pytest
import yaml
from conftest import classification_args, finetune

from finetune import console, report
from finetune.config import build_config

TOKEN = "hf_finetuneTestTokenNeverWritten0123456789"
# Third-party lines nobody can act on (issue 15): never on the screen, always in the rank logs.
NOISE = ("Setting accelerator to CPU", "LOAD REPORT", "Removed shared tensor", "FutureWarning")


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after checking the signature)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def rows_of(steps: int, eval_every: int, metrics=("eval_accuracy", "eval_f1"), shift: float = 0.0) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        rows.append(
            {"step": s, "loss": 2.0 / s + shift, "learning_rate": 1e-3 * (1 - s / steps), "tokens_per_s": 900 + s,
             "tokens_seen": 100 * s, "mfu": 0.01, "world_size": 2, "distributed_type": "MULTI_CPU"}
        )  # fmt: skip
        if s % eval_every == 0:
            rows.append({"step": s, "eval_loss": 1.5 / s + shift, **{m: s / steps for m in metrics}})
    rows.append({"step": steps, "peak_memory": [{"rank": 0, "train_peak_rss_gb": 0.5, "startup_peak_rss_gb": 0.7}]})
    return rows


# ---------------------------------------------------------------- trackers


def test_tracked_config_is_the_whole_config_flattened(assets, tmp_path):
    cfg = build_config(
        {
            "model": assets.llama,
            "dataset": assets.instruction,
            "output_dir": str(tmp_path / "run"),
            "report_to": ["tensorboard"],
            "peft": {"method": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]},
        }
    )
    tracked = report.tracked_config(cfg, {"world_size": 2, "distributed_type": "MULTI_CPU"})
    assert tracked["peft.r"] == 4 and tracked["peft.method"] == "lora"
    assert tracked["peft.target_modules"] == "q_proj,v_proj" and tracked["report_to"] == "tensorboard"
    assert tracked["peft.modules_to_save"] == "null" and tracked["world_size"] == 2
    assert all(isinstance(v, (int, float, str, bool)) for v in tracked.values())
    flat_keys = set(report.flatten(cfg.to_flat()))
    assert {k for k in tracked if k not in ("world_size", "distributed_type")} == flat_keys
    assert len(flat_keys) == len(cfg.to_flat()) - 1 + len(cfg.to_flat()["peft"])  # every field, peft's included


def test_tracker_not_installed_is_refused_before_anything_loads(assets, tmp_path, monkeypatch, capsys):
    import accelerate.utils
    from test_bad_inputs import run_in_process

    missing = next(
        (n for n in ("wandb", "mlflow", "aim", "clearml", "swanlab", "comet_ml") if not getattr(accelerate.utils, f"is_{n}_available")()),
        None,
    )  # fmt: skip
    if missing is None:
        pytest.skip("every tracker is installed here")
    args = ["--model", assets.llama, "--dataset", assets.instruction, "--output_dir", str(tmp_path / "run")]
    code, out, err = run_in_process([*args, "--report_to", missing], {}, monkeypatch, capsys)
    assert code == 2, out + err
    assert f"  - report_to: {missing} is not installed here; install it" in err, err
    assert "[finetune] distributed:" not in out + err and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- Hub


def test_push_to_hub_offline_exits_2_before_the_model_loads(assets, tmp_path, monkeypatch, capsys):
    from test_bad_inputs import run_in_process

    args = ["--model", assets.llama, "--dataset", assets.instruction, "--output_dir", str(tmp_path / "run")]
    code, out, err = run_in_process([*args, "--push_to_hub", "true"], {"HF_HUB_OFFLINE": "1"}, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in out + err, out + err
    assert "  - push_to_hub: the Hub is offline here (HF_HUB_OFFLINE is set)" in err, err
    assert "[finetune] distributed:" not in out + err and not (tmp_path / "run").exists()


def test_push_to_hub_without_network_exits_2_before_the_model_loads_and_never_shows_the_token(
    assets, tmp_path, monkeypatch, capsys
):
    """Online by configuration, with a token, but the Hub does not answer (a closed local port): the preflight
    says so before the Accelerator or the model exist. The token appears nowhere."""
    import huggingface_hub.constants
    from test_bad_inputs import run_in_process

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    env = {"HF_HUB_OFFLINE": "0", "HF_TOKEN": TOKEN}
    args = ["--model", assets.llama, "--dataset", assets.instruction, "--output_dir", str(tmp_path / "run")]
    code, out, err = run_in_process(
        [*args, "--push_to_hub", "true", "--hub_model_id", "me/x"], env, monkeypatch, capsys
    )
    assert code == 2, out + err
    assert "  - push_to_hub: cannot reach the Hub at http://127.0.0.1:9" in err, err
    assert "[finetune] model:" not in out + err and "[finetune] distributed:" not in out + err
    assert TOKEN not in out + err


def test_push_to_hub_without_token_or_with_a_bad_repo_name_is_refused(tmp_path, monkeypatch, assets):
    from finetune.config import ConfigError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored token either
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    base = {"model": assets.llama, "dataset": assets.instruction, "output_dir": str(tmp_path / "run")}
    with pytest.raises(ConfigError) as e:
        build_config({**base, "push_to_hub": True, "hub_model_id": "a/b/c"})
    keys = dict(e.value.problems)
    assert "no Hugging Face token found" in keys["push_to_hub"] and "'a/b/c'" in keys["hub_model_id"]


def test_push_uploads_final_and_a_failure_says_where_the_model_is(assets, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))
            return huggingface_hub.RepoUrl(f"https://huggingface.co/me/{repo_id}")  # the Hub adds the namespace

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw["repo_id"], kw))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    cfg = build_config(
        {"model": assets.llama, "dataset": assets.instruction, "output_dir": str(tmp_path / "my-run"),
         "push_to_hub": True, "hub_private_repo": True}
    )  # fmt: skip
    url = report.push(cfg, str(tmp_path / "my-run" / "final"))
    assert url == "https://huggingface.co/me/my-run"
    assert calls[0] == ("create_repo", "my-run", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert calls[1][1] == "me/my-run" and calls[1][2]["folder_path"] == str(tmp_path / "my-run" / "final")
    assert TOKEN not in yaml.safe_dump(cfg.to_flat()) + json.dumps(report.tracked_config(cfg, {}))

    def refuse(self, **kw):
        raise OSError("connection reset")

    monkeypatch.setattr(FakeApi, "upload_folder", refuse)
    with pytest.raises(
        report.PushFailed, match=r"The model is saved in .*my-run/final; upload it with `hf upload my-run"
    ):
        report.push(cfg, str(tmp_path / "my-run" / "final"))


# ---------------------------------------------------------------- curves and `finetune plot`


def test_curves_have_one_series_per_run_and_metric(tmp_path):
    fig = report.build_figure([("a", rows_of(8, 4)), ("b", rows_of(8, 2, shift=0.1))])
    loss, metrics, lr, speed = fig.axes
    assert [ln.get_label() for ln in loss.lines] == ["a train", "a eval", "b train", "b eval"]
    assert [ln.get_label() for ln in metrics.lines] == ["a accuracy", "a f1", "b accuracy", "b f1"]
    assert len(lr.lines) == 2 and len(speed.lines) == 2
    assert list(loss.lines[3].get_xdata()) == [2, 4, 6, 8]  # b's eval every 2 steps
    assert all(ax.get_xlabel() == "optimizer step" and ax.get_title() for ax in fig.axes)
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["a train", "a eval", "b train", "b eval"]


def test_curves_during_training_wait_for_their_interval_from_the_start(tmp_path, monkeypatch):
    """At an eval: drawn only once CURVES_EVERY_S have passed since the start or the last picture; at the end
    (no interval): always."""
    import time

    from finetune.report import curves

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_of(4, 2)))
    out, every = str(tmp_path), report.CURVES_EVERY_S
    monkeypatch.setattr(curves, "_started", time.monotonic())
    assert report.write_curves(out, min_interval=every) is None and not (tmp_path / "curves.png").exists()
    monkeypatch.setattr(curves, "_started", time.monotonic() - every - 1)
    assert report.write_curves(out, min_interval=every) == str(tmp_path / "curves.png")
    (tmp_path / "curves.png").unlink()
    assert report.write_curves(out, min_interval=every) is None  # drawn just now
    assert report.write_curves(out) == str(tmp_path / "curves.png")  # the end of the run


@pytest.mark.parametrize("curves", [True, False])
def test_the_end_of_a_run_draws_curves_unless_told_not_to(assets, tmp_path, caplog, curves):
    """curves false: no curves.png (at the end; at evals the loop asks the same key), and the summary says how to
    draw it later."""
    from types import SimpleNamespace

    from finetune.report import summary

    out = tmp_path / "run"
    cfg = build_config({"model": assets.llama, "dataset": assets.instruction, "output_dir": str(out), "curves": curves})
    (out / "final").mkdir(parents=True)  # the run's outputs, as the end of a run finds them
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_of(4, 2)))
    with caplog.at_level(logging.INFO, logger="finetune"):
        summary.finish(SimpleNamespace(is_main_process=True), cfg, str(out / "final"), report.RunFacts())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("curves")]
    assert (out / "curves.png").is_file() == curves
    assert said == ([f"curves       {out / 'curves.png'}"] if curves else [
        f"curves       not drawn (curves: false); `finetune plot {out}` draws them"])  # fmt: skip


def test_finetune_plot_overlays_runs_in_one_png(tmp_path, capsys):
    from finetune.cli import run_cli

    for name, shift in (("ddp", 0.0), ("zero2", 0.05), ("zero3", 0.1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows_of(10, 5, shift=shift))
        )
    (tmp_path / "zero3" / "run_config.yaml").write_text(yaml.safe_dump({"run_name": "zero3 offload"}))
    out = tmp_path / "parity.png"
    code = run_cli(["plot", *(str(tmp_path / n) for n in ("ddp", "zero2", "zero3")), "-o", str(out)])
    assert code == 0 and "(3 runs)" in capsys.readouterr().out
    width, height = png_size(out)
    assert (width, height) == (1200, 750) and out.stat().st_size > 20_000
    runs = [(report.run_label(tmp_path / n), report.read_rows(tmp_path / n)) for n in ("ddp", "zero2", "zero3")]
    assert [label for label, _ in runs] == ["ddp", "zero2", "zero3 offload"]
    assert len(report.build_figure(runs).axes[0].lines) == 6
    assert run_cli(["plot", str(tmp_path / "nothing")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_finetune_plot_draws_a_run_into_its_own_dir_and_replaces_only_its_own_pictures(tmp_path, capsys, monkeypatch):
    """`finetune plot DIR` draws DIR/curves.png, as the run summary says (it wrote ./curves.png, over whatever file
    was there); an output that finetune did not draw is left alone: exit 2, the file unchanged."""
    from finetune.cli import run_cli

    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_of(4, 2)))
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    (runs[0] / "curves.png").write_bytes(b"drawn by the run")  # a run's own curves.png is redrawn
    assert run_cli(["plot", str(runs[0])]) == 0 and png_size(runs[0] / "curves.png") == (1200, 750)
    assert list(here.iterdir()) == []
    assert run_cli(["plot", *map(str, runs)]) == 0 and png_size(here / "curves.png") == (1200, 750)
    assert run_cli(["plot", *map(str, runs)]) == 0  # a previous plot is replaced
    capsys.readouterr()
    mine = {here / "curves.png": b"the user's", tmp_path / "notes.png": b"not a plot"}
    for path, data in mine.items():
        path.write_bytes(data)
    for args in ([], ["-o", str(tmp_path / "notes.png")]):
        assert run_cli(["plot", *map(str, runs), *args]) == 2
        err = capsys.readouterr().err
        assert "--output" in err and "not a picture finetune drew" in err and "Traceback" not in err
    assert {path: path.read_bytes() for path in mine} == mine
    assert run_cli(["plot", str(runs[0]), "-o", "x.pdf"]) == 2 and "ending in .png" in capsys.readouterr().err
    assert run_cli(["plot", str(runs[0]), "-o", "no/x.png"]) == 2 and "does not exist" in capsys.readouterr().err


def test_a_torn_last_row_is_left_out_and_a_bad_row_elsewhere_is_named(tmp_path, caplog, capsys):
    """A full disk during an append leaves metrics.jsonl's last line cut short: resume (truncate_after), the curves
    and `finetune plot` read the whole rows before it and say what they left out (they ended in a JSONDecodeError
    traceback, exit 1). A line that is not JSON elsewhere is not a torn append: an error naming the file and line."""
    from finetune.cli import run_cli
    from finetune.config import ConfigError
    from finetune.metrics import MetricsLog

    rows = rows_of(4, 2)
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert report.read_rows(tmp_path) == rows
    assert any("last line (8)" in r.getMessage() and '"lo' in r.getMessage() for r in caplog.records)
    assert run_cli(["plot", str(tmp_path), "-o", str(tmp_path / "p.png")]) == 0 and (tmp_path / "p.png").is_file()
    MetricsLog(str(tmp_path), enabled=True).truncate_after(2)  # resume from step 2
    assert [json.loads(line) for line in log.read_text().splitlines()] == [r for r in rows if r["step"] <= 2]
    capsys.readouterr()

    lines = log.read_text().splitlines(keepends=True)
    log.write_text(lines[0] + '{"step": 1, "lo\n' + "".join(lines[1:]))
    for read in (lambda: report.read_rows(tmp_path), lambda: MetricsLog(str(tmp_path), True).truncate_after(2)):
        with pytest.raises(ConfigError) as info:
            read()
        assert info.value.problems[0][0] == str(log) and "line 2 is not a JSON row" in info.value.problems[0][1]
    assert run_cli(["plot", str(tmp_path), "-o", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert str(log) in err and "line 2" in err and "Traceback" not in err


# ---------------------------------------------------------------- model card


def test_model_card_metadata_and_loading(assets, tmp_path):
    """Hub metadata: base_model only for a Hub id, library_name peft for an adapter, the license from the base
    model's card; how to load the adapter (and the merged model)."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a base model\n")
    cfg = build_config(
        {"model": str(base), "dataset": assets.instruction, "output_dir": str(tmp_path / "run"), "run_name": "sft-1",
         "peft": {"method": "lora", "merge": True}}
    )  # fmt: skip
    text = report.card_text(cfg, rows_of(6, 3), report.RunFacts(parallelism="ddp", world_size=2, final_dir="/x/final"))
    meta = yaml.safe_load(text.split("---")[1])
    assert meta == {
        "library_name": "peft",
        "pipeline_tag": "text-generation",
        "tags": ["finetune", "causal-lm", "lora", "peft"],
        "license": "apache-2.0",
    }
    assert (
        "# sft-1" in text
        and f"A LoRA adapter for `{base}`" in text
        and "AutoPeftModelForCausalLM as Auto" in text
        and "subfolder='merged'" in text
    )
    assert "| eval_loss | 0.2500 |" in text and "| eval_accuracy | 1.0000 |" in text
    # How to load it: no path of the training machine (the card travels with the model); the Hub repo when pushed.
    loads = [line for line in text.splitlines() if "from_pretrained(" in line]
    assert loads and all("'path/to/final'" in line for line in loads), loads
    assert "/x/final" not in text
    pushed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, push_to_hub=True, hub_model_id="org/sft-1"))
    loads = [
        line
        for line in report.card_text(pushed, rows_of(2, 1), report.RunFacts()).splitlines()
        if "from_pretrained(" in line
    ]
    assert loads and all("'org/sft-1'" in line for line in loads), loads
    hub = build_config(
        {"model": "org/base", "dataset": "org/data", "output_dir": str(tmp_path / "r")}, check_filesystem=False
    )
    meta = yaml.safe_load(report.card_text(hub, rows_of(2, 1), report.RunFacts()).split("---")[1])
    assert (
        meta["base_model"] == "org/base" and meta["datasets"] == ["org/data"] and meta["library_name"] == "transformers"
    )


# ---------------------------------------------------------------- console


def test_screen_filter_main_and_other_ranks():
    def record(name, level, msg, **extra):
        r = logging.LogRecord(name, level, __file__, 1, msg, None, None)
        r.__dict__.update(extra)
        return r

    main, other = console.ScreenFilter(True, 0), console.ScreenFilter(False, 1)
    report_text = (
        "\x1b[1mLlamaForSequenceClassification LOAD REPORT\x1b[0m from: x\nKey | Status |\n---+---\n"
        "lm_head.weight | UNEXPECTED | \nscore.weight   | MISSING    | \n"
    )
    load = record("transformers.modeling_utils", logging.WARNING, report_text)
    assert main.filter(load) and load.screen == (
        "model weights newly initialised (not in the checkpoint): score.weight; in the checkpoint but unused: "
        "lm_head.weight (transformers' load report in logs/rank0.log)"
    )
    assert load.getMessage() == report_text  # the rank's log gets the table itself
    assert not main.filter(record("DeepSpeed", logging.WARNING, "Setting accelerator to CPU. If you have GPU"))
    assert not main.filter(record("py.warnings", logging.WARNING, "x", category=FutureWarning))
    assert main.filter(record("py.warnings", logging.WARNING, "x", category=UserWarning))
    assert main.filter(record("finetune", logging.INFO, "step 1")) and not main.filter(
        record("datasets", logging.INFO, "x")
    )
    assert not other.filter(record("finetune", logging.WARNING, "rank 1 warns"))
    assert other.filter(record("finetune", logging.ERROR, "rank 1 fails"))


# ---------------------------------------------------------------- real runs


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(logdir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(files[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def screen_problems(output: str) -> list[str]:
    """Lines of the screen that come from a non-main rank or are known third-party noise."""
    return [
        line
        for line in output.splitlines()
        if re.match(r"\[(finetune|transformers|datasets|warning)[^\]]* rank[1-9]", line)
        or line.startswith("[rank1]")
        or any(n in line for n in NOISE)
    ]


@pytest.mark.slow
def test_ddp_run_tensorboard_curves_card_console(assets, tmp_path):
    """A 2-process DDP classification run with report_to tensorboard and a Hub token in the environment."""
    res = finetune(
        tmp_path / "ddp",
        *classification_args(assets.llama, assets),
        "--max_steps", "6", "--logging_steps", "1", "--eval_steps", "3", "--save_steps", "3",
        "--max_seq_length", "32", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
        "--report_to", "tensorboard", "--run_name", "ddp-cls", "--curves", "true",
        launcher="ddp",
        extra_env={"HF_TOKEN": TOKEN},
    )  # fmt: skip
    out = res.output_dir
    # TensorBoard: every scalar equals metrics.jsonl's, step by step.
    tb = tensorboard_scalars(out / "runs" / "finetune")
    for key in ("loss", "learning_rate", "tokens_per_s", "eval_loss", "eval_accuracy", "eval_f1"):
        expected = {r["step"]: r[key] for r in res.rows if key in r}
        assert len(expected) >= 2 and set(tb[key]) == set(expected), key
        for step, value in expected.items():
            assert tb[key][step] == pytest.approx(value, rel=1e-6, abs=1e-12), (key, step)
    # curves.png: a real picture, the series of this run.
    assert png_size(out / "curves.png") == (1200, 750) and (out / "curves.png").stat().st_size > 20_000
    fig = report.build_figure([("ddp-cls", report.read_rows(out))])
    assert [len(ax.lines) for ax in fig.axes] == [2, 2, 1, 1]
    # The model card: this run's base model, world size, final metrics.
    card = (out / "final" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-classification"
    assert f"A fine-tuned version of `{assets.llama}`" in card and "# ddp-cls" in card
    assert "distributed type: MULTI_CPU, world size: 2" in card and "ddp; data parallel 2" in card
    last = res.eval_rows[-1]
    for key in ("eval_loss", "eval_accuracy", "eval_f1"):
        assert f"| {key} | {last[key]:.4f} |" in card
    assert f"tokens seen: {res.train_rows[-1]['tokens_seen']:,}" in card and "rank 1 host RSS" in card
    # The screen: the main process only, none of the noise; the rank logs have it.
    assert screen_problems(res.output) == [], screen_problems(res.output)
    assert res.output.count("Loading weights: 100%") <= 1  # one progress bar, not one per rank
    assert "model weights newly initialised (not in the checkpoint): score.weight" in res.output
    tail = res.output[res.output.index("run summary") :]
    assert str(out / "final" / "README.md") in tail and str(out / "curves.png") in tail and "eval_accuracy" in tail
    for rank in (0, 1):
        log = (out / "logs" / f"rank{rank}.log").read_text()
        assert "LOAD REPORT" in log and "score.weight" in log, rank
    assert "step 6/6" not in (out / "logs" / "rank1.log").read_text()  # rank 1 logs its own lines only
    # The token: in the environment of every rank, in no file and not on the screen.
    assert TOKEN not in res.output
    for path in out.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_zero2_run_console_and_card(assets, tmp_path):
    res = finetune(
        tmp_path / "zero2",
        *classification_args(assets.llama, assets),
        "--max_steps", "3", "--logging_steps", "1", "--eval_steps", "3", "--save_steps", "null",
        "--max_seq_length", "32", "--per_device_train_batch_size", "4", "--curves", "true",
        launcher="zero2",
    )  # fmt: skip
    out = res.output_dir
    # accelerate's launcher (its own process, before any rank starts) imports DeepSpeed once to launch a DeepSpeed
    # config and prints the CPU warning itself; the ranks' copies are in their logs.
    launcher_line = [ln for ln in res.output.splitlines() if "Setting accelerator to CPU" in ln]
    assert len(launcher_line) <= 1, launcher_line
    others = [ln for ln in screen_problems(res.output) if ln not in launcher_line]
    assert others == [] and "built successfully" not in res.output, others
    for rank in (0, 1):
        log = (out / "logs" / f"rank{rank}.log").read_text()
        assert "Setting accelerator to CPU" in log and "LOAD REPORT" in log, rank
        assert "built successfully" not in log, rank  # DeepSpeed's inference-only shm op is not built on CPUs
    card = (out / "final" / "README.md").read_text()
    assert "deepspeed, ZeRO-2; data parallel 2" in card and "distributed type: DEEPSPEED, world size: 2" in card
    assert f"| eval_accuracy | {res.eval_rows[-1]['eval_accuracy']:.4f} |" in card
    assert (out / "curves.png").stat().st_size > 20_000 and "run summary" in res.output
