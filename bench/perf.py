"""The performance suite: runs the benchmarks under bench/ one after another and prints one table.

    .venv/bin/python bench/perf.py                                  # the six below (~15 min on 2 idle CPU cores)
    .venv/bin/python bench/perf.py --only throughput,packing        # some of them
    .venv/bin/python bench/perf.py --only grid                      # the issue-18 grid (~25 min; bench/grid.py)
    .venv/bin/python bench/perf.py --quick                          # smoke run: small models, 1 repeat

Each benchmark is its own file and also runs alone (`python bench/throughput.py --quick`); all of them launch,
measure, compare and report through bench/harness.py. See bench/README.md for what each row means.
Writes bench/results/perf.json and perf.png (perf_quick.* under --quick).
"""

from __future__ import annotations

import argparse
import sys

import balance
import ddp
import grid
import harness
import launch
import packing
import throughput
import tokenization
import zero_memory

SUITE = [throughput, packing, ddp, launch, balance, tokenization]  # the default: `./run.sh bench`
MODULES = {m.NAME: m for m in [*SUITE, grid, zero_memory]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        default=",".join(m.NAME for m in SUITE),
        help="comma-separated subset of: " + ", ".join(MODULES) + " (default: %(default)s)",
    )
    harness.add_common_arguments(parser)
    for m in MODULES.values():
        if hasattr(m, "add_arguments"):
            m.add_arguments(parser)
    opts = parser.parse_args()
    names = [n.strip() for n in opts.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(MODULES)}")
    harness.run_suite([MODULES[n] for n in names], opts, "perf_quick" if opts.quick else "perf")


if __name__ == "__main__":
    sys.exit(main())
