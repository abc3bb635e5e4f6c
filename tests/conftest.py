import os
import sys

# Make tests/ importable (shared helpers such as tiny_checkpoints) without packaging it.
sys.path.insert(0, os.path.dirname(__file__))
