"""DeepSpeed ZeRO-1/2/3, with or without CPU offload (accelerate's DEEPSPEED).

What differs from DDP, and why:
- The DeepSpeed JSON (ds_configs/) leaves every value the run config owns to "auto"; a JSON that
  contradicts the run config, or brings its own optimizer or scheduler, is refused before anything starts.
- DeepSpeed compiles C++ ops on first use (a minute each): said once, cached in the project's .cache/. On CPU
  processes it would also build its shared-memory all-reduce op, which only its inference path uses: not built
  (skip_inference_shm_op).
- accelerate fills the "auto" micro batch from the loader's batch_size; length-aware batching has none.
- ZeRO-3 partitions parameters at load (zero.Init): sizes come from `ds_numel`; PEFT with gradient
  checkpointing needs reentrant checkpointing; adapter weights are set inside GatheredParameters.
- Full weights and Adam state by name go through DeepSpeed's safe_get_full_* / safe_set_full_* API,
  with two named workarounds of DeepSpeed 0.19.8 below.
- A rank whose checkpoint write fails still goes through the collectives DeepSpeed holds after its writes, so
  the others are not left waiting (finish_collectives_after_a_write_error).
- Memory per rank, three more named workarounds: the fp32 master weights are the weights' own partition
  (share_fp32_master_weights), torch's compiler is not loaded for Muon, which finetune never runs
  (compile_on_first_call), and on gloo ZeRO-3's gathers and reduce-scatters do not copy
  (gloo_collectives_by_all_reduce).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from finetune import console
from finetune.config import RunConfig, TrainArgs
from finetune.parallel import base, ddp
from finetune.parallel.topology import (
    DEEPSPEED_KEYS,
    Launcher,
    deepspeed_json_precision,
    deepspeed_offload_devices,
    launched_json_precision,
)

logger = logging.getLogger("finetune")


def project_cache() -> Path:
    """`.cache/` of the source checkout finetune runs from, else ~/.cache/finetune."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").exists() and os.access(checkout, os.W_OK):
        return checkout / ".cache"
    return Path.home() / ".cache" / "finetune"


def environment(cfg: RunConfig) -> None:
    # Importing DeepSpeed logs "Setting accelerator to CPU" (no GPU) through its own console handler: to the
    # rank's log instead of the screen (finetune/console.py).
    console.quiet_import("deepspeed")
    # accelerate's DeepSpeedPlugin fills the JSON's "auto" accumulation and clipping from these (else from its own
    # defaults, 1 and 1.0), and its accumulation then replaces the Accelerator's. A value the launcher set (the
    # Accelerate config, `accelerate launch --gradient_accumulation_steps`) is kept: problems() refuses it unless it
    # equals the run config's.
    for key in SET_BY_THE_LAUNCHER_TOO:
        os.environ.setdefault(DEEPSPEED_KEYS[key], str(_run_config_values(cfg.train)[key][1]))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(project_cache() / "torch_extensions"))
    precision_from_the_launcher_as_from_its_flag()
    announce_op_builds()
    compile_on_first_call()
    if not base.has_accelerator_device():
        skip_inference_shm_op()
        gloo_collectives_by_all_reduce()
    # DeepSpeed runs on the CPU through its own init path (gloo, see environment.make_accelerator); forcing
    # accelerate's CPU mode (ACCELERATE_USE_CPU) would silently turn a DeepSpeed config into plain MULTI_CPU.


def precision_from_the_launcher_as_from_its_flag(env: dict = os.environ) -> None:
    """Workaround (accelerate 1.15): a `mixed_precision:` line in a DeepSpeed Accelerate config file made every rank
    fail in DeepSpeedPlugin with "When using deepspeed_config_file, the following accelerate config variables will be
    ignored: [..., 'mixed_precision']": the launcher lists it among the config file's DeepSpeed fields
    (ACCELERATE_CONFIG_DS_FIELDS, commands/launch.py launch_command), which the plugin refuses beside a JSON, while
    `--mixed_precision` on the launch line passes. Both reach the ranks as ACCELERATE_MIXED_PRECISION, which finetune
    has already read (environment.set_mixed_precision) and from which accelerate fills the JSON's "auto": dropped
    from the list, the line works as the flag does. tests/test_precision.py::test_accelerate_still_refuses_a_
    mixed_precision_line_beside_a_deepspeed_json fails once accelerate takes it."""
    fields = env.get("ACCELERATE_CONFIG_DS_FIELDS")
    if fields:
        env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(f for f in fields.split(",") if f != "mixed_precision")


def _run_config_values(train: TrainArgs) -> dict[str, tuple[str, float]]:
    """DeepSpeed key -> (run-config field, its value): what the run config owns of a DeepSpeed config."""
    return {
        "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", train.per_device_train_batch_size),
        "gradient_accumulation_steps": ("gradient_accumulation_steps", train.gradient_accumulation_steps),
        "gradient_clipping": ("max_grad_norm", train.max_grad_norm),
    }


# Of those, what the Accelerate side sets too (an inline deepspeed_config key, an `accelerate launch` flag:
# topology.DEEPSPEED_KEYS)
SET_BY_THE_LAUNCHER_TOO = ("gradient_accumulation_steps", "gradient_clipping")


def requested_config(launcher: Launcher) -> tuple[dict, str]:
    """The DeepSpeed config the launch asks for, before accelerate fills its "auto" values: the JSON file, or the
    one accelerate's DeepSpeedPlugin builds from the Accelerate config's inline keys; and how to name it in a
    message. OSError / JSONDecodeError for a JSON that cannot be read."""
    path = launcher.deepspeed_config_file
    if path:
        with open(path) as f:
            return json.load(f), f"the DeepSpeed config {path}"
    keys = launcher.deepspeed_keys
    zero = {
        "stage": int(keys.get("zero_stage", 2)),
        "offload_optimizer": {"device": keys.get("offload_optimizer_device", "none")},
        "offload_param": {"device": keys.get("offload_param_device", "none")},
        "stage3_gather_16bit_weights_on_model_save": keys.get("zero3_save_16bit_model", "false") == "true",
    }
    return {"zero_optimization": zero}, "the Accelerate config's deepspeed_config"


