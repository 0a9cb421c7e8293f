"""Bad input: a corpus of broken inputs, each run through the entry point of `python -m finetune`
(cli.run_cli), in this process, and then again through `accelerate launch` with 2 ranks, as users start runs
(test_bad_input_under_accelerate_launch: no traceback from the ranks or the launcher either).

Every case must end with exit code 2 and one clear message: the key (or file) that is wrong, what is
wrong and the fix; no traceback; in under 10 s (wall time; CPU time when others overload the
machine); before any model is loaded where the config alone tells; and the previous run in
output_dir (indeed every file of the case) left byte for byte as it was. Where the problem is not
about output_dir, `--overwrite_output_dir true` is passed, so a run that got far enough would clear
that previous run: an untouched directory shows it stopped first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import EXPECTED, grid_param

from finetune.demo import write_jsonl

pytestmark = pytest.mark.xdist_group("bad_inputs")  # one worker: its module fixture runs once
ROOT = Path(__file__).resolve().parents[1]
TIME_LIMIT_S = 10.0
DROP = object()  # a base-config field set to DROP is left out of the YAML
# An FSDP2 launch with a parallelism_config (as accelerate launch passes it on), its sizes added by the case
FSDP2_MESH = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true"}

# Where a case must have stopped. CONFIG: at the edge, while parsing and validating (no Accelerator,
# no tokenizer, no data). DATA: before any model is loaded (the problem needs the data or the
# tokenizer). MODEL: only a loaded model tells (e.g. which module names it has).
CONFIG, DATA, MODEL = "config", "data", "model"

# A problem line names its fix: a constraint ("must be >= 1"), the expected form, the choices,
# or an imperative.
FIX_WORDS = (
    "must",
    "expected",
    "is not one of",
    "did you mean",
    "set ",
    "give ",
    "use ",
    "pass ",
    "remove",
    "drop ",
    "pick ",
    "raise ",
    "lower ",
    "fix ",
    "add ",
    "save ",
    "see ",
    "point at",
    "options take the form",
)


@dataclass
class Ctx:
    """What a case builds its input from: shared tiny assets, its own temp dir and the output_dir."""

    assets: object
    no_chat_model: str
    tmp: Path
    out: Path  # holds the fake previous run
    output_dir: Path  # what --output_dir gets (out unless the case says otherwise)
    env: dict[str, str] = field(default_factory=dict)

    def base(self) -> dict:
        """A run config that would train: tiny llama, instruction data, tiny batches."""
        return {
            "model": self.assets.llama,
            "dataset": self.assets.instruction,
            "max_seq_length": 64,
            "per_device_train_batch_size": 4,
            "max_steps": 2,
            "save_steps": None,
            "disable_tqdm": True,
        }

    def yaml(self, **fields) -> list[str]:
        values = {k: v for k, v in {**self.base(), **fields}.items() if v is not DROP}
        return ["--config", self.write("run.yaml", yaml.safe_dump(values))]

    def write(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def jsonl(self, name: str, rows: list[dict]) -> str:
        return write_jsonl(rows, self.tmp / name)

    def mkdir(self, name: str) -> str:
        (self.tmp / name).mkdir(parents=True, exist_ok=True)
        return str(self.tmp / name)

    def deepspeed(self, **json_fields) -> list[str]:
        ds = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 2},
            **json_fields,
        }
        self.env["ACCELERATE_USE_DEEPSPEED"] = "true"
        self.env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = self.write("ds.json", json.dumps(ds))
        return self.yaml()


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Ctx], list[str]]  # writes what it needs under ctx.tmp; returns argv
    key: str  # reported as "  - <key>: ..."
    text: str  # in that problem's message (the file, the value or the fix)
    stage: str = CONFIG
    overwrite: bool = True  # pass --overwrite_output_dir true (the problem is not about output_dir)
    problems: int = 1
    marks: tuple = ()
    # problems under accelerate launch's 2 ranks, where they differ (None: `problems`): a parallelism_config's mesh
    # of 2 processes is refused besides in the one process of the in-process run, not under the launch
    launched_problems: int | None = None


def rows_cls(labels: list) -> list[dict]:
    return [{"text": f"sample {i} about food and rain", "label": lab} for i, lab in enumerate(labels)]


def rows_instruction(n: int, response="It is about tech.") -> list[dict]:
    return [{"prompt": f"Which topic is this about? item {i}", "response": response} for i in range(n)]


def rows_chat(n: int, answer_role: str = "assistant") -> list[dict]:
    turns = [{"role": "user", "content": "Which topic is this about?"}, {"role": answer_role, "content": "tech"}]
    return [{"messages": [{**m, "content": f"{m['content']} {i}"} for m in turns]} for i in range(n)]


LONG_PROMPT = "Which topic is this about? " + "the match was good and the team won again " * 6
CLS = {"task": "classification"}


def cls_data(c: Ctx, labels: list, **more) -> list[str]:
    return c.yaml(**CLS, dataset=c.jsonl("cls.jsonl", rows_cls(labels)), eval_fraction=0.0, **more)


def tiny_opt(c: Ctx) -> str:
    """An OPT model directory (its config alone): OPT builds its attention mask without the position_ids."""
    from transformers import AutoConfig

    sizes = dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32)
    AutoConfig.for_model("opt", vocab_size=300, **sizes).save_pretrained(c.tmp / "opt")
    return str(c.tmp / "opt")


def adapter_dir(c: Ctx, name: str = "adapter") -> str:
    """What a LoRA run's final/ holds: adapter_config.json (naming its base), the adapter's weights, the tokenizer."""
    path = c.mkdir(name)
    shutil.copytree(
        c.assets.llama, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("config.json", "*.safetensors")
    )
    c.write(f"{name}/adapter_config.json", json.dumps({"peft_type": "LORA", "base_model_name_or_path": c.assets.llama}))
    c.write(f"{name}/adapter_model.safetensors", b"")
    return path


def output_dir_of(c: Ctx, method: str) -> str:
    """A finished run's output_dir: run_config.yaml, and final/ holding the model (method none) or the adapter."""
    if method == "none":
        shutil.copytree(c.assets.llama, c.tmp / f"run_{method}" / "final")
    else:
        adapter_dir(c, f"run_{method}/final")
    c.write(f"run_{method}/run_config.yaml", f"peft:\n  method: {method}\n")
    return str(c.tmp / f"run_{method}")


