"""Errors a user can act on. Each message names the flag or file to change."""


class ConfigError(ValueError):
    """A configuration that cannot run (a layout that does not divide, bad sizes, ...)."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or belongs to another model."""


class DataError(RuntimeError):
    """A data path that is missing or a data file that is corrupt."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss stayed non-finite); checkpoints are left as they are."""


class CollectiveError(RuntimeError):
    """A collective failed, timed out, or (``--check-collectives``) did not match.

    ``reporter``: this rank's message is the job's report (print it, then call
    :meth:`reported` so the other ranks exit); otherwise the message is a
    one-line pointer to the rank that has the report.
    """

    def __init__(self, message: str, reporter: bool = True, on_reported=None):
        super().__init__(message)
        self.reporter = reporter
        self._on_reported = on_reported

    def reported(self) -> None:
        """The report is printed: the ranks waiting to exit with a pointer may go."""
        if self._on_reported is not None:
            self._on_reported()


class SwapIOError(OSError):
    """A read or write of an offload swap file failed or came up short.

    The message names the file, the operation, the offset and byte count, and
    the OS error -- or, for a read past the end, where the file ends (a
    truncated swap file). ``errno`` is the OS error number (None for a short
    read); ``path`` the file.
    """

    def __init__(self, message: str, errno: int | None = None, path: str | None = None):
        super().__init__(message)
        self.errno = errno
        self.path = path


class SwapSpaceError(RuntimeError):
    """The nvme tier's swap directory cannot be used: not enough free space (the
    message names the directory, the bytes needed and the bytes free), another job
    holds it, or it cannot be created. Raised before training starts."""


# What a run can end with that the user acts on: the script prints the message, exits 2.
USER_ERRORS = (ConfigError, CheckpointError, DataError, TrainingError, SwapIOError,
               SwapSpaceError)
