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
