"""diffgemma: an inference engine for DiffusionGemma (discrete block diffusion)."""

from .errors import CheckpointError, ConfigError, DiffgemmaError, InputError, SettingsError, TensorError
from .generation import GenerationResult, generate, generate_stream
from .loader import load
from .session import Session, chat
from .settings import GenerationSettings

__version__ = "0.1.0"

__all__ = [
    "load", "generate", "generate_stream", "chat", "Session", "GenerationSettings", "GenerationResult",
    "DiffgemmaError", "CheckpointError", "ConfigError", "TensorError", "SettingsError", "InputError",
]