def problems(cfg: RunConfig, env: Mapping[str, str] = os.environ, here: bool = True) -> list[tuple[str, str]]:
    """What the run config owns set otherwise on the Accelerate side (an inline deepspeed_config key, an `accelerate
    launch` flag, a DeepSpeed JSON value), a DeepSpeed JSON that defines its own optimizer or scheduler (the run
    config's AdamW and schedule are used on every backend), and what finetune's DeepSpeed cannot run: ZeRO stage 0,
    NVMe offload where DeepSpeed's async I/O op cannot load (here only: finetune plan plans for other machines),
    tensor, context or sequence parallelism (a parallelism_config, the JSON's AutoTP)."""
    launcher = Launcher.read(env)
    out = _cpu_mode(launcher) + _set_by_the_launcher(cfg.train, launcher)
    out += _parallelism_config_tp(launcher) + base.parallelism_size_problems(launcher)
    out += base.sequence_split_problems(launcher)
    try:
        ds, where = requested_config(launcher)
    except (OSError, json.JSONDecodeError) as e:
        path = launcher.deepspeed_config_file
        fix = "fix the JSON, or point the Accelerate config's deepspeed_config_file at a valid file"
        if isinstance(e, FileNotFoundError) and not os.path.isabs(path or ""):
            fix = (
                f"accelerate reads a relative path from the folder the launch starts in ({os.getcwd()}): launch from "
                "the folder that holds it (the shipped configs: the checkout's root), or add `--deepspeed_config_file "
                "PATH` to `accelerate launch` (`finetune plan` prints the command for a shipped config)"
            )
        return [*out, ("deepspeed_config_file", f"cannot read {path}: {e}; {fix}")]
    zero = ds.get("zero_optimization") or {}
    if cfg.peft.load_in_4bit and str(zero.get("stage")) == "3":
        why = (
            "transformers loads a 4-bit model without ZeRO-3's partitioned start, and DeepSpeed would partition "
            "bitsandbytes' packed weights, a path never proven"
        )
        out.append(base.qlora_refused(f"ZeRO-3 ({where})", why))
    out += _not_run(zero, where, here) + _autotp(ds, where)
    in_json, asked = deepspeed_json_precision(ds), env.get("ACCELERATE_MIXED_PRECISION")
    if in_json and asked in ("bf16", "fp16") and asked != in_json:  # accelerate's DeepSpeedPlugin raised
        fix = f'set "{in_json}": {{"enabled": "auto"}} in the JSON to train in {asked}, or ask for {in_json}'
        out.append(("mixed_precision", f"{where} enables {in_json} but the run asks for {asked}; {fix}"))
    for key, (field, ours, said) in _owned_by_run_config(cfg.train, launcher.world_size).items():
        value = ds.get(key, "auto")
        if value != "auto" and not _same(value, ours):
            out.append(
                (
                    field,
                    f"{where} sets {key}={value} but the run config has {said}; "
                    'set it to "auto" in the JSON (finetune fills it)',
                )
            )
    for key in ("optimizer", "scheduler"):
        if key in ds:
            out.append(
                (
                    key,
                    f"{where} defines its own {key}; remove it: the run config's AdamW and "
                    "lr_scheduler_type are used on every backend",
                )
            )
    return out


def _cpu_mode(launcher: Launcher) -> list[tuple[str, str]]:
    """accelerate's CPU mode (ACCELERATE_USE_CPU=true in the ranks' environment: accelerate's own launchers do not set
    it for a DeepSpeed config, a user's shell or job script does) beside a DeepSpeed launch: AcceleratorState starts
    DeepSpeed only outside CPU mode (accelerate 1.15 state.py: `ACCELERATE_USE_DEEPSPEED ... and not cpu`), so the
    DeepSpeed config would be dropped without a word and the run be plain DDP or one process, without ZeRO."""
    if not launcher.use_cpu:
        return []
    return [
        (
            "ACCELERATE_USE_CPU",
            "is true in the environment (accelerate's CPU mode), and in CPU mode accelerate ignores the DeepSpeed "
            f"config ({launcher.deepspeed_config_file or 'the Accelerate config'}): the run would be plain DDP (or one "
            "process) without ZeRO. Unset ACCELERATE_USE_CPU for this launch (`env -u ACCELERATE_USE_CPU accelerate "
            "launch ...`): DeepSpeed needs no CPU mode on a machine without a GPU (finetune runs it there on gloo); or, "
            "to train without DeepSpeed, launch with accelerate_configs/ddp.yaml",
        )
    ]


def _parallelism_config_tp(launcher: Launcher) -> list[tuple[str, str]]:
    """A parallelism_config tp_size beside a DeepSpeed config: accelerate 1.15 launches it (the launcher's
    `--use_parallelism_config` check in commands/launch.py runs before the config file is read, and
    utils/launch.py prepare_deepspeed_cmd_env passes its sizes on), but splits no model by it. Accelerator._prepare_tp
    only rewraps a model that is already DTensors (transformers' tp_plan, which finetune gives under tp2.yaml and
    tp2_fsdp2.yaml only), and DeepSpeed itself splits by its JSON's tensor_parallel.autotp_size alone
    (_prepare_deepspeed). The loaders still give the tp ranks one batch (data_loader.py prepare_data_loader, its
    DEEPSPEED branch: process_index // tp), and ZeRO averages over every rank as data parallel."""
    tp = launcher.tp_size
    if tp <= 1:
        return []
    why = (
        f"is {tp} beside a DeepSpeed config, and accelerate 1.15 splits no model by it under DeepSpeed (its tensor "
        "parallelism takes a model already split by transformers' tp_plan, and DeepSpeed splits only by its own JSON): "
        f"every rank would hold the whole model, the {tp} ranks of a group computing the same batches (and, with "
        "more processes than that, eval gathering their rows from each)"
    )
    fix = (
        "remove parallelism_config from the DeepSpeed Accelerate config (ZeRO-3, zero3.yaml, shards the parameters "
        "over every rank), or use accelerate_configs/tp2_fsdp2.yaml for tensor x data parallelism"
    )
    return [("parallelism_config_tp_size", f"{why}; {fix}")]


