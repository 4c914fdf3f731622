"""Errors a user can act on. Each message names the flag or file to change."""


class ConfigError(ValueError):
    """A configuration that cannot run (a layout that does not divide, bad sizes, ...)."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or belongs to another model."""


class DataError(RuntimeError):
    """A data path that is missing or a data file that is corrupt."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. the loss stayed non-finite); checkpoints are left as they are."""
