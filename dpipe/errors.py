"""User-facing errors.

A `UserError` is a mistake the user can fix (a bad path, key or value). The CLI prints its
message without a traceback and exits with status 2; anything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """A problem with the user's input. The message must say what to change."""


class ConfigError(UserError):
    """The composed run config is invalid."""


class DataError(UserError):
    """A dataset file or folder cannot be used."""


class ModelLoadError(UserError):
    """Model weights cannot be found or read."""


class TrainingDiverged(UserError):
    """The loss or the gradients stopped being finite; the message says what to try."""
