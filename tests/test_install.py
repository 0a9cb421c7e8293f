"""A regular (non-editable) install: what the wheel holds, and that the commands find it from any folder.

The tests run from the checkout (an editable install, or PYTHONPATH), where accelerate_configs/ and ds_configs/
are beside the package; a user's `pip install finetune` has only site-packages. The wheel is built from a copy of
the sources (a build in the checkout would leave build/ there) and unpacked as pip would install it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import ROOT

SOURCES = ("finetune", "accelerate_configs", "ds_configs", "pyproject.toml", "setup.py", "README.md")


def build_wheel(tmp: Path) -> Path:
    """The wheel of this checkout (setuptools' PEP 517 backend, as pip runs it), built from a copy of it."""
    src = tmp / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(tmp / 'dist')!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "dist" / proc.stdout.strip().splitlines()[-1]


def test_plan_finds_the_shipped_configs_in_a_regular_install(assets, tmp_path):
    """Installed from its wheel, `finetune plan` plans every shipped config (the ZeRO ones read their DeepSpeed
    JSON) and prints a launch that works from the user's folder: the config's absolute path in site-packages
    (test_memory.py checks the DeepSpeed JSON's beside it)."""
    site = tmp_path / "site-packages"
    zipfile.ZipFile(build_wheel(tmp_path)).extractall(site)
    user = tmp_path / "somewhere"
    user.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # this package, not the checkout's
    plan = ["plan", "--model", assets.llama, "--max_seq_length", "64", "--per_device_train_batch_size", "4"]
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", *plan], cwd=user, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = re.findall(r"^(zero\d\w*|ddp|fsdp2\w*) +2 +\d", proc.stdout, re.MULTILINE)
    assert {"ddp", "zero2", "zero3_offload", "fsdp2"} <= set(rows), proc.stdout
    launch = re.search(r"accelerate launch --config_file (\S+) ", proc.stdout)  # the wheel's package ran
    assert launch and Path(launch[1]).is_file() and Path(launch[1]).is_relative_to(site), proc.stdout
