"""`python -m finetune`, `accelerate launch -m finetune` and `accelerate launch finetune` all start here.

`accelerate launch finetune ...` runs this file as a script, with the finetune/ directory itself
first on sys.path: replace that entry by its parent, so `import finetune` finds this package and
our module names (config, data, ...) cannot shadow other top-level modules.
"""

import os
import sys

if not __package__:
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from finetune.cli import main  # noqa: E402

main()
