import os
import sys

import torch

# Make tests/ importable (shared helpers such as tiny_checkpoints) without packaging it, and the repo root for the
# benchmarks' fixtures (bench.fixtures: random full-size weights).
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU, Triton kernels run in its interpreter. This must be set before the first
# `import triton` anywhere in the session, so it lives here rather than in one test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test shapes are tiny: intra-op threads only spin, and on a busy 2-core machine that made some modules
# many times slower. One thread for the whole session (subprocess tests set their own).
torch.set_num_threads(1)
