"""`finetune plot DIR [DIR ...] [-o OUT.png]`: the curves of several runs in one picture."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from finetune.report.curves import build_figure, read_rows, run_label, save_figure


def main(argv: list[str]) -> int:
    """`finetune plot DIR [DIR ...] [-o OUT.png]`: the curves of several runs in one picture."""
    parser = argparse.ArgumentParser(
        prog="finetune plot",
        description="Overlay the curves of several runs (their metrics.jsonl) in one PNG: train and eval loss, "
        "eval metrics, learning rate, tokens/s. Runs are labelled by run_name, else their directory's name.",
    )
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="output_dir of a run (holds metrics.jsonl)")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG to write (default: curves.png)")
    args = parser.parse_args(argv)
    from finetune.config import ConfigError

    missing = [d for d in args.dirs if not (Path(d) / "metrics.jsonl").is_file()]
    if missing:
        problems = [(d, "has no metrics.jsonl; give the output_dir of a run") for d in missing]
        print(ConfigError(problems).render(), file=sys.stderr)
        return 2
    try:
        runs = [(run_label(d), read_rows(d)) for d in args.dirs]
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    labels = [label for label, _ in runs]
    if len(set(labels)) < len(labels):  # same names in different folders: say which folder
        runs = [(f"{Path(os.path.abspath(d)).parent.name}/{label}", rows) for d, (label, rows) in zip(args.dirs, runs)]
    out = save_figure(build_figure(runs), args.output)
    print(f"wrote {os.path.abspath(out)} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0