def _autotp(ds: Mapping, where: str) -> list[tuple[str, str]]:
    """DeepSpeed's AutoTP (the JSON's tensor_parallel.autotp_size): DeepSpeed splits the model over that many ranks
    (engine.py _configure_tensor_parallel) and accelerate 1.15 gives them one batch (its ds_device_mesh, which
    prepare_data_loader shards by), but finetune's DeepSpeed backend counts every rank as data parallel and knows
    ZeRO's partitions alone."""
    size = (ds.get("tensor_parallel") or {}).get("autotp_size") or 0
    if not isinstance(size, int) or size <= 1:
        return []
    return [
        (
            "tensor_parallel.autotp_size",
            f"{where} sets it to {size} (DeepSpeed's AutoTP), which finetune does not run: the {size} ranks of a "
            "group read the same batches while finetune counts each as data parallel (losses, token counts and eval "
            "miscounted), and none of its DeepSpeed paths (full weights, checkpoints, export) knows AutoTP's split; "
            "remove tensor_parallel from the JSON, or use "
            "accelerate_configs/tp2_fsdp2.yaml for tensor x data parallelism",
        )
    ]


def _set_by_the_launcher(train: TrainArgs, launcher: Launcher) -> list[tuple[str, str]]:
    """An accumulation or clipping the Accelerate side sets (inline deepspeed_config, `accelerate launch` flags) that
    differs from the run config's: accelerate would train with it (and fill the JSON's "auto" from it)."""
    out = []
    for key in SET_BY_THE_LAUNCHER_TOO:
        (field, ours), value = _run_config_values(train)[key], launcher.deepspeed_keys.get(key)
        if value is not None and not _same(value, ours):
            out.append(
                (
                    field,
                    f"the Accelerate side sets {key} {value} (its deepspeed_config key {key}, or `accelerate launch "
                    f"--{key}`) but the run config has {field}={ours}; the run config owns it: remove it from the "
                    f"Accelerate config and the launch command, or set the run config's {field} to {value}",
                )
            )
    return out


def _not_run(zero: Mapping, where: str, here: bool) -> list[tuple[str, str]]:
    """What finetune's DeepSpeed does not run: ZeRO stage 0 (DeepSpeed's default stage); NVMe offload where the
    async_io op cannot load (here: on this machine)."""
    out = []
    if str(zero.get("stage", 0)) == "0":
        out.append(
            (
                "zero_stage",
                f"{where} asks for ZeRO stage 0 (DeepSpeed without ZeRO), which finetune does not run; for the same "
                "data parallelism without sharding use accelerate_configs/ddp.yaml, else ZeRO stage 1, 2 or 3",
            )
        )
    nvme = [k for k, d in zip(("offload_optimizer", "offload_param"), deepspeed_offload_devices(zero)) if d == "nvme"]
    blocker = async_io_blocker() if nvme and here else None
    if blocker:
        out.append((nvme[0], f"{where} offloads {' and '.join(nvme)} to NVMe, but {blocker}"))
    return out


def _same(value, ours: float) -> bool:
    try:
        return float(value) == float(ours)
    except (TypeError, ValueError):
        return False


