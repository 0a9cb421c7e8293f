"""profile_steps: exactly the optimizer steps asked for run under torch's profiler, on every rank, and the run's
losses and weights do not change."""

from __future__ import annotations

import json
from collections import defaultdict

from conftest import base_args, finetune, max_weight_diff

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}


def self_times(events: list[dict]) -> dict[str, float]:
    """Seconds each operator name spent in itself (its duration less its children's), from a Chrome trace's
    complete events, nested per thread by their start and duration."""
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            by_thread[(e["pid"], e["tid"])].append(e)
    own: dict[str, float] = defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []  # open events, with the time their children took
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                done = stack.pop()
                own[done["name"]] += (done["dur"] - done["children"]) / 1e6
            if stack:
                stack[-1]["children"] += e["dur"]
            stack.append({**e, "children": 0.0})
        for done in stack:
            own[done["name"]] += (done["dur"] - done["children"]) / 1e6
    return own


def test_profile_steps_profile_those_steps_on_every_rank_and_change_nothing(assets, tmp_path):
    args = base_args(assets.llama, assets.text, "--max_steps", "5", "--seed", "3")
    plain = finetune(tmp_path / "plain", *args, launcher="ddp")
    profiled = finetune(tmp_path / "profiled", *args, "--profile_steps", "2-3", launcher="ddp")
    assert len(plain.losses()) == 5
    assert profiled.losses() == plain.losses()
    assert max_weight_diff(plain.output_dir / "final", profiled.output_dir / "final") == 0.0
    assert not (plain.output_dir / "profile").exists()
    assert profiled.output.count("profile of steps 2-3 (rank 0)") == 1  # the main process's summary, once
    for rank in (0, 1):
        folder = profiled.output_dir / "profile"
        events = json.loads((folder / f"profile_{rank}.json").read_text())["traceEvents"]
        steps = [e for e in events if str(e.get("name", "")).startswith("optimizer step ")]
        assert sorted(e["name"] for e in steps) == ["optimizer step 2", "optimizer step 3"], rank
        own = self_times(events)
        assert own, rank
        matmul = sum(s for name, s in own.items() if name in MATMULS)
        assert matmul > 0, sorted(own)
        summary = json.loads((folder / f"summary_{rank}.json").read_text())
        assert summary["steps"] == [2, 3] and summary["rank"] == rank
        # the window is the two steps: their own spans fill most of it, and fit in it
        spans = sum(e["dur"] for e in steps) / 1e6
        assert 0.5 * summary["wall_s"] <= spans <= summary["wall_s"] * 1.01 + 1e-3, (spans, summary["wall_s"])
        # the summary's matmul time is the matmuls' own time in the trace (computed here from the events)
        assert abs(summary["by_kind_s"]["matmul"] - matmul) <= 0.02 * matmul + 1e-4, (summary["by_kind_s"], matmul)
        assert summary["busy_s"] <= summary["wall_s"]
        assert "aten::" in (folder / f"ops_{rank}.txt").read_text()
