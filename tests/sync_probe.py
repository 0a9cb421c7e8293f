"""finetune with every call that makes the host wait for the device counted per optimizer step.

Launched in place of `-m finetune` (tests/test_host_sync.py). On a GPU each of these calls on a device tensor
stalls the host until the device's queue has drained: `item`, `tolist`, `__bool__` (a Python `if` on a tensor),
`__float__`, `__int__`, `__index__`, `__format__`, `cpu`, `nonzero`, `torch.equal`, `torch.allclose`,
`torch.cuda.synchronize`. On these CPU processes nothing stalls, so the calls themselves are what is counted; not
counted: `numpy()` (it refuses a device tensor, so it only ever reads host memory) and `.to("cpu")` (here the
device is the CPU: a move to the device looks the same). Each rank writes
$SYNC_PROBE_DIR/rank<r>.json: {optimizer step: [where each call came from]} for the calls made inside
finetune.loop._optimizer_step (the data, the step and its bookkeeping), and {"outside": [...]} for the rest
(loading, log rows, evaluation, checkpoints).
"""

import functools
import json
import os
import sys
import traceback
from collections import defaultdict

import torch

import finetune.loop as loop

CALLS: dict[int | str, list[str]] = defaultdict(list)
STEP: list[int | str] = ["outside"]  # the optimizer step being run, or "outside" (loading, log rows, evaluation...)


def _where() -> str:
    """The innermost caller outside torch and this file: the code that asked for the value."""
    torch_dir = os.path.dirname(torch.__file__)
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(torch_dir) and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "?"


def _counted(owner, name: str, when=lambda *a, **k: True):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if when(*args, **kwargs):
            CALLS[STEP[0]].append(f"{name}: {_where()}")
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


for _name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__format__", "cpu", "nonzero"):
    _counted(torch.Tensor, _name)
for _name in ("equal", "allclose", "nonzero"):
    _counted(torch, _name)
_counted(torch.cuda, "synchronize")

_step = loop._optimizer_step


def _next(batches):
    """The loader's next batch, not counted: it is built from host tensors (the sampler's order, accelerate's RNG
    sync at an epoch's start) until accelerate moves it to the device, which queues a copy and goes on."""
    outer, STEP[0] = STEP[0], "loader"
    try:
        return next(batches)
    finally:
        STEP[0] = outer


def _optimizer_step(run, state, *args, **kwargs):
    STEP[0] = state.step + 1
    try:
        return _step(run, state, *args, **kwargs)
    finally:
        STEP[0] = "outside"


loop._optimizer_step = _optimizer_step
loop.next = _next  # the loop's next(batches) finds this module global before the builtin


if __name__ == "__main__":
    from finetune.cli import run_cli

    sys.argv[0] = "finetune"
    code = run_cli()  # finetune.cli.main, which ends with os._exit: write the counts first
    with open(os.path.join(os.environ["SYNC_PROBE_DIR"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(CALLS, f, indent=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