def async_io_blocker() -> str | None:
    """Why DeepSpeed's async I/O op (NVMe offload) cannot load on this machine; None when it can."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return (
        "DeepSpeed's async_io op cannot be built here (it needs libaio: install libaio-dev, e.g. `apt install "
        "libaio-dev`); or offload to the CPU instead (offload device cpu: accelerate_configs/zero3_offload.yaml)"
    )


def _owned_by_run_config(train: TrainArgs, world_size: int) -> dict[str, tuple[str, float, str]]:
    """DeepSpeed JSON key -> (run-config field, value, how a message says it) for the keys accelerate fills when
    "auto"."""
    out = {key: (field, value, f"{field}={value}") for key, (field, value) in _run_config_values(train).items()}
    rows = train.per_device_train_batch_size * train.gradient_accumulation_steps * world_size
    said = (
        f"per_device_train_batch_size {train.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{train.gradient_accumulation_steps} x {world_size} process(es) = {rows}"
    )
    out["train_batch_size"] = ("per_device_train_batch_size", rows, said)
    return out


def accelerator_kwargs(cfg: RunConfig) -> dict:
    return {}


def announce_op_builds() -> None:
    """DeepSpeed compiles C++ ops on first use, silently: its CPU Adam, for a config that offloads the optimizer
    (measured: 2.5 minutes on 2 busy cores). Say so, once, on rank 0, when it will (cpu_adam_build_due)."""
    launcher = Launcher.read()
    if (launcher.local_rank or 0) != 0:
        return
    try:
        with open(launcher.deepspeed_config_file or "") as f:
            offload = json.load(f).get("zero_optimization", {}).get("offload_optimizer") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return
    cache = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if offload.get("device", "none") != "none" and cpu_adam_build_due(cache):
        print(
            f"[finetune] DeepSpeed compiles its CPU Adam (cpu_adam) before the first step: minutes on a few cores, "
            f"once; cached in {cache} for later runs (`DS_BUILD_CPU_ADAM=1 pip install deepspeed` builds it at install)",
            flush=True,
        )


def cpu_adam_build_due(cache: Path) -> bool:
    """Whether DeepSpeedCPUAdam's first use compiles: not when DeepSpeed was installed with the op built, nor when
    `cache` holds a build of this DeepSpeed's sources (torch's JIT rebuilds one made from another install's: its
    build.ninja names the sources by path)."""
    import deepspeed
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get("cpu_adam"):
        return False
    build = cache / "cpu_adam"
    source = Path(deepspeed.__file__).parent / "ops" / "csrc" / "adam" / "cpu_adam.cpp"
    try:
        return not (build / "cpu_adam.so").exists() or str(source) not in (build / "build.ninja").read_text()
    except OSError:
        return True


def bf16_through_autocast(plugin) -> bool:
    """bf16 as DDP and FSDP2 compute it: torch.autocast over fp32 weights (DeepSpeed's `torch_autocast`), instead of
    DeepSpeed's own bf16 mode, which casts the whole model to bf16 (weights, norms, residual stream). Measured on a
    7.5M Llama, 8 steps against one bf16 process (docs/precision.md): DeepSpeed's bf16 mode 5e-3 relative in the
    losses and 4.9% in the training update, autocast 1e-4 and 0.5-0.9%, as DDP's. Done where the DeepSpeed JSON
    leaves bf16 to accelerate ("auto", as ds_configs/ do); a JSON saying "bf16": {"enabled": true} keeps DeepSpeed's
    bf16 mode (2 bytes less per parameter under ZeRO-1/2). The weights stay fp32 and are the masters
    (share_fp32_master_weights); `lower_precision_safe_modules: []` keeps gradient reduction in fp32 (DeepSpeed
    would reduce Linear layers' gradients in bf16). Must run before the model is built: ZeRO-3 builds it inside
    zero.Init in the dtype transformers' registered copy of the config says, registered again here."""
    config = plugin.deepspeed_config
    if (
        not str((config.get("bf16") or {}).get("enabled")).lower() == "true"
        or launched_json_precision(Launcher.read())[0]
    ):
        return False
    config["bf16"] = {"enabled": False}
    config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    plugin.set_deepspeed_weakref()
    return True


def gather_16bit_weights_on_save(plugin) -> bool:
    """Under ZeRO-3 finetune's checkpoints and export need the full weights gathered from the partitions, which
    DeepSpeed and accelerate do only with zero_optimization.stage3_gather_16bit_weights_on_model_save true; false (a
    JSON's, or `zero3_save_16bit_model: false`, accelerate config's default answer) trained, then failed at the
    first checkpoint or export with nothing saved. The switch affects saving only (DeepSpeed's engine reads it in
    save_16bit_model alone): set true, and said. Returns True when it was set."""
    zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
    was = zero.get("stage3_gather_16bit_weights_on_model_save")
    if str(zero.get("stage")) != "3" or was is True:
        return False
    zero["stage3_gather_16bit_weights_on_model_save"] = True
    plugin.zero3_save_16bit_model = True
    logger.info(
        "ZeRO-3: stage3_gather_16bit_weights_on_model_save set true (the DeepSpeed config had %s): finetune's "
        "checkpoints and export gather the full weights",
        json.dumps(was),
    )
    return True


def keep_used_weight_conversions(model) -> None:
    """Workaround (transformers 5.23): under ZeRO-3, from_pretrained keeps every weight conversion it tried as the
    ones to revert on save (integrations/deepspeed.py: `model_to_load._weight_conversions = weight_mapping`),
    where every other loading path keeps only those that matched a checkpoint key. So save_pretrained reverted
    renamings that were never applied: a BERT trained under ZeRO-3 was exported with LayerNorm.gamma/beta, under
    every other layout with LayerNorm.weight/bias. Keep the used ones, as the other paths do
    (tests/test_deepspeed.py::test_transformers_still_keeps_unused_conversions_under_zero3 fails once fixed)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # an adapter's base model
    conversions = getattr(base, "_weight_conversions", None)
    if conversions:
        base._weight_conversions = [c for c in conversions if c.was_used()]


def zero3_loads_only_fitting_weights() -> None:
    """Workaround (transformers 5.23): under ZeRO-3 from_pretrained loads through _load_state_dict_into_zero3_model,
    which does not honour ignore_mismatched_sizes (it reports no mismatched keys: modeling_utils
    _load_pretrained_model, "mismatched_keys=set()"), so a classifier checkpoint with another label count (finetune
    asks for ignore_mismatched_sizes: model._load_kwargs) failed on every rank with "size mismatch for
    classifier.weight", where every other layout starts that head anew. Here the checkpoint's tensors whose shape
    differs from the model's (a ZeRO-3 parameter's full shape: ds_shape) are left out when ignore_mismatched_sizes
    is asked: they stay missing, and transformers initialises them as it does a missing head, on every rank alike.
    tests/test_deepspeed.py::test_transformers_zero3_loading_still_ignores_mismatched_sizes fails once transformers
    honours it."""
    from transformers import modeling_utils

    load = modeling_utils._load_state_dict_into_zero3_model
    if getattr(load, "leaves_out_mismatched_sizes", False):
        return

    @functools.wraps(load)
    def load_what_fits(model_to_load, state_dict, load_config=None):
        if getattr(load_config, "ignore_mismatched_sizes", False):
            state_dict = _fitting(model_to_load, state_dict)
        return load(model_to_load, state_dict, load_config)

    load_what_fits.leaves_out_mismatched_sizes = True
    modeling_utils._load_state_dict_into_zero3_model = load_what_fits


def _fitting(model, state_dict):
    """state_dict less the tensors whose shape differs from the model's parameter or buffer of that name (with or
    without the model's base_model_prefix, as transformers matches them); every rank leaves out the same ones (the
    other ranks' checkpoint tensors are meta tensors of the same shapes)."""
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}
    shapes.update((n, tuple(b.shape)) for n, b in model.named_buffers())
    prefix = getattr(model, "base_model_prefix", "")
    mismatched = []
    for key, value in state_dict.items():
        want = shapes.get(key, shapes.get(f"{prefix}.{key}"))
        if want is not None and tuple(value.shape) != want:
            mismatched.append(key)
    if not mismatched:
        return state_dict
    logger.info("checkpoint weights of another shape, initialised anew (ignore_mismatched_sizes): %s", mismatched)
    fitting = state_dict.copy()
    for key in mismatched:
        del fitting[key]
    return fitting


def zero3_weights_dtype_note(net, asked) -> str | None:
    """Under ZeRO-3 zero.Init builds every parameter in the DeepSpeed config's dtype, not torch_dtype's: bf16 or
    fp16 only in DeepSpeed's own 16-bit modes, fp32 otherwise (bf16 through autocast, or no mixed precision). What
    to tell a run that asked for 16-bit weights (`asked`) and holds fp32 ones; None where it holds what it asked."""
    params = [p for p in net.parameters() if hasattr(p, "ds_tensor")]
    frozen = [p for p in params if not p.requires_grad] or params  # (an adapter's own weights: fp32, PEFT's choice)
    held = {p.ds_tensor.dtype for p in frozen}
    if asked not in (torch.bfloat16, torch.float16) or torch.float32 not in held:
        return None
    name = str(asked).removeprefix("torch.")
    return (
        f"ZeRO-3 holds the weights in float32, not torch_dtype {name}: zero.Init builds every parameter in the "
        "DeepSpeed config's dtype, 16-bit only in DeepSpeed's own bf16/fp16 modes (finetune runs bf16 through "
        "autocast over fp32 weights): 4 bytes per parameter, partitioned, and bf16 compute as asked. For 16-bit "
        'weights set "bf16": {"enabled": true} in the DeepSpeed JSON (DeepSpeed\'s bf16 mode, docs/precision.md), '
        "or use ZeRO-2 or FSDP2"
    )


