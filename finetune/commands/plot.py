"""`finetune plot DIR [DIR ...] [-o OUT.png]`: the curves of one run, or of several runs in one picture."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from finetune.config import ConfigError
from finetune.report.curves import CURVES, build_figure, drawn_by_finetune, read_rows, run_label, save_figure


def main(argv: list[str]) -> int:
    """`finetune plot DIR [DIR ...] [-o OUT.png]`: the curves of one run, or of several runs in one picture."""
    parser = argparse.ArgumentParser(
        prog="finetune plot",
        description="Draw the curves of a run (its metrics.jsonl) into one PNG, or overlay several runs: train and "
        "eval loss, eval metrics, learning rate, tokens/s. Runs are labelled by run_name, else their directory's "
        "name. A file already at the output is replaced only when finetune drew it (a previous plot, a run's "
        "curves.png).",
    )
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="output_dir of a run (holds metrics.jsonl)")
    parser.add_argument(
        "-o",
        "--output",
        help=f"PNG to write (default: DIR/{CURVES} for one DIR, the run's own curves; ./{CURVES} for several)",
    )
    args = parser.parse_args(argv)
    try:
        out = output_path(args.dirs, args.output)
        runs = [(run_label(d), read_rows(d)) for d in args.dirs]
    except ConfigError as e:
        print(e.render("what finetune plot was given"), file=sys.stderr)
        return 2
    labels = [label for label, _ in runs]
    if len(set(labels)) < len(labels):  # same names in different folders: say which folder
        runs = [(f"{Path(os.path.abspath(d)).parent.name}/{label}", rows) for d, (label, rows) in zip(args.dirs, runs)]
    out = save_figure(build_figure(runs), out)
    print(f"wrote {os.path.abspath(out)} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


def output_path(dirs: list[str], output: str | None) -> str:
    """Where the picture goes; a ConfigError for a run directory without metrics.jsonl and for an output that is not
    a PNG name, has no folder, or would replace a file finetune did not draw."""
    missing = [(d, "has no metrics.jsonl; give the output_dir of a run") for d in dirs
               if not (Path(d) / "metrics.jsonl").is_file()]  # fmt: skip
    if missing:
        raise ConfigError(missing)
    out = output or (os.path.join(dirs[0], CURVES) if len(dirs) == 1 else CURVES)
    why = None
    if not out.lower().endswith(".png"):
        why = "the picture is a PNG; give a name ending in .png"
    elif not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        why = "its folder does not exist; create it or choose another -o"
    elif os.path.lexists(out) and not drawn_by_finetune(out):
        why = "exists and is not a picture finetune drew; choose another -o, or remove or move that file"
    if why:
        raise ConfigError([("--output", f"{out!r}: {why}")])
    return out
