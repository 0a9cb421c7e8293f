"""Everything about the package is in pyproject.toml; this file only adds finetune-launcher.pth to the
installed files (site-packages), for regular and editable installs alike. Python runs that line at start-up,
so the `accelerate launch` (torchrun) process reports a failure finetune named without its own traceback:
see finetune/launcher_report.py, the one place of that workaround."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "finetune-launcher.pth"
# Python executes a .pth line that starts with "import"; a checkout deleted under an editable install must not
# print an error at every interpreter start, hence the try.
LINE = (
    'import sys; exec("try:\\n from finetune.launcher_report import install_excepthook\\nexcept ImportError:\\n pass'
    '\\nelse:\\n install_excepthook()")\n'
)


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
