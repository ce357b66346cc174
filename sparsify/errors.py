"""User-facing errors. The CLI prints their message and exits non-zero, without a traceback;
anything else escaping is a bug and keeps its traceback."""
import signal


class SparsifyError(Exception):
    """A problem with the user's input or environment, stated so that the user can fix it."""


class UnsupportedModelError(SparsifyError):
    """The model's architecture has no gated feed-forward block that sparsify knows."""


class SourceError(SparsifyError):
    """The model source (Hub id, folder, 'demo') cannot be loaded."""


class DataError(SparsifyError):
    """Training or evaluation data is missing, empty, of an unknown format, or too short."""


class ConfigError(SparsifyError):
    """An option or recipe value is impossible (negative L1, zero steps, sequence too long, ...)."""


class OutputError(SparsifyError):
    """The output folder cannot be written (exists and is not empty without --overwrite, ...)."""


class MissingDependencyError(SparsifyError):
    """An optional package that an option needs is not installed (the tracker of --report-to)."""


class Interrupted(SparsifyError):
    """A run stopped by a signal (Ctrl-C's SIGINT; in training also SIGTERM): what was kept, and how to go on. The
    CLI exits with 128 + `signum`, as a shell reports a command that the signal stopped."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.signum = signum