class Backend(ddp.Backend):
    """DeepSpeed ZeRO: only what differs from the DDP backend."""

    checkpoint_format = "portable"  # DeepSpeed's checkpoint holds partitions: portable/ adds full tensors

    def __init__(self, accelerator, topology, cfg: RunConfig):
        super().__init__(accelerator, topology, cfg)
        bf16_through_autocast(accelerator.state.deepspeed_plugin)
        gather_16bit_weights_on_save(accelerator.state.deepspeed_plugin)
        zero3_loads_only_fitting_weights()

    def writes_after_its_collectives(self) -> bool:
        return True  # made so: finish_collectives_after_a_write_error

    def fp32_master_weights(self) -> bool:
        return self.mixed_precision in ("bf16", "fp16")  # fp32 weights under autocast, or fp32 masters

    def keep_checkpoints_per_machine(self) -> None:
        """Also DeepSpeed's own switch: each machine's local rank 0 writes the model-states file that every rank
        reads when it loads (by default only global rank 0 writes it); each rank writes its own partition."""
        super().keep_checkpoints_per_machine()
        self.acc.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["use_node_local_storage"] = True

    def place_model(self, model):
        model = super().place_model(model)
        keep_used_weight_conversions(model)
        asked = self.cfg.model.torch_dtype
        note = zero3_weights_dtype_note(
            model, getattr(torch, asked, None) or getattr(model.config, "dtype", None)
        )  # auto: the base's
        if note:
            logger.warning(note)
        return model

    def reentrant_checkpointing(self, peft_on: bool) -> bool:
        # PEFT under ZeRO-3: the non-reentrant recompute meets parameters ZeRO-3 has already released.
        return peft_on and self.topology.zero_stage == 3

    @contextlib.contextmanager
    def one_process_loading(self):
        """accelerate registers its DeepSpeed config with transformers, so under ZeRO-3 every model built after
        Accelerator() is built inside zero.Init, whose broadcasts deadlock when one process builds alone. Outside
        it for the duration (transformers.integrations.deepspeed's registration, restored after)."""
        from transformers.integrations import deepspeed as hf_deepspeed

        registered = hf_deepspeed._hf_deepspeed_config_weak_ref
        hf_deepspeed.unset_hf_deepspeed_config()
        try:
            yield
        finally:
            hf_deepspeed._hf_deepspeed_config_weak_ref = registered

    def numel(self, p: torch.nn.Parameter) -> int:
        return getattr(p, "ds_numel", None) or p.numel()

    def prepare_frozen(self, model):
        """Under ZeRO-3, partitioned as the trained model is (built inside zero.Init, as it was), in an engine of its
        own without an optimizer, from the run's DeepSpeed config (accelerate's prepare takes one model under
        DeepSpeed); under ZeRO-1/2, which shard only what an optimizer holds, whole on each rank (stage 0), as TRL's
        prepare_deepspeed does."""
        import copy

        import deepspeed

        config = copy.deepcopy(self.acc.state.deepspeed_plugin.deepspeed_config)
        zero = config.setdefault("zero_optimization", {})
        if zero.get("stage") != 3:
            zero["stage"] = 0
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeedEngine.eval returns nothing
        return engine

    def set_weights_by_name(self, named, weights) -> None:
        params = [named[n] for n in weights]
        gathered = contextlib.nullcontext()
        if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3: PEFT's copies of partitioned modules are partitioned
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
        with gathered:
            base.copy_by_name(named, weights)

    def prepare(self, model, optimizer, train_loader, eval_loader, scheduler, plan):
        # accelerate fills DeepSpeed's "auto" train_micro_batch_size_per_gpu from the loaders' batch_size and
        # refuses a loader without one (length_aware_batching's micro batches vary in rows): fill it.
        plugin = self.acc.state.deepspeed_plugin
        if plugin.is_auto("train_micro_batch_size_per_gpu"):
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = plan.micro_batch_size
        prepared = base.prepare_all(self.acc, model, optimizer, train_loader, eval_loader, scheduler)
        share_fp32_master_weights(prepared[1].optimizer)
        finish_collectives_after_a_write_error(prepared[0])
        return prepared

    def generate(self, model, **kwargs) -> torch.Tensor:
        """As DDP's, in the engine's torch_autocast (bf16_through_autocast): generate runs the module itself, outside
        DeepSpeedEngine.forward, where DeepSpeed enters its autocast, so generation eval ran in fp32 while training
        and loss eval ran in bf16."""
        from deepspeed.runtime.torch_autocast import autocast_if_enabled

        with autocast_if_enabled(model):
            return super().generate(model, **kwargs)

    def clip_grad_norm(self, model, max_norm):
        """The global gradient norm of the step DeepSpeed just took (it clips inside its step, from the config's
        gradient_clipping), as the engine keeps it: a device tensor. accelerate's clip_grad_norm_ turns it into a
        Python float, which makes the host wait for the device every step; the loop reads it when it logs."""
        return model.get_global_grad_norm()

    def observed(self, model) -> dict:
        """From the engine itself, not from the config files: the stage and offload DeepSpeed really runs, and
        whether its fp32 master weights are a second copy of the rank's partition (share_fp32_master_weights)."""
        engine = model
        return {
            "zero_stage": int(engine.zero_optimization_stage()),
            "offload_optimizer": _offloaded(engine.zero_offload_optimizer()),
            "offload_params": _offloaded(engine.zero_offload_param()),
            "parameter_shard": base.local_fraction(engine.module.parameters(), self.numel),
            "fp32_master_copy": any(a.data_ptr() != b.data_ptr() for a, b in _master_and_weights(engine.optimizer)),
        }

    def full_state_dict(self, model):
        """Under bf16/fp16 DeepSpeed computes with a 16-bit copy of the weights and updates fp32 master partitions:
        the trainable weights come from the masters (safe_get_full_fp32_param), as DDP's and FSDP's exports come
        from their fp32 parameters; accelerate's get_state_dict would give the 16-bit copy. Frozen weights (an
        adapter's base) exist only in 16 bits. A collective. The main process's (the others get what they need for
        the collectives: under ZeRO-1/2 each rank's copy of the whole model to the host would be thrown away)."""
        from deepspeed.utils import safe_get_full_fp32_param

        gathered = self.topology.zero_stage == 3  # the engine gathers the partitions: every rank takes part
        weights = self.acc.get_state_dict(model) if gathered or self.acc.is_main_process else {}
        net = base.unwrap(self.acc, model)
        if all(p.dtype == torch.float32 for p in net.parameters()):
            return weights  # fp32 weights: they are the masters (share_fp32_master_weights)
        names: dict[int, list[str]] = {}
        for name, p in net.state_dict(keep_vars=True).items():  # tied weights: one parameter, several names
            names.setdefault(id(p), []).append(name)
        for p in net.parameters():  # the same order on every rank: collectives
            if not p.requires_grad:
                continue
            full = safe_get_full_fp32_param(p)
            if self.acc.is_main_process:
                for name in names.get(id(p), []):
                    if name in weights:
                        weights[name] = full.detach().cpu().contiguous()
        return weights

    def full_adam_moments(self, model, optimizer):
        """As DDP's: no moments before the first update went through (fp16's loss scaler can skip the opening steps:
        DeepSpeed creates Adam's state at the first applied step, and asking for it before then raised)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        if not _updated(optimizer):
            return {}  # (and no relink: DeepSpeed links its views itself at the first update)
        relink_optimizer_states(optimizer)
        out = {}
        main = self.acc.is_main_process
        for name, p in base.unwrap(self.acc, model).named_parameters():  # same order on every rank: collectives
            if not p.requires_grad:
                continue
            values = {
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq"),
            }
            if main:
                out[name] = {k: v.detach().float().cpu().contiguous() for k, v in values.items()}
        return out

    def set_full_optimizer_state(self, model, optimizer, state, step: int) -> None:
        """DeepSpeed creates Adam's state lazily, at the first step, and safe_set_full_optimizer_state can only
        write into state that exists. So: one step of the inner optimizer (torch AdamW or DeepSpeedCPUAdam over
        the flat fp32 partitions) with zero gradients and lr 0, which creates the state and changes no weight;
        then the step count, and every parameter's moments and master weights by name. Every rank holds the
        full tensors and keeps its own partition of them."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        named = base.trainable_parameters(base.unwrap(self.acc, model))
        zero = optimizer.optimizer  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
        _create_adam_state(zero, step)
        relink_optimizer_states(optimizer)  # ZeRO-1/2: link the new state to each parameter's fragment
        for n, p in named.items():  # the same order on every rank
            for key in ("param", "exp_avg", "exp_avg_sq"):
                value = state[n][key].float()
                if hasattr(p, "ds_id") and p.ds_numel % zero.partition_count:
                    _set_uneven_zero3_partition(p, value, None if key == "param" else key)
                elif key == "param":
                    safe_set_full_fp32_param(p, value)
                else:
                    safe_set_full_optimizer_state(p, value, key)


