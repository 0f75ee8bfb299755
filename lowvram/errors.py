"""Errors a user can hit, each saying what went wrong and what to do; the CLI prints any
`LowvramError` as one line (exit code 2), anything else is a bug and keeps its traceback."""


class LowvramError(Exception):
    """Base class of every error lowvram raises on purpose."""


class ConfigError(LowvramError):
    """A bad profile or option value, an unknown key, or a missing file."""


class ModelLoadError(LowvramError):
    """A checkpoint is missing, incomplete or corrupt, or cannot be fetched."""


class UnsupportedModelError(LowvramError):
    """An unsupported architecture or quantization format."""


class KernelError(LowvramError):
    """A kernel got shapes, dtypes or strides it does not support."""


class OutOfMemoryError(LowvramError):
    """The model or the requested context does not fit the memory budget."""


class RequestError(LowvramError):
    """A malformed request (bad sampling value, prompt too long, ...)."""
