"""What a person looks at around a run; nothing here touches the training itself.

trackers.py  report_to through accelerate; the whole effective run config, flattened, as the tracked config
curves.py    output_dir/curves.png from metrics.jsonl (at each eval and at the end)
card.py      final/README.md: Hub metadata, how to load it, data, hyperparameters, parallelism, results
hub.py       push_to_hub: final/ (with merged/) uploaded by the main process at the end
outcome.py   what the run did, read back from metrics.jsonl
summary.py   the end of a run: curves, card, Hub, and one block in the log
"""

from finetune.report.card import card_text
from finetune.report.curves import CURVES_EVERY_S, build_figure, read_rows, run_label, write_curves
from finetune.report.hub import PushFailed, hub_preflight, push
from finetune.report.outcome import RunFacts
from finetune.report.summary import finish
from finetune.report.trackers import flatten, init_trackers, tracked_config, tracker_problems

__all__ = [
    "CURVES_EVERY_S",
    "PushFailed",
    "RunFacts",
    "build_figure",
    "card_text",
    "finish",
    "flatten",
    "hub_preflight",
    "init_trackers",
    "push",
    "read_rows",
    "run_label",
    "tracked_config",
    "tracker_problems",
    "write_curves",
]