def _updated(optimizer) -> bool:
    """Whether an update went through: the inner optimizer (over this rank's flat fp32 partitions) has Adam's state,
    which DeepSpeed creates at the first applied step. The same on every rank (a skipped step is skipped by all)."""
    zero = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    inner = getattr(zero, "optimizer", zero)
    return bool(getattr(inner, "state", True))


def _offloaded(offload) -> bool:
    """Whether an engine's offload config (DeepSpeed's zero_offload_optimizer/_param: None, or an object whose
    device may be "none") offloads anything (to the CPU or NVMe)."""
    return offload is not None and str(getattr(offload.device, "value", offload.device)) != "none"


def _master_and_weights(zero) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fp32 master partition, the weights' own partition) of each group or ZeRO-3 sub-group, on this rank."""
    from deepspeed import comm

    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3: one flat partition per sub-group
        pairs = zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat)
        return [(master, weights) for master, weights in pairs if weights is not None]  # None: swapped to NVMe
    if hasattr(zero, "fp32_groups_flat_partition"):  # BF16_Optimizer: ZeRO-1 in bf16 with fp32 accumulation
        return [
            (master, zero.bf16_partitioned_groups[i][comm.get_rank(group=zero.real_dp_process_group[i])])
            for i, master in enumerate(zero.fp32_groups_flat_partition)
        ]
    return [
        (master, zero.parallel_partitioned_bit16_groups[i][comm.get_rank(group=zero.real_dp_process_group[i])])
        for i, master in enumerate(zero.single_partition_of_fp32_groups)
    ]


def share_fp32_master_weights(zero) -> None:
    """Workaround (DeepSpeed 0.19.8): with fp32 weights and no offload, DeepSpeed keeps its fp32 "master" copy of
    a rank's partition as a second copy of the same numbers: 4 bytes per parameter / N ranks, as much as the
    partitioned weights themselves (at 2 ranks, ZeRO-3's states are 8 bytes per parameter with the copy shared,
    10 without; DDP's 16).
    - ZeRO-3 means not to keep it: stage3.py `_create_fp32_partitions` reuses the partition when its dtype and
      device are the master's, but compares the tensor's torch.device with the device's *name* (a str), which is
      never equal, so the branch never runs.
    - ZeRO-1/2 (stage_1_and_2.py) always clone the partition.
    Here each fp32 master partition is pointed at the weights' own partition: the optimizer updates the weights
    in place, and DeepSpeed's copy from master to weights after each step is a copy onto itself (torch skips it).
    ZeRO-1/2 also: their per-parameter views of the master (safe_get_full_fp32_param) are linked again, and a
    checkpoint writes a copy of the master partition (a view of the whole model's weights, which torch.save would
    write whole). tests/test_deepspeed.py::test_deepspeed_still_copies_fp32_master_weights fails once DeepSpeed
    shares them itself."""
    if getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False):
        return  # the master lives on the CPU, the weights on the device
    shared = False
    for master, weights in _master_and_weights(zero):
        if (master.dtype, master.device, master.numel()) != (weights.dtype, weights.device, weights.numel()):
            continue  # 16-bit weights: the master is a different thing
        if master.data_ptr() != weights.data_ptr():
            weights.data.copy_(master.data)  # equal already (no step yet); the master is the truth either way
            master.data = weights.data
            shared = True
    if shared and hasattr(zero, "single_partition_of_fp32_groups"):
        zero._link_all_hp_params()
        zero._hp_optimizer_states_linked = False
        state_dict = zero.state_dict

        def state_dict_with_own_master():
            out = state_dict()
            key = "single_partition_of_fp32_groups"
            out[key] = [t.clone() for t in out[key]]
            return out

        zero.state_dict = state_dict_with_own_master


