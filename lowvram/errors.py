"""Errors a user can hit. Each message says what went wrong and what to do.

The CLI turns any `LowvramError` into one readable line on stderr and exit code 2;
anything else is a bug and keeps its traceback.
"""


class LowvramError(Exception):
    """Base class of every error lowvram raises on purpose."""


class ConfigError(LowvramError):
    """A profile or option has a bad value, an unknown key, or a file is missing."""


class ModelLoadError(LowvramError):
    """A checkpoint is missing, incomplete or corrupt, or cannot be fetched."""


class UnsupportedModelError(LowvramError):
    """The checkpoint's architecture or quantization format is not supported."""


class KernelError(LowvramError):
    """A kernel was called with shapes, dtypes or strides it does not support."""


class OutOfMemoryError(LowvramError):
    """The model or the requested context does not fit the memory budget."""


class RequestError(LowvramError):
    """A request is malformed (bad sampling value, prompt too long, ...)."""
