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

import pytest
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


@pytest.fixture(scope="module")
def site_packages(tmp_path_factory) -> Path:
    """The wheel, unpacked as pip installs it."""
    tmp = tmp_path_factory.mktemp("install")
    zipfile.ZipFile(build_wheel(tmp)).extractall(tmp / "site-packages")
    return tmp / "site-packages"


def test_plan_finds_the_shipped_configs_in_a_regular_install(assets, site_packages, tmp_path):
    """Installed from its wheel, `finetune plan` plans every shipped config (the ZeRO ones read their DeepSpeed
    JSON) and prints a launch that works from the user's folder: the config's absolute path in site-packages
    (test_memory.py checks the DeepSpeed JSON's beside it)."""
    site = site_packages
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


def test_the_launcher_hook_is_loaded_by_launchers_only(site_packages, tmp_path):
    """finetune-launcher.pth installs launcher_report's hook in a launcher's interpreter (accelerate launch, torchrun)
    and imports nothing in any other. It imported `finetune` in every interpreter of the environment: a user's own
    finetune.py on the path ran at every start (pip, jupyter), and a broken one printed "Error processing line 1 of
    finetune-launcher.pth" and its traceback at each. Python processes the .pth here as at start-up (site.addsitedir,
    under -S so that the environment's own site-packages stay out)."""
    assert (site_packages / "finetune-launcher.pth").is_file()
    probe = (
        f"import site, sys; site.addsitedir({str(site_packages)!r}); print(getattr(sys.excepthook, 'finetune', False))"
    )
    users = tmp_path / "user"
    users.mkdir()

    def shows(*argv: str, pythonpath: Path | None = None) -> tuple[str, str]:
        """What `python -c PROBE ARGV` prints (stdout, stderr) with PYTHONPATH (only) pythonpath."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env |= {"PYTHONPATH": str(pythonpath)} if pythonpath else {}
        cmd = [sys.executable, "-S", "-c", probe, *argv]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        return proc.stdout, proc.stderr

    assert shows("torchrun") == ("True\n", "")  # a launcher (its name in the command line): the hook
    (users / "finetune.py").write_text('print("the user\'s finetune.py ran")\n')
    assert shows(pythonpath=users) == ("False\n", "")  # any other interpreter: not imported
    (users / "finetune.py").write_text("raise RuntimeError('broken')\n")
    assert shows(pythonpath=users) == ("False\n", "")
    assert shows("torchrun", pythonpath=users) == ("False\n", "")  # a launcher: no hook, and no error at start


def test_what_a_build_in_the_checkout_writes_is_ignored():
    """`pip wheel .` or `pip install .` in the checkout writes build/ (and finetune.egg-info/) there: git ignores
    them (build/ showed as untracked)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("build/lib/finetune/cli.py", "finetune.egg-info/PKG-INFO", "dist/finetune-0.1.0.tar.gz"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, f"{path} not ignored"
