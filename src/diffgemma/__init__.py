"""diffgemma: an inference engine for DiffusionGemma (discrete block diffusion)."""

from .errors import CheckpointError, ConfigError, DiffgemmaError, InputError, SettingsError, TensorError
from .loader import load

__version__ = "0.1.0"

__all__ = ["load", "DiffgemmaError", "CheckpointError", "ConfigError", "TensorError", "SettingsError", "InputError"]
