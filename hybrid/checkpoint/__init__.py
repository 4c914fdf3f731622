"""Sharded, atomic, layout-independent checkpoints (see :mod:`hybrid.checkpoint.save`)."""

from hybrid.checkpoint.files import find_checkpoint, read_metadata, resolve_checkpoint
from hybrid.checkpoint.load import load_checkpoint
from hybrid.checkpoint.reader import RangeReader
from hybrid.checkpoint.reshard import iter_full_params, merged_state
from hybrid.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "read_metadata",
           "resolve_checkpoint", "RangeReader", "iter_full_params", "merged_state"]