def finish_collectives_after_a_write_error(engine) -> None:
    """Workaround (DeepSpeed 0.19.8): engine.save_checkpoint holds collectives after its writes (ZeRO-3's
    checkpoint_event_epilogue all-gathers the persistent parameters, and a dist.barrier ends it), which a rank whose
    write raised (its disk full) never reaches: the other ranks waited there for ddp_timeout (30 minutes on GPUs),
    then ended with a traceback and a message blaming the rank that did not answer. Here the engine's writes (its
    checkpoint engine's save; the recovery scripts global rank 0 copies) keep their first write error and return,
    the rank goes through every collective with the others, and save_checkpoint raises the error after its last
    one: finetune.checkpoint stops every rank with one message naming the rank and the error. DeepSpeed's `latest`
    file is written after the barrier. Not covered: the copy of NVMe offload's swap files (a user's JSON), which
    DeepSpeed makes with shutil itself. tests/test_deepspeed.py::test_deepspeed_still_leaves_ranks_waiting_after_a_
    write_error fails once DeepSpeed finishes its collectives itself."""
    from finetune.checkpoint import as_os_error
    from finetune.faults import fault_point

    save_checkpoint, errors = engine.save_checkpoint, None  # inside save_checkpoint: its writes' errors

    def deferring(write, fault: str | None = None):
        @functools.wraps(write)
        def write_or_keep_the_error(*args, **kwargs):
            if errors is None:  # another caller (save_16bit_model, say): as DeepSpeed does
                return write(*args, **kwargs)
            if errors:  # (an earlier write of this checkpoint failed: it is not complete anyway)
                return None
            try:
                if fault:
                    fault_point(fault, engine.global_steps)  # tests: a write of DeepSpeed's that fails
                return write(*args, **kwargs)
            except Exception as e:
                io = as_os_error(e)
                if io is None:
                    raise
                errors.append(io)
                return None

        return write_or_keep_the_error

    engine.checkpoint_engine.save = deferring(engine.checkpoint_engine.save, "enospc-deepspeed-write")
    engine._copy_recovery_script = deferring(engine._copy_recovery_script)

    @functools.wraps(save_checkpoint)
    def save_checkpoint_then_raise(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        nonlocal errors
        decoupled = engine.checkpoint_engine.is_decoupled()  # (its commit, later, writes `latest`)
        errors = []
        try:
            save_checkpoint(save_dir, tag, client_state or {}, save_latest=save_latest and decoupled, **kwargs)
        finally:
            failed, errors = errors, None
        if failed:
            raise failed[0]
        if save_latest and not decoupled and engine.global_rank == 0:
            with open(os.path.join(save_dir, "latest"), "w") as f:
                f.write(str(tag or f"global_step{engine.global_steps}"))
        return True

    engine.save_checkpoint = save_checkpoint_then_raise


def compile_on_first_call() -> None:
    """Workaround (DeepSpeed 0.19.8): ZeRO-1, 2 and 3 import DeepSpeed's Muon optimizer module in every run, only to
    ask whether the optimizer is one (stage3.py's __init__, stage_1_and_2.py's average_tensor), and that module
    decorates three functions with runtime/compiler.py's `compile()`, which is torch.compile itself: applied at
    import, it loads torch's compiler stack (torch._inductor, sympy, networkx; 550 modules). Measured on this
    machine: +41 MB resident per rank and 1 s before the first step, for functions that only Muon calls; finetune
    never runs Muon (a DeepSpeed JSON with its own optimizer is refused, see problems). Here `compile()` returns
    a decorator that compiles on the function's first call instead. At 369M parameters on 2 ranks that was 1% of
    ZeRO-3's training peak per rank (bench/README.md, "capacity.py").
    tests/test_deepspeed.py::test_deepspeed_still_compiles_at_import fails once DeepSpeed stops doing it."""
    from deepspeed.runtime import compiler

    if getattr(compiler.compile, "finetune_workaround", False):
        return

    def compile(**options):
        def decorate(fn):
            compiled = None

            @functools.wraps(fn)
            def on_first_call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = torch.compile(fn, **options)
                return compiled(*args, **kwargs)

            return on_first_call

        return decorate

    compile.finetune_workaround = True
    compiler.compile = compile


def skip_inference_shm_op() -> None:
    """Workaround (DeepSpeed 0.19.8, CPU processes): every DeepSpeed start on CPUs builds and loads its shared-memory
    all-reduce op (comm/torch.py TorchBackend.__init__ -> build_shm_op: a C++ build of about a minute on the first
    run of a machine, on 2 cores; then a load and a shared-memory segment per rank), which only its inference
    path calls (inference_all_reduce, used by module_inject's tensor-parallel inference layers); training's
    collectives are torch.distributed's. Marking the op incompatible, in the table DeepSpeed probes once and
    keeps (deepspeed.ops.__compatible_ops__), makes build_shm_op return None, and inference_all_reduce would fall
    back to torch's all_reduce. tests/test_deepspeed.py::test_deepspeed_still_builds_its_inference_shm_op fails
    once DeepSpeed stops building it for training."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def gloo_collectives_by_all_reduce() -> None:
    """Workaround (torch 2.13's gloo, CPU runs): ZeRO-3 gathers every parameter with all_gather_into_tensor and
    reduce-scatters every gradient with reduce_scatter_tensor, and gloo runs both through temporaries as large as
    the whole buffer or larger. Measured on 2 ranks with 50M fp32 elements per buffer: the gather +202 MB (its
    output is 200 MB) in 0.29 s, the reduce-scatter +304 MB in 0.34 s; one in-place all_reduce doing the same work
    +5 MB in 0.20 s. At 369M parameters that temporary (the 131 MB embedding and head, gathered and reduced)
    was the top of ZeRO-3's training peak. So on gloo both become an in-place all_reduce, as DeepSpeed itself
    reduces its contiguous gradient buckets (stage3.py __avg_scatter_contiguous_grads):
    - gather: this rank's partition in its slot of the output, zeros elsewhere, summed over the ranks (x + 0 is
      exactly x, so the gathered weights are bit for bit the partitions);
    - reduce-scatter: DeepSpeed hands over a scratch buffer whose chunk for this rank is the output; sum it in
      place (bitwise the same sums on 2 ranks; on more, summation order may differ in the last bit, as between
      gloo's own algorithms).
    tests/test_deepspeed.py::test_gloo_collectives_still_copy fails once gloo stops copying."""
    import torch.distributed as dist
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero import partition_parameters

    gather, scatter = partition_parameters._dist_allgather_fn, coalesced_collectives._torch_reduce_scatter_fn
    if getattr(gather, "finetune_workaround", False):
        return

    def on_gloo(group, inputs: torch.Tensor, output: torch.Tensor) -> int:
        """This rank's place when the call is on gloo and the sizes are a plain partitioning; else -1."""
        if dist.get_backend(group) != "gloo" or output.numel() != inputs.numel() * dist.get_world_size(group):
            return -1
        return dist.get_rank(group)

    def all_gather(input_tensor, output_tensor, group=None):
        rank = on_gloo(group, input_tensor, output_tensor)
        if rank < 0 or not output_tensor.is_contiguous():
            return gather(input_tensor, output_tensor, group)
        n = input_tensor.numel()
        flat = output_tensor.view(-1)
        mine = flat.narrow(0, rank * n, n)
        if mine.data_ptr() != input_tensor.data_ptr():
            mine.copy_(input_tensor.reshape(-1))
        flat[: rank * n].zero_()
        flat[(rank + 1) * n :].zero_()
        return dist.all_reduce(output_tensor, group=group, async_op=True)  # DeepSpeed waits on the handle

    def reduce_scatter(input_tensor, output_tensor, group=None, async_op=False, prof=False):
        rank = on_gloo(group, output_tensor, input_tensor)
        if rank < 0:
            return scatter(input_tensor, output_tensor, group=group, async_op=async_op, prof=prof)
        dist.all_reduce(input_tensor, group=group)
        mine = input_tensor.view(-1).narrow(0, rank * output_tensor.numel(), output_tensor.numel())
        if mine.data_ptr() != output_tensor.data_ptr():
            output_tensor.view(-1).copy_(mine)
        return None

    all_gather.finetune_workaround = True
    partition_parameters._dist_allgather_fn = all_gather
    coalesced_collectives._torch_reduce_scatter_fn = reduce_scatter


def _create_adam_state(zero, step: int) -> None:
    """One lr-0 step with zero gradients over this rank's flat fp32 partitions, then set the step count."""
    inner = zero.optimizer  # the torch-style optimizer over this rank's flat fp32 partitions
    zero3 = hasattr(zero, "fp32_partitioned_groups_flat")
    # ZeRO-3 hands the optimizer one sub-group at a time (its param groups are empty in between)
    flats = zero.fp32_partitioned_groups_flat if zero3 else [p for g in inner.param_groups for p in g["params"]]
    lrs = [group["lr"] for group in inner.param_groups]
    grads = [p.grad for p in flats]  # ZeRO-3 with offload keeps a gradient buffer attached
    for group in inner.param_groups:
        group["lr"] = 0.0
    for p in flats:
        p.grad = torch.zeros_like(p)
    if zero3:
        for i in range(len(flats)):
            zero._optimizer_step(i)
    else:
        inner.step()
    for group, lr in zip(inner.param_groups, lrs):
        group["lr"] = lr
    for p, g in zip(flats, grads):
        p.grad = g
        state = inner.state[p]
        if torch.is_tensor(state["step"]):
            state["step"].fill_(step)
        else:  # DeepSpeedCPUAdam counts in a Python int
            state["step"] = step


def relink_optimizer_states(optimizer) -> bool:
    """Workaround (DeepSpeed 0.19.8, ZeRO-1/2): after the first step of the *first* parameter group,
    `_lazy_init_hp_params_optimizer_state` links every group's per-parameter views of the Adam state,
    while later groups' states are still empty; their views stay empty for good and
    `safe_get_full_optimizer_state` raises "exp_avg not found". Linking again once every group has
    stepped fixes the views. tests/test_deepspeed.py::test_deepspeed_still_needs_the_relink shows it.
    Returns True when it relinked."""
    zero = getattr(optimizer, "optimizer", None)  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer
    if os.environ.get("FINETUNE_NO_DS_RELINK") or not hasattr(zero, "_hp_optimizer_states_linked"):
        return False
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()
    return True


def _set_uneven_zero3_partition(param, value, key: str | None) -> None:
    """Workaround (DeepSpeed 0.19.8): ZeRO-3's set_full_hp_param cuts this rank's slice out of the full
    value at rank x partition size, for a whole partition; when the parameter's size is not a multiple
    of the world size, the last rank's slice runs past the end ("start (2) + length (2) exceeds
    dimension size (3)"). The same write, with the slice's missing tail left as DeepSpeed's zero
    padding. tests/test_resume_layouts.py::test_into_offloaded_zero_with_uneven_partitions needs it."""
    opt = param._z3_optimizer
    part, group = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    start = part.numel() * opt._get_param_partition_rank(param)
    piece = value.flatten()[start : start + part.numel()]
    part.data.zero_()
    part.data[: piece.numel()].copy_(piece)
    if opt._swappable_optimizer_subgroup(group):
        opt._optimizer_states_and_gradient_swap_out(group)
