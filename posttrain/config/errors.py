"""The user-error channel: every mistake in what a user gives posttrain (config keys and values, data files,
model paths, reward functions, checkpoints to resume from) is a :class:`ConfigError`.

The CLI catches this family only: it prints one message and exits with code 2, before any heavy work where the
check allows it. Every other exception is a bug (ours or a library's) and keeps its traceback.

A ConfigError is a ValueError, so code that validates with ``except ValueError`` keeps working; raise it with a
message that names the key, file or row, the value, the rule and a fix.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user input is wrong: the message names what (key/file/row), its value, the rule and a fix."""


class DataError(ConfigError):
    """A data file or one of its rows is unusable (missing field, bad encoding, empty prompt...)."""


class CheckpointError(ConfigError):
    """A checkpoint (or a file of it) to resume, evaluate or export from is missing, damaged or incompatible."""


class MissingPathError(ConfigError, FileNotFoundError):
    """A file or directory the user named does not exist (also a FileNotFoundError, for callers that expect one)."""
