"""No host-device synchronisation on ordinary training steps (issue 31): between log rows a step queues its work
and goes on; the stop request, the divergence check and the window's sums are read at the logging step.

tests/sync_probe.py counts the synchronising Tensor calls each rank makes inside each optimizer step (forward,
backward, clipping, the optimizer, the loop's bookkeeping) in bf16, as GPU users train. DeepSpeed's own step
reads the gradient norm on the host (deepspeed/runtime/utils.py is_invalid_grad_norm: its overflow check and its
clipping), which finetune cannot change; under ZeRO every other call is counted as for the rest."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, base_args, finetune

LOGGING_STEPS = 3
STEPS = 6


@pytest.mark.parametrize(
    "launcher, packing",  # padded batches (an attention mask) and packed ones (position_ids) across the families
    [("single", "false"), ("ddp", "true"), ("zero3", "true"), ("fsdp2", "false")],
)
def test_ordinary_steps_make_no_host_sync(assets, tmp_path, launcher, packing):
    probe = tmp_path / "probe"
    probe.mkdir()
    args = base_args(assets.llama, assets.instruction, "--max_steps", str(STEPS), "--eval_fraction", "0")
    args += ["--logging_steps", str(LOGGING_STEPS), "--mixed_precision", "bf16", "--packing", packing]
    res = finetune(
        tmp_path / "run",
        *args,
        launcher=launcher,
        entry=(str(ROOT / "tests" / "sync_probe.py"),),
        extra_env={"SYNC_PROBE_DIR": str(probe)},
    )
    assert [r["step"] for r in res.train_rows] == list(range(LOGGING_STEPS, STEPS + 1, LOGGING_STEPS))
    reports = sorted(probe.glob("rank*.json"))
    assert len(reports) == (1 if launcher == "single" else 2), reports  # every rank ran the probe
    ordinary = [s for s in range(1, STEPS + 1) if s % LOGGING_STEPS]
    assert ordinary
    for report in reports:
        calls = json.loads(report.read_text())
        assert calls.pop("outside"), "the probe counted nothing at all (the log rows read their values)"
        calls.pop("loader", None)
        synced = {
            step: [w for w in calls.get(str(step), []) if "/deepspeed/" not in w.split(": ", 1)[1]] for step in ordinary
        }
        assert not any(synced.values()), f"{report.name}: host syncs on ordinary steps:\n" + json.dumps(
            synced, indent=1
        )


def _bool_reads(fn, *args) -> int:
    """How many times fn reads a tensor's truth value on the host."""
    reads, original = [0], torch.Tensor.__bool__

    def counted(self):
        reads[0] += 1
        return original(self)

    torch.Tensor.__bool__ = counted
    try:
        fn(*args)
    finally:
        torch.Tensor.__bool__ = original
    return reads[0]


def test_transformers_still_reads_masks_on_the_host():
    """finetune.model.masks_without_host_sync works around these reads; once this fails, delete it."""
    from transformers import masking_utils as mu

    from finetune.model import masks_without_host_sync

    masks_without_host_sync()
    find_packed = mu.find_packed_sequence_indices.__wrapped__
    ignore_causal = mu._ignore_causal_mask_sdpa.__wrapped__
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert _bool_reads(find_packed, packed) > 0
    assert _bool_reads(ignore_causal, torch.tensor([[True, True, False]]), 3, 3, 0, 0) > 0
    # the workaround itself reads nothing in a training forward
    assert _bool_reads(mu.find_packed_sequence_indices, packed) == 0
    assert _bool_reads(mu._ignore_causal_mask_sdpa, torch.tensor([[True, True, False]]), 3, 3, 0, 0) == 0


def test_masks_without_host_sync_change_no_logits(assets):
    """A training forward (the workaround's masks) gives the logits an evaluation forward (transformers' own
    path) gives, for a padded, an unpadded and a packed batch."""
    from transformers import AutoModelForCausalLM

    from finetune.model import masks_without_host_sync

    masks_without_host_sync()
    model = AutoModelForCausalLM.from_pretrained(assets.llama, attn_implementation="sdpa").eval()
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    batches = {
        "padded": {
            "input_ids": ids,
            "attention_mask": torch.tensor([[1] * 12, [0] * 5 + [1] * 7]),
        },  # left: the mask matters
        "unpadded": {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        "packed": {"input_ids": ids, "position_ids": torch.tensor([list(range(5)) + list(range(7))] * 2)},
    }
    for name, batch in batches.items():
        with torch.no_grad():
            reference = model(**batch).logits
        trained = model(**batch).logits.detach()  # gradients enabled: the workaround's path
        real = batch.get("attention_mask", torch.ones_like(ids)).bool()  # padding's logits are never used
        assert real.any()
        assert torch.allclose(trained[real], reference[real], atol=1e-5), name