def checkpoint_of(c: Ctx, method: str, model_in: str) -> str:
    """A finetune checkpoint's files as a run's model: trainer_state.json, run_config.yaml (peft.method) and the
    tiny llama where the layout writes its from_pretrained copy ("." the checkpoint, "portable" DeepSpeed's and
    FSDP2's); test_peft's adapter-run checkpoint test reads a real one."""
    path = c.tmp / f"ckpt_{method}"
    shutil.copytree(c.assets.llama, path / model_in)
    c.write(f"ckpt_{method}/trainer_state.json", json.dumps({"step": 2, "layout": {}}))
    c.write(f"ckpt_{method}/run_config.yaml", f"model: base\npeft:\n  method: {method}\n")
    return str(path)


def weights_only(c: Ctx) -> str:
    """The tiny GPT-2's config and weights, without its tokenizer files."""
    path = c.mkdir("weights_only")
    shutil.copytree(c.assets.gpt2, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("tokenizer*", "chat_*"))
    return path


def roberta_config_dir(c: Ctx) -> str:
    """A RoBERTa-base-shaped config.json (514 positions, pad id 1) beside the tiny llama's tokenizer."""
    path = c.mkdir("roberta")
    shutil.copytree(c.assets.llama, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
    config = {"model_type": "roberta", "max_position_embeddings": 514, "pad_token_id": 1, "vocab_size": 600}
    c.write("roberta/config.json", json.dumps(config))
    return path


def without_checkpoints(c: Ctx) -> list[str]:
    shutil.rmtree(c.out / "checkpoints")
    return c.yaml(resume_from_checkpoint="latest")


def restarted_by_the_launcher(c: Ctx) -> list[str]:
    """torchrun restarted the ranks (--max_restarts) of a run launched without --resume_from_checkpoint auto: its
    first attempt is the previous run in output_dir."""
    c.env["TORCHELASTIC_RESTART_COUNT"] = "1"
    return c.yaml()


def latest_names_missing_step(c: Ctx) -> list[str]:
    (c.out / "checkpoints" / "latest").write_text("step_9\n")
    return c.yaml(resume_from_checkpoint="latest")


def files_of_two_kinds(c: Ctx) -> list[str]:
    c.write("data/a.jsonl", '{"text": "a"}\n')
    c.write("data/b.csv", "text\nb\n")
    return c.yaml(dataset=str(c.tmp / "data" / "*"))


def deepspeed_json_malformed(c: Ctx) -> list[str]:
    args = c.deepspeed()
    c.write("ds.json", '{"zero_optimization": {"stage": 2}')
    return args


def deepspeed_json_relative_not_here(c: Ctx) -> list[str]:
    """A shipped ZeRO config launched from another folder: its JSON path is relative to the checkout's root."""
    args = c.deepspeed()
    c.env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = "ds_configs/not_in_this_folder.json"
    return args


def output_dir_is_a_file(c: Ctx) -> list[str]:
    c.output_dir = Path(c.write("out.txt", "not a directory"))
    return c.yaml()


CASES = [
    # ---- the run-config file and the command line
    Case(
        "yaml_malformed",
        lambda c: ["--config", c.write("run.yaml", "model: m\ndataset: d\nmax_steps: 3: 4\n")],
        "--config",
        "line 3",
    ),
    Case(
        "yaml_not_a_mapping", lambda c: ["--config", c.write("run.yaml", "- model\n- dataset\n")], "--config", "mapping"
    ),
    Case("config_file_missing", lambda c: ["--config", str(c.tmp / "nowhere.yaml")], "--config", "nowhere.yaml"),
    Case("config_is_a_directory", lambda c: ["--config", c.mkdir("configs")], "--config", "directory"),
    Case("config_not_utf8", lambda c: ["--config", c.write("run.yaml", b"model: \xff\xfe\n")], "--config", "UTF-8"),
    Case("no_config_no_model", lambda c: [], "--config", "examples/", problems=3),
    Case("unknown_key_typo", lambda c: c.yaml(learning_rat=1e-3), "learning_rat", "did you mean 'learning_rate'"),
    Case("unknown_key", lambda c: c.yaml(frobnicate=1), "frobnicate", "finetune --help"),
    Case("unknown_flag", lambda c: [*c.yaml(), "--max_step", "3"], "--max_step", "did you mean --max_steps"),
    Case("stray_argument", lambda c: [*c.yaml(), "train"], "train", "--field value"),
    Case(
        "peft_unknown_field",
        lambda c: c.yaml(peft={"method": "lora", "rank": 4}),
        "peft.rank",
        "did you mean 'peft.r'",
    ),
    Case("peft_not_a_mapping", lambda c: c.yaml(peft="lora"), "peft", "method: lora"),
    # ---- wrong types
    Case("int_given_text", lambda c: c.yaml(max_steps="ten"), "max_steps", "expected an integer"),
    Case(
        "int_given_fraction",
        lambda c: [*c.yaml(), "--per_device_train_batch_size", "2.5"],
        "per_device_train_batch_size",
        "2.5",
    ),
    Case("float_given_text", lambda c: c.yaml(learning_rate="fast"), "learning_rate", "expected a number"),
    Case("bool_given_text", lambda c: c.yaml(packing="maybe"), "packing", "true or false"),
    Case("string_given_list", lambda c: c.yaml(text_column=["a", "b"]), "text_column", "expected a string"),
    Case("list_given_mapping", lambda c: c.yaml(report_to={"tensorboard": True}), "report_to", "list of str"),
    Case("required_value_null", lambda c: c.yaml(learning_rate=None), "learning_rate", "must not be empty"),
    Case("choice_typo", lambda c: c.yaml(lr_scheduler_type="cosin"), "lr_scheduler_type", "did you mean 'cosine'"),
    Case("cpu_allocator_unknown", lambda c: c.yaml(cpu_allocator="keeep"), "cpu_allocator", "did you mean 'keep'"),
    Case("unknown_task", lambda c: c.yaml(task="regression"), "task", "causal_lm, classification, seq2seq"),
    Case("unknown_dtype", lambda c: c.yaml(torch_dtype="fp16"), "torch_dtype", "float16"),
    Case("unknown_peft_method", lambda c: c.yaml(peft={"method": "qlora"}), "peft.method", "did you mean 'lora'"),
    # ---- zero, negative and out-of-range sizes
    Case("batch_size_zero", lambda c: c.yaml(per_device_train_batch_size=0), "per_device_train_batch_size", ">= 1"),
    Case(
        "grad_accumulation_negative",
        lambda c: c.yaml(gradient_accumulation_steps=-2),
        "gradient_accumulation_steps",
        "-2",
    ),
    Case("max_seq_length_zero", lambda c: c.yaml(max_seq_length=0), "max_seq_length", ">= 1"),
    Case("max_steps_zero", lambda c: c.yaml(max_steps=0), "max_steps", "-1"),
    Case("epochs_zero", lambda c: c.yaml(max_steps=-1, num_train_epochs=0), "num_train_epochs", "> 0"),
    Case("learning_rate_negative", lambda c: c.yaml(learning_rate=-1e-4), "learning_rate", "> 0"),
    Case("save_steps_zero", lambda c: c.yaml(save_steps=0), "save_steps", "null"),
    Case("profile_steps_backwards", lambda c: c.yaml(profile_steps="3-2"), "profile_steps", "like 5-7"),
    Case(
        "profile_steps_after_the_run",
        lambda c: c.yaml(profile_steps="2-3"),  # the base config runs max_steps 2
        "profile_steps",
        "takes 2 optimizer steps",
        stage=DATA,
    ),
    Case("warmup_ratio_above_one", lambda c: c.yaml(warmup_ratio=1.5), "warmup_ratio", "[0, 1)"),
    Case("eval_fraction_one", lambda c: c.yaml(eval_fraction=1.0), "eval_fraction", "[0, 1)"),
    Case("peft_rank_zero", lambda c: c.yaml(peft={"method": "lora", "r": 0}), "peft.r", ">= 1"),
    Case("dataloader_workers_negative", lambda c: c.yaml(dataloader_num_workers=-1), "dataloader_num_workers", ">= 0"),
    # ---- model and data files
    Case("model_not_given", lambda c: c.yaml(model=DROP), "model", "local model directory"),
    Case("dataset_not_given", lambda c: c.yaml(dataset=DROP), "dataset", "local data files"),
    Case("model_dir_missing", lambda c: c.yaml(model=str(c.tmp / "no_model")), "model", "no_model"),
    Case("model_dir_without_config", lambda c: c.yaml(model=c.mkdir("empty_model")), "model", "config.json"),
    Case("model_is_an_adapter", lambda c: c.yaml(model=adapter_dir(c)), "model", "peft.adapter to "),
    Case("model_is_a_runs_output_dir", lambda c: c.yaml(model=output_dir_of(c, "none")), "model", "its final/ ("),
    Case(
        "model_is_an_adapter_runs_output_dir",
        lambda c: c.yaml(model=output_dir_of(c, "lora")),
        "model",
        "output_dir of an adapter run, not a model: set model to its base model",
    ),
    Case(
        "model_is_an_adapter_runs_checkpoint",
        lambda c: c.yaml(model=checkpoint_of(c, "lora", ".")),
        "model",
        "resume_from_checkpoint: ",
    ),
    Case(
        "model_is_a_zero3_checkpoint",
        lambda c: c.yaml(model=checkpoint_of(c, "none", "portable")),
        "model",
        "whole model is in portable/: set model to ",
    ),
    Case("model_hub_id_offline", lambda c: c.yaml(model="someorg/tiny-model"), "model", "local", stage=DATA),
    # transformers 5 builds a tokenizer of its special tokens only from a directory without tokenizer files (a
    # checkpoint of an earlier finetune): GPT-2's encoded every example to nothing
    Case(
        "model_dir_without_tokenizer",
        lambda c: c.yaml(model=weights_only(c)),
        "model",
        "holds no tokenizer",
        stage=DATA,
    ),
    Case("dataset_file_missing", lambda c: c.yaml(dataset=str(c.tmp / "no.jsonl")), "dataset", "no.jsonl"),
    Case(
        "dataset_unsupported_extension",
        lambda c: c.yaml(dataset=c.write("train.xml", "<rows/>")),
        "dataset",
        ".jsonl",
    ),
    Case(
        "dataset_not_json",
        lambda c: c.yaml(dataset=c.write("bad.jsonl", '{"prompt": "p", "response": \n<<<garbage>>>\n')),
        "dataset",
        "bad.jsonl",
        stage=DATA,
    ),
    Case("dataset_empty_file", lambda c: c.yaml(dataset=c.write("empty.jsonl", "")), "dataset", "empty.jsonl"),
    Case("dataset_dir_without_data_files", lambda c: c.yaml(dataset=c.mkdir("data")), "dataset", "data"),
    Case(
        "dataset_files_of_two_kinds",
        files_of_two_kinds,
        "dataset",
        "one kind",
    ),
    Case(
        "dataset_hub_id_offline",
        lambda c: c.yaml(dataset="someorg/some-dataset"),
        "dataset",
        "local files",
        stage=DATA,
    ),
    Case(
        "eval_dataset_missing", lambda c: c.yaml(eval_dataset=str(c.tmp / "eval.jsonl")), "eval_dataset", "eval.jsonl"
    ),
    Case("eval_split_with_local_files", lambda c: c.yaml(eval_split="test"), "eval_split", "eval_dataset", stage=DATA),
    # train_split and eval_split name no split of local files: refused, not ignored (the run trained on the one split)
    Case(
        "train_split_with_local_files", lambda c: c.yaml(train_split="validation"), "train_split", "remove", stage=DATA
    ),
    Case(
        "eval_split_with_local_eval_dataset",
        lambda c: c.yaml(eval_dataset=c.assets.instruction, eval_split="validation"),
        "eval_split",
        "evaluated whole",
        stage=DATA,
    ),
    Case(
        "chat_template_neither_text_nor_file",
        lambda c: c.yaml(chat_template="templates/chatml.jinja"),
        "chat_template",
        "chatml.jinja",
    ),
    Case(
        "peft_adapter_dir_without_config",
        lambda c: c.yaml(peft={"method": "lora", "adapter": c.mkdir("adapter")}),
        "peft.adapter",
        "adapter_config.json",
    ),
    # ---- what is in the data
    Case("text_column_missing", lambda c: c.yaml(format="text"), "text_column", "'text'", stage=DATA),
    Case("format_does_not_match_data", lambda c: c.yaml(format="chat"), "messages_column", "format", stage=DATA),
    Case(
        "format_not_detectable",
        lambda c: c.yaml(dataset=c.jsonl("odd.jsonl", [{"question": "q", "answer": "a"}] * 20)),
        "format",
        "question",
        stage=DATA,
    ),
    Case(
        "label_column_missing",
        lambda c: c.yaml(**CLS, dataset=c.assets.classification, label_column="topic"),
        "label_column",
        "'topic'",
        stage=DATA,
    ),
    Case(
        "text_pair_column_missing",
        lambda c: c.yaml(**CLS, dataset=c.assets.classification, text_pair_column="hypothesis"),
        "text_pair_column",
        "'hypothesis'",
        stage=DATA,
    ),
    Case(
        "no_supervised_tokens",
        lambda c: c.yaml(dataset=c.jsonl("long.jsonl", [{"prompt": LONG_PROMPT, "response": "sports"}] * 20)),
        "dataset",
        "raise max_seq_length",
        stage=DATA,
    ),
    Case(
        "responses_all_null",
        lambda c: c.yaml(dataset=c.jsonl("null.jsonl", rows_instruction(20, response=None))),
        "response_column",
        "null 'response'",
        stage=DATA,
    ),
    Case(
        "chat_role_not_assistant",
        lambda c: c.yaml(format="chat", dataset=c.jsonl("bot.jsonl", rows_chat(20, "bot"))),
        "role_map",
        "role_map: {bot: assistant}",
        stage=DATA,
    ),
    Case(
        "data_shape_ambiguous",
        lambda c: c.yaml(dataset=c.jsonl("both.jsonl", [{**r, "conversations": r["messages"]} for r in rows_chat(20)])),
        "messages_column",
        "'conversations'",
        stage=DATA,
    ),
    Case(
        "prepared_data_not_prepared",
        lambda c: c.yaml(prepared_data=c.mkdir("not_prepared")),
        "prepared_data",
        "finetune prepare",
    ),
    Case(
        "dpo_on_instruction_data", lambda c: c.yaml(method="dpo"), "method", "cannot train instruction data", stage=DATA
    ),  # fmt: skip
    Case(
        "streaming_dpo_with_precomputed_references",
        lambda c: c.yaml(
            method="dpo",
            streaming=True,
            max_steps=4,
            dataset=c.jsonl("pairs.jsonl", [{"prompt": f"p{i}", "chosen": "a", "rejected": "b"} for i in range(20)]),
        ),
        "streaming",
        "set reference: live",
    ),
    Case(
        "preference_pairs_all_the_same",
        lambda c: c.yaml(
            method="orpo",
            dataset=c.jsonl("same.jsonl", [{"prompt": f"p{i}", "chosen": "a", "rejected": "a"} for i in range(20)]),
        ),
        "rejected_column",
        "anything to compare",
        stage=DATA,
    ),
    Case("preference_method_unknown", lambda c: c.yaml(method="kto"), "method", "one of"),
    Case("streaming_without_max_steps", lambda c: c.yaml(streaming=True, max_steps=-1), "max_steps", "streaming"),
    Case(
        "streaming_chat_role_not_assistant",  # found in the stream's first rows, before any model loads
        lambda c: c.yaml(
            format="chat", streaming=True, eval_fraction=0, dataset=c.jsonl("bot.jsonl", rows_chat(20, "bot"))
        ),
        "role_map",
        "role_map: {bot: assistant}",
        stage=DATA,
    ),
    Case("role_map_not_a_mapping", lambda c: c.yaml(role_map=["bot", "assistant"]), "role_map", "mapping"),
    Case("labels_empty", lambda c: cls_data(c, [0, 1, None, 1] * 5), "label_column", "empty labels", stage=DATA),
    Case("label_negative", lambda c: cls_data(c, [0, 1, -1, 2] * 5), "label_column", "-1", stage=DATA),
    Case(
        "label_out_of_range_in_eval",
        lambda c: cls_data(c, [0, 1, 2] * 8, eval_dataset=c.jsonl("cls_eval.jsonl", rows_cls([0, 7]))),
        "label_column",
        "7",
        stage=DATA,
    ),
    Case("labels_of_mixed_types", lambda c: cls_data(c, [0, "food"] * 10), "label_column", "one type", stage=DATA),
    Case("labels_all_one", lambda c: cls_data(c, ["food"] * 8), "label_column", "at least 2 labels", stage=DATA),
    Case("labels_floats", lambda c: cls_data(c, [0.0, 1.5] * 8), "label_column", "regression", stage=DATA),
    Case(
        "chat_data_tokenizer_without_template",
        lambda c: c.yaml(model=c.no_chat_model, dataset=c.assets.chat),
        "chat_template",
        "set chat_template",
        stage=DATA,
    ),
    Case(
        "chat_template_refuses_a_conversation",  # jinja's raise_exception, as Llama-2's and Gemma's templates do
        lambda c: c.yaml(
            dataset=c.jsonl(
                "sys.jsonl",
                [{"messages": [{"role": "system", "content": "Be brief."}, *r["messages"]]} for r in rows_chat(20)],
            ),
            chat_template="{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not "
            "supported') }}{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        ),  # fmt: skip
        "chat_template",
        "row 0: the chat template cannot render this conversation (TemplateError: System role not supported)",
        stage=DATA,
    ),
    Case(
        "chat_messages_not_a_list",
        lambda c: c.yaml(dataset=c.jsonl("chat.jsonl", [{"messages": "hello there"}] * 20)),
        "messages_column",
        "role",
        stage=DATA,
    ),
    Case(
        "data_smaller_than_one_batch",
        lambda c: c.yaml(dataset=c.jsonl("tiny.jsonl", rows_instruction(3)), eval_fraction=0.0),
        "per_device_train_batch_size",
        "smaller batches",
        stage=DATA,
    ),
    Case(
        "eval_fraction_leaves_no_train",
        lambda c: c.yaml(dataset=c.jsonl("one.jsonl", rows_instruction(1)), eval_fraction=0.5),
        "eval_fraction",
        "lower it",
        stage=DATA,
    ),
    Case("max_seq_length_beyond_model", lambda c: c.yaml(max_seq_length=4096), "max_seq_length", "<= 512"),
    Case(  # RoBERTa numbers positions from pad_token_id + 1: 514 - 1 - 1 usable (513 crashed in the first forward)
        "max_seq_length_beyond_roberta_positions",
        lambda c: c.yaml(**CLS, model=roberta_config_dir(c), dataset=c.assets.classification, max_seq_length=513),
        "max_seq_length",
        "<= 512",
    ),
    Case(
        "metric_unknown",
        lambda c: c.yaml(**CLS, dataset=c.assets.classification, metrics=["no_such_metric"]),
        "metrics",
        "accuracy",
    ),
    Case(
        "report_to_unknown_tracker",
        lambda c: c.yaml(report_to=["no_such_tracker"]),
        "report_to",
        "no_such_tracker",
        stage=DATA,
    ),
    Case(
        "packing_on_a_model_that_lets_examples_see_each_other",
        lambda c: c.yaml(model=tiny_opt(c), packing=True),
        "packing",
        "(opt) would let the examples",
    ),
    Case(
        "attn_implementation_unknown",
        lambda c: c.yaml(attn_implementation="flash_attention_9"),
        "attn_implementation",
        "sdpa",
        stage=MODEL,
    ),
    Case(
        "peft_target_modules_not_in_model",
        lambda c: c.yaml(peft={"method": "lora", "target_modules": ["no_such_proj"]}),
        "peft.target_modules",
        "no_such_proj",
        stage=MODEL,
    ),
    # ---- options that do not combine
    Case("packing_with_classification", lambda c: c.yaml(**CLS, packing=True), "packing", "packing: false"),
    Case(
        "eval_steps_without_eval_data", lambda c: c.yaml(eval_steps=5, eval_fraction=0.0), "eval_steps", "eval_dataset"
    ),
    Case(
        "eval_on_start_without_eval_data",
        lambda c: c.yaml(eval_on_start=True, eval_fraction=0.0),
        "eval_on_start",
        "eval_fraction",
    ),
    Case("merge_without_peft", lambda c: c.yaml(peft={"merge": True}), "peft.method", "lora"),
    Case("adapter_rank_without_peft", lambda c: c.yaml(peft={"r": 4}), "peft.method", "peft.r configure an adapter"),
    Case("chat_format_for_classification", lambda c: c.yaml(**CLS, format="chat"), "format", "classification"),
    Case("classification_format_for_causal_lm", lambda c: c.yaml(format="classification"), "format", "task"),
    Case(
        "load_in_4bit_without_gpu",
        lambda c: c.yaml(peft={"method": "lora", "load_in_4bit": True}),
        "peft.load_in_4bit",
        "false",
        stage=DATA,
    ),
    Case(
        "deepspeed_json_contradicts_accumulation",
        lambda c: c.deepspeed(gradient_accumulation_steps=4),
        "gradient_accumulation_steps",
        '"auto"',
    ),
    Case(
        "deepspeed_json_malformed",
        deepspeed_json_malformed,
        "deepspeed_config_file",
        "ds.json",
    ),
    Case(
        "deepspeed_json_relative_not_here",
        deepspeed_json_relative_not_here,
        "deepspeed_config_file",
        "--deepspeed_config_file PATH",
    ),
    Case(
        "deepspeed_json_has_own_optimizer",
        lambda c: c.deepspeed(optimizer={"type": "Adam", "params": {"lr": 1e-3}}),
        "optimizer",
        "remove it",
    ),
    Case(
        # accelerate's CPU mode drops the DeepSpeed config: it was an AttributeError in Topology.read (no plugin)
        "deepspeed_in_accelerate_cpu_mode",
        lambda c: (c.env.update(ACCELERATE_USE_CPU="true"), c.deepspeed())[1],
        "ACCELERATE_USE_CPU",
        "accelerate ignores the DeepSpeed config",
    ),
    # ---- an Accelerate parallelism_config whose ranks share a batch (accelerate launch passes its sizes on)
    Case(
        # accelerate gives a context-parallel group's ranks one batch; finetune counted each rank's as its own
        "context_parallel_size",
        lambda c: (c.env.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_CP_SIZE="2"), c.yaml())[1],
        "parallelism_config_cp_size",
        "set parallelism_config_cp_size: 1",
    ),
    Case(
        # accelerate splits no model by it under DeepSpeed, and its tp ranks read one batch
        "deepspeed_with_parallelism_config_tp",
        lambda c: (
            c.env.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_TP_SIZE="2"),
            c.deepspeed(),
        )[1],
        "parallelism_config_tp_size",
        "tp2_fsdp2.yaml",
    ),
    Case(
        # accelerate 1.15 refused it at Accelerator() in a traceback on every rank: FSDP2 has no dp_shard ranks
        "fsdp2_tp_over_every_process",
        lambda c: (c.env.update(PARALLELISM_CONFIG_TP_SIZE="2", **FSDP2_MESH), c.yaml())[1],
        "parallelism_config_dp_shard_size",
        "tp2.yaml",
        problems=2,  # and in one process: a mesh of 2 (accelerate config)
        launched_problems=1,
    ),
    Case(
        "fsdp2_dp_replicate_alone",
        lambda c: (c.env.update(PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2", **FSDP2_MESH), c.yaml())[1],
        "parallelism_config_dp_shard_size",
        "ddp.yaml",
        problems=2,
        launched_problems=1,
    ),
    Case(
        "fsdp2_dp_replicate_x_tp",  # accelerate's ParallelismConfig refused it when it was made
        lambda c: (
            c.env.update(PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2", PARALLELISM_CONFIG_TP_SIZE="2", **FSDP2_MESH),
            c.yaml(),
        )[1],
        "parallelism_config_dp_shard_size",
        "dp_replicate x dp_shard x tp = the processes",
        problems=2,  # and a mesh of 4 processes in one (in two under accelerate launch)
    ),
    Case(
        # accelerate 1.15 refused it at Accelerator() on CPU ranks (MULTI_CPU) in a traceback on every rank; on GPUs it
        # ran plain DDP, sharding nothing
        "ddp_with_parallelism_config_dp_shard",
        lambda c: (
            c.env.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_DP_SHARD_SIZE="2"),
            c.yaml(),
        )[1],
        "parallelism_config_dp_shard_size",
        "use accelerate_configs/fsdp2.yaml",
    ),
    Case(
        "ddp_with_parallelism_config_dp_replicate",  # the same traceback on CPU ranks; on GPUs DDP as without it
        lambda c: (
            c.env.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2"),
            c.yaml(),
        )[1],
        "parallelism_config_dp_replicate_size",
        "drop the parallelism_config for DDP",
    ),
    Case(
        "parallelism_config_size_under_1",
        lambda c: (
            c.env.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_DP_SHARD_SIZE="0"),
            c.yaml(),
        )[1],
        "parallelism_config_dp_shard_size",
        "must be a whole number >= 1",
    ),
    Case(
        "deepspeed_autotp",
        lambda c: c.deepspeed(tensor_parallel={"autotp_size": 2}),
        "tensor_parallel.autotp_size",
        "tp2_fsdp2.yaml",
    ),
    # ---- dataset mixtures (datasets:)
    Case(
        "mixture_weight_not_positive",
        lambda c: c.yaml(dataset=DROP, datasets=[{"dataset": c.assets.instruction, "weight": 0}]),
        "datasets[0].weight",
        "> 0",
    ),
    Case(
        "mixture_formats_cannot_mix",
        lambda c: c.yaml(
            dataset=DROP,
            datasets=[
                {"dataset": c.assets.chat, "format": "chat"},
                {"dataset": c.assets.classification, "format": "classification"},
            ],
        ),
        "datasets[1].format",
        "cannot mix",
    ),
    Case(
        "mixture_source_key_typo",
        lambda c: c.yaml(dataset=DROP, datasets=[{"dataset": c.assets.instruction, "wieght": 2}]),
        "datasets[0].wieght",
        "did you mean 'weight'",
    ),
    Case(
        "mixture_source_file_missing",
        lambda c: c.yaml(dataset=DROP, datasets=[{"dataset": str(c.tmp / "nowhere.jsonl")}]),
        "datasets[0].dataset",
        "nowhere.jsonl",
    ),
    Case(
        "mixture_classification_labels_differ",
        lambda c: c.yaml(
            **CLS,
            dataset=DROP,
            eval_fraction=0.0,
            datasets=[
                {"dataset": c.jsonl("a.jsonl", rows_cls(["food", "rain"] * 4))},
                {"dataset": c.jsonl("b.jsonl", rows_cls(["food", "tech"] * 4))},
            ],
        ),
        "datasets[1].label_column",
        "same label set",
        stage=DATA,
    ),
    # ---- best checkpoint and early stopping
    Case(
        "metric_for_best_model_never_computed",
        lambda c: c.yaml(metric_for_best_model="accuracy"),
        "metric_for_best_model",
        "never computed",
    ),
    Case(
        "load_best_model_at_end_without_saving",
        lambda c: c.yaml(load_best_model_at_end=True, eval_steps=1),
        "load_best_model_at_end",
        "set save_steps",
    ),
    Case(
        "early_stopping_without_metric",
        lambda c: c.yaml(early_stopping_patience=2, eval_steps=1),
        "early_stopping_patience",
        "metric_for_best_model",
    ),
    # ---- output_dir, checkpoints, resume
    Case("output_dir_holds_previous_run", lambda c: c.yaml(), "output_dir", "--overwrite_output_dir", overwrite=False),
    Case(
        "output_dir_holds_previous_run_at_restart",
        restarted_by_the_launcher,
        "output_dir",
        "restart 1 (--max_restarts): launch with --resume_from_checkpoint auto",
        overwrite=False,
    ),
    Case("output_dir_is_a_file", output_dir_is_a_file, "output_dir", "out.txt", overwrite=False),
    Case(
        "resume_latest_without_checkpoint",
        without_checkpoints,
        "resume_from_checkpoint",
        "give 'auto' instead",
        overwrite=False,
    ),
    Case(
        "resume_latest_names_missing_checkpoint",
        latest_names_missing_step,
        "resume_from_checkpoint",
        "step_9",
        overwrite=False,
    ),
    Case(
        "resume_incomplete_checkpoint",  # step_1 holds a trainer_state.json and nothing else
        lambda c: c.yaml(resume_from_checkpoint="latest"),
        "resume_from_checkpoint",
        "step_1",
        stage=DATA,
        overwrite=False,
    ),
    Case(
        "resume_path_missing",
        lambda c: c.yaml(resume_from_checkpoint=str(c.out / "checkpoints" / "step_5")),
        "resume_from_checkpoint",
        "step_5",
        overwrite=False,
    ),
    # ---- encoder-decoders (task seq2seq) and generation eval
    Case("seq2seq_decoder_only_model", lambda c: c.yaml(task="seq2seq"), "task", "needs an encoder-decoder model"),
    Case("causal_lm_encoder_decoder", lambda c: c.yaml(model=c.assets.t5), "task", "set task: seq2seq"),
    Case(
        "seq2seq_chat_format",
        lambda c: c.yaml(model=c.assets.t5, task="seq2seq", dataset=c.assets.chat, format="chat"),
        "format",
        "no input -> target pairs",
    ),
    Case(
        "seq2seq_no_pair_columns",
        lambda c: c.yaml(model=c.assets.t5, task="seq2seq", dataset=c.assets.text),
        "format",
        "set source_column and target_column",
        stage=DATA,
    ),
    Case(
        "seq2seq_under_fsdp2",
        lambda c: (
            c.env.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2"),
            c.yaml(model=c.assets.t5, task="seq2seq"),
        )[1],
        "task",
        "zero3.yaml",
        stage=DATA,
    ),
    Case(
        "generation_metric_on_classification",
        lambda c: cls_data(c, ["a", "b"] * 4, metrics=["rouge"]),
        "metrics",
        "a classifier generates none",
    ),
    Case(
        "generation_on_classification",
        lambda c: cls_data(c, ["a", "b"] * 4, generation_max_new_tokens=8),
        "generation_max_new_tokens",
        "generates no text",
    ),
    Case(
        "generation_metric_in_metrics", lambda c: c.yaml(metrics=["bleu"]), "metrics", "set generation_max_new_tokens"
    ),
    Case(
        "label_metric_on_causal_lm",  # crashed at the first eval: no predicted labels to score
        lambda c: c.yaml(metrics=["accuracy"]),
        "metrics",
        "a causal_lm run predicts none",
    ),
    Case(
        "generation_on_raw_text",
        lambda c: c.yaml(dataset=c.assets.text, generation_max_new_tokens=8),
        "generation_max_new_tokens",
        "no prompt/answer split",
        stage=DATA,
    ),
    Case(
        "generation_without_eval_data",
        lambda c: c.yaml(generation_max_new_tokens=8, eval_fraction=0.0),
        "generation_max_new_tokens",
        "no eval data",
    ),
    Case(
        "generation_metrics_while_off",
        lambda c: c.yaml(generation_metrics=["rouge"]),
        "generation_metrics",
        "set generation_max_new_tokens",
    ),
    Case(
        "generation_metric_not_shipped_offline",
        lambda c: c.yaml(generation_max_new_tokens=8, generation_metrics=["meteor"]),
        "generation_metrics",
        "'meteor' not shipped",
    ),
]


def test_the_corpus_is_large_and_distinct():
    ids = [c.id for c in CASES]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


@pytest.fixture(scope="module")
def no_chat_model(assets, tmp_path_factory) -> str:
    """The tiny llama with a tokenizer that has no chat template."""
    path = tmp_path_factory.mktemp("no_chat") / "llama"
    shutil.copytree(assets.llama, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def make_previous_run(out: Path) -> None:
    """What a finished run leaves: metrics, a checkpoint named by `latest`, an exported model."""
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    (out / "final").mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    (out / "checkpoints" / "step_1" / "trainer_state.json").write_text('{"step": 1}')
    (out / "checkpoints" / "latest").write_text("step_1\n")
    (out / "final" / "model.safetensors").write_bytes(bytes(range(256)) * 4)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root: file -> bytes, directory -> None."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def problem_lines(output: str, key: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"  - {key}: ")]


def run_in_process(args: list[str], env: dict, monkeypatch, capsys) -> tuple[int, str, str]:
    """The same entry point as `python -m finetune` (cli.run_cli), in this process (a new process per case
    would spend most of its time importing). What a run leaves behind in the process (environment variables,
    accelerate's singletons, logging handlers, the SIGTERM handler) is put back afterwards."""
    import logging
    import signal

    from accelerate.state import AcceleratorState

    from finetune.cli import run_cli

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)
    saved_env, saved_sigterm = dict(os.environ), signal.getsignal(signal.SIGTERM)
    saved_handlers = logging.root.handlers[:]
    # Libraries (transformers, datasets) keep one stderr handler for the process: point it at this case's
    # captured stderr, not at an earlier case's (closed) one.
    for lib in logging.Logger.manager.loggerDict.values():
        for h in getattr(lib, "handlers", []):
            if type(h) is logging.StreamHandler and h.stream is not sys.stdout:
                h.stream = sys.stderr  # (setStream would flush the closed one)
    capsys.readouterr()
    try:
        code = run_cli(args)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        signal.signal(signal.SIGTERM, saved_sigterm)
        logging.root.handlers[:] = saved_handlers
        AcceleratorState._reset_state(reset_partial_state=True)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input_exits_2_with_one_clear_message(case: Case, assets, no_chat_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    make_previous_run(out)
    ctx = Ctx(assets=assets, no_chat_model=no_chat_model, tmp=tmp_path, out=out, output_dir=out)
    args = case.build(ctx)
    args += ["--output_dir", str(ctx.output_dir)]
    if case.overwrite:
        args += ["--overwrite_output_dir", "true"]
    before = snapshot(tmp_path)
    start = time.perf_counter()
    own_cpu = time.process_time()
    returncode, stdout, stderr = run_in_process(args, ctx.env, monkeypatch, capsys)
    cpu = time.process_time() - own_cpu
    elapsed = time.perf_counter() - start
    output = stdout + stderr
    shown = f"argv: {args}\n--- output:\n{output[-4000:]}"
    if os.environ.get("FINETUNE_CORPUS_DUMP"):  # the messages, to compare two commits' corpus output
        with open(os.environ["FINETUNE_CORPUS_DUMP"], "a") as dump:
            dump.write(f"== {case.id} ({returncode})\n{stderr.replace(str(tmp_path), '<tmp>')}\n")

    assert returncode == 2, shown
    assert "Traceback" not in output, shown
    n = case.problems
    assert f"finetune: {n} problem{'s' if n > 1 else ''} in the run config:" in stderr, shown
    lines = problem_lines(stderr, case.key)
    assert len(lines) == 1, f"expected one problem for {case.key!r}\n{shown}"
    assert case.text in lines[0], shown
    assert any(word in lines[0].lower() for word in FIX_WORDS), f"the message names no fix\n{shown}"
    if case.stage == CONFIG:  # refused at the edge: no Accelerator, tokenizer or data was touched
        assert "[finetune] distributed:" not in output, shown
    if case.stage in (CONFIG, DATA):  # no model was loaded
        assert "[finetune] model:" not in output and "LOAD REPORT" not in output, shown
    # Wall time is the requirement. On a machine that others keep busier than its cores (the load
    # average says so), wall time measures them too: then the run's own CPU time must fit instead.
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    assert elapsed < TIME_LIMIT_S or (busy and cpu < TIME_LIMIT_S), (
        f"took {elapsed:.1f} s ({cpu:.1f} s CPU, load {os.getloadavg()[0]:.1f})\n{shown}"
    )
    assert snapshot(tmp_path) == before, f"files under {tmp_path} changed\n{shown}"


# The refusal as users meet it, through `accelerate launch` with 2 ranks (about 7 s of a 2-core machine each). By
# default each place a problem can be found once: at the edge (every rank runs the same parse before any distributed
# start, so the launch path does not depend on the case), with the data (the main process prepares it first and the
# others wait for its cache: the path a refusal there must release, at the preparation's main steps) and with the
# model.
# FINETUNE_BAD_INPUT_GRID=1 launches every case (about 14 minutes of CPU).
LAUNCHED_CASES = (
    # at the edge (the file and the command line are one parse on every rank: one case of it launched)
    "no_config_no_model",  # three problems
    "deepspeed_json_contradicts_accumulation",  # the launcher's DeepSpeed config
    "fsdp2_tp_over_every_process",  # a parallelism_config accelerate refused at Accelerator() (FSDP2's come-up first)
    "output_dir_holds_previous_run",  # nothing of the previous run is touched
    # with the data: each place the main process can stop while the others wait for its cache
    "dataset_not_json",  # reading it
    "format_not_detectable",  # its shape
    "no_supervised_tokens",  # after tokenizing
    "streaming_chat_role_not_assistant",  # every rank reads the stream
    "preference_pairs_all_the_same",  # preference pairs
    "resume_incomplete_checkpoint",  # the checkpoint to resume
    # with the model
    "attn_implementation_unknown",
    "peft_target_modules_not_in_model",
)
ONE_PROCESS_CASES = (  # accelerate's simple launcher: one case per place a problem is found
    "no_config_no_model",  # at the edge, three problems
    "format_not_detectable",  # with the data
    "peft_target_modules_not_in_model",  # with the model loaded
)


LAUNCHES = [
    grid_param(c, "ddp", id=c.id, marks=c.marks, default=c.id in LAUNCHED_CASES, grid="FINETUNE_BAD_INPUT_GRID")
    for c in CASES
]
LAUNCHES += [pytest.param(c, "single", id=f"single-{c.id}", marks=c.marks) for c in CASES if c.id in ONE_PROCESS_CASES]


def test_every_launched_case_is_in_the_corpus_and_every_stage_is_launched():
    ids = {c.id for c in CASES}
    assert ids >= set(LAUNCHED_CASES) | set(ONE_PROCESS_CASES), (set(LAUNCHED_CASES) | set(ONE_PROCESS_CASES)) - ids
    assert {c.stage for c in CASES if c.id in LAUNCHED_CASES} == {c.stage for c in CASES} == {CONFIG, DATA, MODEL}


@pytest.mark.slow
@pytest.mark.parametrize(("case", "config"), LAUNCHES)
def test_bad_input_under_accelerate_launch(case: Case, config: str, assets, no_chat_model, tmp_path):
    """Exit 2 and no traceback from the ranks or the launcher (finetune.launcher_report), under torchrun (ddp.yaml,
    2 ranks) and under accelerate's simple launcher (single.yaml, one child process); on stderr the message comes
    first and last, the launcher's report between."""
    from conftest import run_killing_the_group

    from finetune.launching import finetune_command

    out = tmp_path / "out"
    make_previous_run(out)
    ctx = Ctx(assets=assets, no_chat_model=no_chat_model, tmp=tmp_path, out=out, output_dir=out)
    args = case.build(ctx) + ["--output_dir", str(ctx.output_dir)]
    if case.overwrite:
        args += ["--overwrite_output_dir", "true"]
    before = snapshot(tmp_path)
    cmd = finetune_command(args, ROOT / "accelerate_configs" / f"{config}.yaml")
    proc = run_killing_the_group(cmd, {**os.environ, **ctx.env, "OMP_NUM_THREADS": "1"}, 180)
    output = proc.stdout + proc.stderr
    shown = f"argv: {args}\n--- stdout:\n{proc.stdout[-3000:]}\n--- stderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2 and "Traceback" not in output, shown
    # torchrun's one-line records about its ranks go to a file the launcher's report names, not to the screen
    assert not re.search(r"closing signal|failed \(exitcode", output), shown
    # Besides the message: the data's progress bars and, from ranks stopped because another failed first, "stopped by
    # SIGTERM before training started" lines.
    noise = re.compile(r"examples/s\]|it/s\]|\d+%\||^finetune rank \d+: stopped by SIG\w+ before training started")
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not noise.search(line)]
    heading = "[launcher] finetune failed: rank" if config == "ddp" else "[launcher] finetune stopped with the message"
    report = next(i for i, line in enumerate(lines) if line.startswith(heading))
    message = lines[report + 1 :]  # the launcher's report ends with the message
    n = case.problems if case.launched_problems is None else case.launched_problems
    assert message[0] == f"finetune: {n} problem{'s' if n > 1 else ''} in the run config:", shown
    named = problem_lines("\n".join(message), case.key)
    assert len(named) == 1 and case.text in named[0], shown
    assert lines[:report] in ([], message), shown  # before it: the message as rank 0 said it, or nothing
    if "] distributed:" in proc.stdout:  # the ranks had started: no silent single process
        assert f"world size {EXPECTED[config][1]}" in proc.stdout, shown
    assert snapshot(tmp_path) == before, shown
