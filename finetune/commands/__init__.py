"""The subcommands beside training, each a `main(argv) -> exit code` that finetune.cli dispatches to; training never
imports them.

    check.py   `finetune check`: preflight of a cluster, launched like the run
    parity.py  `finetune parity`: the same run under several Accelerate configs, compared
    plan.py    `finetune plan`: memory per rank under each config, and which one fits
    plot.py    `finetune plot`: several runs' curves in one PNG
    merge.py   `finetune merge`: adapter + base -> one model
"""
