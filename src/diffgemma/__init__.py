"""diffgemma: an inference engine for DiffusionGemma (discrete block diffusion)."""

import os

# Expandable segments let torch's allocator grow one mapping instead of caching fixed blocks, so a session reserves
# less slack beside what it holds (docs/ARCHITECTURE.md, 'Memory').
# Only a default: a value the user set wins, and it does nothing if CUDA was initialised before diffgemma was imported.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from .errors import CheckpointError, ConfigError, DiffgemmaError, InputError, SettingsError, TensorError
from .batch import generate_batch
from .generation import GenerationResult, generate, generate_stream
from .loader import load
from .model.options import EngineOptions
from .session import Session, chat
from .settings import GenerationSettings

__version__ = "0.1.0"

__all__ = [
    "load", "generate", "generate_stream", "generate_batch", "chat", "Session", "GenerationSettings", "GenerationResult", "EngineOptions",
    "DiffgemmaError", "CheckpointError", "ConfigError", "TensorError", "SettingsError", "InputError",
]
