"""`python -m diffgemma ...` (and `torchrun --nproc-per-node G -m diffgemma serve ...`): the `diffgemma` command."""

import sys

from .cli import main

sys.exit(main())
