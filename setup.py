"""Everything about the package is in pyproject.toml; this file only adds finetune-launcher.pth to the
installed files (site-packages), for regular and editable installs alike. Python runs that line at start-up,
so the `accelerate launch` (torchrun) process reports a failure finetune named without its own traceback:
see finetune/launcher_report.py, the one place of that workaround."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "finetune-launcher.pth"
# Python executes a .pth line that starts with "import", in every interpreter of the environment (pip, jupyter, ...).
# The hook is needed only in a launcher's (`accelerate launch`, torchrun; read from sys.orig_argv, as sys.argv is not
# set yet), and nothing is imported in any other: a module of the user's named finetune must not run at every start.
# Nor may a failed import print an error at each (a checkout deleted under an editable install), hence the try.
HOOK = """\
import os
for arg in sys.orig_argv:
    if os.path.basename(arg) in ("accelerate", "accelerate-launch", "accelerate.commands.launch", "torchrun",
                                 "torch.distributed.run", "torch.distributed.launch"):
        try:
            from finetune.launcher_report import install_excepthook
            install_excepthook()
        except Exception:
            pass
        break
"""
LINE = f"import sys; exec({HOOK!r})\n"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        # An editable install's wheel is assembled in install_lib; a regular wheel from build_lib.
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(root).mkdir(parents=True, exist_ok=True)
        Path(root, PTH).write_text(LINE)

    def get_outputs(self, include_bytecode=True):
        extra = [] if self.editable_mode else [str(Path(self.build_lib, PTH))]
        return [*super().get_outputs(include_bytecode), *extra]


setup(cmdclass={"build_py": BuildPyWithPth})
