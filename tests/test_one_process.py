"""Every shipped single-node Accelerate config launched with `--num_processes 1` (one GPU, or one CPU process here):
it trains, as the layout its config names (proven from what the prepared engine reports), or it refuses at start with
exit 2, the reason and the fix, and no traceback. (FSDP2 with one process is how one fits a larger model on a single
device with CPU offload; it crashed in Topology.read before.)"""

from __future__ import annotations

import pytest
from conftest import ROOT, base_args, finetune, grid_param

# config -> (distributed type, facts the run's metrics rows must show); one process of it trains
TRAINS = {
    "single": ("NO", {}),
    "ddp": ("MULTI_CPU", {}),
    "zero1": ("DEEPSPEED", {"zero_stage": 1, "offload_optimizer": False}),
    "zero2": ("DEEPSPEED", {"zero_stage": 2, "offload_optimizer": False}),
    "zero2_offload": ("DEEPSPEED", {"zero_stage": 2, "offload_optimizer": True}),
    "zero3": ("DEEPSPEED", {"zero_stage": 3, "offload_params": False}),
    "zero3_offload": ("DEEPSPEED", {"zero_stage": 3, "offload_params": True, "offload_optimizer": True}),
    "fsdp2": ("FSDP", {"fsdp_version": 2, "offload_params": False}),
    "fsdp2_offload": ("FSDP", {"fsdp_version": 2, "offload_params": True}),
}
# config -> words of the fix in its refusal
REFUSES = {
    "tp2": "set num_processes: 2",
    "tp2_fsdp2": "--num_processes 4",
    "megatron_tp2": "needs NVIDIA GPUs",
    "megatron_tp2_pp2": "needs NVIDIA GPUs",
}
# Each family's one-process path runs by default; FINETUNE_CONFIG_GRID=1 runs every config (about 2 minutes).
DEFAULT = {"ddp", "zero3_offload", "fsdp2_offload", "tp2", "tp2_fsdp2", "megatron_tp2"}


def test_every_single_node_config_is_covered():
    shipped = {p.stem for p in (ROOT / "accelerate_configs").glob("*.yaml") if "multinode" not in p.stem}
    assert shipped and shipped == set(TRAINS) | set(REFUSES)


@pytest.mark.parametrize(
    "config",
    [grid_param(c, default=c in DEFAULT, grid="FINETUNE_CONFIG_GRID") for c in [*TRAINS, *REFUSES]],
)
def test_one_process_of_a_shipped_config_trains_or_refuses_clearly(assets, tmp_path, config):
    args = base_args(assets.llama, assets.instruction, "--max_steps", "2", "--eval_fraction", "0")
    r = finetune(
        tmp_path / "out", *args, launcher=str(ROOT / "accelerate_configs" / f"{config}.yaml"),
        launch_args=("--num_processes", "1"), expect_ok=False, timeout=300,
    )  # fmt: skip
    assert "Traceback" not in r.output, r.output[-3000:]
    if config in REFUSES:
        assert r.returncode == 2, r.output[-3000:]
        assert "  - accelerate config: " in r.output and REFUSES[config] in r.output
        return
    assert r.returncode == 0, r.output[-3000:]
    dist_type, facts = TRAINS[config]
    assert f"distributed: {dist_type}, world size 1," in r.output
    rows = r.train_rows
    assert len(rows) == 2
    for row in rows:
        assert row["world_size"] == 1 and row["distributed_type"] == dist_type
        assert {k: row.get(k) for k in facts} == facts
