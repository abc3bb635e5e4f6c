"""The project's own exception types.

Every error a user can cause (a bad path, a malformed checkpoint, a bad setting) is raised as a
DiffgemmaError subclass whose message names the thing (file, tensor, field) and what was expected.
The CLI prints it on one line and exits with status 2.
"""


class DiffgemmaError(Exception):
    """Base class: anything wrong with what the user gave us."""


class CheckpointError(DiffgemmaError):
    """A checkpoint directory, config file or safetensors file is missing or malformed."""


class ConfigError(CheckpointError):
    """config.json / generation_config.json is missing a field or has a value we cannot honour."""


class TensorError(CheckpointError):
    """A tensor is missing from the checkpoint or has the wrong shape."""


class SettingsError(DiffgemmaError):
    """A generation setting (call argument, --set flag, DIFFGEMMA_* variable) is unknown or malformed."""


class InputError(DiffgemmaError):
    """Bad runtime input: wrong ids shape, out-of-vocab ids, cache overflow, ..."""
