"""Sharded, atomic, layout-independent checkpoints (see :mod:`hybrid.checkpoint.save`)."""

from hybrid.checkpoint.files import (find_checkpoint, read_metadata, read_rank_files,
                                     resolve_checkpoint)
from hybrid.checkpoint.load import load_checkpoint
from hybrid.checkpoint.reshard import FullParams
from hybrid.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "read_metadata",
           "read_rank_files", "resolve_checkpoint", "FullParams"]
